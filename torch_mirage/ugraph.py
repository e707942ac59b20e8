"""μGraph IR (Mirage §2): kernel graphs, block graphs, thread graphs, and the op table.

A μGraph is a :class:`KernelGraph` whose ops run on the whole GPU. An op is
either pre-defined (matmul, elementwise, reduction, ...) or graph-defined
(``customized``): its body is a :class:`BlockGraph` that one thread block runs.
A block graph has ``grid`` (up to 3 dims), a ``forloop_range``, one
``iterator`` per kernel input (``imap``: grid dim -> tensor dim or φ = None — the grid dim splits the tensor dim
evenly, or, where the grid dim is a multiple of it, consecutive programs share its elements: :func:`grid_split`;
``fmap``: the tensor dim the for-loop walks, or φ), for-loop accumulators
(``acc_sum``, ``acc_mean``, ``acc_max``, ``acc_rms``, ``acc_concat``,
``acc_online_softmax``) and one ``saver`` per output (``omap``: grid dim ->
output dim). Ops upstream of the accumulators form the for-loop body; ops
downstream run once after the loop. A block op ``thread`` holds a
:class:`ThreadGraph`: a fused elementwise chain kept in registers.

Tensors are named by Mirage's canonical index ``Ref(op, out)``: output ``out``
of op number ``op``. Every op records its output shapes and dtypes; ``OPS`` is
the table (arity, levels, shape rule, the ``Arith`` method that evaluates it)
that the builder, ``validate.py`` and ``executor.py`` all read.
"""
from __future__ import annotations

import hashlib
import heapq
import json
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar, NamedTuple

K, B, T = "kernel", "block", "thread"
HALF = {"float16", "bfloat16"}
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8, "bool": 1}


def nbytes(shape, dtype: str) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype`` (4 per element for a dtype not in ``ITEMSIZE``)."""
    return math.prod(shape) * ITEMSIZE.get(dtype, 4)


class MuGraphError(ValueError):
    """An op or graph that breaks Mirage's validity rules (Definition 2.1)."""


class Ref(NamedTuple):
    op: int
    out: int = 0


Shape = tuple


class Ctx(NamedTuple):
    """What a shape rule may read besides its inputs: the enclosing block
    graph's grid / for-loop, and the op's body graph."""
    grid: tuple = ()
    forloop_range: int = 1
    body: Any = None


# ------------------------------------------------------------------ shape rules
def _err(msg: str) -> MuGraphError:
    return MuGraphError(msg)


def _dim(shape: Shape, dim: int, what: str) -> int:
    if not -len(shape) <= dim < len(shape):
        raise _err(f"{what}: dim {dim} out of range for shape {tuple(shape)}")
    return dim % len(shape)


def broadcast(*shapes: Shape) -> Shape:
    """numpy broadcasting (right-aligned)."""
    rank = max(len(s) for s in shapes)
    out = []
    for i in range(rank):
        sizes = {s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0} - {1}
        if len(sizes) > 1:
            raise _err(f"shapes {[tuple(s) for s in shapes]} do not broadcast")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def _same(ins, at, ctx):
    return (tuple(ins[0]),)


def _bcast(ins, at, ctx):
    return (broadcast(*ins),)


def _reduce(ins, at, ctx):
    s = list(ins[0])
    s[_dim(s, at["dim"], "reduction")] = 1
    return (tuple(s),)


def _rms_norm(ins, at, ctx):
    if not ins[0]:
        raise _err("rms_norm needs a tensor of rank >= 1")
    return (tuple(ins[0]),)


def _matmul(ins, at, ctx):
    a, b = ins
    if len(a) < 2 or len(b) < 2:
        raise _err(f"matmul needs rank >= 2 operands, got {tuple(a)} and {tuple(b)}")
    if a[-1] != b[-2]:
        raise _err(f"matmul: inner dims differ: {tuple(a)} @ {tuple(b)}")
    return (broadcast(a[:-2], b[:-2]) + (a[-2], b[-1]),)


def _concat(ins, at, ctx):
    d = _dim(ins[0], at["dim"], "concat")
    for s in ins[1:]:
        if len(s) != len(ins[0]) or any(x != y for i, (x, y) in enumerate(zip(s, ins[0])) if i != d):
            raise _err(f"concat along dim {d}: shapes {[tuple(s) for s in ins]} differ off that dim")
    out = list(ins[0])
    out[d] = sum(s[d] for s in ins)
    return (tuple(out),)


