"""μGraph → Triton source: one graph-defined kernel op (a :class:`BlockGraph`) → one ``@triton.jit`` kernel.

What maps to what (Mirage §2, §6):

* grid dims → ``tl.program_id(0..2)``; ``imap`` / ``omap`` → tile start offsets ``pid_g × block extent``;
* the for-loop → ``tl.range(lo, hi, num_stages=NUM_STAGES)`` (Triton's software pipelining); iterators
  with ``fmap = φ`` and everything computed only from them are hoisted out of the loop;
* accumulators (sum, mean, max, rms, online-softmax rescaling) → fp32 register tiles; the online softmax
  keeps its running max in log2 units and rescales with ``exp2``, and a ``scalar_mul`` whose only use is its
  scores carries the factor log2(e) (one multiply per score instead of two; H100, attention at b = 8: partial
  kernel 17.8 → 15.6 µs, the same as a hand-written tutorial-style kernel on those tiles); a block matmul
  feeding a sum accumulator → ``acc = tl.dot(a, b, acc)``; ``matmul(concat, concat)`` along the
  contracted dim (LoRA's concat identity) → one ``tl.dot`` per part into the same accumulator;
* thread graphs (fused elementwise chains) are inlined: Triton keeps them in registers; chains of constant
  factors fold into one multiply (a ``scalar_mul`` is a pending scale its reader multiplies in), a divisor
  broadcast over the tile is one reciprocal per row; tanh is ``tanh.approx.f32`` for ``Target.CUDA``;
* a for-loop band (``forloop_band``, causal / sliding-window attention) bounds each block's loop; with a mask that
  is 0 where the band sees, the loop splits into the tiles every row sees whole (no mask) and the edge tiles, and
  causal row blocks run heaviest first; a mask that is exactly the band (``index_mask``) is never loaded: edge
  tiles compute ``key <= pos + offset`` (and the window's edge) from the indices;
* a sum over the rows of a 2-d tile (FlashTensor's column sums of P) adds whole tiles into a register tile and
  reduces once after the loop, not a cross-warp reduction per iteration;
* every tile dim is padded to a power of two (≥ 16, ``tl.dot``'s minimum, unless it is 1); loads and
  stores are masked on ragged dims, and every reduction or contraction over a padded dim masks its
  operand first, so padding never leaks into valid elements; strides are kernel arguments;
* fp16 / bf16 / fp32 storage; elementwise math and accumulation in fp32, ``tl.dot`` operands in the
  storage dtype of the graph (fp16/bf16 on tensor cores; fp32 with ``input_precision="ieee"``);
* ops are emitted in order of depth (Mirage's depth scheduling) within each phase;
* ``split > 1`` is a kernel-level reduction after the graph-defined op (split-K / split-KV): the partial
  kernel runs ``forloop_range / split`` iterations per program and writes its raw accumulator states to an
  fp32 workspace; a combine kernel folds the splits (sum / max / online-softmax rescale), applies the
  accumulators' finals, the epilogue and the savers. The combine kernel may run on a finer grid than the
  partial kernel (``combine=`` a re-tiling with one grid dim multiplied): each of its programs folds one
  chunk of a partial program's states, so the fold of large states (attention's (rows, d) outputs) is not
  left to as few programs as the partial kernel has tiles.

Leading unit dims of a tile are dropped (keeping rank ≥ 2 for rank ≥ 2 tiles); that keeps attention's
``(1, 1, rows, d)`` tiles two-dimensional for ``tl.dot`` and is exact under right-aligned broadcasting.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Sequence

from ..context import Target
from .dependent_launch import WAIT_LINES
from ..ugraph import MASK_FLOOR, BlockGraph, Graph, MuGraphError, Op, Ref, band_geometry, band_mask_dims, grid_split

TL = {"float16": "tl.float16", "bfloat16": "tl.bfloat16", "float32": "tl.float32"}
HALF = ("float16", "bfloat16")
COMBINABLE = {"acc_sum", "acc_mean", "acc_rms", "acc_max", "acc_online_softmax"}

# elementwise μGraph ops: Triton expression over fp32 operands {0}, {1} (attrs by name)
ELEMENTWISE = {
    "add": "{0} + {1}", "sub": "{0} - {1}", "mul": "{0} * {1}", "div": "{0} / {1}",
    "exp": "tl.exp({0})", "sqrt": "tl.sqrt({0})", "rsqrt": "tl.rsqrt({0})", "silu": "{0} * tl.sigmoid({0})",
    "tanh": "(2.0 * tl.sigmoid(2.0 * {0}) - 1.0)",
    "neg": "-{0}", "square": "{0} * {0}", "scalar_mul": "{0} * {value}", "scalar_add": "{0} + {value}",
    "where": "tl.where({keep} != 0, {1}, {value})",       # {keep}: the bool operand as loaded (int1)
}
# tanh on CUDA: the SFU's tanh.approx.f32 (max relative error 2^-10.987), one instruction where the portable form
# (the interpreter's) is an exp, a reciprocal and three multiply-adds
TANH_PTX = 'tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [{0}], dtype=tl.float32, is_pure=True, pack=1)'
# reductions: (Triton reducer, fill for padded elements)
NEG_INF = 'float("-inf")'
LOG2E = 1.4426950408889634   # online softmax in base 2: exp(x) = exp2(x · log2 e)
LN2 = 0.6931471805599453
# an online softmax's running max (log2 units) before any key: finite, below every held score (MASK_FLOOR · log2 e),
# so a tile of -inf scores leaves it finite and exp2(m_old - m_new), exp2(s - m) defined; saved as M_INIT · ln 2
M_INIT = -3.0e38
REDUCERS = {"reduce_sum": ("tl.sum", "0.0"), "reduce_mean": ("tl.sum", "0.0"), "reduce_max": ("tl.max", NEG_INF)}
# how the combine kernel folds two partial accumulator states
FOLD = {"acc_sum": "{a} + {b}", "acc_mean": "{a} + {b}", "acc_rms": "{a} + {b}", "acc_max": "tl.maximum({a}, {b})"}
# the most rows (n) of a transposed weight tile that a one-row matmul multiply-sums along its loaded axis
NARROW_ROWS = 32


class CodegenError(MuGraphError):
    """A μGraph construct this Triton codegen does not emit (the message says which op and what to do)."""


def padded(extent: int) -> int:
    """Triton block size for a tile dim: 1 stays 1, else the next power of two, at least 16."""
    return 1 if extent == 1 else max(16, 1 << (extent - 1).bit_length())


def reduction(fn: str, expr: str, pshape, dim: int, keep: bool = True) -> str:
    """``fn`` (``tl.sum`` / ``tl.max`` / ``tl.min``) of the fp32 tile expression ``expr`` (block shape ``pshape``)
    along ``dim``, kept at 1 (``keep``) or dropped. Along a unit dim it is ``expr`` itself (a reshape where the dim
    is dropped): one element's sum or max is that element, and no reduction is emitted. (H200 12-01: the decode
    seed walking one key a step, its scores a (16, 1) tile, gave results 7x off fp64 under every launch on the GPU,
    exact in the interpreter; its max and sums over the one key and its P·V multiply-sum over a unit axis were
    such reductions.)"""
    if pshape[dim] != 1:
        return f"{fn}({expr}, axis={dim}{', keep_dims=True' if keep else ''})"
    if keep:
        return expr
    return f"tl.reshape({expr}, {tuple(pshape[:dim]) + tuple(pshape[dim + 1:])})"


def strip(shape) -> tuple[tuple, int]:
    """``shape`` without its leading unit dims (rank ≥ 2 tiles keep rank 2); returns (shape, dims dropped)."""
    shape, keep, i = tuple(shape), min(len(shape), 2), 0
    while len(shape) - i > keep and shape[i] == 1:
        i += 1
    return shape[i:], i


def order_by_depth(g: Graph, subset) -> list[int]:
    """Ops ``subset`` of ``g`` in Mirage's depth order: by longest path from the sources, then by index."""
    depth: dict[int, int] = {}
    for i, op in enumerate(g.ops):
        depth[i] = 1 + max((depth[r[0]] for r in op.inputs), default=-1)
    return sorted(subset, key=lambda i: (depth[i], i))


def _expand(rank: int, k: int) -> str:
    """Indexer that lifts a 1-d arange to position ``k`` of a rank-``rank`` block."""
    if rank == 1:
        return ""
    return "[" + ", ".join(":" if j == k else "None" for j in range(rank)) + "]"


def _bcast(*shapes) -> tuple:
    rank = max(len(s) for s in shapes)
    out = []
    for i in range(rank):
        sizes = {s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0} - {1}
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


@dataclass
class Val:
    """A tile value in the kernel: variable name, shape without leading unit dims, dtype of the values."""
    name: str
    shape: tuple
    dtype: str
    parts: tuple = ()       # a virtual concat: its parts (Vals) and the concat dim in ``shape``
    cat_dim: int = -1
    log2e: bool = False     # holds the op's value times log2(e) (online-softmax scores, see _prescaled)
    trans: bool = False     # the register tile holds the value transposed (a rank-2 tile, see layout_rules)
    scale: float = 1.0      # the op's value is ``name`` times this constant, not yet multiplied (see _Emitter.emit_op)
    zero: bool = False      # a tile known to be 0 (a band's mask on a tile every row sees whole): ``name`` builds it

    @property
    def pshape(self) -> tuple:
        return tuple(padded(e) for e in self.shape)

    @property
    def phys(self) -> tuple:
        """The padded shape of the register tile: ``pshape``, its two dims swapped when held transposed."""
        return self.pshape[::-1] if self.trans else self.pshape


@dataclass
class BlockKernel:
    """The generated source for one customized op and what its launcher needs."""
    source: str
    name: str
    combine: str | None
    grid: tuple
    split: int
    workspaces: list = field(default_factory=list)     # numel (padded) of each accumulator state, per program
    outputs: list = field(default_factory=list)        # (shape, dtype) of each saver's kernel tensor
    pipelined: bool = False                            # has a for-loop (takes NUM_STAGES)
    combine_grid: tuple = ()                           # the combine kernel's grid (split > 1)
    counters: int = 0                                  # arrival counters (int32, zeroed once) of an in-kernel combine
    params: list = field(default_factory=list)         # the kernel's parameter names, in order
    flat_pid: bool = False                             # its program comes as ``lin`` (a sibling launch's part)
    pdl: bool = False                                  # waits for its predecessor first (codegen.dependent_launch)


@dataclass(frozen=True)
class StoreThrough:
    """Saver ``saver``'s tile stored into a destination at positions as well (a KV cache's write,
    :mod:`..superopt.updates`): the saved kernel tensor, read row-major, is a value of shape ``shape`` (reshapes
    only) whose dim ``dim`` is the destination's positions, ``pos[i]`` for its ``i``; the other dims are the
    destination's own. ``only``: the saver's own output is not stored (nothing else reads it). The kernel takes
    ``dst{t}_ptr``, its strides and ``pos{t}_ptr`` after its outputs."""
    saver: int
    shape: tuple
    dim: int
    dtype: str
    only: bool = False


def _through_params(through: Sequence[StoreThrough]) -> list[str]:
    return [p for t, th in enumerate(through)
            for p in [f"dst{t}_ptr", *(f"dst{t}_s{d}" for d in range(len(th.shape))), f"pos{t}_ptr"]]


