"""The search claimer: regions around a matmul, and reduction chains, run the μGraph that the search finds.

For each free matmul node and each ``scaled_dot_product_attention`` (last first) the claimer grows a region: producers whose every result is
read only inside the region (elementwise, reductions, layout: a norm before the matmul, a transposed
weight), and, while the region has one result read by free elementwise or layout nodes, those readers
(a gate after the matmul, the view of a flattened matmul back to (batch, seq, n)). Then each free
reduction node (last first) anchors a reduction chain the same way without matmuls (nTrans'
``rms(α·(rms(H)+X)+X)``, a norm with its residual add); the nodes of a chain whose search found
nothing anchor no second search; a chain also grows forward from a row statistic (a mean, a variance) to
the ops that apply it (LayerNorm's centring and scaling). The region's reference program
(:func:`.reference.reference_of`) is searched (:func:`.driver.search`, the ``search_budget_s`` budget): first
the claimer's library seeds (:mod:`.seeds`: the hand-built μGraphs instantiated at the region's dims and
verified against its program), then the enumeration; a verified μGraph becomes the region's plan (the build
stage compiles it; a seed runs as the library's own μGraph, its inputs bound by :func:`.seeds.seed_kernel`).
A claimer with ``enumerates=False`` tries its seeds only and says nothing of a region none fits (the pipeline
runs such passes ahead of the attention and weight-streaming claimers, where today's claims need them: QK-norm
attention before attention takes the attention alone; LoRA and nTrans before a matmul's cut could take part of
them). Where the search finds
nothing within its budget for a region around a matmul, the region's weight-streaming seed
(:func:`..gemv_claim.seed_claim`, verified the same way) is claimed instead, so that a norm before the matmul is
not left to a second, smaller cut of its own. A region that is one matmul with elementwise ops around it
(:func:`gemm_with_elementwise`) is not enumerated: its seed, else Inductor's GEMM template; nor is a region of
compute-bound matmuls none of which reads another's result (:func:`compute_bound_gemms`: a prefill's projections
with their norm and gate). A region that does not
lower, or for which neither is found, is left to the next claimers. The enumeration is behind the ``search`` knob, the seeds behind ``ugraph_library``.
"""
from __future__ import annotations

import functools
import itertools
import logging
import time
from typing import Sequence

from .driver import search
from .reference import is_attention

from ...analysis.cost import skinny_matmul
from ...cache import cache_key, source_digest
from ...capture.ops import OpKind
from ...context import CompileContext
from ...partition.region import Claim, Decline, Outcome, Reason, inputs_of, is_convex, outputs_of
from ..cut import (CHAIN, DTYPES, GROW, MAX_NODES, computes, cut_signature, grow, layout_tails_dropped, levels,
                   lowered_reference, reference_kernel)
from ..gemv_claim import seed_claim
from ..ugraph_plan import Alternative, UGraphPlan, random_inputs
from .seeds import Seed, arity, seed_kernel

log = logging.getLogger("torch_mirage")

NOTHING = "nothing claimed"     # what :meth:`SearchClaimer._seeded` records for a graph where its seeds fit nowhere