def _slice(ins, at, ctx):
    s = list(ins[0])
    d = _dim(s, at["dim"], "slice")
    chunks, start, stop = at["chunks"], at["start"], at["stop"]
    if chunks < 1 or s[d] % chunks or not 0 <= start < stop <= chunks:
        raise _err(f"slice: chunks [{start}, {stop}) of {chunks} along dim {d} of {tuple(s)}")
    s[d] = s[d] // chunks * (stop - start)
    return (tuple(s),)


def _slice_chunks(x, dim, chunks, start, stop):
    size = x.shape[dim] // chunks
    return x.narrow(dim, start * size, (stop - start) * size)


def _rotate_half(ins, at, ctx):
    s, g = tuple(ins[0]), at["group"]
    if not s or g < 2 or g % 2 or s[-1] % g or len(at["signs"]) != 2 or any(x not in (1, -1) for x in at["signs"]):
        raise _err(f"rotate_half: last dim of {s} in groups of {g} (even), signs {at['signs']} (two of ±1)")
    return (s,)


def _transpose(ins, at, ctx):
    s = ins[0]
    if len(s) < 2:
        raise _err(f"transpose needs rank >= 2, got {tuple(s)}")
    return (tuple(s[:-2]) + (s[-1], s[-2]),)


def _reshape(ins, at, ctx):
    if math.prod(ins[0]) != math.prod(at["shape"]):
        raise _err(f"reshape {tuple(ins[0])} -> {tuple(at['shape'])}: element counts differ")
    return (tuple(at["shape"]),)


def _index_copy(ins, at, ctx):
    dst, index, src = (tuple(x) for x in ins)
    d = _dim(dst, at["dim"], "index_copy")
    if len(index) != 1 or len(src) != len(dst) or src[d] != index[0] or \
            any(a != b for i, (a, b) in enumerate(zip(src, dst)) if i != d):
        raise _err(f"index_copy along dim {d}: {src} rows into {dst} at {index} positions (the source must be the "
                   f"destination's shape with the positions' count along dim {d})")
    return (dst,)


def _input(ins, at, ctx):
    return (tuple(at["shape"]),)


def _mapped(m, ctx, what: str) -> tuple:
    if len(m) != len(ctx.grid):
        raise _err(f"{what} {tuple(m)} has {len(m)} entries, grid {ctx.grid} has {len(ctx.grid)} dims")
    return tuple(m)


def _one_to_one(m, what: str, target: str) -> None:
    """A grid map sends at most one grid dim to each tensor dim."""
    dims = [d for d in m if d is not None]
    if len(set(dims)) != len(dims):
        raise _err(f"{what} {tuple(m)} maps two grid dims to one {target} dim")


def grid_split(size: int, programs: int) -> tuple[int, int] | None:
    """How an iterator's grid dim of ``programs`` reads a tensor dim of ``size``: ``(programs per element, tile
    extent)``. Where ``programs`` divides ``size``, each program reads its own ``size / programs`` elements (1,
    extent); where ``size`` divides ``programs``, each element is read by ``programs / size`` consecutive programs
    (group, 1) — grouped-query attention with a program per query head reads KV head ``pid // group``, with no
    copy of K and V per query head. None where neither divides the other."""
    if size % programs == 0:
        return 1, size // programs
    if programs % size == 0:
        return programs // size, 1
    return None


def iterator_tile(full: Shape, imap, fmap, grid, forloop_range) -> Shape:
    """The tile one block loads per iteration: ``full`` split by ``grid`` along
    ``imap`` (:func:`grid_split`) and by ``forloop_range`` along ``fmap``."""
    tile = list(full)
    _one_to_one(imap, "imap", "tensor")
    for g, d in enumerate(imap):
        if d is None:
            continue
        _dim(tile, d, f"imap {tuple(imap)}")
        split = grid_split(tile[d], grid[g])
        if split is None:
            raise _err(f"imap: dim {d} of {tuple(full)} (size {tile[d]}) and grid dim {g} = {grid[g]}: neither "
                       f"divides the other")
        tile[d] = split[1]
    if fmap is not None:
        _dim(tile, fmap, f"fmap {fmap}")
        if tile[fmap] % forloop_range:
            raise _err(f"fmap: dim {fmap} of {tuple(full)} (block extent {tile[fmap]}) does not divide "
                       f"by forloop_range {forloop_range}")
        tile[fmap] //= forloop_range
    return tuple(tile)


def _iterator(ins, at, ctx):
    return (iterator_tile(at["shape"], _mapped(at["imap"], ctx, "imap"), at["fmap"], ctx.grid, ctx.forloop_range),)


