"""The attention claimer: attention regions found by analysis (:mod:`torch_mirage.analysis.attention`) run a seed
μGraph (:mod:`.attention_seeds`) instantiated from their :class:`AttentionSpec`.

Whatever form the region came in — HF eager code with ``repeat_kv``, an SDPA ATen op, a hand-written softmax —
it becomes Q packed per KV head (b, hk, g·sq, d), K and V as they are, and, when masked, one additive mask
(bm, hm, g·sq, skv), shared over batch rows and heads where the user's is: a bool mask becomes ``where(keep, 0,
fill)``, ``is_causal`` a top-left triangle of ``-inf`` (built once per region), and every mask is clamped at
``-1e30`` (or its dtype's floor) so that a tile or split whose keys are all masked stays finite inside the
online softmax. Rows whose keys are all masked (padding) get what the form gives in eager: SDPA returns zeros,
the decomposed softmax NaN for ``-inf`` masks, and a uniform average for the finite ``finfo.min`` masks HF builds —
which is what the clamped mask gives by itself.

Where KV is long enough to split, the split-KV seed is compiled as well and on a GPU the faster runs (the library
claimer's timing, :func:`.claim._fastest`): it fills the SMs where few query rows — decode — leave FlashAttention's
grid small. The backend then checks the region against eager ATen on random inputs, as for every region.
"""
from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Sequence

import torch
from .compile import compile_ugraph
from .claim import _fastest

from ..analysis.attention import AttentionSpec, find_attention
from ..capture.ir import Graph, Node
from ..capture.lower import constant_value
from ..context import CompileContext, Target
from ..partition.region import Claim, Decline, Outcome, Reason, inputs_of, is_convex
from .attention_seeds import SEEDS
from .library import blocks
from ..timing import random_like

log = logging.getLogger("torch_mirage")

DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
MASK_FLOOR = -1e30        # masked scores: finite, so an all-masked tile keeps exp(s - m) defined
SPLIT_KV = 256            # KV length per split of the split-KV seed's default schedule (4 tiles of 64)


