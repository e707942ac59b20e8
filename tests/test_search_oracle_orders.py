"""Theorem 1 beyond the library's own op orders: μGraphs that compute the same
math in other orders a generator reaches (kernel ops only, rsqrt first and the
normalised X fed to the matmul, the norm weight after the division, the
predefined rms_norm op, x² summed per tile then accumulated with an rsqrt
epilogue, x² averaged per tile then by acc_mean, the softmax division before or after the PV matmul, LoRA over two
kernels or two accumulators) match eager,
have the expression of the user's reference (search/reference.py), and every one
of their prefixes is admitted by the front-only oracle (strict: a miss would prune)."""
import math

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import assert_close
from torch_mirage.superopt.executor import execute
from torch_mirage.superopt.library import PHI, new_kernel_graph, new_threadblock_graph
from torch_mirage.superopt.search.expr import const, div, fn, graph_exprs, mul, sub_exprs, sum_, var
from torch_mirage.superopt.search.oracle import SubexprOracle
from torch_mirage.superopt.search.reference import Reference, reference_of
from torch_mirage.capture.lower import trace

M, K, N, R, EPS = 4, 12, 8, 2, 1e-6
B, H, SQ, KV, D = 1, 2, 4, 8, 4
F32 = "float32"


def rms_ref(x, g, w):
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * g) @ w


def mlp_ref(x, w1, w3):
    return F.silu(x @ w1) * (x @ w3)


def lora_ref(x, w, a, b):
    return x @ w + (x @ a) @ b


