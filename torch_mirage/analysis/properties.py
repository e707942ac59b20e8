"""Tensor properties (FlashTensor §4): reduce dependency, broadcast, size and value of every tensor and dimension.

*Reduce dependency* of a dimension, by priority ``NONPARA > REUSE > BATCH``:

- ``NONPARA``: a reduction runs along it (the reduced dim of a reduction's input and kept output, the K dim of a
  matmul); the dim cannot be split over parallel units without a cross-unit combine.
- ``REUSE``: parallel, and tiling it reuses another operand (M and N of a matmul; the dims along which an elementwise
  op or ``expand`` broadcasts a data operand with more than one element).
- ``BATCH``: fully independent.

Each op relates its operands' dims to its outputs' dims (*links*: the same iteration axis seen from two tensors) and
marks some dims from its own semantics (*seeds*). Forward and backward propagation with the priority as join,
iterated to a fixed point, gives every dim the highest seed reachable over links; since links are symmetric that
fixed point is the maximum over each connected set of linked dims, which is computed here with union-find in one
pass. Each connected set is one iteration :class:`Axis` of the analysed nodes (used by the cost model's parallelism).
A size-1 dim broadcast by a consumer is marked ``broadcast`` and not linked (it has no extent to share). Views that
merge or split dims link all dims of the group (conservative). Operands whose value is known (constants, index
masks) are not data worth reusing and seed no REUSE. Opaque ops neither link nor seed: they are
kernel boundaries, never inside a region.

*Value* (forward only): constants (``full``, scalars, and anything computed from constants, evaluated with the ATen op
itself), integer affine index expressions (``iota``/``arange``), half-plane masks from comparing them (a causal
triangle is ``d[-1] - d[-2] >= c``), and piecewise tensors (``where(mask, a, b)``) whose constant side (e.g. ``-inf``)
survives ``add``/``sub``/``mul``/``div``/``exp``... so later stages can skip masked tiles. On the masked side of a
piecewise tensor, non-constant operands are assumed finite (``-inf + x = -inf``, ``0 * x = 0``), the assumption
value-aware skipping rests on; whole-tensor constants are exact (``x * 0`` is not folded: NaN stays NaN).
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from ..capture.ir import Graph, Node, Value
from ..capture.ops import OpKind


# ----------------------------------------------------------------------------- small helpers

def bind_args(node: Node) -> dict[str, Any]:
    """``node``'s ATen arguments by schema name, defaults filled in (empty when the target has no schema)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return {}
    out: dict[str, Any] = {}
    for i, a in enumerate(schema.arguments):
        if i < len(node.args) and not a.kwarg_only:
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    return out


def _rank(v: Value) -> int:
    return len(v.meta.shape)


def _is_int(s: Any) -> bool:
    return isinstance(s, int) and not isinstance(s, bool)


def _same(a: Any, b: Any) -> bool:
    """Sizes equal without guarding on symbols."""
    return a == b if _is_int(a) and _is_int(b) else str(a) == str(b)


def _is_one(s: Any) -> bool:
    return _is_int(s) and s == 1


def _norm_dims(dims: Any, rank: int) -> list[int]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(rank))
    if _is_int(dims):
        dims = [dims]
    return sorted({d % rank if rank else 0 for d in dims})


def _static_numel(v: Value) -> int | None:
    n = 1
    for s in v.meta.shape:
        if not _is_int(s):
            return None
        n *= s
    return n


# ----------------------------------------------------------------------------- value property

class ValueKind(enum.Enum):
    UNKNOWN = "unknown"
    CONSTANT = "constant"     # every element equals ``fill``
    AFFINE = "affine"         # element = expr(indices) (integer index arithmetic from iota / arange)
    MASK = "mask"             # bool: True exactly where expr(indices) >= 0
    PIECEWISE = "piecewise"   # ``inside`` where expr >= 0, ``outside`` elsewhere


