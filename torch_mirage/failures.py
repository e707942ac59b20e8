"""Failures inside mirage's own stages: which stage raised, and one warning line per kind of failure.

A stage runs under ``with stage("lower"):``. An exception leaving it carries the stage's name (the innermost
stage wins), so whoever catches it — the pipeline's fallback, or a claimer that leaves one region to Inductor —
can say where it happened; a new stage gets this by using the same wrapper.

Failures that change what runs during one graph's compile go to that compile's :class:`FailureLog`, which
logs one warning per kind of failure (stage, error type, message with its numbers masked) with a count when it
is flushed at the end of the compile: 80 identical regions failing the same way print one line, not 80.
"""
from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

log = logging.getLogger("torch_mirage")

STRICT_HINT = "Set MIRAGE_STRICT=1 to raise instead."
_STAGE_ATTR = "mirage_stage"


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Run a block as the pipeline stage ``name``: an exception leaving it is tagged with the name."""
    try:
        yield
    except Exception as e:
        if getattr(e, _STAGE_ATTR, None) is None:
            try:
                setattr(e, _STAGE_ATTR, name)
            except AttributeError:   # an exception type without a __dict__: its stage stays unknown
                pass
        raise


def stage_of(error: BaseException, default: str = "unknown") -> str:
    """The innermost stage ``error`` left, or ``default``."""
    return getattr(error, _STAGE_ATTR, None) or default


def describe_error(error: BaseException | str, limit: int = 300) -> str:
    """``Type: message`` (or a problem described in words) on one line, cut to ``limit`` characters."""
    text = " ".join(str(error).split())
    if isinstance(error, BaseException):
        text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def nodes_summary(nodes: Sequence[Any], limit: int = 4) -> str:
    """IR nodes with their input shapes and dtypes (``Node.describe``), the first ``limit`` of them."""
    parts = [n.describe() for n in nodes[:limit]]
    more = len(nodes) - len(parts)
    return "[" + ", ".join(parts) + (f", +{more} more" if more > 0 else "") + "]"


def fx_graph_summary(gm: Any, meta_key: str = "val", limit: int = 6) -> str:
    """An FX graph for a warning: its first ``limit`` ops with result dtypes and shapes, then its tensor inputs
    (``meta_key``: ``"val"`` in an ATen graph, ``"example_value"`` in a Dynamo graph)."""
    def typed(n: Any) -> str:
        val = n.meta.get(meta_key)
        return f" {str(val.dtype).replace('torch.', '')}{list(val.shape)}" if hasattr(val, "dtype") else ""

    ops = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    def name(n: Any) -> str:   # ATen ops by their full name (aten.amax.default), Python callables by theirs
        return str(n.target) if hasattr(n.target, "_schema") else str(getattr(n.target, "__name__", n.target))

    parts = [name(n) + typed(n) for n in ops[:limit]]
    more = f", +{len(ops) - limit} more" if len(ops) > limit else ""
    inputs = [typed(n).strip() for n in gm.graph.nodes if n.op == "placeholder" and typed(n)]
    shown = ", ".join(inputs[:limit]) + (f", +{len(inputs) - limit} more" if len(inputs) > limit else "")
    return "[" + ", ".join(parts) + more + "]" + (f" on inputs {shown}" if inputs else "")


def _shape_of(message: str) -> str:
    """The message with numbers masked, so failures that differ only in sizes group together."""
    return re.sub(r"\d+", "#", message)


@dataclass
class Failure:
    stage: str
    where: str      # the op or region: ops, shapes, dtypes
    error: str      # ``Type: message``
    outcome: str    # what runs instead, e.g. "the region runs through Inductor"


class FailureLog:
    """Failures of one graph's compile, grouped by kind; :meth:`flush` logs one warning line per kind."""

    def __init__(self, context: str):
        self.context = context      # e.g. "inference graph 0"
        self._groups: dict[tuple[str, str, str], list] = {}

    def add(self, stage_name: str, where: str, error: BaseException | str, outcome: str) -> None:
        kind = type(error).__name__ if isinstance(error, BaseException) else ""
        key = (stage_name, kind, _shape_of(str(error)))
        group = self._groups.setdefault(key, [Failure(stage_name, where, describe_error(error), outcome), 0])
        group[1] += 1

    def __len__(self) -> int:
        return sum(count for _, count in self._groups.values())

    def flush(self) -> None:
        for first, count in self._groups.values():
            log.warning("%s", format_failure(first, self.context, count))
        self._groups.clear()


def format_failure(f: Failure, context: str, count: int = 1) -> str:
    """The one warning line for ``count`` failures like ``f``."""
    times = f"for {f.where}" if count == 1 else f"{count} times (first for {f.where})"
    return (f"torch_mirage: the {f.stage} stage failed {times} in {context} ({f.error}); {f.outcome}. "
            f"{STRICT_HINT}")


def note(ctx: Any, stage_name: str, where: str, error: BaseException | str, outcome: str) -> None:
    """Record a failure that changes what runs in the compile ``ctx`` belongs to (its ``failures`` log), or
    log it at once where there is none (a claimer called outside the pipeline)."""
    failures = getattr(ctx, "failures", None)
    if failures is not None:
        failures.add(stage_name, where, error, outcome)
    else:
        log.warning("%s", format_failure(Failure(stage_name, where, describe_error(error), outcome), "a compile"))