def saver_shape(tile: Shape, omap, grid) -> Shape:
    """The kernel output a saver assembles: the tile scaled by ``grid`` along ``omap``."""
    out = list(tile)
    _one_to_one(omap, "omap", "output")
    for g, d in enumerate(omap):
        if d is None:
            if grid[g] > 1:
                raise _err(f"omap {tuple(omap)}: grid dim {g} (size {grid[g]}) maps to no output dim, "
                           "so its blocks would overwrite each other")
            continue
        out[_dim(out, d, f"omap {tuple(omap)}")] *= grid[g]
    return tuple(out)


def _saver(ins, at, ctx):
    saver_shape(ins[0], _mapped(at["omap"], ctx, "omap"), ctx.grid)
    return ()


def _acc(ins, at, ctx):
    if at.get("dim") is None:
        return (tuple(ins[0]),)
    return _reduce(ins, at, ctx)


def _acc_concat(ins, at, ctx):
    s = list(ins[0])
    s[_dim(s, at["dim"], "acc_concat")] *= ctx.forloop_range
    return (tuple(s),)


def _acc_online_softmax(ins, at, ctx):
    s, v = ins
    (o,) = _matmul([s, v], {}, ctx)
    stat = o[:-1] + (1,)
    return (stat, stat, o)


def _customized(ins, at, ctx):
    body = ctx.body
    if not isinstance(body, BlockGraph):
        raise _err("customized op needs a BlockGraph body")
    for op in body.ops:
        if op.name == "iterator":
            i = op.attrs["index"]
            if not 0 <= i < len(ins) or tuple(ins[i]) != tuple(op.attrs["shape"]):
                got = tuple(ins[i]) if 0 <= i < len(ins) else "nothing"
                raise _err(f"iterator {i} expects a kernel tensor of shape {tuple(op.attrs['shape'])}, got {got}")
    return tuple(saver_shape(body.shape(s.inputs[0]), s.attrs["omap"], body.grid) for s in body.savers)


def _thread(ins, at, ctx):
    body = ctx.body
    if not isinstance(body, ThreadGraph):
        raise _err("thread op needs a ThreadGraph body")
    for op in body.ops:
        if op.name == "input" and tuple(ins[op.attrs["index"]]) != tuple(op.attrs["shape"]):
            raise _err(f"thread graph input {op.attrs['index']} expects {tuple(op.attrs['shape'])}, "
                       f"got {tuple(ins[op.attrs['index']])}")
    return tuple(body.shape(r) for r in body.outputs)


# ------------------------------------------------------------------ dtype rules
def _dt_first(dts, at, ctx, n):
    return (dts[0],) * n


def _dt_second(dts, at, ctx, n):
    return (dts[1],) * n


def _dt_attr(dts, at, ctx, n):
    return (at["dtype"],) * n


def _dt_acc(dts, at, ctx, n):
    return tuple("float32" if d in HALF else d for d in (dts[0],) * n)


def _dt_saved(dts, at, ctx, n):
    return tuple(s.attrs["dtype"] for s in ctx.body.savers)


def _dt_body(dts, at, ctx, n):
    return tuple(ctx.body.dtype(r) for r in ctx.body.outputs)


# ------------------------------------------------------------------ the table
@dataclass(frozen=True)
class OpSpec:
    """One op of the μGraph vocabulary.

    ``arity`` None = variadic; ``kind``: io | elementwise | reduction | matmul |
    layout | accum | graph | update; ``arith``: the :class:`~.arith.Arith` method that
    evaluates it (attrs passed as keywords; accumulators call ``arith`` and
    ``arith + '_final'``); ``layout``: the arithmetic-free tensor function of a
    layout op (attrs as keywords); ``lax``: inside Mirage's LAX fragment."""
    name: str
    kind: str
    arity: int | None
    levels: frozenset
    shape: Callable
    arith: str | None = None
    attrs: tuple = ()
    dtype: Callable = _dt_first
    layout: Callable | None = None
    lax: bool = True


def _ew(name, arity, attrs=(), lax=True):
    return OpSpec(name, "elementwise", arity, frozenset({K, B, T}), _same if arity == 1 else _bcast,
                  name, attrs, lax=lax)


def _accum(name, shape=_acc, attrs=("dim",), arity=1, lax=True):
    return OpSpec(name, "accum", arity, frozenset({B}), shape, name, attrs, _dt_acc, lax=lax)