class _Emitter:
    """Writes one kernel's lines. Constant factors are folded: a ``scalar_mul`` binds its input times a pending
    ``Val.scale`` (no code), which the one reader in its phase multiplies in where it reads the value — one
    multiply for a chain (attention's scale, 1/softcap → one constant in tanh's argument; softcap, log2 e → one in
    the online softmax's scores) — and any other reader gets it multiplied out once (:meth:`arg`). ``target``
    picks the CUDA-only forms (tanh on the SFU); the interpreter gets portable ones. ``full``: the loop being
    written walks only tiles every row of the block sees whole, where the band's mask is 0 (not loaded)."""

    def __init__(self, bg: BlockGraph, n_inputs: int, split: int, order=None, transposed=None,
                 target: Target = Target.INTERPRETER, through: Sequence[StoreThrough] = ()):
        self.bg, self.split, self.n_inputs, self.target = bg, split, n_inputs, target
        self.through = {th.saver: (t, th) for t, th in enumerate(through)}
        self.band_zero: int | None = None
        self.band: dict | None = None      # the band's geometry where its mask is computed from indices (index_mask)
        self.wide: dict[int, tuple] = {}    # deferred column sums: acc op -> (whole-tile accumulator, reduced dim)
        self.full = False
        self.walked: int | None = None      # the walked dim's extent in the tensors, where the tiles cover more
        self.walked_index: str | None = None    # the walked dim's indices of the loop step's tiles (1-d), then
        self.row_bound: tuple[int, int] | None = None   # (grid dim, rows the tensors hold) of ragged row blocks
        self.users = bg.consumers()
        self.phase = _phase_of(bg)
        self.raw_scores = {id(op): _raw_terms(bg, op.inputs[0]) for op in bg.ops if op.name == "acc_online_softmax"}
        # a column pass's scores with a loaded mask (:func:`_exp_scores`) held as the online softmax holds its own
        self.held = {i: raw for op in bg.ops if op.name == "acc_sum" and (i := _exp_scores(bg, op.inputs[0][0])) is not None
                     and bg.ops[i].name == "add" and (raw := _raw_terms(bg, Ref(i, 0)))}
        self.input_dtypes = {op.attrs["index"]: op.attrs["dtype"] for op in bg.ops if op.name == "iterator"}
        self.lines: list[str] = []
        self.indent = 1
        self.aranges: set[int] = set()
        self.count = 0
        self.rank = None if order is None else {i: k for k, i in enumerate(order)}
        rules = layout_rules(bg)
        self.transposed = rules.default if transposed is None else frozenset(transposed) & rules.flexible
        self.relabels = {i for i in rules.flexible if bg.ops[i].name == "transpose"}
        self.need = rules.needs(self.transposed)       # (op, input k) -> the orientation it reads
        self.readers = rules.readers
        self.alt: dict[Ref, Val] = {}                  # a value converted to the other orientation
        self.trans_of: dict[str, Val] = {}             # a ``tl.trans`` result's name -> the tile it transposes
        self.prescaled = _prescaled(bg)
        self.exp_of_sub = {e: d for e, d in _exp_of_differences(bg, self.phase).items()   # exp op -> its sub,
                           if (e in self.transposed) == (d in self.transposed)}           # emitted as one exp2
        self.folded_subs = set(self.exp_of_sub.values())
        dts = [op.attrs["dtype"] for op in bg.iterators]
        for d in dts:
            if d not in TL and d != "bool":      # bool: a mask, loaded as int1 and read by ``where``
                raise CodegenError(f"μGraph codegen: input dtype {d} not supported "
                                   "(use float16, bfloat16, float32, or bool for a mask)")
        self.dot_dtype = next((d for d in dts if d in HALF), "float32")

    # -------------------------------------------------------------- basics
    def line(self, s: str) -> None:
        self.lines.append("    " * self.indent + s)

    def fresh(self, base: str) -> str:
        self.count += 1
        return f"{base}{self.count}"

    def r(self, p: int) -> str:
        self.aranges.add(p)
        return f"r{p}"

    def assign(self, base: str, expr: str, shape, dtype: str = "float32", natural=None, trans: bool = False) -> Val:
        v = Val(self.fresh(base), tuple(shape), dtype, trans=trans)
        want = v.phys
        if natural is not None and tuple(natural) != want:
            expr = f"tl.reshape({expr}, {want})"
        self.line(f"{v.name} = {expr}")
        return v

    def holds(self, raw: set[int]) -> bool:
        """Whether scores adding the tiles of iterators ``raw`` (input indices) are held at ``MASK_FLOOR`` here:
        where a tile is loaded (not a band's all-0 one) that may hold finite values below the floor — any mask but
        an fp16 one, whose lowest value (-65504) is far above it; a band's mask computed from indices is at the
        floor itself. (H100 11-27 e: the hold cost the bf16 H2O column pass about 9 µs of 127 at 1024 keys.)"""
        return any(not (self.full and k == self.band_zero)
                   and (self.input_dtypes.get(k) != "float16" or (self.band is not None and k == self.band_zero))
                   for k in raw)

    def hold(self, v: Val) -> Val:
        """Scores ``v`` (with an additive mask) held at ``MASK_FLOOR`` where finite, as the online softmax holds
        them (:func:`_online_softmax_update`): a pass that re-reads the mask after it (H2O's column sums) sees the
        same scores the row statistics came from, so a row masked whole by a dtype's lowest value averages its
        keys in both; -inf stays -inf."""
        x = self.f32(v)
        return self.assign("s", f"tl.where({x} == {NEG_INF}, {x}, tl.maximum({x}, {MASK_FLOOR!r}))", v.shape,
                           trans=v.trans)

    def f32(self, v: Val) -> str:
        """``v``'s value in fp32 as an expression (its pending scale multiplied in)."""
        x = v.name if v.dtype == "float32" else f"{v.name}.to(tl.float32)"
        return x if v.scale == 1.0 else f"({x} * {v.scale!r})"

    def mask(self, shape, trans: bool = False) -> str | None:
        """Validity mask of a block of (stripped) ``shape`` (held transposed: ``trans``): only padded dims are
        checked."""
        rank, terms = len(shape), []
        for k, e in enumerate(shape):
            if padded(e) != e:
                terms.append(f"({self.r(padded(e))} < {e}){_expand(rank, rank - 1 - k if trans else k)}")
        return " & ".join(terms) or None

    def masked(self, v: Val, dims, fill: str) -> str:
        """``v`` (fp32) with the padding of ``dims`` replaced by ``fill`` (no-op when those dims are exact)."""
        rank, terms = len(v.shape), []
        for k in dims:
            e = v.shape[k]
            if padded(e) != e:
                terms.append(f"({self.r(padded(e))} < {e}){_expand(rank, k)}")
        if not terms:
            return self.f32(v)
        return f"tl.where({' & '.join(terms)}, {self.f32(v)}, {fill})"

    # -------------------------------------------------------------- memory
    def coordinates(self, tile, starts, trans: bool = False) -> list[str]:
        """Each dim's index expression for a tile whose dim d starts at ``starts[d]``: the start alone ("0" where it
        is 0) for a leading unit dim, else the start plus an arange lifted to its place in the register tile
        (``trans``: a rank-2 tile held transposed)."""
        kept, n = strip(tile)
        rank, out = len(kept), []
        for d, s in enumerate(starts):
            if d < n:
                out.append("0" if s == "0" else f"({s})")
                continue
            k = d - n
            ar = self.r(padded(tile[d]))
            out.append(f"{ar if s == '0' else f'({s} + {ar})'}{_expand(rank, rank - 1 - k if trans else k)}")
        return out

    def offsets(self, prefix: str, full, tile, starts, trans: bool = False) -> tuple[str, str | None]:
        """Pointer offsets (and mask) of a tile of kernel tensor ``prefix`` whose dim d starts at ``starts[d]``;
        ``trans``: the (rank-2) register tile holds it transposed (loaded as its transpose)."""
        terms = [f"{c} * {prefix}_s{d}" for d, c in enumerate(self.coordinates(tile, starts[:len(full)], trans))
                 if c != "0"]
        return " + ".join(terms) or "0", self.mask(strip(tile)[0], trans)

    def bounded(self, mask: str | None, tile, starts, bounds: dict, trans: bool = False) -> str | None:
        """``mask`` and each dim ``d`` of ``bounds`` held below its bound: a tile at ``starts`` of a tensor that
        holds only ``bounds[d]`` elements of dim ``d`` (ragged tiles; a dim of one element is a start alone)."""
        coords = self.coordinates(tile, starts, trans)
        for d, bound in bounds.items():
            inside = f"({coords[d]} < {bound})"
            mask = inside if mask is None else f"{mask} & {inside}"
        return mask

    def load_iterator(self, op: Op, it: str | None, trans: bool = False, other: str = "0.0") -> Val:
        """The tile of iterator ``op`` at loop step ``it``; elements past the tensor's end read ``other``."""
        a, bg = op.attrs, self.bg
        if self.full and a["index"] == self.band_zero:     # a tile every row sees whole: the mask is 0 there
            shape = strip(op.shapes[0])[0]
            phys = tuple(padded(x) for x in shape)[::-1 if trans else 1]
            return Val(f"tl.zeros({phys}, tl.float32)", shape, "float32", trans=trans, zero=True)
        full, tile = a["shape"], op.shapes[0]
        starts = []
        for d in range(len(full)):
            parts = [_grid_start(g, full[d], bg.grid[g]) for g, m in enumerate(a["imap"]) if m == d]
            if a["fmap"] == d:
                parts.append(f"{it} * {tile[d]}")
            starts.append(" + ".join(parts) or "0")
        if self.band is not None and a["index"] == self.band_zero:   # the band's own mask: from the indices
            return self.band_mask_tile(op, starts, trans)
        p = f"in{a['index']}"
        offs, mask = self.offsets(p, full, tile, starts, trans)
        if self.walked is not None and a["fmap"] is not None:    # whole tiles, the last one ragged: keys past the end
            d = a["fmap"]
            self.walked_index = f"({starts[d]} + {self.r(padded(tile[d]))})"
            mask = self.bounded(mask, tile, starts[:len(full)], {d: self.walked}, trans)
        if self.row_bound is not None:                           # ragged row blocks: rows past the end
            g, rows = self.row_bound
            mask = self.bounded(mask, tile, starts[:len(full)], {a["imap"][g]: rows} if a["imap"][g] is not None
                                else {}, trans)
        extra = f", mask={mask}, other={other}" if mask else ""
        return self.assign("x", f"tl.load({p}_ptr + {offs}{extra})", strip(tile)[0], a["dtype"], trans=trans)

    def band_mask_tile(self, op: Op, starts: list, trans: bool) -> Val:
        """A partly seen tile of the band's ``index_mask`` input, computed instead of loaded: 0 where the key
        (the walked dim's index) is visible from the position (the other dim's index modulo the period), else
        the masked floor."""
        b, tile = self.band, op.shapes[0]
        kept, n = strip(tile)
        rank = len(kept)
        pd, kd = band_mask_dims(self.bg, op)

        def index(d: int) -> str:
            ar = self.r(padded(tile[d]))
            k = d - n
            return f"({'' if starts[d] == '0' else starts[d] + ' + '}{ar}){_expand(rank, rank - 1 - k if trans else k)}"

        pos = index(pd) if op.attrs["shape"][pd] <= b["period"] else f"({index(pd)} % {b['period']})"
        key = index(kd)
        seen = f"({key} <= {pos} + {b['offset']})"
        if b["window"] is not None:
            seen += f" & ({key} > {pos} + {b['offset'] - b['window']})"
        return self.assign("x", f"tl.where({seen}, 0.0, {MASK_FLOOR!r})", kept, "float32", trans=trans)

    def store_saver(self, op: Op, v: Val) -> None:
        k, bg = op.attrs["index"], self.bg
        tile = bg.shape(op.inputs[0])
        starts = [" + ".join(f"pid_{g} * {tile[d]}" for g, m in enumerate(op.attrs["omap"]) if m == d) or "0"
                  for d in range(len(tile))]
        full = [t * math.prod(bg.grid[g] for g, m in enumerate(op.attrs["omap"]) if m == d) for d, t in enumerate(tile)]
        t, through = self.through.get(k, (None, None))
        for part, part_tile, part_starts in self._saved_parts(v, tile, starts):
            value = self.conform(part, strip(part_tile)[0])
            if through is None or not through.only:
                offs, mask = self.offsets(f"out{k}", full, part_tile, part_starts)
                if self.row_bound is not None and (d := op.attrs["omap"][self.row_bound[0]]) is not None:
                    mask = self.bounded(mask, part_tile, part_starts, {d: self.row_bound[1]})
                extra = f", mask={mask}" if mask else ""
                self.line(f"tl.store(out{k}_ptr + {offs}, {value}.to({TL[op.attrs['dtype']]}){extra})")
            if through is not None:
                offs, mask = self.through_offsets(t, through, full, part_tile, part_starts)
                extra = f", mask={mask}" if mask else ""
                self.line(f"tl.store(dst{t}_ptr + {offs}, {value}.to({TL[through.dtype]}){extra})")

    def through_offsets(self, t: int, th: StoreThrough, full, tile, starts) -> tuple[str, str | None]:
        """Offsets (and mask) in destination ``t`` of a saved tile (see :class:`StoreThrough`): each element's
        row-major index in the saved tensor, unravelled in ``th.shape``; the positions' dim looked up."""
        coords = self.coordinates(tile, starts[:len(full)])
        flat = " + ".join(c if math.prod(full[d + 1:]) == 1 else f"{c} * {math.prod(full[d + 1:])}"
                          for d, c in enumerate(coords) if full[d] > 1 and c != "0") or "0"
        flat_name = self.fresh("flat")
        self.line(f"{flat_name} = {flat}")
        terms = []
        for d, extent in enumerate(th.shape):
            inner = math.prod(th.shape[d + 1:])
            if extent == 1:
                index = "0"
            else:
                index = flat_name if inner == 1 else f"({flat_name} // {inner})"
                if d > 0:
                    index = f"({index} % {extent})"
            if d == th.dim:
                index = f"tl.load(pos{t}_ptr + {index})" if index != "0" else f"tl.load(pos{t}_ptr)"
            if index != "0":
                terms.append(f"{index} * dst{t}_s{d}")
        return " + ".join(terms) or "0", self.mask(strip(tile)[0])

    @staticmethod
    def _saved_parts(v: Val, tile, starts):
        """(value, its tile, its starts) of each store a saver makes: ``v`` whole, or each part of a saved
        ``concat`` (RoPE's paired halves) at its offset along the concat dim."""
        if not v.parts:
            return [(v, tuple(tile), starts)]
        d = v.cat_dim + len(tile) - len(v.shape)
        out, at = [], 0
        for p in v.parts:
            lead = len(tile) - len(p.shape)
            extent = p.shape[d - lead] if d >= lead else 1
            part_tile = tuple(extent if j == d else t for j, t in enumerate(tile))
            shifted = list(starts)
            shifted[d] = str(at) if starts[d] == "0" else f"{starts[d]} + {at}"
            out.append((p, part_tile, shifted))
            at += extent
        return out

    # -------------------------------------------------------------- plan: order and tile orientation
    def order(self, idx) -> list[int]:
        """Ops ``idx`` in the plan's order (default: Mirage's depth order)."""
        if self.rank is None:
            return order_by_depth(self.bg, idx)
        return sorted(idx, key=self.rank.__getitem__)

    def arg(self, env: dict, u: int, k: int) -> Val:
        """Input ``k`` of op ``u`` in the orientation ``u`` reads it; a pending scale is multiplied out (once, for
        every reader) unless ``u`` folds it into its own constants (:meth:`folds`)."""
        r = Ref(*self.bg.ops[u].inputs[k])
        v = env[r]
        alt = v.trans != self.need.get((u, k), False)
        if alt:
            v = self.alt[r]
        if v.scale != 1.0 and not self.folds(u, k):
            v = self.assign("v", self.f32(v), v.shape, natural=v.phys, trans=v.trans)
            (self.alt if alt else env)[r] = v
        return v

    def folds(self, u: int, k: int) -> bool:
        """Whether op ``u`` reads input ``k`` through :meth:`f32` or folds its pending scale into a constant."""
        op = self.bg.ops[u]
        return op.name in ELEMENTWISE or u in self.relabels or u in self.prescaled or \
            (op.name == "acc_online_softmax" and k == 0)

    def put(self, env: dict, r: Ref, v: Val) -> None:
        """Bind op output ``r`` to ``v``; where a consumer reads it in the other orientation, the conversion
        (``tl.trans``) is emitted here, once, right after the value."""
        env[r] = v
        self.alt.pop(r, None)
        if any(self.need.get((u, k), False) != v.trans for u, k in self.readers.get(r, ())):
            nat = v.phys[::-1]
            self.alt[r] = replace(self.assign("v", f"tl.trans({v.name})", v.shape, v.dtype, natural=nat,
                                              trans=not v.trans), scale=v.scale)
            self.trans_of[self.alt[r].name] = v

    def emit_op(self, i: int, env: dict, it: str | None = None) -> None:
        """Emit block op ``i`` (``it``: the for-loop index) and bind its outputs: a transposed iterator loads its
        tile transposed, a transpose between orientations is a relabel (no code)."""
        op = self.bg.ops[i]
        trans = i in self.transposed
        if op.name == "iterator":
            outs = [self.load_iterator(op, it, trans)]
        elif i in self.prescaled:
            x = self.arg(env, i, 0)
            v = self.assign("v", f"{self.f32(replace(x, scale=1.0))} * {x.scale * float(op.attrs['value']) * LOG2E!r}",
                            strip(op.shapes[0])[0], natural=x.pshape)
            v.log2e = True
            outs = [v]
        elif i in self.relabels:
            x = self.arg(env, i, 0)
            out = Val(x.name, strip(op.shapes[0])[0], x.dtype, trans=trans, scale=x.scale)
            outs = [replace(out, name=f"tl.zeros({out.phys}, tl.float32)", zero=True) if x.zero else out]
        elif i in self.folded_subs:     # computed inside its exp's exp2 (:meth:`exp_of_difference`): no code
            outs = [Val("<a − b inside an exp2>", strip(op.shapes[0])[0], "float32", trans=trans)]
        elif i in self.exp_of_sub:
            outs = [self.exp_of_difference(env, i, trans)]
        elif op.name == "scalar_mul" and not (x := self.arg(env, i, 0)).parts and not x.log2e:   # folded: no code
            outs = [replace(x, shape=strip(op.shapes[0])[0], trans=trans, log2e=False,
                            scale=1.0 if x.zero else x.scale * float(op.attrs["value"]))]
        else:
            outs = self.emit(op, [self.arg(env, i, k) for k in range(len(op.inputs))], trans=trans)
        if i in self.held and self.holds(self.held[i]):
            outs = [self.hold(outs[0])]
        for j, v in enumerate(outs):
            users = self.users.get(Ref(i, j), [])
            if v.scale != 1.0 and (len(users) != 1 or self.phase[users[0]] != self.phase[i]):
                v = self.assign("v", self.f32(v), v.shape, natural=v.phys, trans=v.trans)   # read twice: once here
            self.put(env, Ref(i, j), v)

    def exp_of_difference(self, env: dict, i: int, trans: bool) -> Val:
        """``exp(a − b)`` (op ``i``, ``b`` broadcast over the tile) as ``exp2(a·c·log2 e − b·log2 e)`` where ``a``
        is a product not yet rounded (``a·c``, ``c`` its pending scale: scores straight from the matmul): ``b``'s
        product once per row and one FMA per element before the exp2, where the scale, the sub and the multiply by
        log2 e inside ``tl.exp`` were three operations. A rounded ``a`` (held or masked scores) keeps the sub
        first: a row whose scores and max are both the mask floor must give exp(0) exactly, and an FMA of two
        products of 1e30 leaves their rounding difference (about 1e23) in the exponent."""
        s = self.bg.ops[i].inputs[0][0]
        a, b = self.arg(env, s, 0), self.arg(env, s, 1)
        if a.scale == 1.0 or a.parts or b.parts or a.log2e or b.log2e:     # as written: the sub, then the exp
            (d,) = self.emit(self.bg.ops[s], [a, b], trans=trans)
            return self.emit(self.bg.ops[i], [d], trans=trans)[0]
        rows = self.assign("v", f"{self.f32(b)} * {LOG2E!r}", b.shape, natural=b.phys, trans=b.trans)
        plain = self.f32(replace(a, scale=1.0))
        return self.assign("v", f"tl.math.exp2({plain} * {a.scale * LOG2E!r} - {rows.name})",
                           strip(self.bg.ops[i].shapes[0])[0], natural=_bcast(a.phys, b.phys), trans=trans)

    def conform(self, v: Val, shape) -> str:
        want = tuple(padded(e) for e in shape)
        return v.name if v.pshape == want else f"tl.reshape({v.name}, {want})"

    def flat(self, pshape, within=None) -> str:
        """Offsets of a ``pshape`` block in a row-major block of padded shape ``within`` (default: itself); a
        dim narrower than ``within``'s is the ``chunk``-th part of it (the combine kernel on a finer grid)."""
        within = within or pshape
        rank, terms = len(pshape), []
        for k, (p, w) in enumerate(zip(pshape, within)):
            stride = math.prod(within[k + 1:])
            ix = self.r(p) if p == w else f"(chunk * {p} + {self.r(p)})"
            terms.append(f"{ix}{_expand(rank, k)}" + (f" * {stride}" if stride != 1 else ""))
        return " + ".join(terms)

    # -------------------------------------------------------------- compute
    def emit(self, op: Op, xs: list[Val], shapes=None, trans: bool = False) -> list[Val]:
        """Emit one compute op of a block or thread graph; returns its output values. ``trans``: an elementwise
        op whose operands are held transposed gives its value transposed."""
        name, a = op.name, op.attrs
        out, n = strip((shapes or op.shapes)[0])
        if name in ELEMENTWISE:
            natural = _bcast(*(x.phys for x in xs))
            if name in ("add", "sub") and xs[1].zero or name == "add" and xs[0].zero:   # x + 0: x itself
                keep = xs[0] if xs[1].zero else xs[1]
                if keep.shape == tuple(out) and keep.phys == tuple(natural) and keep.trans == trans:
                    return [keep]
            args = [self.f32(x) for x in xs]
            value = _literal(float(a["value"])) if "value" in a else None
            x0, plain = xs[0], self.f32(replace(xs[0], scale=1.0))
            if name == "scalar_mul" and x0.scale != 1.0:                      # x·s·c: one multiply by s·c
                expr = f"{plain} * {x0.scale * float(a['value'])!r}"
            elif name == "tanh" and self.target is Target.CUDA:
                expr = TANH_PTX.format(args[0] if x0.scale == 1.0 else f"{plain} * {x0.scale!r}")
            elif name == "tanh" and x0.scale != 1.0:                          # 2σ(2·x·s) − 1: one multiply by 2s
                expr = f"(2.0 * tl.sigmoid({plain} * {2.0 * x0.scale!r}) - 1.0)"
            elif name == "div" and math.prod(xs[1].phys) < math.prod(natural):
                # a divisor broadcast over the tile (a row's sum or norm): its reciprocal once per row, then a
                # multiply per element — Triton's fp32 ``/`` is div.full.f32, an SFU reciprocal and more per element
                expr = f"{args[0]} * (1.0 / {args[1]})"
            else:
                expr = ELEMENTWISE[name].format(*args, value=value, keep=xs[0].name)
            return [self.assign("v", expr, out, natural=natural, trans=trans)]
        if name == "thread":
            return self.emit_thread(op, xs)
        if name in REDUCERS:
            return [self.reduce(op, xs[0], out)]
        if name == "rms_norm":
            x = xs[0]
            last = len(x.shape) - 1
            ss = reduction("tl.sum", f"{self.masked(x, [last], '0.0')} * {self.masked(x, [last], '0.0')}", x.pshape, last)
            expr = f"{self.f32(x)} / tl.sqrt({ss} / {x.shape[last]}.0 + {float(a.get('eps') or 0.0)!r})"
            return [self.assign("v", expr, out, natural=x.pshape)]
        if name == "matmul":
            return [self.matmul(xs[0], xs[1], out)]
        if name == "transpose":
            x, rank = xs[0], len(xs[0].shape)
            if rank == 2:
                expr = f"tl.trans({x.name})"
            else:
                perm = tuple(range(rank - 2)) + (rank - 1, rank - 2)
                expr = f"tl.permute({x.name}, {perm})"
            nat = x.pshape[:-2] + (x.pshape[-1], x.pshape[-2])
            v = self.assign("v", expr, out, x.dtype, natural=nat)
            if rank == 2 and not x.parts:
                self.trans_of[v.name] = x
            return [v]
        if name == "rotate_half":
            return [self.rotate_half(xs[0], out, a["group"], a["signs"])]
        if name == "concat":
            dim = a["dim"] - (len(op.shapes[0]) - len(out))
            return [Val(f"<concat of {len(xs)}>", out, "float32", tuple(xs), dim)]
        raise CodegenError(f"μGraph codegen: block op {name!r} (output {op.shapes[0]}) is not supported; "
                           "rewrite it with supported block ops or run the μGraph with the reference executor")

    def rotate_half(self, x: Val, out, group: int, signs) -> Val:
        """RoPE's rotation inside each ``group`` of the tile's last dim in registers: the tile viewed as
        (…, groups, 2, group / 2), its halves split apart (``tl.split`` of the pair axis moved last) and joined
        back swapped, each times its sign."""
        last = x.shape[-1] if x.shape else 1
        if x.trans or padded(last) != last or last % group:
            raise CodegenError(f"μGraph codegen: rotate_half of a tile {x.shape} (held transposed: {x.trans}) in "
                               f"groups of {group}: the tile's last dim must be whole groups, a power of two")
        lead = x.pshape[:-1]
        rank = len(lead) + 3
        swap = tuple(range(rank - 2)) + (rank - 1, rank - 2)
        first, second = self.fresh("x"), self.fresh("x")
        self.line(f"{first}, {second} = tl.split(tl.permute(tl.reshape({self.f32(x)}, "
                  f"{lead + (last // group, 2, group // 2)}), {swap}))")
        a, b = (f"-{v}" if sg < 0 else v for v, sg in zip((second, first), signs))
        return self.assign("v", f"tl.reshape(tl.permute(tl.join({a}, {b}), {swap}), {x.pshape})", out,
                           natural=x.pshape)

    def emit_thread(self, op: Op, xs: list[Val]) -> list[Val]:
        tg = op.body
        env: dict[Ref, Val] = {}
        for i, top in enumerate(tg.ops):
            ins = [env[Ref(*r)] for r in top.inputs]
            outs = [xs[top.attrs["index"]]] if top.name == "input" else self.emit(top, ins)
            for j, v in enumerate(outs):
                env[Ref(i, j)] = v
        return [env[Ref(*r)] for r in tg.outputs]

    def reduce(self, op: Op, x: Val, out) -> Val:
        fn, fill = REDUCERS[op.name]
        full_rank = len(op.shapes[0])
        dim = op.attrs["dim"] - (full_rank - len(x.shape))
        if dim < 0:                      # a dropped unit dim: reducing one element is the identity
            return self.assign("v", self.f32(x), out, natural=x.pshape)
        expr = reduction(fn, self.masked(x, [dim], fill), x.pshape, dim)
        if op.name == "reduce_mean":
            expr = f"{expr} / {x.shape[dim]}.0"
        nat = x.pshape[:dim] + (1,) + x.pshape[dim + 1:]
        return self.assign("v", expr, out, natural=nat)

    def dot_operand(self, expr: str, dtype: str) -> str:
        return expr if dtype == self.dot_dtype else f"{expr}.to({TL[self.dot_dtype]})"

    def matmul_parts(self, a: Val, b: Val) -> list[tuple[Val, Val]]:
        if not a.parts and not b.parts:
            return [(a, b)]
        if (a.parts and a.cat_dim != len(a.shape) - 1) or (b.parts and b.cat_dim != len(b.shape) - 2) \
                or len(a.parts or [a]) != len(b.parts or [b]):
            raise CodegenError(f"μGraph codegen: concat feeds a matmul other than along the contracted dim "
                               f"({a.shape} @ {b.shape}); only (A1‖A2)·(B1‖B2) = A1·B1 + A2·B2 is emitted")
        return list(zip(a.parts or [a], b.parts or [b]))

    def rows_of(self, a: Val, b: Val) -> Val:
        """``a`` (m, 1, …, 1, k) times a 2-d ``b`` as the 2-d rows (m, k): the batch dims ``b`` broadcasts over are
        all 1 but the first, so the batched product is one (m, k) @ (k, n) (RoPE's paired halves at several rows:
        rows lead the half tiles)."""
        if len(b.shape) != 2 or len(a.shape) <= 2 or any(x != 1 for x in a.shape[1:-2]) or a.shape[-2] != 1 \
                or a.parts or a.trans:
            return a
        x, dt = (a.name, a.dtype) if a.scale == 1.0 else (self.f32(a), "float32")
        shape = (a.shape[0], a.shape[-1])
        return self.assign("a", f"tl.reshape({x}, {tuple(padded(e) for e in shape)})", shape, dt)

    def matmul(self, a: Val, b: Val, out, acc: Val | None = None) -> Val:
        """``a @ b`` (+ ``acc``): ``tl.dot`` when every dim is ≥ 16, else a broadcast multiply-sum (along the last
        axis of ``b``'s source tile where ``b`` is a transpose)."""
        parts = [(self.rows_of(pa, pb), pb) for pa, pb in self.matmul_parts(a, b)]
        expr = acc.name if acc is not None else None
        if acc is not None and len(acc.shape) > 2 and len(parts[0][0].shape) == 2:     # rows_of's (m, 1, …, c) state
            expr = f"tl.reshape({acc.name}, {(padded(parts[0][0].shape[0]), padded(parts[0][1].shape[-1]))})"
        for pa, pb in parts:
            if len(pa.shape) != 2 or len(pb.shape) != 2:
                raise CodegenError(f"μGraph codegen: batched block matmul {pa.shape} @ {pb.shape} is not supported; "
                                   "map the batch dims to grid dims (imap) so each block multiplies 2-d tiles")
            k = pa.shape[1]
            am = self.masked(pa, [1], "0.0") if padded(k) != k else pa.name
            bm = self.masked(pb, [0], "0.0") if padded(k) != k else pb.name
            a_dt = "float32" if am != pa.name else pa.dtype
            b_dt = "float32" if bm != pb.name else pb.dtype
            if min(pa.pshape + pb.pshape) >= 16:
                prec = ', input_precision="ieee"' if self.dot_dtype == "float32" else ""
                tail = f", {expr}" if expr is not None else ""
                term = f"tl.dot({self.dot_operand(am, a_dt)}, {self.dot_operand(bm, b_dt)}{tail}{prec})"
                expr = self.assign("d", term, (pa.shape[0], pb.shape[1])).name
            elif bm == pb.name and not pb.trans and (src := self.trans_of.get(pb.name)) is not None \
                    and src.phys == pb.phys[::-1] and src.scale == 1.0 and src.phys[0] <= NARROW_ROWS:
                # b is the transpose of a narrow tile held as (n, k) — nn.Linear's weight, loaded along its
                # contiguous k: multiply-sum along that axis of the tile as loaded, not of its transpose (H100 11-26,
                # gate / up 1 x 4096 x 2·14336 bf16, 16 x 256 tiles on 896 programs: 296 µs through the transpose,
                # 94.6 µs this way; 32 x 256 tiles of 1 x 4096 x 4096: 14.1 µs both ways; but the split-K QKV
                # projection's 128 x 128 tiles took 54 µs this way against 38.5 through the transpose)
                am = am if a_dt == "float32" else f"{am}.to(tl.float32)"
                bt = src.name if src.dtype == "float32" else f"{src.name}.to(tl.float32)"
                term = reduction("tl.sum", f"{am}[:, None, :] * {bt}[None, :, :]",
                                 (padded(pa.shape[0]), src.phys[0], padded(k)), 2, keep=False)
                expr = self.assign("d", term if expr is None else f"{expr} + {term}", (pa.shape[0], pb.shape[1])).name
            else:
                am = am if a_dt == "float32" else f"{am}.to(tl.float32)"
                bm = bm if b_dt == "float32" else f"{bm}.to(tl.float32)"
                term = reduction("tl.sum", f"{am}[:, :, None] * {bm}[None, :, :]",
                                 (padded(pa.shape[0]), padded(k), padded(pb.shape[1])), 1, keep=False)
                expr = self.assign("d", term if expr is None else f"{expr} + {term}", (pa.shape[0], pb.shape[1])).name
        res = Val(expr, (a.shape[0], b.shape[1]), "float32")
        if tuple(out) != res.shape:     # (m, c) rows of a lhs with unit middle dims: back to (m, 1, …, c)
            return self.assign("v", res.name, out, natural=res.pshape)
        return res


