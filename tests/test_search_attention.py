"""The μGraph search reaches attention with the library off: GQA attention and QK-norm attention, each written
several ways a user writes them, are claimed by the search (one graph-defined kernel with the online-softmax
accumulator), verified, and match eager; the goal-directed skeletons (search/decompose.py), the GQA head packing
(search/heads.py) and the DFS's online-softmax move are checked on their own."""
import math
import os
import time
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import torch_mirage
from conftest import assert_close
from torch_mirage.capture.lower import trace
from torch_mirage.superopt import library as L
from torch_mirage.superopt.builder import new_kernel_graph
from torch_mirage.superopt.executor import execute
from torch_mirage.superopt.search import driver as D
from torch_mirage.superopt.search import expr as E
from torch_mirage.superopt.search.decompose import loop_ops, skeletons
from torch_mirage.superopt.search.generate import enumerate_skeletons, to_kernel_graph
from torch_mirage.superopt.search.heads import group_heads, unpack
from torch_mirage.superopt.search.oracle import SubexprOracle
from torch_mirage.superopt.search.reference import Reference, reference_of

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU kernels run only in Triton's interpreter (TRITON_INTERPRET=1)")

B, HQ, HKV, SQ, KV, D_ = 1, 4, 2, 4, 16, 8      # distinct sizes: a matmul contracting the wrong dim does not fit
EPS = 1e-6


# ------------------------------------------------------------------ GQA attention, three ways
def _repeat_kv(x, n):                   # HF's repeat_kv: expand + reshape
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def gqa_repeat_kv_softmax(q, k, v):
    n = q.shape[1] // k.shape[1]
    return torch.softmax(q @ _repeat_kv(k, n).transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ _repeat_kv(v, n)


def gqa_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def gqa_by_hand(q, k, v):              # the softmax written out (max subtracted), the scale on q, heads repeated by
    n = q.shape[1] // k.shape[1]       # unsqueeze / expand / flatten
    k, v = (t.unsqueeze(2).expand(-1, -1, n, -1, -1).flatten(1, 2) for t in (k, v))
    s = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-2, -1))
    p = torch.exp(s - s.amax(-1, keepdim=True))
    return (p / p.sum(-1, keepdim=True)) @ v


# ------------------------------------------------------------------ QK-norm attention, three ways
def _rms(x, g):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * g


def qknorm_softmax(q, k, v, gq, gk):
    q, k = _rms(q, gq), _rms(k, gk)
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v


def qknorm_f_rms_norm_sdpa(q, k, v, gq, gk):
    d = q.shape[-1]
    return F.scaled_dot_product_attention(F.rms_norm(q, (d,), gq, EPS), F.rms_norm(k, (d,), gk, EPS), v)


class _HFRMSNorm(torch.nn.Module):     # Qwen3's q_norm / k_norm (LlamaRMSNorm): fp32 upcast, weight after the cast back
    def __init__(self, d):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(d))

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
        return self.weight * x.to(dtype)


class QKNormCore(torch.nn.Module):     # HF-style: norm modules, scores by hand with the max subtracted
    def __init__(self, d):
        super().__init__()
        self.q_norm, self.k_norm = _HFRMSNorm(d), _HFRMSNorm(d)
        self.scaling = d ** -0.5

    def forward(self, q, k, v):
        s = torch.matmul(self.q_norm(q), self.k_norm(k).transpose(2, 3)) * self.scaling
        p = torch.exp(s - torch.max(s, dim=-1, keepdim=True).values)
        return torch.matmul(p / p.sum(dim=-1, keepdim=True), v)


def _inputs(kind):
    if kind == "gqa":
        return [torch.randn(B, HQ, SQ, D_), torch.randn(B, HKV, KV, D_), torch.randn(B, HKV, KV, D_)]
    return [torch.randn(B, HKV, SQ, D_), torch.randn(B, HKV, KV, D_), torch.randn(B, HKV, KV, D_),
            torch.randn(D_), torch.randn(D_)]


FORMS = [("gqa", gqa_repeat_kv_softmax), ("gqa", gqa_sdpa), ("gqa", gqa_by_hand),
         ("qknorm", qknorm_softmax), ("qknorm", qknorm_f_rms_norm_sdpa), ("qknorm", QKNormCore)]
