"""Builder API for μGraphs, after the reference implementation's
``new_kernel_graph`` / ``new_threadblock_graph``::

    g = new_kernel_graph()
    X = g.new_input((m, k), "float32"); W = g.new_input((k, n), "float32")
    tb = new_threadblock_graph(grid_dim=(n // 64,), forloop_range=k // 64)
    tX = tb.new_input(X, imap=(None,), fmap=1)      # None (or -1) = φ, replicated
    tW = tb.new_input(W, imap=(1,), fmap=0)
    acc = tb.forloop_accum(tb.matmul(tX, tW), "sum")
    tb.new_output(acc, omap=(1,))
    (Y,) = g.customized([X, W], tb)
    g.mark_output(Y)
    graph = g.build()                                # canonical KernelGraph

Every op of the table (``ugraph.OPS``) that the graph's level allows is a
method: ``tb.exp(t)``, ``tb.div(a, b)``, ``tb.reduce_sum(t, dim=1)``,
``g.concat([a, b], dim=0)`` ... Shapes are inferred as ops are added, so an
op with mismatched shapes raises :class:`~torch_mirage.ugraph.MuGraphError` at once.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from ..ugraph import (OPS, B, K, T, Attrs, BlockGraph, Ctx, KernelGraph, MuGraphError, Op, Ref, ThreadGraph,
                      make_op, spec)


@dataclass(frozen=True)
class Tensor:
    """A handle on one tensor of a graph under construction."""
    owner: "_Builder"
    ref: Ref
    shape: tuple
    dtype: str

    def __repr__(self) -> str:
        return f"Tensor(%{self.ref.op}.{self.ref.out}, {self.dtype}{list(self.shape)})"


def _phi(m):
    return None if m is None or m == -1 else m


class _Builder:
    level = ""

    def __init__(self) -> None:
        self.ops: list[Op] = []

    def _ctx(self) -> Ctx:
        return Ctx()

    def add_op(self, name: str, inputs: Sequence[Tensor] = (), body=None, **attrs) -> list[Tensor]:
        s = spec(name)
        if self.level not in s.levels:
            raise MuGraphError(f"op {name} is not allowed in a {self.level} graph (levels: {sorted(s.levels)})")
        for t in inputs:
            if t.owner is not self:
                raise MuGraphError(f"op {name}: input {t} belongs to another graph")
        op = make_op(name, [t.ref for t in inputs], [t.shape for t in inputs], [t.dtype for t in inputs],
                     attrs, body, self._ctx())
        self.ops.append(op)
        i = len(self.ops) - 1
        return [Tensor(self, Ref(i, j), s_, d) for j, (s_, d) in enumerate(zip(op.shapes, op.dtypes))]

    def __getattr__(self, name: str):
        if name.startswith("_") or name not in OPS:
            raise AttributeError(f"{type(self).__name__} has no method or μGraph op {name!r}")
        s = OPS[name]
        if s.arity is None:
            return lambda xs, **attrs: self._one(name, list(xs), attrs)
        return lambda *xs, **attrs: self._one(name, list(xs), attrs)

    def _one(self, name, xs, attrs):
        outs = self.add_op(name, xs, **attrs)
        return outs[0] if len(outs) == 1 else outs


class KernelBuilder(_Builder):
    level = K

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[Ref] = []
        self.n_inputs = 0

    def new_input(self, dims: Sequence[int], dtype: str = "float16") -> Tensor:
        (t,) = self.add_op("input", index=self.n_inputs, shape=tuple(dims), dtype=dtype)
        self.n_inputs += 1
        return t

    def customized(self, inputs: Sequence[Tensor], tb: "BlockBuilder") -> list[Tensor]:
        """A graph-defined kernel op running ``tb`` on ``inputs`` (in the order
        the block graph's ``new_input`` calls were given their tensors)."""
        body = tb.build(list(inputs))
        return self.add_op("customized", list(inputs), body=body)

    def mark_output(self, t: Tensor) -> None:
        self.outputs.append(t.ref)

    def build(self) -> KernelGraph:
        return KernelGraph(ops=tuple(self.ops), outputs=tuple(self.outputs)).canonical()


class BlockBuilder(_Builder):
    level = B

    def __init__(self, grid_dim: Sequence[int], forloop_range: int = 1) -> None:
        super().__init__()
        grid = tuple(int(g) for g in grid_dim)
        if not 1 <= len(grid) <= 3 or min(grid) < 1:
            raise MuGraphError(f"grid_dim {tuple(grid_dim)}: need 1 to 3 positive dims")
        if forloop_range < 1:
            raise MuGraphError(f"forloop_range {forloop_range} must be >= 1")
        self.grid, self.forloop_range = grid, int(forloop_range)
        self.sources: list[Tensor] = []   # kernel tensors, by iterator index
        self.n_out = 0

    def _ctx(self) -> Ctx:
        return Ctx(self.grid, self.forloop_range)

    def _map(self, m) -> tuple:
        return tuple(_phi(x) for x in m)

    def new_input(self, dtensor: Tensor, imap: Sequence, fmap: int | None = None) -> Tensor:
        """An input iterator over kernel tensor ``dtensor``."""
        self.sources.append(dtensor)
        (t,) = self.add_op("iterator", index=len(self.sources) - 1, shape=dtensor.shape, dtype=dtensor.dtype,
                        imap=self._map(imap), fmap=_phi(fmap))
        return t

    def forloop_accum(self, t: Tensor, kind: str = "sum", dim: int | None = None, **attrs) -> Tensor:
        """A for-loop accumulator: ``kind`` in sum, mean, max, rms, concat;
        ``dim`` reduces that tile dim inside each iteration (concat: the dim the
        iterations are concatenated along)."""
        return self._one("acc_" + kind, [t], {"dim": dim, **attrs})

    def forloop_accum_online_softmax(self, scores: Tensor, values: Tensor) -> list[Tensor]:
        """The rescaling accumulator of online softmax: returns ``(m, l, o)``."""
        return self.add_op("acc_online_softmax", [scores, values])

    def new_output(self, t: Tensor, omap: Sequence, dtype: str | None = None) -> None:
        """An output saver; ``dtype`` of the kernel output defaults to the first input's."""
        dtype = dtype or (self.sources[0].dtype if self.sources else t.dtype)
        self.add_op("saver", [t], index=self.n_out, omap=self._map(omap), dtype=dtype)
        self.n_out += 1

    def build(self, inputs: Sequence[Tensor] | None = None) -> BlockGraph:
        if inputs is not None:
            ids = [id(x) for x in inputs]
            order = [ids.index(id(s)) if id(s) in ids else None for s in self.sources]
            if None in order:
                raise MuGraphError("customized: a block-graph input iterates a tensor not passed as input")
            self.ops = [op if op.name != "iterator" else
                        _with_index(op, order[op.attrs["index"]]) for op in self.ops]
        return BlockGraph(ops=tuple(self.ops), grid=self.grid, forloop_range=self.forloop_range,
                          forloop_band=getattr(self, "forloop_band", None),
                          forloop_scan=getattr(self, "forloop_scan", None))


def _with_index(op: Op, index: int) -> Op:
    return replace(op, attrs=Attrs({**op.attrs, "index": index}))


class ThreadBuilder(_Builder):
    level = T

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[Ref] = []

    def new_input(self, shape: Sequence[int], dtype: str) -> Tensor:
        (t,) = self.add_op("input", index=sum(op.name == "input" for op in self.ops), shape=tuple(shape), dtype=dtype)
        return t

    def mark_output(self, t: Tensor) -> None:
        self.outputs.append(t.ref)

    def build(self) -> ThreadGraph:
        return ThreadGraph(ops=tuple(self.ops), outputs=tuple(self.outputs))


def new_kernel_graph() -> KernelBuilder:
    return KernelBuilder()


def new_threadblock_graph(grid_dim: Sequence[int], forloop_range: int = 1) -> BlockBuilder:
    return BlockBuilder(grid_dim, forloop_range)


def new_thread_graph() -> ThreadBuilder:
    return ThreadBuilder()


# ------------------------------------------------------------ thread graphs
def fuse_thread_graphs(graph: KernelGraph) -> KernelGraph:
    """Mirage's rule-based thread-graph construction: in every block graph,
    each maximal tree of elementwise ops whose inner results have a single
    consumer (in the same loop phase) becomes one ``thread`` op, so those
    intermediates live in registers instead of shared memory."""
    ops = tuple(replace(op, body=_fuse_block(op.body)) if op.name == "customized" else op for op in graph.ops)
    return replace(graph, ops=ops).canonical()


def _fuse_block(bg: BlockGraph) -> BlockGraph:
    ew = [op.spec.kind == "elementwise" for op in bg.ops]
    counts, users = bg.accum_counts(), bg.consumers()
    root = list(range(len(bg.ops)))   # union-find: each op's group root (the group's last op)
    for i, op in enumerate(bg.ops):
        if not ew[i]:
            continue
        for r in op.inputs:
            j = r[0]
            if ew[j] and counts[j] == counts[i] and users.get(Ref(j, 0)) == [i] and j != i:
                for k in range(len(root)):
                    if root[k] == root[j]:
                        root[k] = i
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(root):
        groups.setdefault(r, []).append(i)
    b = BlockBuilder(bg.grid, bg.forloop_range)
    new: dict[Ref, Tensor] = {}
    for i, op in enumerate(bg.ops):
        members = groups.get(i, [])
        if root[i] != i:
            continue   # emitted with its group's root
        if len(members) < 2:
            outs = b.add_op(op.name, [new[r] for r in op.inputs], body=op.body, **op.attrs)
        else:
            body, ext = _thread_body(bg, members)
            outs = b.add_op("thread", [new[r] for r in ext], body=body)
        for j, t in enumerate(outs):
            new[Ref(i, j)] = t
    return replace(bg, ops=tuple(b.ops))


def _thread_body(bg: BlockGraph, members: list[int]) -> tuple[ThreadGraph, list[Ref]]:
    inside = set(members)
    ext: list[Ref] = []
    for i in members:
        for r in bg.ops[i].inputs:
            if r[0] not in inside and Ref(*r) not in ext:
                ext.append(Ref(*r))
    tb = ThreadBuilder()
    env = {r: tb.new_input(bg.shape(r), bg.dtype(r)) for r in ext}
    for i in members:
        op = bg.ops[i]
        (env[Ref(i, 0)],) = tb.add_op(op.name, [env[Ref(*r)] for r in op.inputs], **op.attrs)
    tb.mark_output(env[Ref(members[-1], 0)])
    return tb.build(), ext