# ------------------------------------------------------------------ accumulators
def _acc_count(bg: BlockGraph, op: Op) -> int:
    dim = op.attrs.get("dim")
    if op.name in ("acc_mean", "acc_rms") and dim is not None:
        return bg.shape(op.inputs[0])[dim] * bg.forloop_range
    return bg.forloop_range


def _acc_init(e: _Emitter, op: Op) -> list[Val]:
    states = []
    for j, s in enumerate(op.shapes):
        shape = strip(s)[0]
        pshape = tuple(padded(x) for x in shape)
        if op.name == "acc_max":
            init = f'tl.full({pshape}, float("-inf"), tl.float32)'
        elif op.name == "acc_online_softmax" and j == 0:        # the running max (see _online_softmax_update)
            init = f"tl.full({pshape}, {M_INIT!r}, tl.float32)"
        else:
            init = f"tl.zeros({pshape}, tl.float32)"
        states.append(e.assign("acc", init, shape))
    return states


def _deferred_sum_dim(bg: BlockGraph, op: Op) -> int | None:
    """The reduced dim (of the stripped tile) of a sum over the rows of a 2-d tile — FlashTensor's column sums of
    P — which the kernel adds up whole in a register tile and reduces once after the loop: reduced every
    iteration, each would be a cross-warp reduction through shared memory (rows are spread over warps)."""
    if op.name != "acc_sum" or op.attrs.get("dim") is None:
        return None
    shape = bg.shape(op.inputs[0])
    kept, n = strip(shape)
    dim = op.attrs["dim"] - (len(op.shapes[0]) - len(shape)) - n
    if len(kept) != 2 or dim != 0 or padded(kept[0]) != kept[0] or math.prod(padded(x) for x in kept) > 128 * 128:
        return None                     # (an exact reduced dim: no padding to mask)
    return dim


