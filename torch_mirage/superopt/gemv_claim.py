"""The weight-streaming claimer: memory-bound matmuls (decode GEMVs) with their prologue and epilogue, one kernel.

A matmul is this claimer's when the cost model calls it memory-bound (:func:`~..analysis.cost.skinny_matmul`: at
most 16 rows, or arithmetic intensity below the ridge point): its time is the weight's read, and each kernel
around it that Inductor would launch re-reads activations and pays a launch. For each such free matmul (last
first, so that a later matmul's epilogue is taken before an earlier one's region could grow into it) the claimer
tries cuts of the graph around it (:func:`cuts`, each grown by :func:`.cut.grow`), largest first (of two nested
cuts the larger has the lower roofline estimate):

1. the free memory-bound matmuls reading the same activation (:func:`siblings`: a QKV projection's three, a gated
   MLP's two; a matmul alone is its own family) with the producers read only inside — the norm of the rows
   joins them (each matmul width gets a
   block graph of its own in the seed, each recomputing the norm's row scale), first with the elementwise and
   layout readers of every result (RoPE on a QKV projection's q and k, or on the parts of one fused projection
   split after its matmul; both branches of a GELU that meet again; up to the attention and the cache write;
   then without the views of a result for readers outside, :func:`.cut.layout_tails_dropped`), then without readers;
   each of these first with the static KV cache writes of its results (:func:`.cut.cache_writes`: the seed is built
   and verified without them, :func:`.updates.split_updates`, and its kernel stores the new rows itself);
2. the matmul with producers of every kind (the norm, a gated MLP's sibling, the weight's transpose) and the
   elementwise readers of a single result (a residual add, SiLU·mul); then without the readers;
3. the same with layout producers only, then with none (the activation arrives through a permute the reference
   does not lower: attention's heads merged back into rows) — each of these first with the weight's own views
   (:func:`weight_views`: ``nn.Linear``'s transpose), so that the kernel knows how the weight is stored.

The first cut whose reference program (:func:`.search.reference.reference_of`) has the weight-streaming form
(:func:`.gemv_seed.gemv_seed`) and whose seed the verifier proves equal to it (:func:`.verify.verify`; a large
region at the search's shrunk sizes, :func:`verified_instance`, the instance at its own sizes checked against
eager by the backend's check stage like every region) is claimed; the build stage compiles it
(:func:`.compile.compile_ugraph`; on a GPU the launches of :func:`.launch.streaming_candidates` — one-wave stream,
split-K, split-N — ranked by the roofline estimate and timed). Where the region rotates heads (RoPE), the
seed's paired-halves form (:func:`verified_halves`), verified the same way, is claimed instead where it verifies
(:func:`verified_form`). On a GPU the backend also times it against Inductor's version and keeps the faster.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Sequence

import torch

from ..cache import ProcessMemo
from ..analysis.cost import SKINNY_ROWS, CostModel, matmul_rows, skinny_matmul
from ..analysis.op_dims import matmul_operands
from ..capture.ir import Graph, Node, Value
from ..ugraph import KernelGraph
from ..capture.ops import OpKind
from ..context import CompileContext
from ..partition.region import Claim, Decline, Outcome, Reason, is_convex
from .compile import DTYPES as TORCH_DTYPES
from .gemv_seed import NotStreamable, gemv_seed, rotation_groups
from .launch import streaming_candidates
from .cut import GROW, MAX_NODES, cache_writes, computes, grow, layout_tails_dropped, lowered_reference, reference_kernel
from .search.reference import Reference
from .search.shrink import (MAX_VERIFY_WORK, SMALL_HEAD, SMALL_TILE, block_steps, executor_work, head_size_map,
                            product_size_map, shrink)
from .ugraph_plan import Alternative, UGraphPlan, random_inputs
from .updates import split_updates, with_updates
from .validate import problems
from .verify import verify

log = logging.getLogger("torch_mirage")

LAYOUT = frozenset({OpKind.LAYOUT})
# A seed whose sizes do not shrink is verified at its own: the executor steps every block and for-loop step in
# Python (a QKV projection of 4096 with its output regrouped for GQA attention: 3072 steps, tens of seconds); above
# this many steps the cut is declined and the next, smaller one tried (the regrouping views left out).
MAX_VERIFY_STEPS = 1024
NONE: frozenset = frozenset()


def activation(node: Node) -> Value:
    """The value a matmul's rows come from, through the layout ops (views) between."""
    _, a, _ = matmul_operands(node)
    while a.producer is not None and a.producer.kind is OpKind.LAYOUT:
        a = next(v for v in a.producer.inputs if v.is_tensor)
    return a


