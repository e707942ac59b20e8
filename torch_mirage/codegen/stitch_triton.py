"""StitchPlan → Triton source, and the launcher that runs it on real tensors.

One region becomes one ``@triton.jit`` kernel over a ``[BLOCK_M, BLOCK_N]`` tile of
its iteration space (rows × the last dim). Values constant along the row
(reduction results, per-row inputs) are ``[BLOCK_M, 1]`` vectors that broadcast.
Inputs are loaded through their real strides (broadcast dims have stride 0) and
converted to fp32; outputs are cast on store and written with the strides the
IR recorded. Row-resident strategies evaluate the whole DAG once (the regional
scheme: the row stays on chip across reductions); the looped strategy makes one
chunked pass over the row per reduction level and a last pass for the stores,
recomputing producers from device memory (the global scheme).

NaN / inf follow eager: ``amax``/``amin`` and ``maximum``/``minimum`` propagate
NaN (``tl.max`` does not, so NaN is tracked separately); an all ``-inf`` softmax
row gives NaN as ``-inf - -inf`` does. ``_tanh`` is computed from ``exp`` (no
libdevice in the interpreter), ``_erf`` uses ``tl.erf``.

:func:`node_support` says which IR nodes this codegen can emit; the partitioner
claims nothing else.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..capture.ir import Node, Value
from ..capture.ops import OpKind
from ..partition.plan import StitchPlan, Strategy

aten = torch.ops.aten
prims = torch.ops.prims

TL_DTYPE = {torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32",
            torch.bool: "tl.int1"}

HELPERS = '''
@triton.jit
def _tanh(x):
    # tanh from exp: stable for large |x|, Taylor series near 0 (no libdevice in the interpreter)
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = a * (1.0 - x2 * (0.3333333333333333 - x2 * 0.13333333333333333))
    r = tl.where(a < 0.004, small, big)
    return tl.where(x < 0, -r, r)


@triton.jit
def _erf(x):
    return tl.erf(x)


@triton.jit
def _maximum(a, b):
    # NaN-propagating like torch.maximum / clamp_min
    return tl.where(a != a, a, tl.where(b != b, b, tl.where(a > b, a, b)))


@triton.jit
def _minimum(a, b):
    return tl.where(a != a, a, tl.where(b != b, b, tl.where(a < b, a, b)))
'''

# ---------------------------------------------------------------- what can be emitted

_ALLOWED_KWARGS = {"memory_format", "dtype", "layout", "device", "pin_memory", "non_blocking"}
_POW = {1: "{0}", 2: "({0} * {0})", 3: "({0} * {0} * {0})", 0.5: "tl.sqrt({0})", -0.5: "tl.rsqrt({0})",
        -1: "(1.0 / {0})", -2: "(1.0 / ({0} * {0}))"}
_BOOL_RESULT_OPS = {"eq", "ne", "lt", "le", "gt", "ge", "logical_not", "logical_and", "isnan", "where", "to_dtype", "copy"}


def _swap(t: str) -> Callable[[Node, list[str]], str]:
    return lambda node, a: t.format(a[1], a[0])


def _pow(node: Node, a: list[str]) -> str:
    return _POW[node.args[1]].format(a[0])


def _to_dtype(node: Node, a: list[str]) -> str:
    src, dst = node.inputs[0].meta.dtype, node.outputs[0].meta.dtype
    if dst is torch.bool:
        return f"({a[0]} != 0)"
    if src is torch.bool:
        return f"{a[0]}.to(tl.float32)"
    if dst in (torch.float16, torch.bfloat16) and src is not dst:
        return f"{a[0]}.to({TL_DTYPE[dst]}).to(tl.float32)"   # the rounding eager does
    return a[0]


_RENDER: dict[Any, Callable[[Node, list[str]], str]] = {
    aten.rsub.Scalar: _swap("({0} - {1})"),
    aten.rsub.Tensor: _swap("({0} - {1})"),
    aten.relu.default: lambda node, a: f"_maximum({a[0]}, 0.0)",
    aten.pow.Tensor_Scalar: _pow,
    prims.convert_element_type.default: _to_dtype,
    aten._to_copy.default: _to_dtype,
}


@dataclass(frozen=True)
class ReductionSpec:
    kind: str          # "sum" | "mean" | "amax" | "amin" | "var_mean" | "var"
    keepdim: bool
    correction: int = 0


def reduction_spec(node: Node) -> ReductionSpec | None:
    """How the reduction node reduces, when it reduces exactly the last dim of its input; else None."""
    t, a, kw = node.target, node.args, node.kwargs
    x = a[0] if a else None
    if not isinstance(x, Value) or not x.meta or len(x.meta.shape) == 0:
        return None
    nd = len(x.meta.shape)

    def last_only(dims) -> bool:
        dims = list(dims) if isinstance(dims, (list, tuple)) else [dims]
        return len(dims) == 1 and dims[0] % nd == nd - 1 or (not dims and nd == 1)

    if t is aten.sum.dim_IntList or t is aten.mean.dim:
        dims = a[1] if len(a) > 1 else kw.get("dim")
        keep = a[2] if len(a) > 2 else kw.get("keepdim", False)
        if dims is None or (a[3:] or kw.get("dtype")) or not last_only(dims):
            return None
        return ReductionSpec("sum" if t is aten.sum.dim_IntList else "mean", bool(keep))
    if t in (aten.amax.default, aten.amin.default):
        dims = a[1] if len(a) > 1 else kw.get("dim", [])
        keep = a[2] if len(a) > 2 else kw.get("keepdim", False)
        if not last_only(dims):
            return None
        return ReductionSpec("amax" if t is aten.amax.default else "amin", bool(keep))
    if t is aten.var_mean.correction or t is prims.var.default:
        dims = a[1] if len(a) > 1 else kw.get("dim")
        corr = kw.get("correction", a[2] if t is prims.var.default and len(a) > 2 else 1)
        keep = kw.get("keepdim", False)
        if dims is None or not last_only(dims) or corr not in (0, 1, 0.0, 1.0) or kw.get("output_dtype"):
            return None
        return ReductionSpec("var_mean" if t is aten.var_mean.correction else "var", bool(keep), int(corr))
    return None


def _fill_value(node: Node) -> Any:
    t, a = node.target, node.args
    if t is aten.full.default:
        return a[1]
    if t is aten.scalar_tensor.default:
        return a[0]
    return {aten.zeros.default: 0, aten.ones.default: 1}.get(t)


def node_support(node: Node) -> str | None:
    """None when this codegen emits ``node``; else why not (for the report)."""
    kind = node.kind
    if kind is OpKind.REDUCTION:
        spec = reduction_spec(node)
        if spec is None:
            return f"{node.target_name}: only reductions over the last dim are stitched"
        if not node.inputs[0].meta.dtype.is_floating_point:
            return f"{node.target_name}: reduction of {node.inputs[0].meta.dtype}"
        return None
    if kind is OpKind.CREATION:
        v = _fill_value(node)
        if v is None or not isinstance(v, (int, float, bool)):
            return f"{node.target_name}: only constant fills are stitched"
        return None
    if kind is not OpKind.ELEMENTWISE:
        return f"{node.target_name}: {kind.value} op"
    if node.op.triton is None and node.target not in _RENDER:
        return f"{node.target_name}: no Triton template"
    if node.target is aten.pow.Tensor_Scalar and node.args[1] not in _POW:
        return f"{node.target_name}: exponent {node.args[1]!r} not stitched"
    if node.target in (aten.pow.Tensor_Tensor,):
        return f"{node.target_name}: tensor exponent"
    alpha = node.kwargs.get("alpha", 1)
    if alpha != 1 or any(k not in _ALLOWED_KWARGS | {"alpha"} for k in node.kwargs):
        return f"{node.target_name}: keyword arguments {sorted(node.kwargs)}"
    if len(node.outputs) != 1:
        return f"{node.target_name}: several outputs"
    out = node.outputs[0].meta
    if out is not None and out.dtype is torch.bool and node.op.name not in _BOOL_RESULT_OPS:
        return f"{node.target_name}: arithmetic on bool"
    return None


# ---------------------------------------------------------------- source emission

def _literal(x: Any) -> str:
    if isinstance(x, bool):
        return "1" if x else "0"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if math.isnan(x):
            return 'float("nan")'
        if math.isinf(x):
            return 'float("inf")' if x > 0 else 'float("-inf")'
        return repr(x)
    raise TypeError(f"stitch codegen: cannot emit the constant {x!r}")


class _Emitter:
    """Writes the kernel body; ``scope`` maps value ids to the names holding them in the current block."""

    def __init__(self, plan: StitchPlan):
        self.plan = plan
        self.lines: list[str] = []
        self.indent = 1
        self.names: dict[int, str] = {}
        self.count = 0
        self.load_index = {id(v): i for i, v in enumerate(plan.loads)}
        self.row = plan.row_values
        self.producer_set = {id(n) for n in plan.compute}

    def line(self, s: str) -> None:
        self.lines.append("    " * self.indent + s)

    def fresh(self, base: str = "v") -> str:
        self.count += 1
        return f"{base}{self.count}"

    def is_row(self, v: Value) -> bool:
        return id(v) in self.row

    # --- values
    def value(self, v: Value, scope: dict[int, str]) -> str:
        if id(v) in scope:
            return scope[id(v)]
        if id(v) in self.load_index:
            return self.load(v, scope)
        node = v.producer
        if node is None or id(node) not in self.producer_set:
            raise KeyError(f"stitch codegen: {v!r} is neither loaded nor computed in the region")
        if node.kind is OpKind.REDUCTION:
            raise KeyError(f"stitch codegen: {v!r} used before its reduction ran")
        self.compute(node, scope)
        return scope[id(v)]

    def load(self, v: Value, scope: dict[int, str]) -> str:
        i = self.load_index[id(v)]
        name = self.fresh("x")
        cvt = "" if v.meta.dtype is torch.bool else ".to(tl.float32)"
        other = "0" if v.meta.dtype is torch.bool else "0.0"
        if self.is_row(v):
            self.line(f"{name} = tl.load(in{i} + {self.row_offset(f'in{i}')}, mask=rmask, other={other}){cvt}")
        else:
            r = len(self.plan.space) - 1
            self.line(f"{name} = tl.load(in{i} + {self.row_offset(f'in{i}')} + cols * in{i}_s{r}, mask=mask, "
                      f"other={other}){cvt}")
        scope[id(v)] = name
        return name

    def row_offset(self, prefix: str) -> str:
        lead = [k for k, s in enumerate(self.plan.space[:-1]) if s > 1]
        return "(" + " + ".join(f"r{k} * {prefix}_s{k}" for k in lead) + ")" if lead else "(rows * 0)"

    def operand(self, a: Any, scope: dict[int, str]) -> str:
        if isinstance(a, Value):
            return self.value(a, scope)
        return _literal(a) if isinstance(a, (int, float, bool)) else f"<unused {type(a).__name__}>"

    def compute(self, node: Node, scope: dict[int, str]) -> None:
        out = node.outputs[0]
        name = self.fresh()
        if node.kind is OpKind.CREATION:
            v = _fill_value(node)
            dt = "tl.int1" if out.meta.dtype is torch.bool else "tl.float32"
            lit = _literal(v if out.meta.dtype is torch.bool else torch.tensor(v, dtype=out.meta.dtype).item())
            self.line(f"{name} = tl.full([1, 1], {lit}, {dt})")
        else:
            operands = [self.operand(a, scope) for a in node.args]
            render = _RENDER.get(node.target)
            expr = render(node, operands) if render else node.op.triton.format(*operands)
            self.line(f"{name} = {expr}")
        scope[id(out)] = name

    # --- reductions
    def reduce_inline(self, node: Node, scope: dict[int, str]) -> None:
        """Row in registers: reduce the whole row at once."""
        spec = reduction_spec(node)
        x = self.value(node.inputs[0], scope)
        n = self.plan.row_len
        if spec.kind in ("sum", "mean", "var_mean", "var"):
            s = self.fresh("s")
            self.line(f"{s} = tl.sum(tl.where(mask, {x}, 0.0), 1)[:, None]")
            if spec.kind == "sum":
                scope[id(node.outputs[0])] = s
                return
            mean = self.fresh("mean")
            self.line(f"{mean} = {s} / {float(n)!r}")
            if spec.kind == "mean":
                scope[id(node.outputs[0])] = mean
                return
            d, var = self.fresh("d"), self.fresh("var")
            self.line(f"{d} = tl.where(mask, {x} - {mean}, 0.0)")
            self.line(f"{var} = tl.sum({d} * {d}, 1)[:, None] / {float(n - spec.correction)!r}")
            scope[id(node.outputs[0])] = var
            if spec.kind == "var_mean":
                scope[id(node.outputs[1])] = mean
            return
        fn, ident = ("max", 'float("-inf")') if spec.kind == "amax" else ("min", 'float("inf")')
        m, nan = self.fresh("m"), self.fresh("nan")
        self.line(f"{m} = tl.{fn}(tl.where(mask, {x}, {ident}), 1)[:, None]")
        self.line(f"{nan} = tl.max(tl.where(mask & ({x} != {x}), 1, 0), 1)[:, None]")
        self.line(f"{m} = tl.where({nan} > 0, float(\"nan\"), {m})")
        scope[id(node.outputs[0])] = m


def reduction_parts(node: Node) -> list[str]:
    """The chunk-accumulated parts of a reduction in the looped strategy, in dependency order."""
    kind = reduction_spec(node).kind
    return {"sum": ["sum"], "mean": ["sum"], "amax": ["max"], "amin": ["min"],
            "var_mean": ["sum", "centered"], "var": ["sum", "centered"]}[kind]


def _levels(plan: StitchPlan) -> dict[tuple[int, int], int]:
    """(reduction node id, part index) -> pass number (1-based) in the looped strategy."""
    lvl: dict[int, int] = {}
    out: dict[tuple[int, int], int] = {}
    for node in plan.compute:
        base = max((lvl.get(id(v), 0) for v in node.inputs), default=0)
        if node.kind is OpKind.REDUCTION:
            parts = reduction_parts(node)
            for k in range(len(parts)):
                out[(id(node), k)] = base + 1 + k
            for v in node.outputs:
                lvl[id(v)] = base + len(parts)
            if reduction_spec(node).kind == "var_mean":
                lvl[id(node.outputs[1])] = base + 1   # the mean is ready after the first part
        else:
            for v in node.outputs:
                lvl[id(v)] = base
    return out


def _header(plan: StitchPlan, kname: str) -> list[str]:
    r = len(plan.space)
    params = []
    for i, _ in enumerate(plan.loads):
        params += [f"in{i}"] + [f"in{i}_s{k}" for k in range(r)]
    for j, _ in enumerate(plan.stored):
        params += [f"out{j}"] + [f"out{j}_s{k}" for k in range(r)]
    return ["@triton.jit", f"def {kname}({', '.join(params + ['BLOCK_M: tl.constexpr', 'BLOCK_N: tl.constexpr'])}):"]


def _prelude(e: _Emitter) -> None:
    plan = e.plan
    e.line(f"M = {plan.rows}")
    e.line(f"N = {plan.row_len}")
    e.line("rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]")
    e.line("rmask = rows < M")
    rem = "rows"
    lead = plan.space[:-1]
    for k in reversed(range(len(lead))):
        if lead[k] > 1:
            e.line(f"r{k} = ({rem}) % {lead[k]}" if k > 0 else f"r{k} = {rem}")
            rem = f"({rem}) // {lead[k]}"
        # size-1 dims contribute nothing to offsets


def _cols(e: _Emitter, start: str) -> None:
    e.line(f"cols = {start} + tl.arange(0, BLOCK_N)[None, :]")
    e.line("mask = rmask & (cols < N)")


def _store(e: _Emitter, j: int, v: Value, scope: dict[int, str], tile: bool) -> None:
    r = len(e.plan.space) - 1
    x = e.value(v, scope)
    dt = TL_DTYPE[v.meta.dtype]
    off = e.row_offset(f"out{j}")
    if tile:
        e.line(f"tl.store(out{j} + {off} + cols * out{j}_s{r}, tl.broadcast_to({x}, [BLOCK_M, BLOCK_N]).to({dt}), mask=mask)")
    else:
        e.line(f"tl.store(out{j} + {off}, tl.broadcast_to({x}, [BLOCK_M, 1]).to({dt}), mask=rmask)")


def _stores_as_tile(plan: StitchPlan, v: Value) -> bool:
    shape = v.meta.shape
    return plan.row_len > 1 and len(shape) == len(plan.space) and shape[-1] == plan.row_len


def emit_kernel(plan: StitchPlan, kname: str = "stitch_kernel") -> str:
    """The Triton source of the region's kernel (helpers included)."""
    e = _Emitter(plan)
    lines = _header(plan, kname)
    _prelude(e)
    if plan.mapping.single_pass:
        col0 = "tl.program_id(1) * BLOCK_N" if plan.mapping.strategy is Strategy.ELEMENTWISE else "0"
        _cols(e, col0)
        scope: dict[int, str] = {}
        for node in plan.compute:
            if node.kind is OpKind.REDUCTION:
                e.reduce_inline(node, scope)
            elif all(id(v) in scope for v in node.outputs):
                continue
            else:
                e.compute(node, scope)
        for j, v in enumerate(plan.stored):
            _store(e, j, v, scope, _stores_as_tile(plan, v))
    else:
        _emit_looped(e)
    return "\n".join(["import triton", "import triton.language as tl", HELPERS, ""] + lines + e.lines) + "\n"


