"""The attention claimer: attention regions found by analysis (:mod:`torch_mirage.analysis.attention`) run a seed
μGraph (:mod:`.attention_seeds`) instantiated from their :class:`AttentionSpec`.

Whatever form the region came in — HF eager code with ``repeat_kv``, an SDPA ATen op, a hand-written softmax —
it becomes Q packed per KV head (b, hk, g·sq, d), K and V as they are, and, when masked, one mask
(bm, hm, g·sq, skv), shared over batch rows and heads where the user's is: a bool mask (True keeps) is read by the
kernels as it is, ``where(keep, s, fill)`` per tile (:func:`bool_in_kernel`; else it becomes the additive
``where(keep, 0, fill)``), ``is_causal`` a top-left triangle of ``-inf`` (built once per region). The online-softmax
kernels hold finite masked scores at ``-1e30`` and keep a tile or split whose keys are all ``-inf`` defined
(a column-sum plan's column pass holds its scores the same way). Rows whose keys are all masked
(padding) get what the form gives in eager: SDPA returns zeros (the seeds' ``empty_rows="zero"``), the decomposed
softmax NaN for ``-inf`` masks (the kernels' own 0/0), and a uniform average for the finite ``finfo.min`` masks
HF builds (the held floor's); only column-sum plans find such rows on the mask per call. A mask that is exactly its causal / sliding-window band
(:func:`index_mask`: ``is_causal``, HF's ``where(j <= i, 0, min)``) is none of that: the banded seeds compute it
from indices, the kernel gets a broadcast stand-in, and the graph nodes that build it for this region alone join
the claim, dead — nothing is built, packed, clamped or scanned per call.

Where KV is long enough to split, the split-KV seed is planned as well, and on a GPU the build stage runs the faster
(:func:`torch_mirage.build.fastest`): it fills the SMs where few query rows — decode — leave FlashAttention's
grid small. Decode (one block of query rows) plans split counts around one that fills the SMs (:func:`_seeds`).
Each seed is verified before it runs, at a small instance of the region's parameters (:mod:`.attention_verify`); one
the verifier rejects is left out. The backend then checks the region against eager ATen on random inputs, as for every
region.

A region whose P is also reduced over the query axis (H2O's column sums, :class:`~..analysis.attention.
ColumnReduction`) runs one plan for P·V and the column sums per query head: :func:`plan_candidates` costs the
kernels of :data:`.attention_seeds.PLAN_KERNELS` with the cost model (each as the IR nodes it computes and the
values it writes), :func:`.plan_select.select_plan` picks the set by a binary linear program, and
:func:`.attention_seeds.attention_column_sums` builds it as one μGraph — with a mask passed in, once more with the
mask's tile table, whose scanning launches let both passes skip what the mask hides, timed against the plain one
on the call's mask; each column reduction is then replayed on the (b, h, skv) column sums (a sum over heads, a
permute, a mean's factor, the dtype).
"""
from __future__ import annotations

import functools
import logging
from typing import Callable, Sequence

import torch

from .cut import DTYPES, with_meta_strides
from ..cache import ProcessMemo
from ..analysis.attention import AttentionSpec, find_attention
from ..analysis.graph import GraphAnalysis, analyse
from ..analysis.device import DeviceModel
from ..capture.ir import Graph, Node
from ..capture.lower import constant_value
from ..ugraph import MASK_FLOOR, KernelGraph
from ..context import CompileContext, Target
from ..partition.region import Claim, Decline, Outcome, Reason, inputs_of, is_convex, outputs_of
from .attention_seeds import PLAN_KERNELS, ROW_BLOCK_KV, SEEDS, attention_column_sums, decode_split_counts
from .attention_verify import verified
from .launch import PREFILL_MIN_ROWS
from .library import DOT_MIN, blocks, tiles
from .plan_select import Candidate, select_plan
from .ugraph_plan import Alternative, UGraphPlan
from .validate import validate
from ..timing import random_like

log = logging.getLogger("torch_mirage")

MASK_DTYPES = DTYPES | {torch.bool: "bool"}    # the seeds' mask input: additive, or a bool mask as it is
SPLIT_KV = 256            # KV length per split of the split-KV seed's default schedule (4 tiles of 64)
SEED_TILE = 64            # the seeds' default tile edge
# waves of FlashAttention programs (a row block of queries per batch row and KV head, at SEED_TILE rows) from which
# KV is not split: more programs than that need no split for parallelism, and a split adds a
# combine pass over fp32 partial states (Llama-3-8B prefill 2048: 8 splits, 256 MiB of states per call; H100 11-28,
# 1.5 GiB of the compile's memory peak was that candidate's timing)
ROW_WAVES = 2


