"""StitchPlan → Triton source, and the launcher that runs it on real tensors.

One region becomes one ``@triton.jit`` kernel over a ``[BLOCK_M, BLOCK_N]`` tile of
its iteration space (rows × the last dim). Values constant along the row
(reduction results, per-row inputs) are ``[BLOCK_M, 1]`` vectors that broadcast.
Inputs are loaded through their real strides (broadcast dims have stride 0) and
converted to fp32; outputs are cast on store and written with the strides the
IR recorded. Row-resident strategies evaluate the whole DAG once (the regional
scheme: the row stays on chip across reductions); the looped strategy makes one
chunked pass over the row per reduction level and a last pass for the stores,
recomputing producers from device memory (the global scheme). Reductions that
can share a pass do (:func:`loop_schedule`): ``amax`` with ``sum(exp(x - amax))``
by the online-softmax recurrence, ``var_mean`` by fp32 Welford, so softmax and
layer norm read a long row twice and write it once. Task splitting (AStitch):
a few long rows are split over several programs; ``stitch_partials`` writes each
program's statistics to an fp32 workspace, ``stitch_kernel`` combines them and
stores its piece of the row.

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
from .loader import load_source

from ..capture.ir import Node, Value, map_values
from ..capture.ops import OpKind
from .stitch_plan import StitchPlan, Strategy

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
        self.evict: str | None = None   # L2 eviction hint for the tile loads of the current looped pass

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
            evict = f", eviction_policy=\"{self.evict}\"" if self.evict and math.prod(v.meta.shape[:-1]) > 1 else ""
            self.line(f"{name} = tl.load(in{i} + {self.row_offset(f'in{i}')} + cols * in{i}_s{r}, mask=mask, "
                      f"other={other}{evict}){cvt}")
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


# ---------------------------------------------------------------- the looped schedule (long rows)

@dataclass(frozen=True)
class Accumulation:
    """One per-lane accumulation of a looped row: the reductions it serves and the pass that reads for it.

    ``online`` accumulates ``amax(x)`` and ``sum(exp(x - amax(x)))`` together (the online-softmax recurrence:
    running max, running sum rescaled when the max grows); ``welford`` accumulates count / mean / M2 for
    ``var_mean`` and ``var`` in one pass (fp32 Welford, lanes combined with Chan's formula).
    """
    kind: str                  # "sum" | "max" | "min" | "online" | "welford"
    node: Node                 # the reduction (for "online": the amax)
    partner: Node | None       # "online": the sum of exp(x - amax(x))
    pass_no: int               # 1-based chunked pass over the row


# the per-lane statistics of each accumulation kind and their identities (masked lanes, empty splits)
STATS = {"sum": ("sum",), "max": ("max", "nan"), "min": ("min", "nan"), "online": ("max", "nan", "sum"),
         "welford": ("cnt", "mean", "m2")}
IDENTITY = {"sum": "0.0", "max": 'float("-inf")', "min": 'float("inf")', "nan": "0.0", "cnt": "0.0", "mean": "0.0",
            "m2": "0.0"}
ROW_STATS = {("online", "max")}   # statistics kept per row ([BLOCK_M, 1]) rather than per lane
FUSION_NAME = {"online": "online softmax", "welford": "Welford"}
_KIND = {"sum": "sum", "mean": "sum", "amax": "max", "amin": "min", "var_mean": "welford", "var": "welford"}


def _online_partner(amax: Node, inside: set[int]) -> Node | None:
    """The region's ``sum(exp(x - amax(x)))`` over the same ``x``, which the online recurrence accumulates too."""
    x, m = amax.inputs[0], amax.outputs[0]
    for sub in m.users:
        if id(sub) not in inside or sub.op.name != "sub" or len(sub.args) < 2 \
                or sub.args[0] is not x or sub.args[1] is not m:
            continue
        for ex in sub.outputs[0].users:
            if id(ex) not in inside or ex.op.name != "exp" or ex.args[0] is not sub.outputs[0]:
                continue
            for s in ex.outputs[0].users:
                if id(s) in inside and s.kind is OpKind.REDUCTION and reduction_spec(s) is not None \
                        and reduction_spec(s).kind == "sum":
                    return s
    return None


def loop_schedule(compute: Sequence[Node]) -> list[Accumulation]:
    """The accumulations of a looped row, each in the earliest pass its input allows (fusions applied)."""
    inside = {id(n) for n in compute}
    lvl: dict[int, int] = {}
    fused: dict[int, Accumulation] = {}
    out: list[Accumulation] = []
    for node in compute:
        base = max((lvl.get(id(v), 0) for v in node.inputs), default=0)
        if node.kind is not OpKind.REDUCTION:
            lvl.update((id(v), base) for v in node.outputs)
        elif id(node) in fused:
            lvl.update((id(v), fused[id(node)].pass_no) for v in node.outputs)
        else:
            kind = _KIND[reduction_spec(node).kind]
            partner = _online_partner(node, inside) if kind == "max" else None
            acc = Accumulation("online" if partner is not None else kind, node, partner, base + 1)
            if partner is not None:
                fused[id(partner)] = acc
            out.append(acc)
            lvl.update((id(v), base + 1) for v in node.outputs)
    return out


def schedule_facts(compute: Sequence[Node]) -> tuple[int, tuple[str, ...]]:
    """(reduction passes over a looped row, names of the fused accumulations) for the thread mapping."""
    sched = loop_schedule(compute)
    names = tuple(dict.fromkeys(FUSION_NAME[a.kind] for a in sched if a.kind in FUSION_NAME))
    return max((a.pass_no for a in sched), default=0), names


def stat_slots(plan: StitchPlan) -> list[tuple[int, str]]:
    """(accumulation index, statistic) per fp32 workspace slot of a split row's partials."""
    return [(i, k) for i, a in enumerate(loop_schedule(plan.compute)) for k in STATS[a.kind]]


def _update(e: "_Emitter", kind: str, st: dict[str, str], x: str) -> None:
    """One chunk into the per-lane statistics ``st``."""
    if kind == "sum":
        e.line(f"{st['sum']} += tl.where(mask, {x}, 0.0)")
    if kind in ("max", "min", "online"):
        e.line(f"{st['nan']} = tl.maximum({st['nan']}, tl.where(mask & ({x} != {x}), 1.0, 0.0))")
    if kind in ("max", "min"):
        fn = "maximum" if kind == "max" else "minimum"
        e.line(f"{st[kind]} = tl.{fn}({st[kind]}, tl.where(mask, {x}, {IDENTITY[kind]}))")
    if kind == "online":
        # the running max is per row ([BLOCK_M, 1]): one exp per element plus one per row and chunk for the
        # rescale, instead of two per element with a max per lane
        xc, mn, ms = e.fresh("xc"), e.fresh("mn"), e.fresh("ms")
        e.line(f"{xc} = tl.where(mask, {x}, float(\"-inf\"))")
        e.line(f"{mn} = tl.maximum({st['max']}, tl.max({xc}, 1)[:, None])")
        e.line(f"{ms} = tl.where({mn} == float(\"-inf\"), 0.0, {mn})      # no -inf - -inf in a row")
        e.line(f"{st['sum']} = {st['sum']} * tl.exp({st['max']} - {ms}) + tl.exp({xc} - {ms})")
        e.line(f"{st['max']} = {mn}")
    if kind == "welford":
        c1, d = e.fresh("c"), e.fresh("d")
        e.line(f"{c1} = {st['cnt']} + tl.where(mask, 1.0, 0.0)")
        e.line(f"{d} = tl.where(mask, {x} - {st['mean']}, 0.0)")
        # only a lane's last chunk can be ragged, so its count is the chunk number: multiply by its inverse
        # (one division per chunk, not one per element)
        e.line(f"{st['mean']} = {st['mean']} + {d} * inv_count")
        e.line(f"{st['m2']} = {st['m2']} + {d} * tl.where(mask, {x} - {st['mean']}, 0.0)")
        e.line(f"{st['cnt']} = {c1}")


def _combine(e: "_Emitter", kind: str, lanes: dict[str, str]) -> dict[str, str]:
    """Per-lane statistics ``[BLOCK_M, L]`` → per-row statistics ``[BLOCK_M, 1]`` of the same kind."""
    st = {k: e.fresh(k) for k in STATS[kind]}
    red = lambda fn, x: f"tl.{fn}({x}, 1)[:, None]"
    if "nan" in st:
        e.line(f"{st['nan']} = {red('max', lanes['nan'])}")
    if kind in ("sum", "max", "min"):
        e.line(f"{st[kind]} = {red(kind, lanes[kind])}")
    if kind == "online":
        ms = e.fresh("ms")
        e.line(f"{st['max']} = {red('max', lanes['max'])}")
        e.line(f"{ms} = tl.where({st['max']} == float(\"-inf\"), 0.0, {st['max']})")
        scaled = f"{lanes['sum']} * tl.exp({lanes['max']} - {ms})"
        e.line(f"{st['sum']} = {red('sum', scaled)}")
    if kind == "welford":
        c, m = lanes["cnt"], lanes["mean"]
        e.line(f"{st['cnt']} = {red('sum', c)}")
        weighted = f"{c} * {m}"
        e.line(f"{st['mean']} = {red('sum', weighted)} / tl.maximum({st['cnt']}, 1.0)")
        mean = st["mean"]
        spread = f"{lanes['m2']} + tl.where({c} > 0.0, {c} * ({m} - {mean}) * ({m} - {mean}), 0.0)"
        e.line(f"{st['m2']} = {red('sum', spread)}")   # Chan et al.: M2 = sum(M2_i + n_i (mean_i - mean)^2)
    return st


def _finalize(e: "_Emitter", acc: Accumulation, st: dict[str, str], outer: dict) -> None:
    """Per-row statistics → the reductions' values, with eager's NaN / inf results."""
    spec, n, outs = reduction_spec(acc.node), float(e.plan.row_len), acc.node.outputs
    r = e.fresh("red")
    if acc.kind == "sum":
        e.line(f"{r} = {st['sum']}" + (f" / {n!r}" if spec.kind == "mean" else ""))
    elif acc.kind == "welford":
        e.line(f"{r} = {st['m2']} / {float(e.plan.row_len - spec.correction)!r}")
        if spec.kind == "var_mean":
            outer[id(outs[1])] = st["mean"]
    else:
        key = "min" if acc.kind == "min" else "max"
        e.line(f"{r} = tl.where({st['nan']} > 0.0, float(\"nan\"), {st[key]})")
    outer[id(outs[0])] = r
    if acc.kind == "online":
        # eager: exp(x - m) is NaN everywhere when the max is NaN, +inf or -inf (all -inf row)
        s = e.fresh("red")
        e.line(f"{s} = tl.where(({st['nan']} == 0.0) & (tl.abs({st['max']}) < float(\"inf\")), {st['sum']}, "
               f"float(\"nan\"))")
        outer[id(acc.partner.outputs[0])] = s


def _header(plan: StitchPlan, kname: str) -> list[str]:
    r = len(plan.space)
    params = []
    for i, _ in enumerate(plan.loads):
        params += [f"in{i}"] + [f"in{i}_s{k}" for k in range(r)]
    for j, _ in enumerate(plan.stored):
        params += [f"out{j}"] + [f"out{j}_s{k}" for k in range(r)]
    if plan.mapping.strategy is Strategy.SPLIT:
        params.append("ws")
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
    """The Triton source of the region's kernel (helpers included); a split row adds ``stitch_partials``."""
    e = _Emitter(plan)
    lines = _header(plan, kname)
    _prelude(e)
    strategy = plan.mapping.strategy
    extra: list[str] = []
    if plan.mapping.single_pass:
        col0 = "tl.program_id(1) * BLOCK_N" if strategy is Strategy.ELEMENTWISE else "0"
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
    elif strategy is Strategy.SPLIT:
        _emit_split_store(e)
        p = _Emitter(plan)
        _prelude(p)
        _emit_split_partials(p)
        extra = [""] + _header(plan, "stitch_partials") + p.lines
    else:
        _emit_looped(e)
    return "\n".join(["import triton", "import triton.language as tl", HELPERS, ""] + lines + e.lines + extra) + "\n"


def _accumulate(e: _Emitter, accs: Sequence[Accumulation], outer: dict, lo: str, hi: str) -> list[dict[str, str]]:
    """One chunked pass over columns [lo, hi) feeding every accumulation in ``accs``; returns the lane statistics."""
    lanes = []
    for a in accs:
        st = {k: e.fresh(k) for k in STATS[a.kind]}
        for k, name in st.items():
            width = "1" if (a.kind, k) in ROW_STATS else "BLOCK_N"
            e.line(f"{name} = tl.full([BLOCK_M, {width}], {IDENTITY[k]}, tl.float32)")
        lanes.append(st)
    e.line(f"for start in range({lo}, {hi}, BLOCK_N):")
    e.indent += 1
    _cols(e, "start")
    if any(a.kind == "welford" for a in accs):
        e.line(f"inv_count = 1.0 / ((start - {lo}) // BLOCK_N + 1.0)")
    inner = dict(outer)
    e.evict = "evict_last"      # re-read by the next pass: keep in L2
    for a, st in zip(accs, lanes):
        _update(e, a.kind, st, e.value(a.node.inputs[0], inner))
    e.evict = None
    e.indent -= 1
    return lanes


def _store_pass(e: _Emitter, outer: dict, lo: str, hi: str, row_stores_if: str | None = None) -> None:
    """The last chunked pass: recompute from device memory and store the tile outputs; then the per-row outputs."""
    plan = e.plan
    tile_stores = [(j, v) for j, v in enumerate(plan.stored) if _stores_as_tile(plan, v)]
    if tile_stores:
        e.line(f"for start in range({lo}, {hi}, BLOCK_N):")
        e.indent += 1
        _cols(e, "start")
        inner = dict(outer)
        e.evict = "evict_first"     # last read of the row
        for j, v in tile_stores:
            _store(e, j, v, inner, True)
        e.evict = None
        e.indent -= 1
    row_stores = [(j, v) for j, v in enumerate(plan.stored) if not _stores_as_tile(plan, v)]
    if row_stores and row_stores_if:
        e.line(f"rmask = rmask & ({row_stores_if})")
    for j, v in row_stores:
        _store(e, j, v, outer, False)


def _emit_looped(e: _Emitter) -> None:
    """One chunked pass per reduction level (fused accumulations share a pass), then the store pass."""
    outer: dict = {}
    sched = loop_schedule(e.plan.compute)
    for p in range(1, max((a.pass_no for a in sched), default=0) + 1):
        accs = [a for a in sched if a.pass_no == p]
        lanes = _accumulate(e, accs, outer, "0", "N")
        for a, ln in zip(accs, lanes):
            _finalize(e, a, _combine(e, a.kind, ln), outer)
    _store_pass(e, outer, "0", "N")


def _split_range(e: _Emitter) -> tuple[str, str]:
    e.line(f"lo = tl.program_id(1) * {e.plan.mapping.split_len}")
    return "lo", f"lo + {e.plan.mapping.split_len}"


def _ws_offset(slot: int, plan: StitchPlan, col: str) -> str:
    return f"ws + ({slot * plan.rows} + rows) * {plan.mapping.split} + {col}"


def _emit_split_partials(e: _Emitter) -> None:
    """Task splitting, kernel 1: this program's piece of the row → per-row statistics in the fp32 workspace."""
    sched = loop_schedule(e.plan.compute)
    lo, hi = _split_range(e)
    lanes = _accumulate(e, sched, {}, lo, hi)
    slot = 0
    for a, ln in zip(sched, lanes):
        st = _combine(e, a.kind, ln)
        for k in STATS[a.kind]:
            e.line(f"tl.store({_ws_offset(slot, e.plan, 'tl.program_id(1)')}, {st[k]}, mask=rmask)")
            slot += 1


def _emit_split_store(e: _Emitter) -> None:
    """Task splitting, kernel 2: combine every program's statistics of the row, then store this program's piece."""
    plan = e.plan
    sched = loop_schedule(plan.compute)
    e.line(f"sp = tl.arange(0, {_pow2(plan.mapping.split)})[None, :]")
    e.line(f"smask = rmask & (sp < {plan.mapping.split})")
    outer: dict = {}
    slot = 0
    for a in sched:
        lanes = {}
        for k in STATS[a.kind]:
            lanes[k] = e.fresh("p")
            e.line(f"{lanes[k]} = tl.load({_ws_offset(slot, plan, 'sp')}, mask=smask, other={IDENTITY[k]})")
            slot += 1
        _finalize(e, a, _combine(e, a.kind, lanes), outer)
    lo, hi = _split_range(e)
    _store_pass(e, outer, lo, hi, row_stores_if="tl.program_id(1) == 0")


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


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

    args, kwargs = map_values((node.args, node.kwargs), lambda v: env[id(v)])
    target = node.target
    if target in (aten.view.default, aten._unsafe_view.default):
        target = aten.reshape.default   # same values; tolerates inputs whose strides differ from the trace
    env[id(node.outputs[0])] = target(*args, **kwargs)


def make_launcher(plan: StitchPlan, inputs: Sequence[Value], jit_fn: Any,
                  partials_fn: Any = None) -> Callable[..., tuple]:
    """``(*region inputs) -> tuple(region outputs)``: prologue views, allocation, launch(es), epilogue views.

    A split row (``partials_fn``) first writes per-program statistics to an fp32 workspace, then ``jit_fn``
    combines them and stores.
    """
    space, mapping = tuple(plan.space), plan.mapping
    grid = mapping.grid
    ws_elems = len(stat_slots(plan)) * plan.rows * mapping.split if partials_fn is not None else 0
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
        meta = dict(BLOCK_M=mapping.block_m, BLOCK_N=mapping.block_n, num_warps=mapping.num_warps)
        if partials_fn is not None:
            args.append(torch.empty(ws_elems, dtype=torch.float32, device=device))
            partials_fn[grid](*args, **meta)
        jit_fn[grid](*args, **meta)
        for node in plan.epilogue:
            _apply_layout(node, env)
        return tuple(env[id(v)] for v in plan.outputs)

    run.__name__ = "stitch_region"
    return run


def build_kernel(plan: StitchPlan, inputs: Sequence[Value], cache_dir: str) -> tuple[Callable[..., tuple], str]:
    """Emit, write, import and wrap the region's kernel; returns (launcher, source path)."""

    source = emit_kernel(plan)
    module, path = load_source(source, cache_dir, prefix="stitch")
    return make_launcher(plan, inputs, module.stitch_kernel, getattr(module, "stitch_partials", None)), path