@dataclass(frozen=True)
class Affine:
    """``sum(coef * index[dim]) + const`` with dims counted from the right (-1 = last), so broadcasting keeps it."""
    terms: tuple[tuple[int, int], ...]   # (dim < 0, coef), sorted, no zero coefs
    const: int = 0

    @staticmethod
    def make(terms: dict[int, int], const: int) -> "Affine":
        return Affine(tuple(sorted((d, c) for d, c in terms.items() if c != 0)), const)

    def scaled(self, k: int) -> "Affine":
        return Affine.make({d: c * k for d, c in self.terms}, self.const * k)

    def plus(self, other: "Affine") -> "Affine":
        t = dict(self.terms)
        for d, c in other.terms:
            t[d] = t.get(d, 0) + c
        return Affine.make(t, self.const + other.const)

    def remapped(self, dim_map: dict[int, int]) -> "Affine | None":
        if any(d not in dim_map for d, _ in self.terms):
            return None
        return Affine.make({dim_map[d]: c for d, c in self.terms}, self.const)

    def __str__(self) -> str:
        parts = [("" if c == 1 else "-" if c == -1 else f"{c}*") + f"i[{d}]" for d, c in self.terms]
        return " + ".join(parts + ([str(self.const)] if self.const or not parts else [])).replace("+ -", "- ")


@dataclass(frozen=True)
class ValueProperty:
    kind: ValueKind = ValueKind.UNKNOWN
    fill: Any = None                       # CONSTANT
    expr: Affine | None = None             # AFFINE value / MASK and PIECEWISE predicate (expr >= 0)
    inside: "ValueProperty | None" = None  # PIECEWISE: where expr >= 0
    outside: "ValueProperty | None" = None

    @property
    def is_constant(self) -> bool:
        return self.kind is ValueKind.CONSTANT

    @property
    def known(self) -> bool:
        return self.kind is not ValueKind.UNKNOWN

    @property
    def is_triangle(self) -> bool:
        """A mask / piecewise tensor split by a diagonal ``i[a] - i[b] >= c`` (causal masks)."""
        if self.kind not in (ValueKind.MASK, ValueKind.PIECEWISE) or len(self.expr.terms) != 2:
            return False
        return sorted(c for _, c in self.expr.terms) == [-1, 1]

    def constant_where(self, fill: float) -> Affine | None:
        """The predicate ``expr >= 0`` of the part equal to ``fill`` (e.g. ``-inf``), if one side is that constant."""
        same = (lambda p: p is not None and p.is_constant and _eq_fill(p.fill, fill))
        if self.kind is ValueKind.PIECEWISE and same(self.inside):
            return self.expr
        if self.kind is ValueKind.PIECEWISE and same(self.outside):
            return self.expr.scaled(-1).plus(Affine((), -1))
        return None

    def __str__(self) -> str:
        k = self.kind
        if k is ValueKind.CONSTANT:
            return f"const({self.fill})"
        if k is ValueKind.AFFINE:
            return f"index({self.expr})"
        if k is ValueKind.MASK:
            return f"{'triangle ' if self.is_triangle else ''}mask({self.expr} >= 0)"
        if k is ValueKind.PIECEWISE:
            tri = "triangle " if self.is_triangle else ""
            return f"{tri}piecewise({self.expr} >= 0 ? {self.inside} : {self.outside})"
        return "?"


UNKNOWN = ValueProperty()


def _eq_fill(a: Any, b: Any) -> bool:
    try:
        return a == b or (math.isnan(a) and math.isnan(b))
    except TypeError:
        return False


def const(c: Any) -> ValueProperty:
    return ValueProperty(ValueKind.CONSTANT, fill=c)


# ----------------------------------------------------------------------------- reduce dependency

class ReduceDep(enum.IntEnum):
    """Priority order: the join of two facts about one dim is their ``max``."""
    BATCH = 0
    REUSE = 1
    NONPARA = 2

    @property
    def letter(self) -> str:
        return self.name[0]


@dataclass(frozen=True)
class DimProperty:
    reduce_dep: ReduceDep
    broadcast: bool        # a consumer broadcasts this (size-1) dim
    size: Any              # int or SymInt
    expanded: bool         # stride 0 with size > 1: every element along it is the same

    def __str__(self) -> str:
        marks = ("*" if self.broadcast else "") + ("^" if self.expanded else "")
        return f"{self.size}:{self.reduce_dep.letter}{marks}"


