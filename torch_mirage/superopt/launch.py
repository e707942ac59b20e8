"""Launch parameters of a graph-defined kernel op: tile sizes, split, ``num_warps``, ``num_stages``.

A :class:`LaunchConfig` re-tiles a block graph (new grid sizes and for-loop range: the same imap / fmap /
omap, tile extents re-inferred by the op table), adds a kernel-level split of the for-loop (split-K /
split-KV) and picks Triton's ``num_warps`` / ``num_stages``. A re-tiling is accepted only if the op table
re-infers every shape and every saver keeps its kernel-output shape; :func:`choose` also checks each
candidate's output against the μGraph's own schedule on the real inputs before timing it.

On CUDA, :func:`choose` ranks candidates with a small roofline model (bytes each program loads, SM
occupancy, the combine kernel's cost), times the best few the way they will run — replayed in a CUDA graph
over input sets rotated past L2 (``do_bench`` where capture fails: its per-call events count the CPU launch
gaps, which favoured one-kernel configs over split ones) — and caches the winner in a :class:`~torch_mirage.cache.DiskCache` keyed by the block graph's hash (shapes and dtypes are
in it), the input strides and the device name. On the CPU / interpreter it returns the μGraph's own
schedule with a fixed small config, untimed. Autotuning stays here, apart from codegen.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Sequence

import torch

from ..cache import cache_key, source_digest
from ..codegen.ugraph_triton import ELEMENTWISE, _saved, padded, prologue_accumulators, scanned_mask, strip
from ..numerics import relative_error, same_non_finite, tolerance
from ..timing import cuda_graph_timing, rotated_input_sets
from ..tune import cached_choice, tune
from ..ugraph import BlockGraph, Ctx, MuGraphError, Op, ThreadGraph, grid_split, make_op
from .attention_seeds import decode_split_counts
from .library import DOT_MIN, tiles

log = logging.getLogger("torch_mirage")

TILES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
LOOP_TILES = (32, 64, 128, 256)
SPLITS = (1, 2, 4, 8, 16, 32)
WARPS_STAGES = ((4, 3), (8, 4))
# a deeper pipeline for long for-loops: weight streaming at small batch keeps more loads in flight per SM (H100,
# 2026-11-24: gated MLP 8×4096×4096 fp16 at 4 warps / 6 stages 25.1 µs, 0.89 of copy, against 28.0 at 4 / 3)
DEEP_PIPELINE = (4, 6)
DEEP_LOOP = 8                  # for-loop steps per program from which DEEP_PIPELINE is tried too
# one wave of programs, no split and no combine, the widest K tile that keeps DEEP_LOOP steps, 4 warps / 5 stages:
# the weight-streaming schedule of decode GEMVs (H100 probe, 11-25: 1-16 rows x 4096 x 4096 fp16 in 14.2 µs,
# 0.86 of copy, against 16.1 for the split-K + combine schedule the estimate ranked first)
STREAM_PIPELINE = (4, 5)
# weight bytes one program's for-loop step of that schedule loads: the K tile is the widest whose weight tiles stay
# within it (H100: the probe's one weight, 32 x 256 fp16, is 16 KiB; the gated MLP's two weights were fastest at
# 2 x 64 x 64 or 2 x 32 x 128, also 16 KiB per step, and slower at 2 x 32 x 256, its stream before 11-25 e)
STREAM_STAGE_BYTES = 16 * 1024
# the contiguous piece of each weight row a streamed tile should read (:func:`run_bytes`), and the loop tiles tried
# to get it: the one-wave stream keeps STREAM_STAGE_BYTES by narrowing the K tile, which for nn.Linear's (n, k)
# weight is the contiguous dim (H100 11-26, llama_layer_decode b1 bf16: gate / up in one kernel at 2 x 256 x 32
# tiles, 64-byte pieces, 128.3 µs against a floor of 78; a plain Triton GEMV over the same bytes reading 8 x 512
# tiles took 85.8). :func:`contiguous_streams` adds the unsplit re-tilings that read pieces this long, over waves.
STREAM_RUN_BYTES = 512
RUN_TILES = (256, 512)
# and whose tiles hold at least this many rows (a row per program reads too little), or exactly one over at most
# PROBE_WAVES[-1] waves: sides in between pad to 16 (H100 sweep 11-26 c, llama_layer_decode's k / v projection + RoPE
# in paired halves, 8 heads x 64 slices of one row, 4 rows of 1 x 512 per step: 8.84 µs at 1 / 4; 8 x 16 slices of
# 4 rows: 29-44; 8 x 4 slices of 16 rows need 8 splits to fill the SMs: 15.8 with its combine)
MIN_STREAM_TILE = 16
# (num_warps, num_stages) of those contiguous streams: few warps and few stages (H100 sweep 11-26, Llama-3-8B norm +
# gate / up 1 x 4096 x 2·14336 bf16, 896 programs of 16 x 512 or 16 x 256 tiles: 85.8-88.9 µs, 0.88-0.91 of copy, at
# 1 / 4 and 2 / 3, against 107.0-121.4 at 4 / 5; o_proj 1 x 4096 x 4096, 256 x 16 x 512: 14.5 against 15.5 at 4 / 4;
# 8-row tiles over 1792 programs: 108.4). The norm's sums in a loop of their own are timed at the first pair.
CONTIGUOUS_PIPELINES = ((2, 3), (1, 4))
WAVE_FILL = 0.9            # the fraction of the SMs a split-K of :func:`wave_split` fills
# that split-K is also timed at 2 warps / 3 stages (H100 sweep 11-26, norm + q projection + RoPE 1 x 4096 x 4096 bf16,
# 32 heads x 4 splits: 18.4 µs with its combine, against 20.0 at the 4 / 3 of WARPS_STAGES[0] and 20.6 at 8 / 3)
FILL_PIPELINE = (2, 3)
# (num_warps, num_stages) of the stream where the norm's sums walk a loop of their own, besides STREAM_PIPELINE: the
# dot loop then also reads x·g through registers (H100 sweep 11-25 e, RMSNorm + Linear 2 x 4096 x 4096 bf16: 18.3 µs
# at 4 / 5 against 14.1 for the bare GEMV, 29.0 with the sums in the dot loop); fewer stages and more warps are timed
PROLOGUE_PIPELINES = ((4, 3), (8, 5))
# prefill attention (an online softmax over a tile of many query rows, the for-loop over key tiles): FlashAttention's
# Hopper schedules as (query rows, keys per tile, num_warps, num_stages) — 128-row tiles on 8 warps, 64-128 keys,
# 2-4 stages — plus 64-row tiles for short sequences (more programs); they replace the roofline-ranked re-tilings
# (128 x 128 at 3 stages holds 192 KiB of K / V stages next to Q's 32 KiB: at H100's shared-memory limit, left out)
PREFILL_SCHEDULES = ((128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (64, 64, 4, 3))
# prefill attention whose schedules above leave SMs idle (few heads x few query blocks against many keys: the bench's
# gqa at b8, 16 heads x 256 rows over 4096 keys, 32 programs of 128 rows on 132 SMs): these of them are also timed
# with their keys split to fill one and two waves, the tile's last program folding the partial states in-kernel
# (one launch; the roofline re-tilings split with a combine kernel after them). H100 12-07, gqa b8: the tuner kept a
# folded launch, 19.0 µs in one kernel (19.2 in two on 11-27); the best of 120 launches swept, 18.85, had a combine
PREFILL_SPLIT_SCHEDULES = ((128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3))
# a column pass (FlashTensor's second pass for column sums of P: each program holds a block of keys, the for-loop walks
# the query tiles that see them) as (keys per program, query rows per step, num_warps, num_stages): the prefill
# schedules with the roles of rows and keys swapped, timed besides the roofline re-tilings (which keep 64-row steps
# on 4 warps; H100 11-27, bf16 h2o_core n=1024: the column pass 31.5 µs at 128 keys x 64 rows, 4 / 3, against the
# FlashAttention pass's 38.4)
COLUMN_SCHEDULES = ((128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3), (64, 128, 4, 3), (256, 64, 8, 2))
FILLED_SM_FRACTION = 2         # attention's own schedules are timed alone where one fills 1 / this many of the SMs
PREFILL_MIN_ROWS = 128         # query rows (per grid slice) from which a block graph counts as prefill attention
# split-KV decode attention (a few query rows — the query heads of one KV head — against one split of the cache; the
# seed fixed the split count): (keys per tile, num_warps, num_stages). A memory-bound stream of K / V tiles; 128 keys x
# d 128 at 3 stages holds 192 KiB of K / V stages, the most that fits shared memory (4 stages of 64 keys: 128 KiB)
DECODE_SCHEDULES = ((64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 8, 3))
# the schedules FlashAttention's decode launches split at (H100 11-26 c, llama_layer_decode b1 bf16, 8 KV heads x 4k
# keys: 16 splits of 64-key tiles at 4 / 3, folded in-kernel, 11.7 µs in one kernel against split-KV's 8.8 + 2.5)
DECODE_FOLD_SCHEDULES = 2
PROBE_WAVES = (2, 4)           # programs per SM of the extra candidates :func:`candidates` always adds
RAGGED_TILE = 64               # the tile edge an untuned launch walks ragged keys / rows in (untuned_config)
MAX_TILE = 128 * 128           # elements any block tile may hold (registers of one program)
MAX_STAGE_BYTES = 48 * 1024    # bytes one for-loop iteration loads (x num_stages must fit shared memory)
# programs the combine kernel after a split aims for: it reads every partial state once, so it wants the SMs
# full (H100 profile, 11-23: attention's combine on the partial kernel's 16 tiles folded 8.4 MB of fp32 states)
COMBINE_PROGRAMS = 256
COMBINE_CHUNKS = (2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class LaunchConfig:
    grid: tuple
    forloop_range: int
    split: int = 1
    num_warps: int = 4
    num_stages: int = 2
    prologue: bool = False    # matmul-free accumulators in a for-loop of their own (ugraph_triton.prologue_accumulators)
    sums_after: bool = False  # with prologue: that loop runs after the main loop, not before it
    combine_in_kernel: bool = False  # split > 1: a tile's last program folds its states (no combine kernel)
    mask_scan: bool = False   # each program bounds its loop by the key tiles its mask lets a row see (scanned_mask)
    ragged: int = 0           # the walked dim's extent the loop's tiles cover, past the tensors' own (0: theirs)
    ragged_rows: int = 0      # the query rows the row blocks cover, past the tensors' own (0: theirs)

    def to_json(self) -> dict:
        return {**asdict(self), "grid": list(self.grid)}

    @staticmethod
    def from_json(d: dict) -> "LaunchConfig":
        return LaunchConfig(**{**d, "grid": tuple(d["grid"])})


def default_config(bg: BlockGraph) -> LaunchConfig:
    """The μGraph's own schedule, no split: what every tuned launch is checked against (:func:`choose`)."""
    return LaunchConfig(tuple(bg.grid), bg.forloop_range)