KB = frozenset({K, B})
OPS: dict[str, OpSpec] = {s.name: s for s in (
    OpSpec("input", "io", 0, frozenset({K, T}), _input, attrs=("index", "shape", "dtype"), dtype=_dt_attr),
    OpSpec("iterator", "io", 0, frozenset({B}), _iterator, attrs=("index", "shape", "dtype", "imap", "fmap"),
           dtype=_dt_attr),
    OpSpec("saver", "io", 1, frozenset({B}), _saver, attrs=("index", "omap", "dtype"), dtype=lambda *a: ()),
    *(_ew(n, 1) for n in ("exp", "sqrt", "rsqrt", "silu", "neg", "square")),
    _ew("tanh", 1, lax=False),
    _ew("scalar_mul", 1, ("value",)),
    _ew("scalar_add", 1, ("value",)),
    *(_ew(n, 2) for n in ("add", "sub", "mul", "div")),
    # ``where(keep, x, value)``: x where the bool ``keep`` holds, else the constant (a bool attention mask read
    # as it is, ``where(keep, scores, -inf)``); the value's dtype is x's
    OpSpec("where", "elementwise", 2, frozenset({K, B, T}), _bcast, "where", ("value",), _dt_second, lax=False),
    OpSpec("reduce_sum", "reduction", 1, KB, _reduce, "reduce_sum", ("dim",)),
    OpSpec("reduce_mean", "reduction", 1, KB, _reduce, "reduce_mean", ("dim",)),
    OpSpec("reduce_max", "reduction", 1, KB, _reduce, "reduce_max", ("dim",), lax=False),
    OpSpec("rms_norm", "reduction", 1, KB, _rms_norm, "rms_norm", ("eps",)),
    OpSpec("matmul", "matmul", 2, KB, _matmul, "matmul"),
    OpSpec("concat", "layout", None, KB, _concat, "concat", ("dim",)),
    OpSpec("transpose", "layout", 1, KB, _transpose, layout=lambda x: x.transpose(-1, -2)),
    OpSpec("slice", "layout", 1, frozenset({K}), _slice, attrs=("dim", "chunks", "start", "stop"),
           layout=_slice_chunks),
    OpSpec("rotate_half", "layout", 1, KB, _rotate_half, "rotate_half", ("group", "signs")),
    OpSpec("reshape", "layout", 1, frozenset({K}), _reshape, attrs=("shape",),
           layout=lambda x, shape: x.reshape(shape)),
    # an indexed update: the destination (a kernel input) with its rows at the positions (an int input) replaced by
    # the source's, as ``Tensor.index_copy`` (a static KV cache's write; see superopt.updates)
    OpSpec("index_copy", "update", 3, frozenset({K}), _index_copy, "index_copy", ("dim",), lax=False),
    OpSpec("customized", "graph", None, frozenset({K}), _customized, dtype=_dt_saved),
    OpSpec("thread", "graph", None, frozenset({B}), _thread, dtype=_dt_body),
    _accum("acc_sum"),
    _accum("acc_mean"),
    _accum("acc_max", lax=False),
    _accum("acc_rms", attrs=("dim", "eps")),
    _accum("acc_concat", _acc_concat),
    _accum("acc_online_softmax", _acc_online_softmax, attrs=(), arity=2, lax=False),
)}


def spec(name: str) -> OpSpec:
    try:
        return OPS[name]
    except KeyError:
        raise MuGraphError(f"unknown μGraph op {name!r}; known: {sorted(OPS)}") from None


# ------------------------------------------------------------------ IR
def _freeze(v):
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    return v


class Attrs(dict):
    """Op attributes: a dict whose values are ints, floats, strs, None or tuples."""

    def __hash__(self):  # ops are frozen dataclasses
        return hash(tuple(sorted(self.items(), key=lambda kv: kv[0])))


@dataclass(frozen=True)
class Op:
    name: str
    inputs: tuple = ()
    attrs: Attrs = field(default_factory=Attrs)
    shapes: tuple = ()
    dtypes: tuple = ()
    body: "Graph | None" = None

    @property
    def spec(self) -> OpSpec:
        return spec(self.name)

    def infer(self, in_shapes, in_dtypes, ctx: Ctx) -> tuple[tuple, tuple]:
        """(shapes, dtypes) of the outputs by the op table; raises MuGraphError."""
        s = self.spec
        try:
            shapes = tuple(tuple(x) for x in s.shape([tuple(x) for x in in_shapes], self.attrs, ctx))
        except MuGraphError as e:
            raise MuGraphError(f"op {self.name}{_fmt_attrs(self.attrs)} on inputs "
                               f"{[tuple(x) for x in in_shapes]} {list(in_dtypes)}: {e}") from None
        return shapes, tuple(s.dtype(list(in_dtypes), self.attrs, ctx, len(shapes)))


