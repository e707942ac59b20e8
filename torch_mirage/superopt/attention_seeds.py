"""Attention μGraphs instantiated from an :class:`~torch_mirage.analysis.attention.AttentionSpec` (seeds).

Both seeds take the query heads of one KV head packed into the rows of a tile — Q (b, hk, g·sq, d), so K and V
are read once per group (GQA) — and score a tile as ``mask + softcap(scale · Q Kᵀ)`` with ``softcap(x) =
c·tanh(x/c)`` inside the KV loop, then run the online-softmax accumulator:

* :func:`flash_attention`: one kernel, grid (hk, b, row blocks), the for-loop walks all of KV.
* :func:`flash_decoding`: split-KV in two kernels (partial max/sum/out per split, then the combine), for few
  query rows (decode, speculative decode), where FlashAttention's grid would leave SMs idle.

An additive mask arrives as one more input, (bm, hm, g·sq, skv) with bm ∈ {1, b} and hm ∈ {1, hk} (a mask the
same for every batch row or KV head is read by every block, not copied), loaded per tile by an iterator that walks
KV with K; the claimer turns bool masks and ``is_causal`` into that form. Both graphs are ordinary μGraphs: they verify
(:mod:`.verify`) and compile (:mod:`.compile`) like the library's.

Where the mask's value property shows a causal / sliding-window structure, ``band = (period, offset, window)``
sets the block graph's ``forloop_band`` (:func:`~torch_mirage.ugraph.band_range`): query row ``r`` (position ``r % period``)
sees key ``k`` iff ``k <= pos + offset`` (and ``k > pos + offset - window``), so each row block's for-loop runs
only over the key tiles it can see; the mask is added on the visited tiles that some row sees only in part (the
diagonal ones) and, where the mask's visible part is 0 (``band[3]``), not loaded on the tiles every row sees. A
split of the split-KV seed that a row block cannot see runs no iteration and saves m = -inf, l = 0, o = 0, which
the combine weighs by ``exp(-inf) = 0``.
"""
from __future__ import annotations

from ..ugraph import KernelGraph
from .builder import new_kernel_graph, new_threadblock_graph
from .library import blocks, split_kv_combine

PHI = None


def _band(tb, band, q_input: int, q_dim: int, k_input: int, mask_input: int | None) -> None:
    """``band = (period, offset, window[, zero_mask])``: ``zero_mask`` — the mask is 0 wherever the band
    sees (its visible part), so a tile every row sees whole is not loaded."""
    if band is not None:
        period, offset, window, *zero = band
        z = mask_input if zero and zero[0] else None
        tb.forloop_band = (q_input, q_dim, k_input, int(period), int(offset), None if window is None else int(window),
                           z)


def _scores(tb, tQ, tK, scale: float, softcap: float | None, tMask):
    s = tb.scalar_mul(tb.matmul(tQ, tb.transpose(tK)), value=scale)
    if softcap is not None:
        s = tb.scalar_mul(tb.tanh(tb.scalar_mul(s, value=1.0 / softcap)), value=softcap)
    return tb.add(s, tMask) if tMask is not None else s


def flash_attention(b: int, hk: int, rows: int, skv: int, d: int, *, scale: float, softcap: float | None = None,
                    mask: tuple[int, int] | None = None, dtype: str = "float16", mask_dtype: str = "float32",
                    q_blocks: int | None = None, forloop_range: int | None = None, tile: int = 64,
                    band: tuple | None = None) -> KernelGraph:
    """``softmax(mask + softcap(scale·Q Kᵀ)) V``: inputs Q (b, hk, rows, d), K, V (b, hk, skv, d)
    [+ mask (bm, hm, rows, skv) when ``mask = (bm, hm)``]; output (b, hk, rows, d)."""
    q_blocks = q_blocks or blocks(rows, tile)
    forloop_range = forloop_range or blocks(skv, tile)
    g = new_kernel_graph()
    Q, K, V = g.new_input((b, hk, rows, d), dtype), g.new_input((b, hk, skv, d), dtype), g.new_input((b, hk, skv, d), dtype)
    masked = mask is not None
    M = g.new_input((*mask, rows, skv), mask_dtype) if masked else None
    tb = new_threadblock_graph((hk, b, q_blocks), forloop_range)
    _band(tb, band, 0, 2, 1, 3 if masked else None)
    tQ = tb.new_input(Q, imap=(1, 0, 2), fmap=PHI)
    tK = tb.new_input(K, imap=(1, 0, PHI), fmap=2)
    tV = tb.new_input(V, imap=(1, 0, PHI), fmap=2)
    tM = tb.new_input(M, imap=(1 if mask[1] > 1 else PHI, 0 if mask[0] > 1 else PHI, 2), fmap=3) if masked else None
    _, l, o = tb.forloop_accum_online_softmax(_scores(tb, tQ, tK, scale, softcap, tM), tV)
    tb.new_output(tb.div(o, l), omap=(1, 0, 2))
    (Y,) = g.customized([Q, K, V] + ([M] if masked else []), tb)
    g.mark_output(Y)
    return g.build()