def att_ref(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v


def _rms_inputs(g):
    return g.new_input((M, K), F32), g.new_input((K,), F32), g.new_input((K, N), F32)


def rms_kernel_ops(mean: bool):
    g = new_kernel_graph()
    X, G, W = _rms_inputs(g)
    ms = g.reduce_mean(g.square(X), dim=1) if mean else g.scalar_mul(g.reduce_sum(g.mul(X, X), dim=1), value=1 / K)
    g.mark_output(g.div(g.matmul(g.mul(X, G), W), g.sqrt(g.scalar_add(ms, value=EPS))))
    return g


def _rms_tiles(X, G, W):
    """A block graph over a (2,) grid with 3 for-loop steps, iterating X and G along K and W's columns per block."""
    tb = new_threadblock_graph((2,), 3)
    return tb, tb.new_input(X, imap=(PHI,), fmap=1), tb.new_input(G, imap=(PHI,), fmap=0), tb.new_input(W, imap=(1,), fmap=0)


def rms_rsqrt_first():
    g = new_kernel_graph()
    X, G, W = _rms_inputs(g)
    Xn = g.mul(X, g.rsqrt(g.scalar_add(g.reduce_mean(g.mul(X, X), dim=1), value=EPS)))
    tb, tX, tG, tW = _rms_tiles(Xn, G, W)
    tb.new_output(tb.forloop_accum(tb.matmul(tb.mul(tX, tG), tW), "sum"), omap=(1,))
    g.mark_output(g.customized([Xn, G, W], tb)[0])
    return g


def rms_tile_sums():
    g = new_kernel_graph()
    X, G, W = _rms_inputs(g)
    tb, tX, tG, tW = _rms_tiles(X, G, W)
    acc = tb.forloop_accum(tb.matmul(tb.mul(tG, tX), tW), "sum")
    ss = tb.forloop_accum(tb.reduce_sum(tb.mul(tX, tX), dim=1), "sum")
    tb.new_output(tb.div(acc, tb.sqrt(tb.scalar_add(tb.scalar_mul(ss, value=1 / K), value=EPS))), omap=(1,))
    g.mark_output(g.customized([X, G, W], tb)[0])
    return g


def rms_weight_after():
    g = new_kernel_graph()
    X, G, W = _rms_inputs(g)
    r = g.sqrt(g.scalar_add(g.reduce_mean(g.square(X), dim=1), value=EPS))
    g.mark_output(g.matmul(g.mul(g.div(X, r), G), W))
    return g


def rms_norm_op():
    g = new_kernel_graph()
    X, G, W = _rms_inputs(g)
    g.mark_output(g.matmul(g.mul(g.rms_norm(X, eps=EPS), G), W))
    return g


def rms_tile_sums_rsqrt():
    g = new_kernel_graph()
    X, G, W = _rms_inputs(g)
    tb, tX, tG, tW = _rms_tiles(X, G, W)
    acc = tb.forloop_accum(tb.matmul(tb.mul(tX, tG), tW), "sum")
    ms = tb.forloop_accum(tb.reduce_sum(tb.square(tX), dim=1), "sum")
    tb.new_output(tb.mul(acc, tb.rsqrt(tb.scalar_add(tb.scalar_mul(ms, value=1 / K), value=EPS))), omap=(1,))
    g.mark_output(g.customized([X, G, W], tb)[0])
    return g


def rms_tile_means():
    g = new_kernel_graph()
    X, G, W = _rms_inputs(g)
    tb, tX, tG, tW = _rms_tiles(X, G, W)
    acc = tb.forloop_accum(tb.matmul(tb.mul(tX, tG), tW), "sum")
    ms = tb.forloop_accum(tb.reduce_mean(tb.square(tX), dim=1), "mean")      # sum(4, x²/4), then /3 per step
    tb.new_output(tb.div(acc, tb.sqrt(tb.scalar_add(ms, value=EPS))), omap=(1,))
    g.mark_output(g.customized([X, G, W], tb)[0])
    return g


def mlp_kernel_ops():
    g = new_kernel_graph()
    X, W1, W3 = g.new_input((M, K), F32), g.new_input((K, N), F32), g.new_input((K, N), F32)
    g.mark_output(g.mul(g.matmul(X, W3), g.silu(g.matmul(X, W1))))
    return g


def lora_two_kernels():
    g = new_kernel_graph()
    X, W, A, Bm = (g.new_input(s, F32) for s in ((M, K), (K, N), (K, R), (R, N)))
    tb = new_threadblock_graph((2,), 3)
    tX, tW = tb.new_input(X, imap=(PHI,), fmap=1), tb.new_input(W, imap=(1,), fmap=0)
    tb.new_output(tb.forloop_accum(tb.matmul(tX, tW), "sum"), omap=(1,))
    g.mark_output(g.add(g.matmul(g.matmul(X, A), Bm), g.customized([X, W], tb)[0]))
    return g


def lora_two_accumulators():
    g = new_kernel_graph()
    X, W, A, Bm = (g.new_input(s, F32) for s in ((M, K), (K, N), (K, R), (R, N)))
    tb = new_threadblock_graph((2,), 3)
    tX, tW, tA, tB = tb.new_input(X, imap=(PHI,), fmap=1), tb.new_input(W, imap=(1,), fmap=0), \
        tb.new_input(A, imap=(PHI,), fmap=0), tb.new_input(Bm, imap=(1,), fmap=PHI)
    y = tb.add(tb.forloop_accum(tb.matmul(tX, tW), "sum"), tb.forloop_accum(tb.matmul(tb.matmul(tX, tA), tB), "sum"))
    tb.new_output(y, omap=(1,))
    g.mark_output(g.customized([X, W, A, Bm], tb)[0])
    return g


def att_kernel_ops(div_last: bool):
    g = new_kernel_graph()
    Q, Kt, V = (g.new_input(s, F32) for s in ((B, H, SQ, D), (B, H, KV, D), (B, H, KV, D)))
    S = g.scalar_mul(g.matmul(Q, g.transpose(Kt)), value=1 / math.sqrt(D))
    E = g.exp(g.sub(S, g.reduce_max(S, dim=3)))
    den = g.reduce_sum(E, dim=3)
    g.mark_output(g.div(g.matmul(E, V), den) if div_last else g.matmul(g.div(E, den), V))
    return g


RMS = (rms_ref, [(M, K), (K,), (K, N)])
ATT = (att_ref, [(B, H, SQ, D), (B, H, KV, D), (B, H, KV, D)])
CASES = {
    "rms_kernel_ops_sum": (lambda: rms_kernel_ops(False), RMS),
    "rms_kernel_ops_mean": (lambda: rms_kernel_ops(True), RMS),
    "rms_rsqrt_first": (rms_rsqrt_first, RMS),
    "rms_tile_sums": (rms_tile_sums, RMS),
    "rms_weight_after": (rms_weight_after, RMS),
    "rms_norm_op": (rms_norm_op, RMS),
    "rms_tile_sums_rsqrt": (rms_tile_sums_rsqrt, RMS),
    "rms_tile_means": (rms_tile_means, RMS),
    "mlp_kernel_ops": (mlp_kernel_ops, (mlp_ref, [(M, K), (K, N), (K, N)])),
    "lora_two_kernels": (lora_two_kernels, (lora_ref, [(M, K), (K, N), (K, R), (R, N)])),
    "lora_two_accumulators": (lora_two_accumulators, (lora_ref, [(M, K), (K, N), (K, R), (R, N)])),
    "attention_div_last": (lambda: att_kernel_ops(True), ATT),
    "attention_div_first": (lambda: att_kernel_ops(False), ATT),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_other_orders_match_and_every_prefix_is_admitted(name):
    build, (fn, shapes) = CASES[name]
    g = build().build()
    xs = [torch.randn(s) for s in shapes]
    (out,) = execute(g, xs)
    assert_close(out, fn(*xs))
    cap = trace(fn, xs)
    ref = reference_of(cap.nodes, cap)
    assert isinstance(ref, Reference), str(ref)
    o = SubexprOracle(ref.exprs, use_z3=False)
    assert o.strict                                    # front-only: a miss would prune
    assert [o.equivalent(e) for e in graph_exprs(g)] == [0]
    missed = [str(e) for e in sub_exprs(g) if not o.admits(e)]
    assert not missed, f"{name}: prefixes pruned against {ref.exprs[0]}: {missed}"


def test_only_reciprocal_integer_constants_are_free():
    """1/sqrt(s) is a part of (x·u)/sqrt(s) and a tile mean sum(4, x·x/4) of sum(12, x·x);
    a constant the target never has (3, 2/3, 7/10) is not."""
    x0, x1, x2 = (var(i) for i in range(3))
    s = fn("sqrt", sum_(12, mul(x0, x0)))
    o = SubexprOracle([sum_(12, div(mul(x0, x1, x2), s))], use_z3=False)
    assert o.front(div(const(1), s)) and o.front(mul(x0, div(const(1), s)))
    assert o.front(sum_(4, mul(const(0.25), x0, x0)))
    for c in (3, 2 / 3, 0.7):
        assert not o.front(div(const(c), s)) and not o.front(mul(const(c), x0, x1))


def test_distributed_ntrans_prefixes_need_z3():
    """nTrans with α distributed (α·rms(H) + α·X + X): equal under A_eq's
    distributivity, which the normal form does not apply, so the front misses
    its prefixes (front-only pruning drops them) and Z3 proves each one (strict:
    only a proof keeps it). The complete graph is not ``equivalent`` by normal
    form; its undistributed twin is (and has fewer ops)."""
    pytest.importorskip("z3")
    from torch_mirage.superopt import library as L
    g = new_kernel_graph()
    Hh, X, Al = (g.new_input((4, 6), F32) for _ in range(3))
    inner = g.add(g.add(g.mul(Al, g.rms_norm(Hh, eps=EPS)), g.mul(Al, X)), X)
    g.mark_output(g.rms_norm(inner, eps=EPS))
    g = g.build()
    fn = lambda h, x, al: L.ntrans_ref(h, x, al, eps=EPS)  # noqa: E731
    xs = [torch.randn(4, 6) for _ in range(3)]
    assert_close(execute(g, xs)[0], fn(*xs))
    cap = trace(fn, xs)
    ref = reference_of(cap.nodes, cap)
    front_only = SubexprOracle(ref.exprs, use_z3=False)
    with_z3 = SubexprOracle(ref.exprs, use_z3=True, strict=True, z3_timeout_ms=3000)
    prefixes = list(dict.fromkeys(sub_exprs(g)))
    missed = [e for e in prefixes if not front_only.admits(e)]
    assert missed and not any(front_only.refutes(e) for e in missed)
    assert all(with_z3.admits(e) for e in prefixes)
    assert with_z3.stats["z3_unsat"] == len(missed) and with_z3.stats["z3_unknown"] == 0
