"""search/reference.py: captured regions (several ways a user writes RMSNorm+Linear,
gated MLP and LoRA, nn.Linear's transposed weight included) lower to plain
μGraphs that match eager, and their target expressions equal the library μGraph's."""
import math

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import assert_close
from torch_mirage.superopt import library as L
from torch_mirage.superopt.executor import execute
from torch_mirage.superopt.search.expr import graph_exprs
from torch_mirage.superopt.search.reference import Decline, Reference, reference_of
from torch_mirage.capture.lower import trace

M, K, N, R, EPS = 6, 12, 8, 2, 1e-6


def rms_a(x, g, w):                    # x * rsqrt(mean(x²) + eps) * g @ w   (w: (k, n))
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * g) @ w


def rms_b(x, g, wt):                   # F.rms_norm then F.linear (w: (n, k), transposed)
    return F.linear(F.rms_norm(x, (x.shape[-1],), g, EPS), wt)


def rms_c(x, g, wt):                   # x / sqrt(sum(x·x)/k + eps), weight applied first, nn.Linear layout
    return ((g * x) / torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + EPS)) @ wt.t()


def rms_d(x, g, w):                    # HF style: fp32 upcast, cast back, weight after
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return (g * h.to(x.dtype)) @ w


def mlp_a(x, w1, w3):
    return F.silu(x @ w1) * (x @ w3)


def mlp_b(x, w1t, w3t):                # nn.Linear weights
    return F.linear(x, w3t) * F.silu(F.linear(x, w1t))


def mlp_c(x, w1, w3):                  # silu written out: a · sigmoid(a) is not a kernel op -> via silu of 3D x
    return (F.silu(torch.matmul(x.unsqueeze(0), w1)) * torch.matmul(x.unsqueeze(0), w3)).squeeze(0)


def lora_a(x, w, a, b):
    return x @ w + (x @ a) @ b


def lora_b(x, wt, at, bt):             # three nn.Linear layouts, the adapter added first
    return F.linear(F.linear(x, at), bt) + F.linear(x, wt)


def lora_c(x, w, a, b):                # scaled adapter folded into b beforehand by the user: x@w + x@a@b
    return torch.addmm(x @ w, x @ a, b)


def _inputs(kind, transposed, dtype=torch.float32):
    shapes = {"rms": [(M, K), (K,), (K, N)], "mlp": [(M, K), (K, N), (K, N)],
              "lora": [(M, K), (K, N), (K, R), (R, N)]}[kind]
    xs = [torch.randn(s, dtype=dtype) / (s[0] ** 0.5 if len(s) == 2 and s != shapes[0] else 1) for s in shapes]
    if transposed:                       # weights in nn.Linear's (out, in) layout
        xs = [xs[0]] + [x.t().contiguous() if x.dim() == 2 else x for x in xs[1:]]
    return xs


FORMS = [("rms", rms_a, False), ("rms", rms_b, True), ("rms", rms_c, True), ("rms", rms_d, False),
         ("mlp", mlp_a, False), ("mlp", mlp_b, True), ("mlp", mlp_c, False),
         ("lora", lora_a, False), ("lora", lora_b, True), ("lora", lora_c, False)]

LIB = {"rms": lambda: L.rmsnorm_linear(M, K, N, eps=EPS, grid=2, forloop_range=3),
       "mlp": lambda: L.gated_mlp(M, K, N, grid=2, forloop_range=3),
       "lora": lambda: L.lora(M, K, N, R, grid=2, forloop_range=3)}


def _reference(fn, xs):
    graph = trace(fn, xs)
    return reference_of(graph.nodes, graph), graph


@pytest.mark.parametrize("kind, fn, transposed", FORMS, ids=[f.__name__ for _, f, _ in FORMS])
def test_reference_matches_eager_and_the_library(kind, fn, transposed):
    xs = _inputs(kind, transposed)
    ref, graph = _reference(fn, xs)
    assert isinstance(ref, Reference), str(ref)
    assert all(op.name not in ("customized",) for op in ref.graph.ops)
    pos = {id(v): i for i, v in enumerate(graph.inputs)}
    ins = [xs[pos[id(v)]] for v in ref.inputs]
    (out,) = execute(ref.graph, ins)
    assert_close(out, fn(*xs))
    # the target expression is the library μGraph's (same math, any of the user's forms)
    assert ref.exprs == graph_exprs(LIB[kind]()), (fn.__name__, [str(e) for e in ref.exprs])


