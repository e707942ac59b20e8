"""The partition stage's contract: what a claimer returns (:class:`Claim`, :class:`Decline`) and the
:class:`Region` s the pipeline makes of it.

A claiming pass (a :class:`Claimer`) looks at the graph's free nodes and returns, for each group of nodes it
considered, either a :class:`Claim` — the nodes and the plan it made for them: data the build stage
(:mod:`torch_mirage.build`) turns into a kernel, a :class:`~..codegen.stitch_plan.StitchPlan` or a
:class:`~..superopt.ugraph_plan.UGraphPlan`; a claimer compiles and times nothing — or a :class:`Decline`: the
nodes it passed over, a :class:`Reason` and a detail in words. The pipeline turns claims into
``compiled_by="mirage"`` regions (their ``kernel`` filled in by the build stage), the nodes nobody claimed into
``"inductor"`` (or ``"eager"``) regions, and hands the declines to the report as they are (typed: nothing
downstream reads a reason out of text).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from ..capture.ir import Graph, Node, Value
from ..context import CompileContext
from ..report import Reason

__all__ = ["Claim", "Claimer", "Decline", "Outcome", "Reason", "Region", "claims", "declines", "inputs_of", "is_convex", "outputs_of"]


class _Nodes:
    """A set of IR nodes in graph order (``nodes``): its ops, the values it reads and the values it gives."""
    nodes: list[Node]

    def __post_init__(self) -> None:
        self._ids = {id(n) for n in self.nodes}

    def __contains__(self, node: Node) -> bool:
        return id(node) in self._ids

    @property
    def ops(self) -> list[str]:
        return [n.target_name for n in self.nodes]

    @property
    def inputs(self) -> list[Value]:
        return inputs_of(self.nodes)

    def outputs(self, graph: Graph) -> list[Value]:
        return outputs_of(self.nodes, graph)


def inputs_of(nodes: Sequence[Node]) -> list[Value]:
    """Values ``nodes`` read that they do not produce, in first-use order."""
    inside = {id(n) for n in nodes}
    seen: dict[int, Value] = {}
    for n in nodes:
        for v in n.inputs:
            if (v.producer is None or id(v.producer) not in inside) and id(v) not in seen:
                seen[id(v)] = v
    return list(seen.values())


def outputs_of(nodes: Sequence[Node], graph: Graph) -> list[Value]:
    """Values ``nodes`` produce that something outside them (or the graph output) reads."""
    inside = {id(n) for n in nodes}
    graph_outs = {id(v) for v in graph.output_values}
    return [v for n in nodes for v in n.outputs
            if id(v) in graph_outs or any(id(u) not in inside for u in v.users)]


@dataclass(eq=False)
class Claim(_Nodes):
    """Nodes a claimer takes, and the plan the build stage makes their kernel from."""
    nodes: list[Node]
    plan: Any                          # StitchPlan, UGraphPlan: data, nothing compiled
    detail: str = ""                   # for the report: what is built ("stitch: rows=...", "μGraph lora(...)")
    info: dict[str, Any] = field(default_factory=dict)   # the claimer's facts for the report
    hint: Any = None                   # JSON: what the claimer's ``replan`` needs to plan these nodes again


@dataclass(eq=False)
class Decline:
    """Nodes a claimer considered and passed over, and why; ``claimer`` is filled in by the pipeline."""
    nodes: list[Node]
    reason: Reason
    detail: str = ""
    claimer: str = ""


Outcome = Claim | Decline


def claims(outcomes: Sequence[Outcome]) -> list[Claim]:
    return [o for o in outcomes if isinstance(o, Claim)]


def declines(outcomes: Sequence[Outcome]) -> list[Decline]:
    return [o for o in outcomes if isinstance(o, Decline)]


@dataclass(eq=False)
class Region(_Nodes):
    """A connected set of nodes one compiler runs, with the reason why (the partition stage's output)."""
    nodes: list[Node]
    compiled_by: str                   # "mirage" | "inductor" | "eager"
    reason: Reason
    detail: str = ""
    claimer: str = ""
    kernel: Callable[..., tuple] | None = None   # mirage regions, once built: (*inputs) -> tuple(outputs)
    plan: Any = None                   # the claimer's plan (StitchPlan, UGraphPlan) the kernel is built from
    info: dict[str, Any] = field(default_factory=dict)  # claimer's facts for the report
    declines: list[Decline] = field(default_factory=list)   # fallback regions: what claimers passed over here

    @classmethod
    def of_claim(cls, claim: Claim, claimer: str) -> Region:
        return cls(claim.nodes, "mirage", Reason.CLAIMED, claim.detail, claimer, plan=claim.plan, info=dict(claim.info))


class Claimer(Protocol):
    """A pass that claims the nodes it can plan a faster kernel for than the fallback's, and says why it passes
    over others. A claimer may also offer ``replan(graph, nodes, hint, free, ctx) -> Outcome``: the claim of
    exactly ``nodes`` (with the ``hint`` its claim carried), without the exploration that found them — what a
    warm compile replays from the graph's :class:`~.record.PartitionRecord`."""
    name: str

    def claim(self, graph: Graph, free: Sequence[Node], ctx: CompileContext) -> list[Outcome]: ...


def is_convex(graph: Graph, nodes: Sequence[Node]) -> bool:
    """No path leaves the set and comes back: the set can run as one kernel. Only the nodes between the set's first
    and last (in the graph's topological order) can lie on such a path, so only they are walked: a claimer asks
    this of every candidate cut, and walking the whole graph each time made the partition stage grow with the
    square of a model's layers."""
    inside = {id(n) for n in nodes}
    if not inside:
        return True
    position = graph.positions()
    span = [position[i] for i in inside if i in position]
    walk = graph.nodes[min(span):max(span) + 1] if len(span) == len(inside) else graph.nodes
    # nodes reachable from the set through at least one node outside it
    tainted: set[int] = set()
    for n in walk:
        from_outside_path = any(
            v.producer is not None and (id(v.producer) in tainted or
                                        (id(v.producer) in inside and id(n) not in inside))
            for v in n.inputs)
        if from_outside_path:
            if id(n) in inside:
                return False
            tainted.add(id(n))
    return True