def _acc_update(e: _Emitter, op: Op, states: list[Val], xs: list[Val], fused: tuple | None,
                wide: tuple | None = None) -> None:
    """Fold one iteration into ``states`` in place (re-assigning the same variable names); ``wide``: the
    (register tile, dim) a deferred column sum (:func:`_deferred_sum_dim`) adds the whole tile to."""
    if wide is not None:
        acc, dim = wide
        e.line(f"{acc.name} = {acc.name} + " + (f"tl.trans({e.f32(xs[0])})" if xs[0].trans else e.f32(xs[0])))
        return
    if op.name == "acc_online_softmax":
        raw = e.raw_scores[id(op)]
        return _online_softmax_update(e, states, *xs, clamp=e.holds(raw))
    st = states[0]
    if fused is not None:                               # acc = tl.dot(a, b, acc)
        v = e.matmul(fused[0], fused[1], st.shape, acc=st)
        e.line(f"{st.name} = {v.name}")
        return
    x, dim = xs[0], op.attrs.get("dim")
    if dim is not None:
        dim -= len(op.shapes[0]) - len(x.shape)
    if op.name == "acc_rms":
        sq = e.assign("v", f"{e.f32(x)} * {e.f32(x)}", x.shape, natural=x.pshape)
        x = sq
    if op.name == "acc_max":
        part = reduction("tl.max", e.masked(x, [dim], NEG_INF), x.pshape, dim) \
            if dim is not None and dim >= 0 else e.f32(x)
        e.line(f"{st.name} = tl.maximum({st.name}, {_conform_expr(part, x, dim, st)})")
        return
    part = reduction("tl.sum", e.masked(x, [dim], '0.0'), x.pshape, dim) if dim is not None and dim >= 0 \
        else e.f32(x)
    e.line(f"{st.name} = {st.name} + {_conform_expr(part, x, dim, st)}")


