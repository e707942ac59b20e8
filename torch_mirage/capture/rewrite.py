"""Rewrites of the functional ATen graph before it is lowered: what they change, mirage's IR and every Inductor
fallback partition see alike (both start from the rewritten FX graph).

* :func:`outer_products`: a matmul whose contraction dim is 1 — ``a (…, m, 1) @ b (…, 1, n)`` — is the broadcast
  product ``a * b``, one multiply per element as the matmul's. HF's rotary embedding computes its angles this
  way (``inv_freq[None, :, None] @ position_ids[:, None, :]`` in fp32), which Inductor hands to cuBLAS as a bmm
  of its own every step (H100 11-27, Llama decode b1: a 2.9 µs SGEMM kernel beside the 1.3 µs cos / sin kernel
  it would otherwise fuse into).
"""
from __future__ import annotations

import torch
from torch import fx

aten = torch.ops.aten
_MATMULS = (aten.mm.default, aten.bmm.default)


def _product_strides(a: torch.Tensor, b: torch.Tensor) -> tuple | None:
    """The strides ``a * b`` gets (computed on the meta values, in their fake mode where they have one)."""
    mode = getattr(a, "fake_mode", None)
    try:
        if mode is not None:
            with mode:
                return tuple(torch.mul(a, b).stride())
        return tuple(torch.mul(a, b).stride())
    except Exception:     # unknown: keep the matmul's layout by a copy
        return None


def outer_products(gm: fx.GraphModule) -> int:
    """``mm`` / ``bmm`` with a contraction dim of static size 1 → ``mul`` of the same operands (broadcast).
    Returns how many were rewritten; the graph is recompiled where any was."""
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _MATMULS or len(node.args) != 2 or node.kwargs:
            continue
        a, b = node.args
        va = a.meta.get("val") if isinstance(a, fx.Node) else None
        vb = b.meta.get("val") if isinstance(b, fx.Node) else None
        if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)) or va.dtype != vb.dtype:
            continue
        k = va.shape[-1]
        if not (isinstance(k, int) and k == 1 and isinstance(vb.shape[-2], int) and vb.shape[-2] == 1):
            continue
        want = node.meta.get("val")
        with gm.graph.inserting_before(node):
            product = gm.graph.call_function(aten.mul.Tensor, (a, b))
            result = product
            if want is not None and _product_strides(va, vb) != tuple(want.stride()):
                # the matmul's result is contiguous; a broadcast product may not be (readers may view it)
                result = gm.graph.call_function(aten.clone.default, (product,),
                                                {"memory_format": torch.contiguous_format})
        product.meta = dict(node.meta)
        if result is not product:
            result.meta = dict(node.meta)
        node.replace_all_uses_with(result)
        gm.graph.erase_node(node)
        done += 1
    if done:
        gm.recompile()
    return done
