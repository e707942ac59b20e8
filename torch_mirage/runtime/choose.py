"""The graph-level guarantee: a compiled graph is never slower than what ``backend="inductor"`` makes of it.

When mirage claimed regions of an inference graph, the backend also hands the Dynamo graph to Inductor's own
``compile_fx``. On the first call, with the caller's real inputs, :class:`FasterOf` times both as the caller
will run them (each a replay of its own CUDA graph where it can be captured; inside one graph when the caller
captures its own), through :func:`~torch_mirage.tune.tune`, in the order A B B A so that clock and temperature drift favour neither, and keeps the
faster one for every later call, dropping the other. Tensors the graph writes (inputs, or tensors on modules
and other objects) are saved first and copied back before every timing run and after the last, so each run
sees the caller's state and the state changes once, by the real call. Graphs that write state we cannot
name, and graphs with random ops (re-running them would advance the caller's RNG), are not timed: the backend
keeps Inductor's compile there, never a version it could not time.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Sequence

import torch

from .cudagraph import draws_random_numbers  # noqa: F401  (the rule lives with the CUDA-graph rules)
from ..timing import cuda_graph_timing, fastest_per_half, plain_timing, pooled_median, timing_input_sets
from ..tune import tune

log = logging.getLogger("torch_mirage")

_HALF_MS = 10.0   # GPU time per candidate in each half of the A B B A schedule
_HOST_SAMPLES = 5   # samples per half of a candidate launched from Python (each about _HALF_MS / 5 of calls)


class FasterOf:
    """``fn(*args)`` choosing between named candidates (each ``fn(*args)``) on its first real call.

    ``written(args)`` lists the tensors a call writes to (inputs, or module state the graph holds): they are
    saved first and restored before every timing run and after the last, so the caller's state changes once,
    by the real call.

    ``in_callers_graph``: the caller captures our function in its own CUDA graph (``MIRAGE_CUDA_GRAPHS=0``), so
    candidates are timed inside a graph — GPU time, what that graph will replay, several calls per replay on
    copies of the arguments that together exceed L2 (:func:`timing_input_sets`) when no state has to be
    restored; a candidate that cannot be captured is not chosen. Otherwise each candidate is timed launched from
    Python, as the caller will run it (a replay of its own CUDA graph where it has one): CPU launch cost counts
    there, as it does for the user, and each candidate's time is the mean of its two halves' fastest samples
    (five each, :func:`~torch_mirage.timing.fastest_per_half`: host noise only adds), not their median.

    ``cache`` / ``key``: the times are stored there (as every tuned choice's are), so that a later compile of the
    same graph and versions can read the verdict back without compiling or timing the loser
    (:func:`~torch_mirage.backend.whole_graph_key`).
    """

    def __init__(self, candidates: dict[str, Callable[..., Any]], on_choice: Callable[[str, dict], None],
                 written: Callable[[Sequence[Any]], list[torch.Tensor]] = lambda args: [],
                 in_callers_graph: bool = False, cache: Any = None, key: str | None = None,
                 stage: Callable[[str], Any] = lambda name: contextlib.nullcontext()):
        self.candidates = candidates
        self.stage = stage                     # the report's stage: the first call's timing, its time and memory
        self.on_choice = on_choice
        self.written = written
        self.in_callers_graph = in_callers_graph
        self.cache, self.key = cache, key      # where the times are kept (:func:`~torch_mirage.tune.tune`'s cache)
        self.choice: str | None = None

    def _time_all(self, args: Sequence[Any]) -> dict[str, float]:
        try:
            state = [(t, t.clone()) for t in self.written(args)]
        except torch.cuda.OutOfMemoryError:
            log.info("torch_mirage: no memory to save the state the graph writes; not timing it")
            return {}

        def restore() -> None:
            with torch.no_grad():
                for t, saved in state:
                    t.copy_(saved)

        def from_saved_state(fn: Callable[..., Any]) -> Callable[..., Any]:
            # every run starts from the caller's state (a run may read what the last one wrote: a KV-cache
            # position counter, say); the copies are the same work for every candidate
            def run(*a: Any) -> Any:
                restore()
                return fn(*a)
            return run

        # Inside the caller's graph our call sits among other work: several calls per replay (on copies of the
        # arguments where they are not state to restore), so one replay's launch gap is not most of what is
        # timed, and a pass over the copies does not find them in L2.
        sets = [list(args)]
        if self.in_callers_graph and not state:
            sets = timing_input_sets(args, torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size)

        if self.in_callers_graph:   # GPU time: the median; launched from Python: each half's least disturbed
            timed = lambda run: cuda_graph_timing(run, sets, target_ms=_HALF_MS, repeats=2)   # noqa: E731
            estimate = pooled_median
        else:
            timed = lambda run: plain_timing(run, args, target_ms=_HALF_MS / _HOST_SAMPLES,   # noqa: E731
                                             repeats=_HOST_SAMPLES)
            estimate = fastest_per_half

        def time_half(name: str, _: Any) -> list[float]:
            return timed(from_saved_state(self.candidates[name]) if state else self.candidates[name])["samples"]

        try:   # a candidate that cannot be timed (not capturable, say) is not chosen
            return tune(list(self.candidates), time_half, label="version", cache=self.cache, key=self.key,
                        estimate=estimate).times
        finally:
            restore()

    def __call__(self, *args: Any) -> Any:
        if self.choice is None:
            with self.stage("first-call timing"):
                times = self._time_all(args)
            first = next(iter(self.candidates))
            self.choice = min(times, key=times.get) if times else first
            self.candidates = {self.choice: self.candidates[self.choice]}   # the others' memory is freed
            self.on_choice(self.choice, times)
        return self.candidates[self.choice](*args)


def is_timeable(gm: torch.fx.GraphModule, example_inputs: list) -> bool:
    """CUDA tensors, no random ops: the graph may be run a few extra times on real inputs. A graph of symbolic
    sizes is timed at its first call's sizes (each version in its CUDA graph of that size), and that choice holds
    for every size: a decode step under a cache that grows a token a step (transformers' DynamicCache) costs
    about the same at each length, and its static regions — the projections — are most of it."""
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    if not tensors or any(t.device.type != "cuda" for t in tensors):
        return False
    return not any(draws_random_numbers(n) for n in gm.graph.nodes)


def mutated_inputs(gm: torch.fx.GraphModule) -> tuple[int, ...]:
    """Positions of the placeholders an ATen graph writes to, directly or through views of them."""
    index = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}

    def base(node: Any) -> int | None:
        while isinstance(node, torch.fx.Node) and node not in index:
            schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
            if schema is None or not schema.arguments or not node.args or schema.arguments[0].alias_info is None:
                return None   # a fresh tensor, not a view of an input
            node = node.args[0]
        return index.get(node)

    out = set()
    for n in gm.graph.nodes:
        schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
        if schema is None:
            continue
        for arg, spec in zip(n.args, schema.arguments):
            if spec.alias_info is not None and spec.alias_info.is_write and (i := base(arg)) is not None:
                out.add(i)
    return tuple(sorted(out))


def declared_mutations(num_inputs: int) -> set[int] | None:
    """The inputs AOTAutograd says the graph being compiled mutates (data or metadata, applied in the graph or
    after it), or ``None`` when that is not known for this graph's inputs."""
    ctx = torch._guards.TracingContext.try_get()
    infos = getattr(getattr(ctx, "fw_metadata", None), "input_info", None)
    if infos is None or len(infos) != num_inputs:
        return None
    return {i for i, info in enumerate(infos) if info.mutates_data or info.mutates_metadata}


def writes_in_place(gm: torch.fx.GraphModule) -> bool:
    """Whether a Dynamo graph has an in-place op (``x.add_(...)``, ``x[i] = v``, ``out=``): it writes to state."""
    import operator

    in_place_operators = {operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul,
                          operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul,
                          operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift}
    for n in gm.graph.nodes:
        if n.op == "call_method" and n.target.endswith("_") and not n.target.endswith("__"):
            return True
        if n.op == "call_function":
            name = getattr(n.target, "__name__", "")
            if n.target in in_place_operators:
                return True
            # ``operator.and_`` / ``or_`` / ``not_`` are not in place: the trailing ``_`` means in place only for
            # torch's own functions (``torch.relu_``, ``Tensor.add_``)
            if getattr(n.target, "__module__", None) in ("_operator", "operator"):
                continue
            if "out" in n.kwargs or (name.endswith("_") and not name.endswith("__")):
                return True
            schema = getattr(n.target, "_schema", None)
            if schema is not None and schema.is_mutable:
                return True
    return False
