"""The search claimer: regions around a matmul run the μGraph that the search finds for them.

For each free matmul node (last first) the claimer grows a region: producers whose every result is
read only inside the region (elementwise, reductions, layout: a norm before the matmul, a transposed
weight), and, while the region has one result read by free elementwise or layout nodes, those readers
(a gate after the matmul, the view of a flattened matmul back to (batch, seq, n)). The region's reference program (:func:`.reference.reference_of`) is searched
(:func:`.driver.search`, seeds off, the ``search_budget_s`` budget); a verified μGraph is compiled
(``compile_ugraph``) and becomes the region's kernel. A region that does not lower, or for which the
search finds nothing within its budget, is left to the next claimers. Behind the ``search`` knob.
"""
from __future__ import annotations

import logging
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
        for anchor in reversed(list(free)):
            if id(anchor) not in free_ids or anchor.op.kind is not OpKind.MATMUL:
                continue
            nodes = sorted(grow(graph, anchor, free_ids, self.max_nodes), key=lambda n: order[id(n)])
            if not is_convex(graph, nodes):
                outcomes.append(Decline(nodes, Reason.NOT_CONVEX, f"the region grown around {anchor.name}"))
                continue
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
        pos = {id(v): i for i, v in enumerate(inputs_of(nodes))}
        in_order = [pos[id(v)] for v in ref.inputs]
        out_pos = {id(v): i for i, v in enumerate(ref.outputs)}
        outputs = outputs_of(nodes, graph)
        out_order = [out_pos[id(v)] for v in outputs]
        shapes = [tuple(v.meta.shape) for v in outputs]

        def kernel(*ins):
            outs = compiled(*[ins[i] for i in in_order])
            return tuple(outs[j].reshape(sh) for j, sh in zip(out_order, shapes))

        info = {"source": result.source, "generated": s.generated, "pruned": s.pruned,
                "candidates": s.candidates, "rejected_by_probe": s.rejected_by_probe,
                "rejected_by_verifier": s.rejected_by_verifier, "verified": s.verified,
                "search_s": round(s.seconds, 2), "ugraph_hash": result.best.hash()[:16],
                "ugraph": str(result.best)}
        return Claim(list(nodes), result.best, kernel,
                     detail=f"searched μGraph, {s.depth} block ops, {s.seconds:.2f} s", info=info)


def grow(graph, anchor, free_ids: set, max_nodes: int = MAX_NODES) -> list:
    """The region around ``anchor``: see the module docstring."""
    inside = {id(anchor): anchor}
    returned = {id(v) for v in graph.output_values}
    changed = True
    while changed and len(inside) < max_nodes:
        changed = False
        for n in list(inside.values()):
            for v in n.inputs:
                p = getattr(v, "producer", None)
                if p is None or id(p) in inside or id(p) not in free_ids or p.op.kind not in GROW:
                    continue
                if all(id(u) in inside for w in p.outputs for u in w.users) and \
                        not any(id(w) in returned for w in p.outputs):
                    inside[id(p)] = p
                    changed = True
        outs = [v for n in inside.values() for v in n.outputs
                if id(v) in returned or any(id(u) not in inside for u in v.users)]
        if len(outs) == 1 and id(outs[0]) not in returned:
            users = [u for u in outs[0].users if id(u) not in inside]
            if users and all(id(u) in free_ids and u.op.kind in FORWARD for u in users):
                for u in users:
                    inside[id(u)] = u
                changed = True
    return list(inside.values())