def siblings(anchor: Node, free: Sequence[Node], free_ids: set, model: CostModel) -> list[Node]:
    """The free memory-bound matmuls reading ``anchor``'s activation, itself included (a QKV projection's three,
    a gated MLP's two): grown together, the norm before them joins their kernel."""
    source = activation(anchor)
    return [n for n in free if id(n) in free_ids and n.kind is OpKind.MATMUL and activation(n) is source
            and (n is anchor or skinny_matmul(n, model) is not None)]


def cuts(graph: Graph, anchor: Node, free: Sequence[Node], free_ids: set, model: CostModel) -> list[list[Node]]:
    """Regions around ``anchor`` to try, each in graph order, without repeats: its sibling matmuls and their
    producers; ``anchor`` with producers of all kinds, of layout only and of none, each with and without the
    readers of its result. Largest first: where one cut holds another, the roofline estimate of the larger is
    the lower (one kernel's traffic and launch instead of two, inner values never written), so it is tried first;
    the sibling cut of a gated MLP holds no SiLU·mul and comes after the cut that does."""
    order = graph.positions()
    out: list[list[Node]] = []
    family = siblings(anchor, free, free_ids, model)
    tries = [(family, GROW, True, True), (family, GROW, True, False)] + \
        [(anchor, kinds, forward, False) for kinds in (GROW, LAYOUT, NONE) for forward in (True, False)]
    views = weight_views(anchor, free_ids)
    for start, kinds, forward, every in tries:
        grown = grow(graph, start, free_ids, MAX_NODES, kinds, forward, computes if every else None, every)
        if every:
            variants = [grown, layout_tails_dropped(grown)]
            if writes := cache_writes(graph, grown, free_ids):   # the views the writes read are no tails then
                variants = [grown + writes, layout_tails_dropped(grown + writes)] + variants
        else:   # first with the weight's own views
            variants = [grown + [v for v in views if all(v is not n for n in grown)], grown]
            variants = [v + w for v in variants if (w := cache_writes(graph, v, free_ids))] + variants
        for nodes in variants:
            nodes = sorted(nodes, key=lambda n: order[id(n)])
            if all({id(n) for n in nodes} != {id(n) for n in c} for c in out):
                out.append(nodes)
    return sorted(out, key=len, reverse=True)


def weight_views(anchor: Node, free_ids: set) -> list[Node]:
    """The free layout ops between ``anchor`` and its weight that nothing else reads (``nn.Linear``'s transpose):
    in the region they tell the seed how the weight is stored, so that its kernel reads it along its contiguous
    dim. Left outside (a cut without the activation's producers, whose permute the reference does not lower), the
    kernel got the transposed view as a strided input: on the H100 (11-26, 1 x 4096 x 4096 bf16) 40.8 µs instead
    of the 14.1 µs the same kernel reads the stored weight in."""
    _, _, w = matmul_operands(anchor)
    chain: list[Node] = []
    readers = {id(anchor)}
    while w.producer is not None and w.producer.kind is OpKind.LAYOUT and id(w.producer) in free_ids \
            and all(id(u) in readers for u in w.users):
        chain.append(w.producer)
        readers.add(id(w.producer))
        w = next(v for v in w.producer.inputs if v.is_tensor)
    return chain


