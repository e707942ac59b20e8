"""The search claimer: with the library claimer off, a region around a matmul runs a searched μGraph."""
import os
import time

import pytest
import torch
import torch.nn.functional as F

import torch_mirage
from conftest import assert_close
from helpers import errors_against_fp64

# the CPU test's kernels run in Triton's interpreter; the GPU test runs without it (a module-wide mark skipped it)
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU kernels run only in Triton's interpreter (TRITON_INTERPRET=1)")
pytest.importorskip("torch_mirage.superopt.search.oracle")


def gated_mlp(x, w1, w3):
    return F.silu(x @ w1) * (x @ w3)


def rmsnorm_linear(x, g, w):
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * g) @ w


def linear_gated_mlp(x, w1, w3):
    """nn.Linear-style weights (out, in): the search needs a transposed matmul."""
    return F.silu(F.linear(x, w1)) * F.linear(x, w3)


def rmsnorm_linear_3d(x, g, w):
    """(batch, seq, k) input, fp32 upcast and eps: HF's RMSNorm then a matmul flattened to 2-d by the trace."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * g) @ w


def lora(x, w, a, b):
    return x @ w + (x @ a) @ b


def lora_swapped(a, b, x, w):
    """The adapter's term first, the arguments in another order."""
    return (x @ a) @ b + x @ w


class LoraLinear(torch.nn.Module):
    """PEFT-style: nn.Linear base layer plus nn.Linear A and B, weights stored (out, in)."""
    def __init__(self, k=32, n=24, r=8):
        super().__init__()
        self.base, self.lora_a, self.lora_b = (torch.nn.Linear(k, n, bias=False), torch.nn.Linear(k, r, bias=False),
                                               torch.nn.Linear(r, n, bias=False))

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x))


def sigmoid_gated_mlp(x, w1, w3):
    """SiLU spelled out: g·sigmoid(g), the up projection first."""
    up = x @ w3
    g = x @ w1
    return up * (g * torch.sigmoid(g))


class _HFRMSNorm(torch.nn.Module):     # LlamaRMSNorm: fp32 upcast, eps, the weight after the cast back
    def __init__(self, d):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(d))

    def forward(self, x):
        h = x.to(torch.float32)
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


class NormProjection(torch.nn.Module):
    """HF modules: an RMSNorm module, then nn.Linear (weight (out, in))."""
    def __init__(self, k=32, n=24):
        super().__init__()
        self.norm, self.proj = _HFRMSNorm(k), torch.nn.Linear(k, n, bias=False)

    def forward(self, x):
        return self.proj(self.norm(x))


def rmsnorm_div_sqrt(x, g, w):
    """x / sqrt(mean(x²) + eps) instead of x · rsqrt(…), the gain on the other side."""
    return (g * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5))) @ w


# Each workload in at least three forms (issue 15's acceptance): LoRA, the gated MLP and RMSNorm + Linear here;
# nTrans in test_search_reductions.py; GQA and QK-norm attention in test_search_attention.py.
@interpreted
@pytest.mark.parametrize("fn,shapes", [(lora, [(4, 32), (32, 24), (32, 8), (8, 24)]),
                                       (lora_swapped, [(32, 8), (8, 24), (4, 32), (32, 24)]),
                                       (LoraLinear().requires_grad_(False), [(4, 32)]),   # inference: no saved activations
                                       (gated_mlp, [(4, 32), (32, 24), (32, 24)]),
                                       (linear_gated_mlp, [(4, 32), (24, 32), (24, 32)]),
                                       (sigmoid_gated_mlp, [(4, 32), (32, 24), (32, 24)]),
                                       (rmsnorm_linear, [(4, 32), (32,), (32, 24)]),
                                       (rmsnorm_linear_3d, [(2, 4, 32), (32,), (32, 24)]),
                                       (NormProjection().requires_grad_(False), [(2, 4, 32)]),
                                       (rmsnorm_div_sqrt, [(4, 32), (32,), (32, 24)])],
                         ids=["lora", "lora_swapped", "lora_nn_linear", "gated_mlp", "linear_gated_mlp",
                              "sigmoid_gated_mlp", "rmsnorm", "rmsnorm_3d_eps", "rmsnorm_hf_modules",
                              "rmsnorm_div_sqrt"])
