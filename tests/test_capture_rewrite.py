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
    for got, ref in zip(gm(*args), want):
        assert got.shape == ref.shape and got.dtype == ref.dtype
        assert torch.equal(got, ref)

