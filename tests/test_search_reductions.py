"""The search claimer on reduction chains without a matmul (nTrans, RMSNorm with a residual add), seeds off."""
import os

import pytest
import torch
import torch.nn.functional as F

import torch_mirage
from conftest import assert_close
from torch_mirage.superopt import library as L
from torch_mirage.superopt.builder import new_kernel_graph, new_threadblock_graph
from torch_mirage.superopt.executor import execute
from torch_mirage.superopt.search.driver import search

pytest.importorskip("torch_mirage.superopt.search.oracle")
interpreter_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                      reason="CPU kernels run only in Triton's interpreter (TRITON_INTERPRET=1)")

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


@interpreter_only
@pytest.mark.parametrize("fn", [ntrans_rsqrt, ntrans_div_sqrt, ntrans_f_rms_norm],
                         ids=["rsqrt_mean", "div_sqrt_sum", "F_rms_norm"])
def test_search_claims_ntrans(fn):
    region = _claimed(fn, [(4, 32)] * 3)
    info = region.info
    assert info["verified"] >= 1 and info["source"] == "search"
    assert info["ugraph"].count("rms_norm") == 2, info["ugraph"]     # one kernel: both norms in one block graph


@interpreter_only
def test_search_claims_hf_residual_rmsnorm():
    region = _claimed(ResidualNorm(32), [(2, 4, 32), (2, 4, 32)])
    assert region.info["verified"] >= 1 and "rms_norm" in region.info["ugraph"]


@interpreter_only
def test_a_norm_viewed_for_several_readers_is_searched_without_its_views():
    """A norm whose result leaves the region through several views (as for a QKV projection's three matmuls):
    the region is the norm alone — its views run as views — and the search finds it (with the views inside it
    had four outputs and no μGraph within the op limit)."""
    def fn(x, g):
        h = _rms_rsqrt(x) * g
        return h.view(8, 32), h.view(2, 2, 2, 32).sin(), h.view(2, 4, 2, 16).cos()

    region = _claimed(fn, [(2, 4, 32), (32,)])
    assert region.info["source"] == "search", region.info
    assert not any("view" in op for op in region.ops), region.ops


@interpreter_only
def test_the_graphs_search_budget_bounds_its_regions_together():
    """``search_graph_budget_s`` bounds the enumeration of all of a graph's regions together: the first region
    searched gets at most what is left, and once it is spent the rest are declined saying so (Inductor runs
    them), the results still eager's."""
    def fn(h, x, alpha, y):
        return ntrans_rsqrt(h, x, alpha), F.layer_norm(y + 1.0, (y.shape[-1],))

    report = torch_mirage.Report()
    opts = dict(ugraph_library=False, stitch=False, search=True, search_budget_s=25.0, search_graph_budget_s=0.3,
                measure_regions=False, cache=False)
    compiled = torch.compile(fn, backend=torch_mirage.MirageBackend(options=opts, report=report))
    xs = [torch.randn(4, 32) for _ in range(4)]
    for got, want in zip(compiled(*xs), fn(*xs)):
        assert_close(got, want)
    spent = [r for r in report.regions if any("search_graph_budget_s) is spent" in d.detail for d in r.declines)]
    assert spent, str(report)
    assert not [r for r in report.regions if r.claimer == "ugraph-search" and r.info.get("search_s", 0) > 2.0]


# ------------------------------------------------------------------ the driver on nTrans' reference μGraph
M, N = 4, 32
FRONT = dict(use_z3=False)     # the structural front decides alone: deterministic and fast


def _ntrans_ref(rms):
    g = new_kernel_graph()
    H, X, A = (g.new_input((M, N), "float32") for _ in range(3))
    g.mark_output(rms(g, g.add(g.mul(A, g.add(rms(g, H), X)), X)))
    return g.build()


def _rms_mean_rsqrt(g, x):
    return g.mul(x, g.rsqrt(g.reduce_mean(g.square(x), dim=1)))


def _rms_sum_div_sqrt(g, x):
    return g.div(x, g.sqrt(g.scalar_mul(g.reduce_sum(g.mul(x, x), dim=1), value=1.0 / N)))


def _wrong_ntrans():
    """A near miss: the second residual add is missing, rms(α·(rms(H)+X))."""
    g = new_kernel_graph()
    H, X, Al = (g.new_input((M, N), "float32") for _ in range(3))
    tb = new_threadblock_graph((1,), 1)
    tH, tX, tA = (tb.new_input(t, imap=(None,), fmap=None) for t in (H, X, Al))
    tb.new_output(tb.forloop_accum(tb.rms_norm(tb.mul(tA, tb.add(tb.rms_norm(tH), tX))), "sum"), omap=(None,))
    (Y,) = g.customized([H, X, Al], tb)
    g.mark_output(Y)
    return g.build()