@dataclass(frozen=True)
class Axis:
    """One iteration axis of the analysed nodes: a connected set of linked dims."""
    reduce_dep: ReduceDep
    size: int | None       # largest static size among its dims (None: all symbolic)
    dims: tuple[tuple[str, int], ...]  # (value name, dim)


class _Facts:
    """Union-find over ``(value, dim)`` with the priority join, plus broadcast marks."""

    def __init__(self) -> None:
        self.parent: dict[tuple[int, int], tuple[int, int]] = {}
        self.dep: dict[tuple[int, int], ReduceDep] = {}
        self.bcast: set[tuple[int, int]] = set()
        self.values: dict[int, Value] = {}

    def _find(self, k: tuple[int, int]) -> tuple[int, int]:
        self.parent.setdefault(k, k)
        while self.parent[k] != k:
            self.parent[k] = self.parent[self.parent[k]]
            k = self.parent[k]
        return k

    def key(self, v: Value, d: int) -> tuple[int, int]:
        self.values[id(v)] = v
        return (id(v), d % _rank(v))

    def link(self, v: Value, d: int, w: Value, e: int) -> None:
        a, b = self._find(self.key(v, d)), self._find(self.key(w, e))
        if a != b:
            self.parent[a] = b
            self.dep[b] = max(self.dep.get(a, ReduceDep.BATCH), self.dep.get(b, ReduceDep.BATCH))

    def seed(self, v: Value, d: int, dep: ReduceDep) -> None:
        r = self._find(self.key(v, d))
        self.dep[r] = max(self.dep.get(r, ReduceDep.BATCH), dep)

    def mark_broadcast(self, v: Value, d: int) -> None:
        self.bcast.add(self.key(v, d))

    def dep_of(self, v: Value, d: int) -> ReduceDep:
        return self.dep.get(self._find(self.key(v, d)), ReduceDep.BATCH)


def _is_data(v: Value, values: dict[int, ValueProperty]) -> bool:
    """A broadcast operand whose elements are real data worth reusing (not a scalar, not computed from indices)."""
    n = _static_numel(v)
    return (n is None or n > 1) and not values.get(id(v), UNKNOWN).known


def _broadcast_into(f: _Facts, v: Value, out: Value, values: dict[int, ValueProperty]) -> None:
    """Right-aligned broadcasting of operand ``v`` into ``out``: link equal dims, mark broadcast ones."""
    off = _rank(out) - _rank(v)
    data = _is_data(v, values)
    for e in range(_rank(out)):
        so = out.meta.shape[e]
        d = e - off
        if d >= 0 and (_same(v.meta.shape[d], so) and not (_is_one(v.meta.shape[d]) and not _is_one(so))):
            f.link(v, d, out, e)
            continue
        if d >= 0:
            f.mark_broadcast(v, d)
        if data and not _is_one(so):
            f.seed(out, e, ReduceDep.REUSE)


def _tensor_inputs(node: Node) -> list[Value]:
    return [v for v in node.inputs if v.is_tensor]


def _links_elementwise(f: _Facts, node: Node, values: dict) -> None:
    out = node.outputs[0]
    for v in _tensor_inputs(node):
        _broadcast_into(f, v, out, values)


def reduction_dims(node: Node) -> tuple[Value, list[int], bool]:
    """(input, reduced dims in ``[0, rank)``, keepdim) of a reduction node, from its ATen arguments."""
    b = bind_args(node)
    x = _tensor_inputs(node)[0]
    dims = _norm_dims(b.get("dim", b.get("dims")), _rank(x))
    out = next(o for o in node.outputs if o.is_tensor)
    keepdim = bool(dims) and _rank(out) == _rank(x)
    return x, dims, keepdim


def _links_reduction(f: _Facts, node: Node, values: dict) -> None:
    x, dims, keepdim = reduction_dims(node)
    outs = [o for o in node.outputs if o.is_tensor and _rank(o) == (_rank(x) if keepdim else _rank(x) - len(dims))]
    for d in dims:
        f.seed(x, d, ReduceDep.NONPARA)
    for out in outs:
        j = 0
        for d in range(_rank(x)):
            if d in dims:
                if keepdim:
                    f.seed(out, d, ReduceDep.NONPARA)
                    j += 1
                continue
            f.link(x, d, out, j)
            j += 1