def packed_mask(spec: AttentionSpec, mask: torch.Tensor | None, device: torch.device,
                bool_mask: bool = False, per_head: bool = False) -> torch.Tensor | None:
    """The spec's mask as the kernels take it, (bm, hm, g·sq, skv) with bm ∈ {1, b}, hm ∈ {1, hk}: a mask shared
    by all batch rows / heads stays shared (an HF (1, 1, n, n) causal mask is not copied per head); a per-head one
    is a view of the user's; a head-shared one under GQA repeats its rows once per head of a group (a view where
    each head has one query row: decode). ``bool_mask`` (:func:`bool_in_kernel`): a bool mask as it is; otherwise
    scores to add (bool masks become fp32 ``where(keep, 0, fill)``). None when unmasked. ``per_head``
    (:func:`per_query_head`): (bm, hm, sq, skv) with hm ∈ {1, h}, a view of the user's mask."""
    m = kernel_mask(spec, mask, device, bool_mask)
    return None if m is None else _pack(spec, m, per_head)


def bool_in_kernel(spec: AttentionSpec, use_band: bool = True) -> bool:
    """Whether the kernels read the region's bool mask as it is (``where(keep, s, fill)`` per tile: no additive
    copy built per call; H100 11-27, HF Llama decode b1: the attention region 20.2 µs with the copy and its
    empty-row scan, 12.1 µs without): a bool mask that keeps where True, without column sums (their column pass
    adds a clamped additive mask) and without a for-loop band (whose tiles that every row sees skip the mask as
    a 0 addend)."""
    return spec.mask == "bool" and not spec.extra_outputs and not (use_band and spec.mask_band is not None)


def kernel_mask(spec: AttentionSpec, mask: torch.Tensor | None, device: torch.device,
                bool_mask: bool = False) -> torch.Tensor | None:
    """The mask before packing: the user's bool mask itself with ``bool_mask``, else :func:`additive_mask`."""
    return mask if bool_mask and mask is not None else additive_mask(spec, mask, device)


