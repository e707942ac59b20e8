"""Value properties (forward only): what is known of every element of a tensor without running the program.

This module owns :class:`ValueProperty` and :func:`analyze_values`. Known are constants (``full``, scalars, and
anything computed from constants, evaluated with the ATen op itself), integer affine index expressions
(``iota``/``arange``, :class:`Affine`), half-plane masks from comparing them (a causal triangle is
``d[-1] - d[-2] >= c``), and piecewise tensors (``where(mask, a, b)``) whose constant side (e.g. ``-inf``)
survives ``add``/``sub``/``mul``/``div``/``exp``... so later stages can skip masked tiles. On the masked side of a
piecewise tensor, non-constant operands are assumed finite (``-inf + x = -inf``, ``0 * x = 0``), the assumption
value-aware skipping rests on; whole-tensor constants are exact (``x * 0`` is not folded: NaN stays NaN).

Readers: the attention analysis (:mod:`.attention`, a mask's visible band) and the dimension links
(:mod:`.properties`: an operand whose value is known is not data worth reusing and seeds no REUSE).
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from ..capture.ir import Node, Value
from ..capture.ops import OpKind
from .op_dims import LAYOUT_PAIRS, bind_args, is_int, is_one, ndim, tensor_inputs


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

    def substituted(self, subs: dict[int, "Affine"]) -> "Affine | None":
        """The expression with each index ``i[d]`` replaced by ``subs[d]`` (an expression over other indices: a
        gather's index tensors, a slice's offset); None where a dim it reads has no substitute."""
        if any(d not in subs for d, _ in self.terms):
            return None
        r = Affine((), self.const)
        for d, c in self.terms:
            r = r.plus(subs[d].scaled(c))
        return r

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


def _typed(c: Any, value: Value) -> Any:
    """``c`` as an element of ``value``'s dtype (bool / int / float), so that identities such as ``x & True``
    recognise it."""
    dtype = value.meta.dtype if value.meta is not None else None
    if dtype is torch.bool:
        return bool(c)
    if dtype is not None and not dtype.is_floating_point and not dtype.is_complex:
        return int(c)
    return float(c)


def _normalised(p: ValueProperty, shape: tuple | None = None) -> ValueProperty:
    """An index expression without index terms as the constant it is (``arange(n)[1:] - arange(n)[:-1]`` is 1
    everywhere): AFFINE its value; and a predicate whose sign no index can change as that answer (MASK the bool,
    PIECEWISE the side it selects): indices are >= 0 (``i >= 0`` always holds, ``-i - 1 >= 0`` never) and, where
    ``shape`` (the tensor's, static) is given, below their sizes (a sliding window of 256 keys over a 16-token
    prompt, ``j - i + 255 >= 0``, always holds)."""
    if p.kind is ValueKind.AFFINE and not p.expr.terms:
        return const(p.expr.const)
    if p.kind in (ValueKind.MASK, ValueKind.PIECEWISE):
        lo, hi = _bounds(p.expr, shape)
        holds = True if lo is not None and lo >= 0 else False if hi is not None and hi < 0 else None
        if holds is not None:
            return const(holds) if p.kind is ValueKind.MASK else (p.inside if holds else p.outside)
    return p


def _bounds(expr: Affine, shape: tuple | None) -> tuple[int | None, int | None]:
    """The least and greatest value of ``expr`` over the indices of a tensor of ``shape`` (each index at least 0,
    and below its size where ``shape`` gives one); None for an unbounded side."""
    lo = hi = expr.const
    for d, k in expr.terms:
        size = shape[d] if shape is not None and -len(shape) <= d and is_int(shape[d]) else None
        if size is None:
            lo, hi = (lo, None) if k > 0 else (None, hi)
        else:
            lo, hi = (lo + min(k * (size - 1), 0) if lo is not None else None,
                      hi + max(k * (size - 1), 0) if hi is not None else None)
    return lo, hi


def _with_expr(p: ValueProperty, expr: Affine | None) -> ValueProperty:
    """``p`` read through an index map that turns its expression into ``expr`` (None: not expressible)."""
    if p.kind in (ValueKind.CONSTANT, ValueKind.UNKNOWN):
        return p
    if expr is None:
        return UNKNOWN
    return _normalised(ValueProperty(p.kind, fill=p.fill, expr=expr, inside=p.inside, outside=p.outside))


def _identity_subs(rank: int) -> dict[int, Affine]:
    """Every index of a rank-``rank`` tensor as itself (dims from the right)."""
    return {d: Affine(((d, 1),)) for d in range(-rank, 0)}


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
    if p.is_constant and is_int(p.fill):
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
        if len(c) != 1 or not is_int(c[0]):
            return None
        r = next(a for a, o in zip(affs, ops) if not o.is_constant).scaled(c[0])
    elif not is_int(alpha):
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
        if is_int(start) and is_int(step):
            return [ValueProperty(ValueKind.AFFINE, expr=Affine.make({-1: step}, start))]
        return [UNKNOWN]
    return [_filled(node)]


_FILLS = {"zeros": 0, "ones": 1, "new_zeros": 0, "new_ones": 1, "zeros_like": 0, "ones_like": 1}
_CREATES = frozenset(_FILLS) | {"full_like", "new_full"}     # the op kinds' table calls these opaque


def _filled(node: Node) -> ValueProperty:
    """The constant a creation op fills its result with (``full``, ``ones``, ``new_ones``, ``zeros_like`` ...), in
    the result's dtype; UNKNOWN for any other op."""
    b = bind_args(node)
    out = node.outputs[0]
    for key in ("fill_value", "s"):
        if key in b and isinstance(b[key], (int, float, bool)):
            return const(_typed(b[key], out))
    op = _aten_name(node)
    return const(_typed(_FILLS[op], out)) if op in _FILLS else UNKNOWN


