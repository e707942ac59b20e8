"""The attention claimer: attention regions found by analysis (:mod:`torch_mirage.analysis.attention`) run a seed
μGraph (:mod:`.attention_seeds`) instantiated from their :class:`AttentionSpec`.

Whatever form the region came in — HF eager code with ``repeat_kv``, an SDPA ATen op, a hand-written softmax —
it becomes Q packed per KV head (b, hk, g·sq, d), K and V as they are, and, when masked, one additive fp32 mask
(b, hk, g·sq, skv): a bool mask becomes ``where(keep, 0, fill)``, ``is_causal`` a top-left triangle of ``-inf``,
and every mask is clamped at ``-1e30`` so that a tile or split whose keys are all masked stays finite inside the
online softmax. Rows whose keys are all masked (padding) get what the form gives in eager: SDPA returns zeros,
the decomposed softmax NaN for ``-inf`` masks, and a uniform average for the finite ``finfo.min`` masks HF builds —
which is what the clamped mask gives by itself.

Where KV is long enough to split, the split-KV seed is compiled as well and on a GPU the faster runs (the library
claimer's timing, :func:`.claim._fastest`): it fills the SMs where few query rows — decode — leave FlashAttention's
grid small. The backend then checks the region against eager ATen on random inputs, as for every region.
"""
from __future__ import annotations

import logging
import os
from types import SimpleNamespace
from typing import Any, Sequence

import torch

from ..analysis.attention import AttentionSpec, find_attention
from ..capture.ir import Graph, Node
from ..partition.region import Reason, Region, is_convex
from .attention_seeds import SEEDS
from .library import blocks

log = logging.getLogger("torch_mirage")

DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
MASK_FLOOR = -1e30        # masked scores: finite, so an all-masked tile keeps exp(s - m) defined
SPLIT_KV = 256            # KV length per split of the split-KV seed's default schedule (4 tiles of 64)


