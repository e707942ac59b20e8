"""The benchmark workloads of DESIGN.md's table, written as model authors write them.

Each :class:`Workload` is one row of the table: the PyTorch function, its sizes at
batch ``b`` (and the tiny sizes of ``--quick``), and how every input is drawn
(:data:`INPUT_KINDS`: scaled normals, gains near 1, additive masks with ``-inf``,
RoPE tables, cache positions; never zeros). :func:`cost` counts the minimum
bytes (each input read once, each output written once) and the matmul flops,
by running the function on meta tensors, so the counts follow the code.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from ..numerics import rms_norm
from . import select

# ---------------------------------------------------------------------------------------------
# The functions (what a model author writes)


def _attention(q, k, v, mask=None, softcap: float | None = None):
    s = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s + mask
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return p @ v, p


def rmsnorm_linear(x, g, w):
    return rms_norm(x, weight=g) @ w


def gated_mlp(x, w1, w3):
    return F.silu(x @ w1) * (x @ w3)


def gqa(q, k, v):
    return _attention(q, k, v)[0]


def qknorm_attention(q, k, v, gq, gk):
    return _attention(rms_norm(q, weight=gq), rms_norm(k, weight=gk), v)[0]


def lora(x, w, a, b):
    return x @ w + (x @ a) @ b


def ntrans(h, x, alpha):
    return rms_norm(alpha * (rms_norm(h) + x) + x)


def bias_residual_layernorm(x, residual, bias, gamma, beta):
    return F.layer_norm(x + bias + residual, (x.shape[-1],), gamma, beta)


def bert_softmax(scores, mask):
    return torch.softmax(scores + mask, dim=-1)


def bias_gelu(x, bias):
    return F.gelu(x + bias, approximate="tanh")


def h2o_core(q, k, v, causal_mask):
    """H2O's heavy-hitter statistics: attention output and each key's accumulated attention."""
    out, p = _attention(q, k, v, causal_mask)
    return out, p.sum(dim=-2, dtype=torch.float32)


def gemma2_softcap(q, k, v, causal_mask):
    return _attention(q, k, v, causal_mask, softcap=50.0)[0]


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def llama_layer_decode(x, cos, sin, mask, cache_position, k_cache, v_cache,
                       ln1, wq, wk, wv, wo, ln2, w_gate, w_up, w_down):
    """One Llama-3 decoder layer for one new token per sequence, with a static KV cache
    updated in place (``index_copy_`` at ``cache_position``), grouped-query attention over
    the whole cache and an additive mask hiding the slots not yet written."""
    b, t, d = x.shape
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
    heads = wq.shape[0] // head_dim
    h = rms_norm(x, 1e-5, ln1)
    q = F.linear(h, wq).view(b, t, heads, head_dim).transpose(1, 2)
    k = F.linear(h, wk).view(b, t, kv_heads, head_dim).transpose(1, 2)
    v = F.linear(h, wv).view(b, t, kv_heads, head_dim).transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    k_cache.index_copy_(2, cache_position, k)
    v_cache.index_copy_(2, cache_position, v)
    q = q.reshape(b, kv_heads, heads // kv_heads * t, head_dim)   # the query heads sharing one KV head
    attn, _ = _attention(q, k_cache, v_cache, mask)
    attn = attn.reshape(b, heads, t, head_dim).transpose(1, 2).reshape(b, t, heads * head_dim)
    x = x + F.linear(attn, wo)
    h = rms_norm(x, 1e-5, ln2)
    return x + F.linear(F.silu(F.linear(h, w_gate)) * F.linear(h, w_up), w_down)


# ---------------------------------------------------------------------------------------------
# Inputs: how each kind of input is drawn (never zeros)



def _randn(shape, dtype, device, gen, scale=1.0):
    return (torch.randn(shape, device=device, generator=gen, dtype=torch.float32) * scale).to(dtype)


def _gain(shape, dtype, device, gen, scale=0.1):
    return (1.0 + scale * torch.randn(shape, device=device, generator=gen)).to(dtype)


def _uniform(shape, dtype, device, gen, scale=(0.05, 0.5)):
    lo, hi = scale
    return (lo + (hi - lo) * torch.rand(shape, device=device, generator=gen)).to(dtype)


def _padding_mask(shape, dtype, device, gen, scale=None):
    """Additive (b, 1, 1, L) mask: each sequence keeps a random prefix of at least half its length."""
    b, length = shape[0], shape[-1]
    keep = torch.randint(length // 2, length + 1, (b,), device=device, generator=gen)
    pos = torch.arange(length, device=device)
    mask = torch.where(pos[None, :] < keep[:, None], 0.0, float("-inf"))
    return mask.view(shape).to(dtype)


def _causal_mask(shape, dtype, device, gen, scale=None):
    """Additive (1, 1, S, S) causal mask: 0 on and below the diagonal, -inf above."""
    s = shape[-1]
    mask = torch.full((s, s), float("-inf"), device=device).triu(1)
    return mask.view(shape).to(dtype)


def _decode_mask(shape, dtype, device, gen, scale):
    """Additive (b, 1, 1, T) mask of a static cache holding ``scale + 1`` tokens."""
    pos = torch.arange(shape[-1], device=device)
    mask = torch.where(pos <= scale, 0.0, float("-inf")).expand(shape).contiguous()
    return mask.to(dtype)


def _rope(fn):
    def make(shape, dtype, device, gen, scale):
        position, theta = scale
        head_dim = shape[-1]
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim)
        angles = torch.cat([position * inv_freq] * 2)
        return fn(angles).to(dtype).expand(shape).contiguous()
    return make


def _position(shape, dtype, device, gen, scale):
    return torch.full(shape, scale, dtype=torch.int64, device=device)


INPUT_KINDS: dict[str, Callable] = {
    "randn": _randn, "gain": _gain, "uniform": _uniform, "padding_mask": _padding_mask,
    "causal_mask": _causal_mask, "decode_mask": _decode_mask, "cos": _rope(torch.cos), "sin": _rope(torch.sin),
    "position": _position,
}


@dataclass(frozen=True)
class Arg:
    name: str
    shape: tuple[int, ...]
    kind: str = "randn"
    scale: object = 1.0

    @property
    def is_float(self) -> bool:
        return self.kind != "position"


# ---------------------------------------------------------------------------------------------
# The table


@dataclass(frozen=True)
class Workload:
    name: str
    fn: Callable
    shapes: str                                    # DESIGN.md's shape column
    sizes: Callable[[int], dict[str, int]]         # sizes at batch b
    args: Callable[[dict[str, int]], list[Arg]]    # the inputs, in call order
    quick: Mapping[str, int] = field(default_factory=dict)   # tiny sizes for --quick
    mutates: tuple[int, ...] = ()                  # inputs updated in place (checked like outputs)

    def dims(self, batch: int, quick: bool = False) -> dict[str, int]:
        dims = self.sizes(batch)
        if quick:
            dims.update({k: (v(batch) if callable(v) else v) for k, v in self.quick.items()})
        return dims

    def arg_specs(self, batch: int, quick: bool = False) -> list[Arg]:
        return self.args(self.dims(batch, quick))

    def make_inputs(self, batch: int, dtype: torch.dtype, device, seed: int, quick: bool = False) -> list[torch.Tensor]:
        gen = torch.Generator(device=device).manual_seed(seed)
        return [INPUT_KINDS[a.kind](a.shape, dtype if a.is_float else torch.int64, device, gen, a.scale)
                for a in self.arg_specs(batch, quick)]


def _scores(d):
    return d["D"] ** -0.5


def _llama_args(d):
    b, dm, hd, nh, kv, inter, ctx = d["b"], d["D"], d["HD"], d["H"], d["KV"], d["I"], d["T"]
    pos = ctx - ctx // 32 - 1
    return [Arg("x", (b, 1, dm)), Arg("cos", (b, 1, hd), "cos", (pos, 500000.0)),
            Arg("sin", (b, 1, hd), "sin", (pos, 500000.0)), Arg("mask", (b, 1, 1, ctx), "decode_mask", pos),
            Arg("cache_position", (1,), "position", pos),
            Arg("k_cache", (b, kv, ctx, hd)), Arg("v_cache", (b, kv, ctx, hd)),
            Arg("ln1", (dm,), "gain"), Arg("wq", (nh * hd, dm), scale=dm ** -0.5),
            Arg("wk", (kv * hd, dm), scale=dm ** -0.5), Arg("wv", (kv * hd, dm), scale=dm ** -0.5),
            Arg("wo", (dm, nh * hd), scale=(nh * hd) ** -0.5), Arg("ln2", (dm,), "gain"),
            Arg("w_gate", (inter, dm), scale=dm ** -0.5), Arg("w_up", (inter, dm), scale=dm ** -0.5),
            Arg("w_down", (dm, inter), scale=inter ** -0.5)]


def _attn_args(d, extra=()):
    b, h, m, n, e = d["B"], d["H"], d["M"], d["N"], d["E"]
    return [Arg("q", (b, h, m, e)), Arg("k", (b, h, n, e)), Arg("v", (b, h, n, e)), *extra]


WORKLOADS: dict[str, Workload] = {w.name: w for w in [
    Workload("rmsnorm_linear", rmsnorm_linear, "X(2b,4096) G(4096) W(4096,4096): rms(X)·G @ W",
             lambda b: dict(M=2 * b, D=4096, N=4096),
             lambda d: [Arg("x", (d["M"], d["D"])), Arg("g", (d["D"],), "gain"),
                        Arg("w", (d["D"], d["N"]), scale=d["D"] ** -0.5)],
             quick=dict(D=64, N=48)),
    Workload("gated_mlp", gated_mlp, "X(8b,4096) W1,W3(4096,4096): silu(X@W1)·(X@W3)",
             lambda b: dict(M=8 * b, D=4096, N=4096),
             lambda d: [Arg("x", (d["M"], d["D"])), Arg("w1", (d["D"], d["N"]), scale=d["D"] ** -0.5),
                        Arg("w3", (d["D"], d["N"]), scale=d["D"] ** -0.5)],
             quick=dict(D=64, N=48)),
    Workload("gated_mlp_llama8b", gated_mlp, "X(b,4096) W1,W3(4096,14336)",
             lambda b: dict(M=b, D=4096, N=14336),
             lambda d: [Arg("x", (d["M"], d["D"])), Arg("w1", (d["D"], d["N"]), scale=d["D"] ** -0.5),
                        Arg("w3", (d["D"], d["N"]), scale=d["D"] ** -0.5)],
             quick=dict(D=64, N=112)),
    Workload("gqa", gqa, "Q(b,2,256,64) K,V(b,2,4096,64): softmax(QKᵀ/√d)V",
             lambda b: dict(B=b, H=2, M=256, N=4096, E=64), _attn_args,
             quick=dict(M=8, N=64, E=16)),
    Workload("qknorm_attention", qknorm_attention, "as gqa, rms-normed Q and K (weights G(64))",
             lambda b: dict(B=b, H=2, M=256, N=4096, E=64),
             lambda d: _attn_args(d, [Arg("gq", (d["E"],), "gain"), Arg("gk", (d["E"],), "gain")]),
             quick=dict(M=8, N=64, E=16)),
    Workload("lora", lora, "X(16b,256) W(256,4096) A(256,16) B(16,4096): XW + (XA)B",
             lambda b: dict(M=16 * b, D=256, N=4096, R=16),
             lambda d: [Arg("x", (d["M"], d["D"])), Arg("w", (d["D"], d["N"]), scale=d["D"] ** -0.5),
                        Arg("a", (d["D"], d["R"]), scale=d["D"] ** -0.5),
                        Arg("b", (d["R"], d["N"]), scale=d["R"] ** -0.5)],
             quick=dict(M=lambda b: 4 * b, D=32, N=48, R=4)),
    Workload("ntrans", ntrans, "H,X,α(8b,4096): rms(α·(rms(H)+X)+X)",
             lambda b: dict(M=8 * b, D=4096),
             lambda d: [Arg("h", (d["M"], d["D"])), Arg("x", (d["M"], d["D"])),
                        Arg("alpha", (d["M"], d["D"]), "uniform", (0.05, 0.5))],
             quick=dict(D=64)),
    Workload("bias_residual_layernorm", bias_residual_layernorm, "X,R(4096b,768): layer_norm(X+bias+R)",
             lambda b: dict(M=4096 * b, D=768),
             lambda d: [Arg("x", (d["M"], d["D"])), Arg("residual", (d["M"], d["D"])),
                        Arg("bias", (d["D"],), scale=0.1), Arg("gamma", (d["D"],), "gain"),
                        Arg("beta", (d["D"],), scale=0.1)],
             quick=dict(M=lambda b: 16 * b, D=48)),
    Workload("bert_softmax", bert_softmax, "S(b,12,512,512) + mask(b,1,1,512), softmax",
             lambda b: dict(B=b, H=12, L=512),
             lambda d: [Arg("scores", (d["B"], d["H"], d["L"], d["L"]), scale=3.0),
                        Arg("mask", (d["B"], 1, 1, d["L"]), "padding_mask")],
             quick=dict(H=2, L=32)),
    Workload("bias_gelu", bias_gelu, "X(512b,3072): gelu_tanh(X+bias)",
             lambda b: dict(M=512 * b, D=3072),
             lambda d: [Arg("x", (d["M"], d["D"])), Arg("bias", (d["D"],), scale=0.1)],
             quick=dict(M=lambda b: 8 * b, D=96)),
    Workload("h2o_core", h2o_core, "Q,K,V(1,32,1024b,128), causal softmax, P@V and column sum of P",
             lambda b: dict(B=1, H=32, M=1024 * b, N=1024 * b, E=128),
             lambda d: _attn_args(d, [Arg("causal_mask", (1, 1, d["M"], d["N"]), "causal_mask")]),
             quick=dict(H=2, M=lambda b: 32 * b, N=lambda b: 32 * b, E=16)),
    Workload("gemma2_softcap", gemma2_softcap, "as h2o, scores tanh(s/50)·50, output P@V only",
             lambda b: dict(B=1, H=32, M=1024 * b, N=1024 * b, E=128),
             lambda d: _attn_args(d, [Arg("causal_mask", (1, 1, d["M"], d["N"]), "causal_mask")]),
             quick=dict(H=2, M=lambda b: 32 * b, N=lambda b: 32 * b, E=16)),
    Workload("llama_layer_decode", llama_layer_decode,
             "Llama-3-8B decoder layer, batch b, KV cache 4096, static cache",
             lambda b: dict(b=b, D=4096, HD=128, H=32, KV=8, I=14336, T=4096), _llama_args,
             quick=dict(D=64, HD=16, H=4, KV=2, I=96, T=64), mutates=(5, 6)),
]}

# ---------------------------------------------------------------------------------------------
# Reference columns for the attention workloads: what a user would write instead (fused SDPA, flex_attention with
# a tanh soft-cap score_mod and a causal block mask). Each takes the workload's inputs; ``same`` says whether it
# computes the workload's (first) output — SDPA has no soft-cap and no column sums, so it is a speed reference only.


@dataclass(frozen=True)
class Reference:
    label: str
    make: Callable[[], Callable]    # -> fn(*workload inputs); built per case (flex compiles, caches block masks)
    same: bool


def sdpa_causal(q, k, v, *_):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_plain(q, k, v, *_):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def flex(softcap: float | None = None, causal: bool = True, gqa: bool = False) -> Callable:
    """Compiled flex_attention with ``softcap·tanh(s/softcap)`` as score_mod and a causal block mask (made once
    per shape and device, outside the timed call)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    masks: dict = {}

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / softcap) * softcap

    def causal_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def run(q, k, v, *_):
        key = (q.shape[-2], k.shape[-2], q.device)
        if causal and key not in masks:
            masks[key] = create_block_mask(causal_mod, None, None, q.shape[-2], k.shape[-2], device=q.device)
        return compiled(q, k, v, score_mod=score_mod if softcap else None, block_mask=masks.get(key),
                        enable_gqa=gqa)
    return run