class GemvClaimer:
    """Claims memory-bound matmuls with their norm prologue and elementwise epilogue (see the module docstring)."""
    name = "ugraph-gemv"

    def claim(self, graph: Graph, free: Sequence[Node], ctx: CompileContext) -> list[Outcome]:
        free_ids = {id(n) for n in free}
        model = ctx.analysis_of(graph).cost
        outcomes: list[Outcome] = []
        for anchor in reversed(list(free)):
            if id(anchor) not in free_ids or anchor.kind is not OpKind.MATMUL or skinny_matmul(anchor, model) is None:
                continue
            outcome = self._claim_anchor(graph, anchor, free, free_ids, model, ctx)
            if isinstance(outcome, Claim):
                free_ids -= {id(n) for n in outcome.nodes}
            outcomes.append(outcome)
        return outcomes

    def replan(self, graph: Graph, nodes: list[Node], hint, free: Sequence[Node], ctx: CompileContext) -> Outcome:
        """``nodes``, a cut this claimer claimed before (:class:`~...partition.record.PartitionRecord`), claimed
        again without growing the cuts around its matmul."""
        return self._claim_cut(graph, nodes, ctx)

    def _claim_anchor(self, graph: Graph, anchor: Node, free: Sequence[Node], free_ids: set, model: CostModel,
                      ctx: CompileContext) -> Outcome:
        """The largest cut around ``anchor`` that streams, or the decline of the last one tried."""
        why: Decline | None = None
        for nodes in cuts(graph, anchor, free, free_ids, model):
            if not is_convex(graph, nodes):
                why = Decline(nodes, Reason.NOT_CONVEX, f"the region grown around {anchor.name}")
                continue
            # A decode GEMV (at most SKINNY_ROWS rows) is not held back by MIRAGE_MIN_REGION_US: Inductor runs the
            # matmul as a kernel of its own too (cuBLAS), with the norm before it and the epilogue after it as
            # further kernels, so the fused region replaces at least one launch with one; the measure stage times
            # it against Inductor's. With the floor, the bench's HF decode graphs (hidden 1024, 4 rows) left every
            # projection but the gated MLP's and the LM head's to Inductor (QKV + RoPE 1.3 µs, o_proj 0.6,
            # down_proj 1.7 µs of traffic on the H100 model). More rows (a prompt's, memory-bound by intensity
            # only) keep the floor: there cuBLAS was faster (H200, 256 rows: 15.4 against 22.8 µs).
            if matmul_rows(anchor) > SKINNY_ROWS:
                # the graph's value facts from the analyse stage: not recomputed over the whole graph for each cut
                memory_us = ctx.analysis_of(graph).region_cost(nodes, model).memory_us
                if memory_us < ctx.config.min_region_us:
                    return Decline(nodes, Reason.BELOW_MIN_REGION, f"{memory_us:.2f} µs of memory traffic")
            outcome = self._claim_cut(graph, nodes, ctx)
            if isinstance(outcome, Claim):
                return outcome
            why = outcome
        return why

    def _claim_cut(self, graph: Graph, nodes: list[Node], ctx: CompileContext) -> Outcome:
        # inputs in first-use order: every layer's cut then lowers to the same program (in graph order the first
        # layer's hidden state precedes the rotary cos / sin and later layers' follows them), so its seed is
        # verified once (the verdict cache), not once per order (the bench's 4-layer decode graphs, partition stage
        # on the 2-core CPU: llama 5.4 -> 4.1 s, qwen2 6.3 -> 4.2 s, gemma2 16.7 -> 10.8 s)
        ref = lowered_reference(nodes, graph, ctx, first_use=True)
        return ref if isinstance(ref, Decline) else seed_claim(graph, nodes, ref, ctx)


# verified_form's answers in this process, by the reference program's canonical hash and the verifier's settings:
# a model's layers lower to the same program, whose seed is built, instantiated and verified (or its verdict
# looked up) once, not once per layer (the bench's 4-layer llama decode graph, warm partition on the 2-core CPU:
# the claimer's 35 cuts spent 0.25 s in it, nearly all on layers 2-4)
_FORMS = ProcessMemo(256)