def _aten_name(node: Node) -> str:
    """``new_ones`` of ``aten.new_ones.default``; "" for a target of another form."""
    parts = node.target_name.split(".")
    return parts[1] if len(parts) >= 3 else ""


def _value_reduction(node: Node, values: dict) -> list[ValueProperty]:
    x = _operand_value(tensor_inputs(node)[0], values)
    keeps = node.op.name in ("amax", "amin", "mean") and x.is_constant
    return [x if keeps and o.meta is not None and o.meta.dtype.is_floating_point else UNKNOWN for o in node.outputs]


def _value_layout(node: Node, values: dict) -> list[ValueProperty]:
    ins = [_operand_value(v, values) for v in tensor_inputs(node)]
    outs = [o for o in node.outputs]
    if ins and all(p.is_constant for p in ins) and len({str(p.fill) for p in ins}) == 1:
        return [ins[0]] * len(outs)
    if node.op.name == "cat":
        return [_value_cat(node, ins)]
    if node.op.name == "slice" and "index" not in bind_args(node) and ins and ins[0].known:
        return [_value_sliced(node, ins[0])]
    pair_fn = LAYOUT_PAIRS.get(node.op.name)
    if pair_fn is None or not ins or not ins[0].known:
        return [UNKNOWN] * len(outs)
    x, out = tensor_inputs(node)[0], outs[0]
    pairs, exact = pair_fn(node, x, out)
    if not exact:
        return [UNKNOWN]
    dim_map = {d - ndim(x): e - ndim(out) for d, e in pairs}
    if node.op.name == "view":   # size-1 dims the grouping skipped
        dim_map.update({d - ndim(x): None for d in range(ndim(x)) if is_one(x.meta.shape[d])})
    return [_remap(ins[0], dim_map)]


def _value_sliced(node: Node, p: ValueProperty) -> ValueProperty:
    """``x[..., start::step, ...]``: index ``i`` of the result reads index ``start + step·i`` of ``x``."""
    b = bind_args(node)
    x = tensor_inputs(node)[0]
    rank, size = ndim(x), x.meta.shape[b["dim"] % ndim(x)]
    start, step = b.get("start") or 0, b.get("step") or 1
    if not (is_int(start) and is_int(step) and is_int(size)):
        return UNKNOWN
    start = max(start + size, 0) if start < 0 else start
    d = b["dim"] % rank - rank
    subs = _identity_subs(rank)
    subs[d] = Affine.make({d: step}, start)
    return _with_expr(p, p.expr.substituted(subs) if p.expr is not None else None)


def _value_cat(node: Node, ins: list[ValueProperty]) -> ValueProperty:
    """``cat`` of pieces that are one index expression (each read at its offset along the dim): that expression
    (``cat([pos[:, :1] - 1, pos], -1)`` is ``i - 1`` throughout); UNKNOWN where the pieces differ."""
    pieces = tensor_inputs(node)
    if not pieces or any(not p.known for p in ins):
        return UNKNOWN
    rank = ndim(pieces[0])
    d = (bind_args(node).get("dim", 0) or 0) % rank - rank
    whole, offset = None, 0
    for v, p in zip(pieces, ins):
        subs = _identity_subs(rank)
        subs[d] = Affine.make({d: 1}, -offset)
        q = _with_expr(p, p.expr.substituted(subs) if p.expr is not None else None)
        if whole is None:
            whole = q
        elif q != whole and not (q.is_constant and whole.is_constant and _eq_fill(q.fill, whole.fill)):
            return UNKNOWN
        size = v.meta.shape[d]
        if not is_int(size):
            return UNKNOWN
        offset += size
    return whole


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


