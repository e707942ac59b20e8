"""The looped schedule of a long row: which reductions accumulate in which chunked pass over the row.

This module owns :class:`Accumulation` and :func:`loop_schedule`: every reduction of a looped (or split) row in the
earliest pass its input allows, ``amax`` fused with ``sum(exp(x - amax))`` by the online-softmax recurrence and
``var_mean`` / ``var`` accumulated by fp32 Welford, so softmax and layer norm read a long row twice and write it
once; the statistics each accumulation keeps (:data:`STATS`, one fp32 workspace slot each when a row is split:
:func:`stat_slots`) and their identities. The partitioner reads :func:`schedule_facts` for the thread mapping, the
emitter (:mod:`.stitch_emit`) writes the passes, the launcher (:mod:`.stitch_launch`) sizes the workspace.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..capture.ir import Node
from ..capture.ops import OpKind
from .stitch_ops import reduction_spec
from .stitch_plan import StitchPlan


@dataclass(frozen=True)
class Accumulation:
    """One per-lane accumulation of a looped row: the reductions it serves and the pass that reads for it.

    ``online`` accumulates ``amax(x)`` and ``sum(exp(x - amax(x)))`` together (the online-softmax recurrence:
    running max, running sum rescaled when the max grows); ``welford`` accumulates count / mean / M2 for
    ``var_mean`` and ``var`` in one pass (fp32 Welford, lanes combined with Chan's formula).
    """
    kind: str                  # "sum" | "max" | "min" | "online" | "welford"
    node: Node                 # the reduction (for "online": the amax)
    partner: Node | None       # "online": the sum of exp(x - amax(x))
    pass_no: int               # 1-based chunked pass over the row


# the per-lane statistics of each accumulation kind and their identities (masked lanes, empty splits)
STATS = {"sum": ("sum",), "max": ("max", "nan"), "min": ("min", "nan"), "online": ("max", "nan", "sum"),
         "welford": ("cnt", "mean", "m2"), "any": ("any",)}
IDENTITY = {"sum": "0.0", "max": 'float("-inf")', "min": 'float("inf")', "nan": "0.0", "cnt": "0.0", "mean": "0.0",
            "m2": "0.0", "any": "0.0"}
ROW_STATS = {("online", "max")}   # statistics kept per row ([BLOCK_M, 1]) rather than per lane
FUSION_NAME = {"online": "online softmax", "welford": "Welford"}
_KIND = {"sum": "sum", "mean": "sum", "amax": "max", "amin": "min", "var_mean": "welford", "var": "welford",
         "any": "any"}   # "any": 1.0 where some element of the row is true (a bool reduction kept as fp32)


def _online_partner(amax: Node, inside: set[int]) -> Node | None:
    """The region's ``sum(exp(x - amax(x)))`` over the same ``x``, which the online recurrence accumulates too."""
    x, m = amax.inputs[0], amax.outputs[0]
    for sub in m.users:
        if id(sub) not in inside or sub.op.name != "sub" or len(sub.args) < 2 \
                or sub.args[0] is not x or sub.args[1] is not m:
            continue
        for ex in sub.outputs[0].users:
            if id(ex) not in inside or ex.op.name != "exp" or ex.args[0] is not sub.outputs[0]:
                continue
            for s in ex.outputs[0].users:
                if id(s) in inside and s.kind is OpKind.REDUCTION and reduction_spec(s) is not None \
                        and reduction_spec(s).kind == "sum":
                    return s
    return None


def loop_schedule(compute: Sequence[Node]) -> list[Accumulation]:
    """The accumulations of a looped row, each in the earliest pass its input allows (fusions applied)."""
    inside = {id(n) for n in compute}
    lvl: dict[int, int] = {}
    fused: dict[int, Accumulation] = {}
    out: list[Accumulation] = []
    for node in compute:
        base = max((lvl.get(id(v), 0) for v in node.inputs), default=0)
        if node.kind is not OpKind.REDUCTION:
            lvl.update((id(v), base) for v in node.outputs)
        elif id(node) in fused:
            lvl.update((id(v), fused[id(node)].pass_no) for v in node.outputs)
        else:
            kind = _KIND[reduction_spec(node).kind]
            partner = _online_partner(node, inside) if kind == "max" else None
            acc = Accumulation("online" if partner is not None else kind, node, partner, base + 1)
            if partner is not None:
                fused[id(partner)] = acc
            out.append(acc)
            lvl.update((id(v), base + 1) for v in node.outputs)
    return out


def schedule_facts(compute: Sequence[Node]) -> tuple[int, tuple[str, ...]]:
    """(reduction passes over a looped row, names of the fused accumulations) for the thread mapping."""
    sched = loop_schedule(compute)
    names = tuple(dict.fromkeys(FUSION_NAME[a.kind] for a in sched if a.kind in FUSION_NAME))
    return max((a.pass_no for a in sched), default=0), names


def stat_slots(plan: StitchPlan) -> list[tuple[int, str]]:
    """(accumulation index, statistic) per fp32 workspace slot of a split row's partials."""
    return [(i, k) for i, a in enumerate(loop_schedule(plan.compute)) for k in STATS[a.kind]]