IDS = ["gqa_repeat_kv_softmax", "gqa_sdpa", "gqa_by_hand", "qknorm_softmax", "qknorm_f_rms_norm_sdpa",
       "qknorm_hf_module"]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind,fn", FORMS, ids=IDS)
def test_search_claims_attention(kind, fn, dtype):
    """Library off, search on, the default budget: the whole attention is one searched, verified kernel that
    matches eager (an fp64 reference), found in a few seconds. fp16 regions hold casts (softmax's upcast, HF's
    norm): they are not counted against the region's size limit."""
    module = isinstance(fn, type)           # an nn.Module: its norm weights are parameters (Dynamo lifts them)
    if module:
        fn = fn(D_)
    report = torch_mirage.Report()
    opts = dict(ugraph_library=False, stitch=False, search=True, measure_regions=False, cache=False)
    compiled = torch.compile(fn.to(dtype) if module else fn,
                             backend=torch_mirage.MirageBackend(options=opts, report=report))

    def check():
        xs = [x.to(dtype) for x in _inputs(kind)[:3 if module else None]]
        with torch.no_grad():
            want = (fn.double() if module else fn)(*[x.double() for x in xs])
            if module:
                fn.to(dtype)
            assert_close(compiled(*xs), want.to(dtype))

    check()
    searched = [r for r in report.regions if r.claimer == "ugraph-search"]
    assert len(searched) == 1, [(r.claimer, r.ops) for r in report.regions]
    info = searched[0].info
    assert info["source"] == "search" and info["verified"] >= 1 and info["search_s"] < 5.0, info
    body = info["ugraph"]
    assert body.count("customized") == 1 and "acc_online_softmax" in body and "transpose" in body
    assert ("rms_norm" in body) == (kind == "qknorm")
    if kind == "gqa":       # query heads packed onto their KV head around the kernel
        assert "reshape" in body
    check()                 # fresh inputs


# ------------------------------------------------------------------ the driver, the decomposer, the head packing
def _reference(fn, xs):
    cap = trace(fn, xs)
    ref = reference_of(cap.nodes, cap)
    assert isinstance(ref, Reference), str(ref)
    return ref


def _specs(ref):
    return [(tuple(v.meta.shape), "float32") for v in ref.inputs]


def test_a_wrong_planted_attention_is_rejected_and_the_right_one_found():
    """A FlashAttention μGraph with the wrong temperature (1/d instead of 1/√d) is planted: the verifier rejects
    it (the fp64 probe is off, so the verifier decides), and the search still returns the verified one (whose
    scalar_mul carries 1/√d)."""
    xs = _inputs("qknorm")[:3]
    ref = _reference(lambda q, k, v: torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D_), -1) @ v, xs)
    wrong = L.gqa_flashattention(B, HKV, SQ, KV, D_, dtype="float32", forloop_range=2)
    wrong = _with_scale(wrong, 1.0 / D_)
    r = D.search(ref.graph, _specs(ref), budget_s=20, extra_candidates=[wrong], workers=1, probe=False)
    assert r.best is not None and r.stats.rejected_by_verifier >= 1, r.reason
    values = [op.attrs["value"] for op in next(op.body for op in r.best.ops if op.name == "customized").ops
              if op.name == "scalar_mul"]
    assert values and all(abs(v - D_ ** -0.5) < 1e-12 for v in values)
    (out,) = execute(r.best, xs)
    assert_close(out, execute(ref.graph, xs)[0])


def _with_scale(g, value):
    """``g`` with every block scalar_mul's value replaced."""
    ops = []
    for op in g.ops:
        if op.name == "customized":
            body = replace(op.body, ops=tuple(replace(b, attrs=type(b.attrs)({**b.attrs, "value": value}))
                                              if b.name == "scalar_mul" else b for b in op.body.ops))
            op = replace(op, body=body)
        ops.append(op)
    return replace(g, ops=tuple(ops))