def additive_mask(spec: AttentionSpec, mask: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """The spec's mask as the scores it adds, before packing: ``is_causal``'s triangle, a bool mask's
    ``where(keep, 0, fill)``, an additive mask as it is; None when unmasked."""
    sq, skv = spec.sq, spec.skv
    if spec.mask == "causal":
        keep = torch.ones(sq, skv, dtype=torch.bool, device=device).tril()
        return torch.zeros(keep.shape, device=device).masked_fill(~keep, float("-inf"))
    if mask is None:
        return None
    if spec.mask == "bool":
        return torch.where(mask, 0.0, spec.bool_fill)
    if spec.mask == "bool_inverted":
        return torch.where(mask, spec.bool_fill, 0.0)
    return mask


def _pack(spec: AttentionSpec, mask: torch.Tensor, per_head: bool = False) -> torch.Tensor:
    """:func:`packed_mask`'s packing of a (…, sq, n) tensor (n: the keys, or 1 for a per-row value)."""
    b, h, hk, sq, g = spec.b, spec.h, spec.hk, spec.sq, spec.group
    m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    n = m.shape[-1]
    bm = b if m.shape[0] == b else 1
    if per_head:
        return m.expand(bm, h if m.shape[1] == h else 1, sq, n)
    if m.shape[1] == h and h > 1:
        return m.expand(bm, h, sq, n).reshape(bm, hk, g * sq, n)
    if sq == 1:
        return m.expand(bm, 1, g, n)
    m = m.expand(bm, 1, sq, n)
    return m.repeat(1, 1, g, 1) if g > 1 else m


def mask_dtype(spec: AttentionSpec, bool_mask: bool = False) -> torch.dtype:
    """The dtype the seed's mask input has: the user's float mask's, bool for a bool mask the kernels read
    (``bool_mask``), else fp32 (other bool masks and ``is_causal``)."""
    if bool_mask:
        return torch.bool
    m = spec.mask_value
    return m.meta.dtype if m is not None and m.meta.dtype.is_floating_point else torch.float32


def index_mask(spec: AttentionSpec) -> bool:
    """Whether the mask is exactly its band — 0 where the band sees, a masked floor elsewhere (``is_causal``, HF's
    ``where(j <= i, 0, min)`` causal / sliding-window masks) — so the banded seeds compute it from indices
    (``forloop_band``'s ``index_mask``) and never read it: no mask is built, packed or loaded per call."""
    if spec.mask_band is None or not spec.mask_zero_visible:
        return False
    return spec.mask in ("causal", "additive") or (spec.bool_fill is not None and spec.bool_fill <= -6e4)


def split_bias(spec: AttentionSpec) -> bool:
    """Whether the seeds take a mask added as several terms as two inputs at their own shapes — the mask term
    (:attr:`~torch_mirage.analysis.attention.AttentionSpec.mask_term`: HF's causal mask, computed from indices where
    it is exactly its band) and the sum of the others as a bias (BLOOM's ALiBi, (b, h, 1, skv)) — instead of the sum
    of every term at the scores' (b, h, sq, skv), made per call: without column sums, where the bias is not packed
    (one query head per KV head, or a program per query head) and both have a key dim."""
    if not (spec.bias_terms and not spec.extra_outputs and (spec.group == 1 or per_query_head(spec))):
        return False
    shape = bias_shape(spec)
    return shape[-1] == spec.skv and shape[-2] in (1, spec.sq) and spec.mask_term.shape[-1] == spec.skv


def bias_shape(spec: AttentionSpec) -> tuple:
    """The 4-D shape of the sum of :func:`split_bias`'s terms (their broadcast)."""
    return tuple(torch.broadcast_shapes(*(t.shape for t in spec.bias_terms)))


def run_spec(spec: AttentionSpec, compiled, q, k, v, mask=None, *, fixed: torch.Tensor | None = None,
             bool_mask: bool = False, per_head: bool = False, out_meta=None,
             bias: torch.Tensor | None = None) -> tuple:
    """The region's outputs from the compiled seed: P·V (b, h, sq, d), then each of ``spec.extra_outputs`` from
    the seed's column sums of P (b, h, skv) when it has them. Q is packed per KV head (a view where its strides
    allow it, as with one query head per KV head; else a copy), or read as it is with ``per_head``
    (:func:`per_query_head`). K and V are read with their own strides. The mask is packed (with ``per_head`` a view;
    a bool one as it is with ``bool_mask``) — the kernels hold masked scores at their floor themselves, -inf kept
    for the launches that scan it — or, where the region's mask is fixed (``fixed``: ``is_causal``'s, built once; an
    :func:`index_mask`'s broadcast stand-in, never read), that tensor. Rows whose keys are all ``-inf`` get eager's
    answer from the kernels themselves: zeros from SDPA (the seeds' ``empty_rows``), NaN from the decomposed
    softmax (0/0). Column sums (decomposed softmax only: SDPA has no P) are NaN for every key of a head with such a
    row, as eager's sum over its NaN row; a two-pass plan's column pass may skip that row's tiles (a band, a scan),
    so the heads whose row sums (its third output) are not all positive are filled — three small ops on the row
    sums, where the mask's per-row max and a fill of P·V were six (H100 11-27, h2o_core n=1024: 9 kernels a call).
    ``out_meta`` (P·V's value in the graph): where the kernel's output is P·V's shape (a head per program), the
    kernel writes it with those strides (SDPA's (b, s, h, d) order: no copy into them after the call). ``bias``
    (:func:`split_bias`): the seed's bias input, 4-D at its own shape, after the mask."""
    b, h, hk, sq, d, dv = spec.b, spec.h, spec.hk, spec.sq, spec.d, spec.v_dim
    q = q if per_head else q.reshape(b, hk, spec.group * sq, d)
    args = [_rows_dense(q), _rows_dense(k), _rows_dense(v)]
    if fixed is not None:
        args.append(fixed)
    elif (m := kernel_mask(spec, mask, q.device, bool_mask)) is not None:
        args.append(_pack(spec, m, per_head))
    if bias is not None:
        args.append(_rows_dense(bias))
    out = None
    if out_meta is not None and (per_head or spec.group == 1) and tuple(out_meta.shape) == (b, h, sq, dv):
        out = torch.empty_strided(out_meta.shape, out_meta.stride, dtype=out_meta.dtype, device=q.device)
    res = compiled(*args, outs={0: out}) if out is not None else compiled(*args)
    outs = [res[0].reshape(b, h, sq, dv)]
    if spec.extra_outputs:
        colsum = res[1]
        if len(res) > 2:           # the row sums, (b, hk, group·sq, 1): > 0 for a row that sees a key
            seen = res[2].reshape(b, h, sq).amin(-1, keepdim=True) > 0       # (b, h, 1); amin keeps a NaN
            colsum = torch.where(seen, colsum, float("nan"))
        outs += [r.apply(colsum) for r in spec.extra_outputs]
    return tuple(outs)


def _rows_dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the kernels read it: with its own strides wherever its last dim is dense (the kernels take every
    input's strides: HF's K and V, views of a projection transposed to (b, hk, s, d), are not copied per call —
    H200 11-28, HF Llama prefill 4 x 256: two of the four 3.5 us copies per layer around the attention kernel),
    else a contiguous copy."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def plan_candidates(spec: AttentionSpec, graph: Graph, mask_shape: tuple | None = None,
                    analysis: GraphAnalysis | None = None) -> list[Candidate]:
    """The kernels a plan for attention with column sums may use (:data:`.attention_seeds.PLAN_KERNELS`), each
    costed by the cost model as the IR nodes it computes and the values it writes: FlashAttention (P·V) with or
    without the row statistics, the column-sum pass (recomputes the scores, reads the statistics; under GQA only
    for a mask shared by batch rows and KV heads or given for each — ``mask_shape``, the packed mask's (bm, hm)),
    and for short KV the row-block kernel (both outputs; with more than one row block per head, plus their partial
    sums written and read once and the kernel adding them). ``analysis``: the graph's (default: computed here)."""
    analysis = analysis or analyse(graph)
    model = analysis.cost
    reductions = [x for r in spec.extra_outputs for x in r.nodes]
    skip = {id(x) for x in reductions}
    core = [x for x in spec.nodes if id(x) not in skip]
    stats, colsums = list(spec.row_stats), [r.value for r in spec.extra_outputs]
    ins = {id(x) for x in core}
    column_pass, todo, seen = [], [r.nodes[0] for r in spec.extra_outputs], set()
    while todo:                           # the nodes the column sums read back to the row statistics
        n = todo.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        column_pass.append(n)
        todo += [v.producer for v in n.inputs if v.producer is not None and id(v.producer) in ins | skip
                 and all(v is not s for s in stats)]
    order = graph.positions()
    column_pass.sort(key=lambda x: order[id(x)])

    def us(nodes, outputs) -> float:
        return analysis.region_cost(nodes, outputs=outputs).predicted_us

    cands = [Candidate("flash", us(core, [spec.output]), PLAN_KERNELS["flash"].produces),
             Candidate("flash_stats", us(core, [spec.output, *stats]), PLAN_KERNELS["flash_stats"].produces)]
    if spec.group == 1 or mask_shape is None or mask_shape[0] * mask_shape[1] in (1, spec.b * spec.hk):
        cands.append(Candidate("column_sums", us(column_pass, colsums), PLAN_KERNELS["column_sums"].produces,
                               PLAN_KERNELS["column_sums"].needs))
    if spec.skv <= ROW_BLOCK_KV:
        per_head = tiles(spec.sq, SEED_TILE)      # more than one: partial sums, and a kernel that adds them
        scratch_us = 0.0 if per_head == 1 else (2 * spec.b * spec.h * per_head * spec.skv * 4 / model.device.bandwidth
                                                + model.kernel_overhead_s) * 1e6
        cands.append(Candidate("row_block", us(spec.nodes, [spec.output, *colsums]) + scratch_us,
                               PLAN_KERNELS["row_block"].produces))
    return cands