def test_upcast_is_recorded_and_fp16_runs():
    xs = _inputs("rms", False, torch.float16)
    ref, graph = _reference(rms_d, xs)
    assert isinstance(ref, Reference) and ref.upcast and ref.dtype == "float16" and ref.casts
    (out,) = execute(ref.graph, [x.float() for x in xs])
    assert_close(out, rms_d(*[x.float() for x in xs]))


def test_declines_name_the_op():
    xs = [torch.randn(M, K), torch.randn(K, N)]
    ref, _ = _reference(lambda x, w: torch.sin(x) @ w, xs)
    assert isinstance(ref, Decline) and "sin" in str(ref)
    ref, _ = _reference(lambda x, w: x.pow(5) @ w, xs)
    assert isinstance(ref, Decline) and "pow" in ref.reason and "5" in ref.reason
    ref, _ = _reference(lambda x, w: x.pow(3) @ w, xs)               # GPT-2's GELU: x³ lowers to x²·x
    assert isinstance(ref, Reference) and [op.name for op in ref.graph.ops].count("square") == 1
    ref, _ = _reference(lambda x: x.permute(1, 0, 2).exp(), [torch.randn(2, 3, 4)])
    assert isinstance(ref, Decline) and "permute" in ref.reason


def att_a(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v


def att_b(q, k, v):                    # scale folded into q, F.softmax
    return F.softmax((q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1), dim=-1) @ v


def att_c(q, k, v):                    # softmax written out
    s = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    p = torch.exp(s - s.amax(-1, keepdim=True))
    return (p / p.sum(-1, keepdim=True)) @ v


def test_qknorm_attention_and_ntrans_refs_give_the_library_expressions():
    b, h, sq, kv, d = 1, 2, 4, 8, 4
    xs = [torch.randn(b, h, sq, d), torch.randn(b, h, kv, d), torch.randn(b, h, kv, d), torch.randn(d),
          torch.randn(d)]
    ref, _ = _reference(lambda q, k, v, gq, gk: L.qknorm_attention_ref(q, k, v, gq, gk, eps=EPS), xs)
    assert isinstance(ref, Reference), str(ref)
    assert ref.exprs == graph_exprs(L.qknorm_attention(b, h, sq, kv, d, eps=EPS, forloop_range=2))
    xs = [torch.randn(4, 6) for _ in range(3)]
    ref, _ = _reference(lambda hh, x, al: L.ntrans_ref(hh, x, al, eps=EPS), xs)
    assert isinstance(ref, Reference), str(ref)
    assert ref.exprs == graph_exprs(L.ntrans(4, 6, eps=EPS))
    (out,) = execute(ref.graph, xs)
    assert_close(out, L.ntrans_ref(*xs, eps=EPS))


def _repeat_kv(x, n):                  # HF's repeat_kv
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def gqa_a(q, k, v):
    n = q.shape[1] // k.shape[1]
    return torch.softmax(q @ _repeat_kv(k, n).transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ _repeat_kv(v, n)


def gqa_b(q, k, v):                    # query heads grouped per KV head: no repeat at all
    b, h, sq, d = q.shape
    hk = k.shape[1]
    qg = q.reshape(b, hk, (h // hk) * sq, d)
    o = torch.softmax(qg @ k.transpose(-1, -2) * d ** -0.5, -1) @ v
    return o.reshape(b, h, sq, d)


@pytest.mark.parametrize("fn,h,hk", [(att_a, 2, 2), (att_b, 2, 2), (att_c, 2, 2), (gqa_a, 4, 2), (gqa_b, 4, 2)])
def test_attention_and_gqa_forms_give_flashattention(fn, h, hk):
    b, sq, kv, d = 1, 4, 8, 4
    xs = [torch.randn(b, h, sq, d), torch.randn(b, hk, kv, d), torch.randn(b, hk, kv, d)]
    ref, graph = _reference(fn, xs)
    assert isinstance(ref, Reference), str(ref)
    (out,) = execute(ref.graph, xs)
    assert_close(out, fn(*xs))
    assert ref.exprs == graph_exprs(L.gqa_flashattention(b, h, sq, kv, d, forloop_range=2))


class _HFRMSNorm(torch.nn.Module):     # LlamaRMSNorm's forward
    def __init__(self, d, eps=EPS):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(d))
        self.variance_epsilon = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * x.to(dtype)


class _NormProj(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.proj = _HFRMSNorm(K), torch.nn.Linear(K, N, bias=False)

    def forward(self, x):
        return self.proj(self.norm(x))


class _GateUp(torch.nn.Module):        # LlamaMLP without its down projection
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(K, N, bias=False), torch.nn.Linear(K, N, bias=False)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x):
        return self.act_fn(self.gate_proj(x)) * self.up_proj(x)


@pytest.mark.parametrize("module, kind", [(_NormProj, "rms"), (_GateUp, "mlp")])
def test_hf_style_modules(module, kind):
    """Modules with their parameters lifted to inputs (as Dynamo captures them)."""
    m = module()
    names = [n for n, _ in m.named_parameters()]
    params = [p.detach() for _, p in m.named_parameters()]

    def fn(x, *ps):
        return torch.func.functional_call(m, dict(zip(names, ps)), (x,))

    xs = [torch.randn(2, M // 2, K)] + params
    ref, graph = _reference(fn, xs)
    assert isinstance(ref, Reference), str(ref)
    pos = {id(v): i for i, v in enumerate(graph.inputs)}
    (out,) = execute(ref.graph, [xs[pos[id(v)]] for v in ref.inputs])
    with torch.no_grad():
        assert_close(out, m(xs[0]))
    assert ref.exprs == graph_exprs(LIB[kind]())


def _sdpa_gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def _repeat_kv_attention(q, k, v):     # HF's repeat_kv (expand + reshape), then softmax attention
    b, hkv, s, d = k.shape
    g = q.shape[1] // hkv
    k, v = (t[:, :, None].expand(b, hkv, g, s, d).reshape(b, hkv * g, s, d) for t in (k, v))
    return att_a(q, k, v)


@pytest.mark.parametrize("fn, hq", [
    (lambda q, k, v: F.scaled_dot_product_attention(q, k, v), 2),
    (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5), 2),
    (_sdpa_gqa, 4),
])
def test_sdpa_lowers_to_its_softmax_decomposition(fn, hq):
    """F.scaled_dot_product_attention (an opaque ATen op in the capture) lowers to
    softmax(q·kᵀ·scale) @ v: the FlashAttention μGraph's expression, GQA heads repeated
    as HF's repeat_kv does; it matches eager."""
    b, hkv, sq, kv, d = 1, 2, 4, 8, 4
    xs = [torch.randn(b, hq, sq, d), torch.randn(b, hkv, kv, d), torch.randn(b, hkv, kv, d)]
    ref, graph = _reference(fn, xs)
    assert isinstance(ref, Reference), str(ref)
    assert any("scaled_dot_product" in n.target_name for n in graph.nodes)     # the ATen op itself, not decomposed
    (out,) = execute(ref.graph, xs)
    assert_close(out, fn(*xs))
    if hq == hkv:
        assert ref.exprs == graph_exprs(L.gqa_flashattention(b, hq, sq, kv, d, forloop_range=2))
    else:
        twin, _ = _reference(_repeat_kv_attention, xs)
        assert isinstance(twin, Reference), str(twin)
        assert ref.exprs == twin.exprs
        assert_close(execute(twin.graph, xs)[0], out)


@pytest.mark.parametrize("fn, what", [
    (lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, is_causal=True), "causal"),
    (lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), "mask"),
])
def test_sdpa_declines_masks(fn, what):
    xs = [torch.randn(1, 2, 4, 4), torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4), torch.randn(4, 8)]
    ref, _ = _reference(fn, xs)
    assert isinstance(ref, Decline) and what in ref.reason and "scaled_dot_product" in str(ref), str(ref)


def _layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps=1e-5)


def _var_mean_unbiased(x, w, b):       # torch.var_mean's default correction (1), keepdim=False
    var, mean = torch.var_mean(x, dim=-1)
    return (x - mean[:, None]) * torch.rsqrt(var[:, None] + 1e-5) * w + b


@pytest.mark.parametrize("fn", [_layer_norm, _var_mean_unbiased], ids=["layer_norm", "var_mean_unbiased"])
def test_var_mean_lowers_with_its_correction(fn):
    xs = [torch.randn(M, K), torch.rand(K) + 0.5, torch.randn(K)]
    ref, graph = _reference(fn, xs)
    assert isinstance(ref, Reference), str(ref)
    pos = {id(v): i for i, v in enumerate(graph.inputs)}
    (out,) = execute(ref.graph, [xs[pos[id(v)]] for v in ref.inputs])
    assert_close(out, fn(*xs))
