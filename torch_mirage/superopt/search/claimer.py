"""The search claimer: regions around a matmul, and reduction chains, run the μGraph that the search finds.

For each free matmul node and each ``scaled_dot_product_attention`` (last first) the claimer grows a region: producers whose every result is
read only inside the region (elementwise, reductions, layout: a norm before the matmul, a transposed
weight), and, while the region has one result read by free elementwise or layout nodes, those readers
(a gate after the matmul, the view of a flattened matmul back to (batch, seq, n)). Then each free
reduction node (last first) anchors a reduction chain the same way without matmuls (nTrans'
``rms(α·(rms(H)+X)+X)``, a norm with its residual add); the nodes of a chain whose search found
nothing anchor no second search; a chain also grows forward from a row statistic (a mean, a variance) to
the ops that apply it (LayerNorm's centring and scaling). The region's reference program
(:func:`.reference.reference_of`) is searched (:func:`.driver.search`, seeds off, the ``search_budget_s``
budget); a verified μGraph becomes the region's plan (the build stage compiles it). Where the search finds
nothing within its budget for a region around a matmul, the region's weight-streaming seed
(:func:`..gemv_claim.seed_claim`, verified the same way) is claimed instead, so that a norm before the matmul is
not left to a second, smaller cut of its own. A region that does not lower, or for which neither is found, is left
to the next claimers. Behind the ``search`` knob.
"""
from __future__ import annotations

import functools
import logging
from typing import Sequence

from .driver import search
from .reference import is_attention

from ...capture.ops import OpKind
from ...context import CompileContext
from ...partition.region import Claim, Decline, Outcome, Reason, is_convex
from ..cut import CHAIN, DTYPES, GROW, MAX_NODES, computes, grow, lowered_reference, reference_kernel
from ..gemv_claim import seed_claim
from ..ugraph_plan import Alternative, UGraphPlan, random_inputs

log = logging.getLogger("torch_mirage")



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
        anchors = [n for n in last_first if n.op.kind is OpKind.MATMUL or is_attention(n)] + \
            [n for n in last_first if n.op.kind is OpKind.REDUCTION]
        searched: set = set()       # nodes of reduction chains already searched
        for anchor in anchors:
            if id(anchor) not in free_ids or id(anchor) in searched:
                continue
            chain = anchor.op.kind is OpKind.REDUCTION
            nodes = sorted(grow(graph, anchor, free_ids, self.max_nodes, CHAIN if chain else GROW, counts=computes),
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

        ref = lowered_reference(nodes, graph, ctx)
        if isinstance(ref, Decline):
            log.debug("torch_mirage: search claimer: region at %s: %s", nodes[-1].target_name, ref.detail)
            return ref
        metas = [v.meta for v in ref.inputs]
        budget = self.budget_s if self.budget_s is not None else ctx.config.search_budget_s
        specs = [(tuple(m.shape), DTYPES[m.dtype]) for m in metas]
        with unset_fake_temporarily():      # the search runs real tensors (probe, verifier)
            result = search(ref.graph, specs, budget_s=budget, cache=ctx.cache, workers=ctx.config.search_workers,
                            verify_kwargs=dict(error_bound=ctx.config.verify_error_bound,
                                               trials=ctx.config.verify_trials))
            if result.best is None:
                log.info("torch_mirage: μGraph search found nothing for %d nodes (%s)", len(nodes), result.reason)
                seeded = seed_claim(graph, nodes, ref, ctx) if any(op.name == "matmul" for op in ref.graph.ops) \
                    else None
                if isinstance(seeded, Claim):   # the region whole, not cut smaller: its weight-streaming seed
                    seeded.info["search"] = f"found nothing ({result.reason}); the weight-streaming seed verified"
                    return seeded
                why = result.reason + (f"; {seeded.detail}" if seeded is not None else "")
                return Decline(nodes, Reason.NOT_FOUND, why)
        s = result.stats
        info = {"source": result.source, "generated": s.generated, "pruned": s.pruned,
                "candidates": s.candidates, "rejected_by_probe": s.rejected_by_probe,
                "rejected_by_verifier": s.rejected_by_verifier, "verified": s.verified,
                "search_s": round(s.seconds, 2)}
        detail = f"searched μGraph, {s.depth} block ops, {s.seconds:.2f} s"
        plan = UGraphPlan([Alternative("searched", result.best, detail, {"ugraph": str(result.best)})],
                          functools.partial(random_inputs, metas),
                          functools.partial(reference_kernel, nodes, graph, ref),
                          what=f"searched μGraph of {len(nodes)} ops")
        return Claim(list(nodes), plan, detail=detail, info=info)
