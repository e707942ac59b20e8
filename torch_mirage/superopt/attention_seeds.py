"""Attention μGraphs instantiated from an :class:`~torch_mirage.analysis.attention.AttentionSpec` (seeds).

Both seeds take the query heads of one KV head packed into the rows of a tile — Q (b, hk, g·sq, d), so K and V
are read once per group (GQA) — and score a tile as ``mask + softcap(scale · Q Kᵀ)`` with ``softcap(x) =
c·tanh(x/c)`` inside the KV loop, then run the online-softmax accumulator:

* :func:`flash_attention`: one kernel, grid (hk, b, row blocks), the for-loop walks all of KV.
* :func:`flash_decoding`: split-KV in two kernels (partial max/sum/out per split, then the combine), for few
  query rows (decode, speculative decode), where FlashAttention's grid would leave SMs idle.

An additive mask arrives as one more input, (bm, hm, g·sq, skv) with bm ∈ {1, b} and hm ∈ {1, hk} (a mask the
same for every batch row or KV head is read by every block, not copied), loaded per tile by an iterator that walks
KV with K; the claimer turns bool masks and ``is_causal`` into that form. ``bias = (bm, hm, br)`` adds a second
one, (bm, hm, br, skv) with br ∈ {1, rows} (one row: broadcast over the tile's rows), loaded on every tile the loop
visits: a mask the graph adds as several terms is not summed per call — one term is the mask (computed from
indices where it is exactly its band, its input then a stand-in: ``band``'s ``index_mask``), the others' sum the
bias (BLOOM's ALiBi). Both graphs are ordinary μGraphs: they verify (:mod:`.verify`) and compile
(:mod:`.compile`) like the library's.

Where the mask's value property shows a causal / sliding-window structure, ``band = (period, offset, window)``
sets the block graph's ``forloop_band`` (:func:`~torch_mirage.ugraph.band_range`): query row ``r`` (position ``r % period``)
sees key ``k`` iff ``k <= pos + offset`` (and ``k > pos + offset - window``), so each row block's for-loop runs
only over the key tiles it can see; the mask is added on the visited tiles that some row sees only in part (the
diagonal ones) and, where the mask's visible part is 0 (``band[3]``), not loaded on the tiles every row sees. A
split of the split-KV seed that a row block cannot see runs no iteration and saves l = 0, o = 0 and the running
max's finite start (codegen's ``M_INIT``, far below any score), which the combine weighs by ``exp(M_INIT − max) = 0``.

Column sums of P (H2O's accumulated attention per key) need each row's final max and sum, which a single
online-softmax pass does not have when it meets a key. :func:`attention_column_sums` composes a plan from
:data:`PLAN_KERNELS`: FlashAttention that also saves its row statistics, then FlashTensor's non-convex column
kernel (grid over key blocks, the for-loop over query tiles, the scores recomputed and ``exp(s − max)/sum``
summed over rows; under a band, a key block walks only the query tiles that see it); or, for KV up to
:data:`ROW_BLOCK_KV`, one row-block kernel that holds whole score rows and saves P·V and its rows' column sums.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Sequence

from ..ugraph import KernelGraph
from .builder import new_kernel_graph, new_threadblock_graph
from .library import blocks, split_kv_combine, tiles

PHI = None
NEG_INF = float("-inf")
EMPTY_ROW_EPS = 1e-30     # far below fp32's resolution at 1 (6e-8): l + eps == l for every row with a key
EMPTY_ROWS = ("nan", "zero")


def _band(tb, band, q_input: int, q_dim: int, k_input: int, mask_input: int | None) -> None:
    """``band = (period, offset, window[, zero_mask[, index_mask]])``: ``zero_mask`` — the mask is 0 wherever
    the band sees (its visible part), so a tile every row sees whole is not loaded; ``index_mask`` — the mask is
    exactly the band's (0 where visible, masked elsewhere), so it is never loaded: the partly seen tiles compute it
    from the indices, and the mask input may be a broadcast stand-in."""
    if band is not None:
        period, offset, window, *flags = band
        z = mask_input if flags and flags[0] else None
        index = z is not None and len(flags) > 1 and bool(flags[1])
        tb.forloop_band = (q_input, q_dim, k_input, int(period), int(offset), None if window is None else int(window),
                           z) + ((True,) if index else ())     # 7 fields unless index_mask: other hashes stay


def _scores(tb, tQ, tK, scale: float, softcap: float | None, tMask, mask_fill: float = NEG_INF, tBias=None):
    """``mask + bias + softcap(scale·Q Kᵀ)``; a bool mask (the user's, read as it is) keeps the scores it holds
    True and puts ``mask_fill`` at the others: ``where(keep, s, fill)``, which is ``s + where(keep, 0, fill)``.
    ``tBias``: a second additive mask, broadcast over the tile's rows where it has one row."""
    s = tb.scalar_mul(tb.matmul(tQ, tb.transpose(tK)), value=scale)
    if softcap is not None:
        s = tb.scalar_mul(tb.tanh(tb.scalar_mul(s, value=1.0 / softcap)), value=softcap)
    if tBias is not None:
        s = tb.add(s, tBias)
    if tMask is None:
        return s
    return tb.where(tMask, s, value=mask_fill) if tMask.dtype == "bool" else tb.add(s, tMask)


def _normalised(tb, o, l, empty_rows: str):
    """``o / l``, the online softmax's output. ``empty_rows``: what a row whose keys are all masked by -inf (sum
    l = 0, o = 0) gives — ``"nan"``: 0/0, as the decomposed softmax in eager; ``"zero"``: 0, as SDPA, by
    ``o / (l + EMPTY_ROW_EPS)`` — every other row has l >= 1 (its max key adds exp(0)), where adding the epsilon
    leaves fp32 l unchanged."""
    return tb.div(o, tb.scalar_add(l, value=EMPTY_ROW_EPS) if empty_rows == "zero" else l)


def flash_attention(b: int, hk: int, rows: int, skv: int, d: int, *, scale: float, softcap: float | None = None,
                    mask: tuple[int, int] | None = None, dtype: str = "float16", mask_dtype: str = "float32",
                    q_blocks: int | None = None, forloop_range: int | None = None, tile: int = 64,
                    band: tuple | None = None, stats: bool = False, mask_fill: float = NEG_INF,
                    empty_rows: str = "nan", scan_table: bool = False, q_heads: int | None = None,
                    dv: int | None = None, bias: tuple[int, int, int] | None = None) -> KernelGraph:
    """``softmax(mask + softcap(scale·Q Kᵀ)) V``: inputs Q (b, hk, rows, d), K (b, hk, skv, d), V (b, hk, skv, dv)
    (``dv``: V's head size where it is not Q's and K's, as in multi-head latent attention; default ``d``)
    [+ mask (bm, hm, rows, skv) when ``mask = (bm, hm)``: additive, or bool (``mask_dtype`` "bool", the scores
    it does not keep set to ``mask_fill``)] [+ bias (bm, hm, br, skv) ``mask_dtype`` when ``bias = (bm, hm, br)``,
    added to the scores]; output (b, hk, rows, dv) [+ with ``stats`` each row's softmax max and
    sum of exponentials, (b, hk, rows, 1) fp32: what a second pass over the scores needs]. ``empty_rows``: see
    :func:`_normalised`. ``scan_table``: kernel-level reductions first make the max and sum of each ``SCAN_TILE``
    square of an additive mask (:func:`mask_tile_table`; read once per call, not once per head and query block), whose
    rows a program reads before its loop to walk only the key tiles one of its rows sees, and to skip the mask
    on the tiles where it is all 0 (the block graph's ``forloop_scan``; launches that
    scan: :func:`~torch_mirage.superopt.launch.scanning`).

    ``q_heads`` (a multiple of ``hk``): Q, the mask's heads (hm ∈ {1, q_heads}) and the output have that many heads,
    ``rows`` query positions each, one program per query head: the programs of a group read their KV head's tiles
    (the grid's head dim reads K and V at ``pid // group``: :func:`~torch_mirage.ugraph.grid_split`). Q, the mask
    and the output are then views of the region's own tensors — prefill, where a head's rows fill row blocks —
    where the packed rows (the default) are copies of Q and the mask per call, and the output is copied back."""
    g = new_kernel_graph()
    Q = g.new_input((b, q_heads or hk, rows, d), dtype)
    K, V = g.new_input((b, hk, skv, d), dtype), g.new_input((b, hk, skv, dv or d), dtype)
    M = g.new_input((*mask, rows, skv), mask_dtype) if mask is not None else None
    B = _bias_input(g, bias, rows, skv, mask_dtype)
    table = mask_tile_table(g, M, band) if scan_table else None
    outs = _flash_op(g, Q, K, V, M, scale=scale, softcap=softcap, q_blocks=q_blocks or tiles(rows, tile),
                     forloop_range=forloop_range or tiles(skv, tile), band=band, stats=stats, mask_fill=mask_fill,
                     empty_rows=empty_rows, table=table, B=B)
    for t in outs:
        g.mark_output(t)
    return g.build()


def _bias_input(g, bias: tuple | None, rows: int, skv: int, dtype: str):
    """The bias input (bm, hm, br, skv) of ``bias = (bm, hm, br)``, br one row or ``rows``; None without one."""
    if bias is None:
        return None
    bm, hm, br = bias
    if br not in (1, rows):
        raise ValueError(f"a bias of {br} rows over {rows} query rows (need 1 or {rows})")
    return g.new_input((bm, hm, br, skv), dtype)


def _bias_imap(B, head: int, batch: int, rows: int | None) -> tuple:
    """A bias iterator's imap over grid dims (head, batch, rows): each dim the bias has (more than one entry)."""
    bm, hm, br = B.shape[:3]
    return (head if hm > 1 else PHI, batch if bm > 1 else PHI, rows if br > 1 and rows is not None else PHI)


SCAN_TILE = 64        # the mask squares a scan table's entries cover: the smallest prefill tile edge


def mask_tile_table(g, M, band: tuple | None):
    """The tile table of additive mask ``M`` (bm, hm, rows, skv): (bm, hm, 2·rows / SCAN_TILE, skv / SCAN_TILE)
    fp32, each square row's maxima followed by its sums over its ``SCAN_TILE`` squares, made by one kernel that
    reads the mask once (a program per square). A square whose max is -inf hides all its keys from all its
    rows (its sum is -inf too, and NaN where the square holds one: a scan asks only whether an entry is -inf);
    one whose max and sum are both 0 is all 0 (every entry at most 0, and a sum of non-positive floats rounds to
    0 only where every term is 0), so its mask need not be read. Raises where no table applies: no mask, a bool
    one, a band (the loop is bounded already), sizes that are not whole squares."""
    t = SCAN_TILE
    if M is None or M.dtype == "bool" or band is not None:
        raise ValueError("a scan table needs an additive mask and no band")
    bm, hm, rows, skv = M.shape
    if rows % t or skv % t or rows < 2 * t:
        raise ValueError(f"a scan table needs whole {t} x {t} squares of at least two row blocks "
                         f"(mask {tuple(M.shape)})")
    flat = g.reshape(M, shape=(bm * hm * rows, skv))
    tb = new_threadblock_graph((bm * hm * rows // t, skv // t, 1), 1)
    square = tb.new_input(flat, imap=(0, 1, PHI), fmap=PHI)
    stats = [tb.forloop_accum(reduce(reduce(square, dim=1), dim=0), "sum") for reduce in (tb.reduce_max, tb.reduce_sum)]
    tb.new_output(tb.concat(stats, dim=0), omap=(0, 1, PHI), dtype="float32")
    (table,) = g.customized([flat], tb)
    return g.reshape(table, shape=(bm, hm, 2 * rows // t, skv // t))


def _flash_op(g, Q, K, V, M, *, scale: float, softcap: float | None, q_blocks: int, forloop_range: int,
              band: tuple | None, stats: bool, mask_fill: float = NEG_INF, empty_rows: str = "nan",
              table=None, B=None) -> list:
    """The FlashAttention block graph on kernel tensors Q (b, h, rows, d), K, V (b, hk, skv, d) [, M [, its scan
    ``table``]] [, bias ``B`` (bm, hm, br, skv)]: grid (h, b, row blocks) — h = hk, or a multiple whose programs
    share KV heads —, the for-loop over KV tiles; returns the output [and the row max / sum of exponentials]."""
    b, hk = Q.shape[:2]
    mask = M.shape[:2] if M is not None else None
    tb = new_threadblock_graph((hk, b, q_blocks), forloop_range)
    _band(tb, band, 0, 2, 1, 3 if M is not None else None)
    tQ = tb.new_input(Q, imap=(1, 0, 2), fmap=PHI)
    tK = tb.new_input(K, imap=(1, 0, PHI), fmap=2)
    tV = tb.new_input(V, imap=(1, 0, PHI), fmap=2)
    tM = tb.new_input(M, imap=(1 if mask[1] > 1 else PHI, 0 if mask[0] > 1 else PHI, 2), fmap=3) if M is not None else None
    if table is not None:       # read by the launches that scan it, never by the math
        tb.new_input(table, imap=(1 if mask[1] > 1 else PHI, 0 if mask[0] > 1 else PHI, 2), fmap=3)
        tb.forloop_scan = 4
    tB = None
    if B is not None:
        if table is not None:
            raise ValueError("a bias beside a scan table (the table covers one mask)")
        tB = tb.new_input(B, imap=_bias_imap(B, 1, 0, 2), fmap=3)
    m, l, o = tb.forloop_accum_online_softmax(_scores(tb, tQ, tK, scale, softcap, tM, mask_fill, tB), tV)
    tb.new_output(_normalised(tb, o, l, empty_rows), omap=(1, 0, 2))
    if stats:
        tb.new_output(m, omap=(1, 0, 2), dtype="float32")
        tb.new_output(l, omap=(1, 0, 2), dtype="float32")
    return g.customized([Q, K, V] + ([M] if M is not None else []) + ([table] if table is not None else [])
                        + ([B] if B is not None else []), tb)


def flash_decoding(b: int, hk: int, rows: int, skv: int, d: int, *, scale: float, softcap: float | None = None,
                   mask: tuple[int, int] | None = None, dtype: str = "float16", mask_dtype: str = "float32",
                   splits: int | None = None, forloop_range: int | None = None, q_blocks: int | None = None,
                   combine_q_blocks: int | None = None, tile: int = 64, band: tuple | None = None,
                   mask_fill: float = NEG_INF, empty_rows: str = "nan", dv: int | None = None,
                   bias: tuple[int, int, int] | None = None) -> KernelGraph:
    """The same attention split over KV (V's head size ``dv``, default ``d``): kernel 1 saves each split's (max,
    sum, out); kernel 2 rescales each by ``exp(m_s − max_s m_s)`` and combines them. Decode (one row block,
    ``q_blocks`` 1): grid (hk, b, splits) over Q, K, V as they are, so the mask may be shared by batch rows and / or
    KV heads or given for each — an HF static-cache mask (b, 1, 1, skv) is read per batch row by every KV head.
    Several row blocks: grid (b·hk, row blocks, splits), batch and KV heads merged into one grid dim, so a mask must
    be shared by all of them or given for each: ``mask`` (1, 1) or (b, hk); so must a ``bias`` (as
    :func:`flash_attention`'s)."""
    masked = mask is not None
    splits = splits or blocks(skv, 4 * tile)
    forloop_range = forloop_range or tiles(skv // splits, tile)
    q_blocks = q_blocks or tiles(rows, tile)
    # the combine holds (splits, its rows, d) fp32 in registers, rows padded to 16 unless one: decode's few rows
    # one per program (on the H100 the 64-split decode seed, its combine 64 x 16 padded rows x d 128, never ran)
    combine_q_blocks = combine_q_blocks or (rows if rows < 16 else blocks(rows, 8))
    if masked and q_blocks > 1 and tuple(mask) not in ((1, 1), (b, hk)):
        raise ValueError(f"flash_decoding: a mask of batch/head dims {tuple(mask)} over {q_blocks} row blocks "
                         f"(need (1, 1) or {(b, hk)}, or one row block)")
    if bias is not None and q_blocks > 1 and tuple(bias[:2]) not in ((1, 1), (b, hk)):
        raise ValueError(f"flash_decoding: a bias of batch/head dims {tuple(bias[:2])} over {q_blocks} row blocks "
                         f"(need (1, 1) or {(b, hk)}, or one row block)")
    g = new_kernel_graph()
    dv = dv or d
    Q, K = g.new_input((b, hk, rows, d), dtype), g.new_input((b, hk, skv, d), dtype)
    V = g.new_input((b, hk, skv, dv), dtype)
    M = g.new_input((*mask, rows, skv), mask_dtype) if masked else None
    B = _bias_input(g, bias, rows, skv, mask_dtype)
    bh = b * hk
    if q_blocks == 1:
        ins = [Q, K, V] + ([M] if masked else []) + ([B] if B is not None else [])
        tb = new_threadblock_graph((hk, b, splits), forloop_range)
        _band(tb, band, 0, 2, 1, 3 if masked else None)
        tQ = tb.new_input(Q, imap=(1, 0, PHI), fmap=PHI)
        tK = tb.new_input(K, imap=(1, 0, 2), fmap=2)
        tV = tb.new_input(V, imap=(1, 0, 2), fmap=2)
        tM = tb.new_input(M, imap=(1 if mask[1] > 1 else PHI, 0 if mask[0] > 1 else PHI, 3), fmap=3) if masked else None
        # the grid's split dim walks the keys: imap 3 (the whole rows, one split's keys each)
        tB = tb.new_input(B, imap=_bias_imap(B, 1, 0, None)[:2] + (3,), fmap=3) if B is not None else None
        omap = (1, 0, 2)                       # (b, hk, splits·rows, ·): split s writes rows s·rows …
    else:
        Q4 = g.reshape(Q, shape=(bh, 1, rows, d))
        K3, V3 = g.reshape(K, shape=(bh, skv, d)), g.reshape(V, shape=(bh, skv, dv))
        M4 = g.reshape(M, shape=(mask[0] * mask[1], 1, rows, skv)) if masked else None
        B4 = g.reshape(B, shape=(bias[0] * bias[1], 1, bias[2], skv)) if B is not None else None
        ins = [Q4, K3, V3] + ([M4] if masked else []) + ([B4] if B is not None else [])
        tb = new_threadblock_graph((bh, q_blocks, splits), forloop_range)
        _band(tb, band, 0, 2, 1, 3 if masked else None)
        tQ = tb.new_input(Q4, imap=(0, 2, PHI), fmap=PHI)
        tK = tb.new_input(K3, imap=(0, PHI, 1), fmap=1)
        tV = tb.new_input(V3, imap=(0, PHI, 1), fmap=1)
        tM = tb.new_input(M4, imap=(0 if mask[0] * mask[1] > 1 else PHI, 2, 3), fmap=3) if masked else None
        tB = (tb.new_input(B4, imap=(0 if bias[0] * bias[1] > 1 else PHI, 2 if bias[2] > 1 else PHI, 3), fmap=3)
              if B is not None else None)
        omap = (0, 2, 1)                       # (b·hk, splits, rows, ·)
    acc_dtype = "float32" if dtype in ("float16", "bfloat16") else dtype
    for t in tb.forloop_accum_online_softmax(_scores(tb, tQ, tK, scale, softcap, tM, mask_fill, tB), tV):
        tb.new_output(t, omap=omap, dtype=acc_dtype)
    states = g.customized(ins, tb)
    Ms, Ls, Os = (g.reshape(x, shape=(bh, splits, rows, x.shape[-1])) if q_blocks == 1 else x for x in states)
    Y = split_kv_combine(g, Ms, Ls, Os, bh, combine_q_blocks, dtype,           # (b·hk, 1, rows, d)
                         empty_eps=EMPTY_ROW_EPS if empty_rows == "zero" else None)
    g.mark_output(g.reshape(Y, shape=(b, hk, rows, dv)))
    return g.build()


DECODE_MIN_KEYS = 128     # the fewest keys a split of decode attention walks (two 64-key tiles)
DECODE_WAVES = 2          # programs per SM decode attention's split count aims for (two resident per SM)


def decode_splits(bh: int, skv: int, n_sm: int) -> int:
    """The split count of split-KV decode over ``bh`` (batch rows x KV heads) programs per split and ``skv`` keys:
    FlashAttention-2's ``num_splits_heuristic`` over ``DECODE_WAVES · n_sm`` program slots — the fewest power-of-two
    splits (each at least ``DECODE_MIN_KEYS`` keys, dividing ``skv``) whose last wave is at least 85% as full as the
    best one's — so the SMs are full and the combine reads few partial states. 1 where ``bh`` fills the slots."""
    slots = DECODE_WAVES * n_sm
    if bh >= 0.8 * slots:
        return 1
    choices = [s for s in (2 ** i for i in range(8)) if skv % s == 0 and skv // s >= DECODE_MIN_KEYS] or [1]

    def fill(s: int) -> float:
        return bh * s / slots / -(-bh * s // slots)
    best = max(fill(s) for s in choices)
    return next(s for s in choices if fill(s) >= 0.85 * best)


def decode_split_counts(bh: int, skv: int, n_sm: int, tile: int = 64) -> list[int]:
    """The split counts decode attention times: :func:`decode_splits`' first, then half and twice it where those
    still split KV (twice: each split at least one ``tile`` of keys); the claimer times them. The heuristic alone
    left b=1 short (H100, 2026-11-25, bf16, 8 KV heads x 4k slots, the split kernel alone: 32 splits of 128 keys,
    8.4 µs, 1.46x the KV floor, against 1.04x at b=8 with 4 splits). Empty where KV is not split."""
    s = decode_splits(bh, skv, n_sm)
    if s == 1:
        return []
    return [s] + [x for x in (s // 2, 2 * s) if x > 1 and skv % x == 0 and skv // x >= tile]


SEEDS = {"flash_attention": flash_attention, "flash_decoding": flash_decoding}


# ------------------------------------------------------------------ column sums of P (H2O), non-convex kernels
ROW_BLOCK_KV = 128        # the longest KV whose whole score row one block holds (the row-block kernel)


def _column_band(band: tuple | None, sq: int) -> tuple | None:
    """The attention's ``band = (period, offset, window[, zero])`` for a loop over queries from a block of keys:
    query ``p`` sees key ``k`` iff ``p >= k − offset`` (and ``p < k − offset + window``), which is the band
    ``(keys, offset', window')`` of :func:`~.ugraph.band_range` with the roles swapped (a key's position is its
    index: keys are not packed)."""
    if band is None:
        return None
    _, offset, window, *zero = band
    off, win = (sq, sq + offset + 1) if window is None else (window - offset - 1, window)
    return (None, off, win, *zero)


def _column_op(g, Q, K, M, Mx, L, *, group: int, scale: float, softcap: float | None, q_tiles: int,
               k_blocks: int, band: tuple | None = None, table=None):
    """FlashTensor's non-convex kernel: ``Σ_rows exp(s − max)/sum`` per query head and key, the scores
    recomputed from Q and K with the first pass's row statistics ``Mx``, ``L`` (b, hk, rows, 1). The grid walks
    key blocks, the for-loop a head's query tiles. One query head per KV head: grid (hk, b, key blocks), any
    mask; GQA: grid (b·hk, group, key blocks) over Q seen as (b·hk, group, sq, d), so the mask must be shared
    by batch rows and KV heads or given for each. Under the attention's ``band`` (:func:`_column_band`) a key
    block visits only the query tiles that see one of its keys. With the mask's ``table`` (:func:`mask_tile_table`)
    a launch that scans it walks only the query tiles that see one of the block's keys, and reads no mask where
    it is all 0. Returns (b, hk·group, skv) fp32."""
    b, hk, rows, d = Q.shape
    skv, sq = K.shape[2], rows // group
    if group == 1:
        tb = new_threadblock_graph((hk, b, k_blocks), q_tiles)
        tQ = tb.new_input(Q, imap=(1, 0, PHI), fmap=2)
        tK = tb.new_input(K, imap=(1, 0, 2), fmap=PHI)
        tMx, tL = (tb.new_input(x, imap=(1, 0, PHI), fmap=2) for x in (Mx, L))
        tM = (tb.new_input(M, imap=(1 if M.shape[1] > 1 else PHI, 0 if M.shape[0] > 1 else PHI, 3), fmap=2)
              if M is not None else None)
        if table is not None:     # read by the launches that scan it, never by the math
            tb.new_input(table, imap=(1 if M.shape[1] > 1 else PHI, 0 if M.shape[0] > 1 else PHI, 3), fmap=2)
        omap = (1, 0, 3)
    else:
        bh = b * hk
        if M is not None and M.shape[0] * M.shape[1] not in (1, bh):
            raise ValueError(f"column sums under GQA: a mask of batch/head dims {tuple(M.shape[:2])} "
                             f"(need (1, 1) or {(b, hk)})")
        Q = g.reshape(Q, shape=(bh, group, sq, d))
        K = g.reshape(K, shape=(bh, skv, d))
        Mx, L = (g.reshape(x, shape=(bh, group, sq, 1)) for x in (Mx, L))
        tb = new_threadblock_graph((bh, group, k_blocks), q_tiles)
        tQ = tb.new_input(Q, imap=(0, 1, PHI), fmap=2)
        tK = tb.new_input(K, imap=(0, PHI, 1), fmap=PHI)
        tMx, tL = (tb.new_input(x, imap=(0, 1, PHI), fmap=2) for x in (Mx, L))
        tM = None
        if M is not None:
            shared = M.shape[0] * M.shape[1] == 1
            M = g.reshape(M, shape=(M.shape[0] * M.shape[1], group, sq, skv))
            tM = tb.new_input(M, imap=(PHI if shared else 0, 1, 3), fmap=2)
            if table is not None:     # each head's square rows are whole: sq a multiple of SCAN_TILE
                if sq % SCAN_TILE:
                    raise ValueError(f"column sums under GQA: a scan table needs whole {SCAN_TILE}-row squares "
                                     f"per head ({sq} rows)")
                table = g.reshape(table, shape=(M.shape[0], group, 2 * sq // SCAN_TILE, table.shape[-1]))
                tb.new_input(table, imap=(PHI if shared else 0, 1, 3), fmap=2)
        omap = (0, 1, 3)
    if (cb := _column_band(band, sq)) is not None:     # iterators: Q 0, K 1, Mx 2, L 3, mask 4 [, table 5]
        _band(tb, (skv, *cb[1:]), 1, 1 if group > 1 else 2, 0, 4 if tM is not None else None)
    if table is not None:
        tb.forloop_scan = 5
    p = tb.div(tb.exp(tb.sub(_scores(tb, tQ, tK, scale, softcap, tM), tMx)), tL)
    tb.new_output(tb.forloop_accum(p, "sum", dim=2), omap=omap, dtype="float32")
    ins = [Q, K, Mx, L] + ([M] if M is not None else []) + ([table] if table is not None else [])
    (C,) = g.customized(ins, tb)
    return g.reshape(C, shape=(b, hk * group, skv))


def _row_block_op(g, Q, K, V, M, *, group: int, scale: float, softcap: float | None, q_blocks: int) -> list:
    """One kernel for P·V and the column sums where a block holds whole score rows (KV ≤ :data:`ROW_BLOCK_KV`):
    grid (hk, b, row blocks), no for-loop; each block saves its rows' P·V and the column sums of its P, which a
    kernel-level sum over the row blocks of each head finishes (where a head has more than one). Row blocks hold
    rows of one head (``q_blocks`` a multiple of ``group``). Returns the output (b, hk, rows, d) and the column
    sums (b, hk·group, skv) fp32."""
    b, hk, rows, d = Q.shape
    skv = K.shape[2]
    if q_blocks % group:
        raise ValueError(f"row-block column sums: {q_blocks} row blocks do not split {group} heads")
    tb = new_threadblock_graph((hk, b, q_blocks), 1)
    tQ = tb.new_input(Q, imap=(1, 0, 2), fmap=PHI)
    tK, tV = (tb.new_input(x, imap=(1, 0, PHI), fmap=PHI) for x in (K, V))
    tM = (tb.new_input(M, imap=(1 if M.shape[1] > 1 else PHI, 0 if M.shape[0] > 1 else PHI, 2), fmap=PHI)
          if M is not None else None)
    s = _scores(tb, tQ, tK, scale, softcap, tM)
    e = tb.exp(tb.sub(s, tb.reduce_max(s, dim=3)))
    p = tb.div(e, tb.reduce_sum(e, dim=3))
    tb.new_output(tb.forloop_accum(tb.matmul(p, tV), "sum"), omap=(1, 0, 2))
    tb.new_output(tb.forloop_accum(tb.reduce_sum(p, dim=2), "sum"), omap=(1, 0, 2), dtype="float32")
    O, parts = g.customized([Q, K, V] + ([M] if M is not None else []), tb)    # parts: (b, hk, q_blocks, skv)
    if q_blocks == group:                      # one block per head: its sums are the head's
        return [O, g.reshape(parts, shape=(b, hk * group, skv))]
    per_head = g.reshape(parts, shape=(b, hk * group, q_blocks // group, skv))
    return [O, g.reshape(g.reduce_sum(per_head, dim=2), shape=(b, hk * group, skv))]


def _k_flash(g, env, p, stats=False):
    outs = _flash_op(g, env["q"], env["k"], env["v"], env.get("mask"), scale=p["scale"], softcap=p["softcap"],
                     q_blocks=tiles(p["rows"], p["tile"]), forloop_range=tiles(p["skv"], p["tile"]),
                     band=p["band"], stats=stats, table=env.get("table"))
    return dict(zip(("out", "row_max", "row_sum"), outs))


def _k_columns(g, env, p):
    sq = p["rows"] // p["group"]
    return {"colsum": _column_op(g, env["q"], env["k"], env.get("mask"), env["row_max"], env["row_sum"],
                                 group=p["group"], scale=p["scale"], softcap=p["softcap"],
                                 q_tiles=tiles(sq, p["tile"]), k_blocks=tiles(p["skv"], p["tile"]),
                                 band=p["band"], table=env.get("table"))}


def _k_row_block(g, env, p):
    if p["skv"] > ROW_BLOCK_KV:
        raise ValueError(f"row-block column sums: KV length {p['skv']} > {ROW_BLOCK_KV} (a block holds whole rows)")
    sq = p["rows"] // p["group"]
    out, colsum = _row_block_op(g, env["q"], env["k"], env["v"], env.get("mask"), group=p["group"],
                                scale=p["scale"], softcap=p["softcap"], q_blocks=p["group"] * tiles(sq, p["tile"]))
    return {"out": out, "colsum": colsum}


@dataclass(frozen=True)
class PlanKernel:
    """A kernel a column-sum plan may use: the values it produces and needs (``out``: P·V; ``colsum``: the column
    sums of P; ``stats``: the row max and sum of exponentials), and how it adds itself to a kernel graph."""
    name: str
    produces: frozenset
    needs: frozenset
    build: Callable


PLAN_KERNELS = {k.name: k for k in (
    PlanKernel("flash", frozenset({"out"}), frozenset(), _k_flash),
    PlanKernel("flash_stats", frozenset({"out", "stats"}), frozenset(), partial(_k_flash, stats=True)),
    PlanKernel("column_sums", frozenset({"colsum"}), frozenset({"stats"}), _k_columns),
    PlanKernel("row_block", frozenset({"out", "colsum"}), frozenset(), _k_row_block),
)}


def attention_column_sums(b: int, hk: int, rows: int, skv: int, d: int, *, group: int, kernels: Sequence[str],
                          scale: float, softcap: float | None = None, mask: tuple[int, int] | None = None,
                          dtype: str = "float16", mask_dtype: str = "float32", tile: int = 64,
                          band: tuple | None = None, scan_table: bool = False, row_sums: bool = False
                          ) -> KernelGraph:
    """Attention and the column sums of its P from one plan: inputs as :func:`flash_attention` (Q packed
    ``group`` query heads per KV head), outputs P·V (b, hk, rows, d) and ``Σ_queries P`` per query head
    (b, hk·group, skv) fp32, computed by ``kernels`` (names of :data:`PLAN_KERNELS`, each after the kernels whose
    values it needs): ``flash_stats`` + ``column_sums`` (two passes) or ``row_block`` (one). ``scan_table``: the
    mask's tile table (:func:`mask_tile_table`), made once and read by both passes' scanning launches.
    ``row_sums``: a two-pass plan also outputs the first pass's row sums of exponentials (b, hk, rows, 1) fp32 —
    0 for a row whose keys are all -inf, NaN for a NaN row: the rows whose column sums eager makes NaN, which a
    column pass that skips tiles (a band, a scan) may not visit."""
    if rows % group:
        raise ValueError(f"attention_column_sums: {rows} rows are not {group} heads of equal length")
    g = new_kernel_graph()
    env = {"q": g.new_input((b, hk, rows, d), dtype), "k": g.new_input((b, hk, skv, d), dtype),
           "v": g.new_input((b, hk, skv, d), dtype)}
    if mask is not None:
        env["mask"] = g.new_input((*mask, rows, skv), mask_dtype)
    if scan_table:
        if "row_block" in kernels:
            raise ValueError("attention_column_sums: the row-block kernel has no loop for a scan table to bound")
        env["table"] = mask_tile_table(g, env.get("mask"), band)
    params = dict(rows=rows, skv=skv, group=group, scale=scale, softcap=softcap, tile=tile, band=band)
    for name in kernels:
        kernel = PLAN_KERNELS[name]
        missing = {"row_max" if n == "stats" else n for n in kernel.needs} - set(env)
        if missing:
            raise ValueError(f"attention_column_sums: kernel {name} needs {sorted(missing)}, which no kernel "
                             f"before it in {list(kernels)} produces")
        env.update(kernel.build(g, env, params))
    if "out" not in env or "colsum" not in env:
        raise ValueError(f"attention_column_sums: kernels {list(kernels)} do not produce both P·V and the column sums")
    g.mark_output(env["out"])
    g.mark_output(env["colsum"])
    if row_sums and "row_sum" in env:
        g.mark_output(env["row_sum"])
    return g.build()