def test_search_claims_a_fused_region(fn, shapes):
    report = torch_mirage.Report()
    opts = dict(ugraph_library=False, stitch=False, search=True, search_budget_s=25.0, measure_regions=False,
                cache=False)       # a fresh search each run (the driver tests cover the cache)
    compiled = torch.compile(fn, backend=torch_mirage.MirageBackend(options=opts, report=report))
    xs = [torch.randn(s) for s in shapes]
    assert_close(compiled(*xs), fn(*xs))
    searched = [r for r in report.regions if r.claimer == "ugraph-search"]
    assert len(searched) == 1, [(r.claimer, r.ops) for r in report.regions]
    info = searched[0].info
    assert info["verified"] >= 1 and info["source"] == "search"
    assert "customized" in info["ugraph"] and "acc_sum" in info["ugraph"]   # the chosen μGraph, printed
    xs = [torch.randn(s) for s in shapes]          # fresh inputs
    assert_close(compiled(*xs), fn(*xs))


def layer_norm_linear(x, g, b, w):
    return F.linear(F.layer_norm(x, (x.shape[-1],), g, b, 1e-5), w)


@interpreted
def test_searched_layer_norm_keeps_eagers_precision_far_from_zero():
    """Rows of mean 300 and spread 1 over k = 103: the field reads fl(1/103) as 1/103, so a variance written
    E[x²] − μ² (which cancels there) now verifies as equal to the centred one; what the search keeps must still be
    as precise as eager (CPU, 11-29: 3.1e-6 against eager's 8.1e-5)."""
    report = torch_mirage.Report()
    opts = dict(ugraph_library=False, stitch=False, search=True, search_budget_s=25.0, measure_regions=False,
                cache=False)
    compiled = torch.compile(layer_norm_linear, backend=torch_mirage.MirageBackend(options=opts, report=report))
    xs = [torch.randn(8, 103) + 300.0, 1 + 0.1 * torch.randn(103), 0.1 * torch.randn(103), torch.randn(40, 103) * 0.1]
    err, eager_err, scale = errors_against_fp64(compiled, layer_norm_linear, xs)
    assert err <= 4 * eager_err + 1e-6 * scale, (err, eager_err)
    assert [r.claimer for r in report.regions if r.compiled_by == "mirage"] == ["ugraph-search"], str(report)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_search_claims_on_gpu(dtype):
    """fp16 / bf16 on the GPU at model-like shapes: claimed by the search within the default budget, matches eager."""
    report = torch_mirage.Report()
    opts = dict(ugraph_library=False, stitch=False, search=True)
    compiled = torch.compile(gated_mlp, backend=torch_mirage.MirageBackend(options=opts, report=report))
    xs = [torch.randn(s, device="cuda", dtype=dtype) * s[0] ** -0.5 for s in [(16, 1024), (1024, 1024), (1024, 1024)]]
    assert_close(compiled(*xs), gated_mlp(*xs))
    searched = [r for r in report.regions if r.claimer == "ugraph-search"]
    assert len(searched) == 1 and searched[0].info["search_s"] < 30.0


def test_the_compiles_options_reach_the_search_and_its_verifier(monkeypatch):
    """options= (not only MIRAGE_* variables) set the search's budget, workers and verifier settings."""
    from torch_mirage.superopt.search import claimer, driver

    calls = []

    def fake_search(target, inputs, **kw):
        calls.append(kw)
        return driver.SearchResult(None, driver.SearchStats(), reason="nothing (test)")

    monkeypatch.setattr(claimer, "search", fake_search)
    report = torch_mirage.Report()
    opts = dict(ugraph_library=False, stitch=False, search=True, search_budget_s=7.0, search_workers=3,
                verify_trials=5, verify_error_bound=1e-3, measure_regions=False, cache=False)
    compiled = torch.compile(gated_mlp, backend=torch_mirage.MirageBackend(options=opts, report=report))
    xs = [torch.randn(s) for s in [(4, 32), (32, 24), (32, 24)]]
    assert_close(compiled(*xs), gated_mlp(*xs))
    assert calls, "the search claimer did not search"
    assert all((kw["budget_s"], kw["workers"], kw["verify_kwargs"]) ==
               (7.0, 3, {"error_bound": 1e-3, "trials": 5}) for kw in calls), calls