def untuned_config(bg: BlockGraph) -> LaunchConfig:
    """The launch a compile that does not tune runs (the CPU interpreter, tests): the μGraph's own schedule, except
    where that walks attention's keys or blocks its query rows in tiles shorter than tl.dot's ``DOT_MIN`` because
    no longer tile divides them (131, a prime: one key a step, one row a program) — then whole ``RAGGED_TILE``-long
    tiles with a ragged last one (:func:`ragged_walk`, :func:`ragged_rows`), the float check against eager judging
    the region as for any launch."""
    own = default_config(bg)
    grid, steps, walked, rows = list(bg.grid), bg.forloop_range, 0, 0

    def undivided(extent: int, parts: int) -> bool:     # short tiles, and no tile up to 2 · RAGGED_TILE is longer
        return extent // parts < DOT_MIN <= extent and extent // tiles(extent, RAGGED_TILE) < DOT_MIN
    keys = ragged_walk(bg)
    if keys is not None and undivided(keys, bg.forloop_range) and (walk := ragged_steps(keys, RAGGED_TILE)):
        steps, walked = walk
    row_dim = ragged_rows(bg)
    if row_dim is not None and undivided(row_dim[1], bg.grid[row_dim[0]]) and \
            (cut := ragged_steps(row_dim[1], RAGGED_TILE)):
        grid[row_dim[0]], rows = cut
    if not walked and not rows:
        return own
    config = LaunchConfig(tuple(grid), steps, ragged=walked, ragged_rows=rows)
    return config if launch_tiling(bg, config) is not None else own


# ------------------------------------------------------------------ re-tiling
def _rebody(tg: ThreadGraph, in_shapes, in_dtypes) -> ThreadGraph:
    ops = []
    for op in tg.ops:
        if op.name == "input":
            i = op.attrs["index"]
            ops.append(make_op("input", [], [], [], {**op.attrs, "shape": tuple(in_shapes[i])}))
            continue
        ops.append(make_op(op.name, op.inputs, [ops[r[0]].shapes[r[1]] for r in op.inputs],
                           [ops[r[0]].dtypes[r[1]] for r in op.inputs], dict(op.attrs)))
    return ThreadGraph(ops=tuple(ops), outputs=tg.outputs)


def retile(bg: BlockGraph, grid: Sequence[int], forloop_range: int, walked: int = 0, rows: int = 0
           ) -> BlockGraph | None:
    """``bg`` with a new grid and for-loop range, or None where that changes what the op computes
    (a shape rule fails, a saver's output shape changes, or an iterator's reads become shared by programs or stop
    being shared: :func:`~torch_mirage.ugraph.grid_split`). ``walked``: the iterators the for-loop walks read
    that many elements along the walked dim, past their tensors' own extent (:func:`ragged_walk`; 0: their own);
    ``rows``: likewise the query rows' grid dim (:func:`ragged_rows`), its savers' tiles cover that many rows."""
    grid = tuple(int(g) for g in grid)
    if grid == tuple(bg.grid) and forloop_range == bg.forloop_range and not walked and not rows:
        return bg
    row_dim = ragged_rows(bg) if rows else None
    if rows and (row_dim is None or rows < row_dim[1]):
        return None
    ctx = Ctx(grid, int(forloop_range))
    ops: list = []
    try:
        for op in bg.ops:
            shapes = [ops[r[0]].shapes[r[1]] for r in op.inputs]
            dtypes = [ops[r[0]].dtypes[r[1]] for r in op.inputs]
            body = _rebody(op.body, shapes, dtypes) if isinstance(op.body, ThreadGraph) else op.body
            attrs = dict(op.attrs)
            if walked and op.name == "iterator" and attrs["fmap"] is not None:
                attrs["shape"] = tuple(walked if d == attrs["fmap"] else x for d, x in enumerate(attrs["shape"]))
            if row_dim is not None and op.name == "iterator":
                attrs["shape"] = tuple(rows if d in _mapped_dims(attrs["imap"], row_dim[0]) else x
                                       for d, x in enumerate(attrs["shape"]))
            ops.append(make_op(op.name, op.inputs, shapes, dtypes, attrs, body, ctx))
    except MuGraphError:
        return None
    new = BlockGraph(ops=tuple(ops), grid=grid, forloop_range=int(forloop_range), forloop_band=bg.forloop_band,
                     forloop_scan=bg.forloop_scan)
    if [_saved(new, s, row_dim) for s in new.savers] != [_saved(bg, s) for s in bg.savers] \
            or _shared(new) != _shared(bg):
        return None
    return new


