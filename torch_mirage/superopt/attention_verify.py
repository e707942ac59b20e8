"""Verification of the attention claimer's seed μGraphs and column-sum plans before they run (issue 15: every μGraph
that runs is verified).

A seed is built at the region's dims (:func:`.attention_claim._build_seeds`), where the verifier's executor, which
steps every block and for-loop step in Python, would take minutes (4k keys, heads of 128). So the same seed is built
again at a small instance of the region's own parameters — its scale, soft-cap, mask kind (additive or bool, with
the bool mask's fill, shared over batch rows or KV heads as the region's is), its band (causal / sliding window,
computed from indices or read from the mask) and the seed's own schedule kind (a split-KV seed split, FlashAttention
over several key tiles, a mask tile table) — with the same construction and other counts (one batch row, at most
two KV heads, two query heads per KV head and two query positions, 16 keys, heads of 8, tiles of 4), and
:func:`.verify.verify` checks it against ``softmax(mask + softcap(scale·Q Kᵀ)) V`` written in PyTorch on inputs
shaped as the seed takes them (Q packed per KV head, or a head per program): the finite-field test where the
program is LAX (tanh is an uninterpreted function there; masks and bands make it float-only: the verdict says
which), and the float test always.

What is not covered here: a region with SDPA's empty rows (``empty_rows="zero"``) runs ``o / (l + 1e-30)``, an
identity only up to rounding (every row with a key has l >= 1), which the field test would reject; its twin with
``o / l`` is verified, and the epsilon is left to the float check of the whole region against eager ATen that the
check stage runs at the real sizes. Likewise a column-sum plan's (H2O) extra output, the first pass's row sums of
exponentials, which depend on the row max: the plan is verified without it (P·V and the column sums of P per query
head, :data:`COLUMN_SQ` query positions so that its column pass walks several row tiles).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch

from ..cache import ProcessMemo
from ..ugraph import KernelGraph
from .attention_seeds import SCAN_TILE, SEEDS, attention_column_sums
from .compile import DTYPES
from .verify import Verdict, verify

log = logging.getLogger("torch_mirage")

SMALL = dict(b=1, heads=2, group=2, sq=2, skv=16, d=8, tile=4, splits=2)   # the small instance's counts
COLUMN_SQ = 8         # query positions of a column-sum plan's small instance: its column pass walks several row tiles
# what a seed name builds: the attention seeds, and a column-sum plan (its own parameters: group, kernels, ...)
BUILDERS = {**SEEDS, "column_sums": attention_column_sums}
REFERENCE = "softmax(mask + bias + softcap(scale·Q Kᵀ)) V"   # what :func:`reference` computes: its verdicts' cache key


def small_instance(b: int, hk: int, group: int, sq: int, skv: int, kwargs: dict, own: dict
                   ) -> tuple[tuple, dict, dict]:
    """``((b, hk, rows, skv, d), kwargs, own)`` of the small instance of a seed built at the region's dims with
    ``kwargs`` (:func:`.attention_claim._seed_kwargs` and the softmax's) and its own parameters ``own``."""
    columns = "kernels" in own             # a column-sum plan
    per_head = own.get("q_heads") is not None    # a program per query head (FlashAttention's ``q_heads``)
    hk_s, group_s = min(hk, SMALL["heads"]), min(group, SMALL["group"])
    sq_s = min(sq, COLUMN_SQ if columns else SMALL["sq"])
    rows_s, skv_s, tile = (1 if per_head else group_s) * sq_s, SMALL["skv"], SMALL["tile"]
    small = dict(kwargs, tile=tile)
    if small.get("dv"):                    # V's head size unlike Q's: kept unlike, and small
        small["dv"] = SMALL["d"] // 2
    if small.get("empty_rows") == "zero":
        small["empty_rows"] = "nan"         # o / l: the epsilon is a float device (module docstring)
    if kwargs.get("mask") is not None:
        _, hm = kwargs["mask"]             # shared over batch rows or not: one batch row here either way
        small["mask"] = (1, 1 if hm == 1 else hk_s * (group_s if per_head else 1))
    if kwargs.get("bias") is not None:     # the same, and one row or a row per query row
        _, hm, br = kwargs["bias"]
        small["bias"] = (1, 1 if hm == 1 else hk_s * (group_s if per_head else 1), 1 if br == 1 else rows_s)
    if kwargs.get("band") is not None:
        period, offset, window, *flags = kwargs["band"]
        # keys a query sees: ``offset`` ahead of its position, ``window`` back; kept at the same place in the keys
        last = skv - sq
        offset_s = skv_s - sq_s if offset >= last else 0 if offset <= 0 else max(1, min(skv_s - sq_s - 1,
                                                                                         offset * skv_s // skv))
        window_s = None if window is None else max(1, min(window, skv_s // 2))
        small["band"] = (sq_s, offset_s, window_s, *flags)
    own = dict(own)
    if per_head:
        own["q_heads"] = hk_s * group_s
    if "splits" in own:
        own["splits"] = SMALL["splits"]
    if columns:
        # the first pass's row sums of exponentials depend on the row max, not only through a shift that cancels
        # (a false reject in the field test): the plan without that output is verified
        own.update(group=group_s, row_sums=False)
    if own.get("scan_table"):              # the table's squares: SCAN_TILE x SCAN_TILE, two row blocks of them at least
        rows_s, skv_s, small["tile"] = 2 * SCAN_TILE, 2 * SCAN_TILE, SCAN_TILE
    if "tile" in own:                      # a parameter of the seed's own (a column-sum plan's)
        own["tile"] = small.pop("tile")
    return (1, hk_s, rows_s, skv_s, SMALL["d"]), small, own


def reference(scale: float, softcap: float | None, mask_fill: float, columns: tuple[int, int] | None = None
              ) -> Callable:
    """The attention the seeds compute, on their inputs (Q packed per KV head, or a head per query head, each
    group's KV head repeated): ``softmax(mask + bias + softcap(scale·Q Kᵀ)) V`` (a bool
    mask keeps the scores where True and puts ``mask_fill`` elsewhere; ``bias``, a second additive mask of one row
    or a row per query row, is added as it is: the verifier draws it as any float input); with ``columns = (group, sq)`` also the
    column sums of P per query head (b, hk·group, skv), as a column-sum plan outputs them."""
    def per_query_head(m, h, g, rows):
        """A (bm, hm, rows | 1, skv) mask seen as the scores' (b, hk, g, rows, skv)."""
        return m.reshape(m.shape[0], -1, g, m.shape[2], m.shape[-1]) if m.shape[1] == h and g > 1 else m.unsqueeze(2)

    def attention(q, k, v, mask=None, bias=None):
        b, h, rows, _ = q.shape
        hk, g = k.shape[1], h // k.shape[1]      # g > 1: a head per program, its group's KV head
        for m in (mask, bias):
            if m is not None and m.is_floating_point():    # an fp32 mask on fp16 scores: both in fp32
                dt = torch.promote_types(q.dtype, m.dtype)
                q, k, v = q.to(dt), k.to(dt), v.to(dt)
        mask, bias = (m.to(q.dtype) if m is not None and m.is_floating_point() else m for m in (mask, bias))
        # the group's heads as one matmul per KV head (views of the contiguous inputs, which the field test's
        # traced reference evaluates as they are), the scores then seen per query head
        s = (q.reshape(b, hk, g * rows, q.shape[-1]) @ k.transpose(-1, -2) * scale).reshape(b, hk, g, rows, -1)
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        if bias is not None:
            s = s + per_query_head(bias, h, g, rows)
        if mask is not None:
            m = per_query_head(mask, h, g, rows)
            s = torch.where(m, s, mask_fill) if mask.dtype == torch.bool else s + m
        p = torch.softmax(s, -1).reshape(b, hk, g * rows, -1)
        if columns is None:
            return (p @ v).reshape(b, h, rows, -1)
        b, hk, _, skv = p.shape
        return p @ v, p.reshape(b, hk * columns[0], columns[1], skv).sum(2)
    return attention


# verify_seed's verdicts in this process by what builds the seed and the verifier's settings: a model's next layer
# neither builds the small instance nor hashes it for the verifier's cache again
_VERDICTS = ProcessMemo(256)


def verify_seed(seed: str, dims: tuple, kwargs: dict, own: dict, config: Any, cache: Any = None) -> Verdict:
    """The verdict on seed ``seed`` (a name of :data:`BUILDERS`) built at ``dims`` (b, hk, rows, skv, d) with
    ``kwargs`` and ``own`` (a small instance: :func:`small_instance`) against :func:`reference`, with ``config``'s
    verifier settings; kept in this process and, by the verifier, in ``cache`` (the compile's disk cache), so a
    model's layers verify their shared seeds once."""
    key = repr((seed, dims, sorted(kwargs.items()), sorted(own.items()), config.verify_error_bound,
                config.verify_trials, REFERENCE))
    return _VERDICTS.get(key, lambda: _verify_seed(seed, dims, kwargs, own, config, cache))


def _verify_seed(seed: str, dims: tuple, kwargs: dict, own: dict, config: Any, cache: Any = None) -> Verdict:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    kg: KernelGraph = BUILDERS[seed](*dims, **kwargs, **own)
    columns = (own["group"], dims[2] // own["group"]) if seed == "column_sums" else None
    params = (kwargs["scale"], kwargs.get("softcap"), kwargs.get("mask_fill", float("-inf")), columns)
    with unset_fake_temporarily():      # the verifier runs real tensors (the partition stage may be under a fake mode)
        examples = [torch.zeros(tuple(op.attrs["shape"]), dtype=DTYPES[op.attrs["dtype"]]) for op in kg.inputs]
        return verify(kg, reference(*params), examples, error_bound=config.verify_error_bound,
                      trials=config.verify_trials, cache=cache, reference_key=repr((REFERENCE, params)))


def verified(built: Sequence[tuple[str, KernelGraph]], names: dict, spec_dims: tuple, kwargs: dict, config: Any,
             cache: Any = None) -> tuple[list[tuple[str, KernelGraph]], dict[str, str]]:
    """The seeds of ``built`` (name, μGraph at the region's dims) whose small instance verifies, and each seed's
    verdict in words. ``names``: each name's (seed, own parameters); ``spec_dims``: the region's (b, hk, group, sq,
    skv)."""
    kept, said = [], {}
    for name, kg in built:
        seed, own = names[name]
        dims, small, small_own = small_instance(*spec_dims, kwargs, own)
        try:
            verdict = verify_seed(seed, dims, small, small_own, config, cache)
        except Exception as e:     # a seed with no small instance is not run unverified
            said[name] = f"not verified: no small instance ({type(e).__name__}: {e})"
            log.info("torch_mirage: attention seed %s %s", name, said[name])
            continue
        said[name] = verdict.reason
        if verdict.equivalent:
            kept.append((name, kg))
        else:
            log.info("torch_mirage: attention seed %s rejected by the verifier: %s", name, verdict.reason)
    return kept, said