def _seed_kwargs(spec: AttentionSpec, dtype: str, mask_shape: tuple | None, use_band: bool = True,
                 bias: tuple | None = None) -> dict:
    """The seed's parameters; a mask whose value property bounds the visible keys (causal, sliding window) gives
    the for-loop band: each query block visits only the key tiles it can see (config ``attention_band``), and
    where the mask is exactly the band (:func:`index_mask`) its partly seen tiles compute it from indices — as
    they compute the mask term where the other terms are a ``bias`` (:func:`split_bias`: its (bm, hm, br)) and
    that term is exactly its band."""
    exact = spec.band_term_exact if bias is not None else index_mask(spec)
    band = ((spec.sq, *spec.mask_band, exact or spec.mask_zero_visible, exact)
            if spec.mask_band is not None and use_band else None)
    bool_mask = bool_in_kernel(spec, use_band) and mask_shape is not None
    return dict(scale=spec.scale, softcap=spec.softcap, mask=mask_shape, dtype=dtype,
                mask_dtype=MASK_DTYPES[mask_dtype(spec, bool_mask)], band=band,
                **({"dv": spec.dv} if spec.dv else {}), **({"bias": tuple(bias)} if bias is not None else {}))


def _softmax_kwargs(spec: AttentionSpec) -> dict:
    """The online-softmax seeds' own parameters: the score a bool mask's dropped keys get, and what a row with no
    key gives (SDPA: 0; the decomposed softmax: 0/0)."""
    fill = {"mask_fill": spec.bool_fill} if spec.mask == "bool" and spec.bool_fill is not None else {}
    return fill | {"empty_rows": "nan" if spec.form == "eager" and not spec.empty_rows_zero else "zero"}


