"""The tensor-program IR every stage after capture works on.

A :class:`Graph` is a list of :class:`Node` in topological order. Each node
applies one :class:`~torch_mirage.capture.ops.OpDef` (or an opaque ATen op) and
produces :class:`Value` s; every tensor value carries its :class:`TensorMeta`
(shape, dtype, stride, device). Node arguments keep the structure of the ATen
call (``args`` / ``kwargs`` with values in place of FX nodes), so a graph
converts back to FX losslessly (:mod:`torch_mirage.capture.lower`).
"""
from __future__ import annotations

import functools
import re
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils import _pytree as pytree

from .ops import OpDef, OpKind


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple      # ints, or torch.SymInt for dynamic dims
    dtype: torch.dtype
    stride: tuple
    device: torch.device

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorMeta":
        return cls(tuple(t.shape), t.dtype, tuple(t.stride()), t.device)

    @property
    def is_static(self) -> bool:
        return all(isinstance(s, int) for s in self.shape + self.stride)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @functools.cached_property
    def is_contiguous(self) -> bool:
        expected, stride = 1, []
        for s in reversed(self.shape):
            stride.append(expected)
            expected *= s
        return all(a == b or s == 1 for a, b, s in zip(self.stride, reversed(stride), self.shape))

    @functools.cached_property
    def _text(self) -> str:      # made once per meta: the partition stage's cut signatures ask it many times over
        dt = str(self.dtype).replace("torch.", "")
        dims = ",".join(str(s) for s in self.shape)
        return f"{dt}[{dims}]" + ("" if self.is_contiguous else f"s({','.join(map(str, self.stride))})")

    def __str__(self) -> str:
        return self._text


@dataclass(eq=False)
class Value:
    """One SSA value: a tensor (``meta`` set) or a non-tensor (SymInt, scalar, None)."""
    name: str
    meta: TensorMeta | None
    producer: "Node | None" = None      # None for graph inputs
    users: list["Node"] = field(default_factory=list)
    example: Any = None                 # the FakeTensor / SymInt the value was traced with

    @property
    def is_tensor(self) -> bool:
        return self.meta is not None

    def __repr__(self) -> str:
        return f"%{self.name}"


@dataclass(eq=False)
class Node:
    name: str
    op: OpDef
    target: Any                 # the ATen overload (kept for opaque ops and for round trips)
    args: tuple                 # ATen call structure, Values in place of inputs
    kwargs: dict
    outputs: list[Value] = field(default_factory=list)
    out_structure: Any = None   # pytree spec of the ATen result (a Value, or a tuple of them)

    @property
    def inputs(self) -> list[Value]:
        """The Values among ``args`` and ``kwargs``, flattened once per call structure (partitioning reads them
        for every node many times over)."""
        cached = self.__dict__.get("_inputs")
        if cached is None or cached[0] is not self.args or cached[1] is not self.kwargs:
            leaves = [a for a in pytree.tree_leaves((self.args, self.kwargs)) if isinstance(a, Value)]
            cached = self.__dict__["_inputs"] = (self.args, self.kwargs, leaves)
        return list(cached[2])

    @property
    def kind(self) -> OpKind:
        return self.op.kind

    @property
    def target_name(self) -> str:
        """The op's name, the same in every process: an ATen overload as ``aten.add.Tensor``, a Python function
        (``torch.sym_sum``, ``operator.getitem``) by module and qualified name, not a repr with its address
        (keys made from a graph's text, e.g. the partition record's, must not change between processes)."""
        return target_name(self.target)

    def describe(self) -> str:
        """``aten.add.Tensor(f16[8,4096], f16[4096])``: for reports and error messages."""
        ins = ", ".join(str(v.meta) if v.meta else repr(v.example) for v in self.inputs)
        return f"{self.target_name}({ins})"

    def __repr__(self) -> str:
        return f"Node({self.name}: {self.op.name})"