def matmul_operands(node: Node) -> tuple[Value | None, Value, Value]:
    """(bias or None, A[..., M, K], B[..., K, N]) of mm / bmm / addmm / baddbmm."""
    ins = _tensor_inputs(node)
    return (ins[0] if len(ins) == 3 else None), ins[-2], ins[-1]


def _links_matmul(f: _Facts, node: Node, values: dict) -> None:
    bias, a, b = matmul_operands(node)
    out = node.outputs[0]
    f.link(a, -1, b, -2)
    f.seed(a, -1, ReduceDep.NONPARA)
    f.link(a, -2, out, -2)
    f.link(b, -1, out, -1)
    f.seed(out, -2, ReduceDep.REUSE)
    f.seed(out, -1, ReduceDep.REUSE)
    for v in (a, b):
        for d in range(_rank(v) - 2):
            f.link(v, d, out, d + _rank(out) - _rank(v))
    if bias is not None:
        _broadcast_into(f, bias, out, values)


# --- layout ops: (input dim, output dim) pairs for single-input ops; ``exact`` when indices are unchanged

def _view_groups(src: Sequence, dst: Sequence) -> list[tuple[list[int], list[int]]] | None:
    """Groups of source / target dims whose sizes multiply to the same number (size-1 dims skipped)."""
    if not all(_is_int(s) and s > 0 for s in list(src) + list(dst)):
        return None
    i = j = 0
    groups = []
    while True:
        while i < len(src) and src[i] == 1:
            i += 1
        while j < len(dst) and dst[j] == 1:
            j += 1
        if i >= len(src) or j >= len(dst):
            return groups
        gi, gj, ps, pd = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while ps != pd:
            if ps < pd:
                gi.append(i)
                ps *= src[i]
                i += 1
            else:
                gj.append(j)
                pd *= dst[j]
                j += 1
        groups.append((gi, gj))


def _pairs_view(node: Node, x: Value, out: Value) -> tuple[list[tuple[int, int]], bool]:
    groups = _view_groups(x.meta.shape, out.meta.shape)
    if groups is None:   # symbolic sizes: every dim with every dim
        return [(d, e) for d in range(_rank(x)) for e in range(_rank(out))], False
    pairs = [(d, e) for gi, gj in groups for d in gi for e in gj]
    return pairs, all(len(gi) == 1 and len(gj) == 1 for gi, gj in groups)


def _pairs_permute(node: Node, x: Value, out: Value) -> tuple[list[tuple[int, int]], bool]:
    b = bind_args(node)
    r = _rank(x)
    if "dims" in b:
        perm = [d % r for d in b["dims"]]
    elif "dim0" in b:
        perm = list(range(r))
        i, j = b["dim0"] % r, b["dim1"] % r
        perm[i], perm[j] = perm[j], perm[i]
    else:
        perm = list(reversed(range(r)))
    return [(p, e) for e, p in enumerate(perm)], True


def _pairs_expand(node: Node, x: Value, out: Value) -> tuple[list[tuple[int, int]], bool]:
    off = _rank(out) - _rank(x)
    return [(d, d + off) for d in range(_rank(x))], True


def _pairs_unsqueeze(node: Node, x: Value, out: Value) -> tuple[list[tuple[int, int]], bool]:
    u = bind_args(node)["dim"] % _rank(out)
    return [(d, d if d < u else d + 1) for d in range(_rank(x))], True


def _pairs_squeeze(node: Node, x: Value, out: Value) -> tuple[list[tuple[int, int]], bool]:
    b = bind_args(node)
    dims = set(_norm_dims(b["dim"], _rank(x))) if "dim" in b else set(range(_rank(x)))
    dropped = {d for d in dims if _is_one(x.meta.shape[d])}
    kept = [d for d in range(_rank(x)) if d not in dropped]
    return list(zip(kept, range(len(kept)))), True


def _pairs_slice(node: Node, x: Value, out: Value) -> tuple[list[tuple[int, int]], bool]:
    b = bind_args(node)
    d0 = b["dim"] % _rank(x)
    if "index" in b:   # select: the dim disappears
        kept = [d for d in range(_rank(x)) if d != d0]
        return list(zip(kept, range(len(kept)))), False
    exact = b.get("start") in (None, 0) and b.get("step", 1) == 1
    return [(d, d) for d in range(_rank(x))], exact


