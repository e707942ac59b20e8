"""Random small tensor programs for differential testing of the backend: chains of the ops transformer blocks
are made of (elementwise maps, row reductions and their broadcasts back, softmax, RMSNorm / LayerNorm written
several ways, ``nn.Linear``-style matmuls with transposed weights, with a bias, GPT-2's ``addmm``, residual adds,
fp16 round trips), and
attention calls as models write them (HF's eager form, SDPA, masks, soft-cap, GQA, decode rows, q / k norms,
column sums), and a decoder layer's decode step with a static KV cache written in place, drawn from a seed, run
compiled and against the same program in float64 (outputs, and the inputs a program writes).

:func:`draw` makes a :class:`Program`, :func:`draw_attention` an :class:`AttentionProgram`, :func:`draw_decode`
a :class:`DecodeStepProgram` (their source is
printed on a mismatch, so a failure can be replayed by hand); :func:`check` compiles one with a backend and says
how far the result is from float64's."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..numerics import rms_norm

_UNARY = {
    "exp_tanh": lambda x: torch.exp(torch.tanh(x)),
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": torch.relu,
    "square": lambda x: x * x,
    "neg_abs": lambda x: -torch.abs(x),
    "softcap": lambda x: 5.0 * torch.tanh(x / 5.0),
}

_BINARY = {
    "add": torch.add,
    "mul": torch.mul,
    "sub": torch.sub,
    "div": lambda a, b: a / (torch.abs(b) + 1.0),
    "max": torch.maximum,
}


def _rmsnorm_div(x, w):
    return w * (x / torch.sqrt(torch.mean(x * x, dim=-1, keepdim=True) + 1e-6))


def _layernorm_manual(x, w):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + 1e-5) * w


def _rmsnorm_upcast(x, w):   # HF's LlamaRMSNorm: in float32, cast back, weight after
    return rms_norm(x, 1e-6, w)


_NORMS = {"rmsnorm_rsqrt": lambda x, w: rms_norm(x, 1e-6, w, upcast=False), "rmsnorm_div": _rmsnorm_div,
          "rmsnorm_upcast": _rmsnorm_upcast,
          "layernorm_manual": _layernorm_manual,
          "layer_norm": lambda x, w: F.layer_norm(x, (x.shape[-1],), w, None, 1e-5),
          "layer_norm_bias": lambda x, w: F.layer_norm(x, (x.shape[-1],), w, w - 1.0, 1e-5)}   # a bias near 0

_ROWWISE = {
    "softmax": lambda x: torch.softmax(x, -1),
    "log_softmax": lambda x: torch.log_softmax(x, -1),
    "center": lambda x: x - x.mean(-1, keepdim=True),
    "max_shift": lambda x: x - x.amax(-1, keepdim=True),
    "sum_scale": lambda x: x / (x.abs().sum(-1, keepdim=True) + 1.0),
}


@dataclass
class Step:
    """One op of a program: ``kind`` names the table, ``name`` the op, ``args`` the live values it reads (indices
    into the program's values; inputs first), ``param``: the input index of its weight, if any."""
    kind: str
    name: str
    args: tuple
    param: int | None = None


@dataclass
class Program:
    rows: int
    cols: int
    steps: list[Step] = field(default_factory=list)
    inputs: list[tuple] = field(default_factory=list)     # shapes of the inputs
    outputs: tuple = ()                                   # values returned
    widths: list[int] = field(default_factory=list)       # columns of each value

    def run(self, *ins: torch.Tensor) -> tuple:
        values = list(ins[:1])
        for s in self.steps:
            a = [values[i] for i in s.args]
            p = ins[s.param] if s.param is not None else None
            if s.kind == "unary":
                values.append(_UNARY[s.name](a[0]))
            elif s.kind == "binary":
                values.append(_BINARY[s.name](a[0], a[1] if p is None else p))
            elif s.kind == "norm":
                values.append(_NORMS[s.name](a[0], p))
            elif s.kind == "rowwise":
                values.append(_ROWWISE[s.name](a[0]))
            elif s.kind == "linear":
                values.append(F.linear(a[0], p))
            elif s.kind == "linear_bias":    # nn.Linear with its bias (the bias the next input)
                values.append(F.linear(a[0], p, ins[s.param + 1]))
            elif s.kind == "addmm":          # GPT-2's Conv1D: bias + x @ w, the weight stored (in, out)
                flat = a[0].reshape(-1, a[0].shape[-1])
                values.append(torch.addmm(ins[s.param + 1], flat, p).view(*a[0].shape[:-1], p.shape[1]))
            elif s.kind == "matmul_t":      # the weight stored (in, out): x @ w
                values.append(a[0] @ p)
            elif s.kind == "half":
                values.append(a[0].to(torch.float16).to(a[0].dtype))
            else:
                raise ValueError(s.kind)
        return tuple(values[i] for i in self.outputs)

    def make_inputs(self, dtype: torch.dtype = torch.float32, device: str = "cpu") -> list[torch.Tensor]:
        """Fresh random inputs: the activation unit-normal, weights scaled by 1/sqrt(fan-in) (a matmul chain keeps
        its magnitude), norm weights near one."""
        out = []
        for k, shape in enumerate(self.inputs):
            t = torch.randn(shape, dtype=torch.float64)
            step = next((s for s in self.steps if s.param == k), None)
            if step is not None and step.kind in ("linear", "matmul_t", "linear_bias", "addmm"):
                t = t / (shape[1] if step.kind.startswith("linear") else shape[0]) ** 0.5
            elif step is not None and step.kind == "norm":
                t = 1.0 + 0.1 * t
            out.append(t.to(dtype=dtype, device=device))
        return out

    def source(self) -> str:
        lines = [f"rows {self.rows}, inputs {self.inputs}"]
        for k, s in enumerate(self.steps, 1):
            lines.append(f"v{k} = {s.kind}.{s.name}({', '.join(f'v{i}' for i in s.args)}"
                         + (f", in{s.param}" if s.param is not None else "") + ")")
        lines.append(f"return {', '.join(f'v{i}' for i in self.outputs)}")
        return "\n".join(lines)


def draw(seed: int, max_steps: int = 7) -> Program:
    """A program of 2 to ``max_steps`` steps over one (rows, cols) activation and the weights its steps add."""
    rng = random.Random(seed)
    rows = rng.choice([1, 2, 4, 7, 16, 33])
    cols = rng.choice([16, 32, 48, 64, 96, 100])
    prog = Program(rows, cols, inputs=[(rows, cols)], widths=[cols])
    for _ in range(rng.randint(2, max_steps)):
        last = len(prog.widths) - 1
        pick = rng.choice([last, last, rng.randrange(len(prog.widths))])
        w = prog.widths[pick]
        kind = rng.choice(["unary", "unary", "binary", "norm", "rowwise", "linear", "linear", "matmul_t", "half",
                           "linear_bias", "addmm"])
        if kind == "unary":
            prog.steps.append(Step(kind, rng.choice(list(_UNARY)), (pick,)))
        elif kind == "binary":
            same = [i for i, x in enumerate(prog.widths) if x == w and i != pick]
            if same and rng.random() < 0.6:
                prog.steps.append(Step(kind, rng.choice(list(_BINARY)), (pick, rng.choice(same))))
            else:   # against an input: a full one, a row vector or a column vector
                shape = rng.choice([(rows, w), (w,), (rows, 1)])
                prog.inputs.append(shape)
                prog.steps.append(Step(kind, rng.choice(list(_BINARY)), (pick,), len(prog.inputs) - 1))
        elif kind == "norm":
            prog.inputs.append((w,))
            prog.steps.append(Step(kind, rng.choice(list(_NORMS)), (pick,), len(prog.inputs) - 1))
        elif kind == "rowwise":
            prog.steps.append(Step(kind, rng.choice(list(_ROWWISE)), (pick,)))
        elif kind in ("linear", "matmul_t", "linear_bias", "addmm"):
            out = rng.choice([16, 32, 64, 96, w])
            prog.inputs.append((out, w) if kind.startswith("linear") else (w, out))
            prog.steps.append(Step(kind, kind, (pick,), len(prog.inputs) - 1))
            if kind in ("linear_bias", "addmm"):
                prog.inputs.append((out,))
            w = out
        else:
            prog.steps.append(Step(kind, "fp16_round_trip", (pick,)))
        prog.widths.append(w)
    n = len(prog.widths) - 1
    extra = [i for i in range(1, n) if rng.random() < 0.25]
    prog.outputs = tuple(extra + [n])
    return prog


def make_inputs(prog: "Program | AttentionProgram | DecodeStepProgram", dtype: torch.dtype = torch.float32,
                device: str = "cpu") -> list[torch.Tensor]:
    """Fresh random inputs of ``prog`` (its ``make_inputs``)."""
    return prog.make_inputs(dtype, device)


def tolerance(prog: "Program | AttentionProgram | DecodeStepProgram", dtype: torch.dtype,
              base: float | None = None) -> float:
    """The relative error (against float64) ``prog`` may have in ``dtype``: ``base`` or the dtype's own (1e-4 fp32,
    5e-3 fp16, 2e-2 bf16), and 5e-3 at least where a chain rounds to fp16 on the way (a rounding that flips, a sum
    in another order, moves its value by an fp16 ulp)."""
    tol = base if base is not None else {torch.float32: 1e-4, torch.float16: 5e-3}.get(dtype, 2e-2)
    if isinstance(prog, Program) and any(s.kind == "half" for s in prog.steps):
        tol = max(tol, 5e-3)
    return tol


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``|got - want| / |want|`` in the 2-norm, over the whole tensor (float64). NaN where one has a NaN the other
    has not (an attention row that sees no key: NaN in SDPA with a bool mask); the NaNs that agree count as 0."""
    got, want = got.double().cpu(), want.double().cpu()
    if not torch.equal(torch.isnan(got), torch.isnan(want)):
        return float("nan")
    got, want = got.nan_to_num(), want.nan_to_num()
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


def check(prog: "Program | AttentionProgram | DecodeStepProgram", compile_fn: Callable[[Callable], Callable], dtype: torch.dtype = torch.float32,
          device: str = "cpu") -> dict[str, Any]:
    """Compile ``prog.run`` with ``compile_fn`` and run it on fresh inputs: the relative error of each output
    against float64's, and eager's in ``dtype`` for scale (the dtype's own rounding)."""
    ins = make_inputs(prog, dtype, device)
    mutated = getattr(prog, "mutated", ())

    def run(fn: Callable, args: list) -> list:   # the outputs, then the inputs it writes in place
        outs = list(fn(*args))
        return outs + [args[i] for i in mutated]

    with torch.no_grad():
        got = run(compile_fn(prog.run), [t.clone() for t in ins])
        eager = run(prog.run, [t.clone() for t in ins])
        want = run(prog.run, [t.double() if t.is_floating_point() else t.clone() for t in ins])
    return {"errors": [relative_error(g, w) for g, w in zip(got, want)],
            "eager_errors": [relative_error(e, w) for e, w in zip(eager, want)]}


# ------------------------------------------------------------------ attention
def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """HF's repeat_kv: (b, hk, s, d) -> (b, hk·n_rep, s, d) by expand and reshape."""
    b, hk, s, d = x.shape
    return x if n_rep == 1 else x[:, :, None].expand(b, hk, n_rep, s, d).reshape(b, hk * n_rep, s, d)


@dataclass
class AttentionProgram:
    """One attention call as models write it: ``form`` (``hf_eager``: matmul, scale, soft-cap, additive mask,
    softmax in fp32, matmul; ``manual``: the same with ``softmax`` in the input dtype and the scale on q;
    ``sdpa``: ``F.scaled_dot_product_attention``), a ``mask`` (``none``, ``causal`` / ``padding`` / ``window``
    additive at finfo.min, ``bool`` causal for SDPA, ``is_causal``), GQA by ``repeat_kv`` or SDPA's
    ``enable_gqa``, an optional RMSNorm of q and k (``qk_norm``), the P column sums (``column_sums``, H2O's) and
    the output as (b, h, sq, d) or (b, sq, h·d)."""
    b: int
    h: int
    hk: int
    sq: int
    skv: int
    d: int
    form: str
    mask: str
    softcap: float | None
    gqa: str            # "repeat_kv" or "enable_gqa"
    qk_norm: bool
    column_sums: bool
    merge_heads: bool

    def _mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        if self.mask in ("none", "is_causal"):
            return None
        i = torch.arange(self.sq)[:, None] + (self.skv - self.sq)
        j = torch.arange(self.skv)[None, :]
        keep = (j <= i).expand(self.b, 1, self.sq, self.skv).clone()
        if self.mask == "window":
            keep &= i - j < 8
        if self.mask == "padding":
            for r in range(self.b):
                keep[r, :, :, : 3 * r] = False
        if self.mask == "bool":
            return keep
        return torch.zeros(self.b, 1, self.sq, self.skv, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)

    def make_inputs(self, dtype: torch.dtype, device: str) -> list[torch.Tensor]:
        ins = [torch.randn(self.b, self.h, self.sq, self.d), torch.randn(self.b, self.hk, self.skv, self.d),
               torch.randn(self.b, self.hk, self.skv, self.d)]
        ins = [t.to(dtype=dtype, device=device) for t in ins]
        mask = self._mask(dtype)
        if mask is not None:
            ins.append(mask.to(device))
        if self.qk_norm:
            ins += [(1.0 + 0.1 * torch.randn(self.d)).to(dtype=dtype, device=device) for _ in range(2)]
        return ins

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: torch.Tensor) -> tuple:
        rest = list(rest)
        mask = rest.pop(0) if self.mask not in ("none", "is_causal") else None
        if self.qk_norm:
            wq, wk = rest
            q, k = _rmsnorm_upcast(q, wq), _rmsnorm_upcast(k, wk)
        scale = self.d ** -0.5
        n_rep = self.h // self.hk
        if self.form == "sdpa":
            gqa = self.gqa == "enable_gqa" and n_rep > 1
            if not gqa:
                k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.mask == "is_causal",
                                               scale=scale, **({"enable_gqa": True} if gqa else {}))
            outs = [o]
        else:
            k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
            if self.form == "hf_eager":
                w = torch.matmul(q, k.transpose(2, 3)) * scale
            else:
                w = (q * scale) @ k.transpose(-1, -2)
            if self.softcap is not None:
                w = torch.tanh(w / self.softcap) * self.softcap
            if mask is not None:
                w = w + mask
            if self.form == "hf_eager":
                p = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
            else:
                p = torch.softmax(w, dim=-1)
            outs = [torch.matmul(p, v)]
            if self.column_sums:
                outs.append(p.sum(-2))
        if self.merge_heads:
            outs[0] = outs[0].transpose(1, 2).reshape(self.b, self.sq, self.h * self.d)
        return tuple(outs)

    def source(self) -> str:
        return repr(self)