class SearchClaimer:
    name = "ugraph-search"

    def __init__(self, budget_s: float | None = None, max_nodes: int = MAX_NODES, seeds: Sequence[str] = (),
                 enumerates: bool = True):
        self.budget_s = budget_s
        self.max_nodes = max_nodes
        self.seeds = tuple(seeds)           # library workloads tried first (.seeds.SEED_WORKLOADS' names)
        self.enumerates = enumerates        # False: the seeds only, silent where none verifies

    def claim(self, graph, free: Sequence, ctx: CompileContext) -> list[Outcome]:
        if any(v.meta is not None and not v.meta.is_static for n in free for v in n.outputs):
            return []   # symbolic sizes: no μGraph is drawn for them, and comparing them would add Dynamo guards
        free_ids = {id(n) for n in free}
        outcomes = self._seeded(graph, free, free_ids, ctx) if self.seeds else []
        if not self.enumerates:
            return outcomes
        if self._region_budget(ctx) <= 0:
            log.info("torch_mirage: μGraph search budget 0 (search_budget_s): no search; its regions go to %s",
                     ctx.config.fallback)
        return outcomes + self._searched(graph, free, free_ids, ctx)

    def _region_budget(self, ctx: CompileContext) -> float:
        """Seconds one region's search may take: the claimer's own budget, else the config's."""
        return self.budget_s if self.budget_s is not None else ctx.config.search_budget_s

    def _seeded(self, graph, free: Sequence, free_ids: set, ctx: CompileContext) -> list[Outcome]:
        """Subprograms a library seed verifies for: at each free node (last first) the region of its producers
        (:func:`.cut.grow` without readers: the node is the region's output), then that region with its leading
        elementwise ops peeled (an add on the activation that belongs to the program before), then the smaller
        cuts ending at the node (:func:`.cut.levels`, largest first: a gated MLP inside the region that also holds
        the norm before it), each tried against the seeds; the first verified one is claimed."""
        key = self._nothing_key(graph, free_ids, ctx)
        if key is not None and ctx.cache.get_json(key) == NOTHING:
            log.debug("torch_mirage: seeds %s: nothing claimed in this graph before (disk cache)", self.seeds)
            return []
        order = graph.positions()
        arities = {arity(w) for w in self.seeds}
        outcomes: list[Outcome] = []
        unseeded: set = set()     # signatures of cuts no seed verified for (each layer repeats its cuts)
        for anchor in reversed(list(free)):
            if id(anchor) not in free_ids or anchor.op.kind not in GROW:
                continue
            region = sorted(grow(graph, anchor, free_ids, self.max_nodes, GROW, forward=False, counts=computes),
                            key=lambda n: order[id(n)])
            for nodes in candidates(graph, region, anchor, free_ids, self.max_nodes, order):
                if len([v for v in inputs_of(nodes) if v.is_tensor]) not in arities or not is_convex(graph, nodes):
                    continue
                signature = cut_signature(nodes, graph)
                if signature in unseeded:
                    continue
                outcome = self._claim(graph, nodes, ctx, seeds_only=True)
                if isinstance(outcome, Claim):
                    outcome.hint = {"seeds_only": True}
                    free_ids -= {id(n) for n in nodes}
                    outcomes.append(outcome)
                    break
                unseeded.add(signature)
        if key is not None and not outcomes:
            ctx.cache.put_json(key, NOTHING)
        return outcomes

    def _nothing_key(self, graph, free_ids: set, ctx: CompileContext) -> str | None:
        """The disk-cache key under which :meth:`_seeded` records that its seeds claimed nothing in this graph: the
        graph as the pass reads it (every node's op, arguments, wiring and output metas, :func:`.cut.cut_signature`
        of the whole graph; which nodes are still free), the seeds, the node limit, the configuration's fields that
        change what is compiled, and a digest of the claimers' and the verifier's code (a negative answer is only
        as good as the code that gave it). A warm compile then skips the pass (Llama-3-8B decode, 4 layers: each
        pass grows and lowers a hundred cuts or more). None without a disk cache."""
        if ctx.cache is None:
            return None
        nodes = list(graph.nodes)
        return cache_key(kind="seeded-pass-nothing", graph=repr(cut_signature(nodes, graph)),
                         free=[id(n) in free_ids for n in nodes], seeds=list(self.seeds), max_nodes=self.max_nodes,
                         config=ctx.config.output_key(), target=ctx.target.name,
                         code=source_digest("superopt", "analysis", "capture", "partition", "ugraph.py",
                                            "numerics.py"))

    def _searched(self, graph, free: Sequence, free_ids: set, ctx: CompileContext) -> list[Outcome]:
        """Regions grown around matmuls, attention and reduction chains, searched (see the module docstring)."""
        order = graph.positions()
        outcomes: list[Outcome] = []
        last_first = [n for n in reversed(list(free)) if id(n) in free_ids]
        anchors = [n for n in last_first if n.op.kind is OpKind.MATMUL or is_attention(n)] + \
            [n for n in last_first if n.op.kind is OpKind.REDUCTION]
        searched: set = set()       # nodes of reduction chains already searched
        graph_budget = ctx.config.search_graph_budget_s
        spent, told = 0.0, False
        for anchor in anchors:
            if id(anchor) not in free_ids or id(anchor) in searched:
                continue
            chain = anchor.op.kind is OpKind.REDUCTION
            grown = grow(graph, anchor, free_ids, self.max_nodes, CHAIN if chain else GROW, counts=computes)
            if len(outputs_of(grown, graph)) > 1:
                # without views of a result for readers outside (a norm's output viewed for each of the q, k, v
                # projections: three more outputs the μGraph would write, none found within the op limit); a
                # single output keeps its view (the search finds (b, s, n) rows from (b, s, k) ones, not a reshape)
                grown = layout_tails_dropped(grown)
            nodes = sorted(grown, key=lambda n: order[id(n)])
            if not is_convex(graph, nodes):
                outcomes.append(Decline(nodes, Reason.NOT_CONVEX, f"the region grown around {anchor.name}"))
                continue
            if chain:
                searched |= {id(n) for n in nodes}
            elif (gemms := compute_bound_gemms(nodes, ctx.analysis_of(graph).cost)) is not None:
                log.info("torch_mirage: μGraph search skips %d nodes: %s", len(nodes), gemms)
                outcomes.append(Decline(nodes, Reason.NOT_FOUND, f"not enumerated: {gemms}"))
                continue
            left = None if graph_budget <= 0 else max(0.0, graph_budget - spent)   # None: no graph limit
            if left == 0.0 and not told:
                log.info("torch_mirage: the graph's μGraph search budget (search_graph_budget_s = %g s) is spent: "
                         "no more enumeration in this graph", graph_budget)
                told = True
            t0 = time.monotonic()
            outcome = self._claim(graph, nodes, ctx, budget_s=left)
            spent += time.monotonic() - t0
            if isinstance(outcome, Claim):
                outcome.hint = {"seeds_only": False}
                free_ids -= {id(n) for n in nodes}
            outcomes.append(outcome)
        return outcomes

    def replan(self, graph, nodes: list, hint, free: Sequence, ctx: CompileContext) -> Outcome | None:
        """``nodes``, a region this claimer claimed before (:class:`~...partition.record.PartitionRecord`), claimed
        again as it was (by a seed, or searched: the search's answer is on disk), without the cuts tried before it."""
        if not isinstance(hint, dict) or "seeds_only" not in hint:
            return None
        outcome = self._claim(graph, nodes, ctx, seeds_only=bool(hint["seeds_only"]))
        if isinstance(outcome, Claim):
            outcome.hint = hint
        return outcome

    def _claim(self, graph, nodes: list, ctx: CompileContext, seeds_only: bool = False,
               budget_s: float | None = None) -> Outcome | None:
        """``nodes`` claimed with the μGraph the search finds for them (its seeds first; the enumeration within
        the claimer's or the config's per-region budget, or ``budget_s`` where that is less: what is left of the
        graph's budget), else with its weight-streaming seed, else a decline."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        ref = lowered_reference(nodes, graph, ctx)
        if isinstance(ref, Decline):
            log.debug("torch_mirage: search claimer: region at %s: %s", nodes[-1].target_name, ref.detail)
            return None if seeds_only else ref
        metas = [v.meta for v in ref.inputs]
        budget = self._region_budget(ctx)
        if budget <= 0 and not seeds_only:      # no search asked for: no seed stands in either (claim() says so)
            return Decline(nodes, Reason.NOT_FOUND, "search budget 0 (search_budget_s): no search")
        if not seeds_only and gemm_with_elementwise(ref.graph):
            return self._gemm_epilogue(graph, nodes, ref, ctx)
        if budget_s is not None:
            budget = min(budget, budget_s)
        specs = [(tuple(m.shape), DTYPES[m.dtype]) for m in metas]
        with unset_fake_temporarily():      # the search runs real tensors (probe, verifier)
            result = search(ref.graph, specs, budget_s=budget, cache=ctx.cache, workers=ctx.config.search_workers,
                            seeds=self.seeds, seeds_only=seeds_only,
                            verify_kwargs=dict(error_bound=ctx.config.verify_error_bound,
                                               trials=ctx.config.verify_trials))
            if result.best is None and seeds_only:
                return None
            if result.seed is not None:
                return _seed_claim(graph, nodes, ref, result.seed, result.source)
            if result.best is None:
                log.info("torch_mirage: μGraph search found nothing for %d nodes (%s): %s", len(nodes), result.reason,
                         ", ".join(n.target_name for n in nodes))
                seeded = seed_claim(graph, nodes, ref, ctx) if any(op.name == "matmul" for op in ref.graph.ops) \
                    else None
                if isinstance(seeded, Claim):   # the region whole, not cut smaller: its weight-streaming seed
                    seeded.info["search"] = f"found nothing ({result.reason}); the weight-streaming seed verified"
                    return seeded
                why = ("the graph's search budget (search_graph_budget_s) is spent" if budget_s == 0.0
                       else result.reason) + (f"; {seeded.detail}" if seeded is not None else "")
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

    def _gemm_epilogue(self, graph, nodes: list, ref, ctx: CompileContext) -> Outcome:
        """A GEMM with an elementwise epilogue (:func:`gemm_with_elementwise`): its weight-streaming seed where that
        verifies, else left to Inductor's GEMM template — not enumerated."""
        seeded = seed_claim(graph, nodes, ref, ctx)
        if isinstance(seeded, Claim):
            seeded.info["search"] = "not enumerated (one matmul, elementwise ops); the weight-streaming seed verified"
            return seeded
        log.info("torch_mirage: μGraph search skips %d nodes: one matmul with elementwise ops, Inductor's GEMM "
                 "template fuses them (%s)", len(nodes), seeded.detail)
        return Decline(nodes, Reason.NOT_FOUND, "one matmul with elementwise ops: not enumerated, left to Inductor's "
                       f"GEMM template ({seeded.detail})")


