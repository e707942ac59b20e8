"""Masked-tile skipping (issue 16, item 2): a causal / sliding-window mask's value property gives the attention
seeds a for-loop band (``BlockGraph.forloop_band``), so each query block visits only the key tiles it can see;
the generated Triton loop is ``tl.range(band_lo, band_hi)``. Eager-equal (fp64 reference) through the backend."""
import os

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close
from test_attention_family import _check, _qkv, repeat_kv
from torch_mirage.superopt.attention_seeds import flash_attention, flash_decoding
from torch_mirage.superopt.compile import compile_ugraph
from torch_mirage.superopt.executor import execute
from torch_mirage.ugraph import BlockGraph, band_range, from_json

interp = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                            reason="CPU kernels run only in Triton's interpreter (TRITON_INTERPRET=1)")


def _band(region):
    """(offset, window) of the region's band from its description, None without one."""
    info = region.info["attention"]
    if "band=" not in info:
        return None
    off, _, w = info.split("band=")[1].split()[0].partition(",w")
    band = (int(off), int(w) if w else None)
    used = region.info.get("forloop_band")
    assert used is not None and tuple(used[4:6]) == band and used[6] == 3, region.info     # the seed ran with it
    return band


def _inmask(sq, skv, window=None, dtype=torch.float32, device="cpu"):
    """HF-style additive mask built in the graph from index comparisons (causal with the cache offset)."""
    i = torch.arange(sq, device=device)[:, None] + (skv - sq)
    j = torch.arange(skv, device=device)[None, :]
    keep = j <= i
    if window is not None:
        keep = keep & (j > i - window)
    zero, low = torch.zeros((), dtype=dtype, device=device), torch.full((), torch.finfo(dtype).min, dtype=dtype, device=device)
    return torch.where(keep, zero, low)[None, None]


def _eager(q, k, v, mask):
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    w = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5 + mask
    return torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("sq,skv,window", [(16, 16, None), (4, 24, None), (16, 16, 5), (4, 24, 7)])
def test_eager_causal_and_window_masks_get_a_band(sq, skv, window, dtype):
    """HF eager with the mask made in the graph (decode with a cache: sq < skv, causal offset skv - sq)."""
    def f(q, k, v):
        return _eager(q, k, v, _inmask(q.shape[-2], k.shape[-2], window, q.dtype, q.device))

    (region,) = _check(f, _qkv(1, 4, 2, sq, skv, 16, dtype), dtype)
    assert _band(region) == (skv - sq, window), region.info


@interp
@pytest.mark.parametrize("window", [None, 40])
def test_band_that_skips_tiles_passes_the_check_on_the_real_mask(window):
    """n=128: the seed walks two 64-key tiles and the band skips the ones a query block cannot see. The mask made
    in the graph is a function of constants, so the backend's numeric check (and launch tuning) feed the kernel
    that mask, not random scores it was not specialised on: the region is claimed, eager-equal."""
    def f(q, k, v):
        return _eager(q, k, v, _inmask(q.shape[-2], k.shape[-2], window, q.dtype, q.device))

    (region,) = _check(f, _qkv(1, 1, 1, 128, 128, 16, torch.float16), torch.float16)
    assert _band(region) == (0, window), region.info