def make_op(name, inputs, in_shapes, in_dtypes, attrs=None, body=None, ctx: Ctx = Ctx()) -> Op:
    """A new op with its output shapes and dtypes inferred from the table."""
    s = spec(name)
    attrs = Attrs({k: _freeze(v) for k, v in (attrs or {}).items()})
    if isinstance(attrs.get("dim"), int) and in_shapes and -len(in_shapes[0]) <= attrs["dim"] < 0:
        attrs["dim"] %= len(in_shapes[0])     # canonical: non-negative dims
    unknown = set(attrs) - set(s.attrs)
    if unknown:
        raise MuGraphError(f"op {name}: unknown attributes {sorted(unknown)} (allowed: {list(s.attrs)})")
    if s.arity is not None and len(inputs) != s.arity:
        raise MuGraphError(f"op {name} takes {s.arity} inputs, got {len(inputs)}")
    op = Op(name, tuple(Ref(*r) for r in inputs), attrs, body=body)
    # the context as it is where it already has this body (most ops: none): in the warm H100 profile of 12-07 g
    # this ``_replace`` took 0.37 s of own time over 2337 calls (1 µs a call on the CPU)
    shapes, dtypes = op.infer(in_shapes, in_dtypes, ctx if ctx.body is body else ctx._replace(body=body))
    return replace(op, shapes=shapes, dtypes=dtypes)