def flash_decoding(b: int, hk: int, rows: int, skv: int, d: int, *, scale: float, softcap: float | None = None,
                   mask: tuple[int, int] | None = None, dtype: str = "float16", mask_dtype: str = "float32",
                   splits: int | None = None, forloop_range: int | None = None, q_blocks: int | None = None,
                   combine_q_blocks: int | None = None, tile: int = 64, band: tuple | None = None) -> KernelGraph:
    """The same attention split over KV: kernel 1, grid (b·hk, row blocks, splits), saves each split's
    (max, sum, out); kernel 2 rescales each by ``exp(m_s − max_s m_s)`` and combines them. Batch and KV heads
    merge into one grid dim, so a mask must be shared by all of them or given for each: ``mask`` (1, 1) or
    (b, hk)."""
    masked = mask is not None
    if masked and tuple(mask) not in ((1, 1), (b, hk)):
        raise ValueError(f"flash_decoding: a mask of batch/head dims {tuple(mask)} (need (1, 1) or {(b, hk)})")
    splits = splits or blocks(skv, 4 * tile)
    forloop_range = forloop_range or blocks(skv // splits, tile)
    q_blocks = q_blocks or blocks(rows, tile)
    combine_q_blocks = combine_q_blocks or blocks(rows, 8)
    g = new_kernel_graph()
    Q, K, V = g.new_input((b, hk, rows, d), dtype), g.new_input((b, hk, skv, d), dtype), g.new_input((b, hk, skv, d), dtype)
    M = g.new_input((*mask, rows, skv), mask_dtype) if masked else None
    bh = b * hk
    Q4 = g.reshape(Q, shape=(bh, 1, rows, d))
    K3, V3 = g.reshape(K, shape=(bh, skv, d)), g.reshape(V, shape=(bh, skv, d))
    M4 = g.reshape(M, shape=(mask[0] * mask[1], 1, rows, skv)) if masked else None
    tb = new_threadblock_graph((bh, q_blocks, splits), forloop_range)
    _band(tb, band, 0, 2, 1, 3 if masked else None)
    tQ = tb.new_input(Q4, imap=(0, 2, PHI), fmap=PHI)
    tK = tb.new_input(K3, imap=(0, PHI, 1), fmap=1)
    tV = tb.new_input(V3, imap=(0, PHI, 1), fmap=1)
    tM = tb.new_input(M4, imap=(0 if mask[0] * mask[1] > 1 else PHI, 2, 3), fmap=3) if masked else None
    acc_dtype = "float32" if dtype in ("float16", "bfloat16") else dtype
    for t in tb.forloop_accum_online_softmax(_scores(tb, tQ, tK, scale, softcap, tM), tV):
        tb.new_output(t, omap=(0, 2, 1), dtype=acc_dtype)
    Ms, Ls, Os = g.customized([Q4, K3, V3] + ([M4] if masked else []), tb)      # (b·hk, splits, rows, ·)
    Y = split_kv_combine(g, Ms, Ls, Os, bh, combine_q_blocks, dtype)            # (b·hk, 1, rows, d)
    g.mark_output(g.reshape(Y, shape=(b, hk, rows, d)))
    return g.build()


SEEDS = {"flash_attention": flash_attention, "flash_decoding": flash_decoding}