def _emit_looped(e: _Emitter) -> None:
    """One chunked pass per reduction level, then a chunked pass for the tile stores."""
    plan = e.plan
    outer: dict[int, str] = {}
    levels = _levels(plan)
    npasses = max(levels.values(), default=0)
    reductions = [n for n in plan.compute if n.kind is OpKind.REDUCTION]
    for p in range(1, npasses + 1):
        parts = [(n, k) for n in reductions for k, _ in enumerate(reduction_parts(n)) if levels[(id(n), k)] == p]
        accs = []
        for n, k in parts:
            kind = reduction_parts(n)[k]
            acc = e.fresh("acc")
            init = {"sum": "0.0", "centered": "0.0", "max": 'float("-inf")', "min": 'float("inf")'}[kind]
            e.line(f"{acc} = tl.full([BLOCK_M, BLOCK_N], {init}, tl.float32)")
            nan = None
            if kind in ("max", "min"):
                nan = e.fresh("nan")
                e.line(f"{nan} = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)")
            accs.append((n, k, kind, acc, nan))
        e.line("for start in range(0, N, BLOCK_N):")
        e.indent += 1
        _cols(e, "start")
        inner = dict(outer)
        for n, k, kind, acc, nan in accs:
            x = e.value(n.inputs[0], inner)
            if kind == "sum":
                e.line(f"{acc} += tl.where(mask, {x}, 0.0)")
            elif kind == "centered":
                mean = outer[("mean", id(n))]
                e.line(f"{acc} += tl.where(mask, ({x} - {mean}) * ({x} - {mean}), 0.0)")
            else:
                ident = 'float("-inf")' if kind == "max" else 'float("inf")'
                e.line(f"{acc} = tl.{'maximum' if kind == 'max' else 'minimum'}({acc}, tl.where(mask, {x}, {ident}))")
                e.line(f"{nan} = {nan} | tl.where(mask & ({x} != {x}), 1, 0)")
        e.indent -= 1
        for n, k, kind, acc, nan in accs:
            spec = reduction_spec(n)
            r = e.fresh("red")
            if kind in ("max", "min"):
                e.line(f"{r} = tl.where(tl.max({nan}, 1)[:, None] > 0, float(\"nan\"), tl.{kind}({acc}, 1)[:, None])")
                outer[id(n.outputs[0])] = r
            elif kind == "sum":
                e.line(f"{r} = tl.sum({acc}, 1)[:, None]")
                if spec.kind == "sum":
                    outer[id(n.outputs[0])] = r
                else:
                    mean = e.fresh("mean")
                    e.line(f"{mean} = {r} / {float(plan.row_len)!r}")
                    outer[("mean", id(n))] = mean
                    if spec.kind == "mean":
                        outer[id(n.outputs[0])] = mean
                    elif spec.kind == "var_mean":
                        outer[id(n.outputs[1])] = mean
            else:
                e.line(f"{r} = tl.sum({acc}, 1)[:, None] / {float(plan.row_len - spec.correction)!r}")
                outer[id(n.outputs[0])] = r
    tile_stores = [(j, v) for j, v in enumerate(plan.stored) if _stores_as_tile(plan, v)]
    if tile_stores:
        e.line("for start in range(0, N, BLOCK_N):")
        e.indent += 1
        _cols(e, "start")
        inner = dict(outer)
        for j, v in tile_stores:
            _store(e, j, v, inner, True)
        e.indent -= 1
    for j, v in enumerate(plan.stored):
        if not _stores_as_tile(plan, v):
            _store(e, j, v, outer, False)


