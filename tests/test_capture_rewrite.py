"""ATen-graph rewrites before lowering (capture/rewrite.py), against eager."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from torch_mirage.capture.rewrite import outer_products

aten = torch.ops.aten


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matmuls_over_one_contraction_element_become_products(dtype):
    """HF's rotary angles (``inv_freq[None, :, None] @ positions[:, None, :]``, a bmm), and an mm of the same
    kind: rewritten to a broadcast multiply, equal to eager bit for bit (one product per element either way);
    a matmul that really contracts keeps its op."""
    def f(inv_freq, pos, x, w):
        angles = inv_freq[None, :, None].expand(pos.shape[0], -1, 1) @ pos[:, None, :]
        outer = x[:, :1] @ w[:1, :]
        return angles.transpose(1, 2).cos(), outer, x @ w
    args = (torch.rand(8, dtype=dtype), torch.arange(5, dtype=dtype).repeat(2, 1), torch.randn(3, 4, dtype=dtype),
            torch.randn(4, 6, dtype=dtype))
    gm = make_fx(f, tracing_mode="fake")(*args)
    assert aten.bmm.default in _targets(gm)
    want = f(*args)
    assert outer_products(gm) == 2
    assert aten.bmm.default not in _targets(gm) and _targets(gm).count(aten.mm.default) == 1
    assert aten.clone.default not in _targets(gm)      # the products' strides (on the fake values) are the matmuls'
    for got, ref in zip(gm(*args), want):
        assert got.shape == ref.shape and got.dtype == ref.dtype and got.stride() == ref.stride()
        assert torch.equal(got, ref)


def test_a_product_whose_layout_differs_is_made_contiguous(monkeypatch):
    """A matmul's result is contiguous; where the broadcast product's strides (computed on the meta values) would
    differ — or cannot be computed — a contiguous copy follows it, so readers that view it see the matmul's layout.
    (TensorIterator gives the outer products tried here contiguous strides, so the difference is injected.)"""
    from torch_mirage.capture import rewrite

    def f(x, w):
        return (x.t()[:, :1] @ w[:1, :]).view(-1)
    args = (torch.randn(4, 3), torch.randn(4, 6))
    gm = make_fx(f, tracing_mode="fake")(*args)
    monkeypatch.setattr(rewrite, "_product_strides", lambda a, b: None)
    assert outer_products(gm) == 1
    assert _targets(gm).count(aten.clone.default) == 1 and aten.mm.default not in _targets(gm)
    got = gm(*args)
    assert torch.equal(got, f(*args))
