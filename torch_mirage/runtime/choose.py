"""The graph-level guarantee: a compiled graph is never slower than Inductor's version of the whole graph.

When mirage claimed regions of a CUDA graph, both assemblies — mirage's kernels with Inductor for the rest,
and Inductor for everything — are compiled. On the first call, with the caller's real inputs, each is timed
inside a CUDA graph and the faster one is kept for every later call (and for the CUDA-graph capture).
Graphs with random ops are not timed (re-running them would advance the caller's RNG); mirage's assembly
is kept there.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from .measure import cuda_graph_time_us

log = logging.getLogger("torch_mirage")


class FasterOf:
    """Boxed callable choosing between named boxed candidates on its first real call."""

    def __init__(self, candidates: dict[str, Callable[[list], Any]], on_choice: Callable[[str, dict], None]):
        self.candidates = candidates
        self.on_choice = on_choice
        self.choice: str | None = None
        self._boxed_call = True

    def _time(self, fn: Callable[[list], Any], args: list) -> float:
        return cuda_graph_time_us(lambda *a: fn(list(a)), [args], replays=10, repeats=3)

    def __call__(self, args: list) -> Any:
        if self.choice is None:
            times: dict[str, float] = {}
            for name, fn in self.candidates.items():
                try:
                    times[name] = self._time(fn, list(args))
                except Exception as e:   # a candidate that cannot be timed (e.g. not capturable) is not chosen
                    log.info("torch_mirage: timing the %s assembly failed (%s: %s)", name, type(e).__name__, e)
            first = next(iter(self.candidates))
            self.choice = min(times, key=times.get) if times else first
            self.on_choice(self.choice, times)
        return self.candidates[self.choice](args)


def is_timeable(gm: torch.fx.GraphModule, example_inputs: list) -> bool:
    """CUDA tensors, static shapes, no random ops: the graph may be run a few extra times on real inputs."""
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    if not tensors or any(t.device.type != "cuda" for t in tensors):
        return False
    if any(isinstance(x, torch.SymInt) for x in example_inputs):
        return False
    return not any(n.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())
                   for n in gm.graph.nodes)