def _conform_expr(expr: str, x: Val, dim, st: Val) -> str:
    """``expr`` (``x`` reduced over ``dim``) reshaped to the state's block shape where they differ."""
    nat = x.pshape if dim is None or dim < 0 else x.pshape[:dim] + (1,) + x.pshape[dim + 1:]
    return expr if tuple(nat) == st.pshape else f"tl.reshape({expr}, {st.pshape})"


def _online_softmax_update(e: _Emitter, states: list[Val], s: Val, v: Val, clamp: bool = True) -> None:
    """One iteration of the online softmax, in base 2: the running max ``m`` is in log2 units (scores times
    log2 e), so every rescale and probability is one ``exp2``; :func:`_acc_final` turns ``m`` back. The scores'
    pending scale and log2 e are one multiply. ``clamp``: the scores may hold an additive mask (see below); finite
    scores below ``MASK_FLOOR`` are held there before the multiply by log2 e (a dtype's lowest value would overflow
    fp32 to -inf), so a row masked whole by finite values averages its keys, as eager's softmax does; -inf stays
    -inf, and the running max starting at ``M_INIT`` (below the floor, finite) keeps ``exp2(s - m)`` defined on a
    tile or split whose keys are all -inf — a row masked whole by -inf ends with sum 0 and output 0/0 = NaN, as
    eager's. No clamped copy of the mask per call."""
    m, l, o = states
    last = len(s.shape) - 1
    factor = s.scale * (1.0 if s.log2e else LOG2E)
    if clamp:
        x = e.f32(s)
        x = x if x == s.name else e.assign("s", x, s.shape, natural=s.pshape).name
        floor = MASK_FLOOR * (LOG2E if s.log2e else 1.0)
        held = e.assign("s", f"tl.where({x} == {NEG_INF}, {x}, tl.maximum({x}, {floor!r}))"
                        + ("" if s.log2e else f" * {LOG2E!r}"), s.shape, natural=s.pshape)
        scores = e.masked(held, [last], NEG_INF)
    elif factor > 0:            # masking with -inf commutes with a positive factor
        base = e.masked(replace(s, scale=1.0), [last], NEG_INF)
        scores = base if factor == 1.0 else f"{base} * {factor!r}"
    else:
        scores = e.masked(s, [last], NEG_INF) if s.log2e else f"{e.masked(s, [last], NEG_INF)} * {LOG2E!r}"
    if e.walked is not None and e.walked_index is not None:     # keys past the tensors' end: -inf
        scores = f"tl.where({e.walked_index}{_expand(len(s.shape), last)} < {e.walked}, {scores}, {NEG_INF})"
    sm = held if clamp and scores == held.name else e.assign("s", scores, s.shape, natural=s.pshape)
    mt = e.assign("m", reduction("tl.max", sm.name, sm.pshape, last), m.shape,
                  natural=sm.pshape[:last] + (1,))
    mn = e.assign("m", f"tl.maximum({m.name}, {mt.name})", m.shape, natural=m.pshape)
    alpha = e.assign("a", f"tl.math.exp2({m.name} - {mn.name})", m.shape, natural=m.pshape)
    # s - m <= 0, but the GPU compiler contracts ``s = x * log2e`` into ``fma(x, log2e, -m)``: at a masked
    # score (-1e30, an additive mask) that leaves the product's rounding error, ~1e22, and exp2 of it is inf
    # (NaN after the combine; seen on an H100 with a fully masked KV split). Clamped, such a tile gives p <= 1.
    # Scores that add no loaded tile to a matmul's (a tile every row sees whole, its mask 0) are not clamped.
    diff = f"tl.minimum({sm.name} - {mn.name}, 0.0)" if clamp else f"{sm.name} - {mn.name}"
    p = e.assign("p", f"tl.math.exp2({diff})", s.shape, natural=s.pshape)
    e.line(f"{l.name} = {l.name} * {alpha.name} + {reduction('tl.sum', p.name, p.pshape, last)}")
    scaled = e.assign("o", f"{o.name} * {alpha.name}", o.shape, natural=o.pshape)
    new_o = e.matmul(p, v, o.shape, acc=scaled)
    e.line(f"{o.name} = {new_o.name}")
    e.line(f"{m.name} = {mn.name}")


def _acc_final(e: _Emitter, bg: BlockGraph, op: Op, states: list[Val]) -> list[Val]:
    st = states[0]
    if op.name == "acc_mean":
        return [e.assign("f", f"{st.name} / {_acc_count(bg, op)}.0", st.shape)]
    if op.name == "acc_rms":
        eps = float(op.attrs.get("eps") or 0.0)
        return [e.assign("f", f"tl.sqrt({st.name} / {_acc_count(bg, op)}.0 + {eps!r})", st.shape)]
    if op.name == "acc_online_softmax":           # the running max back from log2 units (dead unless saved)
        return [e.assign("f", f"{st.name} * {LN2!r}", st.shape), *states[1:]]
    return states


def _combine(e: _Emitter, op: Op, states: list[Val], others: list[Val]) -> None:
    if op.name != "acc_online_softmax":
        st, ot = states[0], others[0]
        e.line(f"{st.name} = {FOLD[op.name].format(a=st.name, b=ot.name)}")
        return
    (m, l, o), (m2, l2, o2) = states, others          # raw partial states: m in log2 units
    # two partials that saw no key (an empty for-loop band: m = M_INIT, l = o = 0) stay empty: weights 1, states 0
    mn = e.assign("m", f"tl.maximum({m.name}, {m2.name})", m.shape)
    a1 = e.assign("a", f"tl.math.exp2({m.name} - {mn.name})", m.shape)
    a2 = e.assign("a", f"tl.math.exp2({m2.name} - {mn.name})", m.shape)
    e.line(f"{l.name} = {l.name} * {a1.name} + {l2.name} * {a2.name}")
    e.line(f"{o.name} = {o.name} * {a1.name} + {o2.name} * {a2.name}")
    e.line(f"{m.name} = {mn.name}")


def _literal(x: float) -> str:
    """A Python float literal Triton's frontend parses (``float("-inf")`` for infinities)."""
    return repr(x) if math.isfinite(x) else f'float("{x}")'


# ------------------------------------------------------------------ kernels
def _fusable_matmuls(bg: BlockGraph) -> dict[int, int]:
    """matmul op → the ``acc_sum`` (no dim) that is its only consumer: emitted as ``tl.dot(a, b, acc)``."""
    users = bg.consumers()
    out = {}
    for i, op in enumerate(bg.ops):
        if op.name != "matmul":
            continue
        us = users.get(Ref(i, 0), [])
        if len(us) == 1 and bg.ops[us[0]].name == "acc_sum" and bg.ops[us[0]].attrs.get("dim") is None:
            out[i] = us[0]
    return out


def _exp_of_differences(bg: BlockGraph, phase: list[int]) -> dict[int, int]:
    """``exp`` ops of ``a − b`` whose ``b`` is broadcast over the tile (a row's max: FlashTensor's column pass
    re-deriving P from the row statistics), the sub read by nothing else in the same phase: exp op -> sub op.
    Such an exp is one exp2 of an FMA per element (:meth:`_Emitter.exp_of_difference`)."""
    users = bg.consumers()
    out = {}
    for i, op in enumerate(bg.ops):
        if op.name != "exp":
            continue
        s = op.inputs[0][0]
        sub = bg.ops[s]
        if sub.name != "sub" or users.get(Ref(s, 0), []) != [i] or phase[s] != phase[i]:
            continue
        if math.prod(bg.shape(sub.inputs[1])) < math.prod(sub.shapes[0]):
            out[i] = s
    return out


def _prescaled(bg: BlockGraph) -> set[int]:
    """``scalar_mul`` ops whose only use is an online softmax's scores: emitted with the factor log2(e)
    folded into their constant, so the base-2 update needs no multiply of its own."""
    users = bg.consumers()
    out = set()
    for i, op in enumerate(bg.ops):
        us = users.get(Ref(i, 0), [])
        if op.name == "scalar_mul" and len(us) == 1 and bg.ops[us[0]].name == "acc_online_softmax" \
                and tuple(bg.ops[us[0]].inputs[0]) == (i, 0) and tuple(bg.ops[us[0]].inputs[1]) != (i, 0):
            out.add(i)
    return out


@dataclass(frozen=True)
class LayoutRules:
    """Which tiles the emitter can hold transposed and what each op input reads.

    ``flexible``: ops whose (one, rank-2) output tile may be held transposed — iterators (the tile is loaded
    transposed), elementwise ops over rank-2 operands of their own rank (they run on the transposed tiles alike)
    and transposes of rank-2 tiles (a relabel when the orientations differ). ``rules[(u, k)]``: input ``k`` of op
    ``u`` is read "same" (in ``u``'s own orientation: a flexible elementwise op), "flip" (the other one: a
    flexible transpose) or "row" (as the value is: every other op). ``readers[ref]``: the (op, k) reading it."""
    flexible: frozenset
    rules: dict
    readers: dict
    default: frozenset      # the layout without a plan: the flexible transposes (every tile as computed, each
                            # transpose a relabel of its input converted by a ``tl.trans`` for its readers)

    def needs(self, transposed) -> dict:
        """(op, input k) -> whether it reads that input transposed, given the ops whose tiles are transposed."""
        return {e: (u in transposed) == (rule == "same") for e, rule in self.rules.items()
                if rule != "row" for u in (e[0],)}


def layout_rules(bg: BlockGraph) -> LayoutRules:
    """The :class:`LayoutRules` of ``bg``'s emitter (the μGraph optimiser's layout choices are drawn from them)."""
    prescaled = _prescaled(bg)

    def rank2(r) -> bool:
        return len(strip(bg.shape(r))[0]) == 2 and bg.ops[r[0]].name != "concat"

    flex = set()
    for i, op in enumerate(bg.ops):
        if len(op.shapes) != 1 or not rank2(Ref(i, 0)):
            continue
        if op.name == "iterator" or op.name == "transpose" and rank2(op.inputs[0]):
            flex.add(i)
        elif op.name in ELEMENTWISE and i not in prescaled and \
                all(rank2(r) and len(bg.shape(r)) == len(op.shapes[0]) for r in op.inputs):
            flex.add(i)
    rules, readers = {}, {}
    for u, op in enumerate(bg.ops):
        for k, r in enumerate(op.inputs):
            rules[u, k] = "row" if u not in flex else "flip" if op.name == "transpose" else "same"
            readers.setdefault(Ref(*r), []).append((u, k))
    return LayoutRules(frozenset(flex), rules, readers, frozenset(i for i in flex if bg.ops[i].name == "transpose"))


class Phases(NamedTuple):
    """The op groups :func:`emit_block_kernel` writes in sequence: ``invariant`` ops hoisted before the for-loop,
    the loop's ``variant`` ops, its ``accumulators`` (each ``fused`` matmul runs inside its accumulator's update:
    matmul -> accumulator) and the ``epilogue`` after the loop (savers included)."""
    invariant: list
    variant: list
    accumulators: list
    epilogue: list
    fused: dict


def phases(bg: BlockGraph) -> Phases:
    body, epi = bg.phases()
    accs = [i for i in body if bg.ops[i].spec.kind == "accum"]
    fused = _fusable_matmuls(bg)
    var = _variant(bg)
    compute = [i for i in body if i not in accs and i not in fused]
    return Phases([i for i in compute if not var[i]], [i for i in compute if var[i]], accs, epi, fused)


def _variant(bg: BlockGraph) -> list[bool]:
    """Which body ops change from one for-loop iteration to the next (the rest are hoisted)."""
    var: list[bool] = []
    for op in bg.ops:
        if op.name == "iterator":
            var.append(op.attrs["fmap"] is not None)
        else:
            var.append(any(var[r[0]] for r in op.inputs))
    return var


def _grid_start(g: int, size: int, programs: int) -> str:
    """The first index of grid dim ``g``'s tile along a tensor dim of ``size`` (:func:`~torch_mirage.ugraph.
    grid_split`): ``pid × extent``, or ``pid // group`` where consecutive programs share an element."""
    group, extent = grid_split(size, programs)
    return f"pid_{g} * {extent}" if group == 1 else f"(pid_{g} // {group})"