def additive_mask(spec: AttentionSpec, mask: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """The spec's mask as fp32 scores to add, broadcast to (b, h, sq, skv) (None: unmasked)."""
    if spec.mask == "causal":
        keep = torch.ones(spec.sq, spec.skv, dtype=torch.bool, device=device).tril()
        return torch.zeros(keep.shape, device=device).masked_fill(~keep, float("-inf")).expand(
            spec.b, spec.h, spec.sq, spec.skv)
    if mask is None:
        return None
    if spec.mask == "bool":
        mask = torch.where(mask, 0.0, spec.bool_fill)
    elif spec.mask == "bool_inverted":
        mask = torch.where(mask, spec.bool_fill, 0.0)
    return mask.float().expand(spec.b, spec.h, spec.sq, spec.skv)


def run_spec(spec: AttentionSpec, compiled, q, k, v, mask=None) -> torch.Tensor:
    """The region's output from the compiled seed: Q packed per KV head, the mask made additive."""
    b, h, hk, sq, skv, d = spec.b, spec.h, spec.hk, spec.sq, spec.skv, spec.d
    args = [q.contiguous().reshape(b, hk, (h // hk) * sq, d), k.contiguous(), v.contiguous()]
    full = additive_mask(spec, mask, q.device)
    if full is not None:
        args.append(full.clamp_min(MASK_FLOOR).reshape(b, hk, (h // hk) * sq, skv))
    out = compiled(*args)[0].reshape(b, h, sq, d)
    if full is not None and spec.mask != "causal":
        empty = (full.amax(-1, keepdim=True) == float("-inf"))    # rows with every key masked by -inf
        if spec.form == "eager":
            out = out.masked_fill(empty, float("nan"))
        else:
            out = out.masked_fill(empty, 0.0)
    return out


def _seed_kwargs(spec: AttentionSpec, dtype: str) -> dict:
    return dict(scale=spec.scale, softcap=spec.softcap, masked=spec.mask != "none", dtype=dtype)


class AttentionClaimer:
    """Claims attention regions (any form :func:`find_attention` reads) and runs an attention seed μGraph."""
    name = "attention"

    def claim(self, graph: Graph, free: Sequence[Node], ctx: Any) -> list[Region]:
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        regions = []
        for spec in find_attention(graph, free):
            why = self._unsupported(spec, interpret)
            if why or not is_convex(graph, spec.nodes):
                log.info("torch_mirage: attention %s not claimed (%s)", spec.describe(), why or "not convex")
                continue
            region = self._region(spec, ctx)
            if region is not None:
                regions.append(region)
        return regions

    @staticmethod
    def _unsupported(spec: AttentionSpec, interpret: bool) -> str:
        metas = [x.meta for x in (spec.q, spec.k, spec.v, spec.output)]
        if len({m.dtype for m in metas[:3]}) != 1 or spec.dtype not in DTYPES:
            return "inputs of mixed or unsupported dtypes"
        if not all(m.is_static for m in metas):
            return "dynamic shapes"
        device = metas[0].device.type
        if device not in ("cuda", "cpu") or (device == "cpu" and not interpret):
            return f"{device} tensors without Triton's interpreter"
        if interpret and spec.dtype == torch.bfloat16:
            return "bf16 in Triton's interpreter"
        if spec.mask_value is not None and not (spec.mask_value.meta and spec.mask_value.meta.is_static):
            return "a mask of dynamic shape"
        return ""

    def _region(self, spec: AttentionSpec, ctx: Any) -> Region | None:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        from ..runtime.measure import random_like
        from .claim import _fastest
        from .compile import compile_ugraph

        dtype = DTYPES[spec.dtype]
        rows = spec.group * spec.sq
        names = ["flash_attention"] + (["flash_decoding"] if blocks(spec.skv, SPLIT_KV) > 1 else [])
        cache = getattr(ctx, "cache", None)
        with unset_fake_temporarily():
            q, k, v = (random_like(x.meta) for x in (spec.q, spec.k, spec.v))
            ex = [q.reshape(spec.b, spec.hk, rows, spec.d), k.contiguous(), v.contiguous()]
            if spec.mask != "none":
                ex.append(torch.zeros(spec.b, spec.hk, rows, spec.skv, device=q.device))
            built = []
            for name in names:
                try:
                    kg = SEEDS[name](spec.b, spec.hk, rows, spec.skv, spec.d, **_seed_kwargs(spec, dtype))
                    built.append((SimpleNamespace(name=name), kg, compile_ugraph(kg, ex, cache=cache)))
                except Exception as e:   # a seed that does not build for these shapes: not used
                    log.info("torch_mirage: attention seed %s for %s not used (%s: %s)", name, spec.describe(),
                             type(e).__name__, e)
            if not built:
                return None
            (chosen, kgraph, compiled), times = _fastest(built, ex, cache)
        region = Region(spec.nodes, "mirage", Reason.CLAIMED, detail=f"attention {chosen.name} ({spec.describe()})",
                        plan=kgraph)
        positions = {id(x): i for i, x in enumerate(region.inputs)}
        order = [positions[id(x)] for x in spec.inputs]
        out_meta = spec.output.meta

        def kernel(*ins):
            out = run_spec(spec, compiled, *[ins[i] for i in order])
            if not out_meta.is_contiguous:
                out = torch.empty_strided(out_meta.shape, out_meta.stride, dtype=out.dtype,
                                          device=out.device).copy_(out)
            return (out,)   # an SDPA op's other outputs (logsumexp, ...) are unread (find_attention checks)

        region.kernel = kernel
        region.info = {"ugraph": chosen.name, "attention": spec.describe(), "dtype": dtype,
                       "ugraph_hash": kgraph.hash()[:16]}
        if times:
            region.info["ugraph_us"] = {n: round(us, 2) for n, us in times.items()}
        return region