def _verified_form_once(ref: KernelGraph, config, cache: Any) -> tuple[KernelGraph | None, str, str]:
    return _FORMS.get((ref.hash(), config.verify_error_bound, config.verify_trials),
                      lambda: verified_form(ref, config, cache))


def seed_claim(graph: Graph, nodes: list[Node], ref: Reference, ctx: CompileContext) -> Outcome:
    """``nodes`` (whose reference is ``ref``) claimed with their weight-streaming seed, verified against ``ref``
    (the build stage compiles it, launches from :func:`.launch.streaming_candidates`); a decline where the region
    has no seed or the verifier rejects it."""
    seed, verdict, name = _verified_form_once(ref.graph, ctx.config, ctx.cache)
    if seed is None:
        return Decline(nodes, Reason.NO_KERNEL, verdict)
    metas = [v.meta for v in ref.inputs]
    mms = [n for n in nodes if n.kind is OpKind.MATMUL]
    _, a, _ = matmul_operands(mms[0])
    rows, k, n = matmul_rows(mms[0]), a.meta.shape[-1], mms[0].outputs[0].meta.shape[-1]
    detail = f"weight-streaming μGraph: {len(mms)} matmul(s), {rows} rows x {k} -> {n}, {len(nodes)} ops" + \
        (", RoPE heads in paired halves" if name == HALVES else "")
    plan = UGraphPlan([Alternative(name, seed, detail, {"ugraph": name})],
                      functools.partial(random_inputs, metas), functools.partial(reference_kernel, nodes, graph, ref),
                      what=f"weight-streaming μGraph of {len(nodes)} ops on {', '.join(_describe(m) for m in metas)}",
                      propose=streaming_candidates)
    info = {"rows": rows, "k": k, "n": n, "matmuls": len(mms), "verified": verdict}
    return Claim(list(nodes), plan, detail=detail, info=info)