def compute_bound_gemms(nodes: list, model) -> str | None:
    """Why a region is not enumerated, where its matmuls are all compute-bound (none streams its weight,
    :func:`~...analysis.cost.skinny_matmul`) and none reads another's result: GEMMs with their prologue and
    epilogue (a prefill's gated MLP), which Inductor's GEMM templates and cuBLAS run at the tensor cores' rate,
    with no intermediate for a μGraph to keep on chip; None for any other region. A chain of matmuls (attention's
    two, LoRA's) is still searched. On the H100 (11-27) an HF Llama's prefill regions (1024 rows, hidden 1024)
    spent the graph's whole search budget, found nothing, and took the first call to 56.4 s."""
    mms = [n for n in nodes if n.op.kind is OpKind.MATMUL]
    if not mms or any(skinny_matmul(n, model) is not None for n in mms):
        return None
    ids = {id(n) for n in mms}
    inside = {id(n) for n in nodes}
    for mm in mms:                   # a matmul whose producers (inside the region) reach another: a chain
        todo, seen = [v.producer for v in mm.inputs if getattr(v, "producer", None) is not None], set()
        while todo:
            p = todo.pop()
            if id(p) in seen or id(p) not in inside:
                continue
            if id(p) in ids:
                return None
            seen.add(id(p))
            todo += [v.producer for v in p.inputs if getattr(v, "producer", None) is not None]
    return (f"{len(mms)} compute-bound matmul(s) ({', '.join(n.describe() for n in mms)}), none reading another's "
            "result: Inductor's GEMM templates run them")


