"""Tensor properties (FlashTensor §4): reduce dependency, broadcast and size of every dimension, by dimension links.

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

This module owns the links and their result, :class:`TensorProperties` (:func:`analyze_properties`), which also
holds every tensor's value property (:mod:`.values`); the per-op dim facts the links use are in :mod:`.op_dims`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ..capture.ir import Graph, Node, Value
from ..capture.ops import OpKind
from .op_dims import LAYOUT_PAIRS, is_int, is_one, matmul_operands, ndim, reduction_dims, tensor_inputs
from .values import UNKNOWN, ValueProperty, analyze_values


def _same(a: Any, b: Any) -> bool:
    """Sizes equal without guarding on symbols."""
    return a == b if is_int(a) and is_int(b) else str(a) == str(b)


def _static_numel(v: Value) -> int | None:
    n = 1
    for s in v.meta.shape:
        if not is_int(s):
            return None
        n *= s
    return n


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
        return (id(v), d % ndim(v))

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
    off = ndim(out) - ndim(v)
    data = _is_data(v, values)
    for e in range(ndim(out)):
        so = out.meta.shape[e]
        d = e - off
        if d >= 0 and (_same(v.meta.shape[d], so) and not (is_one(v.meta.shape[d]) and not is_one(so))):
            f.link(v, d, out, e)
            continue
        if d >= 0:
            f.mark_broadcast(v, d)
        if data and not is_one(so):
            f.seed(out, e, ReduceDep.REUSE)


def _links_elementwise(f: _Facts, node: Node, values: dict) -> None:
    out = node.outputs[0]
    for v in tensor_inputs(node):
        _broadcast_into(f, v, out, values)


def _links_reduction(f: _Facts, node: Node, values: dict) -> None:
    x, dims, keepdim = reduction_dims(node)
    outs = [o for o in node.outputs if o.is_tensor and ndim(o) == (ndim(x) if keepdim else ndim(x) - len(dims))]
    for d in dims:
        f.seed(x, d, ReduceDep.NONPARA)
    for out in outs:
        j = 0
        for d in range(ndim(x)):
            if d in dims:
                if keepdim:
                    f.seed(out, d, ReduceDep.NONPARA)
                    j += 1
                continue
            f.link(x, d, out, j)
            j += 1


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
        for d in range(ndim(v) - 2):
            f.link(v, d, out, d + ndim(out) - ndim(v))
    if bias is not None:
        _broadcast_into(f, bias, out, values)


def _links_layout(f: _Facts, node: Node, values: dict) -> None:
    ins, outs = tensor_inputs(node), [o for o in node.outputs if o.is_tensor]
    pair_fn = LAYOUT_PAIRS.get(node.op.name)
    if pair_fn is not None:
        x, out = ins[0], outs[0]
        pairs, _ = pair_fn(node, x, out)
        for d, e in pairs:
            f.link(x, d, out, e)
        if node.op.name == "expand":
            for d, e in pairs:
                if is_one(x.meta.shape[d]) and not is_one(out.meta.shape[e]):
                    f.mark_broadcast(x, d)
            if _is_data(x, values):
                mapped = {e for d, e in pairs if not (is_one(x.meta.shape[d]) and not is_one(out.meta.shape[e]))}
                for e in range(ndim(out)):
                    if e not in mapped and not is_one(out.meta.shape[e]):
                        f.seed(out, e, ReduceDep.REUSE)
        return
    # cat / split: every dim of every piece with the same dim of the whole (the cat / split dim too)
    whole, pieces = (outs[0], ins) if node.op.name == "cat" else (ins[0], outs)
    for p in pieces:
        if ndim(p) == ndim(whole):
            for d in range(ndim(p)):
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


# ----------------------------------------------------------------------------- result

class TensorProperties:
    """Per-dimension and whole-tensor properties of the values touched by the analysed nodes."""

    def __init__(self, facts: _Facts, values: dict[int, ValueProperty], order: list[Value]) -> None:
        self._f = facts
        self._values = values
        self._order = order

    def reduce_deps(self, v: Value) -> list[ReduceDep]:
        return [self._f.dep_of(v, d) for d in range(ndim(v))]

    def dims(self, v: Value) -> list[DimProperty]:
        if not v.is_tensor:
            raise TypeError(f"tensor properties: {v!r} is not a tensor value")
        m = v.meta
        return [DimProperty(self._f.dep_of(v, d), (id(v), d) in self._f.bcast, m.shape[d],
                            m.stride[d] == 0 and not is_one(m.shape[d]))
                for d in range(ndim(v))]

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
                for d in range(ndim(v)):
                    groups.setdefault(self._f._find(self._f.key(v, d)), []).append((v, d))
        axes = []
        for root, members in groups.items():
            sizes = [v.meta.shape[d] for v, d in members if is_int(v.meta.shape[d])]
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
        for v in tensor_inputs(node) + node.outputs:
            if id(v) not in seen:
                seen.add(id(v))
                order.append(v)
    return TensorProperties(facts, values, order)