class AttentionClaimer:
    """Claims attention regions (any form :func:`find_attention` reads) and runs an attention seed μGraph."""
    name = "attention"

    def claim(self, graph: Graph, free: Sequence[Node], ctx: CompileContext) -> list[Outcome]:
        outcomes: list[Outcome] = []
        analysis = ctx.analysis_of(graph)
        for spec in find_attention(graph, free, analysis.values):
            why = self._unsupported(spec, ctx.target) or (
                None if is_convex(graph, spec.nodes) else (Reason.NOT_CONVEX, "not convex"))
            if why is not None:
                log.info("torch_mirage: attention %s not claimed (%s)", spec.describe(), why[1])
                outcomes.append(Decline(spec.nodes, *why))
                continue
            outcomes.append(self._claim(spec, graph, free, ctx))
        return outcomes

    @staticmethod
    def _unsupported(spec: AttentionSpec, target: Target) -> tuple[Reason, str] | None:
        metas = [x.meta for x in (spec.q, spec.k, spec.v, spec.output)]
        if len({m.dtype for m in metas[:3]}) != 1 or spec.dtype not in DTYPES:
            return Reason.UNSUPPORTED_DTYPE, "inputs of mixed or unsupported dtypes"
        if not all(m.is_static for m in metas):
            return Reason.DYNAMIC_SHAPE, "dynamic shapes"
        device = metas[0].device.type
        if not target.runs_on(device):
            return Reason.UNSUPPORTED_DEVICE, f"{device} tensors without Triton's interpreter"
        if target is Target.INTERPRETER and spec.dtype == torch.bfloat16:
            return Reason.UNSUPPORTED_DTYPE, "bf16 in Triton's interpreter"
        masks = spec.inputs[3:]
        if not all(m.meta and m.meta.is_static for m in masks):
            return Reason.DYNAMIC_SHAPE, "a mask of dynamic shape"
        if spec.dv and spec.extra_outputs:
            return Reason.NO_KERNEL, "column sums of P with V's head size unlike Q's (no such plan)"
        key_tile = spec.skv // tiles(spec.skv, SEED_TILE)
        if spec.extra_outputs and key_tile < DOT_MIN <= spec.skv:
            # a KV length with no divisor from 16 to 128 (131, a prime; 2·131): the seeds walk tiles of one or a
            # few keys (and rows), which a launch re-tiles into whole tiles with a ragged last one
            # (launch.ragged_walk, launch.ragged_rows) — but not a column-sum pass: its keys are the programs'
            return Reason.NO_KERNEL, (f"a KV length of {spec.skv} keys, whose tiles of at most "
                                      f"{2 * SEED_TILE} keys would be {key_tile} key(s) long, with column sums of P")
        return None

    def _claim(self, spec: AttentionSpec, graph: Graph, free: Sequence[Node], ctx: CompileContext) -> Outcome:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        dtype = DTYPES[spec.dtype]
        use_band = ctx.config.attention_band
        bias = split_bias(spec)
        # the mask from indices only where every kernel of the plan walks the band (the row-block kernel has none)
        by_index = use_band and spec.mask_band is not None and spec.band_term_exact if bias else \
            use_band and index_mask(spec) and not (spec.extra_outputs and "row_block" in
                                                   _plan(plan_candidates(spec, graph, (1, 1), ctx.analysis_of(graph))))
        bool_mask = bool_in_kernel(spec, use_band)
        per_head = per_query_head(spec)
        with unset_fake_temporarily():
            _, mask_shape, fixed = _example_mask(spec, graph, spec.q.meta.device, by_index, bool_mask, per_head,
                                                 bias=bias)
        kwargs = _seed_kwargs(spec, dtype, mask_shape, use_band, bias_shape(spec)[:3] if bias else None)
        if spec.extra_outputs:
            plans, info, names = self._column_plan(spec, graph, kwargs, ctx.analysis_of(graph))
            seeds, info["verified"] = verified(plans, names, (spec.b, spec.hk, spec.group, spec.sq, spec.skv),
                                               kwargs, ctx.config, ctx.cache)
        else:
            names, built_with = _seeds(spec, per_head, bias), kwargs | _softmax_kwargs(spec)
            seeds, verdicts = verified(_build_seeds(spec, names, built_with), names,
                                       (spec.b, spec.hk, spec.group, spec.sq, spec.skv), built_with, ctx.config,
                                       ctx.cache)
            info = {"verified": verdicts}
        if not seeds:
            what = "the column-sum plan" if spec.extra_outputs else "attention seeds"
            why = "; ".join(f"{k}: {v}" for k, v in info.get("verified", {}).items())
            return Decline(spec.nodes, Reason.NO_KERNEL, f"{what} ({spec.describe()}): none built"
                           + (f" and verified ({why})" if why else ""))
        # a mask the kernel computes from indices: the nodes that build it only for this region join it (dead) —
        # unless they build a bias term too, which the kernel reads
        nodes = spec.nodes + (_mask_builders(spec, graph, free) if by_index else [])
        positions = {id(x): i for i, x in enumerate(inputs_of(nodes))}
        if bias and any(id(t.value) not in positions for t in spec.bias_terms):
            nodes = spec.nodes
            positions = {id(x): i for i, x in enumerate(inputs_of(nodes))}
        # the bias terms' inputs, then the mask term's (none where the kernels compute it from indices)
        bias_at = ([positions[id(t.value)] for t in spec.bias_terms]
                   + ([] if by_index else [positions[id(spec.mask_term.value)]])) if bias else None
        order = [positions[id(x)] for x in spec.inputs if id(x) in positions]
        produced = [spec.output] + [r.value for r in spec.extra_outputs]
        slots = [next(i for i, p in enumerate(produced) if p is v) for v in outputs_of(nodes, graph)]
        metas = [v.meta for v in produced]
        alternatives = []
        for name, kgraph in seeds:
            bands = [op.body.forloop_band for op in kgraph.ops if getattr(op.body, "forloop_band", None) is not None]
            alternatives.append(Alternative(name, kgraph, f"attention {name} ({spec.describe()})",
                                            {"ugraph": name, **({"forloop_band": list(bands[0])} if bands else {})}))
        info = {"attention": spec.describe(), "dtype": dtype, **info}
        if bool_mask and mask_shape is not None:
            info["mask"] = "bool, read in the kernel"
        if per_head:
            info["layout"] = "a program per query head: Q, K, V and the mask read as they are"
        if by_index:
            info["mask"] = "from indices" + (f" ({len(nodes) - len(spec.nodes)} mask nodes joined)"
                                             if len(nodes) > len(spec.nodes) else "")
        if bias:
            info["mask"] = ("the band's term from indices" if by_index else f"a term at {spec.mask_term.shape}") + \
                f", the other {len(spec.bias_terms)} term(s) loaded as a bias {bias_shape(spec)}"
        plan = UGraphPlan(alternatives, functools.partial(_example_inputs, spec, graph, by_index, bool_mask,
                                                          per_head, ctx.observed_inputs, bias),
                          functools.partial(attention_kernel, spec, order, slots, metas, fixed, bool_mask, per_head,
                                            bias_at),
                          what=f"attention {spec.describe()} {dtype}")
        return Claim(nodes, plan, detail=alternatives[0].detail, info=info)

    @staticmethod
    def _column_plan(spec: AttentionSpec, graph: Graph, kwargs: dict, analysis: GraphAnalysis
                     ) -> tuple[list, dict, dict]:
        """P·V and the column sums of P by the plan the BLP picks among :func:`plan_candidates`: ``([(name,
        μGraph)], info, {name: what builds it})`` (:mod:`.attention_verify` builds it again, small), no μGraph where
        none is valid."""
        cands = plan_candidates(spec, graph, kwargs["mask"], analysis)
        info = {"plan_us": {c.name: round(c.cost_us, 2) for c in cands}}
        try:
            names = info["plan"] = _plan(cands)
        except Exception as e:   # no plan: left to Inductor
            log.info("torch_mirage: no attention plan for %s (%s: %s)", spec.describe(), type(e).__name__, e)
            return [], info, {}
        built, how = [], {}
        # a mask passed in: the plan again with its tile table, whose scanning launches both passes may take
        for table in (False, True) if spec.mask == "additive" else (False,):
            try:
                own = dict(group=spec.group, kernels=tuple(names), tile=SEED_TILE, scan_table=table, row_sums=True)
                kg = attention_column_sums(spec.b, spec.hk, spec.group * spec.sq, spec.skv, spec.d, **own, **kwargs)
                validate(kg)
                name = "+".join(names) + ("/scan" if table else "")
                built.append((name, kg))
                how[name] = ("column_sums", own)
            except Exception as e:   # a plan that does not build for these shapes: left out (none: to Inductor)
                log.info("torch_mirage: attention plan %s%s for %s not used (%s: %s)", names, " with a scan table"
                         if table else "", spec.describe(), type(e).__name__, e)
        return built, info, how