_LAYOUT_PAIRS: dict[str, Callable] = {
    "view": _pairs_view, "permute": _pairs_permute, "expand": _pairs_expand,
    "unsqueeze": _pairs_unsqueeze, "squeeze": _pairs_squeeze, "slice": _pairs_slice,
}


def _links_layout(f: _Facts, node: Node, values: dict) -> None:
    ins, outs = _tensor_inputs(node), [o for o in node.outputs if o.is_tensor]
    pair_fn = _LAYOUT_PAIRS.get(node.op.name)
    if pair_fn is not None:
        x, out = ins[0], outs[0]
        pairs, _ = pair_fn(node, x, out)
        for d, e in pairs:
            f.link(x, d, out, e)
        if node.op.name == "expand":
            for d, e in pairs:
                if _is_one(x.meta.shape[d]) and not _is_one(out.meta.shape[e]):
                    f.mark_broadcast(x, d)
            if _is_data(x, values):
                mapped = {e for d, e in pairs if not (_is_one(x.meta.shape[d]) and not _is_one(out.meta.shape[e]))}
                for e in range(_rank(out)):
                    if e not in mapped and not _is_one(out.meta.shape[e]):
                        f.seed(out, e, ReduceDep.REUSE)
        return
    # cat / split: every dim of every piece with the same dim of the whole (the cat / split dim too)
    whole, pieces = (outs[0], ins) if node.op.name == "cat" else (ins[0], outs)
    for p in pieces:
        if _rank(p) == _rank(whole):
            for d in range(_rank(p)):
                f.link(p, d, whole, d)


def _no_links(f: _Facts, node: Node, values: dict) -> None:
    return None


_LINK_RULES: dict[OpKind, Callable[[_Facts, Node, dict], None]] = {
    OpKind.ELEMENTWISE: _links_elementwise,
    OpKind.REDUCTION: _links_reduction,
    OpKind.MATMUL: _links_matmul,
    OpKind.LAYOUT: _links_layout,
    OpKind.CREATION: _no_links,
    OpKind.OPAQUE: _no_links,
}


# ----------------------------------------------------------------------------- value rules (forward)

def _operand_value(a: Any, values: dict[int, ValueProperty]) -> ValueProperty:
    if isinstance(a, Value):
        return values.get(id(a), UNKNOWN)
    if isinstance(a, (int, float, bool)):
        return const(a)
    return UNKNOWN


def _eval_constants(node: Node, consts: dict[int, Any]) -> Any:
    """Run the ATen op on 0-d tensors holding the constants (exact dtype semantics); ``None`` if it fails."""
    def sub(a: Any) -> Any:
        if isinstance(a, Value):
            return torch.tensor(consts[id(a)], dtype=a.meta.dtype)
        if isinstance(a, (list, tuple)):
            return type(a)(sub(x) for x in a)
        return a
    try:
        r = node.target(*sub(node.args), **{k: sub(v) for k, v in node.kwargs.items()})
        return r.item() if isinstance(r, torch.Tensor) and r.numel() == 1 else None
    except Exception:   # noqa: BLE001 - an op we cannot fold stays unknown
        return None


# absorbing elements with an unknown (assumed finite) operand: op name -> (operand position, fill) -> result
_ABSORB: dict[str, dict[tuple[int, Any], Any]] = {
    "add": {(0, -math.inf): -math.inf, (1, -math.inf): -math.inf},
    "sub": {(0, -math.inf): -math.inf, (1, math.inf): -math.inf},
    "mul": {(0, 0.0): 0.0, (1, 0.0): 0.0},
    "div": {(0, 0.0): 0.0},
    "maximum": {(0, math.inf): math.inf, (1, math.inf): math.inf},
    "minimum": {(0, -math.inf): -math.inf, (1, -math.inf): -math.inf},
}


# identities: op name -> {operand position: value}; the result is the other operand (any kind of property)
_IDENTITY: dict[str, dict[int, Any]] = {
    "add": {0: 0, 1: 0}, "sub": {1: 0}, "mul": {0: 1, 1: 1}, "div": {1: 1}, "logical_and": {0: True, 1: True},
}


