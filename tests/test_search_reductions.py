"""The search claimer on reduction chains without a matmul (nTrans, RMSNorm with a residual add), seeds off."""
import os

import pytest
import torch
import torch.nn.functional as F

import torch_mirage
from conftest import assert_close

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU kernels run only in Triton's interpreter (TRITON_INTERPRET=1)")
pytest.importorskip("torch_mirage.superopt.search.oracle")

EPS = 1e-6


def _rms_rsqrt(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def _rms_div_sqrt(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + EPS)


def ntrans_rsqrt(h, x, alpha):
    return _rms_rsqrt(alpha * (_rms_rsqrt(h) + x) + x)


def ntrans_div_sqrt(h, x, alpha):
    """The residual written first and the scale on the right: x + (x + rms(h))·α."""
    return _rms_div_sqrt(x + (x + _rms_div_sqrt(h)) * alpha)


def ntrans_f_rms_norm(h, x, alpha):
    return F.rms_norm(alpha * (F.rms_norm(h, (h.shape[-1],), eps=EPS) + x) + x, (x.shape[-1],), eps=EPS)


class HFRMSNorm(torch.nn.Module):
    """Hugging Face's LlamaRMSNorm: fp32 upcast, variance, rsqrt, weight after the cast back."""

    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(n) + 0.5)

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + EPS)).to(dtype)


class ResidualNorm(torch.nn.Module):
    """A pre-norm block's residual add followed by its RMSNorm (HF module)."""

    def __init__(self, n):
        super().__init__()
        self.norm = HFRMSNorm(n)

    def forward(self, x, residual):
        return self.norm(x + residual)


def _claimed(fn, shapes, budget=25.0):
    report = torch_mirage.Report()
    opts = dict(ugraph_library=False, stitch=False, search=True, search_budget_s=budget, measure_regions=False,
                cache=False)
    compiled = torch.compile(fn, backend=torch_mirage.MirageBackend(options=opts, report=report))
    xs = [torch.randn(s) for s in shapes]
    assert_close(compiled(*xs), fn(*xs))
    searched = [r for r in report.regions if r.claimer == "ugraph-search"]
    assert len(searched) == 1, [(r.claimer, r.ops, r.detail) for r in report.regions]
    xs = [torch.randn(s) for s in shapes]          # fresh inputs
    assert_close(compiled(*xs), fn(*xs))
    return searched[0]


@pytest.mark.parametrize("fn", [ntrans_rsqrt, ntrans_div_sqrt, ntrans_f_rms_norm],
                         ids=["rsqrt_mean", "div_sqrt_sum", "F_rms_norm"])
def test_search_claims_ntrans(fn):
    region = _claimed(fn, [(4, 32)] * 3)
    info = region.info
    assert info["verified"] >= 1 and info["source"] == "search"
    assert info["ugraph"].count("rms_norm") == 2, info["ugraph"]     # one kernel: both norms in one block graph


def test_search_claims_hf_residual_rmsnorm():
    region = _claimed(ResidualNorm(32), [(2, 4, 32), (2, 4, 32)])
    assert region.info["verified"] >= 1 and "rms_norm" in region.info["ugraph"]