@pytest.mark.parametrize("rms", [_rms_mean_rsqrt, _rms_sum_div_sqrt], ids=["mean_rsqrt", "sum_div_sqrt"])
def test_driver_finds_ntrans_whole_rows(rms):
    """One block graph, no for-loop (whole rows per block), both norms as block ops; eager-equal."""
    ref = _ntrans_ref(rms)
    r = search(ref, [((M, N), "float32")] * 3, budget_s=20, oracle_kwargs=FRONT, workers=1)
    assert r.best is not None, r.reason
    assert [op.name for op in r.best.ops if op.name != "input"] == ["customized"]
    body = next(op.body for op in r.best.ops if op.name == "customized")
    assert body.forloop_range == 1 and [op.name for op in body.ops].count("rms_norm") == 2
    h, x, a = torch.randn(M, N), torch.randn(M, N), torch.rand(M, N)
    (y,) = execute(r.best, [h, x, a])
    assert_close(y, L.ntrans_ref(h, x, a))


@pytest.mark.parametrize("probe", [True, False])
def test_planted_wrong_ntrans_is_rejected(probe):
    ref, wrong = _ntrans_ref(_rms_mean_rsqrt), _wrong_ntrans()
    kw = dict(budget_s=20, oracle_kwargs=FRONT, probe=probe, workers=1)
    clean = search(ref, [((M, N), "float32")] * 3, **kw)
    r = search(ref, [((M, N), "float32")] * 3, extra_candidates=[wrong], **kw)
    assert r.best is not None and r.best.hash() == clean.best.hash() != wrong.hash() and r.source == "search"
    rejected = "rejected_by_probe" if probe else "rejected_by_verifier"
    assert getattr(r.stats, rejected) == getattr(clean.stats, rejected) + 1      # the plant, and only it


# ------------------------------------------------------------------ LayerNorm chains with a residual add
def layernorm_f(x, residual, w, b):
    return F.layer_norm(x + residual, (x.shape[-1],), w, b, eps=1e-5)


def layernorm_by_hand(x, residual, w, b):
    """Centred, variance as a mean of squares, divided by its root, weight and bias after."""
    h = x + residual
    c = h - h.mean(-1, keepdim=True)
    return c / torch.sqrt((c * c).mean(-1, keepdim=True) + 1e-5) * w + b


class PreNormResidual(torch.nn.Module):
    """``nn.LayerNorm`` over a residual stream, on (batch, seq, hidden) inputs."""

    def __init__(self, n):
        super().__init__()
        self.norm = torch.nn.LayerNorm(n)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x, residual):
        return self.norm(residual + x)


@interpreter_only
@pytest.mark.parametrize("fn,shapes", [(layernorm_f, [(4, 32), (4, 32), (32,), (32,)]),
                                       (layernorm_by_hand, [(4, 32), (4, 32), (32,), (32,)]),
                                       (PreNormResidual(32), [(2, 4, 32), (2, 4, 32)])],
                         ids=["F_layer_norm", "by_hand", "nn_LayerNorm_3d"])
def test_search_claims_residual_layernorm(fn, shapes):
    region = _claimed(fn, shapes)
    assert region.info["verified"] >= 1 and region.info["source"] == "search"
    assert "reduce_mean" in region.info["ugraph"] and "rms_norm" in region.info["ugraph"]


def test_a_row_max_is_not_enumerated():
    """softmax's row max has no block op the generator enumerates: the search returns at once, nothing found."""
    g = new_kernel_graph()
    X = g.new_input((M, N), "float32")
    e = g.exp(g.sub(X, g.reduce_max(X, dim=1)))
    g.mark_output(g.div(e, g.reduce_sum(e, dim=1)))
    r = search(g.build(), [((M, N), "float32")], budget_s=20, oracle_kwargs=FRONT, workers=1)
    assert r.best is None and r.stats.generated == 0 and r.stats.seconds < 5.0


def test_rows_that_fit_one_block_when_shrunk_split_over_the_grid_at_the_real_size():
    """nTrans at 8 x 4096 (the bench's b1) is searched shrunk (4096 -> 32): there the whole problem fits one block;
    at the real size no one-block schedule is valid, so the μGraph carried back splits its rows over the grid, and
    is verified at the real size (before: no schedule of the same structure, and the search ran again at the real
    size); eager-equal."""
    m, n = 8, 4096
    g = new_kernel_graph()
    H, X, A = (g.new_input((m, n), "float32") for _ in range(3))
    g.mark_output(_rms_mean_rsqrt(g, g.add(g.mul(A, g.add(_rms_mean_rsqrt(g, H), X)), X)))
    r = search(g.build(), [((m, n), "float32")] * 3, budget_s=25, oracle_kwargs=FRONT, workers=1)
    assert r.best is not None, r.reason
    assert "its grid split otherwise at the real sizes" in r.reason, r.reason
    body = next(op.body for op in r.best.ops if op.name == "customized")
    assert body.grid == (m,) and body.forloop_range == 1
    h, x, a = torch.randn(m, n), torch.randn(m, n), torch.rand(m, n)
    (y,) = execute(r.best, [h, x, a])
    assert_close(y, L.ntrans_ref(h, x, a))