def _identity(node: Node, ops: list[ValueProperty]) -> ValueProperty | None:
    if len(ops) != 2 or bind_args(node).get("alpha", 1) != 1 or "rsub" in node.target_name:
        return None
    for pos, ident in _IDENTITY.get(node.op.name, {}).items():
        o = ops[pos]
        if o.is_constant and isinstance(o.fill, bool) == isinstance(ident, bool) and o.fill == ident:
            return ops[1 - pos]
    return None


def _side(node: Node, ops: list[ValueProperty], positional: list[Any], masked: bool) -> ValueProperty:
    """The value of one side of a piecewise result (``masked``) or of a whole tensor, given its operands' values.
    Absorbing elements with unknown operands (``-inf + x``) apply to masked sides only: whole tensors stay exact."""
    if all(o.is_constant for o in ops):
        consts = {id(a): o.fill for a, o in zip(positional, ops) if isinstance(a, Value)}
        r = _eval_constants(node, consts)
        return UNKNOWN if r is None else const(r)
    ident = _identity(node, ops)
    if ident is not None:
        return ident
    for i, o in enumerate(ops if masked else ()):
        if o.is_constant:
            for (pos, fill), res in _ABSORB.get(node.op.name, {}).items():
                if pos == i and _eq_fill(o.fill, fill):
                    return const(res)
    return UNKNOWN


def _affine_of(p: ValueProperty) -> Affine | None:
    if p.kind is ValueKind.AFFINE:
        return p.expr
    if p.is_constant and _is_int(p.fill):
        return Affine((), p.fill)
    return None


def _value_compare(node: Node, ops: list[ValueProperty]) -> ValueProperty | None:
    name = node.op.name
    if name not in ("ge", "gt", "le", "lt") or len(ops) != 2 or all(o.is_constant for o in ops):
        return None
    a, b = _affine_of(ops[0]), _affine_of(ops[1])
    if a is None or b is None:
        return None
    diff = a.plus(b.scaled(-1))
    expr = {"ge": diff, "gt": diff.plus(Affine((), -1)), "le": diff.scaled(-1),
            "lt": diff.scaled(-1).plus(Affine((), -1))}[name]
    return ValueProperty(ValueKind.MASK, expr=expr)


def _value_affine_arith(node: Node, ops: list[ValueProperty]) -> ValueProperty | None:
    if node.op.name not in ("add", "sub", "neg", "mul", "to_dtype", "copy") or all(o.is_constant for o in ops):
        return None
    affs = [_affine_of(o) for o in ops]
    if any(a is None for a in affs):
        return None
    alpha = bind_args(node).get("alpha", 1)
    name = node.op.name
    if name in ("to_dtype", "copy"):
        r = affs[0]
    elif name == "neg":
        r = affs[0].scaled(-1)
    elif name == "mul":
        c = [o.fill for o in ops if o.is_constant]
        if len(c) != 1 or not _is_int(c[0]):
            return None
        r = next(a for a, o in zip(affs, ops) if not o.is_constant).scaled(c[0])
    elif not _is_int(alpha):
        return None
    else:
        r = affs[0].plus(affs[1].scaled(alpha if name == "add" else -alpha))
        if "rsub" in node.target_name:
            r = r.scaled(-1)
    return ValueProperty(ValueKind.AFFINE, expr=r)


