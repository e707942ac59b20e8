"""Masks computed from indices (issue 16): where a mask's value property shows it is exactly a causal / sliding
window band (0 where seen, a floor elsewhere), the banded seeds never read it — tiles every row sees whole skip
it, partly seen tiles compute ``key <= pos + offset`` (and the window's lower edge) from the indices — and the
graph's nodes that build it only for the region join the claim (dead), so nothing is built, packed or loaded per
call. Masks whose values are not known (passed in, padding) are still loaded. fp64 references."""
import os

import pytest
import torch

from helpers import assert_close
from test_attention_band import _eager, _inmask
from test_attention_family import _attention_regions, _check, _compile, _qkv, repeat_kv
from torch_mirage.bench import workloads as W
from torch_mirage.superopt.attention_seeds import attention_column_sums, flash_attention, flash_decoding
from torch_mirage.superopt.compile import compile_ugraph
from torch_mirage.superopt.executor import execute
from torch_mirage.ugraph import MASK_FLOOR

interp = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                            reason="CPU kernels run only in Triton's interpreter (TRITON_INTERPRET=1)")


def _by_index(region) -> bool:
    info = region.info
    band = info.get("forloop_band")
    return info.get("mask", "").startswith("from indices") and band is not None and len(band) == 8 and band[7] is True


def _band_mask(rows, skv, period, offset, window=None):
    pos = torch.arange(rows)[:, None] % period
    j = torch.arange(skv)[None, :]
    seen = j <= pos + offset
    if window is not None:
        seen &= j > pos + offset - window
    return torch.zeros(rows, skv, dtype=torch.float64).masked_fill(~seen, MASK_FLOOR)[None, None]


@interp
@pytest.mark.parametrize("case", ["causal", "window", "softcap", "gqa", "decode"])
def test_in_graph_masks_are_computed_from_indices(case):
    """HF eager / gemma2 soft-cap attention with the mask built in the graph from index comparisons: claimed with
    the index mask, the mask's nodes joined to the region, eager-equal (fp64)."""
    h, hk, sq, skv, window = 4, 4, 16, 16, None
    if case == "window":
        window = 5
    elif case == "gqa":
        hk = 2
    elif case == "decode":     # a KV cache: causal with offset skv - sq
        hk, sq, skv = 2, 4, 24

    def f(q, k, v):
        mask = _inmask(q.shape[-2], k.shape[-2], window, q.dtype, q.device)
        if case == "softcap":
            return W.gemma2_softcap(q, k, v, mask)
        return _eager(q, k, v, mask)

    (region,) = _check(f, _qkv(1, h, hk, sq, skv, 16, torch.float32), torch.float32)
    assert _by_index(region) and "mask nodes joined" in region.info["mask"], region.info


@interp
@pytest.mark.parametrize("hk,window", [(2, None), (1, None), (2, 40)])
def test_column_sums_with_masks_from_indices(hk, window):
    """H2O (P·V and the column sums of P) over KV too long for whole rows (the two-pass plan): both kernels
    compute the mask from indices — the column pass with the band's roles swapped; GQA; a window."""
    def f(q, k, v):
        n_rep = q.shape[1] // k.shape[1]
        mask = _inmask(q.shape[-2], k.shape[-2], window, q.dtype, q.device)
        return W.h2o_core(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), mask)

    torch._dynamo.reset()
    compiled, report = _compile(f)
    args = _qkv(1, 2, hk, 136, 136, 16, torch.float32)
    outs = compiled(*args)
    refs = f(*[a.double() for a in args])
    for out, ref in zip(outs, refs):
        assert_close(out, ref.to(out.dtype), torch.float32)
    (region,) = _attention_regions(report)
    assert region.info["plan"] == ["flash_stats", "column_sums"] and _by_index(region), region.info