def _header(name: str, params: Sequence[str]) -> list[str]:
    return ["@triton.jit", f"def {name}({', '.join(params)}):"]


def _params(n_inputs: int, in_ranks, out_ranks, n_ws: int, pipelined: bool, counters: bool = False,
            flat_pid: bool = False, through: Sequence[StoreThrough] = ()) -> list[str]:
    """A block kernel's parameters: each input's and output's pointer and strides (with the outputs, the
    destinations of its :class:`StoreThrough` s), the split workspaces, the arrival counters, ``lin`` (the
    program, where a sibling launch passes it: :func:`emit_sibling_kernel`), NUM_STAGES."""
    params = []
    for i in range(n_inputs):
        params += [f"in{i}_ptr"] + [f"in{i}_s{d}" for d in range(in_ranks[i])]
    for k, r in enumerate(out_ranks):
        params += [f"out{k}_ptr"] + [f"out{k}_s{d}" for d in range(r)]
    if out_ranks:
        params += _through_params(through)
    params += [f"ws{j}_ptr" for j in range(n_ws)]
    if counters:
        params.append("cnt_ptr")
    if flat_pid:
        params.append("lin")
    if pipelined:
        params.append("NUM_STAGES: tl.constexpr")
    return params


def _pids(e: _Emitter, grid: tuple, split: int, reverse=frozenset(), flat_pid: bool = False) -> None:
    """Program ids per grid dim; a dim in ``reverse`` is walked from its last program (:func:`heaviest_first`).
    ``flat_pid``: the launch's program ids are unpacked from ``lin`` (a sibling launch's part), dim 0 fastest as
    Triton orders a grid's programs."""
    launch = [grid[0] * split, *grid[1:]]

    def program(g: int) -> str:
        if not flat_pid:
            return f"tl.program_id({g})"
        inner = math.prod(launch[:g])
        q = f"(lin // {inner})" if inner > 1 else "lin"
        return q if g == len(launch) - 1 else f"({q} % {launch[g]})"
    for g in range(len(grid)):
        if g == 0 and split > 1:
            e.line(f"pid_0 = {program(0)} // {split}")
            e.line(f"split = {program(0)} % {split}")
        elif g in reverse:
            e.line(f"pid_{g} = {grid[g] - 1} - {program(g)}")
        else:
            e.line(f"pid_{g} = {program(g)}")


def _pid_flat(grid: tuple, ratio: tuple = ()) -> str:
    """The flat program index over ``grid``; where ``ratio[g] > 1`` the running program's ``pid_g`` is a
    finer grid's and its program of ``grid`` is ``pid_g // ratio[g]``."""
    def pid(g: int) -> str:
        return f"(pid_{g} // {ratio[g]})" if ratio and ratio[g] > 1 else f"pid_{g}"
    expr = pid(0)
    for g in range(1, len(grid)):
        expr = f"({expr}) * {grid[g]} + {pid(g)}"
    return f"({expr})"


def _finish(e: _Emitter, head: list[str]) -> str:
    prelude = [f"    r{p} = tl.arange(0, {p})" for p in sorted(e.aranges)]
    body = e.lines[:e.pid_lines] + prelude + e.lines[e.pid_lines:]
    return "\n".join(head + body) + "\n"


def _epilogue(e: _Emitter, bg: BlockGraph, epi: list[int], env: dict) -> None:
    for i in e.order(epi):
        op = bg.ops[i]
        if op.name == "saver":
            e.store_saver(op, e.arg(env, i, 0))
            continue
        e.emit_op(i, env)


def prologue_accumulators(bg: BlockGraph) -> list[int]:
    """Accumulators a separate for-loop before the main one can compute: those with no matmul in their chain
    (an RMSNorm's sum of squares over X's row) in a block graph whose other accumulators do hold one. Walking
    them in their own loop keeps the main loop a pure ``tl.dot`` stream whose weight loads pipeline (H100 probe,
    11-25: a sum of squares inside the dot loop took a 1 x 4096 x 4096 GEMV from 14.2 to 28.5 µs)."""
    accs = [i for i, op in enumerate(bg.ops) if op.spec.kind == "accum"]
    has_dot = {i: any(bg.ops[j].name == "matmul" for j in bg.ancestors([i])) for i in accs}
    if not any(has_dot.values()):
        return []
    return [i for i in accs if not has_dot[i]]