def attention_kernel(spec: AttentionSpec, order: Sequence[int], slots: Sequence[int], metas: Sequence,
                     fixed: torch.Tensor | None, bool_mask: bool, per_head: bool, bias_at: Sequence[int] | None,
                     compiled) -> Callable[..., tuple]:
    """The region's kernel from a compiled attention μGraph (:func:`run_spec`): the region's inputs in the spec's
    order (``order``), its outputs (``slots`` into P·V and the column reductions) with the graph's strides.
    ``bias_at``: the inputs holding :func:`split_bias`'s bias terms (summed at their own shape), then its mask
    term's, where the kernels read it (else ``fixed``'s stand-in)."""
    n_bias = len(spec.bias_terms)

    def kernel(*ins):
        args = [ins[i] for i in order]
        bias = None
        if bias_at is not None:     # the mask term (or the stand-in of one computed from indices) and a bias
            bias = spec.combine_mask([ins[i] for i in bias_at[:n_bias]], spec.bias_terms)
            mask_at = bias_at[n_bias:]
            args = args[:3] + ([spec.combine_mask([ins[mask_at[0]]], [spec.mask_term])] if mask_at else [])
        elif spec.mask_terms:       # a mask the graph adds as several tensors: their sum
            args[3:] = [spec.combine_mask(args[3:])]
        # an SDPA op's other outputs (logsumexp, ...) are unread (find_attention checks)
        outs = run_spec(spec, compiled, *args, fixed=fixed, bool_mask=bool_mask,
                        per_head=per_head, out_meta=metas[0], bias=bias)
        return tuple(with_meta_strides(outs[i], metas[i]) for i in slots)
    return kernel


def _plan(cands: list[Candidate]) -> list[str]:
    """The kernels of the cheapest plan producing P·V and the column sums (:func:`.plan_select.select_plan`)."""
    return [c.name for c in select_plan(cands, ("out", "colsum"))]


