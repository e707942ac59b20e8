"""The weight-streaming claimer: memory-bound matmuls (decode GEMVs) with their prologue and epilogue, one kernel.

A matmul is this claimer's when the cost model calls it memory-bound (:func:`~..analysis.cost.skinny_matmul`: at
most 16 rows, or arithmetic intensity below the ridge point): its time is the weight's read, and each kernel
around it that Inductor would launch re-reads activations and pays a launch. For each such free matmul (last
first, so that a later matmul's epilogue is taken before an earlier one's region could grow into it) the claimer
tries cuts of the graph around it, largest first (:func:`cuts`): the region :func:`.cut.grow` grows
(producers read only inside — an RMSNorm of the rows, the sibling matmul of a gated MLP, the weight's transpose —
and the elementwise readers of a single result — a residual add, SiLU·mul), then without the readers, then with
layout producers only, then with no producers (the activation arrives through a permute the reference does not
lower: attention's heads merged back into rows). The first cut whose reference program (:func:`.search.reference.reference_of`) has the
weight-streaming form (:func:`.gemv_seed.gemv_seed`) and whose seed the verifier proves equal to it
(:func:`.verify.verify`; a large region's construction is verified on its program shrunk to
:data:`.gemv_seed.VERIFY_DIMS`, :func:`.gemv_seed.shrunk`, and the instance at its own sizes is checked against
eager by the backend's check stage like every region) is compiled (:func:`.compile.compile_ugraph`; on a GPU the launches of
:func:`.launch.streaming_candidates` — one-wave stream, split-K, split-N — ranked by the roofline estimate and
timed) and claimed. The backend then checks it against eager and, on a GPU, times it against Inductor's version.

A larger cut costs less than the same nodes cut in two (one kernel's traffic and launch instead of two, the norm's
output never written), so the largest cut that works wins. Compute-bound matmuls are left to the library call.
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch

from ..analysis.cost import CostModel, matmul_rows, skinny_matmul
from ..analysis.op_dims import matmul_operands
from ..capture.ir import Graph, Node
from ..capture.ops import OpKind
from ..context import CompileContext, Target
from ..failures import describe_error
from ..partition.region import Claim, Decline, Outcome, Reason, is_convex
from ..timing import random_like
from .compile import compile_ugraph
from .gemv_seed import NotStreamable, gemv_seed, shrunk
from .launch import streaming_candidates
from .cut import GROW, MAX_NODES, grow, reference_kernel
from .search.reference import Decline as NotLowered, Reference, reference_of
from .verify import verify

log = logging.getLogger("torch_mirage")

DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
DTYPE_OF = {name: dtype for dtype, name in DTYPES.items()}
LAYOUT = frozenset({OpKind.LAYOUT})
NONE: frozenset = frozenset()


def cuts(graph: Graph, anchor: Node, free_ids: set) -> list[list[Node]]:
    """Regions around ``anchor`` to try, largest first, each in graph order, without repeats."""
    order = {id(n): i for i, n in enumerate(graph.nodes)}
    out: list[list[Node]] = []
    for kinds, forward in ((GROW, True), (GROW, False), (LAYOUT, True), (LAYOUT, False), (NONE, True), (NONE, False)):
        nodes = sorted(grow(graph, anchor, free_ids, MAX_NODES, kinds, forward), key=lambda n: order[id(n)])
        if all({id(n) for n in nodes} != {id(n) for n in c} for c in out):
            out.append(nodes)
    return out


class GemvClaimer:
    """Claims memory-bound matmuls with their norm prologue and elementwise epilogue (see the module docstring)."""
    name = "ugraph-gemv"

    def claim(self, graph: Graph, free: Sequence[Node], ctx: CompileContext) -> list[Outcome]:
        free_ids = {id(n) for n in free}
        model = CostModel()
        outcomes: list[Outcome] = []
        for anchor in reversed(list(free)):
            if id(anchor) not in free_ids or anchor.kind is not OpKind.MATMUL or skinny_matmul(anchor, model) is None:
                continue
            outcome = self._claim_anchor(graph, anchor, free_ids, model, ctx)
            if isinstance(outcome, Claim):
                free_ids -= {id(n) for n in outcome.nodes}
            outcomes.append(outcome)
        return outcomes

    def _claim_anchor(self, graph: Graph, anchor: Node, free_ids: set, model: CostModel,
                      ctx: CompileContext) -> Outcome:
        """The largest cut around ``anchor`` that streams, or the decline of the last one tried."""
        why: Decline | None = None
        for nodes in cuts(graph, anchor, free_ids):
            if not is_convex(graph, nodes):
                why = Decline(nodes, Reason.NOT_CONVEX, f"the region grown around {anchor.name}")
                continue
            memory_us = model.region_cost(nodes, graph).memory_us
            if memory_us < ctx.config.min_region_us:
                return Decline(nodes, Reason.BELOW_MIN_REGION, f"{memory_us:.2f} µs of memory traffic")
            outcome = self._claim_cut(graph, nodes, ctx)
            if isinstance(outcome, Claim):
                return outcome
            why = outcome
        return why

    def _claim_cut(self, graph: Graph, nodes: list[Node], ctx: CompileContext) -> Outcome:
        ref = reference_of(nodes, graph)
        if isinstance(ref, NotLowered):
            return Decline(nodes, Reason.NOT_LOWERED, str(ref))
        metas = [v.meta for v in ref.inputs]
        if any(m.dtype not in DTYPES for m in metas) or \
                (ctx.target is Target.INTERPRETER and any(m.dtype == torch.bfloat16 for m in metas)):
            return Decline(nodes, Reason.UNSUPPORTED_DTYPE, ", ".join(sorted({str(m.dtype) for m in metas})))
        if not ctx.target.runs_on(metas[0].device.type):
            return Decline(nodes, Reason.UNSUPPORTED_DEVICE, str(metas[0].device))
        return seed_claim(graph, nodes, ref, ctx)


def seed_claim(graph: Graph, nodes: list[Node], ref: Reference, ctx: CompileContext) -> Outcome:
    """``nodes`` (whose reference is ``ref``) claimed with their weight-streaming seed, verified against ``ref``
    and compiled; a decline where the region has no seed, the verifier rejects it or it does not compile."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    try:
        seed = gemv_seed(ref.graph)
    except NotStreamable as e:
        return Decline(nodes, Reason.NO_KERNEL, f"not a weight-streaming matmul region: {e}")
    metas = [v.meta for v in ref.inputs]
    small = shrunk(ref.graph)          # a large region: its construction verified at VERIFY_DIMS
    program, candidate = (ref.graph, seed) if small is None else (small, gemv_seed(small))
    examples = [torch.zeros(tuple(op.attrs["shape"]), dtype=DTYPE_OF[op.attrs["dtype"]]) for op in program.inputs]
    with unset_fake_temporarily():      # the verifier and the compile run real tensors
        verdict = verify(candidate, program, examples)
        if not verdict:
            return Decline(nodes, Reason.NO_KERNEL, f"the weight-streaming seed is not verified: {verdict.reason}")
        try:
            compiled = compile_ugraph(seed, [random_like(m) for m in metas], cache=ctx.cache,
                                      propose=streaming_candidates)
        except Exception as e:   # a seed that does not compile: the region goes on to the next claimers
            if ctx.config.strict:
                raise
            log.info("torch_mirage: weight-streaming μGraph does not compile (%s)", describe_error(e))
            return Decline(nodes, Reason.COMPILE_ERROR, describe_error(e))
    mms = [n for n in nodes if n.kind is OpKind.MATMUL]
    _, a, _ = matmul_operands(mms[0])
    rows, k, n = matmul_rows(mms[0]), a.meta.shape[-1], mms[0].outputs[0].meta.shape[-1]
    info = {"ugraph": "weight_streaming", "ugraph_hash": seed.hash()[:16], "rows": rows, "k": k, "n": n,
            "matmuls": len(mms), "verified": verdict.reason, "launch": [c.to_json() for c in compiled.configs]}
    return Claim(list(nodes), seed, reference_kernel(nodes, graph, ref, compiled),
                 detail=f"weight-streaming μGraph: {len(mms)} matmul(s), {rows} rows x {k} -> {n}, {len(nodes)} ops",
                 info=info)
