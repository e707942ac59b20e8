"""Regions: connected sets of IR nodes that one compiler takes, with the reason why.

A claiming pass (a :class:`Claimer`) looks at the graph and returns the
:class:`Region` s it will compile itself (``compiled_by="mirage"``), each with a
``kernel``: a callable from the region's input tensors to its output tensors.
Everything left unclaimed becomes ``"inductor"`` (or ``"eager"``) regions.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from ..capture.ir import Graph, Node, Value


class Reason(enum.Enum):
    CLAIMED = "claimed by a mirage pass"
    NOT_CLAIMED = "no mirage pass claims these ops"
    OPAQUE_OP = "holds ops outside mirage's IR"
    COMPUTE_BOUND = "compute-bound: left to the library call"
    DYNAMIC_SHAPE = "dynamic shapes: mirage compiles static shapes only"
    UNSUPPORTED_DEVICE = "not on a device mirage generates kernels for"
    UNSUPPORTED_DTYPE = "dtype mirage does not generate kernels for"
    SLOWER_THAN_INDUCTOR = "mirage's kernel measured slower than Inductor's"
    COMPILE_ERROR = "mirage failed to compile it; fell back"
    DISABLED = "disabled by configuration"


@dataclass(eq=False)
class Region:
    nodes: list[Node]
    compiled_by: str                   # "mirage" | "inductor" | "eager"
    reason: Reason
    detail: str = ""
    claimer: str = ""
    kernel: Callable[..., tuple] | None = None   # mirage regions: (*inputs) -> tuple(outputs)
    plan: Any = None                   # the claimer's plan (StitchPlan, μGraph) the kernel was built from
    info: dict[str, Any] = field(default_factory=dict)  # claimer's facts for the report

    def __post_init__(self) -> None:
        ids = {id(n) for n in self.nodes}
        self._ids = ids

    def __contains__(self, node: Node) -> bool:
        return id(node) in self._ids

    @property
    def ops(self) -> list[str]:
        return [n.target_name for n in self.nodes]

    @property
    def inputs(self) -> list[Value]:
        """Values the region reads that it does not produce, in first-use order."""
        seen: dict[int, Value] = {}
        for n in self.nodes:
            for v in n.inputs:
                if (v.producer is None or v.producer not in self) and id(v) not in seen:
                    seen[id(v)] = v
        return list(seen.values())

    def outputs(self, graph: Graph) -> list[Value]:
        """Values the region produces that something outside it (or the graph output) reads."""
        graph_outs = {id(v) for v in graph.output_values}
        return [v for n in self.nodes for v in n.outputs
                if id(v) in graph_outs or any(u not in self for u in v.users)]


class Claimer(Protocol):
    """A pass that claims the regions it compiles better than the fallback."""
    name: str

    def claim(self, graph: Graph, free: Sequence[Node], ctx: Any) -> list[Region]: ...


def is_convex(graph: Graph, nodes: Sequence[Node]) -> bool:
    """No path leaves the set and comes back: the set can run as one kernel."""
    inside = {id(n) for n in nodes}
    # nodes reachable from the set through at least one node outside it
    tainted: set[int] = set()
    for n in graph.nodes:
        from_outside_path = any(
            v.producer is not None and (id(v.producer) in tainted or
                                        (id(v.producer) in inside and id(n) not in inside))
            for v in n.inputs)
        if from_outside_path:
            if id(n) in inside:
                return False
            tainted.add(id(n))
    return True
