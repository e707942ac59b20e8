"""The weight-streaming seed of a matmul region: a μGraph read off the region's reference program.

A region's reference (:func:`.search.reference.reference_of`: pre-defined kernel ops) qualifies when every matmul
reads the same activation rows ``A`` (m, k) against a weight of its own, stored (k, n) or as ``nn.Linear``'s (n, k)
behind a ``transpose``, and

* ``A`` is a product (and quotient) of *tile factors* — elementwise functions of row tensors (m, k) and column
  vectors (k,) — and *row scales* (m, 1): elementwise functions of row reductions (sum / mean over k) of tile
  expressions. An RMSNorm ``x · rsqrt(mean(x²) + eps) · g`` is the tile factors ``x``, ``g`` and the row scale
  ``rsqrt(mean(x²) + eps)``;
* the ops after the matmuls are elementwise over their results (m, n), row tensors (m, n) and column vectors (n,):
  a residual add, a bias, SiLU·mul of a gated MLP; each output is computed from matmuls of one width n. A
  matmul whose result is only read in slices along n (a fused QKV projection split into q, k and v; a fused
  gate-up projection chunked in two) is that many matmuls, each against the matching slice of the weight
  (``(A·W)[:, a:b] = A·W[:, a:b]``, :func:`streams`): phi-3's ``gate, up = gate_up_proj(x).chunk(2, -1)`` then
  streams as a gated MLP does, and its q, k and v as a QKV projection;
* or RoPE's rotation of a result viewed as heads (b, h, 1, d): a ``concat`` of the two halves of each head of one
  value swapped, one or both negated (:func:`rotation`, read off the cat / neg / slice structure: HF's
  ``rotate_half``, or slices stacked and flattened), with tensors the same for every head (cos, sin: (m, d) or
  (d,)). Such a width's block graph holds one head per block, so the rotation is a permutation inside the tile
  (the ``rotate_half`` block op); or, with ``halves``, matching slices of both halves of a head
  (:class:`_HalvesBlock`), so that launches need not keep a whole head per block.

The seed (Mirage's RMSNorm + Linear, generalised) has one block graph per matmul width (a QKV projection: two or
three, each recomputing the row scales): grid over n, for-loop over k. In the loop the tile factors' product meets
each weight tile in a ``tl.dot`` accumulator and each row reduction accumulates its tile sums (codegen walks these
matmul-free sums in a loop of their own, :func:`~..codegen.ugraph_triton.prologue_accumulators`); after the loop
the row scales multiply the accumulators (a row scale commutes with the matmul: ``(s·A)·W = s·(A·W)``) and the
epilogue runs on the (m, n) tile. An activation of several terms (a LayerNorm, :func:`_terms`) reads its rows less
their first column (``LN(x − c) = LN(x)``): its terms cancel, and unshifted rows far from 0 lost eager's
precision. An input the epilogue reads reaches it through a mean accumulator of its loop-invariant tile (a
block graph's post-loop ops read accumulators only); an input read in two roles (``x + linear(norm(x), w)``: rows
in the loop, residual after it) through a second view. Leading dims fold into the rows (kernel reshapes). With
``gains_on_weights`` the vector factors (an RMSNorm's gain ``g``) scale the weight tile instead of the rows
(``(x·g)·W = x·(g·W)``, a column of ``g`` against each weight tile): the rows reach the matmul as loaded, and the
weight tile takes the multiply. Verified like the default form, it is not claimed: on the
H100 (11-25, RMSNorm + Linear 2 and 16 x 4096 x 4096 bf16, tuned) it ran 17.9 µs against the default form's 16.7;
``benchmarks/ugraph_config_sweep.py --seed --gain-on-weights`` times it. Launches — one-wave stream, split-K,
split-N — are :func:`.launch.streaming_candidates`.
A form outside these rules raises :class:`NotStreamable` naming the op; the seed is only a candidate: the claimer
verifies it against the reference (a large one shrunk, :func:`.search.shrink.shrink`) before it runs.
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Callable, NamedTuple

from ..ugraph import KernelGraph, Ref
from .builder import Tensor, new_kernel_graph, new_threadblock_graph
from .library import PHI, blocks

ELEMENTWISE = frozenset({"add", "sub", "mul", "div", "exp", "sqrt", "rsqrt", "silu", "neg", "square", "tanh",
                         "scalar_mul", "scalar_add"})
ROW_REDUCTIONS = frozenset({"reduce_sum", "reduce_mean"})
IN_LOOP = frozenset({"first_k"})   # loop-invariant roles read inside the loop (not through an accumulator)
MIN_TILE = 16        # a loop / grid tile below this (a prime extent) holds the whole extent instead
WHOLE_EXTENT = 1024  # the largest extent one tile may hold whole


class NotStreamable(ValueError):
    """The reference is not a weight-streaming matmul region (the message names the op and why)."""


def _parts(extent: int, tile: int) -> int:
    """Equal parts of ``extent`` of at most ``tile`` each; one part (the whole extent, masked) where the only
    such parts are tiny (a prime extent) and the extent fits one tile."""
    parts = blocks(extent, tile)
    if extent // parts < MIN_TILE and extent <= WHOLE_EXTENT:
        return 1
    return parts


def _loop_parts(k: int, tile: int) -> int:
    """For-loop steps over k: the fewest power of two whose parts are at most ``tile`` long, else :func:`_parts`.
    A power of two keeps the mean accumulator of an epilogue input exact in the verifier's finite field (its
    count divides as ``fl(1/count)``, exact only for powers of two); a launch may re-tile it on the GPU."""
    p = 1
    while p <= k and (k % p or k // p > tile):
        p *= 2
    return p if p <= k and k % p == 0 else _parts(k, tile)


class _Reader:
    """Walks the reference: producers through reshapes, shapes, the matmuls and their shared rows."""

    def __init__(self, ref: KernelGraph):
        self.ops = ref.ops
        self.ref = ref

    def op(self, r: Ref):
        return self.ops[r.op]

    def shape(self, r: Ref) -> tuple:
        return tuple(self.op(r).shapes[r.out])

    def dtype(self, r: Ref) -> str:
        return self.op(r).dtypes[r.out]

    def through_reshapes(self, r: Ref) -> Ref:
        while self.op(r).name == "reshape":
            r = self.op(r).inputs[0]
        return r

    def describe(self, r: Ref) -> str:
        return f"%{r.op} = {self.op(r).name}{list(self.shape(r))}"


def _weight(rd: _Reader, r: Ref) -> tuple[Ref, bool]:
    """(the kernel input holding a matmul's weight, whether it is stored (n, k)), reshapes looked through."""
    r = rd.through_reshapes(r)
    if rd.op(r).name == "input":
        return r, False
    if rd.op(r).name == "transpose" and rd.op(w := rd.through_reshapes(rd.op(r).inputs[0])).name == "input":
        return w, True
    raise NotStreamable(f"the matmul's weight {rd.describe(r)} is not a kernel input (or its transpose)")


def _factors(rd: _Reader, r: Ref, inverse: bool = False) -> list[tuple[Ref, bool]]:
    """``r`` as the factors of its tree of ``mul`` and ``div`` ops (reshapes looked through), each with whether
    it divides."""
    r = rd.through_reshapes(r)
    op = rd.op(r)
    if op.name == "mul":
        return [f for x in op.inputs for f in _factors(rd, x, inverse)]
    if op.name == "div":
        return _factors(rd, op.inputs[0], inverse) + _factors(rd, op.inputs[1], not inverse)
    return [(r, inverse)]


MAX_TERMS = 8   # the most terms an activation or a row reduction expands into (:func:`_terms`)


def _is_row_stat(rd: _Reader, r: Ref, m: int, k: int) -> bool:
    shape = rd.shape(r)
    return bool(shape) and shape[-1] == 1 and math.prod(shape[:-1]) == m and k != 1


def _terms(rd: _Reader, r: Ref, m: int, k: int) -> list[tuple[Fraction, tuple, tuple]]:
    """``r`` (an (m, k) value or a row reduction's operand) expanded into a sum of terms ``coef · Π scales ·
    Π factors``: each scale a row statistic (m, 1), each factor a row tensor (m, k) or a vector (k,), both given
    as ``(ref, divides)`` and sorted; like terms merged. A LayerNorm's ``((x − μ)·r)·g + b`` is ``x·g`` scaled by
    ``r``, ``g`` scaled by ``−μ·r`` and ``b``; its variance ``Σ(x − μ)²`` is ``Σx² − 2μ·Σx + k·μ²``. Sums and
    differences that read a row statistic, negations, constant scalings, products and quotients by one term are
    expanded; any other op is a leaf (a sum of tensors alone, ``x + residual``, is one tile factor: it stays one
    matmul). :class:`NotStreamable` past :data:`MAX_TERMS` terms."""
    def expand(r: Ref) -> list[tuple[Fraction, tuple, tuple]]:
        r = rd.through_reshapes(r)
        op = rd.op(r)
        if op.name in ("add", "sub") and _reads_row_stat(rd, r, m, k):   # else one tile factor (x + residual)
            a, b = (expand(x) for x in op.inputs)
            return a + ([(-c, sc, fa) for c, sc, fa in b] if op.name == "sub" else b)
        if op.name == "neg":
            return [(-c, sc, fa) for c, sc, fa in expand(op.inputs[0])]
        if op.name == "scalar_mul":
            return [(c * Fraction(op.attrs["value"]), sc, fa) for c, sc, fa in expand(op.inputs[0])]
        if op.name in ("mul", "square"):
            a, b = (expand(op.inputs[0]), expand(op.inputs[-1]))
            return [(ca * cb, sa + sb, fa + fb) for ca, sa, fa in a for cb, sb, fb in b]
        if op.name == "div" and len(den := expand(op.inputs[1])) == 1:
            (cd, sd, fd), = den
            flip = lambda xs: tuple((x, not inv) for x, inv in xs)      # noqa: E731
            return [(c / cd, sc + flip(sd), fa + flip(fd)) for c, sc, fa in expand(op.inputs[0])]
        leaf = ((r, False),)
        return [(Fraction(1), leaf, ())] if _is_row_stat(rd, r, m, k) else [(Fraction(1), (), leaf)]

    merged: dict[tuple, Fraction] = {}
    for c, sc, fa in expand(r):
        key = (tuple(sorted(sc)), tuple(sorted(fa)))
        merged[key] = merged.get(key, Fraction(0)) + c
    terms = [(c, sc, fa) for (sc, fa), c in merged.items() if c != 0]
    if len(terms) > MAX_TERMS:
        raise NotStreamable(f"{rd.describe(r)} expands into {len(terms)} terms (at most {MAX_TERMS})")
    return terms


def _reads_row_stat(rd: _Reader, r: Ref, m: int, k: int) -> bool:
    """Whether ``r`` is a row statistic or reads one through elementwise ops (a LayerNorm's ``x − μ``)."""
    r = rd.through_reshapes(r)
    op = rd.op(r)
    if _is_row_stat(rd, r, m, k):
        return True
    return op.name in ELEMENTWISE and any(_reads_row_stat(rd, x, m, k) for x in op.inputs)


def rotation(rd: _Reader, r: Ref) -> tuple[Ref, int, tuple] | None:
    """RoPE's pairing read off a ``concat``: ``(source, group, signs)`` where ``r`` joins the two halves of each
    ``group`` columns of ``source`` swapped, each possibly negated (``cat((-x2, x1), -1)`` of ``x1, x2 =
    x.chunk(2, -1)``: signs (-1, 1)); the concat along the last dim, or along the one before of parts of extent 1
    there (``torch.stack((-x2, x1), -2)`` before a flatten). None where ``r`` is not of that form."""
    r = rd.through_reshapes(r)
    op = rd.op(r)
    shape = rd.shape(r)
    if op.name != "concat" or len(op.inputs) != 2 or not shape:
        return None
    dim = op.attrs["dim"] % len(shape)
    if dim != len(shape) - 1 and not (dim == len(shape) - 2 and all(rd.shape(x)[-2] == 1 for x in op.inputs)):
        return None
    halves = []
    for x in op.inputs:
        x, sign = rd.through_reshapes(x), 1
        while rd.op(x).name == "neg":
            x, sign = rd.through_reshapes(rd.op(x).inputs[0]), -sign
        cut = rd.op(x)
        if cut.name != "slice" or cut.attrs["dim"] % len(rd.shape(x)) != len(rd.shape(x)) - 1:
            return None
        halves.append((cut.inputs[0], Fraction(cut.attrs["start"], cut.attrs["chunks"]),
                       Fraction(cut.attrs["stop"], cut.attrs["chunks"]), sign))
    (src, *_), (other, *_) = halves
    group = rd.shape(src)[-1]
    if rd.through_reshapes(src) != rd.through_reshapes(other) or [h[1:3] for h in halves] != \
            [(Fraction(1, 2), Fraction(1)), (Fraction(0), Fraction(1, 2))] or group % 2:
        return None
    return src, group, tuple(h[3] for h in halves)


def rotation_groups(ref: KernelGraph) -> set[int]:
    """The head sizes of the rotations (:func:`rotation`) in ``ref``."""
    rd = _Reader(ref)
    return {rot[1] for i, op in enumerate(ref.ops) if op.name == "concat" and (rot := rotation(rd, Ref(i, 0)))}


class Stream(NamedTuple):
    """A matmul result the seed computes: a matmul's whole result, or one slice of it along n."""
    ref: Ref                   # the value: the matmul's result, or the slice op's
    mm: int                    # the matmul op
    part: tuple | None         # (chunks, start, stop) of the weight's n, or None: all of it
    width: int
    bias: Ref | None = None    # a split matmul's bias (n,), added before the split: its part is added to the part


def streams(ref: KernelGraph, mms: list[int]) -> list[Stream]:
    """The results of matmuls ``mms``: a matmul read only through slices along its last dim (reshapes keeping
    that dim looked through) gives one stream per slice, each a matmul against that slice of the weight; any
    other matmul, its whole result."""
    readers: dict[Ref, list[int]] = {}
    for j, op in enumerate(ref.ops):
        for x in op.inputs:
            readers.setdefault(x, []).append(j)
    out = []
    for i in mms:
        n = ref.ops[i].shapes[0][-1]
        split = _slices_along_n(ref, readers, Ref(i, 0), n)
        if split is None:
            out.append(Stream(Ref(i, 0), i, None, n))
            continue
        slices, bias = split
        for j in slices:
            at = ref.ops[j].attrs
            out.append(Stream(Ref(j, 0), i, (at["chunks"], at["start"], at["stop"]),
                              n * (at["stop"] - at["start"]) // at["chunks"], bias))
    return out


def _slices_along_n(ref: KernelGraph, readers: dict, r: Ref, n: int) -> tuple[list[int], Ref | None] | None:
    """The slice ops along the last dim (of extent ``n``, whole parts) that all readers of ``r`` are, through
    reshapes keeping that dim and at most one add of a bias (a kernel input of n elements: GPT-2's ``c_attn``),
    with that bias; None where ``r`` (or a value on the way) has another reader or is an output."""
    found, todo, bias = [], [r], None
    while todo:
        x = todo.pop()
        if x in ref.outputs:
            return None
        for j in readers.get(x, ()):
            op = ref.ops[j]
            shape = op.shapes[0]
            other = [y for y in op.inputs if y != x]
            if op.name == "reshape" and shape and shape[-1] == n:
                todo.append(Ref(j, 0))
            elif op.name == "add" and bias is None and len(other) == 1 and ref.ops[other[0].op].name == "input" \
                    and math.prod(ref.ops[other[0].op].shapes[other[0].out]) == n and shape and shape[-1] == n:
                bias = other[0]
                todo.append(Ref(j, 0))
            elif op.name == "slice" and shape and op.attrs["dim"] % len(shape) == len(shape) - 1 and \
                    n * (op.attrs["stop"] - op.attrs["start"]) % op.attrs["chunks"] == 0:
                found.append(j)
            else:
                return None
    return (found, bias) if found else None


def streamed_dims(ref: KernelGraph) -> tuple[int, int, int]:
    """``(m, k, n)`` of the reference's first matmul: rows, reduced dim, output columns."""
    mm = next((op for op in ref.ops if op.name == "matmul"), None)
    if mm is None:
        raise NotStreamable("no matmul")
    a = mm.inputs[0]
    return math.prod(mm.shapes[0][:-1]), ref.ops[a[0]].shapes[a[1]][-1], mm.shapes[0][-1]


def gemv_seed(ref: KernelGraph, tile: int = 64, gains_on_weights: bool = False, halves: bool = False) -> KernelGraph:
    """The weight-streaming μGraph of ``ref`` (see the module docstring; ``gains_on_weights``: the activation's
    vector factors scale the weight tiles; ``halves``: a rotated width's block holds matching slices of both halves
    of a head, :class:`_HalvesBlock`, instead of the whole head); :class:`NotStreamable` when ``ref`` is not of
    that form (with ``halves``, also where no width is rotated)."""
    rd = _Reader(ref)
    mms = [i for i, op in enumerate(ref.ops) if op.name == "matmul"]
    if not mms:
        raise NotStreamable("no matmul")
    rows_ref = {rd.through_reshapes(ref.ops[i].inputs[0]) for i in mms}
    if len(rows_ref) != 1:
        raise NotStreamable(f"{len(mms)} matmuls read {len(rows_ref)} different activations")
    (a,) = rows_ref
    for i in mms:      # a batched matmul streams where its batch is one (F.linear of a 3-D view: bmm of batch 1)
        if math.prod(ref.ops[i].shapes[0][:-2]) != 1 or math.prod(rd.shape(ref.ops[i].inputs[1])[:-2]) != 1:
            raise NotStreamable(f"a batched matmul {rd.describe(Ref(i, 0))}: one (m, n) result per matmul is needed")
    weights = {i: _weight(rd, ref.ops[i].inputs[1]) for i in mms}
    m, k, _ = streamed_dims(ref)
    results_of = streams(ref, mms)
    widths = {st.ref.op: st.width for st in results_of}
    group_of = []                                   # each output: the width of the matmuls it is computed from
    for r in ref.outputs:
        found = {widths[i] for i in ref.ancestors([r.op]) if i in widths}
        if len(found) != 1:
            raise NotStreamable(f"output {rd.describe(r)} reads {len(found)} matmul widths: one is needed")
        group_of.append(found.pop())
    if halves and not rotation_groups(ref):
        raise NotStreamable("no rotation: paired halves apply to RoPE's heads only")
    seed = _Seed(rd, m, k, tile, gains_on_weights)
    results: dict[int, Tensor] = {}
    for n in dict.fromkeys(st.width for st in results_of):   # one block graph per width (a QKV projection: three)
        outs = [j for j, w in enumerate(group_of) if w == n]
        if not outs:
            raise NotStreamable(f"the matmul(s) of width {n} reach no output")
        group = [st for st in results_of if st.width == n]
        heads = {rot[1] for i in ref.ancestors([ref.outputs[j].op for j in outs]) if ref.ops[i].name == "concat"
                 and (rot := rotation(rd, Ref(i, 0))) is not None}
        if len(heads) > 1 or heads and n % min(heads):
            raise NotStreamable(f"rotations in groups of {sorted(heads)} over {n} columns: one head size is needed")
        block = _HalvesBlock(seed, n, min(heads)) if halves and heads else _Block(seed, n, min(heads) if heads else None)
        ys = block.build(a, group, [weights[st.mm] for st in group], [ref.outputs[j] for j in outs])
        results.update(zip(outs, ys))
    for j, r in enumerate(ref.outputs):
        y, shape = results[j], rd.shape(r)
        seed.g.mark_output(y if tuple(y.shape) == shape else seed.g.reshape(y, shape=shape))
    return seed.g.build()


class _Seed:
    """The kernel graph under construction: the reference's inputs (in its order) and their 2-D views, shared by
    the block graphs of every matmul width."""

    def __init__(self, rd: _Reader, m: int, k: int, tile: int, gains_on_weights: bool = False):
        self.rd, self.m, self.k, self.tile, self.gains_on_weights = rd, m, k, tile, gains_on_weights
        self.g = new_kernel_graph()
        inputs = sorted((i for i, op in enumerate(rd.ops) if op.name == "input"),
                        key=lambda i: rd.ops[i].attrs["index"])
        self.kin = {i: self.g.new_input(rd.ops[i].attrs["shape"], rd.ops[i].attrs["dtype"]) for i in inputs}
        self.views: dict[tuple, Tensor] = {}             # (ref input op, shape) -> kernel tensor a block reads

    def view(self, i: int, shape: tuple) -> Tensor:
        """Kernel input ``i`` reshaped to ``shape`` (itself where it has that shape)."""
        key = (i, shape)
        if key not in self.views:
            t = self.kin[i]
            self.views[key] = t if tuple(t.shape) == shape else self.g.reshape(t, shape=shape)
        return self.views[key]


class _Block:
    """The block graph of one matmul width n: grid over n, for-loop over k; the translation of reference values
    into its tiles (the prologue is translated again in each block graph: each recomputes the row scales)."""
    K_DIM = 1        # the k dim of a loop-side tile
    shifted = False  # whether row inputs reach the loop less their first column (an activation of several terms)

    def __init__(self, seed: _Seed, n: int, head: int | None = None):
        self.seed, self.rd, self.m, self.k, self.n, self.head = seed, seed.rd, seed.m, seed.k, n, head
        self.tb = new_threadblock_graph((n // head if head else _parts(n, seed.tile),), _loop_parts(seed.k, seed.tile))
        self.sources: list[Tensor] = []
        self.iters: dict[tuple, Tensor] = {}             # (ref input op, role) -> block iterator
        self.tiles: dict[Ref, Tensor] = {}               # ref value -> block tile (loop side)
        self.after: dict[Ref, Tensor] = {}               # ref value -> block tensor after the loop

    # ---------------------------------------------------------------- inputs
    def _iterator(self, i: int, role: str, part: tuple | None = None) -> Tensor:
        """Block iterator over kernel input ``i`` as ``role``: rows_k (m, k), vec_k (k,), col_k (k, 1), rows_n
        (m, n), vec_n (n,), weight (k, n), weight_t (n, k), stat (m, 1); with a rotation, rows_head (m, head) and
        vec_head (head,): the same for every head (RoPE's cos and sin), the block's tile one head. ``part``
        (chunks, start, stop): a weight's slice along n (a :class:`Stream` of a split matmul)."""
        key = (i, role, part)
        if key in self.iters:
            return self.iters[key]
        m, k, n = self.m, self.k, self.n
        shape, imap, fmap = {"rows_k": ((m, k), (PHI,), 1), "vec_k": ((k,), (PHI,), 0), "col_k": ((k, 1), (PHI,), 0),
                             "rows_n": ((m, n), (1,), PHI), "vec_n": ((n,), (0,), PHI),
                             "weight": ((k, n), (1,), 0), "weight_t": ((n, k), (0,), 1),
                             "stat": ((m, 1), (PHI,), PHI), "first_k": ((m, 1), (PHI,), PHI),
                             "rows_head": ((m, self.head), (PHI,), PHI), "vec_head": ((self.head,), (PHI,), PHI)}[role]
        if part is not None:    # the whole weight's view, sliced along n
            chunks, start, stop = part
            dim = {"weight": 1, "weight_t": 0, "vec_n": 0}[role]
            whole = tuple(x * chunks // (stop - start) if d == dim else x for d, x in enumerate(shape))
            src = self.seed.g.slice(self.seed.view(i, whole), dim=dim, chunks=chunks, start=start, stop=stop)
        elif role == "first_k":  # the rows' first column, a row-constant shift (:meth:`tile`)
            src = self.seed.g.slice(self.seed.view(i, (m, k)), dim=1, chunks=k, start=0, stop=1)
        else:
            src = self.seed.view(i, shape)
        if any(t is src for t in self.sources):     # one iterator per kernel tensor: a second role reads a view
            src = self.seed.g.reshape(self.seed.kin[i], shape=shape)
        self.sources.append(src)
        t = self.tb.new_input(src, imap=imap, fmap=fmap)
        if role == "weight_t":
            t = self.tb.transpose(t)
        if fmap is None and role not in IN_LOOP:  # read after the loop: through an accumulator (the mean of a
            t = self.tb.forloop_accum(t, "mean")   # loop-invariant tile is it)
        self.iters[key] = t
        return t

    def _input_role(self, r: Ref, side: str) -> str:
        """The role of ref input ``r`` read on ``side`` ("k": in the loop, "n": after it) from its shape."""
        shape = self.rd.shape(r)
        last, lead = (shape[-1] if shape else 1), math.prod(shape[:-1])
        width = self.k if side == "k" else self.n
        if last == width and (len(shape) == 1 or (lead == 1 and self.m != 1)):
            return f"vec_{side}"
        if last == width and lead == self.m or side == "n" and self.head is not None and \
                last * lead == self.m * width and last % self.head == 0:      # (b, h, 1, d): rows in heads
            return f"rows_{side}"
        if last == 1 and lead == self.m:
            return "stat"
        if side == "n" and self.head is not None and last == self.head and lead in (1, self.m):
            return "rows_head" if lead == self.m and (self.m != 1 or len(shape) > 1) else "vec_head"
        raise NotStreamable(f"input {self.rd.describe(r)} is neither rows ({self.m}, {width}), a vector "
                            f"({width},) nor a row statistic ({self.m}, 1)")

    def _is_gain(self, r: Ref) -> bool:
        """Whether tile factor ``r`` is a kernel input read as a vector over k (an RMSNorm's gain)."""
        return self.rd.op(r).name == "input" and self._input_role(r, "k") == "vec_k"

    # ---------------------------------------------------------------- translation
    def _elementwise(self, r: Ref, arg: Callable[[Ref], Tensor]) -> Tensor:
        op = self.rd.op(r)
        if op.name not in ELEMENTWISE:
            raise NotStreamable(f"{self.rd.describe(r)} is not elementwise")
        return getattr(self.tb, op.name)(*[arg(x) for x in op.inputs], **dict(op.attrs))

    def tile(self, r: Ref) -> Tensor:
        """The loop-side tile of a tile-factor value: elementwise over rows (m, k) and vectors (k,)."""
        r = self.rd.through_reshapes(r)
        if r not in self.tiles:
            op = self.rd.op(r)
            if op.name == "input":
                role = self._input_role(r, "k")
                if role == "stat":
                    raise NotStreamable(f"row statistic {self.rd.describe(r)} inside a tile factor")
                self.tiles[r] = self._iterator(r.op, role)
                if self.shifted and role == "rows_k":
                    self.tiles[r] = self.tb.sub(self.tiles[r], self._iterator(r.op, "first_k"))
            else:
                self.tiles[r] = self._elementwise(r, self.tile)
        return self.tiles[r]

    def stat(self, r: Ref) -> Tensor:
        """A row scale (m, 1) after the loop: elementwise over row reductions of tile expressions."""
        r = self.rd.through_reshapes(r)
        if r not in self.after:
            op = self.rd.op(r)
            shape = self.rd.shape(r)
            if op.name in ROW_REDUCTIONS:
                x = op.inputs[0]
                if op.attrs.get("dim") not in (len(self.rd.shape(x)) - 1, -1) or self.rd.shape(x)[-1] != self.k:
                    raise NotStreamable(f"{self.rd.describe(r)} does not reduce the rows' last dim ({self.k})")
                if _reads_row_stat(self.rd, x, self.m, self.k):     # Σ(x − μ)²: a sum of terms' sums
                    if not self.shifted:     # Σx² − 2μ·Σx + k·μ² cancels on rows far from 0 (see build)
                        raise NotStreamable(f"{self.rd.describe(r)} reduces a centred value under an activation "
                                            "that a shift of the rows would change")
                    acc = self._expanded_sum(x)
                else:
                    acc = self.tb.forloop_accum(self.tile(x), "sum", dim=self.K_DIM)
                self.after[r] = self.tb.scalar_mul(acc, value=1.0 / self.k) if op.name == "reduce_mean" else acc
            elif op.name == "input":
                self.after[r] = self._iterator(r.op, "stat")
            elif shape and shape[-1] == 1 and math.prod(shape[:-1]) == self.m:
                self.after[r] = self._elementwise(r, self.stat)
            else:
                raise NotStreamable(f"{self.rd.describe(r)} is not a row statistic ({self.m}, 1)")
        return self.after[r]

    def _product(self, factors: tuple) -> Tensor:
        """The loop-side tile of a product of tile factors (a divides flag each; the first may not divide)."""
        if factors[0][1]:
            raise NotStreamable("a term's first tile factor divides")
        t = self.tile(factors[0][0])
        for f, inv in factors[1:]:
            t = (self.tb.div if inv else self.tb.mul)(t, self.tile(f))
        return t

    def _scaled(self, t: Tensor | None, coef: Fraction, scales: tuple) -> Tensor:
        """``coef · Π scales · t`` after the loop (``t`` None: the scales alone)."""
        for s, inv in scales:
            if t is None and inv:
                raise NotStreamable("a term of row statistics alone that divides")
            t = self.stat(s) if t is None else (self.tb.div if inv else self.tb.mul)(t, self.stat(s))
        if t is None:
            raise NotStreamable("a constant term")
        return t if coef == 1 else self.tb.scalar_mul(t, value=float(coef))

    def _expanded_sum(self, x: Ref) -> Tensor:
        """``Σ_k x`` over the rows' last dim where ``x`` reads row statistics: the sum of its terms
        (:func:`_terms`), each term's tile factors summed in the loop and scaled after it; a term of row statistics
        alone sums to k times itself."""
        return self._summed(
            self._scaled(self.tb.forloop_accum(self._product(factors), "sum", dim=self.K_DIM), coef, scales)
            if factors else self._scaled(None, coef * self.k, scales)
            for coef, scales, factors in _terms(self.rd, x, self.m, self.k))

    def _summed(self, parts) -> Tensor:
        """The sum of the after-loop tensors ``parts``, added in their order."""
        total = None
        for t in parts:
            total = t if total is None else self.tb.add(total, t)
        return total

    def _term_lhs(self, factors: tuple) -> Tensor:
        """The loop-side left operand of one term's matmul: its tile factors' product where one of them is a row
        tensor; for vector factors alone (a LayerNorm's gain or bias), their product as a (1, k) row."""
        if not all(self.rd.op(f).name == "input" and self._input_role(f, "k") == "vec_k" for f, _ in factors):
            return self._product(factors)
        col = None
        for f, inv in factors:
            c = self._iterator(f.op, "col_k")
            col = c if col is None else (self.tb.div if inv else self.tb.mul)(col, c)
        return self.tb.transpose(col)

    def _rotation(self, r: Ref) -> tuple:
        """RoPE's rotation at concat ``r`` (:func:`rotation`) in this block's heads, or :class:`NotStreamable`."""
        rot = rotation(self.rd, r)
        if rot is None or rot[1] != self.head:
            raise NotStreamable(f"{self.rd.describe(r)} after the matmul is not a rotation of head halves")
        return rot

    def _rows(self, a: Ref) -> tuple[Tensor, list, list]:
        """The loop-side product of the activation's tile factors, its row scales and (``gains_on_weights``) its
        gains for the weight tiles."""
        factors = _factors(self.rd, a)
        scales = [(f, inv) for f, inv in factors if self.rd.shape(f)[-1:] == (1,) and self.k != 1]
        tiles = [(f, inv) for f, inv in factors if (f, inv) not in scales]
        gains = [(f, inv) for f, inv in tiles if self.seed.gains_on_weights and self._is_gain(f)]
        tiles = [t for t in tiles if t not in gains]
        if not tiles or tiles[0][1]:
            raise NotStreamable("the activation has no row tensor factor")
        lhs = self.tile(tiles[0][0])
        for f, inv in tiles[1:]:
            lhs = (self.tb.div if inv else self.tb.mul)(lhs, self.tile(f))
        return lhs, scales, gains

    def epilogue(self, r: Ref) -> Tensor:
        """An (m, n) value after the loop: the matmul results, then elementwise ops over them, rows (m, n) and
        vectors (n,)."""
        r = self.rd.through_reshapes(r)
        if r not in self.after:
            op = self.rd.op(r)
            if op.name == "input":
                self.after[r] = self._iterator(r.op, self._input_role(r, "n"))
            elif op.name in ROW_REDUCTIONS or op.name == "matmul":
                raise NotStreamable(f"{self.rd.describe(r)} after the matmul: only elementwise ops stream")
            elif op.name == "concat":
                src, group, signs = self._rotation(r)
                self.after[r] = self.tb.rotate_half(self.epilogue(src), group=group, signs=signs)
            else:
                self.after[r] = self._elementwise(r, self.epilogue)
        return self.after[r]

    # ---------------------------------------------------------------- the graph
    def build(self, a: Ref, group: list[Stream], weights: list[tuple[Ref, bool]], outs: list[Ref]) -> list[Tensor]:
        """The block graph computing ``outs`` from the matmul results ``group`` of activation ``a``; the kernel
        op's results."""
        terms = _terms(self.rd, a, self.m, self.k)
        if len(terms) > 1:      # a sum of terms (a LayerNorm): one accumulator a term, scaled and added after
            if self.seed.gains_on_weights:
                raise NotStreamable("gains on the weights: an activation of one term only")
            # The terms cancel: x·g·r against μ·g·r, Σx² against k·μ². Far from 0 (|μ| / σ = 300, fp32) that
            # lost 3 of eager's 7 digits, so the rows are shifted by their first column, which a LayerNorm does not
            # see (LN(x − c) = LN(x)) and which leaves terms of the rows' spread: for c one of the row's
            # values |c − μ| ≤ σ·√k, so the cancellation is bounded by k (a massive activation in the first
            # column), where unshifted it grew with (μ / σ)² without bound. An activation that the shift
            # changes fails verification and is not claimed.
            self.shifted = True
            if any(not factors for _, _, factors in terms):
                raise NotStreamable("a term of the activation without a tile factor")
            for st, (w, transposed) in zip(group, weights):
                rhs = self._iterator(w.op, "weight_t" if transposed else "weight", st.part)
                total = self._summed(
                    self._scaled(self.tb.forloop_accum(self.tb.matmul(self._term_lhs(factors), rhs), "sum"),
                                 coef, scales) for coef, scales, factors in terms)
                self.after[st.ref] = self._part_bias(st, total)
            return self._outputs(outs)
        lhs, scales, gains = self._rows(a)
        for st, (w, transposed) in zip(group, weights):
            rhs = self._iterator(w.op, "weight_t" if transposed else "weight", st.part)
            for f, inv in gains:                  # (x·g)·W = x·(g·W): a column of g scales the weight tile
                rhs = (self.tb.div if inv else self.tb.mul)(rhs, self._iterator(f.op, "col_k"))
            acc = self.tb.forloop_accum(self.tb.matmul(lhs, rhs), "sum")
            for f, inv in scales:
                acc = (self.tb.div if inv else self.tb.mul)(acc, self.stat(f))
            self.after[st.ref] = self._part_bias(st, acc)
        return self._outputs(outs)

    def _part_bias(self, st: Stream, acc: Tensor) -> Tensor:
        """A split matmul's part with its slice of the bias added before the split (``(A·W + b)[:, a:b]``)."""
        if st.bias is None:
            return acc
        return self.tb.add(acc, self._iterator(st.bias.op, "vec_n", st.part))

    def _outputs(self, outs: list[Ref]) -> list[Tensor]:
        for r in outs:
            if math.prod(self.rd.shape(r)) != self.m * self.n:     # (m, n) rows, or a reshape of them: (b, h, 1, d)
                raise NotStreamable(f"output {self.rd.describe(r)} is not ({self.m}, {self.n}) rows")
            self.tb.new_output(self.epilogue(r), omap=(1,), dtype=self.rd.dtype(r))
        return self.seed.g.customized(self.sources, self.tb)


class _HalvesBlock(_Block):
    """The block graph of one rotated width in paired halves (``gemv_seed(halves=True)``): RoPE pairs column i of a
    head with column i + d/2, so a block holds matching slices of both halves of one head — grid (heads, slices of
    d/2), each weight read through its two halves, strided views of the stored (n, k) weight (kernel ``reshape`` to
    (heads, 2, d/2, k) and ``slice``: no copy), each in (1, 1, c, kt) tiles that read whole rows along k. Every value
    after the loop is a pair of half tiles (m, 1, 1, c): elementwise ops act on each half, the rotation swaps the
    pair with its signs, and a saver stores ``concat`` of the pair into the output viewed (m, heads, 2, d/2). The
    rows lead the half tiles; each loop step multiplies the (m, 1, 1, kt) rows by a (kt, c) half tile as one 2-d
    product (the codegen's :meth:`~torch_mirage.codegen.ugraph_triton._Emitter.rows_of`)."""
    K_DIM = 3

    def __init__(self, seed: _Seed, n: int, head: int):
        if head % 2:
            raise NotStreamable(f"heads of {head}: paired halves need an even head size")
        self.seed, self.rd, self.m, self.k, self.n, self.head = seed, seed.rd, seed.m, seed.k, n, head
        self.tb = new_threadblock_graph((n // head, _parts(head // 2, seed.tile)), _loop_parts(seed.k, seed.tile))
        self.sources, self.iters, self.tiles, self.after = [], {}, {}, {}
        self.pairs: dict[Ref, tuple[Tensor, Tensor]] = {}
        self.halves: dict[tuple, Tensor] = {}

    def _half(self, i: int, shape: tuple, dim: int, half: int, part: tuple | None = None) -> Tensor:
        """Kernel input ``i`` viewed as ``shape`` (dim ``dim`` of size 2: the halves) and sliced to ``half``;
        ``part`` (chunks, start, stop): first the slice of the (n, k) weight's rows a split matmul reads."""
        key = (i, shape, dim, half, part)
        if key not in self.halves:
            if part is None:
                whole = self.seed.view(i, shape)
            else:                # the stored (n, k) rows of this part: one block of rows, reshaped to the halves
                chunks, start, stop = part
                rows = self.seed.g.slice(self.seed.view(i, (self.n * chunks // (stop - start), self.k)), dim=0,
                                         chunks=chunks, start=start, stop=stop)
                whole = self.seed.g.reshape(rows, shape=shape)
            self.halves[key] = self.seed.g.slice(whole, dim=dim, chunks=2, start=half, stop=half + 1)
        return self.halves[key]

    def _iterator(self, i: int, role: str, half: int | None = None, part: tuple | None = None) -> Tensor:
        key = (i, role, half, part)
        if key in self.iters:
            return self.iters[key]
        m, k, heads, d2 = self.m, self.k, self.n // self.head, self.head // 2
        if role in ("rows_k", "vec_k", "stat"):     # the same for both halves
            shape, fmap = {"rows_k": ((m, 1, 1, k), 3), "vec_k": ((1, 1, 1, k), 3), "stat": ((m, 1, 1, 1), PHI)}[role]
            src = self.seed.view(i, shape)
            if any(t is src for t in self.sources):
                src = self.seed.g.reshape(self.seed.kin[i], shape=shape)
            imap = (PHI, PHI)
        elif half is None:
            raise NotStreamable(f"input {self.rd.describe(Ref(i, 0))} as {role} needs a half")
        elif role == "weight_t":
            src, imap, fmap = self._half(i, (heads, 2, d2, k), 1, half, part), (0, 2), 3
        else:    # after the loop, read through a mean accumulator: (…, 2, d/2) views sliced to the half
            shape, imap = {"rows_n": ((m, heads, 2, d2), (1, 3)), "vec_n": ((1, heads, 2, d2), (1, 3)),
                           "rows_head": ((m, 1, 2, d2), (PHI, 3)), "vec_head": ((1, 1, 2, d2), (PHI, 3))}[role]
            src, fmap = self._half(i, shape, 2, half), PHI
        self.sources.append(src)
        t = self.tb.new_input(src, imap=imap, fmap=fmap)
        if role == "weight_t":
            t = self.tb.transpose(t)
        if fmap is None:
            t = self.tb.forloop_accum(t, "mean")
        self.iters[key] = t
        return t

    def pair(self, r: Ref) -> tuple[Tensor, Tensor]:
        """The two half tiles of an (m, n) value after the loop."""
        r = self.rd.through_reshapes(r)
        if r not in self.pairs:
            op = self.rd.op(r)
            if op.name == "input":
                role = self._input_role(r, "n")
                self.pairs[r] = (self._iterator(r.op, "stat"),) * 2 if role == "stat" else \
                    tuple(self._iterator(r.op, role, h) for h in (0, 1))
            elif op.name in ROW_REDUCTIONS or op.name == "matmul":
                raise NotStreamable(f"{self.rd.describe(r)} after the matmul: only elementwise ops stream")
            elif op.name == "concat":
                src, _, signs = self._rotation(r)
                a, b = self.pair(src)      # rotate_half: (s0 · second half, s1 · first half)
                self.pairs[r] = tuple(x if s == 1 else self.tb.scalar_mul(x, value=-1.0)
                                      for x, s in ((b, signs[0]), (a, signs[1])))
            elif op.name in ELEMENTWISE:
                if any(self._row_stat(x) for x in op.inputs):    # a row scale: the same tile for both halves
                    args = [(self.stat(x),) * 2 if self._row_stat(x) else self.pair(x) for x in op.inputs]
                else:
                    args = [self.pair(x) for x in op.inputs]
                self.pairs[r] = tuple(getattr(self.tb, op.name)(*[a[h] for a in args], **dict(op.attrs))
                                      for h in (0, 1))
            else:
                raise NotStreamable(f"{self.rd.describe(r)} is not elementwise")
        return self.pairs[r]

    def _row_stat(self, r: Ref) -> bool:
        shape = self.rd.shape(self.rd.through_reshapes(r))
        return bool(shape) and shape[-1] == 1 and math.prod(shape[:-1]) == self.m and self.n != 1

    def build(self, a: Ref, group: list[Stream], weights: list[tuple[Ref, bool]], outs: list[Ref]) -> list[Tensor]:
        if self.seed.gains_on_weights:
            raise NotStreamable("paired halves take the gains on the rows")
        if len(_terms(self.rd, a, self.m, self.k)) > 1:
            raise NotStreamable("paired halves of an activation of several terms are not built")
        if any(st.bias is not None for st in group):
            raise NotStreamable("paired halves of a split matmul with a bias are not built")
        lhs, scales, _ = self._rows(a)
        for st, (w, transposed) in zip(group, weights):
            if not transposed:
                raise NotStreamable("paired halves read nn.Linear's (n, k) weight, stored along k")
            pair = []
            for half in (0, 1):
                weight = self._iterator(w.op, "weight_t", half, st.part)
                acc = self.tb.forloop_accum(self.tb.matmul(lhs, weight), "sum")
                for f, inv in scales:
                    acc = (self.tb.div if inv else self.tb.mul)(acc, self.stat(f))
                pair.append(acc)
            self.pairs[st.ref] = tuple(pair)
        for r in outs:
            if math.prod(self.rd.shape(r)) != self.m * self.n:     # (m, n) rows, or a reshape of them: (b, h, 1, d)
                raise NotStreamable(f"output {self.rd.describe(r)} is not ({self.m}, {self.n}) rows")
            self.tb.new_output(self.tb.concat(list(self.pair(r)), dim=2), omap=(1, 3), dtype=self.rd.dtype(r))
        return self.seed.g.customized(self.sources, self.tb)