def target_name(target: Any) -> str:
    """:attr:`Node.target_name` of ``target``."""
    if isinstance(target, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
        if module and name:
            return f"{module}.{name}"
    return _ADDRESS.sub("", str(target))


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class Graph:
    """Inputs, nodes in topological order, outputs."""

    def __init__(self) -> None:
        self.inputs: list[Value] = []
        self.nodes: list[Node] = []
        self.outputs: list[Any] = []   # Values or constants, in FX output order
        self.single_output = False     # the FX graph returns one value, not a tuple
        self.constants: dict[str, str] = {}   # input value name -> get_attr target, for constant tensors
        self._names: set[str] = set()

    def _fresh(self, base: str) -> str:
        name, i = base, 0
        while name in self._names:
            i += 1
            name = f"{base}_{i}"
        self._names.add(name)
        return name

    def add_input(self, name: str, example: Any) -> Value:
        meta = TensorMeta.of(example) if isinstance(example, torch.Tensor) else None
        v = Value(self._fresh(name), meta, example=example)
        self.inputs.append(v)
        return v

    def add_node(self, name: str, op: OpDef, target: Any, args: tuple, kwargs: dict, example_out: Any) -> Node:
        node = Node(self._fresh(name), op, target, args, kwargs)
        leaves, spec = pytree.tree_flatten(example_out)
        for i, ex in enumerate(leaves):
            meta = TensorMeta.of(ex) if isinstance(ex, torch.Tensor) else None
            vname = node.name if len(leaves) == 1 else f"{node.name}.{i}"
            node.outputs.append(Value(vname, meta, producer=node, example=ex))
        node.out_structure = spec
        for v in node.inputs:
            v.users.append(node)
        self.nodes.append(node)
        return node

    def result(self, node: Node) -> Any:
        """The node's ATen result structure, Values at the leaves."""
        return pytree.tree_unflatten(node.outputs, node.out_structure)

    def values(self) -> Iterator[Value]:
        yield from self.inputs
        for n in self.nodes:
            yield from n.outputs

    def _memo(self, name: str, key: Any, make: Callable[[], Any]) -> Any:
        """``make()`` kept under ``name`` until ``key`` changes (nodes and inputs are only appended, so their
        counts say when a derived table is stale; the outputs are compared as they are)."""
        cached = self.__dict__.get(name)
        if cached is None or cached[0] != key:
            cached = self.__dict__[name] = (key, make())
        return cached[1]

    def positions(self) -> dict[int, int]:
        """``id(node)`` -> its index in :attr:`nodes`, so that the partitioner's questions about a small set of
        nodes do not walk the whole graph each time."""
        return self._memo("_positions", len(self.nodes), lambda: {id(n): i for i, n in enumerate(self.nodes)})

    def value_positions(self) -> dict[int, int]:
        """``id(value)`` -> its index in :meth:`values` (inputs first, then each node's outputs)."""
        return self._memo("_value_positions", (len(self.inputs), len(self.nodes)),
                          lambda: {id(v): i for i, v in enumerate(self.values())})

    @property
    def output_values(self) -> list[Value]:
        """The Values among the outputs (a fresh list; flattened once per outputs list: claimers ask for every cut)."""
        leaves = self._memo("_output_values", tuple(self.outputs),
                            lambda: [v for v in pytree.tree_leaves(self.outputs) if isinstance(v, Value)])
        return list(leaves)

    def validate(self) -> None:
        """Invariants: topological order, users consistent, every value defined once."""
        defined = {id(v) for v in self.inputs}
        for n in self.nodes:
            for v in n.inputs:
                if id(v) not in defined:
                    raise AssertionError(f"IR: {n.name} uses {v!r} before it is defined")
                if n not in v.users:
                    raise AssertionError(f"IR: {v!r} does not list its user {n.name}")
            for v in n.outputs:
                if id(v) in defined:
                    raise AssertionError(f"IR: {v!r} defined twice")
                if v.producer is not n:
                    raise AssertionError(f"IR: {v!r} has the wrong producer")
                defined.add(id(v))
        for v in self.output_values:
            if id(v) not in defined:
                raise AssertionError(f"IR: output {v!r} is not defined")

    def __str__(self) -> str:
        def fmt(a: Any) -> str:
            if isinstance(a, Value):
                return repr(a)
            if isinstance(a, (list, tuple)):
                inner = ", ".join(fmt(x) for x in a)
                return f"[{inner}]"
            if isinstance(a, torch.dtype):
                return str(a).replace("torch.", "")
            return repr(a)

        lines = ["graph(" + ", ".join(f"%{v.name}: {v.meta or type(v.example).__name__}" for v in self.inputs) + "):"]
        for n in self.nodes:
            outs = ", ".join(f"%{v.name}: {v.meta}" if v.meta else f"%{v.name}" for v in n.outputs)
            argstr = ", ".join([fmt(a) for a in n.args] + [f"{k}={fmt(v)}" for k, v in n.kwargs.items()])
            tag = n.op.name if n.op.kind is not OpKind.OPAQUE else f"opaque<{n.target_name}>"
            lines.append(f"  {outs} = {tag}({argstr})")
        lines.append(f"  return {fmt(list(self.outputs))}")
        return "\n".join(lines)


def map_values(tree: Any, fn) -> Any:
    return pytree.tree_map(lambda a: fn(a) if isinstance(a, Value) else a, tree)


def topo_sorted(nodes: Sequence[Node], graph: Graph) -> list[Node]:
    """``nodes`` in the graph's order."""
    keep = set(map(id, nodes))
    return [n for n in graph.nodes if id(n) in keep]


def subgraph(graph: Graph, nodes: Sequence[Node], outputs: Sequence[Value]) -> Graph:
    """A standalone graph of ``nodes``: their external inputs become inputs, ``outputs`` its outputs."""
    sub = Graph()
    env: dict[int, Value] = {}
    inside = {id(n) for n in nodes}
    for node in topo_sorted(nodes, graph):
        for v in node.inputs:
            if id(v) not in env and (v.producer is None or id(v.producer) not in inside):
                env[id(v)] = sub.add_input(v.name, v.example)
        args, kwargs = map_values((node.args, node.kwargs), lambda v: env[id(v)])
        example = pytree.tree_unflatten([v.example for v in node.outputs], node.out_structure)
        new = sub.add_node(node.name, node.op, node.target, tuple(args), dict(kwargs), example)
        for old, fresh in zip(node.outputs, new.outputs):
            env[id(old)] = fresh
    sub.outputs = [env[id(v)] for v in outputs]
    sub.validate()
    return sub


def fingerprint(graph: Graph) -> str:
    """A stable text of the graph's structure, shapes, strides, dtypes and constants: for cache keys."""
    index = {id(v): i for i, v in enumerate(graph.values())}

    def fmt(a: Any) -> str:
        if isinstance(a, Value):
            return f"%{index[id(a)]}"
        if isinstance(a, (list, tuple)):
            return "[" + ",".join(fmt(x) for x in a) + "]"
        return repr(a)

    parts = [";".join(f"{v.meta}s{v.meta.stride}" if v.meta else repr(v.example) for v in graph.inputs)]
    for n in graph.nodes:
        parts.append(f"{n.target_name}({fmt(n.args)},{fmt(sorted(n.kwargs.items()))})->"
                     + ",".join(str(v.meta) for v in n.outputs))
    parts.append("out:" + fmt(graph.outputs))
    return "\n".join(parts)


def connected_components(nodes: Sequence[Node]) -> list[list[Node]]:
    """``nodes`` grouped by data edges among themselves, each group in the given order."""
    parent = {id(n): id(n) for n in nodes}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for n in nodes:
        for v in n.inputs:
            if v.producer is not None and id(v.producer) in parent:
                parent[find(id(n))] = find(id(v.producer))
    groups: dict[int, list[Node]] = {}
    for n in nodes:
        groups.setdefault(find(id(n)), []).append(n)
    return list(groups.values())