@interpreted
def test_budget_zero_gives_inductor_with_one_log_line(caplog):
    """search_budget_s = 0: no search, and no weight-streaming seed in its place — the region is Inductor's, and
    one log line says why."""
    import logging
    report = torch_mirage.Report()
    opts = dict(ugraph_library=False, stitch=False, search=True, search_budget_s=0.0, measure_regions=False,
                cache=False)
    compiled = torch.compile(linear_gated_mlp, backend=torch_mirage.MirageBackend(options=opts, report=report))
    xs = [torch.randn(4, 32), torch.randn(24, 32), torch.randn(24, 32)]
    with caplog.at_level(logging.INFO, logger="torch_mirage"):
        assert_close(compiled(*xs), linear_gated_mlp(*xs))
    assert all(r.compiled_by == "inductor" for r in report.regions), str(report)
    said = [r for r in caplog.records if "search budget 0" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]


def gelu_tanh_projection(x, w):
    """Gemma-2's gate projection: one matmul, then GELU-tanh's polynomial and tanh — a GEMM and its epilogue."""
    return F.gelu(x @ w, approximate="tanh")


def transposed_projection(x, w):
    """One matmul and elementwise ops, its result transposed between them: no weight-streaming seed."""
    return (x @ w).t() * 2.0


@interpreted
@pytest.mark.parametrize("fn,rows", [(gelu_tanh_projection, 1), (gelu_tanh_projection, 64), (transposed_projection, 8)])
def test_a_gemm_with_an_elementwise_epilogue_is_not_enumerated(fn, rows):
    """One matmul with elementwise ops only is not enumerated (the generator does not reach the μGraph of a long
    epilogue within its budget; Inductor's GEMM templates fuse it): its weight-streaming seed runs where it applies,
    else the region is left to Inductor with the reason — at once, not after the 25 s budget, and eager-equal."""
    report = torch_mirage.Report()
    opts = dict(ugraph_library=False, stitch=False, search=True, search_budget_s=25.0, measure_regions=False,
                cache=False)
    compiled = torch.compile(fn, backend=torch_mirage.MirageBackend(options=opts, report=report))
    xs = [torch.randn(rows, 64), torch.randn(64, 32) / 8]
    t0 = time.perf_counter()
    assert_close(compiled(*xs), fn(*xs))
    assert time.perf_counter() - t0 < 20.0
    searched = [r for r in report.regions if r.claimer == "ugraph-search"]
    if fn is gelu_tanh_projection:
        assert len(searched) == 1 and searched[0].info["search"].startswith("not enumerated"), report.regions
    else:
        assert not searched
        declines = [d for r in report.regions for d in r.declines if d.claimer == "ugraph-search"]
        assert any("one matmul with elementwise ops: not enumerated" in d.detail for d in declines), report.regions