def _mapped_dims(imap, g: int) -> set[int]:
    """The tensor dim grid dim ``g`` maps in an ``imap`` / ``omap`` (none: φ, replicated)."""
    return set() if imap[g] is None else {imap[g]}


def ragged_walk(bg: BlockGraph) -> int | None:
    """The extent of the dim the for-loop walks where a launch may walk it in whole tiles with a ragged last one
    (``LaunchConfig.ragged``), else None. That is online-softmax attention: the walked iterators (keys, values, a
    mask's or bias's key columns) share the extent, the online softmax is the only accumulator over it, so that
    keys past the end — read as 0, their scores -inf (:func:`~torch_mirage.codegen.ugraph_triton.emit_block_kernel`'s
    ``walked_extent``) — add nothing; no saver stores along it (a column-sum pass does) and no table of mask tiles
    bounds the loop."""
    accumulators = [op.name for op in bg.ops if op.name.startswith("acc_")]
    if bg.forloop_scan is not None or accumulators != ["acc_online_softmax"]:
        return None
    if _attention_iterators(bg) is None:
        return None
    extents = {op.attrs["shape"][op.attrs["fmap"]] for op in bg.iterators if op.attrs["fmap"] is not None}
    return extents.pop() if len(extents) == 1 else None


def ragged_rows(bg: BlockGraph) -> tuple[int, int] | None:
    """``(grid dim, query rows)`` where a launch may cut online-softmax attention's query rows into whole blocks
    with a ragged last one (``LaunchConfig.ragged_rows``), else None: the attention of :func:`ragged_walk`, its
    query rows one grid dim, which maps only dims of as many rows (Q's, a mask's; K and V are read whole by
    every row block) and the rows of every saver."""
    if ragged_walk(bg) is None:
        return None
    q, k, rows_dim, _ = _attention_dims(bg)
    gs = [g for g, m in enumerate(q.attrs["imap"]) if m == rows_dim]
    if len(gs) != 1:
        return None
    g, rows = gs[0], q.attrs["shape"][rows_dim]
    if any(op.attrs["shape"][d] != rows for op in bg.iterators for d in _mapped_dims(op.attrs["imap"], g)) \
            or not all(_mapped_dims(s.attrs["omap"], g) for s in bg.savers):
        return None
    return g, rows


def launch_tiling(bg: BlockGraph, config: LaunchConfig) -> BlockGraph | None:
    """The block graph ``config`` launches: :func:`retile` at its grid and for-loop range, the walked dim read at
    ``config.ragged`` elements and the query rows' blocks at ``config.ragged_rows`` where it sets those; None where
    it does not re-tile ``bg`` (a split of ragged row blocks: its combine kernel stores whole blocks)."""
    keys = ragged_walk(bg) if config.ragged else None
    if config.ragged and (keys is None or config.ragged < keys or config.mask_scan):
        return None
    if config.ragged_rows and (config.split > 1 or config.mask_scan):
        return None
    return retile(bg, config.grid, config.forloop_range, config.ragged, config.ragged_rows)


def launch_bounds(bg: BlockGraph, config: LaunchConfig) -> dict:
    """What :func:`~torch_mirage.codegen.ugraph_triton.emit_block_kernel` needs to know of ``config``'s ragged
    tiles: ``walked_extent`` (the keys the tensors hold) and ``row_bound`` (the query rows' grid dim and the rows
    the tensors hold)."""
    return {"walked_extent": ragged_walk(bg) if config.ragged else None,
            "row_bound": ragged_rows(bg) if config.ragged_rows else None}


