"""A graph of symbolic sizes compiled again at each concrete size it is called at (``MIRAGE_STATIC_SIZES``).

Under torch.compile's default ``dynamic=None`` a second prompt length makes Dynamo recompile into one graph of
symbolic sizes. Mirage claims nothing whose sizes are symbolic (its μGraphs are built for fixed shapes), so that
graph ran Inductor's kernels only — a serving user lost mirage's prefill from the second prompt length on.
:class:`StaticSizes` keeps the symbolic compile for sizes met once and for what lies past its limit; a size (the
values of the graph's symbolic inputs: scalars, and the shapes and strides of tensors of symbolic size) that comes
back — :data:`CALLS_BEFORE_COMPILE` calls — gets the Dynamo graph compiled once more on that call's own inputs,
whose sizes are concrete — the whole pipeline: mirage's kernels, the timing against Inductor, the CUDA graph — and
that compile serves the size from then on. A size met once runs the symbolic graph: a KV cache that grows by a
token per decode step (transformers' DynamicCache) never meets a size twice, and compiling each step would cost
seconds a step for nothing. Nor are the sizes of a graph that met more than :data:`SPREAD_SIZES` sizes
before the first came back: that is such a cache called again (a second ``generate`` at the same prompt length
meets each step's size a second time, once a call), where a static compile of seconds per size would pay for
one call a ``generate`` (on the H200 a second DynamicCache ``generate`` of an HF llama took 54 s this way,
2026-12-02), or serving at more prompt lengths than a few static compiles cover. A size whose
static compile fails runs the symbolic graph (logged once). Only calls without autograd, outside a caller's
CUDA-graph capture, are compiled again (others run the symbolic graph)."""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import torch

log = logging.getLogger("torch_mirage")

CALLS_BEFORE_COMPILE = 2   # a size's call at which its static compile is made: sizes that come back
SEEN_SIZES = 4096          # sizes whose calls are counted (a longer history is forgotten and counted again)
SPREAD_SIZES = 16          # sizes met before the first comes back past which no size is compiled again


def size_key(args: Sequence[Any], positions: Sequence[int]) -> tuple:
    """The size of a call: each symbolic input's value — an int, or a tensor's shape and strides."""
    return tuple(tuple(a.shape) + tuple(a.stride()) if isinstance(a, torch.Tensor) else int(a)
                 for a in (args[i] for i in positions))


class StaticSizes:
    """``symbolic`` (the compiled graph of symbolic sizes) with each of the first ``limit`` sizes it is called at
    again served by ``compile_at(args)``: a static compile of the same graph on a call's inputs. ``positions``: the
    inputs that carry the sizes (:func:`size_key`); ``describe(key)``: the size in words, for the log;
    ``strict``: a failed static compile raises instead of running the symbolic graph."""

    def __init__(self, compile_at: Callable[[list], Callable], symbolic: Callable, positions: Sequence[int],
                 limit: int, describe: Callable[[tuple], str] = repr, strict: bool = False):
        self.compile_at, self.symbolic = compile_at, symbolic
        self.positions, self.limit, self.describe, self.strict = tuple(positions), limit, describe, strict
        self.compiled: dict[tuple, Callable] = {}
        self.failed: set[tuple] = set()
        self.calls: dict[tuple, int] = {}        # calls of each size not compiled
        self.spread: int | None = None            # sizes met when the first came back
        self._said_full = False

    def __call__(self, *args: Any) -> Any:
        key = size_key(args, self.positions)
        fn = self.compiled.get(key)
        if fn is None:
            fn = self._compile(key, args)
        return fn(*args)          # Dynamo's calling convention: a backend's compile takes its inputs unboxed

    def _compile(self, key: tuple, args: Sequence[Any]) -> Callable:
        """The static compile for ``key``, or the symbolic graph where none is made (a size met once, past the
        limit, a failed compile, a call that records gradients)."""
        if key in self.failed or (torch.is_grad_enabled() and any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in args)):
            return self.symbolic
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return self.symbolic      # inside the caller's CUDA-graph capture: no compile (its timing) there
        if len(self.calls) >= SEEN_SIZES:
            self.calls.clear()
        self.calls[key] = calls = self.calls.get(key, 0) + 1
        if calls < CALLS_BEFORE_COMPILE:
            return self.symbolic
        if self.spread is None:
            self.spread = len(self.calls)
            if self.spread > SPREAD_SIZES:
                log.info("torch_mirage: a graph of symbolic sizes met %d sizes before %s came back (a KV cache "
                         "growing a token a step, as transformers' DynamicCache, called again): no size of it is "
                         "compiled again (MIRAGE_STATIC_SIZES), each would cost seconds for a call or so a "
                         "generate", self.spread, self.describe(key))
        if self.spread > SPREAD_SIZES:
            return self.symbolic
        if len(self.compiled) >= self.limit:
            if not self._said_full:
                self._said_full = True
                log.info("torch_mirage: a graph of symbolic sizes met more than %d sizes that came back "
                         "(MIRAGE_STATIC_SIZES): %s and later new sizes run the symbolic graph", self.limit,
                         self.describe(key))
            return self.symbolic
        start = time.perf_counter()
        try:
            fn = self.compile_at(list(args))
        except Exception as e:
            if self.strict:
                raise
            self.failed.add(key)
            log.warning("torch_mirage: the static compile of a graph of symbolic sizes at %s failed (%s: %s); "
                        "that size runs the symbolic graph", self.describe(key), type(e).__name__, e)
            return self.symbolic
        self.compiled[key] = fn
        self.calls.pop(key, None)
        log.info("torch_mirage: graph of symbolic sizes compiled again at %s in %.1f s (%d of MIRAGE_STATIC_SIZES=%d)",
                 self.describe(key), time.perf_counter() - start, len(self.compiled), self.limit)
        return fn