@interp
@pytest.mark.parametrize("sq,skv", [(16, 16), (8, 24)])
def test_sdpa_is_causal_gets_a_band(sq, skv):
    """SDPA's is_causal (top-left: offset 0, also where sq != skv) and a bool attn_mask from comparisons."""
    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    (region,) = _check(f, _qkv(1, 2, 2, sq, skv, 16, torch.float32), torch.float32)
    assert _band(region) == (0, None), region.info

    def g(q, k, v):
        i = torch.arange(q.shape[-2])[:, None] + (k.shape[-2] - q.shape[-2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.arange(k.shape[-2])[None] <= i)

    (region,) = _check(g, _qkv(1, 2, 2, sq, skv, 16, torch.float32), torch.float32)
    assert _band(region) == (skv - sq, None), region.info


@interp
def test_mask_as_input_or_with_padding_gets_no_band():
    """A mask passed in (its values unknown) or joined with padding (rows may be fully masked): no band."""
    def f(q, k, v, mask):
        return _eager(q, k, v, mask)

    q, k, v = _qkv(1, 2, 2, 8, 8, 16, torch.float32)
    (region,) = _check(f, (q, k, v, _inmask(8, 8)), torch.float32)
    assert _band(region) is None, region.info

    def g(q, k, v, pad):
        i, j = torch.arange(8)[:, None], torch.arange(8)[None, :]
        keep = (j <= i) & (j >= pad)
        low = torch.full((), torch.finfo(torch.float32).min, dtype=q.dtype)
        m = torch.where(keep, torch.zeros((), dtype=q.dtype), low)[None, None]
        return _eager(q, k, v, m)

    (region,) = _check(g, (q, k, v, torch.tensor(3)), torch.float32)
    assert _band(region) is None, region.info


@interp
@pytest.mark.parametrize("zero", [False, True])
@pytest.mark.parametrize("seed", ["flash", "split"])
def test_seed_band_skips_masked_tiles_and_empty_splits(seed, zero):
    """The seeds with a band: the loop in the source is bounded per block; a split that a query block cannot see
    saves neutral partials (m = -inf, l = o = 0) and the combine gives no NaN; the executor runs the same band."""
    b, hk, g, sq, skv, d, off = 1, 2, 2, 8, 32, 16, 24
    rows = g * sq
    i = torch.arange(sq)[:, None] + off
    m = torch.zeros(sq, skv).masked_fill(torch.arange(skv)[None] > i, -1e30).repeat(g, 1)[None, None]
    if seed == "flash":
        kg = flash_attention(b, hk, rows, skv, d, scale=0.3, softcap=5.0, mask=(1, 1), dtype="float32",
                             q_blocks=4, forloop_range=4, band=(sq, off, None, zero))
    else:
        kg = flash_decoding(b, hk, rows, skv, d, scale=0.3, softcap=5.0, mask=(1, 1), dtype="float32",
                            splits=4, forloop_range=2, q_blocks=2, band=(sq, off, None, zero))
    q, k, v = torch.randn(b, hk, rows, d), torch.randn(b, hk, skv, d), torch.randn(b, hk, skv, d)
    c = compile_ugraph(kg, [q, k, v, m])
    out = c(q, k, v, m)[0]
    ref = torch.softmax(torch.tanh(q @ k.transpose(-1, -2) * 0.3 / 5.0) * 5.0 + m, -1) @ v
    assert torch.isfinite(out).all()
    assert_close(out, ref, torch.float32)
    src = "\n".join(map(str, c.sources))
    assert "band_hi, num_stages" in src and "band_p0" in src, src
    # the mask is loaded only on partly seen tiles: a loop of its own over the tiles every row sees whole
    assert ("band_f1, num_stages" in src and "tl.range(band_f1, band_hi" in src) == zero, src
    assert src.count("tl.load(in3_ptr") == 1, src
    assert_close(execute(kg, [q, k, v, m])[0], ref, torch.float32)
    if zero:    # the band's meaning, not the mask's: a bias on fully seen tiles is not read, by both runners
        bias = m + 0.5 * (m == 0)
        assert_close(c(q, k, v, bias)[0], execute(kg, [q, k, v, bias])[0], torch.float32)
        assert not torch.allclose(c(q, k, v, bias)[0], ref)
    bg = next(op.body for op in kg.ops if isinstance(op.body, BlockGraph))
    if seed == "split":       # query rows 0..7 (positions 0..7) see keys <= 31: all splits; the band is per block
        assert band_range(bg, (0, 0, 0)) == (0, 2)
    else:                     # first row block: positions 0..3 see keys <= 27: tiles 0..3 of 8 keys
        assert band_range(bg, (0, 0, 0)) == (0, 4)


def test_band_keeps_hashes_of_other_graphs_and_round_trips():
    plain = flash_attention(1, 2, 16, 32, 16, scale=0.3, dtype="float32", forloop_range=4)
    banded = flash_attention(1, 2, 16, 32, 16, scale=0.3, dtype="float32", forloop_range=4, q_blocks=2,
                             band=(16, 0, 5))
    assert "forloop_band" not in plain.to_json() and "forloop_band" in banded.to_json()
    assert plain.hash() != banded.hash()
    assert from_json(banded.to_json()).hash() == banded.hash()
    bg = next(op.body for op in banded.ops if isinstance(op.body, BlockGraph))
    # row block 1 (rows 8..15) sees keys 4..15 with window 5: tiles 0..1 of 8 keys
    assert band_range(bg, (0, 0, 1)) == (0, 2) and band_range(bg, (0, 0, 0)) == (0, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("window", [None, 256])
def test_gpu_causal_band_softcap(window):
    """H100: gemma2-style soft-capped causal (and sliding-window) attention with the mask made in the graph,
    fp16, n=1024: claimed with a band, eager-equal."""
    dtype, n = torch.float16, 1024

    def f(q, k, v):
        w = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5
        w = torch.tanh(w / 50.0) * 50.0 + _inmask(n, n, window, q.dtype, q.device)
        return torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)

    import torch_mirage
    from test_attention_family import _attention_regions

    q, k, v = (torch.randn(1, 8, n, 128, device="cuda", dtype=dtype) for _ in range(3))
    torch._dynamo.reset()
    report = torch_mirage.Report()
    backend = torch_mirage.MirageBackend(options={"min_region_us": 0, "measure_regions": False}, report=report)
    out = torch.compile(f, backend=backend)(q, k, v)
    ref = f(q.double(), k.double(), v.double())
    (region,) = _attention_regions(report)
    assert _band(region) == (0, window), region.info
    assert torch.isfinite(out).all()
    assert_close(out, ref.to(out.dtype), dtype)


@interp
@pytest.mark.parametrize("window", [None, 6])
def test_bench_gemma2_softcap_with_mask_made_in_graph(window):
    """The bench's gemma2 workload (soft-cap, additive mask) with the causal / window mask made in the graph."""
    from torch_mirage.bench import workloads as W

    def f(q, k, v):
        return W.gemma2_softcap(q, k, v, _inmask(q.shape[-2], q.shape[-2], window, q.dtype, q.device))

    (region,) = _check(f, _qkv(1, 2, 2, 16, 16, 16, torch.float16), torch.float16)
    assert _band(region) == (0, window) and "softcap=50" in region.info["attention"], region.info


@interp
def test_attention_band_knob_off():
    """``options={"attention_band": False}``: the same region, no band (the bench's mirage_noband column)."""
    import torch_mirage
    from test_attention_family import _attention_regions

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    torch._dynamo.reset()
    report = torch_mirage.Report()
    backend = torch_mirage.MirageBackend(options={"min_region_us": 0, "attention_band": False}, report=report)
    args = _qkv(1, 2, 2, 16, 16, 16, torch.float32)
    assert_close(torch.compile(f, backend=backend)(*args), f(*args), torch.float32)
    (region,) = _attention_regions(report)
    assert "band=0" in region.info["attention"] and "forloop_band" not in region.info, region.info


@interp
@pytest.mark.parametrize("grid,loop,split", [((2, 1, 4), 8, 2), ((2, 1, 2), 4, 4), ((2, 1, 1), 2, 1)])
def test_band_under_other_launch_configs(grid, loop, split):
    """A banded block graph re-tiled (other row blocks / key tiles) and split over KV by the launcher (split-K
    partials of a block that sees none of a split: m = -inf, l = o = 0, folded without NaN): eager-equal."""
    from torch_mirage.superopt.launch import LaunchConfig
    from torch_mirage.config import load
    from torch_mirage.superopt.compile import BlockLauncher

    b, hk, g, sq, skv, d, off, w = 1, 2, 2, 8, 32, 16, 24, 6
    i = torch.arange(sq)[:, None] + off
    j = torch.arange(skv)[None]
    m = torch.zeros(sq, skv).masked_fill((j > i) | (j <= i - w), -1e30).repeat(g, 1)[None, None]
    kg = flash_attention(b, hk, g * sq, skv, d, scale=0.3, mask=(1, 1), dtype="float32", band=(sq, off, w, True))
    bg = next(op.body for op in kg.ops if isinstance(op.body, BlockGraph))
    q, k, v = torch.randn(b, hk, g * sq, d), torch.randn(b, hk, skv, d), torch.randn(b, hk, skv, d)
    launcher = BlockLauncher(bg, LaunchConfig(grid, loop, split), [4, 4, 4, 4], load().cache_dir)
    (out,) = launcher(q, k, v, m)
    ref = torch.softmax(q @ k.transpose(-1, -2) * 0.3 + m, -1) @ v
    assert torch.isfinite(out).all()
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("seed,band", [("flash", (8, 0, None, True)), ("flash", (8, 0, 3, False)),
                                       ("split", (4, 28, None, True)), ("split", (2, 0, None, False)),
                                       ("flash", (8, 0, 3, True, True)), ("split", (4, 28, None, True, True))])
def test_banded_seeds_verify(seed, band):
    """The verifier draws masks that satisfy the band (its precondition: exactly the band where the mask's
    visible part is 0, random keys inside it otherwise): banded seeds pass both tests, a wrong scale does not."""
    from torch_mirage.superopt.verify import verify

    def ref(q, k, v, mask, scale=0.25):
        return torch.softmax(q @ k.transpose(-1, -2) * scale + mask, -1) @ v

    if seed == "flash":
        g = flash_attention(1, 2, 8, 8, 16, scale=0.25, mask=(1, 2), dtype="float32", forloop_range=2, q_blocks=2,
                            band=band)
        xs = [torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.zeros(1, 2, 8, 8)]
    else:
        g = flash_decoding(1, 2, 4, 32, 16, scale=0.25, mask=(1, 1), dtype="float32", splits=4, forloop_range=2,
                           band=band)
        xs = [torch.randn(1, 2, 4, 16), torch.randn(1, 2, 32, 16), torch.randn(1, 2, 32, 16), torch.zeros(1, 1, 4, 32)]
    good = verify(g, ref, xs)
    assert good.equivalent and "finite-field test passed" in good.reason, good.reason
    bad = verify(g, lambda q, k, v, mask: ref(q, k, v, mask, 0.26), xs)
    assert not bad.equivalent, bad.reason


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mask", ["causal", "bool"])
def test_gpu_gqa_prefill_per_query_head(mask):
    """HF Llama's prefill attention as compiled on CUDA (bf16, 16 query / 8 KV heads, 4 x 256 tokens, Q / K / V
    transposed projections; a causal SDPA, or K / V repeated before SDPA with a bool mask): a program per query
    head on the region's own tensors, eager-equal."""
    import torch_mirage
    from test_attention_family import _attention_regions

    dtype, b, h, hk, s, d = torch.bfloat16, 4, 16, 8, 256, 64
    xq, xk, xv = (torch.randn(b, s, n, d, device="cuda", dtype=dtype) for n in (h, hk, hk))
    keep = torch.ones(b, 1, s, s, dtype=torch.bool, device="cuda").tril()
    keep[1, :, :, :7] = False                                   # a left-padded row: its first keys hidden
    keep[1, :, :7, 0] = True                                    # (each query row keeps a key)

    def f(xq, xk, xv, *m):
        q, k, v = (x.transpose(1, 2) for x in (xq, xk, xv))
        if m:
            out = F.scaled_dot_product_attention(q, repeat_kv(k, h // hk), repeat_kv(v, h // hk), attn_mask=m[0])
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(b, s, h * d)

    args = (xq, xk, xv) + ((keep,) if mask == "bool" else ())
    torch._dynamo.reset()
    report = torch_mirage.Report()
    backend = torch_mirage.MirageBackend(options={"min_region_us": 0, "measure_regions": False}, report=report)
    out = torch.compile(f, backend=backend)(*args)
    ref = f(*[x.double() if x.is_floating_point() else x for x in args])
    (region,) = _attention_regions(report)
    assert "a program per query head" in region.info.get("layout", ""), region.info
    assert_close(out, ref.to(out.dtype), dtype)
