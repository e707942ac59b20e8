"""The search claimer: regions around a matmul, and reduction chains, run the μGraph that the search finds.

For each free matmul node (last first) the claimer grows a region: producers whose every result is
read only inside the region (elementwise, reductions, layout: a norm before the matmul, a transposed
weight), and, while the region has one result read by free elementwise or layout nodes, those readers
(a gate after the matmul, the view of a flattened matmul back to (batch, seq, n)). Then each free
reduction node (last first) anchors a reduction chain the same way without matmuls (nTrans'
``rms(α·(rms(H)+X)+X)``, a norm with its residual add); the nodes of a chain whose search found
nothing anchor no second search; a chain also grows forward from a row statistic (a mean, a variance) to
the ops that apply it (LayerNorm's centring and scaling). The region's reference program
(:func:`.reference.reference_of`) is searched (:func:`.driver.search`, seeds off, the ``search_budget_s``
budget); a verified μGraph is compiled (``compile_ugraph``) and becomes the region's kernel. A region that does not lower, or for which the
search finds nothing within its budget, is left to the next claimers. Behind the ``search`` knob.
"""
from __future__ import annotations

import logging
import math
from typing import Sequence

import torch
from .reference import Decline as NotLowered, reference_of
from .driver import search
from ..compile import compile_ugraph

from ...capture.ops import OpKind
from ...context import CompileContext, Target
from ...failures import describe_error
from ...partition.region import Claim, Decline, Outcome, Reason, inputs_of, is_convex, outputs_of
from ...timing import random_like

log = logging.getLogger("torch_mirage")

GROW = {OpKind.ELEMENTWISE, OpKind.REDUCTION, OpKind.LAYOUT, OpKind.MATMUL}
CHAIN = GROW - {OpKind.MATMUL}                     # a reduction chain: row reductions and elementwise ops
FORWARD = {OpKind.ELEMENTWISE, OpKind.LAYOUT}     # a gate after the matmul; the view back to (b, s, n)
MAX_NODES = 32
DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class SearchClaimer:
    name = "ugraph-search"

    def __init__(self, budget_s: float | None = None, max_nodes: int = MAX_NODES):
        self.budget_s = budget_s
        self.max_nodes = max_nodes

    def claim(self, graph, free: Sequence, ctx: CompileContext) -> list[Outcome]:
        free_ids = {id(n) for n in free}
        order = {id(n): i for i, n in enumerate(graph.nodes)}
        outcomes: list[Outcome] = []
        last_first = list(reversed(list(free)))
        anchors = [n for n in last_first if n.op.kind is OpKind.MATMUL] + \
            [n for n in last_first if n.op.kind is OpKind.REDUCTION]
        searched: set = set()       # nodes of reduction chains already searched
        for anchor in anchors:
            if id(anchor) not in free_ids or id(anchor) in searched:
                continue
            chain = anchor.op.kind is OpKind.REDUCTION
            nodes = sorted(grow(graph, anchor, free_ids, self.max_nodes, CHAIN if chain else GROW),
                           key=lambda n: order[id(n)])
            if not is_convex(graph, nodes):
                outcomes.append(Decline(nodes, Reason.NOT_CONVEX, f"the region grown around {anchor.name}"))
                continue
            if chain:
                searched |= {id(n) for n in nodes}
            outcome = self._claim(graph, nodes, ctx)
            if isinstance(outcome, Claim):
                free_ids -= {id(n) for n in nodes}
            outcomes.append(outcome)
        return outcomes

    def _claim(self, graph, nodes: list, ctx: CompileContext) -> Outcome:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        ref = reference_of(nodes, graph)
        if isinstance(ref, NotLowered):
            log.debug("torch_mirage: search claimer: region at %s not lowered: %s", nodes[-1].target_name, ref)
            return Decline(nodes, Reason.NOT_LOWERED, str(ref))
        metas = [v.meta for v in ref.inputs]
        if any(m.dtype not in DTYPES for m in metas) or \
                (ctx.target is Target.INTERPRETER and any(m.dtype == torch.bfloat16 for m in metas)):
            return Decline(nodes, Reason.UNSUPPORTED_DTYPE, ", ".join(sorted({str(m.dtype) for m in metas})))
        if not ctx.target.runs_on(metas[0].device.type):
            return Decline(nodes, Reason.UNSUPPORTED_DEVICE, str(metas[0].device))
        budget = self.budget_s if self.budget_s is not None else ctx.config.search_budget_s
        specs = [(tuple(m.shape), DTYPES[m.dtype]) for m in metas]
        with unset_fake_temporarily():      # the search runs real tensors (probe, verifier)
            result = search(ref.graph, specs, budget_s=budget, cache=ctx.cache)
            if result.best is None:
                log.info("torch_mirage: μGraph search found nothing for %d nodes (%s)", len(nodes), result.reason)
                return Decline(nodes, Reason.NOT_FOUND, result.reason)
            examples = [random_like(m) for m in metas]
            try:
                compiled = compile_ugraph(result.best, examples, cache=ctx.cache)
            except Exception as e:   # a searched μGraph that does not compile: the region goes on
                log.info("torch_mirage: searched μGraph does not compile (%s: %s)", type(e).__name__, e)
                return Decline(nodes, Reason.COMPILE_ERROR, describe_error(e))
        s = result.stats
        info = {"source": result.source, "generated": s.generated, "pruned": s.pruned,
                "candidates": s.candidates, "rejected_by_probe": s.rejected_by_probe,
                "rejected_by_verifier": s.rejected_by_verifier, "verified": s.verified,
                "search_s": round(s.seconds, 2), "ugraph_hash": result.best.hash()[:16],
                "ugraph": str(result.best)}
        return Claim(list(nodes), result.best, reference_kernel(nodes, graph, ref, compiled),
                     detail=f"searched μGraph, {s.depth} block ops, {s.seconds:.2f} s", info=info)