def ragged_steps(extent: int, tile: int, multiple: int = 1) -> tuple[int, int] | None:
    """``(for-loop steps, extent they cover)`` of whole ``tile``-long steps over ``extent`` with a ragged last one,
    the steps a multiple of ``multiple`` (a split's), or None where ``tile`` divides ``extent`` (no ragged tile)."""
    if extent % (tile * multiple) == 0:
        return None
    steps = -(-extent // (tile * multiple)) * multiple
    return steps, steps * tile


def _shared(bg: BlockGraph) -> set[tuple[int, int]]:
    """(iterator, grid dim) pairs where consecutive programs share the iterator's elements (GQA's KV heads read by
    the programs of a query-head group)."""
    return {(it.attrs["index"], g) for it in bg.iterators for g, d in enumerate(it.attrs["imap"])
            if d is not None and grid_split(it.attrs["shape"][d], bg.grid[g])[0] > 1}


def _elementwise(op) -> bool:
    if op.name == "thread":
        return all(o.name == "input" or o.name in ELEMENTWISE for o in op.body.ops)
    return op.name in ELEMENTWISE


def combine_tiling(bg: BlockGraph, split: int, programs: int = COMBINE_PROGRAMS) -> BlockGraph:
    """The block graph whose grid the combine kernel after a ``split`` of ``bg`` runs on: ``bg`` with one grid
    dim multiplied by the smallest chunk count that gives at least ``programs`` programs (else the most
    programs), or ``bg`` itself. A chunking is used only where it cuts each accumulator state along one dim
    into equal power-of-two parts (so a program's part is a slice of what one partial program wrote), of at
    least 16 along the state's last dim (:func:`_chunks_states`), and the ops after the accumulators that the
    chunking reshapes are elementwise (a reduction or matmul over the chunked dim would see a part of its
    operand)."""
    if split <= 1 or math.prod(bg.grid) >= programs:
        return bg
    body, epi = bg.phases()
    accs = [i for i in body if bg.ops[i].spec.kind == "accum"]
    best = bg
    for r in COMBINE_CHUNKS:
        for g in range(len(bg.grid)):
            fine = retile(bg, tuple(x * r if k == g else x for k, x in enumerate(bg.grid)), bg.forloop_range)
            if fine is None or not _chunks_states(bg, fine, accs, r):
                continue
            if any(fine.ops[i].shapes != bg.ops[i].shapes and not _elementwise(bg.ops[i])
                   for i in epi if bg.ops[i].name != "saver"):
                continue
            if math.prod(fine.grid) > math.prod(best.grid):
                best = fine
            if math.prod(fine.grid) >= programs:
                return fine
    return best


def _chunks_states(bg: BlockGraph, fine: BlockGraph, accs, r: int) -> bool:
    """Whether ``fine`` cuts every accumulator state of ``bg`` along at most one dim into ``r`` power-of-two
    parts, of at least 16 along the state's last (contiguous) dim — a program then reads whole rows of 32+ bytes
    — and of any size along another (an attention state's query rows: H100 11-26, the searched gqa b1 fp16 with
    16 key splits folded 64-row states on 32 programs in 4.6 µs, the library's one row per program on 512 in 3.0)."""
    for i in accs:
        for cs, fs in zip(bg.ops[i].shapes, fine.ops[i].shapes):
            (c, _), (f, _) = strip(cs), strip(fs)
            if len(c) != len(f):
                return False
            cut = [(d, a, b) for d, (a, b) in enumerate(zip(c, f)) if a != b]
            if len(cut) > 1 or any(a != b * r or padded(a) != a or padded(b) != b or (b < 16 and d == len(c) - 1)
                                   for d, a, b in cut):
                return False
    return True


# ------------------------------------------------------------------ candidates
def _grid_choices(bg: BlockGraph, g: int) -> list[int]:
    for it in bg.iterators:
        d = it.attrs["imap"][g]
        if d is None:
            continue
        extent = it.attrs["shape"][d]
        if extent // bg.grid[g] <= 1:
            return [bg.grid[g]]          # a dim split to single elements (heads, batch; or shared: KV heads): leave it
        return sorted({extent // t for t in TILES if extent % t == 0} | {bg.grid[g]})
    return [bg.grid[g]]


def _loop_choices(bg: BlockGraph, grid, tiles: Sequence[int] = LOOP_TILES) -> list[int]:
    for it in bg.iterators:
        d = it.attrs["fmap"]
        if d is None:
            continue
        extent = it.attrs["shape"][d]
        for g, m in enumerate(it.attrs["imap"]):
            if m == d:
                extent //= grid[g]
        return sorted({extent // t for t in tiles if extent % t == 0 and extent >= t} | {bg.forloop_range})
    return [bg.forloop_range]


def _tile_bytes(it: Op) -> int:
    size = 2 if it.attrs["dtype"] in ("float16", "bfloat16") else 4
    return math.prod(padded(x) for x in it.shapes[0]) * size


def _streamed(bg: BlockGraph) -> list[Op]:
    """The iterators that the grid splits and the loop walks: a weight-streaming kernel's weights."""
    return [it for it in bg.iterators if it.attrs["fmap"] is not None and any(m is not None for m in it.attrs["imap"])]


def streamed_bytes(bg: BlockGraph) -> int:
    """Bytes one for-loop step of a program loads from the iterators that the grid splits and the loop walks: the
    weight tiles of a weight-streaming kernel (the activation rows every program reads are not counted)."""
    return sum(_tile_bytes(it) for it in _streamed(bg))


def run_bytes(bg: BlockGraph) -> int:
    """The shortest piece of contiguous memory a streamed tile reads per row: its last dim (the stored tensor's
    contiguous one) in bytes — the K tile for ``nn.Linear``'s (n, k) weight, the N tile for a (k, n) one."""
    return min((padded(it.shapes[0][-1]) * _tile_bytes(it) // math.prod(padded(x) for x in it.shapes[0])
                for it in _streamed(bg)), default=0)


def estimate_us(bg: BlockGraph, split: int, n_sm: int, bandwidth: float = 3.0e6) -> float | None:
    """A roofline guess in µs: bytes all programs load at the achieved occupancy, a per-iteration cost and
    the combine kernel; None where a tile would not fit registers or one stage would not fit shared memory."""
    if any(math.prod(padded(x) for x in s) > MAX_TILE for op in bg.ops for s in op.shapes):
        return None
    programs = math.prod(bg.grid) * split
    per_program = stage = 0
    for it in bg.iterators:
        tile_bytes = _tile_bytes(it)
        if it.attrs["fmap"] is not None:
            stage += tile_bytes
            per_program += tile_bytes * (bg.forloop_range // split)
        else:
            per_program += tile_bytes
    if stage > MAX_STAGE_BYTES:
        return None
    states = [math.prod(padded(x) for x in s) for op in bg.ops if op.spec.kind == "accum" for s in op.shapes]
    occupancy = min(1.0, programs / n_sm)
    t = per_program * programs / (bandwidth * occupancy) + 0.02 * (bg.forloop_range // split)
    if split > 1:
        t += 2.0 + 2 * sum(states) * 4 * programs / bandwidth
    return t


def _along_first_inputs(bg: BlockGraph, i: int, name: str) -> Op | None:
    """The first op named ``name`` met walking from op ``i`` along first inputs (through transposes, scalings,
    norms), or None."""
    while bg.ops[i].name != name:
        if not bg.ops[i].inputs:
            return None
        i = bg.ops[i].inputs[0][0]
    return bg.ops[i]


def _attention_iterators(bg: BlockGraph) -> tuple[Op, Op] | None:
    """The query and key iterators of an online softmax whose scores are one matmul of a query tile (not walked by
    the for-loop) by a key tile walked by the for-loop, else None."""
    acc = next((op for op in bg.ops if op.name == "acc_online_softmax"), None)
    if acc is None:
        return None
    mm = _along_first_inputs(bg, acc.inputs[0][0], "matmul")
    if mm is None:
        return None
    q, k = (_along_first_inputs(bg, r[0], "iterator") for r in mm.inputs)
    if q is None or k is None or q.attrs["fmap"] is not None or k.attrs["fmap"] is None:
        return None
    return q, k


def _attention_dims(bg: BlockGraph) -> tuple | None:
    """``(query iterator, key iterator, the query rows' dim, the key dim the loop walks)`` of an online-softmax
    block graph (:func:`_attention_iterators`), else None."""
    found = _attention_iterators(bg)
    if found is None:
        return None
    q, k = found
    return q, k, len(q.attrs["shape"]) - 2, k.attrs["fmap"]


def prefill_attention(bg: BlockGraph) -> tuple[int, int, int] | None:
    """``(grid dim of the query rows, query rows, keys)`` where ``bg`` is prefill attention — an online softmax
    whose scores are one matmul of a query tile (not walked by the loop, its rows one grid dim, at least
    ``PREFILL_MIN_ROWS`` of them) by a key tile walked by the loop (no grid dim over keys) — else None."""
    found = _attention_dims(bg)
    if found is None:
        return None
    q, k, rows_dim, kd = found
    gs = [g for g, m in enumerate(q.attrs["imap"]) if m == rows_dim]
    if len(gs) != 1 or any(m == kd for m in k.attrs["imap"]) or q.attrs["shape"][rows_dim] < PREFILL_MIN_ROWS:
        return None
    return gs[0], q.attrs["shape"][rows_dim], k.attrs["shape"][kd]


def column_pass(bg: BlockGraph) -> tuple[int, int, int] | None:
    """``(grid dim of the keys, keys, query rows)`` where ``bg`` sums over its for-loop a function of one matmul
    of a query tile walked by the loop by a key tile that is not (its keys one grid dim, none walked) — a column
    pass: each program a block of keys, the query tiles summed — else None."""
    acc = next((op for op in bg.ops if op.name == "acc_sum"), None)
    mm = next((op for op in bg.ops if op.name == "matmul"), None)
    if acc is None or mm is None or sum(op.name == "matmul" for op in bg.ops) != 1:
        return None
    q, k = (_along_first_inputs(bg, r[0], "iterator") for r in mm.inputs)
    if q is None or k is None or q.attrs["fmap"] is None or k.attrs["fmap"] is not None:
        return None
    qd, kd = q.attrs["fmap"], len(k.attrs["shape"]) - 2          # the rows the loop walks; K's key dim
    gs = [g for g, m in enumerate(k.attrs["imap"]) if m == kd]
    if len(gs) != 1 or any(m == qd for m in q.attrs["imap"]):
        return None
    return gs[0], k.attrs["shape"][kd], q.attrs["shape"][qd]


def column_candidates(bg: BlockGraph) -> list[LaunchConfig]:
    """:data:`COLUMN_SCHEDULES` that re-tile column pass ``bg`` (:func:`column_pass`), no split."""
    return _schedules(bg, column_pass(bg), COLUMN_SCHEDULES)


def split_kv_decode(bg: BlockGraph) -> int | None:
    """The keys one program walks where ``bg`` is split-KV decode attention — an online softmax of a query tile
    (one block of fewer than ``PREFILL_MIN_ROWS`` rows: no grid dim over them but one of size 1) against key tiles
    walked by the loop, one grid dim splitting the keys — else None."""
    found = _decode_key_grid(bg)
    if found is None or len(found[1]) != 1:
        return None
    return found[0] // bg.grid[found[1][0]]


def whole_kv_decode(bg: BlockGraph) -> int | None:
    """The keys where ``bg`` is decode attention as FlashAttention writes it — :func:`split_kv_decode`'s query
    tile, but no grid dim over the keys: each program's loop walks them all — else None."""
    found = _decode_key_grid(bg)
    return found[0] if found is not None and not found[1] else None


def _decode_key_grid(bg: BlockGraph) -> tuple[int, list[int]] | None:
    """(keys, the grid dims splitting them) of decode attention ``bg`` (one query block of fewer than
    ``PREFILL_MIN_ROWS`` rows: a grid dim over them, if any, of one program), else None."""
    found = _attention_dims(bg)
    if found is None:
        return None
    q, k, rows_dim, kd = found
    if any(m == rows_dim and bg.grid[g] > 1 for g, m in enumerate(q.attrs["imap"])) or \
            q.attrs["shape"][rows_dim] >= PREFILL_MIN_ROWS:
        return None
    return k.attrs["shape"][kd], [g for g, m in enumerate(k.attrs["imap"]) if m == kd]


def prefill_candidates(bg: BlockGraph) -> list[LaunchConfig]:
    """:data:`PREFILL_SCHEDULES` that re-tile prefill attention ``bg`` (:func:`prefill_attention`), no split."""
    return _schedules(bg, prefill_attention(bg), PREFILL_SCHEDULES)


def prefill_split_candidates(bg: BlockGraph, n_sm: int) -> list[LaunchConfig]:
    """:data:`PREFILL_SPLIT_SCHEDULES` that re-tile prefill attention ``bg``, each with its keys split in the fewest
    power-of-two parts whose programs fill a wave of ``n_sm`` (to ``WAVE_FILL``) and in twice that many, each
    split walking whole loop steps; the tile's last program folds the states (``combine_in_kernel``). None of a
    schedule whose unsplit launch fills the wave already, or whose row blocks are ragged (a split stores whole
    blocks)."""
    out = []
    for c in _schedules(bg, prefill_attention(bg), PREFILL_SPLIT_SCHEDULES):
        programs = math.prod(c.grid)
        if c.ragged_rows or programs >= WAVE_FILL * n_sm:
            continue
        first = 2
        while programs * first < WAVE_FILL * n_sm:
            first *= 2
        for s in (first, 2 * first):
            split = replace(c, split=s, combine_in_kernel=True)
            if c.forloop_range % s == 0 and launch_tiling(bg, split) is not None:
                out.append(split)
    return out


def _schedules(bg: BlockGraph, found: tuple[int, int, int] | None, schedules: Sequence[tuple]) -> list[LaunchConfig]:
    """The ``schedules`` — (extent per program, extent per loop step, num_warps, num_stages) — that re-tile ``bg``,
    whose ``found`` = (grid dim, its extent, the extent the loop walks), no split; none where ``found`` is None."""
    if found is None:
        return []
    g, across, along = found
    out = []
    row_dim = ragged_rows(bg)
    for per_program, per_step, warps, stages in schedules:
        rows = 0
        if across % per_program:               # whole row blocks, the last one ragged
            if row_dim is None or row_dim[0] != g:
                continue
            rows = ragged_steps(across, per_program)[1]
        grid = tuple(-(-across // per_program) if d == g else x for d, x in enumerate(bg.grid))
        if along % per_step == 0:
            config = LaunchConfig(grid, along // per_step, 1, warps, stages, ragged_rows=rows)
        elif ragged_walk(bg) is not None:         # whole steps, the last one ragged
            steps, cover = ragged_steps(along, per_step)
            config = LaunchConfig(grid, steps, 1, warps, stages, ragged=cover, ragged_rows=rows)
        else:
            continue
        if launch_tiling(bg, config) is not None:
            out.append(config)
    return out


def decode_candidates(bg: BlockGraph, n_sm: int) -> list[LaunchConfig]:
    """:data:`DECODE_SCHEDULES` that re-tile split-KV decode attention ``bg`` (:func:`split_kv_decode`): the same
    grid (the seed fixed the split count), key tiles of 64 / 128 and the pipeline depth; no further split. Decode
    attention whose programs walk every key (:func:`whole_kv_decode`): the launch splits them at each of
    :func:`~.attention_seeds.decode_split_counts`, folded in-kernel (one kernel), at the first
    ``DECODE_FOLD_SCHEDULES`` of ``DECODE_SCHEDULES``."""
    keys = split_kv_decode(bg)
    if keys is not None:
        return [LaunchConfig(tuple(bg.grid), keys // t, 1, warps, stages) for t, warps, stages in DECODE_SCHEDULES
                if keys % t == 0 and retile(bg, bg.grid, keys // t) is not None]
    keys = whole_kv_decode(bg)
    if keys is None:
        return []
    out = [LaunchConfig(tuple(bg.grid), keys // t, s, warps, stages, combine_in_kernel=True)
           for s in decode_split_counts(math.prod(bg.grid), keys, n_sm)
           for t, warps, stages in DECODE_SCHEDULES[:DECODE_FOLD_SCHEDULES]
           if keys % (t * s) == 0 and retile(bg, bg.grid, keys // t) is not None]
    if out or ragged_walk(bg) is None:
        return out
    # no tile of DECODE_SCHEDULES divides the keys (131, a prime; 2·131): whole tiles, the last one ragged, at the
    # whole-key launch and each split (the split's share a whole number of steps)
    whole = -(-keys // DECODE_SCHEDULES[0][0]) * DECODE_SCHEDULES[0][0]      # the keys at whole first-schedule tiles
    for s in (1, *decode_split_counts(math.prod(bg.grid), whole, n_sm)):
        for t, warps, stages in DECODE_SCHEDULES[:DECODE_FOLD_SCHEDULES]:
            if (walk := ragged_steps(keys, t, s)) is None:      # the tiles divide the keys
                continue
            steps, cover = walk
            config = LaunchConfig(tuple(bg.grid), steps, s, warps, stages, combine_in_kernel=s > 1, ragged=cover)
            if launch_tiling(bg, config) is not None:
                out.append(config)
    return list(dict.fromkeys(out))


def _scored(bg: BlockGraph, n_sm: int) -> list[tuple]:
    """``(estimate µs, grid, forloop_range, split)`` of every re-tiling and split, best first."""
    scored = []
    choices = [_grid_choices(bg, g) for g in range(len(bg.grid))]
    for grid in _product(choices):
        for f in _loop_choices(bg, grid):
            tiled = retile(bg, grid, f)
            if tiled is None:
                continue
            for s in SPLITS:
                if f % s or (s > 1 and f // s < 1):
                    continue
                est = estimate_us(tiled, s, n_sm)
                if est is not None:
                    scored.append((est, grid, f, s))
    return sorted(scored)


def candidates(bg: BlockGraph, n_sm: int, limit: int = 4) -> list[LaunchConfig]:
    """Prefill attention: its own schedule plus :func:`prefill_candidates`; split-KV decode attention: its own
    schedule plus :func:`decode_candidates` — alone where one of them fills ``1 / FILLED_SM_FRACTION`` of the
    SMs, else followed by the re-tilings below. Otherwise the μGraph's own schedule
    plus the ``limit`` best re-tilings by :func:`estimate_us` and the best with at least ``PROBE_WAVES`` programs
    per SM, each with the (num_warps, num_stages) pairs of ``WARPS_STAGES`` and, where each program walks at least
    ``DEEP_LOOP`` for-loop steps, ``DEEP_PIPELINE``. (Pairs whose stages do not fit shared memory fail to compile
    and are skipped by :func:`choose`.) Splits here keep their combine kernel: the in-kernel fold is timed for
    weight streams and decode attention, where the H100 kept it. Prefill attention with its mask's tile table
    scans it (:func:`scanning`)."""
    fixed = prefill_candidates(bg) or decode_candidates(bg, n_sm)
    if fixed:
        base = default_config(bg)
        fixed = [base] + [c for c in fixed if c != base]
        if max(math.prod(c.grid) * c.split for c in fixed) * FILLED_SM_FRACTION >= n_sm:
            return scanning(bg, fixed)
        # too few programs to fill the SMs (a few heads of a short prefill against a long cache): the roofline
        # re-tilings and key splits below are timed too (H100 11-25, qknorm attention 2 heads x 256 x 4096 fp16:
        # 56.9 µs at the best prefill schedule's 8 programs, against 11.1 before prefill schedules replaced them)
        fixed += [c for c in prefill_split_candidates(bg, n_sm) if c not in fixed]
    scored = _scored(bg, n_sm)
    picks = [(tuple(bg.grid), bg.forloop_range, 1)]
    for _, grid, f, s in scored:
        if len(picks) > limit:
            break
        if (grid, f, s) not in picks:
            picks.append((grid, f, s))
    # The model counts SMs, not the loads each SM keeps in flight, so it ranks 1 and 4 programs per SM alike;
    # the best-estimated re-tiling with at least PROBE_WAVES[i] programs per SM is timed as well
    for waves in PROBE_WAVES:
        probe = next(((g, f, s) for _, g, f, s in scored if math.prod(g) * s >= waves * n_sm), None)
        if probe is not None and probe not in picks:
            picks.append(probe)
    configs = [LaunchConfig(g, f, s, w, st) for g, f, s in picks
               for w, st in (*WARPS_STAGES, *([DEEP_PIPELINE] if f // s >= DEEP_LOOP else []))]
    configs += _stream_configs(bg, scored, n_sm) + column_candidates(bg)
    return scanning(bg, fixed + [c for c in dict.fromkeys(configs) if c not in fixed])


def scanning(bg: BlockGraph, configs: Sequence[LaunchConfig]) -> list[LaunchConfig]:
    """``configs``, each scanning the mask (``mask_scan``) where ``bg`` has a table of its mask's tiles
    (``forloop_scan``, the seeds' ``scan_table``: prefill attention, a column-sum pass) that covers the config's
    tiles: each program reads its row (column) of the table and walks only the tiles one of its rows (keys) sees. Whether the table pays is the choice between that seed and the one
    without it, timed on the compiled call's mask. (H100, 11-27, soft-capped prefill with a causal mask passed in,
    32 heads, bf16, scanning the mask itself: n = 8192 3046 µs, 4759 on a random mask; n = 1024 65.7 against
    65.8 unscanned, 83.0 on a random mask — every program re-read its rows of the mask, once per head.)"""
    if bg.forloop_scan is None:
        return list(configs)

    def scans(c: LaunchConfig) -> bool:       # the table's tile covers the program's mask tile
        tiled = None if c.ragged or c.ragged_rows else retile(bg, c.grid, c.forloop_range)
        return tiled is not None and scanned_mask(tiled) is not None
    return list(dict.fromkeys(replace(c, mask_scan=True) if scans(c) else c for c in configs))


def _stream_configs(bg: BlockGraph, scored: Sequence[tuple], n_sm: int) -> list[LaunchConfig]:
    """The one-wave stream of :func:`streaming_pick` at ``STREAM_PIPELINE``, and with the matmul-free sums (an
    RMSNorm's sum of squares) in a loop of their own where the kernel has them (the dot loop then holds no
    reduction) at ``STREAM_PIPELINE`` and each of ``PROLOGUE_PIPELINES``, and that loop after the dot loop at
    ``STREAM_PIPELINE`` (the weight stream starts at once; x is in L2 by then)."""
    stream = streaming_pick(bg, scored, n_sm)
    if stream is None:
        return []
    configs = [LaunchConfig(stream[0], stream[1], 1, *STREAM_PIPELINE)]
    if prologue_accumulators(bg):
        configs += [LaunchConfig(stream[0], stream[1], 1, w, st, prologue=True)
                    for w, st in (STREAM_PIPELINE, *PROLOGUE_PIPELINES)]
        configs.append(LaunchConfig(stream[0], stream[1], 1, *STREAM_PIPELINE, prologue=True, sums_after=True))
    return configs


def contiguous_streams(bg: BlockGraph, n_sm: int) -> list[tuple[tuple, int]]:
    """``(grid, forloop_range)`` of unsplit re-tilings of at least one wave of programs (to ``WAVE_FILL``: 32 heads
    x 4 slices of RoPE's paired halves count on 132 SMs) whose streamed tiles read pieces of at least
    ``STREAM_RUN_BYTES`` (loop tiles of ``RUN_TILES``), with sides of at least ``MIN_STREAM_TILE`` (or of one, over
    at most ``PROBE_WAVES[-1]`` waves: a row per program adds up only where few rows leave few programs) and no
    padding: per piece length the one whose step loads closest to ``STREAM_STAGE_BYTES``
    (at most twice that), as many waves as that takes."""
    best: dict[int, tuple] = {}
    for grid in _product([_grid_choices(bg, g) for g in range(len(bg.grid))]):
        if math.prod(grid) < WAVE_FILL * n_sm:
            continue
        for f in _loop_choices(bg, grid, RUN_TILES):
            tiled = retile(bg, grid, f)
            if tiled is None or estimate_us(tiled, 1, n_sm) is None or not _whole_stream_tiles(tiled, n_sm):
                continue
            run, stage = run_bytes(tiled), streamed_bytes(tiled)
            if run < STREAM_RUN_BYTES or stage > 2 * STREAM_STAGE_BYTES:
                continue
            score = (abs(stage - STREAM_STAGE_BYTES), -math.prod(grid))
            if run not in best or score < best[run][0]:
                best[run] = (score, tuple(grid), f)
    return [(g, f) for _, g, f in (best[r] for r in sorted(best))]


def streaming_candidates(bg: BlockGraph, n_sm: int, limit: int = 4) -> list[LaunchConfig]:
    """The launches of a weight-streaming (memory-bound matmul) kernel: the μGraph's own schedule at the first of
    ``WARPS_STAGES`` and, where its loop has at least ``DEEP_LOOP`` steps, at ``DEEP_PIPELINE`` (the library gated
    MLP's tuned winner: its μGraph is the seed's); the one-wave stream of :func:`_stream_configs`; the
    best-estimated split-K (a combine kernel after it; also with the sums' loop of its own where there is one) and
    split-N of more than one wave and at most ``PROBE_WAVES[-1]`` programs per SM, at the first of ``WARPS_STAGES``;
    the best-estimated unsplit loop of at least ``DEEP_LOOP`` steps at ``DEEP_PIPELINE``; the split-K that just fills
    a wave (:func:`wave_split`, also at ``FILL_PIPELINE`` and with the sums' loop of its own); the
    :func:`contiguous_streams` at each of ``CONTIGUOUS_PIPELINES`` (with a norm: also with its sums in a loop of
    their own, at the first); each split whose sums share the dot loop also folded by its tiles' last programs
    (``combine_in_kernel``: one launch, no combine kernel). Up to 23 configs (13 without a norm), each a Triton
    compile (in parallel: ``compile_workers``); a decode layer has one such kernel per projection."""
    scored = _scored(bg, n_sm)
    warps, stages = WARPS_STAGES[0]
    own = (tuple(bg.grid), bg.forloop_range)
    has_sums = bool(prologue_accumulators(bg))
    configs = [LaunchConfig(*own, 1, warps, stages)]
    if bg.forloop_range >= DEEP_LOOP:
        configs.append(LaunchConfig(*own, 1, *DEEP_PIPELINE))
    configs += _stream_configs(bg, scored, n_sm)
    for g, f in contiguous_streams(bg, n_sm):    # with a norm's sums also in a loop of their own
        configs += [LaunchConfig(g, f, 1, w, st) for w, st in CONTIGUOUS_PIPELINES]
        if has_sums:
            configs.append(LaunchConfig(g, f, 1, *CONTIGUOUS_PIPELINES[0], prologue=True))
    split_k = next(((g, f, s) for _, g, f, s in scored if s > 1), None)
    split_n = next(((g, f, s) for _, g, f, s in scored
                    if s == 1 and n_sm < math.prod(g) <= PROBE_WAVES[-1] * n_sm), None)
    for pick in (split_k, split_n, fill := wave_split(bg, scored, n_sm)):
        if pick is not None:
            configs.append(LaunchConfig(pick[0], pick[1], pick[2], warps, stages))
    if fill is not None:
        configs.append(LaunchConfig(*fill, *FILL_PIPELINE))
    for pick in (split_k, fill) if has_sums else ():   # each split's share of the sums in a loop of its own
        if pick is not None:
            configs.append(LaunchConfig(*pick, warps, stages, prologue=True))
    deep = next(((g, f) for _, g, f, s in scored if s == 1 and f >= DEEP_LOOP), None)
    if deep is not None:
        configs.append(LaunchConfig(deep[0], deep[1], 1, *DEEP_PIPELINE))
    configs += [replace(c, combine_in_kernel=True) for c in configs if c.split > 1 and not c.prologue]
    return list(dict.fromkeys(configs))


def wave_split(bg: BlockGraph, scored: Sequence[tuple], n_sm: int) -> tuple | None:
    """``(grid, forloop_range, split)`` where no unsplit re-tiling of whole weight tiles (:func:`_whole_stream_tiles`)
    fills a wave of ``n_sm`` programs (to ``WAVE_FILL``; a grid fixed by whole heads: the RoPE projection's 32 or 8
    blocks): the split-K with the fewest splits that fills one, at its best estimate — the fewest partial states
    for the combine kernel to read (H100 11-26, decode QKV + RoPE: the k / v projection at 32 splits spent 6.2 µs
    in its combine against 11.3 in the main kernel); else None. A re-tiling whose tiles pad (Qwen2's 28 heads x 8
    slices: 8 columns of each half padded to Triton's 16) streams its padding too, and one of single rows over many
    waves reads too little a program: neither counts (H100 11-28, Qwen2-7B decode: the q projection ran as
    28 x 4 = 112 programs on 132 SMs at 48 % of copy)."""
    if any(s == 1 and math.prod(g) >= WAVE_FILL * n_sm and (t := retile(bg, g, f)) is not None
           and _whole_stream_tiles(t, n_sm) for _, g, f, s in scored):
        return None
    fills = [(s, est, g, f) for est, g, f, s in scored if s > 1 and math.prod(g) * s >= WAVE_FILL * n_sm]
    if not fills:
        return None
    s, _, g, f = min(fills, key=lambda x: (x[0], x[1]))
    return g, f, s


def _whole_stream_tiles(tiled: BlockGraph, n_sm: int) -> bool:
    """Whether the weight tiles ``tiled`` streams are unpadded with sides of at least ``MIN_STREAM_TILE``, or of one
    over at most ``PROBE_WAVES[-1]`` waves of ``n_sm`` programs (:func:`contiguous_streams`' re-tilings)."""
    programs = math.prod(tiled.grid)
    return all(padded(x) == x and (x >= MIN_STREAM_TILE or x == 1 and programs <= PROBE_WAVES[-1] * n_sm)
               for it in _streamed(tiled) for x in strip(it.shapes[0])[0])


def streaming_pick(bg: BlockGraph, scored: Sequence[tuple], n_sm: int) -> tuple | None:
    """``(grid, forloop_range)`` of the weight-streaming schedule among ``bg``'s scored re-tilings: no split, the
    most programs that still fit one wave (``<= n_sm``) and walk at least ``DEEP_LOOP`` for-loop steps, then the
    widest K tile (fewest steps) whose weight tiles stay within ``STREAM_STAGE_BYTES`` per step
    (:func:`streamed_bytes`; the narrowest where none does); None where no re-tiling qualifies."""
    fits = [(g, f) for _, g, f, s in scored if s == 1 and math.prod(g) <= n_sm and f >= DEEP_LOOP]
    if not fits:
        return None
    programs = max(math.prod(g) for g, _ in fits)
    widest = sorted({gf for gf in fits if math.prod(gf[0]) == programs}, key=lambda gf: gf[1])
    for grid, f in widest:
        tiled = retile(bg, grid, f)
        if tiled is not None and streamed_bytes(tiled) <= STREAM_STAGE_BYTES:
            return grid, f
    return widest[-1]


def _product(choices):
    out = [()]
    for c in choices:
        out = [p + (x,) for p in out for x in c]
    return out


# ------------------------------------------------------------------ choosing
def _disagreement(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative error of a config's output against the first config's; ``inf`` where their NaN / inf differ (a
    config producing NaN where the reference has numbers disagrees with it)."""
    return relative_error(got, want, where=want) if same_non_finite(got, want) else float("inf")


def retile_problem(outs: Sequence[torch.Tensor], want: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                   reference: str) -> str | None:
    """Why the outputs of another launch of the same kernel(s) disagree with ``want`` (``reference`` names what gave
    it), or None: re-tilings sum in another order, so the lowest precision among the inputs and outputs bounds the
    agreement (:func:`~torch_mirage.numerics.tolerance`'s ``retile``)."""
    half = [t.dtype for t in (*outs, *inputs) if t.dtype in (torch.float16, torch.bfloat16)]
    err = max((_disagreement(o, w) for o, w in zip(outs, want)), default=0.0)
    if err > tolerance(half[0] if half else torch.float32, "retile"):
        return f"disagrees with {reference} (relative error {err:.2e})"
    return None


class AgreesWithFirst:
    """A :func:`~torch_mirage.tune.tune` check of launches of the same kernel(s): runs a candidate on ``inputs`` and
    compares its outputs with those of the first candidate it ran (kept as ``want``; ``reference`` names it) by
    :func:`retile_problem`. The outputs live only for the comparison, not until every candidate is timed."""

    def __init__(self, inputs: Sequence[torch.Tensor], reference: str):
        self.inputs, self.reference = inputs, reference
        self.want: list[torch.Tensor] = []

    def __call__(self, name: str, run: Callable) -> str | None:
        outs = run(*self.inputs)
        if not self.want:
            self.want.extend(o.clone() for o in outs)
            return None
        return retile_problem(outs, self.want, self.inputs, self.reference)


def launch_key(bg: BlockGraph, inputs: Sequence[torch.Tensor], device: torch.device, limit: int,
               propose: Callable[..., list[LaunchConfig]]) -> str:
    """The cache key of :func:`choose`'s answer for ``bg`` on inputs of these strides on CUDA ``device``; with the
    digest of this module, which proposes the candidates (:func:`cached_launch` reads an answer back without
    proposing them, so a changed proposal must not find an old answer)."""
    return cache_key(kind="ugraph-launch", graph=bg.hash(), strides=[list(t.stride()) for t in inputs],
                     code=source_digest("superopt/launch.py"),
                     device=torch.cuda.get_device_name(device), timing="cuda graph, rotated inputs, ABBA",
                     space=[WARPS_STAGES, DEEP_PIPELINE, DEEP_LOOP, PROBE_WAVES, limit, COMBINE_PROGRAMS,
                            STREAM_PIPELINE, CONTIGUOUS_PIPELINES, FILL_PIPELINE, STREAM_STAGE_BYTES, STREAM_RUN_BYTES,
                            RUN_TILES, PROLOGUE_PIPELINES, PREFILL_SCHEDULES, PREFILL_SPLIT_SCHEDULES, DECODE_SCHEDULES,
                            COLUMN_SCHEDULES,
                            "mask scan", "ragged walk"]
                     + ([] if propose is candidates else [propose.__name__]))   # a wider search re-tunes


def cached_launch(bg: BlockGraph, cache: Any, key: str) -> LaunchConfig | None:
    """The launch config :func:`choose` stored under ``key`` for ``bg``, read back without proposing the
    candidates again (a warm compile of a llama decode graph spent about 2 s of its build there, H200 12-02):
    the winner's name is its JSON. None where nothing is stored, or the name no longer makes a config that
    tiles ``bg``."""
    hit = cached_choice(cache, key, None)
    if hit is None:
        return None
    try:
        config = LaunchConfig.from_json(json.loads(hit.winner))
    except (ValueError, TypeError, KeyError):
        return None
    return config if launch_tiling(bg, config) is not None else None


def proposed(bg: BlockGraph, device: torch.device, limit: int, propose: Callable[..., list[LaunchConfig]]
             ) -> dict[str, LaunchConfig]:
    """The launch configs :func:`choose` times for ``bg`` on CUDA ``device``, by name."""
    n_sm = torch.cuda.get_device_properties(device).multi_processor_count
    return {_config_name(c): c for c in propose(bg, n_sm, limit)}


def choose(bg: BlockGraph, build: Callable[[LaunchConfig], Callable], inputs: Sequence[torch.Tensor], *,
           cache: Any = None, limit: int = 4, propose: Callable[..., list[LaunchConfig]] = candidates) -> LaunchConfig:
    """The launch config to use for ``bg`` on ``inputs``; ``build(config)`` returns ``run(*inputs) -> outputs``
    (with ``run.warmup(*inputs)``, as a :class:`~.compile.BlockLauncher` has, the candidates compile at once in the
    compile pool before the first runs: :func:`~torch_mirage.tune.tune`'s ``precompile``; ``build`` must then be
    safe to call from several threads);
    ``propose(bg, n_sm, limit)`` lists the configs timed (:func:`candidates`, :func:`streaming_candidates`).
    Every candidate's outputs must agree with the first one's (the μGraph's own schedule) to the re-tiling
    tolerance of the lowest precision involved; the fastest that agrees wins (:func:`~torch_mirage.tune.tune`)."""
    base = default_config(bg)
    if not inputs or inputs[0].device.type != "cuda":
        return untuned_config(bg)
    key = launch_key(bg, inputs, inputs[0].device, limit, propose)
    if (known := _cached_answer(bg, inputs, cache, key)) is not None:
        return known
    props = torch.cuda.get_device_properties(inputs[0].device)
    configs = proposed(bg, inputs[0].device, limit, propose)
    sets: list = []
    launchers: dict[str, Callable] = {}   # the launchers the compile pool built, by candidate

    def precompile(name: str) -> None:   # in a pool thread: codegen and Triton's compile, nothing launched
        run = launchers[name] = build(configs[name])
        warmup = getattr(run, "warmup", None)
        if warmup is not None:
            warmup(*inputs)

    def make(name: str) -> Callable:   # the timing sets only when the cache has no answer
        if not sets:
            sets.extend(rotated_input_sets(inputs, props.L2_cache_size, max_sets=16))
        return launchers.pop(name) if name in launchers else build(configs[name])

    agrees = AgreesWithFirst(inputs, "the μGraph's own schedule")
    tuned = tune(list(configs), lambda name, run: time_launches(run, inputs, sets), build=make, check=agrees,
                 cache=cache, key=key, label="launch config", progress="torch_mirage: tuning a μGraph kernel",
                 precompile=precompile)
    winner = configs[tuned.winner] if tuned.winner is not None else base
    twin = scan_twin(bg, winner)
    if twin is None:
        return winner
    pair = [_config_name(c) for c in (winner, twin)]
    configs[pair[1]] = twin
    key2 = scan_key(bg, inputs, key)
    hit = cached_choice(cache, key2, pair)
    if hit is not None:
        return configs[hit.winner]
    if not agrees.want:             # the first round's answer came from the cache: the reference is the winner
        agrees(pair[0], make(pair[0]))
    second = tune(pair, lambda name, run: time_launches(run, inputs, sets), build=make, check=agrees,
                  cache=cache, key=key2, label="mask scan", precompile=precompile)
    return configs[second.winner] if second.winner is not None else winner


def scan_key(bg: BlockGraph, inputs: Sequence[torch.Tensor], key: str) -> str:
    """The cache key of :func:`scan_twin`'s round after the first round's ``key``."""
    return cache_key(kind="ugraph-launch-scan", first=key, hidden=hidden_share(bg, inputs))


def _cached_answer(bg: BlockGraph, inputs: Sequence[torch.Tensor], cache: Any, key: str) -> LaunchConfig | None:
    """:func:`choose`'s answer where both of its rounds are in the cache (the scan round only where
    :func:`scan_twin` applies), found without proposing, building or timing anything; None otherwise."""
    winner = cached_launch(bg, cache, key)
    if winner is None:
        return None
    twin = scan_twin(bg, winner)
    if twin is None:
        return winner
    names = [_config_name(winner), _config_name(twin)]
    hit = cached_choice(cache, scan_key(bg, inputs, key), names)
    if hit is None:
        return None
    return winner if hit.winner == names[0] else twin


def hidden_share(bg: BlockGraph, inputs: Sequence[torch.Tensor]) -> float | None:
    """The share of the entries of the mask ``bg``'s launches scan (:func:`scanned_mask`) that hide their key (-inf;
    False in a bool mask), in eighths; None where nothing is scanned. What a scan saves depends on it, so the timed
    answer of :func:`scan_twin` is kept per share: a decode step early in a long static cache hides most of it,
    a late one almost none (H100 11-27, llama decode at position 256 reused the choice timed at 4000 from the disk
    cache, unscanned)."""
    m = scanned_mask(bg)
    if m is None:
        return None
    x = inputs[bg.ops[m].attrs["index"]]
    hidden = ~x if x.dtype == torch.bool else x == float("-inf")
    return round(hidden.float().mean().item() * 8) / 8


def _config_name(config: LaunchConfig) -> str:
    """A launch config's name among the tuner's candidates (and in its cache)."""
    return json.dumps(config.to_json(), sort_keys=True)


def scan_twin(bg: BlockGraph, config: LaunchConfig) -> LaunchConfig | None:
    """``config`` scanning the mask, where ``bg`` is decode attention whose mask a call gives (a static cache's
    mask: a step early in a long cache sees a few of its slots, and its programs then walk only those): timed
    against ``config`` after the other candidates, on the compiled call's mask (one more kernel to build, not a
    twin of each). None where that does not apply (prefill times each schedule both ways: :func:`scanning`)."""
    if config.mask_scan or config.ragged or config.forloop_range // config.split <= 1 \
            or prefill_attention(bg) is not None \
            or scanned_mask(bg) is None:      # one loop step per program: nothing to bound
        return None
    if split_kv_decode(bg) is None and whole_kv_decode(bg) is None:
        return None
    return replace(config, mask_scan=True)


def time_launches(run: Callable, inputs: Sequence[torch.Tensor], sets: Sequence[Sequence[torch.Tensor]]) -> list[float]:
    """µs-per-call samples of ``run`` replayed in a CUDA graph over ``sets``; ``do_bench`` where capture fails."""
    try:
        return cuda_graph_timing(run, sets, replays=10, repeats=3)["samples"]
    except Exception as e:   # not capturable: time it launched from Python, and say so
        log.info("torch_mirage: CUDA-graph timing failed (%s: %s); timing with do_bench", type(e).__name__, e)
        torch.cuda.synchronize()
        import triton.testing

        return [triton.testing.do_bench(lambda: run(*inputs), warmup=5, rep=25) * 1e3]