@interp
@pytest.mark.parametrize("seed", ["flash", "split", "columns"])
@pytest.mark.parametrize("window", [None, 5])
def test_seeds_never_read_an_index_mask(seed, window):
    """The seeds with ``index_mask``: fed a broadcast zero stand-in they equal the fp64 reference on the band's
    real mask; the source loads no mask; rows that see none of a visited tile (the window's first tile of a
    misaligned block) stay finite; the executor computes the same mask."""
    b, hk, g, sq, skv, d, off = 1, 2, 2, 16, 32, 16, 16
    rows = g * sq
    band = (sq, off, window, True, True)
    if seed == "flash":
        kg = flash_attention(b, hk, rows, skv, d, scale=0.3, softcap=5.0, mask=(1, 1), dtype="float32",
                             q_blocks=4, forloop_range=4, band=band)
    elif seed == "split":
        kg = flash_decoding(b, hk, rows, skv, d, scale=0.3, softcap=5.0, mask=(1, 1), dtype="float32",
                            splits=2, forloop_range=2, q_blocks=2, band=band)
    else:
        kg = attention_column_sums(b, hk, rows, skv, d, group=g, kernels=["flash_stats", "column_sums"], scale=0.3,
                                   softcap=5.0, mask=(1, 1), dtype="float32", tile=8, band=band)
    q, k, v = torch.randn(b, hk, rows, d), torch.randn(b, hk, skv, d), torch.randn(b, hk, skv, d)
    standin = torch.zeros(()).expand(1, 1, rows, skv)
    m = _band_mask(rows, skv, sq, off, window)
    s = torch.tanh(q.double() @ k.double().transpose(-1, -2) * 0.3 / 5.0) * 5.0 + m
    p = torch.softmax(s, -1)
    refs = [p @ v.double(), p.reshape(b, hk, g, sq, skv).sum(-2).reshape(b, hk * g, skv)]
    c = compile_ugraph(kg, [q, k, v, standin])
    outs = c(q, k, v, standin)
    assert all(torch.isfinite(o).all() for o in outs)
    for out, ref in zip(outs, refs):
        assert_close(out, ref.float(), torch.float32)
    mask_arg = [3] if seed != "columns" else [3, 4]          # the column pass reads Q, K, max, sum, mask
    for src, i in zip(map(str, c.sources), mask_arg):
        assert f"tl.load(in{i}_ptr" not in src and "tl.where(" in src, src
    for out, ref in zip(execute(kg, [q, k, v, standin]), refs):
        assert_close(out, ref.float(), torch.float32)


@interp
def test_masks_of_unknown_values_are_still_loaded():
    """A causal mask passed in (values unknown) and one joined with a padding condition (rows may be fully
    masked): no index mask, the mask is read, eager-equal."""
    def f(q, k, v, mask):
        return _eager(q, k, v, mask)

    q, k, v = _qkv(1, 2, 2, 8, 8, 16, torch.float32)
    (region,) = _check(f, (q, k, v, _inmask(8, 8)), torch.float32)
    assert "mask" not in region.info, region.info

    def g(q, k, v, pad):
        i, j = torch.arange(8)[:, None], torch.arange(8)[None, :]
        keep = (j <= i) & (j >= pad)
        low = torch.full((), torch.finfo(torch.float32).min, dtype=q.dtype)
        return _eager(q, k, v, torch.where(keep, torch.zeros((), dtype=q.dtype), low)[None, None])

    (region,) = _check(g, (q, k, v, torch.tensor(3)), torch.float32)
    assert "mask" not in region.info, region.info
    # the seed without an index mask loads it
    kg = flash_attention(1, 2, 8, 8, 16, scale=0.25, mask=(1, 1), dtype="float32", band=(8, 0, None, True))
    src = "\n".join(map(str, compile_ugraph(kg, [q, k, v, torch.zeros(1, 1, 8, 8)]).sources))
    assert "tl.load(in3_ptr" in src, src


@interp
def test_shared_mask_stays_an_input():
    """A mask that something else reads too (HF: one mask for every layer) is not joined to the region: it is
    built once per call and passed, and the kernel still computes it from indices."""
    def f(q, k, v):
        mask = _inmask(q.shape[-2], k.shape[-2], None, q.dtype, q.device)
        return _eager(q, k, v, mask), mask.clamp_min(-1.0).sum()

    torch._dynamo.reset()
    compiled, report = _compile(f)
    args = _qkv(1, 2, 2, 8, 8, 16, torch.float32)
    out, total = compiled(*args)
    ref, ref_total = f(*[a.double() for a in args])
    assert_close(out, ref.float(), torch.float32)
    assert total.item() == ref_total.item()
    (region,) = _attention_regions(report)
    assert region.info.get("mask") == "from indices", region.info
