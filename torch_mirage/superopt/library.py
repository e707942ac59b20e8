"""The Mirage benchmark set as hand-built μGraphs, each with its PyTorch program.

Each workload is a function ``name(shapes..., dtype=..., schedule...) ->
KernelGraph`` written with the builder, plus ``name_ref(*inputs)``, the PyTorch
program it must equal (inputs in the μGraph's input order). ``WORKLOADS``
lists them with the input shapes of DESIGN.md's benchmark table. Schedules
(grid sizes, for-loop ranges) default to tiles near ``tile`` elements along
each split dim; any divisor works, so tests use small odd shapes.

* rmsnorm_linear: division moved after the matmul; Σx² and X·(G∘W) accumulate
  in one for-loop over K.
* gated_mlp: both matmuls in one block graph, SiLU·Mul after the loop.
* lora: (X ‖ XA)·(W ‖ B) per K tile, one kernel (the concat identity).
* gqa_flashdecoding: split-KV partial attention (max, sum, out) + a combine kernel.
* gqa_flashattention: one kernel, online-softmax accumulator.
* qknorm_attention: Q/K RMS-norm fused into the FlashAttention kernel.
* ntrans: rms(α·(rms(H)+X)+X) as one kernel.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..ugraph import KernelGraph
from ..numerics import rms_norm
from .builder import new_kernel_graph, new_threadblock_graph

PHI = None


def blocks(extent: int, tile: int) -> int:
    """The fewest equal parts of ``extent`` that are at most ``tile`` long."""
    return next(d for d in range(1, extent + 1) if extent % d == 0 and extent // d <= tile)


DOT_MIN = 16   # tl.dot's shortest tile edge: a shorter part is a broadcast multiply-sum, one key or row a step


def tiles(extent: int, tile: int) -> int:
    """How many equal tiles a kernel walks ``extent`` in: :func:`blocks`' fewest parts at most ``tile`` long,
    unless those are shorter than ``DOT_MIN`` while ``extent`` is not (a length with no divisor in between: 67
    keys would be 67 one-key steps of the loop) — then the fewest parts at most ``2 · tile`` long, where those
    reach ``DOT_MIN`` (one tile of 67 keys padded to 128; two of 67 for 134). No wider: a 128-row block's
    scores over 128 keys already fill ``launch.MAX_TILE``. A ``tile`` below ``DOT_MIN`` is taken as asked."""
    n = blocks(extent, tile)
    if extent // n >= DOT_MIN or extent < DOT_MIN or tile < DOT_MIN:
        return n
    wide = blocks(extent, 2 * tile)
    return wide if extent // wide >= DOT_MIN else n


# ------------------------------------------------------------------ RMSNorm + Linear
def rmsnorm_linear(m: int, k: int, n: int, *, dtype: str = "float16", eps: float = 0.0,
                   grid: int | None = None, forloop_range: int | None = None, tile: int = 64) -> KernelGraph:
    """``rms_norm(X)·G @ W`` = ``(X∘G) @ W / rms(X)``: inputs X(m,k), G(k), W(k,n)."""
    grid = grid or blocks(n, tile)
    forloop_range = forloop_range or blocks(k, tile)
    g = new_kernel_graph()
    X, G, W = g.new_input((m, k), dtype), g.new_input((k,), dtype), g.new_input((k, n), dtype)
    tb = new_threadblock_graph((grid,), forloop_range)
    tX = tb.new_input(X, imap=(PHI,), fmap=1)
    tG = tb.new_input(G, imap=(PHI,), fmap=0)
    tW = tb.new_input(W, imap=(1,), fmap=0)
    acc_xw = tb.forloop_accum(tb.matmul(tb.mul(tX, tG), tW), "sum")
    acc_rms = tb.forloop_accum(tX, "rms", dim=1, eps=eps)
    tb.new_output(tb.div(acc_xw, acc_rms), omap=(1,))
    (Y,) = g.customized([X, G, W], tb)
    g.mark_output(Y)
    return g.build()


def rmsnorm_linear_ref(x, g, w, eps: float = 0.0):
    return rms_norm(x, eps, g, upcast=False) @ w


# ------------------------------------------------------------------ Gated MLP
def gated_mlp(m: int, k: int, n: int, *, dtype: str = "float16", grid: int | None = None,
              forloop_range: int | None = None, tile: int = 64) -> KernelGraph:
    """``silu(X@W1)·(X@W3)``: inputs X(m,k), W1(k,n), W3(k,n)."""
    grid = grid or blocks(n, tile)
    forloop_range = forloop_range or blocks(k, tile)
    g = new_kernel_graph()
    X, W1, W3 = g.new_input((m, k), dtype), g.new_input((k, n), dtype), g.new_input((k, n), dtype)
    tb = new_threadblock_graph((grid,), forloop_range)
    tX = tb.new_input(X, imap=(PHI,), fmap=1)
    tW1 = tb.new_input(W1, imap=(1,), fmap=0)
    tW3 = tb.new_input(W3, imap=(1,), fmap=0)
    a1 = tb.forloop_accum(tb.matmul(tX, tW1), "sum")
    a3 = tb.forloop_accum(tb.matmul(tX, tW3), "sum")
    tb.new_output(tb.mul(tb.silu(a1), a3), omap=(1,))
    (Y,) = g.customized([X, W1, W3], tb)
    g.mark_output(Y)
    return g.build()


def gated_mlp_ref(x, w1, w3):
    return F.silu(x @ w1) * (x @ w3)


# ------------------------------------------------------------------ LoRA
def lora(m: int, k: int, n: int, r: int, *, dtype: str = "float16", grid: int | None = None,
         forloop_range: int | None = None, tile: int = 64) -> KernelGraph:
    """``X@W + (X@A)@B`` = Σ_i (X_i ‖ X_i A_i)·(W_i ‖ B): inputs X(m,k), W(k,n), A(k,r), B(r,n)."""
    grid = grid or blocks(n, tile)
    forloop_range = forloop_range or blocks(k, tile)
    g = new_kernel_graph()
    X, W, A, Bm = (g.new_input(s, dtype) for s in ((m, k), (k, n), (k, r), (r, n)))
    tb = new_threadblock_graph((grid,), forloop_range)
    tX = tb.new_input(X, imap=(PHI,), fmap=1)
    tW = tb.new_input(W, imap=(1,), fmap=0)
    tA = tb.new_input(A, imap=(PHI,), fmap=0)
    tB = tb.new_input(Bm, imap=(1,), fmap=PHI)
    lhs = tb.concat([tX, tb.matmul(tX, tA)], dim=1)
    rhs = tb.concat([tW, tB], dim=0)
    tb.new_output(tb.forloop_accum(tb.matmul(lhs, rhs), "sum"), omap=(1,))
    (Y,) = g.customized([X, W, A, Bm], tb)
    g.mark_output(Y)
    return g.build()


def lora_ref(x, w, a, b):
    return x @ w + (x @ a) @ b


# ------------------------------------------------------------------ attention
def _attention_block(tb, tQ, tK, tV, d: int, scale: float | None = None):
    """Scores (times ``scale``, default ``1/√d``), online-softmax accumulation, ``o / l`` — shared by the
    FlashAttention-style graphs."""
    s = tb.scalar_mul(tb.matmul(tQ, tb.transpose(tK)), value=1.0 / math.sqrt(d) if scale is None else scale)
    m, l, o = tb.forloop_accum_online_softmax(s, tV)
    return m, l, o


def gqa_flashattention(b: int, h: int, sq: int, kv: int, d: int, *, dtype: str = "float16",
                       q_blocks: int | None = None, forloop_range: int | None = None, tile: int = 64,
                       qknorm_eps: float | None = None, scale: float | None = None) -> KernelGraph:
    """``softmax(Q Kᵀ·scale) V`` (scale default ``1/√d``): Q(b,h,sq,d), K,V(b,h,kv,d) [+ Gq(d), Gk(d) when
    ``qknorm_eps`` is set]. Grid (h, b, q row blocks); the for-loop walks KV."""
    q_blocks = q_blocks or blocks(sq, tile)
    forloop_range = forloop_range or blocks(kv, tile)
    g = new_kernel_graph()
    Q, Kt, V = g.new_input((b, h, sq, d), dtype), g.new_input((b, h, kv, d), dtype), g.new_input((b, h, kv, d), dtype)
    norms = [g.new_input((d,), dtype), g.new_input((d,), dtype)] if qknorm_eps is not None else []
    tb = new_threadblock_graph((h, b, q_blocks), forloop_range)
    tQ = tb.new_input(Q, imap=(1, 0, 2), fmap=PHI)
    tK = tb.new_input(Kt, imap=(1, 0, PHI), fmap=2)
    tV = tb.new_input(V, imap=(1, 0, PHI), fmap=2)
    if norms:
        tGq = tb.new_input(norms[0], imap=(PHI, PHI, PHI), fmap=PHI)
        tGk = tb.new_input(norms[1], imap=(PHI, PHI, PHI), fmap=PHI)
        tQ = tb.mul(tb.rms_norm(tQ, eps=qknorm_eps), tGq)
        tK = tb.mul(tb.rms_norm(tK, eps=qknorm_eps), tGk)
    _, l, o = _attention_block(tb, tQ, tK, tV, d, scale)
    tb.new_output(tb.div(o, l), omap=(1, 0, 2))
    (Y,) = g.customized([Q, Kt, V, *norms], tb)
    g.mark_output(Y)
    return g.build()


def attention_ref(q, k, v):
    d = q.shape[-1]
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1) @ v


def qknorm_attention(b: int, h: int, sq: int, kv: int, d: int, *, dtype: str = "float16", eps: float = 0.0,
                     scale: float | None = None, **schedule) -> KernelGraph:
    """QKNorm fused into attention: ``attention(rms(Q)·Gq, rms(K)·Gk, V)`` (scores times ``scale``, default
    ``1/√d``)."""
    return gqa_flashattention(b, h, sq, kv, d, dtype=dtype, qknorm_eps=eps, scale=scale, **schedule)


def qknorm_attention_ref(q, k, v, gq, gk, eps: float = 0.0):
    return attention_ref(rms_norm(q, eps, gq, upcast=False), rms_norm(k, eps, gk, upcast=False), v)


def gqa_flashdecoding(b: int, h: int, sq: int, kv: int, d: int, *, dtype: str = "float16",
                      splits: int | None = None, forloop_range: int | None = None, q_blocks: int | None = None,
                      combine_q_blocks: int | None = None, tile: int = 64) -> KernelGraph:
    """Split-KV attention in two kernels. Batch and heads are merged (``b·h``)
    so the grid has room for query-row blocks. Kernel 1, grid (b·h, q blocks,
    splits), runs online softmax over its KV split and saves (max, sum, out);
    kernel 2, grid (b·h, q blocks), rescales each split by
    ``exp(m_s - max_s m_s)`` and combines them."""
    splits = splits or blocks(kv, 4 * tile)
    forloop_range = forloop_range or blocks(kv // splits, tile)
    q_blocks = q_blocks or blocks(sq, tile)
    combine_q_blocks = combine_q_blocks or blocks(sq, 8)
    g = new_kernel_graph()
    Q, Kt, V = g.new_input((b, h, sq, d), dtype), g.new_input((b, h, kv, d), dtype), g.new_input((b, h, kv, d), dtype)
    Q4 = g.reshape(Q, shape=(b * h, 1, sq, d))
    K3, V3 = g.reshape(Kt, shape=(b * h, kv, d)), g.reshape(V, shape=(b * h, kv, d))
    tb = new_threadblock_graph((b * h, q_blocks, splits), forloop_range)
    tQ = tb.new_input(Q4, imap=(0, 2, PHI), fmap=PHI)
    tK = tb.new_input(K3, imap=(0, PHI, 1), fmap=1)
    tV = tb.new_input(V3, imap=(0, PHI, 1), fmap=1)
    acc_dtype = "float32" if dtype in ("float16", "bfloat16") else dtype
    for t in _attention_block(tb, tQ, tK, tV, d):      # m, l, o: (1, 1, rows, ·) per block
        tb.new_output(t, omap=(0, 2, 1), dtype=acc_dtype)
    M, L, O = g.customized([Q4, K3, V3], tb)           # (b·h, splits, sq, ·)
    Y = split_kv_combine(g, M, L, O, b * h, combine_q_blocks, dtype)   # (b·h, 1, sq, d)
    g.mark_output(g.reshape(Y, shape=(b, h, sq, d)))
    return g.build()


def split_kv_combine(g, M, L, O, heads: int, q_blocks: int, dtype: str, empty_eps: float | None = None):
    """The combine block graph after a split-KV attention kernel: the splits' running maxima ``M``, sums ``L``
    and unnormalised outputs ``O`` (heads, splits, rows, ·) merged into the normalised output (heads, 1, rows, d).
    ``empty_eps``: added to the combined sum, so a row that saw no key (sum 0) gives 0, not 0/0 (see
    :func:`.attention_seeds._normalised`)."""
    cb = new_threadblock_graph((heads, q_blocks), 1)
    cm, cl, co = (cb.new_input(x, imap=(0, 2), fmap=PHI) for x in (M, L, O))
    w = cb.exp(cb.sub(cm, cb.reduce_max(cm, dim=1)))
    num = cb.reduce_sum(cb.mul(w, co), dim=1)
    den = cb.reduce_sum(cb.mul(w, cl), dim=1)
    if empty_eps is not None:
        den = cb.scalar_add(den, value=empty_eps)
    cb.new_output(cb.forloop_accum(cb.div(num, den), "sum"), omap=(0, 2), dtype=dtype)
    (Y,) = g.customized([M, L, O], cb)
    return Y


# ------------------------------------------------------------------ nTrans
def ntrans(m: int, n: int, *, dtype: str = "float16", eps: float = 0.0, grid: int | None = None,
           tile: int = 1) -> KernelGraph:
    """``rms(α·(rms(H)+X)+X)`` row-wise, one kernel: inputs H, X, α (m, n); each
    block holds ``m / grid`` whole rows (forloop_range 1)."""
    grid = grid or blocks(m, tile)
    g = new_kernel_graph()
    H, X, Al = (g.new_input((m, n), dtype) for _ in range(3))
    tb = new_threadblock_graph((grid,), 1)
    tH, tX, tA = (tb.new_input(t, imap=(0,), fmap=PHI) for t in (H, X, Al))
    inner = tb.add(tb.mul(tA, tb.add(tb.rms_norm(tH, eps=eps), tX)), tX)
    tb.new_output(tb.forloop_accum(tb.rms_norm(inner, eps=eps), "sum"), omap=(0,))
    (Y,) = g.customized([H, X, Al], tb)
    g.mark_output(Y)
    return g.build()


def ntrans_ref(h, x, alpha, eps: float = 0.0):
    return rms_norm(alpha * (rms_norm(h, eps, upcast=False) + x) + x, eps, upcast=False)


# ------------------------------------------------------------------ the table
@dataclass(frozen=True)
class Workload:
    """A hand-built μGraph, its PyTorch program, and its input shapes."""
    name: str
    build: Callable[..., KernelGraph]
    reference: Callable
    input_shapes: Callable[..., list]     # (*dims) -> shapes, in μGraph input order
    bench_dims: tuple                     # DESIGN.md shapes, b = 1 ({b} scales)


def _attn_shapes(b, h, sq, kv, d):
    return [(b, h, sq, d), (b, h, kv, d), (b, h, kv, d)]


WORKLOADS = {w.name: w for w in (
    Workload("rmsnorm_linear", rmsnorm_linear, rmsnorm_linear_ref,
             lambda m, k, n: [(m, k), (k,), (k, n)], (2, 4096, 4096)),
    Workload("gated_mlp", gated_mlp, gated_mlp_ref,
             lambda m, k, n: [(m, k), (k, n), (k, n)], (8, 4096, 4096)),
    Workload("lora", lora, lora_ref,
             lambda m, k, n, r: [(m, k), (k, n), (k, r), (r, n)], (16, 256, 4096, 16)),
    Workload("gqa_flashdecoding", gqa_flashdecoding, attention_ref, _attn_shapes, (1, 2, 256, 4096, 64)),
    Workload("gqa_flashattention", gqa_flashattention, attention_ref, _attn_shapes, (1, 2, 256, 4096, 64)),
    Workload("qknorm_attention", qknorm_attention, qknorm_attention_ref,
             lambda b, h, sq, kv, d: _attn_shapes(b, h, sq, kv, d) + [(d,), (d,)], (1, 2, 256, 4096, 64)),
    Workload("ntrans", ntrans, ntrans_ref, lambda m, n: [(m, n)] * 3, (8, 4096)),
)}


def bench_dims(name: str, b: int) -> tuple:
    """DESIGN.md's shapes for batch ``b`` (the first dim scales with b)."""
    dims = WORKLOADS[name].bench_dims
    return (dims[0] * b,) + dims[1:]
