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

__all__ = ["Claim", "Claimer", "ClaimedRegions", "Decline", "Outcome", "Reason", "Region", "claims", "declines", "inputs_of",
           "is_convex", "outputs_of"]


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
    start, end = (min(span), max(span)) if len(span) == len(inside) else (0, len(graph.nodes) - 1)
    return not _comes_back(graph, inside, start, end)


def _comes_back(graph: Graph, inside: set[int], start: int, end: int, held: "ClaimedRegions | None" = None) -> bool:
    """Whether a path from the nodes ``inside`` through a node outside them reaches them again, walking positions
    ``start``..``end``. With ``held``, reaching any node of a claimed region reaches all of them (it runs as a
    whole): the walk is then repeated from the earliest member so reached, until no region is newly reached."""
    position = graph.positions()
    tainted: set[int] = set()       # nodes reachable from the set through at least one node outside it
    while True:
        reached: set[int] = set()
        for n in graph.nodes[start:end + 1]:
            if id(n) in tainted:
                continue
            if any(v.producer is not None and (id(v.producer) in tainted or
                                               (id(v.producer) in inside and id(n) not in inside))
                   for v in n.inputs):
                if id(n) in inside:
                    return True
                tainted.add(id(n))
                if held is not None and id(n) in held.group:
                    reached.add(held.group[id(n)])
        again = [m for g in reached for m in held.members[g] if id(m) not in tainted] if reached else []
        if not again:
            return False
        tainted.update(id(m) for m in again)
        start = min(position[id(m)] for m in again)


class ClaimedRegions:
    """The regions claimed so far in a partition, each of which will run as one kernel: a new claim is admitted
    only where it is convex with each of them contracted to one node (:meth:`admits`). Two claims can each be
    convex and still need each other first — claim A reads a value of claim B, and B a value of A, through
    parts of each that do not depend on one another (a backward graph's stitch region holding two independent
    pieces of a norm's gradient, one feeding a GEMV region and one fed by it) —, and then no order runs them."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.group: dict[int, int] = {}                  # id(node) -> its region's index
        self.members: list[list[Node]] = []
        self.spans: list[tuple[int, int]] = []           # each region's first and last position in the graph

    def add(self, nodes: Sequence[Node]) -> None:
        position = self.graph.positions()
        at = [position[id(n)] for n in nodes]
        for n in nodes:
            self.group[id(n)] = len(self.members)
        self.members.append(list(nodes))
        self.spans.append((min(at), max(at)))

    def admits(self, nodes: Sequence[Node]) -> bool:
        """Whether no path leaves ``nodes`` and comes back, where a path that reaches any node of a claimed region
        goes on from all of them (the region runs as a whole, after everything it reads)."""
        inside = {id(n) for n in nodes}
        if not inside or not self.members:
            return True
        position = self.graph.positions()
        at = [position[id(n)] for n in nodes]
        start, end = min(at), max(at)
        # a path comes back to an earlier position only by way of a region, from a member after the span to one
        # inside it: the walk goes as far as the last member of any region reaching into it
        grown = True
        while grown:
            grown = False
            for first, last in self.spans:
                if first <= end < last:
                    end, grown = last, True
        return not _comes_back(self.graph, inside, start, end, self)