def reference_kernel(nodes: list, graph, ref, compiled):
    """The region's kernel from a compiled μGraph whose inputs and outputs are ``ref``'s (a
    :class:`~.reference.Reference` of ``nodes``): region inputs reordered to ``ref.inputs``, its outputs to the
    region's, each in its graph shape."""
    pos = {id(v): i for i, v in enumerate(inputs_of(nodes))}
    in_order = [pos[id(v)] for v in ref.inputs]
    out_pos = {id(v): i for i, v in enumerate(ref.outputs)}
    outputs = outputs_of(nodes, graph)
    out_order = [out_pos[id(v)] for v in outputs]
    shapes = [tuple(v.meta.shape) for v in outputs]

    def kernel(*ins):
        outs = compiled(*[ins[i] for i in in_order])
        return tuple(outs[j].reshape(sh) for j, sh in zip(out_order, shapes))

    return kernel


def grow(graph, anchor, free_ids: set, max_nodes: int = MAX_NODES, kinds=GROW, forward: bool = True) -> list:
    """The region around ``anchor``, taking producers of the op ``kinds``: see the module docstring.
    ``forward`` False: producers only (no readers of the region's result)."""
    inside = {id(anchor): anchor}
    returned = {id(v) for v in graph.output_values}
    rows = max((_numel(v) for v in anchor.inputs if getattr(v, "is_tensor", False)), default=0)
    changed = True
    while changed and len(inside) < max_nodes:
        changed = False
        for n in list(inside.values()):
            for v in n.inputs:
                p = getattr(v, "producer", None)
                if p is None or id(p) in inside or id(p) not in free_ids or p.op.kind not in kinds:
                    continue
                if all(id(u) in inside for w in p.outputs for u in w.users) and \
                        not any(id(w) in returned for w in p.outputs):
                    inside[id(p)] = p
                    changed = True
        outs = [v for n in inside.values() for v in n.outputs
                if id(v) in returned or any(id(u) not in inside for u in v.users)]
        ahead = outs if len(outs) == 1 and forward else []
        if kinds is CHAIN:      # a row statistic (mean, variance) goes on to where it is applied to the rows
            ahead = ahead + [v for v in outs if _numel(v) < rows and v not in ahead]
        for v in ahead:
            users = [u for u in v.users if id(u) not in inside]
            if id(v) not in returned and users and all(id(u) in free_ids and u.op.kind in FORWARD for u in users):
                for u in users:
                    inside[id(u)] = u
                changed = True
    return list(inside.values())


def _numel(v) -> int:
    return math.prod(v.meta.shape) if v.is_tensor else 0