REFERENCES: dict[str, tuple[Reference, ...]] = {
    "gemma2_softcap": (Reference("flex(softcap+causal)", lambda: flex(50.0), True),
                       Reference("sdpa(causal, no softcap)", lambda: sdpa_causal, False)),
    "h2o_core": (Reference("sdpa(causal, P·V only)", lambda: sdpa_causal, False),
                 Reference("flex(causal, P·V only)", lambda: flex(None), False)),
    "gqa": (Reference("sdpa", lambda: sdpa_plain, True), Reference("flex", lambda: flex(None, causal=False), True)),
}


# --quick's default set: a matmul prologue, a masked softmax, attention, a whole decoder layer
QUICK_DEFAULT = ("rmsnorm_linear", "bert_softmax", "gqa", "llama_layer_decode")


def get(names: Sequence[str] | None) -> list[Workload]:
    return select(WORKLOADS, names, "workload(s)")


# ---------------------------------------------------------------------------------------------
# Minimum work


@dataclass(frozen=True)
class Cost:
    bytes: int     # every input read once, every output written once
    flops: int     # matmul flops (2·M·N·K), the work the matrix units must do


def cost(workload: Workload, batch: int, dtype: torch.dtype, quick: bool = False) -> Cost:
    """Count bytes and matmul flops by running the workload on meta tensors.

    In-place updates (the decode layer's cache slot) count as reads of the whole input; the
    written slice is a few KiB. Causal masks are not credited: the floor counts the full
    QKᵀ and P·V products, as DESIGN.md's table does."""
    from torch.utils.flop_counter import FlopCounterMode

    specs = workload.arg_specs(batch, quick)
    inputs = [torch.empty(a.shape, dtype=dtype if a.is_float else torch.int64, device="meta") for a in specs]
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        out = workload.fn(*inputs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    nbytes = sum(t.numel() * t.element_size() for t in (*inputs, *outs))
    return Cost(int(nbytes), int(counter.get_total_flops()))


def floor_us(c: Cost, copy_bytes_per_s: float, matmul_flops_per_s: float) -> float:
    return max(c.bytes / copy_bytes_per_s, c.flops / matmul_flops_per_s) * 1e6


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)