@dataclass(frozen=True)
class Graph:
    """Ops in topological order; ``outputs`` are the graph's results (block
    graphs have savers instead)."""
    level: ClassVar[str] = ""
    ops: tuple = ()
    outputs: tuple = ()

    # -- access
    def shape(self, r: Ref) -> tuple:
        return self.ops[r[0]].shapes[r[1]]

    def dtype(self, r: Ref) -> str:
        return self.ops[r[0]].dtypes[r[1]]

    def ctx(self, body=None) -> Ctx:
        return Ctx(body=body)

    def named(self, name: str) -> list[tuple[int, Op]]:
        return [(i, op) for i, op in enumerate(self.ops) if op.name == name]

    def ancestors(self, roots) -> set[int]:
        """Indices of the ops ``roots`` (op indices) depend on, themselves included."""
        seen: set[int] = set()
        stack = list(roots)
        while stack:
            i = stack.pop()
            if i not in seen:
                seen.add(i)
                stack.extend(r[0] for r in self.ops[i].inputs)
        return seen

    def consumers(self) -> dict[Ref, list[int]]:
        out: dict[Ref, list[int]] = {}
        for i, op in enumerate(self.ops):
            for r in op.inputs:
                out.setdefault(Ref(*r), []).append(i)
        return out

    def header(self) -> dict:
        return {"level": self.level}

    # -- canonical form, JSON, hash
    def canonical(self) -> "Graph":
        """The same graph with ops in Mirage's canonical order: a topological
        order that always takes the ready op of least rank (its inputs'
        canonical indices, its type, its attributes, its body)."""
        n = len(self.ops)
        bodies = [op.body.canonical() if op.body is not None else None for op in self.ops]
        deps = [{r[0] for r in op.inputs} for op in self.ops]
        users: dict[int, list[int]] = {}
        for i, d in enumerate(deps):
            for j in d:
                users.setdefault(j, []).append(i)
        new: dict[int, int] = {}

        def rank(i):
            op = self.ops[i]
            return (tuple((new[r[0]], r[1]) for r in op.inputs), op.name, op.attrs.get("index", -1),
                    _dumps(_attrs_json(op.attrs)), bodies[i].hash() if bodies[i] is not None else "", i)

        waiting = [len(d) for d in deps]
        ready = [rank(i) for i in range(n) if not waiting[i]]
        heapq.heapify(ready)
        order = []
        while ready:
            i = heapq.heappop(ready)[-1]
            new[i] = len(order)
            order.append(i)
            for u in users.get(i, ()):
                waiting[u] -= 1
                if not waiting[u]:
                    heapq.heappush(ready, rank(u))
        if len(order) != n:
            raise MuGraphError(f"{type(self).__name__} has a cycle or a dangling input")
        ops = tuple(replace(self.ops[i], inputs=tuple(Ref(new[r[0]], r[1]) for r in self.ops[i].inputs),
                            body=bodies[i]) for i in order)
        return replace(self, ops=ops, outputs=tuple(Ref(new[r[0]], r[1]) for r in self.outputs))

    def to_dict(self) -> dict:
        return {**self.header(), "outputs": [list(r) for r in self.outputs], "ops": [_op_dict(op) for op in self.ops]}

    def to_json(self) -> str:
        """Canonical JSON: ops in canonical order, sorted keys, no whitespace."""
        return _dumps(self.canonical().to_dict())

    def hash(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def __str__(self) -> str:
        return "\n".join(self._lines(""))

    def _lines(self, pad: str) -> list[str]:
        head = " ".join(f"{k}={v}" for k, v in self.header().items() if k != "level")
        lines = [f"{pad}{type(self).__name__} {head}".rstrip()]
        for i, op in enumerate(self.ops):
            lhs = ", ".join(_tname(i, j, len(op.shapes)) for j in range(len(op.shapes)))
            types = ", ".join(f"{d}{list(s)}" for s, d in zip(op.shapes, op.dtypes))
            args = ", ".join(_tname(r[0], r[1], len(self.ops[r[0]].shapes)) for r in op.inputs)
            lines.append(f"{pad}  {lhs + ' = ' if lhs else ''}{op.name}({args}){_fmt_attrs(op.attrs, op.name)}"
                         f"{' : ' + types if types else ''}")
            if op.body is not None:
                lines += op.body._lines(pad + "    ")
        if self.outputs:
            lines.append(f"{pad}  return " + ", ".join(_tname(r[0], r[1], len(self.ops[r[0]].shapes))
                                                       for r in self.outputs))
        return lines


@dataclass(frozen=True)
class KernelGraph(Graph):
    level: ClassVar[str] = K

    @property
    def inputs(self) -> list[Op]:
        return sorted((op for op in self.ops if op.name == "input"), key=lambda op: op.attrs["index"])


@dataclass(frozen=True)
class BlockGraph(Graph):
    level: ClassVar[str] = B
    grid: tuple = (1,)
    forloop_range: int = 1
    # a band of the for-loop range per block (see :func:`band_range`); None: every block runs the whole loop
    forloop_band: tuple | None = None
    # the input (index) of a coarse table of the loop's mask — each entry the max of one tile of it — that a
    # program may read before its loop to walk only the key tiles one of its rows sees (codegen's mask scan);
    # None: none. The math never reads it
    forloop_scan: int | None = None

    def ctx(self, body=None) -> Ctx:
        return Ctx(tuple(self.grid), self.forloop_range, body)

    def header(self) -> dict:
        h = {"level": self.level, "grid": list(self.grid), "forloop_range": self.forloop_range}
        if self.forloop_band is not None:       # absent when unused: canonical JSON / hashes stay as they were
            h["forloop_band"] = list(self.forloop_band)
        if self.forloop_scan is not None:
            h["forloop_scan"] = self.forloop_scan
        return h

    @property
    def savers(self) -> list[Op]:
        return sorted((op for op in self.ops if op.name == "saver"), key=lambda op: op.attrs["index"])

    @property
    def iterators(self) -> list[Op]:
        return sorted((op for op in self.ops if op.name == "iterator"), key=lambda op: op.attrs["index"])

    def accum_counts(self) -> list[list[frozenset]]:
        """For each op output, the set of accumulator counts over all paths from
        the iterators to it (capped at 2). 0 = for-loop body, 1 = after the loop."""
        counts: list[list[frozenset]] = []
        for op in self.ops:
            seen = frozenset().union(*(counts[r[0]][r[1]] for r in op.inputs)) if op.inputs else frozenset({0})
            if op.spec.kind == "accum":
                seen = frozenset(min(c + 1, 2) for c in seen)
            counts.append([seen] * max(1, len(op.shapes)))
        return counts

    def phases(self) -> tuple[list[int], list[int]]:
        """Op indices of the for-loop body (iterators, body ops, accumulators)
        and of the epilogue after the loop (savers included)."""
        counts = self.accum_counts()
        body = [i for i, op in enumerate(self.ops) if op.spec.kind == "accum" or counts[i][0] == {0}]
        return body, [i for i in range(len(self.ops)) if i not in set(body)]


BAND_FIELDS = ("q_input", "q_dim", "k_input", "period", "offset", "window", "zero_input", "index_mask")
MASK_FLOOR = -1e30        # a masked score the kernels add: finite, so an all-masked tile keeps exp(s - m) defined


def band_geometry(bg: BlockGraph) -> dict:
    """What the for-loop band ``bg.forloop_band = (q_input, q_dim, k_input, period, offset, window)`` reads
    off the block graph: the query rows of a block are the tile of iterator ``q_input`` along ``q_dim`` (its
    start, from the grid dims that map to ``q_dim``); a row's query position is its index modulo ``period``
    (queries of several heads packed into rows); the keys of iteration ``it`` are the tile of iterator
    ``k_input`` along its ``fmap`` dim. Key ``k`` is visible from query ``p`` iff ``k <= p + offset`` and, with a
    ``window``, ``k > p + offset - window``. ``zero_input`` (or None): an iterator (walked by the loop) whose
    tiles are all 0 where every row of the block sees every key of the tile (an additive mask's visible part):
    those tiles are not loaded. ``index_mask`` (optional 8th field, default False): ``zero_input`` is exactly the
    band's own mask — 0 where visible, masked elsewhere — so it is never loaded: the partly seen tiles compute it
    from the indices (:func:`band_mask_dims`), and the kernel input may be any tensor of its shape (a broadcast
    stand-in). Raises MuGraphError when the band does not fit the graph."""
    if len(bg.forloop_band) not in (len(BAND_FIELDS) - 1, len(BAND_FIELDS)):
        raise MuGraphError(f"forloop_band {bg.forloop_band}: need {BAND_FIELDS}")
    b = dict(zip(BAND_FIELDS, bg.forloop_band))
    b["index_mask"] = bool(b.get("index_mask", False))
    if b["index_mask"] and b["zero_input"] is None:
        raise MuGraphError(f"forloop_band {bg.forloop_band}: index_mask needs the mask's zero_input")
    its = {op.attrs["index"]: op for op in bg.ops if op.name == "iterator"}
    q, k = its.get(b["q_input"]), its.get(b["k_input"])
    if q is None or k is None or k.attrs["fmap"] is None or q.attrs["fmap"] == b["q_dim"]:
        raise MuGraphError(f"forloop_band {bg.forloop_band}: needs a query iterator not walked by the loop "
                           "along q_dim and a key iterator walked by it")
    z = b["zero_input"]
    if z is not None and (z not in its or its[z].attrs["fmap"] is None):
        raise MuGraphError(f"forloop_band {bg.forloop_band}: zero_input {z} is no iterator walked by the loop")
    if b["period"] < 1 or (b["window"] is not None and b["window"] < 1):
        raise MuGraphError(f"forloop_band {bg.forloop_band}: period and window must be >= 1")
    qd, kd = b["q_dim"], k.attrs["fmap"]
    b.update(
        q_rows=q.shapes[0][qd],
        q_starts=[(g, q.attrs["shape"][qd] // bg.grid[g]) for g, m in enumerate(q.attrs["imap"]) if m == qd],
        k_tile=k.shapes[0][kd],
        k_starts=[(g, k.attrs["shape"][kd] // bg.grid[g]) for g, m in enumerate(k.attrs["imap"]) if m == kd])
    return b


def _band_rows(b: dict, block: tuple) -> tuple[int, int, int]:
    """(first, last query position, first key) of block ``block`` under band geometry ``b``."""
    start = sum(block[g] * e for g, e in b["q_starts"])
    rows, period = b["q_rows"], b["period"]
    p0, p1 = ((start % period, start % period + rows - 1) if period % rows == 0 else (0, period - 1))
    return p0, p1, sum(block[g] * e for g, e in b["k_starts"])


def band_full(bg: BlockGraph, block: tuple, it: int) -> bool:
    """Whether every query row of block ``block`` sees every key of iteration ``it``'s tile (the band's
    ``zero_input`` tile is 0 there and is not loaded)."""
    b = band_geometry(bg)
    p0, p1, kb = _band_rows(b, block)
    k0 = kb + it * b["k_tile"]
    k1 = k0 + b["k_tile"] - 1
    return k1 <= p0 + b["offset"] and (b["window"] is None or k0 >= p1 + b["offset"] - b["window"] + 1)


def band_mask_dims(bg: BlockGraph, it: Op) -> tuple[int, int]:
    """(position dim, key dim) of the band's ``index_mask`` iterator ``it``: its tile has two dims of extent > 1,
    the one the for-loop walks holds the band's keys, the other its query positions (both as in
    :func:`band_geometry`: the roles swap in a loop over queries, FlashTensor's column sums); a tile of one
    position (one query row a program) or one key a step: the dims of the tensor's own shape; a mask of one query
    position in all (decode, keys last): the dim before the keys."""
    kd = it.attrs["fmap"]
    rest = [d for d, e in enumerate(it.shapes[0]) if e > 1 and d != kd]
    if len(rest) != 1:      # a tile of one position (one row a program): the tensor's other dim of extent > 1
        rest = [d for d, e in enumerate(it.attrs["shape"]) if e > 1 and d != kd]
    rank = len(it.attrs["shape"])
    if not rest and kd is not None and rank >= 2 and kd == rank - 1:
        rest = [rank - 2]   # one query position in all (a decode step): its row dim, of extent 1, index 0
    if kd is None or len(rest) != 1:
        raise MuGraphError(f"forloop_band {bg.forloop_band}: the index mask's tile {it.shapes[0]} needs one "
                           "walked key dim and one position dim")
    return rest[0], kd


def band_range(bg: BlockGraph, block: tuple, lo: int = 0, hi: int | None = None) -> tuple[int, int]:
    """The iterations ``[lo, hi)`` of the for-loop that block ``block`` runs: those whose key tile holds a key
    visible from one of the block's query rows (the others are entirely masked and never visited). The Triton
    codegen emits the same arithmetic (``ugraph_triton._band_bounds``); an empty range leaves the block's
    accumulators at their identities (online softmax: m = -inf, l = 0, o = 0)."""
    hi = bg.forloop_range if hi is None else hi
    if bg.forloop_band is None:
        return lo, hi
    b = band_geometry(bg)
    t = b["k_tile"]
    p0, p1, kb = _band_rows(b, block)
    hi = min(hi, max(p1 + b["offset"] - kb + t, 0) // t)
    if b["window"] is not None:
        lo = max(lo, max(p0 + b["offset"] - b["window"] + 1 - kb, 0) // t)
    return lo, hi


@dataclass(frozen=True)
class ThreadGraph(Graph):
    level: ClassVar[str] = T


LEVEL_CLASSES = {K: KernelGraph, B: BlockGraph, T: ThreadGraph}


def _tname(i: int, j: int, n: int) -> str:
    return f"%{i}" if n == 1 else f"%{i}.{j}"


def _fmt_val(v) -> str:
    if isinstance(v, tuple):
        return "(" + ", ".join("φ" if x is None else _fmt_val(x) for x in v) + ("," if len(v) == 1 else "") + ")"
    return "φ" if v is None else repr(v)


_GRID = "xyz"


def _fmt_attrs(attrs, name: str = "") -> str:
    """Attributes for printing: maps as {x:dim, y:φ}, the kernel tensor's dtype and
    an io op's own shape left to the type column, absent options dropped."""
    hide = {"dtype", "shape"} if name == "input" else {"dtype"} if name in ("iterator", "saver") else set()
    parts = []
    for k, v in sorted(attrs.items()):
        if k in hide or v is None and k not in ("fmap",):
            continue
        if k in ("imap", "omap"):
            v = "{" + ", ".join(f"{_GRID[g]}:{'φ' if d is None else d}" for g, d in enumerate(v)) + "}"
        else:
            v = _fmt_val(v)
        parts.append(f"{k}={v}")
    return "[" + ", ".join(parts) + "]" if parts else ""


def _attrs_json(attrs) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in attrs.items()}


def _dumps(obj) -> str:
    # infinities are attrs (a bool mask's ``where`` fill, -inf), written as JSON's common -Infinity extension
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=True)


def _op_dict(op: Op) -> dict:
    d = {"name": op.name, "inputs": [list(r) for r in op.inputs], "attrs": _attrs_json(op.attrs),
         "shapes": [list(s) for s in op.shapes], "dtypes": list(op.dtypes)}
    if op.body is not None:
        d["body"] = op.body.to_dict()
    return d


def from_dict(d: dict) -> Graph:
    cls = LEVEL_CLASSES[d["level"]]
    ops = tuple(Op(o["name"], tuple(Ref(*r) for r in o["inputs"]),
                   Attrs({k: _freeze(v) for k, v in o["attrs"].items()}),
                   tuple(tuple(s) for s in o["shapes"]), tuple(o["dtypes"]),
                   from_dict(o["body"]) if "body" in o else None) for o in d["ops"])
    extra = {"grid": tuple(d["grid"]), "forloop_range": d["forloop_range"]} if cls is BlockGraph else {}
    if cls is BlockGraph and d.get("forloop_band") is not None:
        extra["forloop_band"] = tuple(d["forloop_band"])
    if cls is BlockGraph and d.get("forloop_scan") is not None:
        extra["forloop_scan"] = int(d["forloop_scan"])
    return cls(ops=ops, outputs=tuple(Ref(*r) for r in d["outputs"]), **extra)


def from_json(text: str) -> Graph:
    """Inverse of :meth:`Graph.to_json` (shapes are kept as stored; ``validate`` re-checks them)."""
    return from_dict(json.loads(text))