def _mask_builders(spec: AttentionSpec, graph: Graph, free: Sequence[Node]) -> list[Node]:
    """The nodes that compute the region's mask from the graph's constants alone and whose values only the region
    (or each other) reads: with an :func:`index_mask` they are dead. Empty where a graph input reaches the mask or
    something else reads it (an HF mask shared by every layer: built once per call, passed and not read)."""
    if spec.mask_value is None or spec.mask_value.producer is None:
        return []
    pool, region = {id(n) for n in free}, {id(n) for n in spec.nodes}
    found, stack = {}, [spec.mask_value.producer]
    while stack:
        n = stack.pop()
        if id(n) in found:
            continue
        if id(n) not in pool or id(n) in region:
            return []
        found[id(n)] = n
        for x in n.inputs:
            if x.producer is not None:
                stack.append(x.producer)
            elif x.name not in graph.constants:
                return []                              # a graph input reaches the mask
    inside = region | set(found)
    outs = {id(x) for x in graph.output_values}
    if any(id(w) in outs or any(id(u) not in inside for u in w.users) for n in found.values() for w in n.outputs):
        return []
    order = graph.positions()
    return sorted(found.values(), key=lambda x: order[id(x)])


def _example_inputs(spec: AttentionSpec, graph: Graph, by_index: bool = False, bool_mask: bool = False,
                    per_head: bool = False, observed: dict | None = None, bias: bool = False) -> list:
    """The seeds' example inputs (:func:`_examples`), made by the build stage when it compiles them; ``observed``:
    the compile's real inputs by graph input index (:attr:`CompileContext.observed_inputs`, emptied after the
    build); ``bias`` (:func:`split_bias`): the mask term alone, then the bias terms' sum."""
    ex = _examples(spec, graph, by_index, bool_mask, per_head, observed, bias)[0]
    if bias:
        terms = _term_examples(graph, spec.bias_terms, observed)
        ex.append(spec.combine_mask(terms, spec.bias_terms).to(mask_dtype(spec)))
    return ex


def _examples(spec: AttentionSpec, graph: Graph, by_index: bool = False, bool_mask: bool = False,
              per_head: bool = False, observed: dict | None = None, bias: bool = False
              ) -> tuple[list, tuple | None, torch.Tensor | None]:
    """Random inputs shaped as the seeds take them (Q packed per KV head and the mask packed, or both as they are
    with ``per_head``), with the graph's strides, the mask's batch/head
    dims, and the region's fixed mask: ``is_causal``'s (built once, clamped) or, with ``by_index`` (an
    :func:`index_mask`), a broadcast stand-in the kernels never read. A mask the graph computes from constants
    keeps its real contents: launch tuning compares re-tilings whose bands skip the tiles it hides; so does a mask
    computed from the call's own inputs where ``observed`` holds them (the scan's tiles it skips,
    :func:`~.launch.scanning`)."""
    q, k, v = (random_like(x.meta) for x in (spec.q, spec.k, spec.v))
    q = q if per_head else q.reshape(spec.b, spec.hk, spec.group * spec.sq, spec.d)
    ex = [_rows_dense(q), _rows_dense(k), _rows_dense(v)]
    mask, mask_shape, causal = _example_mask(spec, graph, q.device, by_index, bool_mask, per_head, observed, bias)
    return ex + ([mask] if mask is not None else []), mask_shape, causal


def _example_mask(spec: AttentionSpec, graph: Graph, device: torch.device, by_index: bool = False,
                  bool_mask: bool = False, per_head: bool = False, observed: dict | None = None, bias: bool = False
                  ) -> tuple[torch.Tensor | None, tuple | None, torch.Tensor | None]:
    """The mask part of :func:`_examples` (no Q, K, V drawn: the claim needs only the mask's dims and the fixed
    mask): the packed example mask or None (unmasked), its batch/head dims, the region's fixed mask. ``bias``
    (:func:`split_bias`): the mask term alone."""
    if by_index:
        rows = spec.sq if per_head else spec.group * spec.sq
        standin = torch.zeros((), dtype=mask_dtype(spec), device=device).expand(1, 1, rows, spec.skv)
        return standin, (1, 1), standin
    if spec.mask == "none":
        return None, None, None
    example_mask = None
    if spec.mask_value is not None:
        if bias:
            example_mask = spec.combine_mask(_term_examples(graph, [spec.mask_term], observed),
                                             [spec.mask_term])
        else:
            terms = _term_examples(graph, spec.mask_terms or [spec.mask_value], observed)
            example_mask = spec.combine_mask(terms) if spec.mask_terms else terms[0]
    packed = packed_mask(spec, example_mask, device, bool_mask, per_head).to(mask_dtype(spec, bool_mask))
    causal = packed.clamp_min(MASK_FLOOR).contiguous() if spec.mask == "causal" else None
    return packed, tuple(packed.shape[:2]), causal


def _term_examples(graph: Graph, terms: Sequence, observed: dict | None) -> list:
    """Example tensors of mask ``terms`` (MaskTerms, or Values): a term the graph computes from constants (or from
    the compile's ``observed`` inputs) with its real contents, else random."""
    named = {graph.inputs[i].name: t for i, t in (observed or {}).items() if i < len(graph.inputs)}
    values = [getattr(t, "value", t) for t in terms]
    return [t if (t := constant_value(graph, m, named)) is not None else random_like(m.meta) for m in values]