def test_decomposed_skeletons_compute_the_target_and_nothing_else():
    """Every skeleton the decomposer yields replays to the target expression (QK-norm attention: the norms, the
    weights, the temperature, Q·Kᵀ, the online softmax and its division), cheapest first; a target outside its
    rules (a gated MLP) yields none."""
    ref = _reference(qknorm_softmax, _inputs("qknorm"))
    specs, targets = _specs(ref), ref.exprs
    t0 = time.monotonic()
    found = list(skeletons(targets, specs, [specs[0][0]], kinds=D.op_kinds(targets), probe_range=2,
                           scale_values=D._scale_values(ref.graph, targets), eps_values=D._eps_values(ref.graph)))
    assert found and time.monotonic() - t0 < 5.0
    for skel in found:
        assert E.graph_exprs(to_kernel_graph(skel, specs)) == targets
    kinds = [op.kind for op in found[0].ops]
    assert sorted(kinds) == sorted(["rms_norm", "rms_norm", "mul", "mul", "scalar_mul", "matmul_t",
                                    "acc_online_softmax", "div"])
    assert [len(s.ops) for s in found] == sorted(len(s.ops) for s in found)
    # equal cost: fewest ops in the for-loop first (only the K tile's norm and Q·Kᵀ; the temperature and the
    # weights go on the hoisted side)
    assert loop_ops(found[0]) == 2 == min(loop_ops(s) for s in found) < max(loop_ops(s) for s in found)
    g = new_kernel_graph()
    X, W1, W3 = (g.new_input(s, "float32") for s in ((4, 8), (8, 6), (8, 6)))
    g.mark_output(g.mul(g.silu(g.matmul(X, W1)), g.matmul(X, W3)))
    mlp = g.build()
    assert not list(skeletons(E.graph_exprs(mlp), [((4, 8), "float32"), ((8, 6), "float32"), ((8, 6), "float32")],
                              [(4, 6)], kinds=D.op_kinds(E.graph_exprs(mlp)), probe_range=2))


def test_gqa_heads_pack_and_unpack():
    """Query heads packed per KV head: FlashAttention on the packed shapes, viewed back, equals the region's
    program; heads that do not group give no packing."""
    xs = _inputs("gqa")
    ref = _reference(gqa_repeat_kv_softmax, xs)
    specs = _specs(ref)
    groups = group_heads(specs, [tuple(xs[0].shape)])
    assert groups is not None and groups.group == HQ // HKV
    assert groups.inputs[0][0] == (B, HKV, (HQ // HKV) * SQ, D_) and groups.packed[1] is None
    (want,) = execute(ref.graph, xs)
    flash = L.gqa_flashattention(B, HKV, (HQ // HKV) * SQ, KV, D_, dtype="float32", forloop_range=2)
    assert_close(execute(unpack(flash, groups, specs), xs)[0], want)
    assert group_heads([((B, 3, SQ, D_), "float32")] + specs[1:], [(B, 3, SQ, D_)]) is None


def test_the_dfs_reaches_attention_with_the_online_softmax_move():
    """Without the decomposer, the DFS enumerates the online-softmax accumulator (two values: its sum and its
    unnormalised output) and scalar_mul by the target's temperature: at depth 4 it yields FlashAttention."""
    xs = _inputs("qknorm")[:3]
    ref = _reference(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), xs)
    specs, targets = _specs(ref), ref.exprs
    oracle = SubexprOracle(targets, use_z3=False)
    found = [s for s, _ in enumerate_skeletons(
        specs, [tuple(xs[0].shape)], max_ops=4, exact_ops=True, probe_range=2, admits=oracle.admits,
        is_target=lambda es: [oracle.equivalent(e) for e in es] == [0], kinds=D.op_kinds(targets),
        scale_values=D._scale_values(ref.graph, targets), fmap_choices=[[None], [2], [2]])]
    assert any([op.kind for op in s.ops][-2:] == ["acc_online_softmax", "div"] and
               any(op.kind == "matmul_t" for op in s.ops) for s in found), [str(s) for s in found]


def test_softmax_probabilities_alone_stay_unreachable():
    """The online-softmax accumulator computes Σ exp(s − max s)·V, not the probabilities themselves."""
    g = new_kernel_graph()
    X = g.new_input((4, 6), "float32")
    e = g.exp(g.sub(X, g.reduce_max(X, dim=1)))
    g.mark_output(g.div(e, g.reduce_sum(e, dim=1)))
    assert "softmax probabilities" in D._unreachable(E.graph_exprs(g.build()))
    ref = _reference(gqa_sdpa, _inputs("gqa"))
    assert D._unreachable(ref.exprs) == "" and "acc_online_softmax" in D.op_kinds(ref.exprs)
