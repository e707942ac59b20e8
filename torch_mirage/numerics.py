"""How mirage compares numbers: one relative error, one tolerance table, one RMSNorm reference.

Every numeric comparison in the package — the compile-time check of a region against eager
(:mod:`.runtime.measure`), launch tuning's agreement between configs (:mod:`.superopt.launch`), the search's
float probe (:mod:`.superopt.search.driver`), the equivalence verifier's float test
(:mod:`.superopt.verify`), the bench's correctness gate (:mod:`.bench`) and the tests —
measures :func:`relative_error` and compares it with :func:`tolerance` for the output's dtype and the use.
The uses differ on purpose, and each difference is a named column of :data:`TOLERANCE`, not a copy.

:func:`rms_norm` is the one RMSNorm formula: the μGraph library's reference math (``upcast=False``) and the
way half-precision models write it (``upcast=True``: in fp32, cast back, then the gain), which the library
claimer traces to match user graphs and the tests and bench run as workloads.
"""
from __future__ import annotations

from typing import Literal

import torch

# relative error allowed, by use and dtype
TOLERANCE: dict[str, dict[torch.dtype, float]] = {
    # a kernel's output against eager (or against a float64 run of the same graph): the compile-time check of
    # every region and the tests' assert_close
    "kernel": {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2},
    # a bench case against its float64 (CPU) / float32 (GPU) reference; a mode may also be bench.ERR_SLACK times
    # as far off as eager itself
    "bench": {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2},
    # a whole model's logits against eager's (bench models / LLM scenarios): many layers of rounding
    "model": {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 6e-2},
    # two launch configs of one μGraph against each other: the same sums in another order; half-precision
    # inputs bound the agreement even of fp32 outputs (a split-KV's fp32 partials from fp16 Q / K / V differ
    # by ~1e-4, which is not a wrong config)
    "retile": {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 5e-3},
    # the search's float64 probe, in the max norm: a wrong imap / fmap is off by O(1)
    "probe": {torch.float64: 1e-6},
    # the equivalence verifier's float test (superopt.verify), fp64 in the max norm over the reference's finite
    # elements: reassociation error is ~1e-15 there, a real rewrite bug is O(1)
    "verify": {torch.float64: 1e-7},
}
Use = Literal["kernel", "bench", "model", "retile", "probe", "verify"]

_CHUNK = 1 << 22   # elements compared at a time: the check of a 2 GiB logits output needs no 4 GiB float64 copy


def tolerance(dtype: torch.dtype, use: Use = "kernel") -> float:
    """The relative error allowed for an output of ``dtype`` in ``use`` (a column of :data:`TOLERANCE`)."""
    column = TOLERANCE[use]
    if dtype not in column:
        raise ValueError(f"torch_mirage: no {use!r} tolerance for {dtype}; the table has "
                         f"{', '.join(str(d) for d in column)} (torch_mirage/numerics.py)")
    return column[dtype]


def _chunks(*tensors: torch.Tensor):
    flat = [t.reshape(-1) for t in tensors]
    for i in range(0, flat[0].numel(), _CHUNK):
        yield [f[i:i + _CHUNK] for f in flat]


def relative_error(got: torch.Tensor, ref: torch.Tensor, where: torch.Tensor | None = None, *,
                   norm: Literal["l2", "max"] = "l2") -> float:
    """``‖got − ref‖ / ‖ref‖`` in float64 (the absolute error where ``ref`` is all zero), in the L2 or the max
    norm, over the elements where ``where`` is finite (all elements when ``where`` is None). A NaN in ``got``
    among those elements gives NaN, which passes no tolerance; compare non-finite values with
    :func:`same_non_finite`."""
    if tuple(got.shape) != tuple(ref.shape):
        raise ValueError(f"torch_mirage: shape {tuple(got.shape)} where the reference has {tuple(ref.shape)}")
    diff = size = 0.0
    for part in _chunks(got, ref, *(() if where is None else (where,))):
        g, r = part[0].double(), part[1].double()
        if where is not None:
            keep = torch.isfinite(part[2])
            g, r = g[keep], r[keep]
        if not r.numel():
            continue
        if norm == "max":
            diff = max(diff, (g - r).abs().max().item(), key=_nan_first)
            size = max(size, r.abs().max().item(), key=_nan_first)
        else:
            diff += (g - r).pow(2).sum().item()
            size += r.pow(2).sum().item()
    if norm == "l2":
        diff, size = diff ** 0.5, size ** 0.5
    return diff / (size or 1.0)


def _nan_first(x: float) -> float:
    """Sort key making NaN the largest value, so that a running ``max`` keeps a NaN it met."""
    return float("inf") if x != x else x


def same_non_finite(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """NaN and ±inf in the same places, with the same infinities."""
    for g, r in _chunks(got, ref):
        finite = torch.isfinite(r)
        if not torch.equal(finite, torch.isfinite(g)):
            return False
        if not torch.equal(g[~finite].double().nan_to_num(), r[~finite].double().nan_to_num()):
            return False
    return True


def rms_norm(x: torch.Tensor, eps: float = 1e-6, weight: torch.Tensor | None = None, *,
             upcast: bool = True) -> torch.Tensor:
    """``x / sqrt(mean(x²) + eps)`` over the last dim, times ``weight`` when given.

    ``upcast=True`` is RMSNorm as half-precision models write it: ``x.float()``, the norm, cast back to x's
    dtype, then the gain (a float64 ``x`` is normed in fp32 too, as that code does). ``upcast=False`` computes
    in x's own dtype: the μGraph library's reference math. The ops and their order are what the library
    claimer matches in user graphs, so a change here changes what it finds."""
    h = x.float() if upcast else x
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if upcast:
        h = h.to(x.dtype)
    return h if weight is None else h * weight