def packed_mask(spec: AttentionSpec, mask: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """The spec's mask as scores to add, (bm, hm, g·sq, skv) with bm ∈ {1, b}, hm ∈ {1, hk}: a mask shared by all
    batch rows / heads stays shared (an HF (1, 1, n, n) causal mask is not copied per head); a per-head one is a
    view of the user's; a head-shared one under GQA repeats its rows once per head of a group. Bool masks become
    fp32 ``where(keep, 0, fill)``; None when unmasked."""
    b, h, hk, sq, skv, g = spec.b, spec.h, spec.hk, spec.sq, spec.skv, spec.group
    if spec.mask == "causal":
        keep = torch.ones(sq, skv, dtype=torch.bool, device=device).tril()
        mask = torch.zeros(keep.shape, device=device).masked_fill(~keep, float("-inf"))
    elif mask is None:
        return None
    elif spec.mask == "bool":
        mask = torch.where(mask, 0.0, spec.bool_fill)
    elif spec.mask == "bool_inverted":
        mask = torch.where(mask, spec.bool_fill, 0.0)
    m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    bm = b if m.shape[0] == b else 1
    if m.shape[1] == h and h > 1:
        return m.expand(bm, h, sq, skv).reshape(bm, hk, g * sq, skv)
    m = m.expand(bm, 1, sq, skv)
    return m.repeat(1, 1, g, 1) if g > 1 else m


def mask_dtype(spec: AttentionSpec) -> torch.dtype:
    """The dtype the seed's mask input has: the user's float mask's, fp32 for bool masks and ``is_causal``."""
    m = spec.mask_value
    return m.meta.dtype if m is not None and m.meta.dtype.is_floating_point else torch.float32


def run_spec(spec: AttentionSpec, compiled, q, k, v, mask=None, *, causal: torch.Tensor | None = None) -> torch.Tensor:
    """The region's output from the compiled seed: Q packed per KV head, the mask packed and clamped at the
    dtype's floor (finite: an all-masked tile or split keeps the online softmax defined). Rows whose keys are
    all ``-inf`` get eager's answer: zeros from SDPA, NaN from the decomposed softmax."""
    b, h, hk, sq, d = spec.b, spec.h, spec.hk, spec.sq, spec.d
    rows = spec.group * sq
    args = [q.contiguous().reshape(b, hk, rows, d), k.contiguous(), v.contiguous()]
    if causal is not None:
        args.append(causal)
        return compiled(*args)[0].reshape(b, h, sq, d)
    packed = packed_mask(spec, mask, q.device)
    if packed is not None:
        args.append(packed.clamp_min(max(MASK_FLOOR, torch.finfo(packed.dtype).min)))
    out = compiled(*args)[0]
    if packed is not None:
        empty = packed.amax(-1, keepdim=True) == float("-inf")
        out = out.masked_fill(empty, float("nan") if spec.form == "eager" else 0.0)
    return out.reshape(b, h, sq, d)


def _seed_kwargs(spec: AttentionSpec, dtype: str, mask_shape: tuple | None, use_band: bool = True) -> dict:
    """The seed's parameters; a mask whose value property bounds the visible keys (causal, sliding window) gives
    the for-loop band: each query block visits only the key tiles it can see (config ``attention_band``)."""
    band = (spec.sq, *spec.mask_band, spec.mask_zero_visible) if spec.mask_band is not None and use_band else None
    return dict(scale=spec.scale, softcap=spec.softcap, mask=mask_shape, dtype=dtype,
                mask_dtype=DTYPES[mask_dtype(spec)], band=band)


class AttentionClaimer:
    """Claims attention regions (any form :func:`find_attention` reads) and runs an attention seed μGraph."""
    name = "attention"

    def claim(self, graph: Graph, free: Sequence[Node], ctx: CompileContext) -> list[Outcome]:
        outcomes: list[Outcome] = []
        for spec in find_attention(graph, free):
            why = self._unsupported(spec, ctx.target) or (
                None if is_convex(graph, spec.nodes) else (Reason.NOT_CONVEX, "not convex"))
            if why is not None:
                log.info("torch_mirage: attention %s not claimed (%s)", spec.describe(), why[1])
                outcomes.append(Decline(spec.nodes, *why))
                continue
            outcomes.append(self._claim(spec, graph, ctx))
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
        if spec.mask_value is not None and not (spec.mask_value.meta and spec.mask_value.meta.is_static):
            return Reason.DYNAMIC_SHAPE, "a mask of dynamic shape"
        return None

    def _claim(self, spec: AttentionSpec, graph: Graph, ctx: CompileContext) -> Outcome:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        dtype = DTYPES[spec.dtype]
        rows = spec.group * spec.sq
        use_band = ctx.config.attention_band
        names = ["flash_attention"] + (["flash_decoding"] if blocks(spec.skv, SPLIT_KV) > 1 else [])
        cache = ctx.cache
        with unset_fake_temporarily():
            q, k, v = (random_like(x.meta) for x in (spec.q, spec.k, spec.v))
            ex = [q.reshape(spec.b, spec.hk, rows, spec.d), k.contiguous(), v.contiguous()]
            mask_shape = causal = None
            if spec.mask != "none":
                example_mask = None
                if spec.mask_value is not None:   # a mask made from constants: tuned on its real contents (the
                    example_mask = constant_value(graph, spec.mask_value)   # band's re-tilings skip its tiles)
                    if example_mask is None:
                        example_mask = random_like(spec.mask_value.meta)
                packed = packed_mask(spec, example_mask, q.device).to(mask_dtype(spec))
                mask_shape = tuple(packed.shape[:2])
                ex.append(packed)
                if spec.mask == "causal":   # a constant of the region: built once, clamped
                    causal = packed.clamp_min(MASK_FLOOR).contiguous()
            built = []
            for name in names:
                try:
                    kg = SEEDS[name](spec.b, spec.hk, rows, spec.skv, spec.d,
                                     **_seed_kwargs(spec, dtype, mask_shape, use_band))
                    built.append((SimpleNamespace(name=name), kg, compile_ugraph(kg, ex, cache=cache)))
                except Exception as e:   # a seed that does not build for these shapes: not used
                    log.info("torch_mirage: attention seed %s for %s not used (%s: %s)", name, spec.describe(),
                             type(e).__name__, e)
            if not built:
                return Decline(spec.nodes, Reason.NO_KERNEL, f"attention seeds {', '.join(names)} ({spec.describe()})")
            (chosen, kgraph, compiled), times = _fastest(built, ex, cache)
        positions = {id(x): i for i, x in enumerate(inputs_of(spec.nodes))}
        order = [positions[id(x)] for x in spec.inputs]
        out_meta = spec.output.meta

        def kernel(*ins):
            out = run_spec(spec, compiled, *[ins[i] for i in order], causal=causal)
            if not out_meta.is_contiguous:
                out = torch.empty_strided(out_meta.shape, out_meta.stride, dtype=out.dtype,
                                          device=out.device).copy_(out)
            return (out,)   # an SDPA op's other outputs (logsumexp, ...) are unread (find_attention checks)

        info = {"ugraph": chosen.name, "attention": spec.describe(), "dtype": dtype, "ugraph_hash": kgraph.hash()[:16]}
        bands = [op.body.forloop_band for op in kgraph.ops if getattr(op.body, "forloop_band", None) is not None]
        if bands:
            info["forloop_band"] = list(bands[0])
        if times:
            info["ugraph_us"] = {n: round(us, 2) for n, us in times.items()}
        return Claim(spec.nodes, kgraph, kernel, detail=f"attention {chosen.name} ({spec.describe()})", info=info)