def test_compute_bound_gemms_are_not_enumerated():
    """A prefill's gated MLP (512 rows: both matmuls compute-bound, neither reading the other's result) is left to
    Inductor's GEMM templates without a search; the same at 4 rows (weight streaming) and attention (a matmul of a
    matmul's softmax) are still searched."""
    from torch_mirage.capture.lower import trace
    from torch_mirage.config import load
    from torch_mirage.context import CompileContext
    from torch_mirage.numerics import rms_norm
    from torch_mirage.superopt.search.claimer import compute_bound_gemms

    def mlp(x, g, w1, w3):
        h = rms_norm(x, 1e-5, g)
        return F.silu(F.linear(h, w1)) * F.linear(h, w3)

    def attention(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v
    ctx = CompileContext.standalone(load({}))
    weights = [torch.randn(1024), torch.randn(2048, 1024), torch.randn(2048, 1024)]
    for fn, args, skipped in ((mlp, [torch.randn(512, 1024), *weights], True),
                              (mlp, [torch.randn(4, 1024), *weights], False),
                              (attention, [torch.randn(4, 512, 64) for _ in range(3)], False)):
        graph = trace(fn, args)
        why = compute_bound_gemms(list(graph.nodes), ctx.analysis_of(graph).cost)
        assert (why is not None) == skipped, (fn.__name__, args[0].shape, why)
        assert why is None or "2 compute-bound matmul(s)" in why


def test_cut_signature_is_shared_by_the_same_cut_in_each_layer_only():
    """cut_signature: the same ops on the same shapes, read and leaving alike, with the same producers before them
    (a layer fed by a layer like itself) -> one signature; a different scalar, shape, a cut cut shorter, or a first
    layer fed by a graph input -> another (the seeded claimer shares only 'no seed verified' between equal
    signatures)."""
    from torch_mirage.superopt.cut import cut_signature
    from torch_mirage.testing.aten import trace_ir

    def layers(x, *ws):
        for i, w in enumerate(ws):
            x = torch.relu(x @ w) * (3.0 if i == len(ws) - 1 else 2.0)
        return x

    def cut_at(graph, k):                           # the k-th layer's mm, relu, mul
        mms = [n for n in graph.nodes if n.op.name == "matmul"]
        i = graph.nodes.index(mms[k])
        return graph.nodes[i:i + 3]
    graph = trace_ir(layers, torch.randn(4, 16), *[torch.randn(16, 16) for _ in range(5)])
    sig = [cut_signature(cut_at(graph, k), graph) for k in range(5)]
    assert sig[2] == sig[3]                         # layers fed by layers like themselves
    assert sig[0] != sig[3]                         # the first reads the graph's input
    assert sig[4] != sig[3]                         # * 3.0 instead of * 2.0
    assert cut_signature(cut_at(graph, 3)[:2], graph) != sig[3]
    other = trace_ir(layers, torch.randn(4, 16), *[torch.randn(16, 16) for _ in range(3)], torch.randn(16, 8),
                     torch.randn(8, 16))
    assert cut_signature(cut_at(other, 3), other) != sig[3]   # (16, 8) weights: other shapes


def test_cut_signature_follows_producers_only_where_the_lowering_looks():
    """Along a residual stream every layer's cut reads an add of two tensors: the signature names that producer and
    stops there, so the second layer of four shares the third's (followed three steps back, the first two layers'
    cuts reached the graph's input and none shared, HF gemma2 lowering 368 cuts a graph); a written-out SiLU's
    chain before a cut (``add(exp(neg(a)), 1)``) is still followed, so another chain gives another signature."""
    from torch_mirage.superopt.cut import cut_signature
    from torch_mirage.testing.aten import trace_ir

    def residual(x, *ws):
        for w in ws:
            x = x + torch.relu(x @ w) * 2.0
        return x

    graph = trace_ir(residual, torch.randn(4, 16), *[torch.randn(16, 16) for _ in range(4)])
    mms = [n for n in graph.nodes if n.op.name == "matmul"]
    cuts = [graph.nodes[graph.nodes.index(m):graph.nodes.index(m) + 3] for m in mms]
    sig = [cut_signature(c, graph) for c in cuts]
    assert sig[1] == sig[2] == sig[3] and sig[0] != sig[1]

    def silu_then(a, w, negate):
        d = torch.exp(-a if negate else a) + 1
        return (a / d) @ w

    def div_cut(g):
        i = next(i for i, n in enumerate(g.nodes) if n.op.name == "div")
        return g.nodes[i:]
    x, w = torch.randn(4, 16), torch.randn(16, 16)
    written, other = trace_ir(lambda a, w: silu_then(a, w, True), x, w), trace_ir(lambda a, w: silu_then(a, w, False), x, w)
    assert cut_signature(div_cut(written), written) != cut_signature(div_cut(other), other)


def test_the_seeded_claimer_claims_the_same_with_shared_negative_answers(monkeypatch):
    """Three Llama blocks in a row: every claimer's regions are the same whether the seeded claimer shares 'no seed
    verified' between cuts of equal signature or asks for every cut."""
    from torch_mirage.config import load
    from torch_mirage.context import CompileContext
    from torch_mirage.pipeline import claim_regions, default_claimers
    from torch_mirage.superopt.search import claimer as claimer_mod
    from torch_mirage.testing.aten import trace_ir
    from torch_mirage.testing.models import LlamaBlock, LlamaConfig, llama_inputs

    cfg = LlamaConfig(dim=64, heads=4, kv_heads=2, hidden=160)
    blocks = torch.nn.ModuleList([LlamaBlock(cfg) for _ in range(3)])

    def model(x, cos, sin):
        for b in blocks:
            x = b(x, cos, sin)
        return x
    x, cos, sin = llama_inputs(cfg, batch=1, seq=4)
    graph = trace_ir(model, x, cos, sin)

    def claimed():
        config = load({"min_region_us": 0})
        regions = claim_regions(graph, default_claimers(config), CompileContext.standalone(config))
        return sorted((r.claimer, tuple(n.name for n in r.nodes)) for r in regions if r.compiled_by == "mirage")
    shared = claimed()
    monkeypatch.setattr(claimer_mod, "cut_signature", lambda nodes, graph: object())   # every cut its own
    assert claimed() == shared and shared
