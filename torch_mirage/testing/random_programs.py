"""Random small tensor programs for differential testing of the backend: chains of the ops transformer blocks
are made of (elementwise maps, row reductions and their broadcasts back, softmax, RMSNorm / LayerNorm written
several ways, ``nn.Linear``-style matmuls with transposed weights, residual adds, fp16 round trips), drawn from
a seed, run compiled and against the same program in float64.

:func:`draw` makes a :class:`Program` (its source is printed on a mismatch, so a failure can be replayed by
hand); :func:`check` compiles it with a backend and says how far the result is from float64's."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

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


def _rmsnorm_rsqrt(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _rmsnorm_div(x, w):
    return w * (x / torch.sqrt(torch.mean(x * x, dim=-1, keepdim=True) + 1e-6))


def _rmsnorm_upcast(x, w):   # HF's LlamaRMSNorm: in float32, cast back, weight after
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return w * h.to(x.dtype)


def _layernorm_manual(x, w):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + 1e-5) * w


_NORMS = {"rmsnorm_rsqrt": _rmsnorm_rsqrt, "rmsnorm_div": _rmsnorm_div, "rmsnorm_upcast": _rmsnorm_upcast,
          "layernorm_manual": _layernorm_manual,
          "layer_norm": lambda x, w: F.layer_norm(x, (x.shape[-1],), w, None, 1e-5)}

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
    width: int = 0          # a matmul's output columns


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
            elif s.kind == "matmul_t":      # the weight stored (in, out): x @ w
                values.append(a[0] @ p)
            elif s.kind == "half":
                values.append(a[0].to(torch.float16).to(a[0].dtype))
            else:
                raise ValueError(s.kind)
        return tuple(values[i] for i in self.outputs)

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
        kind = rng.choice(["unary", "unary", "binary", "norm", "rowwise", "linear", "linear", "matmul_t", "half"])
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
        elif kind in ("linear", "matmul_t"):
            out = rng.choice([16, 32, 64, 96, w])
            prog.inputs.append((out, w) if kind == "linear" else (w, out))
            prog.steps.append(Step(kind, kind, (pick,), len(prog.inputs) - 1, out))
            w = out
        else:
            prog.steps.append(Step(kind, "fp16_round_trip", (pick,)))
        prog.widths.append(w)
    n = len(prog.widths) - 1
    extra = [i for i in range(1, n) if rng.random() < 0.25]
    prog.outputs = tuple(extra + [n])
    return prog


def make_inputs(prog: Program, dtype: torch.dtype = torch.float32, device: str = "cpu") -> list[torch.Tensor]:
    """Fresh random inputs: the activation unit-normal, weights scaled by 1/sqrt(fan-in) (a matmul chain keeps
    its magnitude), norm weights near one."""
    out = []
    for k, shape in enumerate(prog.inputs):
        t = torch.randn(shape, dtype=torch.float64)
        step = next((s for s in prog.steps if s.param == k), None)
        if step is not None and step.kind in ("linear", "matmul_t"):
            t = t / (shape[1] if step.kind == "linear" else shape[0]) ** 0.5
        elif step is not None and step.kind == "norm":
            t = 1.0 + 0.1 * t
        out.append(t.to(dtype=dtype, device=device))
    return out


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``|got - want| / |want|`` in the 2-norm, over the whole tensor (float64)."""
    got, want = got.double().cpu(), want.double().cpu()
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


def check(prog: Program, compile_fn: Callable[[Callable], Callable], dtype: torch.dtype = torch.float32,
          device: str = "cpu") -> dict[str, Any]:
    """Compile ``prog.run`` with ``compile_fn`` and run it on fresh inputs: the relative error of each output
    against float64's, and eager's in ``dtype`` for scale (the dtype's own rounding)."""
    ins = make_inputs(prog, dtype, device)
    with torch.no_grad():
        got = compile_fn(prog.run)(*ins)
        eager = prog.run(*ins)
        want = prog.run(*[t.double() for t in ins])
    return {"errors": [relative_error(g, w) for g, w in zip(got, want)],
            "eager_errors": [relative_error(e, w) for e, w in zip(eager, want)]}