def gemm_with_elementwise(program) -> bool:
    """Whether a region's program is one matmul with elementwise (and layout) ops around it: no reduction, no
    second matmul — a GEMM and its epilogue, which Inductor's GEMM templates fuse. The enumeration does not reach
    its μGraph within the budget once the epilogue has five ops or more (CPU 11-26, tiny Gemma-2's gate projection
    with GELU-tanh's polynomial: 7.0 M graphs generated in 30 s, no candidate), and the weight-streaming seed is
    that μGraph (timed against Inductor's version on a GPU like every region)."""
    kinds = [op.spec.kind for op in program.ops]
    return kinds.count("matmul") == 1 and all(k in ("io", "matmul", "elementwise", "layout") for k in kinds)


def _seed_claim(graph, nodes: list, ref, seed: Seed, source: str) -> Claim:
    """``nodes`` claimed with a verified library seed: the library's μGraph at the region's dims, the region's
    inputs bound to it by :func:`.seeds.seed_kernel`."""
    positions = {id(v): i for i, v in enumerate(inputs_of(nodes))}
    order = [positions[id(ref.inputs[j])] for j in seed.order]
    metas = [ref.inputs[j].meta for j in seed.order]
    (out,) = outputs_of(nodes, graph)
    dtype = DTYPES[metas[0].dtype]
    detail = seed.describe()
    plan = UGraphPlan([Alternative(seed.name, seed.graph, detail, {"ugraph": seed.name})],
                      functools.partial(random_inputs, metas, seed.shapes),
                      functools.partial(seed_kernel, order, seed.transposed, seed.shapes, tuple(out.meta.shape)),
                      what=f"{detail} {dtype}")
    return Claim(list(nodes), plan, detail=detail,
                 info={"source": "seed" if source == "seed" else f"{source} (seed)", "dims": list(seed.dims),
                       "dtype": dtype, "verified": seed.reason})


def candidates(graph, region: list, anchor, free_ids: set, max_nodes: int, order: dict):
    """The cuts ending at ``anchor`` that a seed is tried on, each once, in graph order: ``region`` and its
    :func:`peeled` forms, then the :func:`.cut.levels` from ``anchor``, largest first; only those with a matmul, a
    reduction or an attention (a seed's program has one)."""
    seen: set = set()
    smaller = reversed(list(levels(graph, anchor, free_ids, max_nodes, GROW, counts=computes)))
    for nodes in itertools.chain(peeled(region, anchor), smaller):
        key = frozenset(id(n) for n in nodes)
        if key in seen or not any(n.op.kind in (OpKind.MATMUL, OpKind.REDUCTION) or is_attention(n) for n in nodes):
            continue
        seen.add(key)
        yield sorted(nodes, key=lambda n: order[id(n)])


def peeled(region: list, anchor, times: int = 2):
    """``region``, then up to ``times`` times without its leading elementwise ops (those reading only values from
    outside it; never ``anchor``)."""
    nodes = list(region)
    for _ in range(times + 1):
        yield nodes
        inside = {id(n) for n in nodes}
        leading = {id(n) for n in nodes if n is not anchor and n.op.kind is OpKind.ELEMENTWISE and not any(
            getattr(v, "producer", None) is not None and id(v.producer) in inside for v in n.inputs)}
        if not leading:
            return
        nodes = [n for n in nodes if id(n) not in leading]