def _value_elementwise(node: Node, values: dict) -> list[ValueProperty]:
    positional = [a for a in node.args if isinstance(a, (Value, int, float, bool))]
    ops = [_operand_value(a, values) for a in positional]
    if node.op.name == "where" and ops and ops[0].kind is ValueKind.MASK \
            and all(o.kind in (ValueKind.CONSTANT, ValueKind.UNKNOWN) for o in ops[1:]):
        if ops[1].is_constant and ops[2].is_constant and _eq_fill(ops[1].fill, ops[2].fill):
            return [ops[1]]
        return [ValueProperty(ValueKind.PIECEWISE, expr=ops[0].expr, inside=ops[1], outside=ops[2])]
    if node.op.name == "where" and ops and ops[0].is_constant:
        return [ops[1] if ops[0].fill else ops[2]]
    for rule in (_value_compare, _value_affine_arith):
        r = rule(node, ops)
        if r is not None:
            return [r]
    if node.op.name == "logical_not" and ops[0].kind is ValueKind.MASK:
        return [ValueProperty(ValueKind.MASK, expr=ops[0].expr.scaled(-1).plus(Affine((), -1)))]
    ident = _identity(node, ops)
    if ident is not None:
        return [ident]
    preds = {o.expr for o in ops if o.kind is ValueKind.PIECEWISE}
    if len(preds) > 1 or any(o.kind in (ValueKind.AFFINE, ValueKind.MASK) for o in ops):
        return [UNKNOWN]
    if not preds:
        return [_side(node, ops, positional, masked=False)]
    pred = preds.pop()
    inside = _side(node, [o.inside if o.kind is ValueKind.PIECEWISE else o for o in ops], positional, True)
    outside = _side(node, [o.outside if o.kind is ValueKind.PIECEWISE else o for o in ops], positional, True)
    if inside.is_constant and outside.is_constant and _eq_fill(inside.fill, outside.fill):
        return [inside]
    if not inside.known and not outside.known:
        return [UNKNOWN]
    return [ValueProperty(ValueKind.PIECEWISE, expr=pred, inside=inside, outside=outside)]


def _value_creation(node: Node, values: dict) -> list[ValueProperty]:
    b = bind_args(node)
    name = node.target_name
    if "iota" in name or "arange" in name:
        start, step = b.get("start", 0) or 0, b.get("step", 1) or 1
        if _is_int(start) and _is_int(step):
            return [ValueProperty(ValueKind.AFFINE, expr=Affine.make({-1: step}, start))]
        return [UNKNOWN]
    for key in ("fill_value", "s"):
        if key in b:
            return [const(b[key])]
    fills = {"zeros": 0.0, "ones": 1.0}
    return [next((const(v) for k, v in fills.items() if f".{k}." in name + "."), UNKNOWN)]


def _value_reduction(node: Node, values: dict) -> list[ValueProperty]:
    x = _operand_value(_tensor_inputs(node)[0], values)
    keeps = node.op.name in ("amax", "amin", "mean") and x.is_constant
    return [x if keeps and o.meta is not None and o.meta.dtype.is_floating_point else UNKNOWN for o in node.outputs]


def _value_layout(node: Node, values: dict) -> list[ValueProperty]:
    ins = [_operand_value(v, values) for v in _tensor_inputs(node)]
    outs = [o for o in node.outputs]
    if ins and all(p.is_constant for p in ins) and len({str(p.fill) for p in ins}) == 1:
        return [ins[0]] * len(outs)
    pair_fn = _LAYOUT_PAIRS.get(node.op.name)
    if pair_fn is None or not ins or not ins[0].known:
        return [UNKNOWN] * len(outs)
    x, out = _tensor_inputs(node)[0], outs[0]
    pairs, exact = pair_fn(node, x, out)
    if not exact:
        return [UNKNOWN]
    dim_map = {d - _rank(x): e - _rank(out) for d, e in pairs}
    if node.op.name == "view":   # size-1 dims the grouping skipped
        dim_map.update({d - _rank(x): None for d in range(_rank(x)) if _is_one(x.meta.shape[d])})
    return [_remap(ins[0], dim_map)]


def _remap(p: ValueProperty, dim_map: dict[int, int | None]) -> ValueProperty:
    if p.kind is ValueKind.CONSTANT or p.kind is ValueKind.UNKNOWN:
        return p
    live = {d: e for d, e in dim_map.items() if e is not None}
    expr = p.expr.remapped(live)
    if expr is None:
        return UNKNOWN
    if p.kind is ValueKind.PIECEWISE:
        return ValueProperty(p.kind, expr=expr, inside=p.inside, outside=p.outside)
    return ValueProperty(p.kind, expr=expr)


def _value_unknown(node: Node, values: dict) -> list[ValueProperty]:
    return [UNKNOWN] * len(node.outputs)


_VALUE_RULES: dict[OpKind, Callable[[Node, dict], list[ValueProperty]]] = {
    OpKind.ELEMENTWISE: _value_elementwise,
    OpKind.REDUCTION: _value_reduction,
    OpKind.MATMUL: _value_unknown,
    OpKind.LAYOUT: _value_layout,
    OpKind.CREATION: _value_creation,
    OpKind.OPAQUE: _value_unknown,
}