def _seeds(spec: AttentionSpec, per_head: bool = False, bias: bool = False) -> dict[str, tuple[str, dict]]:
    """The seeds to build for attention without column sums, by the name they are timed and reported under: the
    seed and its own parameters. FlashAttention, and split-KV where KV is long enough to split. Decode — one row
    block of queries (the heads of a KV head packed, a few tokens each) — builds split-KV at each of
    :func:`.attention_seeds.decode_split_counts` (``flash_decoding/<splits>``), and FlashAttention (a program per
    batch row and KV head, whose launches split KV too: each tile's last split program folds the states, one
    kernel where ``flash_decoding`` takes two). Split-KV is left out where the query rows alone fill the SMs
    (:func:`rows_fill_the_sms`: prefill). Prefill with an additive mask also builds FlashAttention with the
    mask's tile table (``flash_attention/scan``: timed against the others on the compiled call's mask).
    ``per_head`` (:func:`per_query_head`, where no split-KV seed is built): each with a program per query head.
    ``bias`` (:func:`split_bias`): no tile-table seed (its table covers one mask)."""
    seeds: dict[str, tuple[str, dict]] = {"flash_attention": ("flash_attention", {})}
    if spec.group * spec.sq <= SEED_TILE:
        bh, n_sm = spec.b * spec.hk, DeviceModel.current().sm_count
        counts = decode_split_counts(bh, spec.skv, n_sm)
        if counts:
            return {f"flash_decoding/{s}": ("flash_decoding", {"splits": s}) for s in counts} | {
                "flash_attention": ("flash_attention", {})}
    if blocks(spec.skv, SPLIT_KV) > 1 and not rows_fill_the_sms(spec):
        seeds["flash_decoding"] = ("flash_decoding", {})
    if spec.mask == "additive" and not bias:  # a mask passed in: its tile table lets the launches skip what it
        seeds["flash_attention/scan"] = ("flash_attention", {"scan_table": True})   # hides (refused under a band)
    if per_head:
        seeds = {name: (seed, {**own, "q_heads": spec.h}) for name, (seed, own) in seeds.items()}
    return seeds


def per_query_head(spec: AttentionSpec) -> bool:
    """Whether the seeds run a program per query head (FlashAttention's ``q_heads``: the programs of a group read
    their KV head's tiles) instead of packing a KV head's query heads into the rows of its programs: GQA prefill
    without column sums, whose heads' own rows fill row blocks (``PREFILL_MIN_ROWS`` of them) and where
    FlashAttention is the only seed (no split-KV: :func:`rows_fill_the_sms`, or KV too short to split). Q, the mask
    and the output are then the region's own tensors; packed rows copy Q and a head-shared mask per call (H200
    11-28, HF Llama prefill 4 x 256, 16 query / 8 KV heads: the region 30.4 us around a 9.8 us kernel)."""
    mask = spec.mask_shape
    heads = mask[-3] if mask else 1                             # the mask's own heads: shared, or one per query head
    return (spec.group > 1 and not spec.extra_outputs and spec.sq >= PREFILL_MIN_ROWS and heads in (1, spec.h)
            and (blocks(spec.skv, SPLIT_KV) <= 1 or rows_fill_the_sms(spec)))


def rows_fill_the_sms(spec: AttentionSpec) -> bool:
    """Whether FlashAttention's programs over ``spec``'s query rows alone (a block of ``SEED_TILE`` rows per batch
    row and KV head, the smallest row tile the prefill launches take) make ``ROW_WAVES`` waves of the device's
    SMs: then the split-KV seed is not built."""
    programs = spec.b * spec.hk * tiles(spec.group * spec.sq, SEED_TILE)
    return programs >= ROW_WAVES * DeviceModel.current().sm_count


# _build_seeds' answers in this process by what they are built from (μGraphs are immutable): a model's next layer
# gets the same seeds without building and validating them again
_BUILT = ProcessMemo(64)


def _build_seeds(spec: AttentionSpec, names: dict[str, tuple[str, dict]], kwargs: dict) -> list[tuple[str, KernelGraph]]:
    """Each seed of ``names`` (name: the seed and its own parameters) instantiated for ``spec`` and valid at its
    shapes (the build stage compiles them); one that does not build is left out."""
    key = repr((spec.b, spec.hk, spec.group, spec.sq, spec.skv, spec.d, sorted(names.items()),
                sorted(kwargs.items())))
    return list(_BUILT.get(key, lambda: _build_seeds_once(spec, names, kwargs)))


def _build_seeds_once(spec: AttentionSpec, names: dict[str, tuple[str, dict]], kwargs: dict
                      ) -> list[tuple[str, KernelGraph]]:
    built = []
    for name, (seed, own) in names.items():
        try:
            rows = spec.sq if own.get("q_heads") else spec.group * spec.sq      # per_query_head: a head's rows
            kg = SEEDS[seed](spec.b, spec.hk, rows, spec.skv, spec.d, **kwargs, **own)
            validate(kg)
            built.append((name, kg))
        except Exception as e:   # a seed that does not build for these shapes: not used
            log.info("torch_mirage: attention seed %s for %s not used (%s: %s)", name, spec.describe(),
                     type(e).__name__, e)
    return built
