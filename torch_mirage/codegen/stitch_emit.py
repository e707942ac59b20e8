"""StitchPlan → Triton source: the emitter of a stitch region's kernel (:func:`emit_kernel`).

One region becomes one ``@triton.jit`` kernel over a ``[BLOCK_M, BLOCK_N]`` tile of
its iteration space (rows × the last dim). Values constant along the row
(reduction results, per-row inputs) are ``[BLOCK_M, 1]`` vectors that broadcast.
Inputs are loaded through their real strides (broadcast dims have stride 0) and
converted to fp32; outputs are cast on store and written with the strides the
IR recorded. Row-resident strategies evaluate the whole DAG once (the regional
scheme: the row stays on chip across reductions); the looped strategy makes one
chunked pass over the row per reduction level and a last pass for the stores,
recomputing producers from device memory (the global scheme). Reductions that
can share a pass do (:func:`~.stitch_schedule.loop_schedule`): ``amax`` with ``sum(exp(x - amax))``
by the online-softmax recurrence, ``var_mean`` by fp32 Welford, so softmax and
layer norm read a long row twice and write it once. Task splitting (AStitch):
a few long rows are split over several programs; ``stitch_partials`` writes each
program's statistics to an fp32 workspace, ``stitch_kernel`` combines them and
stores its piece of the row.

NaN / inf follow eager: ``amax``/``amin`` propagate NaN (``tl.max`` does not, so NaN is tracked separately); an
all ``-inf`` softmax row gives NaN as ``-inf - -inf`` does. What each op is in Triton is :mod:`.stitch_ops`; the
launcher that runs the kernel on real tensors is :mod:`.stitch_launch`.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from ..capture.ir import Node, Value
from ..capture.ops import OpKind
from .stitch_ops import HELPERS, TL_DTYPE, fill_value, op_expr, reduction_spec
from .stitch_plan import StitchPlan, Strategy
from .stitch_schedule import IDENTITY, ROW_STATS, STATS, Accumulation, loop_schedule


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
            v = fill_value(node)
            dt = "tl.int1" if out.meta.dtype is torch.bool else "tl.float32"
            lit = _literal(v if out.meta.dtype is torch.bool else torch.tensor(v, dtype=out.meta.dtype).item())
            self.line(f"{name} = tl.full([1, 1], {lit}, {dt})")
        else:
            operands = [self.operand(a, scope) for a in node.args]
            self.line(f"{name} = {op_expr(node, operands)}")
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
        if spec.kind == "any":
            a = self.fresh("any")
            self.line(f"{a} = tl.max(tl.where(mask & ({x} != 0), 1.0, 0.0), 1)[:, None] > 0.0")
            scope[id(node.outputs[0])] = a
            return
        fn, ident = ("max", 'float("-inf")') if spec.kind == "amax" else ("min", 'float("inf")')
        m, nan = self.fresh("m"), self.fresh("nan")
        self.line(f"{m} = tl.{fn}(tl.where(mask, {x}, {ident}), 1)[:, None]")
        self.line(f"{nan} = tl.max(tl.where(mask & ({x} != {x}), 1, 0), 1)[:, None]")
        self.line(f"{m} = tl.where({nan} > 0, float(\"nan\"), {m})")
        scope[id(node.outputs[0])] = m


def _update(e: "_Emitter", kind: str, st: dict[str, str], x: str) -> None:
    """One chunk into the per-lane statistics ``st``."""
    if kind == "sum":
        e.line(f"{st['sum']} += tl.where(mask, {x}, 0.0)")
    if kind in ("max", "min", "online"):
        e.line(f"{st['nan']} = tl.maximum({st['nan']}, tl.where(mask & ({x} != {x}), 1.0, 0.0))")
    if kind in ("max", "min"):
        fn = "maximum" if kind == "max" else "minimum"
        e.line(f"{st[kind]} = tl.{fn}({st[kind]}, tl.where(mask, {x}, {IDENTITY[kind]}))")
    if kind == "any":
        e.line(f"{st['any']} = tl.maximum({st['any']}, tl.where(mask & ({x} != 0), 1.0, 0.0))")
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
    if kind == "any":
        e.line(f"{st['any']} = {red('max', lanes['any'])}")
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
    elif acc.kind == "any":
        e.line(f"{r} = {st['any']} > 0.0")
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