def draw_attention(seed: int) -> AttentionProgram:
    """An attention call of small, often ragged sizes (decode rows, prime KV lengths, GQA groups)."""
    rng = random.Random(seed)
    hk, rep = rng.choice([1, 2]), rng.choice([1, 2, 4])
    sq = rng.choice([1, 1, 2, 5, 16, 17, 32])
    skv = rng.choice([16, 37, 64, 131]) if sq <= 2 else rng.choice([sq, sq + 16, 64])
    form = rng.choice(["hf_eager", "hf_eager", "manual", "sdpa", "sdpa"])
    masks = ["none", "causal", "padding", "window"] + (["bool"] + ["is_causal"] * (sq == skv) if form == "sdpa" else [])
    return AttentionProgram(
        b=rng.choice([1, 2]), h=hk * rep, hk=hk, sq=sq, skv=skv, d=rng.choice([16, 32, 64]), form=form,
        mask=rng.choice(masks), softcap=rng.choice([None, None, 30.0]) if form != "sdpa" else None,
        gqa=rng.choice(["repeat_kv", "enable_gqa"]), qk_norm=rng.random() < 0.25,
        column_sums=form != "sdpa" and rng.random() < 0.25, merge_heads=rng.random() < 0.5)


# ------------------------------------------------------------------ a decode step with a static KV cache
def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass
class DecodeStepProgram:
    """One decoder layer's decode step (or a prefill chunk of ``tokens``) as HF writes it with a ``StaticCache``: an RMSNorm (``norm``: one of the
    chain programs' forms), the q / k / v projections (``fused_qkv``: one weight split after the matmul), RoPE
    (``rope``), the cache write at the position (``write``: ``index_copy_`` or slice assignment), attention over
    every slot with an additive mask hiding the slots past the position (GQA by ``repeat_kv``), the output
    projection and the residual, and optionally the gated MLP (Gemma-2's soft-cap, sliding window and GELU-tanh as
    options). Returns the layer's output; the caches are written
    in place (:attr:`mutated`)."""
    b: int
    dim: int
    heads: int
    kv_heads: int
    head_dim: int
    slots: int
    norm: str
    fused_qkv: bool
    rope: bool
    write: str
    mlp: bool
    tokens: int = 1      # query tokens of the step: 1 a decode step, more a prefill chunk at contiguous positions
    softcap: float | None = None   # Gemma-2's attention soft-cap
    window: int | None = None      # a sliding window: keys more than this far behind a query are hidden
    act: str = "silu"              # the gated MLP's activation: silu (Llama) or gelu_tanh (Gemma)

    mutated = (1, 2)     # the K and V caches among the inputs

    def make_inputs(self, dtype: torch.dtype, device: str) -> list[torch.Tensor]:
        b, d, h, hk, hd, n, t = self.b, self.dim, self.heads, self.kv_heads, self.head_dim, self.slots, self.tokens
        first = random.randrange(n - t + 1)
        rows = torch.arange(first, first + t)[:, None]
        keep = torch.arange(n)[None, :] <= rows
        if self.window is not None:
            keep &= rows - torch.arange(n)[None, :] < self.window
        mask = torch.zeros(b, 1, t, n).masked_fill(~keep, torch.finfo(dtype).min)
        angle = torch.rand(b, t, hd // 2) * 6.0
        cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
        w = lambda o, i: torch.randn(o, i) * i ** -0.5   # noqa: E731
        floats = [torch.randn(b, t, d), torch.randn(b, hk, n, hd), torch.randn(b, hk, n, hd), mask, cos, sin,
                  1.0 + 0.1 * torch.randn(d), w((h + 2 * hk) * hd, d), w(d, h * hd), 1.0 + 0.1 * torch.randn(d),
                  w(2 * 2 * d, d), w(d, 2 * d)]
        ins = [t.to(dtype=dtype, device=device) for t in floats]
        ins.insert(3, torch.arange(first, first + t, device=device))
        return ins

    def run(self, x, k_cache, v_cache, pos, mask, cos, sin, g1, w_qkv, w_o, g2, w_gu, w_down) -> tuple:
        b, h, hk, hd, t = self.b, self.heads, self.kv_heads, self.head_dim, self.tokens
        hn = _NORMS[self.norm](x, g1)
        if self.fused_qkv:
            q, k, v = F.linear(hn, w_qkv).split([h * hd, hk * hd, hk * hd], dim=-1)
        else:
            wq, wk, wv = w_qkv.split([h * hd, hk * hd, hk * hd], dim=0)
            q, k, v = F.linear(hn, wq), F.linear(hn, wk), F.linear(hn, wv)
        q = q.view(b, t, h, hd).transpose(1, 2)
        k = k.view(b, t, hk, hd).transpose(1, 2)
        v = v.view(b, t, hk, hd).transpose(1, 2)
        if self.rope:
            c, s = cos.unsqueeze(1), sin.unsqueeze(1)
            q, k = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
        if self.write == "index_copy":
            k_cache.index_copy_(2, pos, k)
            v_cache.index_copy_(2, pos, v)
        else:
            k_cache[:, :, pos] = k
            v_cache[:, :, pos] = v
        keys, values = repeat_kv(k_cache, h // hk), repeat_kv(v_cache, h // hk)
        w = torch.matmul(q, keys.transpose(2, 3)) * hd ** -0.5
        if self.softcap is not None:
            w = torch.tanh(w / self.softcap) * self.softcap
        w = w + mask
        p = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.matmul(p, values).transpose(1, 2).reshape(b, t, h * hd)
        x = x + F.linear(o, w_o)
        if self.mlp:
            gate, up = F.linear(_NORMS[self.norm](x, g2), w_gu).chunk(2, dim=-1)
            act = F.silu(gate) if self.act == "silu" else F.gelu(gate, approximate="tanh")
            x = x + F.linear(act * up, w_down)
        return (x,)

    def source(self) -> str:
        return repr(self)


def draw_decode(seed: int) -> DecodeStepProgram:
    """A decode step of small, often ragged sizes (odd slot counts, GQA groups, batch 1-4)."""
    rng = random.Random(seed)
    head_dim = rng.choice([16, 32])
    heads = rng.choice([2, 4])
    return DecodeStepProgram(
        b=rng.choice([1, 2, 4]), dim=rng.choice([64, 96, 128]), heads=heads, kv_heads=rng.choice([1, 2, heads]),
        head_dim=head_dim, slots=rng.choice([17, 32, 37, 64]), norm=rng.choice(["rmsnorm_rsqrt", "rmsnorm_div",
                                                                               "rmsnorm_upcast"]),
        fused_qkv=rng.random() < 0.5, rope=rng.random() < 0.7, write=rng.choice(["index_copy", "slice"]),
        mlp=rng.random() < 0.5, tokens=rng.choice([1, 1, 1, 3, 8, 13]), softcap=rng.choice([None, None, 50.0]),
        window=rng.choice([None, None, 8]), act=rng.choice(["silu", "gelu_tanh"]))