# ----------------------------------------------------------------------------- result

class TensorProperties:
    """Per-dimension and whole-tensor properties of the values touched by the analysed nodes."""

    def __init__(self, facts: _Facts, values: dict[int, ValueProperty], order: list[Value]) -> None:
        self._f = facts
        self._values = values
        self._order = order

    def reduce_deps(self, v: Value) -> list[ReduceDep]:
        return [self._f.dep_of(v, d) for d in range(_rank(v))]

    def dims(self, v: Value) -> list[DimProperty]:
        if not v.is_tensor:
            raise TypeError(f"tensor properties: {v!r} is not a tensor value")
        m = v.meta
        return [DimProperty(self._f.dep_of(v, d), (id(v), d) in self._f.bcast, m.shape[d],
                            m.stride[d] == 0 and not _is_one(m.shape[d]))
                for d in range(_rank(v))]

    def grid_dims(self, v: Value) -> list[int]:
        """Dims of ``v`` that may map to grid dims (BATCH, or REUSE by tiles): every dim that is not NONPARA."""
        return [d for d, dep in enumerate(self.reduce_deps(v)) if dep is not ReduceDep.NONPARA]

    def value(self, v: Value) -> ValueProperty:
        return self._values.get(id(v), UNKNOWN)

    @staticmethod
    def size(v: Value) -> Any:
        return v.meta.numel

    def axes(self) -> list[Axis]:
        """The iteration axes (connected sets of linked dims) of the analysed nodes."""
        groups: dict[tuple[int, int], list[tuple[Value, int]]] = {}
        for v in self._order:
            if v.is_tensor:
                for d in range(_rank(v)):
                    groups.setdefault(self._f._find(self._f.key(v, d)), []).append((v, d))
        axes = []
        for root, members in groups.items():
            sizes = [v.meta.shape[d] for v, d in members if _is_int(v.meta.shape[d])]
            axes.append(Axis(self._f.dep.get(root, ReduceDep.BATCH), max(sizes) if sizes else None,
                             tuple((v.name, d) for v, d in members)))
        return axes

    def __str__(self) -> str:
        lines = []
        for v in self._order:
            if not v.is_tensor:
                continue
            dims = " ".join(str(p) for p in self.dims(v))
            val = self.value(v)
            lines.append(f"%{v.name}: [{dims}]" + (f"  value={val}" if val.known else ""))
        return "\n".join(lines)


def analyze_values(nodes: Iterable[Node]) -> dict[int, ValueProperty]:
    """Value properties of the outputs of ``nodes`` (in topological order), keyed by ``id(value)``; forward only."""
    values: dict[int, ValueProperty] = {}
    for node in nodes:
        for out, p in zip(node.outputs, _VALUE_RULES[node.kind](node, values)):
            values[id(out)] = p
    return values


def analyze_properties(graph: Graph | None, nodes: Iterable[Node] | None = None, *,
                       values: dict[int, ValueProperty] | None = None) -> TensorProperties:
    """Properties of ``graph``'s tensors. With ``nodes`` only those nodes' link rules apply: the view of one candidate
    kernel, whose axes give its parallelism. Values flow through the whole graph (they do not depend on the kernel);
    pass ``values`` from :func:`analyze_values` to reuse them, or ``graph=None`` to analyse ``nodes`` alone."""
    if graph is None and nodes is None:
        raise ValueError("analyze_properties: give a graph, nodes, or both")
    keep = None if nodes is None else {id(m) for m in nodes}
    all_nodes = list(nodes) if graph is None else graph.nodes
    chosen = all_nodes if keep is None else [n for n in all_nodes if id(n) in keep]
    if values is None:
        values = analyze_values(all_nodes)
    facts = _Facts()
    order: list[Value] = []
    seen: set[int] = set()
    for node in chosen:
        _LINK_RULES[node.kind](facts, node, values)
        for v in _tensor_inputs(node) + node.outputs:
            if id(v) not in seen:
                seen.add(id(v))
                order.append(v)
    return TensorProperties(facts, values, order)