def verified_seed(ref: KernelGraph, config, halves: bool = False, cache: Any = None
                  ) -> tuple[KernelGraph | None, str]:
    """``(seed, the verifier's reason)``: the weight-streaming seed of ``ref`` (``halves``: its paired-halves form)
    verified against it with ``config``'s verifier settings (verdicts kept in ``cache``, the compile's disk cache); ``(None, why not)`` where ``ref`` has no such seed, it
    is not valid, too large to verify at its own sizes, or not verified."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    program_with_updates = ref
    ref, updates = split_updates(ref)      # a cache write: the seed computes what it writes (superopt.updates)
    try:
        seed = gemv_seed(ref, halves=halves)
        program, candidate = verified_instance(ref, seed, halves=halves)
    except NotStreamable as e:
        return None, f"not a weight-streaming matmul region: {e}"
    if invalid := problems(seed):
        return None, f"the weight-streaming seed is not valid: {'; '.join(invalid)}"
    if program is ref and ((steps := block_steps(candidate)) > MAX_VERIFY_STEPS
                           or (work := executor_work(candidate)) > MAX_VERIFY_WORK):
        size = f"{steps} block steps" if steps > MAX_VERIFY_STEPS else f"{work:.2e} elements to compute"
        return None, (f"the weight-streaming seed is too large to verify at its own sizes ({size}; its sizes do not "
                      "shrink): a smaller cut is tried")
    examples = [torch.zeros(tuple(op.attrs["shape"]), dtype=TORCH_DTYPES[op.attrs["dtype"]]) for op in program.inputs]
    with unset_fake_temporarily():      # the verifier runs real tensors
        verdict = verify(candidate, program, examples, error_bound=config.verify_error_bound,
                         trials=config.verify_trials, cache=cache)
    if not verdict:
        return None, f"the weight-streaming seed is not verified: {verdict.reason}"
    return with_updates(seed, updates, program_with_updates), verdict.reason


HALVES = "weight_streaming_halves"


def verified_form(ref: KernelGraph, config, cache: Any = None) -> tuple[KernelGraph | None, str, str]:
    """``(μGraph, the verifier's reason, its name)`` of ``ref``: where the region rotates heads (RoPE), the seed's
    paired-halves form (:func:`verified_halves`) where it verifies; else the seed (:func:`verified_seed`). The
    head-per-block form is not compiled beside the halves: of the 18 choices between them timed on the H100 on
    11-27 (decode QKV + RoPE + cache write, ``benchmarks/results/raw``), the halves were faster in 16 (llama b1
    22.1 vs 30.0 µs, b8 26.5-28.2 vs 28.4-29.1; gemma2 31.1-31.3 vs 45.8-46.2) and slower by 0.1-0.4 % in two
    (gemma2, 40.40 / 40.75 vs 40.36 / 40.58), and building both cost about 12 s of a cold compile (the other
    form's tuning and sibling rounds, and the timing)."""
    halves = verified_halves(ref, config, cache)
    if halves is not None:
        return halves, "verified (paired-halves form)", HALVES
    seed, verdict = verified_seed(ref, config, cache=cache)
    return seed, verdict, "weight_streaming"


def verified_halves(ref: KernelGraph, config, cache: Any = None) -> KernelGraph | None:
    """The paired-halves form of a rotated seed (:class:`.gemv_seed._HalvesBlock`: a block holds matching slices of
    both halves of a head, so its launches may stream the weight in contiguous tiles over more programs than heads),
    verified like the seed (:func:`verified_seed`); None where the region has no rotation or the form does not
    apply or verify (H100 11-26: the head-per-block q projection + RoPE ran 18.4-24.5 µs over 64 launches where the
    same bytes without RoPE stream in 14.5)."""
    if not rotation_groups(ref):
        return None
    halves, why = verified_seed(ref, config, halves=True, cache=cache)
    if halves is None:
        log.info("torch_mirage: no paired-halves weight-streaming form (%s)", why)
    return halves


def verified_instance(ref: KernelGraph, seed: KernelGraph, gains_on_weights: bool = False, halves: bool = False
                      ) -> tuple[KernelGraph, KernelGraph]:
    """(reference, seed) the verifier checks: ``ref`` and its seed where ``ref`` is small; else both at the search's
    shrunk sizes (:func:`.search.shrink.shrink`: the executor steps every block and for-loop step in Python, a
    minute for a 4096 x 14336 weight; rows that a reshape merges, a prompt's 4 x 64 into 256, by
    :func:`.search.shrink.product_size_map`: at their own sizes HF qwen2's prompt projections took 1.2-7.3 s a
    verification on the 2-core CPU; a region with RoPE's rotation in heads of d, whose sizes do not shrink one by
    one, to two heads of :data:`.search.shrink.SMALL_HEAD`, else of d, :func:`.search.shrink.head_size_map`: the
    executor's steps grow with the head, gemma2's heads of 256 took 7.8 s a verification on the 2-core CPU at d),
    the seed drawn in the same form (``gains_on_weights``, see
    :func:`.gemv_seed.gemv_seed`) with the shrunk problem's tile so that the grid and the for-loop split there as at
    the real sizes: the same construction, other counts (``halves``: the paired-halves form)."""
    outs = [ref.ops[r[0]].shapes[r[1]] for r in ref.outputs]
    ins = [(tuple(op.attrs["shape"]), op.attrs["dtype"]) for op in ref.inputs]
    small = shrink(ref, ins, outs) or shrink(ref, ins, outs, product_size_map)   # rows merged by a reshape
    if small is None and len(heads := rotation_groups(ref)) == 1:    # heads of (b, h, 1, d) views: shrink h
        head = heads.pop()
        for small_head in ([SMALL_HEAD] if head > SMALL_HEAD else []) + [None]:   # then d, where d does not shrink
            small = shrink(ref, ins, outs, functools.partial(head_size_map, head=head, small_head=small_head))
            if small is not None:
                break
    if small is None:
        return ref, seed
    return small.target, gemv_seed(small.target, tile=SMALL_TILE, gains_on_weights=gains_on_weights, halves=halves)


def _describe(meta) -> str:
    return f"{str(meta.dtype).replace('torch.', '')}{list(meta.shape)}"