def emit_block_kernel(bg: BlockGraph, in_ranks, name: str = "ugraph_kernel", split: int = 1,
                      combine: BlockGraph | None = None, prologue: bool = False, order=None,
                      transposed=None, target: Target = Target.INTERPRETER, sums_after: bool = False,
                      combine_in_kernel: bool = False, flat_pid: bool = False,
                      through: Sequence[StoreThrough] = (), mask_scan: bool = False, pdl: bool = False,
                      walked_extent: int | None = None, row_bound: tuple[int, int] | None = None) -> BlockKernel:
    """Triton source for one graph-defined op, for ``target`` (the interpreter's forms run anywhere). ``in_ranks``: rank of each kernel input (its strides are
    arguments). ``combine``: the re-tiling of ``bg`` whose grid the combine kernel runs on (split > 1;
    default ``bg``'s own grid). ``prologue``: the :func:`prologue_accumulators` walk the for-loop range in a
    loop of their own before the main loop (loop fission; the same sums in the same order), or after it with
    ``sums_after`` (they are read only after the loop: the main loop's loads start at once). ``order`` (a
    topological order of ``bg``'s ops; default: depth order) and ``transposed`` (ops whose tiles are held
    transposed, see :class:`LayoutRules`; default: its ``default``) are the μGraph optimiser's plan
    (``superopt.optimise``). ``combine_in_kernel`` (split > 1): no combine kernel — each program stores its partial
    states, counts its arrival on its tile's counter, and the last of the tile's ``split`` programs to arrive folds
    them (:func:`_fold_split`) and resets the counter (one launch less; the fold runs on ``bg``'s grid).
    ``flat_pid``: the kernel is a part of a sibling launch (:func:`emit_sibling_kernel`), its program passed as
    ``lin``; a split with a combine kernel cannot be one (the combine is a second launch). ``through``: savers
    whose tiles are stored into a destination at positions as well (:class:`StoreThrough`), by whichever kernel
    stores the outputs. ``mask_scan``: where :func:`scanned_mask` finds the loop's mask, each program first reads
    its mask tiles and walks only from the first to the last key tile that one of its rows sees
    (:func:`_scanned_bounds`). ``pdl``: the kernel (and its combine kernel) first waits for its predecessor and then
    lets its dependents launch (:mod:`.dependent_launch`); a sibling launch's part leaves that to the launch.
    ``walked_extent``: the kernel tensors the for-loop walks hold only that many elements of the walked dim, which
    ``bg``'s iterators read further (whole tiles, the last one ragged: ``launch.ragged_walk``): their loads past it
    read 0 and the online softmax's scores there are -inf, so those keys add nothing. ``row_bound`` = (grid dim,
    rows): the tensors that grid dim maps hold only that many of the rows its blocks cover (whole row blocks,
    the last one ragged: ``launch.ragged_rows``): loads past them read 0, stores past them are dropped, and the
    outputs have that many rows."""
    if bg.forloop_range % split:
        raise CodegenError(f"μGraph codegen: split {split} does not divide forloop_range {bg.forloop_range}")
    if flat_pid and split > 1 and not combine_in_kernel:
        raise CodegenError(f"μGraph codegen: a split of {split} with a combine kernel is two launches, not a part of "
                           f"a sibling launch (fold it in-kernel)")
    ph = phases(bg)
    accs, epi, fused = ph.accumulators, ph.epilogue, ph.fused
    for i in accs:
        if bg.ops[i].name not in COMBINABLE:
            raise CodegenError(f"μGraph codegen: accumulator {bg.ops[i].name} is not supported "
                               f"(supported: {sorted(COMBINABLE)})")
    savers = bg.savers
    out_ranks = [len(bg.shape(s.inputs[0])) for s in savers]
    state_shapes = [strip(s)[0] for i in accs for s in bg.ops[i].shapes]
    ws = [math.prod(padded(x) for x in s) for s in state_shapes] if split > 1 else []
    n_inputs = len(in_ranks)
    if row_bound is not None and split > 1:
        raise CodegenError(f"μGraph codegen: ragged row blocks with a split of {split} "
                           "(its combine kernel stores whole blocks)")
    e = _Emitter(bg, n_inputs, split, order, transposed, target, through)
    e.walked, e.row_bound = walked_extent, row_bound
    _pids(e, bg.grid, split, heaviest_first(bg, split, mask_scan), flat_pid)
    pdl = pdl and not flat_pid
    if pdl:
        for line in WAIT_LINES:
            e.line(line)
    e.pid_lines = len(e.lines)
    env: dict[Ref, Val] = {}
    per = bg.forloop_range // split
    loop = per > 1

    def emit_ops(idx, it):
        for i in e.order(idx):
            e.emit_op(i, env, it)

    lo = f"split * {per}" if split > 1 else "0"
    hi = f"{lo} + {per}" if split > 1 else f"{per}"
    walk_tile = _walked_tile(bg) if walked_extent is not None else None
    # the steps whose tiles hold a walked element
    steps = -(-walked_extent // walk_tile) if walk_tile is not None else None
    if steps is not None and steps < bg.forloop_range:
        # tiles wholly past the keys (a split's share of the steps rounded up) are not visited
        hi = f"tl.minimum({hi}, {steps})" if split > 1 else str(min(per, steps))
    segments = [(lo, hi, False)]
    edge_stages = "NUM_STAGES"          # the pipeline depth of the loops over partly seen tiles
    if bg.forloop_band is not None:     # per-block loop bounds: entirely masked key tiles are never visited
        loop = True
        segments = _band_bounds(e, bg, lo, hi)
        if any(full for *_, full in segments):   # a band's edge loops run a tile or two per block: not pipelined
            edge_stages = "1"
    elif mask_scan and loop and (m := scanned_mask(bg)) is not None:   # the same, the mask read at run time
        segments = _scanned_bounds(e, bg, bg.ops[m], lo, hi)
    peeled = loop and steps is not None
    if peeled:                          # only the last key tile is ragged: the whole ones load unbounded
        segments = _peel_ragged_tail(segments, walked_extent // walk_tile)
    else:
        segments = [(*seg, True) for seg in segments]
    emit_ops(ph.invariant, None)
    states = {i: _acc_init(e, bg.ops[i]) for i in accs}
    for i in accs:                      # column sums: the whole tile summed per iteration, reduced after the loop
        if (dim := _deferred_sum_dim(bg, bg.ops[i])) is not None:
            shape = strip(bg.shape(bg.ops[i].inputs[0]))[0]
            e.wide[i] = (e.assign("acc", f"tl.zeros({tuple(padded(x) for x in shape)}, tl.float32)", shape), dim)
    first = prologue_accumulators(bg) if prologue and loop else []
    groups = [first, [i for i in accs if i not in first]] if first else [accs]
    for group in (groups[::-1] if sums_after else groups):
        needed = bg.ancestors(group)
        for s_lo, s_hi, full, bounded in segments if loop else [(lo, hi, False, True)]:
            e.full = full
            e.walked = walked_extent if bounded else None
            if loop:            # a peeled tail is one step at most: not pipelined
                stages = "1" if peeled and bounded else "NUM_STAGES" if full else edge_stages
                e.line(f"for it in tl.range({s_lo}, {s_hi}, num_stages={stages}):")
                e.indent += 1
            emit_ops([i for i in ph.variant if i in needed], "it" if loop else lo)
            for i in e.order(group):
                op = bg.ops[i]
                mm = next((m for m, a in fused.items() if a == i), None)
                pair = tuple(e.arg(env, mm, k) for k in range(2)) if mm is not None else None
                _acc_update(e, op, states[i], [e.arg(env, i, k) for k in range(len(op.inputs))] if mm is None
                            else [], pair, e.wide.get(i))
            if loop:
                e.indent -= 1
    e.full, e.walked = False, walked_extent
    for i, (wide, dim) in e.wide.items():
        st = states[i][0]
        total = _conform_expr(reduction("tl.sum", wide.name, wide.pshape, dim), wide, dim, st)
        e.line(f"{st.name} = {st.name} + {total}")
    in_kernel = split > 1 and combine_in_kernel      # the outputs are written here, after the fold
    kept_outs = out_ranks if split == 1 or in_kernel else []
    params = _params(n_inputs, in_ranks, kept_outs, len(ws), loop, in_kernel, flat_pid, through)
    head = _header(name, params)
    outputs = [(_saved(bg, s, row_bound), s.attrs["dtype"]) for s in savers]
    if split > 1:
        j = 0
        for i in accs:
            for st in states[i]:       # the state's valid part only: padded rows are neither written nor read
                mask = e.mask(st.shape, st.trans)
                e.line(f"tl.store(ws{j}_ptr + ({_pid_flat(bg.grid)} * {split} + split) * {ws[j]} + "
                       f"{e.flat(st.pshape)}, {st.name}{f', mask={mask}' if mask else ''})")
                j += 1
        if in_kernel:
            tile = _pid_flat(bg.grid)
            e.line("tl.debug_barrier()")           # every thread's partial stores before the arrival (release)
            e.line(f"arrived = tl.atomic_add(cnt_ptr + {tile}, 1, sem='acq_rel')")
            e.line(f"if arrived == {split - 1}:")    # the tile's last program: the others' states are visible
            fold = _Emitter(bg, 0, 1, order, transposed, target, through)
            fold.indent, fold.count = e.indent + 1, e.count
            _fold_split(fold, bg, bg, accs, epi, ws, split, in_kernel=True)
            fold.line(f"tl.store(cnt_ptr + {tile}, 0)")    # ready for the next launch
            e.lines += fold.lines
            e.aranges |= fold.aranges
            return BlockKernel(_finish(e, head), name, None, tuple(bg.grid), split, ws, outputs, loop,
                               counters=math.prod(bg.grid), params=params, flat_pid=flat_pid, pdl=pdl)
        source = _finish(e, head)
        fine = combine or bg
        src = _emit_combine(bg, fine, name + "_combine", accs, epi, out_ranks, ws, split, order, transposed, target,
                            through, pdl)
        return BlockKernel(source + "\n\n" + src, name, name + "_combine", tuple(bg.grid), split, ws, outputs, loop,
                           tuple(fine.grid), params=params, pdl=pdl)
    for i in accs:
        for j, v in enumerate(_acc_final(e, bg, bg.ops[i], states[i])):
            e.put(env, Ref(i, j), v)
    _epilogue(e, bg, epi, env)
    return BlockKernel(_finish(e, head), name, None, tuple(bg.grid), 1, [], outputs, loop, params=params,
                       flat_pid=flat_pid, pdl=pdl)


def emit_sibling_kernel(name: str, parts: Sequence[BlockKernel], pdl: bool = False) -> str:
    """One kernel that runs independent block kernels ``parts`` (each emitted with ``flat_pid``) side by side: its
    programs are the parts' programs one after another (the first part's, then the second's, …), each running its
    part's body as a function call with its own program index. One launch for several graph-defined ops that do not
    read each other's outputs: a decode layer's q and k / v projections stream their weights as one kernel, and
    the fixed cost of a launch is paid once. Parameters: each part's, prefixed ``p{j}_``. ``pdl``: the launch first
    waits for its predecessor and lets its dependents launch (:mod:`.dependent_launch`)."""
    if any(not k.flat_pid or k.combine for k in parts):
        raise CodegenError("μGraph codegen: a sibling launch's parts are single kernels emitted with flat_pid")
    params, calls, start = [], [], 0
    for j, k in enumerate(parts):
        own = [p.split(":")[0] for p in k.params]
        params += [f"p{j}_{p}" for p in k.params if p != "lin"]
        calls.append((start, f"{k.name}({_offset_args(own, j, start)})"))
        start += math.prod(k.grid) * k.split
    lines = _header(name, params) + ["    lin = tl.program_id(0)"]
    lines += [f"    {line}" for line in WAIT_LINES] if pdl else []
    for n, (_, call) in enumerate(calls):
        depth = "    " * (n + 1)
        if n < len(calls) - 1:
            lines.append(f"{depth}if lin < {calls[n + 1][0]}:")
            lines.append(f"{depth}    {call}")
            lines.append(f"{depth}else:")
        else:
            lines.append(f"{depth}{call}")
    return "\n".join(lines) + "\n"


def _offset_args(own: Sequence[str], j: int, start: int) -> str:
    """A part's call arguments: its parameters as the sibling kernel names them, its program ``lin - start``."""
    return ", ".join((f"lin - {start}" if start else "lin") if p == "lin" else f"p{j}_{p}" for p in own)


def _walked_tile(bg: BlockGraph) -> int | None:
    """The walked dim's tile (elements a for-loop step covers), where no grid dim splits that dim (each program's
    steps start at its first element), else None."""
    walked = [op for op in bg.iterators if op.attrs["fmap"] is not None]
    if not walked or any(m == op.attrs["fmap"] for op in walked for m in op.attrs["imap"]):
        return None
    return walked[0].shapes[0][walked[0].attrs["fmap"]]


def _peel_ragged_tail(segments: Sequence[tuple[str, str, bool]], whole: int) -> list[tuple[str, str, bool, bool]]:
    """Each loop segment ``(lo, hi, full)`` of a ragged walk cut at step ``whole`` (the steps whose tiles lie wholly
    inside the walked extent) into ``(lo, hi, full, bounded)``: the steps before it load and score unbounded, the
    ones from it on (the ragged last tile, where a segment reaches it) with the extent's bound. Loop bounds known
    here fold to numbers; run-time ones (a split's share, a band's) become ``tl.minimum`` / ``tl.maximum``."""
    def at_most(a: str) -> str:
        return str(min(int(a), whole)) if a.isdigit() else f"tl.minimum({a}, {whole})"

    def at_least(a: str) -> str:
        return str(max(int(a), whole)) if a.isdigit() else f"tl.maximum({a}, {whole})"

    out = []
    for lo, hi, full in segments:
        inner, tail = at_most(hi), at_least(lo)
        if not (inner.isdigit() and lo.isdigit() and int(inner) <= int(lo)):
            out.append((lo, inner, full, False))
        if not (tail.isdigit() and hi.isdigit() and int(hi) <= int(tail)):
            out.append((tail, hi, full, True))
    return out


def _band_bounds(e: _Emitter, bg: BlockGraph, lo: str, hi: str) -> list[tuple[str, str, bool]]:
    """The block's loop under ``bg.forloop_band`` (the arithmetic of :func:`~torch_mirage.ugraph.band_range` and
    :func:`~torch_mirage.ugraph.band_full` on program ids), as ``(lo, hi, full)`` segments covering the first to
    one past the last iteration whose key tile holds a key visible from one of the block's query rows, within
    ``[lo, hi)`` (a split's share of the loop). Where the band has a ``zero_input`` (the mask is 0 wherever the
    band sees), the tiles every row sees whole are one segment of their own (``full``: the mask is neither loaded
    nor added there), between the partly seen edge tiles (the causal diagonal; a window's lower edge)."""
    b = band_geometry(bg)
    start = " + ".join(f"pid_{g} * {n}" for g, n in b["q_starts"]) or "0"
    rows, period, t, off = b["q_rows"], b["period"], b["k_tile"], b["offset"]
    unpacked = e.row_bound is not None and period == e.row_bound[1]     # ragged row blocks of one head's rows
    if period % rows == 0 or unpacked:
        e.line(f"band_p0 = ({start}) % {period}")
        e.line(f"band_p1 = band_p0 + {rows - 1}")
    else:                               # rows of several query positions' residues: the whole period
        e.line("band_p0 = 0")
        e.line(f"band_p1 = {period - 1}")
    e.line("band_kb = " + (" + ".join(f"pid_{g} * {n}" for g, n in b["k_starts"]) or "0"))
    e.line(f"band_hi = tl.minimum({hi}, tl.maximum(band_p1 + {off + t} - band_kb, 0) // {t})")
    if b["window"] is not None:
        e.line(f"band_lo = tl.maximum({lo}, tl.maximum(band_p0 + {off - b['window'] + 1} - band_kb, 0) // {t})")
        lo = "band_lo"
    if b["zero_input"] is None:
        return [(lo, "band_hi", False)]
    e.band_zero = b["zero_input"]
    e.band = b if b["index_mask"] else None
    # full tiles: the last key <= band_p0 + offset (and with a window the first key >= band_p1 + offset - window + 1)
    f0 = lo
    if b["window"] is not None:
        e.line(f"band_f0 = tl.minimum(tl.maximum({lo}, tl.maximum(band_p1 + {off - b['window'] + 1 + t - 1} - band_kb, 0)"
               f" // {t}), band_hi)")
        f0 = "band_f0"
    e.line(f"band_f1 = tl.maximum(tl.minimum(tl.maximum(band_p0 + {off + 1} - band_kb, 0) // {t}, band_hi), {f0})")
    edges = [(lo, f0, False)] if b["window"] is not None else []
    return edges + [(f0, "band_f1", True), ("band_f1", "band_hi", False)]


def scanned_mask(bg: BlockGraph) -> int | None:
    """The iterator (op index) a mask scan reads: where the block graph has a table of the mask's tiles
    (``forloop_scan``), the table's; else that of the mask itself (:func:`_walked_mask`). None where there is no
    mask to scan or a static band already bounds the loop."""
    if (m := _walked_mask(bg)) is None or bg.forloop_scan is None:
        return m
    t = next((i for i, it in enumerate(bg.ops) if it.name == "iterator"
              and it.attrs["index"] == bg.forloop_scan and it.attrs["fmap"] is not None), None)
    return t if t is not None and _table_aligned(bg.ops[m], bg.ops[t]) else None


def _table_aligned(mask: Op, table: Op) -> bool:
    """Whether each program's tile of the mask's table (a square row's maxima, then its sums: twice the square
    rows) covers exactly its tile of the mask: whole squares, rows and keys (a re-tiling to blocks smaller than a
    square is not scanned)."""
    (rows, keys), (t_rows, t_keys) = mask.attrs["shape"][-2:], table.attrs["shape"][-2:]
    (r, k), (tr, tk) = strip(mask.shapes[0])[0][-2:], strip(table.shapes[0])[0][-2:]
    if 2 * rows % t_rows or keys % t_keys or tr % 2:
        return False
    return r == tr // 2 * (2 * rows // t_rows) and k == tk * (keys // t_keys)


def _walked_mask(bg: BlockGraph) -> int | None:
    """The iterator (op index) of the mask attention scores take last, where a tile whose mask is masked for
    every row and key of it adds exactly nothing and may be skipped: the scores are ``add(s, mask)`` or
    ``where(keep, s, -inf)`` with the mask's tile walked by the for-loop, taken by an online softmax or by a sum
    of ``exp(scores − m) / l`` (a column pass: ``l > 0`` for every row that sees a key; masked means -inf:
    ``exp(-inf − m) = 0``; a finite floor such as ``finfo.min`` is not skipped, since a row that sees no key
    averages over every key there). None where there is no such mask or a static band bounds the loop."""
    if bg.forloop_band is not None:
        return None
    for op in bg.ops:
        if op.name == "acc_online_softmax":
            score = bg.ops[op.inputs[0][0]]
        elif op.name == "acc_sum" and (i := _exp_scores(bg, op.inputs[0][0])) is not None:
            score = bg.ops[i]
        else:
            continue
        if score.name == "add":
            terms = [r[0] for r in score.inputs]
        elif score.name == "where" and score.attrs["value"] == float("-inf"):
            terms = [score.inputs[0][0]]
        else:
            return None
        walked = [i for i in terms if bg.ops[i].name == "iterator" and bg.ops[i].attrs["fmap"] is not None]
        return walked[0] if len(walked) == 1 else None
    return None


def _exp_scores(bg: BlockGraph, i: int) -> int | None:
    """The op whose value ``x`` op ``i`` computes as ``exp(c·x − m) / l`` (scalar factors outside the exp, and
    ``c > 0`` inside; ``m`` and ``l`` anything), so that ``x = -inf`` gives exactly 0; None where it is not that
    form."""
    op = bg.ops[i]
    while op.name in ("div", "scalar_mul"):
        i = op.inputs[0][0]
        op = bg.ops[i]
    if op.name != "exp":
        return None
    i = op.inputs[0][0]
    while bg.ops[i].name == "sub" or (bg.ops[i].name == "scalar_mul" and bg.ops[i].attrs["value"] > 0):
        i = bg.ops[i].inputs[0][0]
    return i


def _scanned_bounds(e: _Emitter, bg: BlockGraph, op: Op, lo: str, hi: str) -> list[tuple[str, str, bool]]:
    """Lines that read the block's tiles of iterator ``op`` (the mask, or its tile table) over ``[lo, hi)`` (a
    split's share of the loop) and bound the loop by the first and one past the last tile holding an entry that
    is not masked; a block whose rows see no key there walks nothing (``l = 0``, as after walking tiles that add
    nothing). Each tile position keeps the first and last step it was seen at, elementwise (no reduction per
    step over a mask tile: H100, 11-27, a whole-tile ``tl.max`` per step made the scan cost a third of a 1024-key
    soft-capped prefill); two reductions after the loop give the bounds. Returns ``(lo, hi, full)`` segments.

    With a table (:func:`~torch_mirage.superopt.attention_seeds.mask_tile_table`: each mask square's max and sum,
    a few entries per step, so a per-step reduction is cheap) the first run of tiles whose mask is all 0 (max and
    sum 0) is a segment of its own (``full``): there the mask is neither loaded nor added (a causal mask's tiles
    left of the diagonal)."""
    bool_mask = op.attrs["dtype"] == "bool"
    tabled = bg.forloop_scan is not None and op.attrs["index"] == bg.forloop_scan
    shape = tuple(padded(x) for x in strip(op.shapes[0])[0])
    e.line(f"scan_first = tl.zeros({shape}, tl.int32) + ({hi})")
    e.line(f"scan_last = tl.zeros({shape}, tl.int32) + ({lo})")
    if tabled:
        e.line(f"zero_lo = tl.full((), {hi}, tl.int32)")
        e.line(f"zero_hi = tl.full((), {hi}, tl.int32)")
    e.line(f"for scan_it in tl.range({lo}, {hi}):")
    e.indent += 1
    tile = e.load_iterator(op, "scan_it", other="0" if bool_mask else NEG_INF)   # padding is not seen
    # != -inf, not > -inf: a NaN entry is seen (eager's NaN reaches its rows)
    e.line(f"seen = {tile.name} != 0" if bool_mask else f"seen = {tile.name} != {NEG_INF}")
    e.line(f"scan_first = tl.minimum(scan_first, tl.where(seen, scan_it, {hi}))")
    e.line("scan_last = tl.where(seen, scan_it + 1, scan_last)")
    if tabled:      # the tile again, its padding read as 0 (no square there); NaN != 0 is not zero
        zeros = e.load_iterator(op, "scan_it", other="0.0")
        e.line(f"zero = tl.max(tl.where({zeros.name} == 0, 0, 1)) == 0")
        e.line(f"zero_start = zero & (zero_lo == {hi})")
        e.line("zero_hi = tl.where(zero_start | (zero & (zero_hi == scan_it)), scan_it + 1, zero_hi)")
        e.line("zero_lo = tl.where(zero_start, scan_it, zero_lo)")
    e.indent -= 1
    e.line("scan_lo = tl.min(scan_first)")
    e.line("scan_hi = tl.max(scan_last)")
    if not tabled:
        return [("scan_lo", "scan_hi", False)]
    # the zero run lies inside [scan_lo, scan_hi) where there is one; else both ends are scan_hi (empty)
    e.line("zero_lo = tl.minimum(tl.maximum(zero_lo, scan_lo), scan_hi)")
    e.line("zero_hi = tl.minimum(tl.maximum(zero_hi, zero_lo), scan_hi)")
    e.band_zero = bg.ops[_walked_mask(bg)].attrs["index"]
    return [("scan_lo", "zero_lo", False), ("zero_lo", "zero_hi", True), ("zero_hi", "scan_hi", False)]


def heaviest_first(bg: BlockGraph, split: int, mask_scan: bool = False) -> frozenset:
    """Grid dims whose program ids the kernel walks in reverse: under a causal band (no window) a query block's
    loop grows with its start, and CUDA starts programs in id order, so the longest blocks run first and the
    last wave holds the shortest (a short tail). A launch that scans a mask's tile table (``mask_scan``) over
    key tiles walks its query blocks in reverse as well: a passed-in mask is most often causal; a mask with no
    such structure loses nothing by the order."""
    if bg.forloop_band is None:
        if not (mask_scan and bg.forloop_scan is not None and (m := _walked_mask(bg)) is not None):
            return frozenset()
        it = bg.ops[m].attrs
        rank = len(it["shape"])
        if it["fmap"] != rank - 1 or split > 1:       # keys walked (not a column pass over query tiles)
            return frozenset()
        return frozenset(g for g, d in enumerate(it["imap"]) if d == rank - 2)
    b = band_geometry(bg)
    if b["window"] is not None or b["period"] % b["q_rows"]:
        return frozenset()
    return frozenset(g for g, _ in b["q_starts"] if not (g == 0 and split > 1))


def _phase_of(bg: BlockGraph) -> list[int]:
    """Each op's phase: 0 before the for-loop (hoisted), 1 in it (accumulators too), 2 after it."""
    body, _ = bg.phases()
    var = _variant(bg)
    inside = set(body)
    return [(1 if var[i] or bg.ops[i].spec.kind == "accum" else 0) if i in inside else 2 for i in range(len(bg.ops))]


def _raw_terms(bg: BlockGraph, ref) -> set[int]:
    """Indices of the iterators whose tiles reach ``ref`` other than through a matmul (an additive mask or bias
    of attention scores)."""
    out, seen, stack = set(), set(), [ref[0]]
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        op = bg.ops[i]
        if op.name == "iterator":
            out.add(op.attrs["index"])
        elif op.name != "matmul":
            stack.extend(r[0] for r in op.inputs)
    return out


def _saved(bg: BlockGraph, s: Op, row_bound: tuple[int, int] | None = None) -> tuple:
    """The shape of the kernel tensor saver ``s`` writes: its tiles over the grid; the dim grid dim
    ``row_bound[0]`` maps cut to ``row_bound[1]`` (ragged row blocks run past the tensor's rows)."""
    tile = bg.shape(s.inputs[0])
    shape = tuple(t * math.prod(bg.grid[g] for g, m in enumerate(s.attrs["omap"]) if m == d)
                  for d, t in enumerate(tile))
    if row_bound is None or (d := s.attrs["omap"][row_bound[0]]) is None:
        return shape
    return tuple(min(x, row_bound[1]) if k == d else x for k, x in enumerate(shape))


def _emit_combine(bg: BlockGraph, fine: BlockGraph, name: str, accs, epi, out_ranks, ws, split: int, order=None,
                  transposed=None, target: Target = Target.INTERPRETER, through: Sequence[StoreThrough] = (),
                  pdl: bool = False) -> str:
    """The kernel after a split op: fold the ``split`` partial states, finals, epilogue, savers. It runs on
    ``fine``'s grid (``bg``'s, or one dim of it multiplied: see ``launch.combine_tiling``); a program there
    reads its chunk of the states its program of ``bg`` wrote."""
    ratio = tuple(f // c for f, c in zip(fine.grid, bg.grid))
    e = _Emitter(fine, 0, 1, order, transposed, target, through)
    _pids(e, fine.grid, 1)
    for g, r in enumerate(ratio):
        if r > 1:
            e.line(f"chunk = pid_{g} % {r}")
    for line in WAIT_LINES if pdl else ():
        e.line(line)
    e.pid_lines = len(e.lines)
    _fold_split(e, bg, fine, accs, epi, ws, split)
    params = [p for j, r in enumerate(out_ranks) for p in [f"out{j}_ptr"] + [f"out{j}_s{d}" for d in range(r)]]
    params += _through_params(through) + [f"ws{j}_ptr" for j in range(len(ws))]
    return _finish(e, _header(name, params))


# A fold of up to FOLD_UNROLLED split states is unrolled whole; of more, it walks them in unrolled chunks of
# FOLD_CHUNK (a first chunk, then a loop of chunks). Triton's compile time grows faster than the unrolled length
# (sm_90, decode attention's fold of 16 x 128 states, benchmarks/compile_time_cpu.py: 16 splits 1.6 s, 32 4.2 s,
# 64 18 s whole; 32 or 64 in chunks of 8, 1.6 s), and the H100 tuner has kept 16 or fewer where it timed more.
FOLD_UNROLLED = 16
FOLD_CHUNK = 8


def _fold_split(e: _Emitter, bg: BlockGraph, fine: BlockGraph, accs, epi, ws, split: int, in_kernel: bool = False) -> None:
    """Lines that fold the ``split`` partial states of each accumulator (``ws{j}_ptr``, as the split programs of
    ``bg`` stored them) for the running program of ``fine`` (``pid_*`` bound), then its finals, epilogue and
    savers: the combine kernel's body, or the last arriving program's (``in_kernel``: its loads skip L1, read
    where the other programs' stores met: L2). Only the states' valid parts were stored and are read (a padded dim
    reads 0): FlashAttention's decode fold of 16 splits of 4 query rows padded to 16 would read 128 KiB per head in
    one program, 32 KiB of it valid."""
    cache = ", cache_modifier='.cg'" if in_kernel else ""
    ratio = tuple(f // c for f, c in zip(fine.grid, bg.grid))
    flat = _pid_flat(bg.grid, ratio)
    env: dict[Ref, Val] = {}
    k = 0
    for i in accs:
        op = bg.ops[i]
        coarse = [tuple(padded(x) for x in strip(s)[0]) for s in op.shapes]
        shapes = [strip(s)[0] for s in fine.ops[i].shapes]
        idx = range(k, k + len(shapes))
        k += len(shapes)

        def load(j: int, shape, s, full) -> str:
            offs = e.flat(tuple(padded(x) for x in shape), full)
            mask = e.mask(shape)     # padded rows (a decode head's 4 query rows in 16) are not read: 0 there
            return f"tl.load(ws{j}_ptr + ({flat} * {split} + {s}) * {ws[j]} + {offs}" + \
                (f", mask={mask}, other=0.0" if mask else "") + f"{cache})"
        states = [e.assign("acc", load(j, sh, 0, c), sh) for j, sh, c in zip(idx, shapes, coarse)]
        unroll = FOLD_CHUNK if split > FOLD_UNROLLED and split % FOLD_CHUNK == 0 else split
        e.line(f"for s in tl.static_range(1, {unroll}):")
        e.indent += 1
        others = [e.assign("w", load(j, sh, "s", c), sh) for j, sh, c in zip(idx, shapes, coarse)]
        _combine(e, op, states, others)
        e.indent -= 1
        if unroll < split:          # the rest in a loop of unrolled chunks: compile time stays that of one chunk
            e.line(f"for chunk in tl.range(1, {split // unroll}):")
            e.indent += 1
            e.line(f"for part in tl.static_range({unroll}):")
            e.indent += 1
            e.line(f"later = chunk * {unroll} + part")
            others = [e.assign("w", load(j, sh, "later", c), sh) for j, sh, c in zip(idx, shapes, coarse)]
            _combine(e, op, states, others)
            e.indent -= 2
        for n, v in enumerate(_acc_final(e, bg, op, states)):
            e.put(env, Ref(i, n), v)
    _epilogue(e, fine, epi, env)


def module_source(kernels: list[BlockKernel]) -> str:
    """One importable module holding the kernels of a μGraph."""
    head = '"""Generated by torch_mirage.codegen.ugraph_triton from a μGraph; do not edit."""\n' \
           "import triton\nimport triton.language as tl\n\n\n"
    return head + "\n\n".join(k.source for k in kernels)