# ops whose every result element is one of their first operand's elements (gathers): a constant stays constant
# (transformers 5.17's causal mask ANDs the triangle with a padding mask indexed out of ``ones``, BLOOM's prompt)
_PICKS = frozenset({"aten.index.Tensor", "aten.index_select.default", "aten.gather.default",
                    "aten.embedding.default"})


def _value_opaque(node: Node, values: dict) -> list[ValueProperty]:
    if len(node.outputs) != 1:
        return _value_unknown(node, values)
    if node.target_name in _PICKS and isinstance(node.args[0], Value):
        source = _operand_value(node.args[0], values)
        if source.is_constant:
            return [source]
        if node.target_name == "aten.index.Tensor":
            return [_value_indexed(node, source, values)]
    elif node.target_name == "aten.cumsum.default":
        return [_value_cumsum(node, values)]
    elif _aten_name(node) in _CREATES:
        return [_filled(node)]
    return _value_unknown(node, values)


def _value_indexed(node: Node, source: ValueProperty, values: dict) -> ValueProperty:
    """``x[idx_0, ..., idx_k-1]`` (advanced indexing of the leading dims by index tensors): x's expression with
    index ``j < k`` replaced by the expression of ``idx_j``, whose dims (broadcast together) lead the result, and
    the dims after k kept (transformers' masks gather positions as ``pos[b, q]``)."""
    indices = node.args[1] if len(node.args) > 1 else None
    if source.expr is None or not indices or not all(
            isinstance(i, Value) and i.meta is not None and i.meta.dtype in (torch.int64, torch.int32)
            for i in indices):              # a bool / byte index selects where it is True: no index expression
        return UNKNOWN
    exprs = [_affine_of(_operand_value(i, values)) for i in indices]
    if any(e is None for e in exprs):
        return UNKNOWN
    sizes = node.args[0].meta.shape
    for j, (i, e) in enumerate(zip(indices, exprs)):     # a negative index wraps around: not this expression
        lo, hi = _bounds(e, tuple(i.meta.shape))
        if lo is None or lo < 0 or hi is None or not is_int(sizes[j]) or hi >= sizes[j]:
            return UNKNOWN
    rank, k = ndim(node.args[0]), len(indices)
    trailing = rank - k
    subs = _identity_subs(trailing)        # the dims after k: the result's last dims, as they are
    subs.update({j - rank: Affine.make({d - trailing: c for d, c in e.terms}, e.const) for j, e in enumerate(exprs)})
    return _with_expr(source, source.expr.substituted(subs))


def _value_cumsum(node: Node, values: dict) -> ValueProperty:
    """The running sum of a constant integer ``c`` along a dim: ``c·(i + 1)`` (0 for a mask that is all False)."""
    x = node.args[0]
    p = _operand_value(x, values)
    if not p.is_constant or not isinstance(p.fill, (bool, int)):
        return UNKNOWN
    c = int(p.fill)
    d = bind_args(node)["dim"] % ndim(x) - ndim(x)
    return ValueProperty(ValueKind.AFFINE, expr=Affine.make({d: c}, c))    # c = 0: analyze_values makes it 0


_VALUE_RULES: dict[OpKind, Callable[[Node, dict], list[ValueProperty]]] = {
    OpKind.ELEMENTWISE: _value_elementwise,
    OpKind.REDUCTION: _value_reduction,
    OpKind.MATMUL: _value_unknown,
    OpKind.LAYOUT: _value_layout,
    OpKind.CREATION: _value_creation,
    OpKind.OPAQUE: _value_opaque,
}


def analyze_values(nodes: Iterable[Node]) -> dict[int, ValueProperty]:
    """Value properties of the outputs of ``nodes`` (in topological order), keyed by ``id(value)``; forward only."""
    values: dict[int, ValueProperty] = {}
    for node in nodes:
        for out, p in zip(node.outputs, _VALUE_RULES[node.kind](node, values)):
            values[id(out)] = _normalised(p, tuple(out.meta.shape) if out.meta is not None else None)
    return values