# ---------------------------------------------------------------- launching

def broadcast_strides(t: torch.Tensor, space: Sequence[int]) -> list[int]:
    """``t``'s strides right-aligned into ``space``; broadcast (size-1 or missing) dims get stride 0."""
    r, k = len(space), t.dim()
    out = [0] * r
    for d in range(k):
        sd = r - k + d
        if t.shape[d] != 1:
            out[sd] = t.stride(d)
    return out


def _apply_layout(node: Node, env: dict[int, Any]) -> None:
    from ..capture.ir import map_values

    args, kwargs = map_values((node.args, node.kwargs), lambda v: env[id(v)])
    target = node.target
    if target in (aten.view.default, aten._unsafe_view.default):
        target = aten.reshape.default   # same values; tolerates inputs whose strides differ from the trace
    env[id(node.outputs[0])] = target(*args, **kwargs)


def make_launcher(plan: StitchPlan, inputs: Sequence[Value], jit_fn: Any) -> Callable[..., tuple]:
    """``(*region inputs) -> tuple(region outputs)``: prologue views, allocation, launch, epilogue views."""
    space, mapping = tuple(plan.space), plan.mapping
    grid = mapping.grid
    input_ids = [id(v) for v in inputs]
    metas = [v.meta for v in plan.stored]

    def run(*tensors: torch.Tensor) -> tuple:
        env: dict[int, Any] = dict(zip(input_ids, tensors))
        for node in plan.prologue:
            _apply_layout(node, env)
        args: list[Any] = []
        device = None
        for v in plan.loads:
            t = env[id(v)]
            device = t.device if device is None else device
            args.append(t)
            args.extend(broadcast_strides(t, space))
        device = device or metas[0].device
        for v, meta in zip(plan.stored, metas):
            out = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=device)
            env[id(v)] = out
            strides = list(meta.stride) if len(meta.shape) == len(space) else list(meta.stride) + [0]
            args.append(out)
            args.extend(0 if s == 1 else st for s, st in zip(list(meta.shape) + [1] * (len(space) - len(meta.shape)), strides))
        jit_fn[grid](*args, BLOCK_M=mapping.block_m, BLOCK_N=mapping.block_n, num_warps=mapping.num_warps)
        for node in plan.epilogue:
            _apply_layout(node, env)
        return tuple(env[id(v)] for v in plan.outputs)

    run.__name__ = "stitch_region"
    return run


def build_kernel(plan: StitchPlan, inputs: Sequence[Value], cache_dir: str) -> tuple[Callable[..., tuple], str]:
    """Emit, write, import and wrap the region's kernel; returns (launcher, source path)."""
    from .loader import load_source

    source = emit_kernel(plan)
    module, path = load_source(source, cache_dir, prefix="stitch")
    return make_launcher(plan, inputs, module.stitch_kernel), path
