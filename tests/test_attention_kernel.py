"""Prefill attention kernels (issue 16): what the μGraph codegen emits for the banded, soft-capped FlashAttention
seed — folded constant chains, tanh on the SFU for CUDA, the band's loop split into tiles every row sees whole
(no mask) and edge tiles (masked), causal row blocks heaviest first — and the prefill launch candidates. CPU
tests run the kernels in Triton's interpreter against fp64 references."""
import math
import os
import re

import pytest
import torch

from helpers import assert_close
from torch_mirage.codegen.ugraph_triton import LOG2E, emit_block_kernel
from torch_mirage.config import load
from torch_mirage.context import Target
from torch_mirage.superopt.attention_seeds import decode_split_counts, decode_splits, flash_attention, flash_decoding
from torch_mirage.superopt.compile import BlockLauncher, compile_ugraph
from torch_mirage.superopt.launch import (LaunchConfig, candidates, default_config, prefill_attention,
                                          split_kv_decode, whole_kv_decode)
from torch_mirage.ugraph import BlockGraph

interp = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                            reason="CPU kernels run only in Triton's interpreter (TRITON_INTERPRET=1)")


def _body(kg) -> BlockGraph:
    """The attention kernel's block graph (its online softmax's; a mask's tile table is made by a kernel before
    it, split-KV's combine runs after it)."""
    return next(op.body for op in kg.ops if isinstance(op.body, BlockGraph)
                and any(o.name == "acc_online_softmax" for o in op.body.ops))


def _mask(rows, skv, sq, off, window=None):
    """(1, 1, rows, skv) additive mask of the band (query heads packed: position = row % sq), -1e30 outside."""
    p = torch.arange(rows)[:, None] % sq + off
    j = torch.arange(skv)[None]
    hide = (j > p) if window is None else (j > p) | (j <= p - window)
    return torch.zeros(rows, skv).masked_fill(hide, -1e30)[None, None]


def _reference(q, k, v, m, scale, cap):
    """fp64 soft-capped masked attention."""
    q, k, v, m = (x.double() for x in (q, k, v, m))
    s = q @ k.transpose(-1, -2) * scale
    if cap is not None:
        s = torch.tanh(s / cap) * cap
    return torch.softmax(s + m, -1) @ v


def _loops(src: str) -> list[str]:
    """The bodies of the kernel's for-loops (each up to the next loop or the end of the indented block)."""
    parts = re.split(r"\n    for it in ", src)[1:]
    return [p.split("\n    f")[0] if "\n    f" in p else p for p in parts]


def test_constant_chains_fold_into_one_multiply():
    """scale·(1/softcap) is one constant in tanh's argument; softcap·log2 e one in the scores of the tiles every
    row sees whole (the mask add is gone there, so nothing stands between them)."""
    cap, scale = 30.0, 0.125
    kg = flash_attention(1, 2, 64, 64, 16, scale=scale, softcap=cap, mask=(1, 1), dtype="float16",
                         q_blocks=2, forloop_range=4, band=(64, 0, None, True))
    src = emit_block_kernel(_body(kg), [4, 4, 4, 4]).source
    full, edge = _loops(src)
    assert f"tl.sigmoid(d8 * {2.0 * (scale * (1.0 / cap))!r})" in full, full
    assert f"* {cap * LOG2E!r}" in full and f"* {scale!r}" not in full, full
    assert f"* {cap!r})" in edge and f"* {LOG2E!r}" in edge, edge        # the mask is added between them there


def test_tanh_on_cuda_is_the_sfu_instruction():
    """Target.CUDA: tanh.approx.f32 through inline asm (scale folded into its argument); the interpreter gets the
    portable sigmoid form, which it can run."""
    kg = flash_attention(1, 2, 64, 64, 16, scale=0.125, softcap=30.0, mask=(1, 1), dtype="float16",
                         q_blocks=2, forloop_range=4, band=(64, 0, None, True))
    cuda = emit_block_kernel(_body(kg), [4, 4, 4, 4], target=Target.CUDA).source
    portable = emit_block_kernel(_body(kg), [4, 4, 4, 4], target=Target.INTERPRETER).source
    assert cuda.count("tanh.approx.f32") == 2 and "sigmoid" not in cuda, cuda
    assert f"[d8 * {0.125 / 30.0!r}]" in cuda, cuda
    assert "tanh.approx" not in portable and portable.count("tl.sigmoid") == 2


def test_full_tiles_skip_mask_and_clamp_edge_tiles_keep_them():
    """The band splits the key loop: tiles every row sees whole load no mask and need no clamp of s − m; the
    diagonal tiles load the mask (unpredicated: every one of them needs it) and clamp."""
    kg = flash_attention(1, 2, 64, 64, 16, scale=0.25, mask=(1, 1), dtype="float32", q_blocks=2, forloop_range=4,
                         band=(64, 0, None, True))
    src = emit_block_kernel(_body(kg), [4, 4, 4, 4]).source
    full, edge = _loops(src)
    assert full.startswith("tl.range(0, band_f1,") and edge.startswith("tl.range(band_f1, band_hi,"), src
    assert "in3_ptr" not in full and "tl.minimum" not in full, full
    assert "tl.load(in3_ptr" in edge and "mask=" not in edge and "tl.minimum(" in edge, edge
    assert "num_stages=NUM_STAGES)" in full.split("\n")[0] and "num_stages=1)" in edge.split("\n")[0]
    assert "pid_2 = 1 - tl.program_id(2)" in src          # causal: the longest row block first


def test_window_band_has_two_edges_and_keeps_row_order():
    kg = flash_attention(1, 2, 64, 64, 16, scale=0.25, mask=(1, 1), dtype="float32", q_blocks=2, forloop_range=8,
                         band=(64, 0, 20, True))
    src = emit_block_kernel(_body(kg), [4, 4, 4, 4]).source
    lo, full, hi = _loops(src)
    assert lo.startswith("tl.range(band_lo, band_f0,") and full.startswith("tl.range(band_f0, band_f1,")
    assert "in3_ptr" not in full and "in3_ptr" in lo and "in3_ptr" in hi
    assert "pid_2 = tl.program_id(2)" in src


def test_no_zero_mask_no_split():
    """A band whose mask is not known to be 0 where the band sees (zero flag off): one loop, mask on every tile."""
    kg = flash_attention(1, 2, 64, 64, 16, scale=0.25, mask=(1, 1), dtype="float32", q_blocks=2, forloop_range=4,
                         band=(64, 0, None, False))
    src = emit_block_kernel(_body(kg), [4, 4, 4, 4]).source
    (loop,) = _loops(src)
    assert "tl.load(in3_ptr" in loop and "tl.minimum(" in loop


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window,cap", [(None, 50.0), (None, None), (40, 50.0), (7, None)])
@pytest.mark.parametrize("cfg", [(4, 8), (2, 8), (2, 2), (8, 16)])     # (row blocks, key tiles)
def test_split_band_eager_equal(cfg, window, cap, dtype):
    """Banded seed under re-tilings (128- and 64-row tiles, key tiles of 64 down to 8, GQA-packed rows of two
    heads): the full / edge loops together give the fp64 reference, no NaN."""
    b, hk, g, sq, skv, d = 1, 2, 2, 64, 128, 16
    rows, off = g * sq, skv - sq
    kg = flash_attention(b, hk, rows, skv, d, scale=d ** -0.5, softcap=cap, mask=(1, 1),
                         dtype={torch.float32: "float32", torch.float16: "float16"}[dtype],
                         band=(sq, off, window, True))
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(s, generator=gen).to(dtype) for s in ((b, hk, rows, d), (b, hk, skv, d), (b, hk, skv, d)))
    m = _mask(rows, skv, sq, off, window)
    bg = _body(kg)
    run = BlockLauncher(bg, LaunchConfig((hk, b, cfg[0]), cfg[1]), [4, 4, 4, 4], load().cache_dir)
    (out,) = run(q, k, v, m)
    assert torch.isfinite(out).all()
    assert_close(out, _reference(q, k, v, m, d ** -0.5, cap).to(dtype), dtype)


@interp
def test_fully_masked_rows_stay_finite_where_eager_gives_numbers():
    """An additive mask (no band) hiding every key of some rows at the floor (-1e30, as the claimer clamps HF's
    finfo.min masks): eager gives those rows the uniform average, so must the kernel — the clamp of s − m stays
    on tiles that add a mask."""
    b, hk, rows, skv, d = 1, 2, 32, 32, 16
    kg = flash_attention(b, hk, rows, skv, d, scale=0.3, softcap=20.0, mask=(1, 1), dtype="float32",
                         q_blocks=2, forloop_range=4)
    q, k, v = torch.randn(b, hk, rows, d), torch.randn(b, hk, skv, d), torch.randn(b, hk, skv, d)
    m = torch.zeros(1, 1, rows, skv)
    m[..., :5, :] = -1e30                       # rows 0..4 see nothing
    m[..., 5:, 20:] = -1e30
    c = compile_ugraph(kg, [q, k, v, m])
    out = c(q, k, v, m)[0]
    ref = _reference(q, k, v, m, 0.3, 20.0)
    assert torch.isfinite(out).all()
    assert torch.allclose(ref[..., :5, :], v.double().mean(-2, keepdim=True).expand(-1, -1, 5, -1))
    assert_close(out, ref.float(), torch.float32)
    assert "tl.minimum(" in "\n".join(c.sources)


def test_prefill_candidates():
    """Prefill attention gets 128-row tiles on 8 warps with 64 / 128 keys and 2-4 stages (and 64-row ones); decode
    (few rows) keeps the roofline-ranked re-tilings; the CPU runs the μGraph's own schedule."""
    kg = flash_attention(1, 32, 1024, 1024, 128, scale=0.088, softcap=50.0, mask=(1, 1), dtype="bfloat16",
                         band=(1024, 0, None, True))
    bg = _body(kg)
    assert prefill_attention(bg) == (2, 1024, 1024)
    cands = candidates(bg, 132)
    assert cands[0] == default_config(bg)
    pairs = {(c.grid[2], c.forloop_range, c.num_warps, c.num_stages) for c in cands}
    for stages in (2, 3, 4):
        assert (8, 16, 8, stages) in pairs                  # 128 rows x 64 keys
    assert (8, 8, 8, 2) in pairs and (16, 16, 4, 3) in pairs  # 128 x 128 keys; 64 x 64
    assert all(c.split == 1 for c in cands)
    decode = _body(flash_attention(1, 8, 4, 4096, 128, scale=0.088, dtype="float16"))
    assert prefill_attention(decode) is None
    assert any(c.split > 1 for c in candidates(decode, 132))


def test_prefill_with_a_passed_mask_scans_it():
    """Prefill attention whose mask is a tensor with no band known, built with the mask's tile table: every
    candidate scans the table; without the table, under a band (the structure known when compiling) and at
    decode none scans; the seed refuses a table under a band or for a bool mask."""
    kw = dict(scale=0.088, softcap=50.0, mask=(1, 1), dtype="bfloat16")
    tabled = _body(flash_attention(1, 32, 1024, 1024, 128, scan_table=True, **kw))
    assert tabled.forloop_scan == 4
    assert all(c.mask_scan for c in candidates(tabled, 132))
    assert not any(c.mask_scan for c in candidates(_body(flash_attention(1, 32, 1024, 1024, 128, **kw)), 132))
    for bad in (dict(band=(1024, 0, None, True)), dict(mask_dtype="bool")):
        with pytest.raises(ValueError, match="scan table"):
            flash_attention(1, 32, 1024, 1024, 128, scan_table=True, **{**kw, **bad})
    banded = _body(flash_attention(1, 32, 1024, 1024, 128, scale=0.088, mask=(1, 1), dtype="bfloat16",
                                   band=(1024, 0, None, True)))
    assert not any(c.mask_scan for c in candidates(banded, 132))
    decode = _body(flash_attention(1, 8, 4, 4096, 128, scale=0.088, mask=(1, 1), dtype="float16"))
    assert not any(c.mask_scan for c in candidates(decode, 132))


def test_underfilled_prefill_also_times_retilings():
    """Two heads of 256 query rows against 4096 keys make at most 8 programs at the prefill schedules: the
    roofline re-tilings (smaller row blocks, key splits) are timed besides them, the prefill schedules first (then
    their own key splits)."""
    bg = _body(flash_attention(1, 2, 256, 4096, 64, scale=0.125, dtype="float16"))
    assert prefill_attention(bg) is not None
    cands = candidates(bg, 132)
    assert cands[0] == default_config(bg)
    prefill = [c for c in cands if c.split == 1 and math.prod(c.grid) <= 8]
    unfolded = [c for c in cands if not c.combine_in_kernel]     # the schedules' key splits come after them
    assert len(prefill) >= 4 and unfolded[:len(prefill)] == prefill
    assert any(c.split > 1 or math.prod(c.grid) > 8 for c in cands)
    assert len(set(cands)) == len(cands)


def test_underfilled_prefill_times_key_splits_folded_in_kernel():
    """The bench's gqa at b8 (16 heads x 256 rows against 4096 keys) makes 32 programs of 128 rows: the prefill
    schedules are also timed with the keys split to fill one and two waves of 132 SMs, folded in-kernel; a
    prefill that fills the SMs by itself gets none."""
    from torch_mirage.superopt.launch import PREFILL_SPLIT_SCHEDULES, WAVE_FILL, prefill_split_candidates

    bg = _body(flash_attention(8, 2, 256, 4096, 64, scale=0.125, dtype="bfloat16"))
    splits = prefill_split_candidates(bg, 132)
    assert splits and all(c.combine_in_kernel and c.split > 1 for c in splits)
    assert {(c.num_warps, c.num_stages) for c in splits} == {(w, st) for *_, w, st in PREFILL_SPLIT_SCHEDULES}
    for c in splits:
        programs = math.prod(c.grid) * c.split
        assert WAVE_FILL * 132 <= programs <= 4 * 132 and c.forloop_range % c.split == 0
    assert set(splits) <= set(candidates(bg, 132))
    assert (math.prod(splits[0].grid), splits[0].split) == (32, 4)      # 128-row tiles: 4 splits of 1024 keys
    full = _body(flash_attention(1, 32, 1024, 1024, 128, scale=0.088, dtype="bfloat16"))
    assert prefill_split_candidates(full, 132) == []


@interp
@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
def test_prefill_key_split_folded_in_kernel_equals_fp64(tmp_path, causal):
    """A prefill schedule with its keys split and the partial states folded by each tile's last program, with and
    without a causal band (a split whose keys a row block never sees walks nothing): equal to fp64, twice (the
    fold leaves its counters zero for the next launch)."""
    from torch_mirage.superopt.launch import prefill_split_candidates

    b, h, n, skv, d = 1, 2, 128, 512, 16
    kw = dict(mask=(1, 1), band=(n, skv - n, None, True)) if causal else {}
    bg = _body(flash_attention(b, h, n, skv, d, scale=0.25, dtype="float32", **kw))
    configs = [c for c in prefill_split_candidates(bg, 8) if c.grid[2] == 1]       # 128-row blocks
    assert configs
    gen = torch.Generator().manual_seed(11)
    ins = [torch.randn(s, generator=gen) for s in ((b, h, n, d), (b, h, skv, d), (b, h, skv, d))]
    m = _mask(n, skv, n, skv - n) if causal else torch.zeros(1, 1, n, skv)
    if causal:
        ins.append(m)
    want = _reference(*ins[:3], m, 0.25, None).float()
    launcher = BlockLauncher(bg, configs[0], [4] * len(ins), str(tmp_path), f"split{int(causal)}", Target.INTERPRETER)
    assert "atomic_add" in launcher.source
    for _ in range(2):
        assert_close(launcher(*ins)[0], want, torch.float32)


def test_decode_split_count_fills_the_sms():
    """Llama-3-8B decode over a 4k cache (8 KV heads): b=1 splits KV 32 ways and b=8 4 ways (256 programs, about
    two per SM of 132); a batch that fills the SMs by itself is not split; every split walks at least 128 keys."""
    assert decode_splits(8, 4096, 132) == 32 and decode_splits(64, 4096, 132) == 4
    assert decode_splits(256, 4096, 132) == 1
    assert decode_splits(8, 512, 132) == 4                  # 128 keys per split at least
    assert decode_splits(8, 100, 132) == 1                  # too short to split
    assert decode_split_counts(8, 4096, 132) == [32, 16, 64] and decode_split_counts(64, 4096, 132) == [4, 2, 8]
    assert decode_split_counts(8, 256, 132) == [2, 4] and decode_split_counts(256, 4096, 132) == []


def test_split_kv_is_built_only_where_the_query_rows_leave_the_sms_idle():
    """Prefill whose query rows alone make two waves of FlashAttention programs gets no split-KV seed (Llama-3-8B
    prefill 2048: 8 KV heads x 128 row blocks; its 8-split candidate held 256 MiB of partial states per call, H100
    11-28); a chunk of 256 queries over a 4k cache (8 x 16 row blocks) and decode keep it."""
    from torch_mirage.analysis.attention import AttentionSpec
    from torch_mirage.superopt.attention_claim import _seeds, rows_fill_the_sms

    def spec(b, sq, skv):
        return AttentionSpec(b=b, h=32, hk=8, sq=sq, skv=skv, d=128, scale=128 ** -0.5, mask="causal",
                             dtype=torch.bfloat16)
    prefill, chunk, decode = spec(1, 2048, 2048), spec(1, 256, 4096), spec(1, 1, 4096)
    assert rows_fill_the_sms(prefill) and not rows_fill_the_sms(chunk) and not rows_fill_the_sms(decode)
    assert set(_seeds(prefill)) == {"flash_attention"}
    assert set(_seeds(chunk)) == {"flash_attention", "flash_decoding"}
    assert any(name.startswith("flash_decoding/") for name in _seeds(decode))


def test_decode_candidates():
    """Split-KV decode's partial kernel keeps its grid (the seed fixed the split count) and is timed over 64- and
    128-key tiles and pipeline depths, never split again; prefill attention is not decode."""
    kg = flash_decoding(1, 8, 4, 4096, 128, scale=0.088, mask=(1, 1), dtype="bfloat16", splits=32)
    bg = _body(kg)
    assert bg.grid == (8, 1, 32) and split_kv_decode(bg) == 128
    cands = candidates(bg, 132)
    assert cands[0] == default_config(bg)
    assert {(c.forloop_range, c.num_warps, c.num_stages) for c in cands} >= {(2, 4, 3), (2, 4, 4), (1, 4, 2), (1, 8, 3)}
    assert all(c.split == 1 and c.grid == bg.grid for c in cands)
    prefill = _body(flash_attention(1, 32, 1024, 1024, 128, scale=0.088, dtype="float16"))
    assert split_kv_decode(prefill) is None and whole_kv_decode(prefill) is None


def test_flash_attention_at_decode_splits_keys_folded_in_kernel():
    """FlashAttention at decode (a program per KV head walking all 4096 keys): its launches split the keys at the
    decode split counts, each folded by its tiles' last program (one kernel), over 64-key tiles; alone, since they
    fill the SMs."""
    bg = _body(flash_attention(1, 8, 4, 4096, 128, scale=0.088, mask=(1, 1), dtype="bfloat16"))
    assert whole_kv_decode(bg) == 4096 and split_kv_decode(bg) is None
    cands = candidates(bg, 132)
    assert cands[0] == default_config(bg)
    split = cands[1:]
    assert split and all(c.combine_in_kernel and c.grid == bg.grid and 4096 // c.forloop_range == 64 for c in split)
    assert {c.split for c in split} == set(decode_split_counts(8, 4096, 132)) and len(split) == 2 * len(
        {c.split for c in split})


@interp
@pytest.mark.parametrize("tile", [(8, 2), (16, 1)])
def test_decode_retiled_matches_reference(tile):
    """A split-KV decode kernel (per-batch-row mask, GQA rows packed) re-tiled as the decode candidates do (other
    keys per tile, the same splits) still matches fp64."""
    b, hk, rows, skv, d = 2, 2, 4, 64, 16
    kg = flash_decoding(b, hk, rows, skv, d, scale=0.25, mask=(b, 1), dtype="float32", splits=4, tile=4)
    ins = [torch.randn(b, hk, rows, d), torch.randn(b, hk, skv, d), torch.randn(b, hk, skv, d),
           torch.randn(b, 1, rows, skv)]
    ins[3][0, ..., 20:] = -1e30                               # a batch row's unwritten slots: two whole splits
    bg = _body(kg)
    keys, f = tile[0], tile[1]
    assert split_kv_decode(bg) == keys * f
    launcher = BlockLauncher(bg, LaunchConfig(bg.grid, f), [4, 4, 4, 4], load().cache_dir, "dec", Target.INTERPRETER)
    m, l, o = launcher(*ins)
    m, l, o = (x.reshape(b * hk, 4, rows, -1) for x in (m, l, o))
    w = torch.exp(m - m.amax(1, keepdim=True))
    out = ((w * o).sum(1) / (w * l).sum(1)).reshape(b, hk, rows, d)
    assert_close(out, _reference(*ins, 0.25, None).float(), torch.float32)


@interp
@pytest.mark.parametrize("splits", [32, 64])
def test_fold_of_many_splits_walks_chunks(splits, tmp_path):
    """More than ``FOLD_UNROLLED`` split states are folded in unrolled chunks of ``FOLD_CHUNK`` (a first chunk, then a
    loop of chunks): FlashAttention at decode with its keys split, folded by a combine kernel and in-kernel by each
    tile's last program, equal to fp64, a whole split's keys masked included; splits of up to ``FOLD_UNROLLED``
    stay unrolled whole."""
    from torch_mirage.codegen.ugraph_triton import FOLD_CHUNK, FOLD_UNROLLED

    assert splits > FOLD_UNROLLED and splits % FOLD_CHUNK == 0
    b, hk, rows, skv, d = 1, 2, 4, 8 * splits, 16
    ins = [torch.randn(b, hk, rows, d), torch.randn(b, hk, skv, d), torch.randn(b, hk, skv, d),
           torch.randn(b, 1, rows, skv)]
    ins[3][..., 8 * splits - 24:] = -1e30                   # the last three splits' keys: all masked
    want = _reference(*ins, 0.25, None).float()
    bg = _body(flash_attention(b, hk, rows, skv, d, scale=0.25, mask=(b, 1), dtype="float32"))
    for in_kernel in (False, True):
        cfg = LaunchConfig(tuple(bg.grid), skv // 4, splits, 4, 2, combine_in_kernel=in_kernel)
        launcher = BlockLauncher(bg, cfg, [4, 4, 4, 4], str(tmp_path), f"fold{int(in_kernel)}", Target.INTERPRETER)
        assert "for chunk in tl.range(1, " in launcher.source
        for _ in range(2):                                 # an in-kernel fold leaves its counters zero
            assert_close(launcher(*ins)[0], want, torch.float32)
    small = LaunchConfig(tuple(bg.grid), skv // 4, FOLD_UNROLLED, 4, 2, combine_in_kernel=True)
    assert "for chunk" not in BlockLauncher(bg, small, [4, 4, 4, 4], str(tmp_path), "fold16",
                                            Target.INTERPRETER).source


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_prefill_key_splits_folded_in_kernel(dtype, tmp_path):
    """The bench's gqa at b8 on the GPU: each prefill schedule's key split, folded in-kernel, fp64-equal, twice."""
    from torch_mirage.superopt.launch import prefill_split_candidates

    b, h, n, skv, d = 8, 2, 256, 4096, 64
    bg = _body(flash_attention(b, h, n, skv, d, scale=0.125,
                               dtype={torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]))
    ins = [torch.randn(b, h, s, d, device="cuda", dtype=dtype) for s in (n, skv, skv)]
    want = _reference(*ins, torch.zeros(1, 1, n, skv, device="cuda"), 0.125, None).to(dtype)
    configs = prefill_split_candidates(bg, torch.cuda.get_device_properties(0).multi_processor_count)
    assert configs
    for i, config in enumerate(configs):
        launcher = BlockLauncher(bg, config, [4, 4, 4], str(tmp_path), f"split{i}", Target.CUDA)
        for _ in range(2):
            assert_close(launcher(*ins)[0], want, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_prefill_softcap_tuned(dtype):
    """H100: the banded soft-capped seed with tanh.approx, tuned over the prefill candidates, fp64-equal."""
    n, h, d = 1024, 4, 128
    kg = flash_attention(1, h, n, n, d, scale=d ** -0.5, softcap=50.0, mask=(1, 1),
                         dtype={torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype], band=(n, 0, None, True))
    q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=dtype) for _ in range(3))
    m = _mask(n, n, n, 0).cuda()
    c = compile_ugraph(kg, [q, k, v, m], target=Target.CUDA)
    assert "tanh.approx.f32" in c.sources[0]
    out = c(q, k, v, m)[0]
    assert torch.isfinite(out).all()
    assert_close(out, _reference(q, k, v, m, d ** -0.5, 50.0).to(dtype), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_prefill_passed_mask_scanned(dtype):
    """H100: soft-capped prefill attention whose causal mask is a tensor (no band known), with the mask's tile
    table, tuned over the prefill candidates (each scanning the table); fp64-equal with a causal -inf mask, right
    padding included, and with a mask that hides no whole tile. Eight heads: the prefill schedules alone fill the
    SMs (with four, re-tilings to 32-row tiles, which split the table's squares and so do not scan, are timed too,
    and the H100 picked one for bf16)."""
    n, h, d = 1024, 8, 128
    name = {torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    kg = flash_attention(1, h, n, n, d, scale=d ** -0.5, softcap=50.0, mask=(1, 1), dtype=name, mask_dtype=name,
                         scan_table=True)
    q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=dtype) for _ in range(3))
    causal = torch.full((n, n), float("-inf"), device="cuda").triu(1)
    causal[:, 1000:] = float("-inf")
    c = compile_ugraph(kg, [q, k, v, causal[None, None].to(dtype)], target=Target.CUDA)
    assert any("scan_lo" in src for src in c.sources)
    for m in (causal, torch.randn(n, n, device="cuda")):
        m = m[None, None].to(dtype)
        assert_close(c(q, k, v, m)[0], _reference(q, k, v, m, d ** -0.5, 50.0).to(dtype), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_decode_split_kv_tuned(dtype):
    """H100: llama decode attention (4 query heads per KV head packed, a per-batch-row mask of -inf on unwritten
    slots, b=2 x 8 KV heads x 2048 slots) as the claimer builds it — decode_splits' split count, tuned over the
    decode candidates — fp64-equal."""
    b, hk, rows, skv, d = 2, 8, 4, 2048, 128
    splits = decode_splits(b * hk, skv, torch.cuda.get_device_properties(0).multi_processor_count)
    kg = flash_decoding(b, hk, rows, skv, d, scale=d ** -0.5, mask=(b, 1), splits=splits,
                        dtype={torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype],
                        mask_dtype={torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype])
    q = torch.randn(b, hk, rows, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(b, hk, skv, d, device="cuda", dtype=dtype) for _ in range(2))
    m = torch.zeros(b, 1, rows, skv, device="cuda", dtype=dtype)
    m[1, ..., 1500:] = max(-1e30, torch.finfo(dtype).min)      # row 1: 1500 slots written (the claimer's clamp)
    c = compile_ugraph(kg, [q, k, v, m], target=Target.CUDA)
    out = c(q, k, v, m)[0]
    assert torch.isfinite(out).all()
    assert_close(out, _reference(q, k, v, m, d ** -0.5, None).to(dtype), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("steps", ["one_key", "whole_tile"])
def test_gpu_decode_seed_at_a_prime_kv_length(steps):
    """Decode GQA (2 query rows per KV head packed, 8 KV heads, b=4, d 64, bf16) over 67 keys, the seed's loop
    walking one key a step (what the seed did before ``library.tiles``; H200 11-29 y: its tuned launches disagreed
    with its own schedule there, and on 12-01 its own schedule was 7x off fp64 — its reductions over the one key,
    now not emitted: ``ugraph_triton.reduction``) or one tile of 67 padded to 128 — every launch the tuner times
    (64-key tiles with a ragged last one among them), fp64-equal."""
    from torch_mirage.superopt.launch import candidates

    b, hk, rows, skv, d, dtype = 4, 8, 2, 67, 64, torch.bfloat16
    kg = flash_attention(b, hk, rows, skv, d, scale=d ** -0.5, dtype="bfloat16",
                         forloop_range=skv if steps == "one_key" else 1)
    q = torch.randn(b, hk, rows, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(b, hk, skv, d, device="cuda", dtype=dtype) for _ in range(2))
    want = _reference(q, k, v, torch.zeros(1, device="cuda"), d ** -0.5, None).to(dtype)
    c = compile_ugraph(kg, [q, k, v], target=Target.CUDA)
    assert_close(c(q, k, v)[0], want, dtype)
    (bg,) = [op.body for op in kg.ops if op.name == "customized"]
    for i, config in enumerate(candidates(bg, torch.cuda.get_device_properties(0).multi_processor_count)[:8]):
        def only(bg, n_sm, limit, config=config):
            return [config]
        only.__name__ = f"only_{i}"      # a launch cache key of its own
        one = compile_ugraph(kg, [q, k, v], target=Target.CUDA, propose=only)
        assert_close(one(q, k, v)[0], want, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("skv", [64, 67, 134, 131])
def test_gpu_decode_gqa_region_at_any_kv_length(skv, caplog):
    """The region a DynamicCache decode hands the backend on Hopper (HF's ``repeat_kv``, then SDPA: cuDNN's op),
    bf16, 16 query / 8 KV heads, b=4, at KV lengths that divide into 64-key tiles, that do not (67: one tile of
    67, 134: two) and at 131 (no tile from 16 to 128 divides it: the seed walks one key a step, and the tuner
    picks a launch of whole 64-key tiles with a ragged last one) — claimed (no timing against Inductor), compiled
    strict (a failed check raises), with no tuned launch disagreeing with the seed's own schedule; fp64-equal."""
    import torch.nn.functional as F

    from helpers import strict_attention_compile
    from test_attention_family import repeat_kv

    b, h, hk, d, dtype = 4, 16, 8, 64, torch.bfloat16
    q = torch.randn(b, h, 1, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(b, hk, skv, d, device="cuda", dtype=dtype) for _ in range(2))

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, repeat_kv(k, h // hk), repeat_kv(v, h // hk))

    out, (region,) = strict_attention_compile(f, (q, k, v), caplog)
    if skv == 131:
        assert all(launch["ragged"] for launch in region.info["launch"]), region.info
    assert_close(out, f(q.double(), k.double(), v.double()).to(dtype), dtype)


@interp
def test_column_sums_multiply_by_the_row_sum_reciprocal():
    """H2O's column-sum kernel divides each score's exp by its row's sum: one reciprocal per row (a (rows, 1)
    tile), a multiply per element; the full / edge loops of its band still give the column sums of P (fp64)."""
    from torch_mirage.superopt.attention_seeds import attention_column_sums

    b, hk, n, d = 1, 2, 64, 16
    kg = attention_column_sums(b, hk, n, n, d, group=1, kernels=["flash_stats", "column_sums"], tile=16,
                               scale=0.25, softcap=None, mask=(1, 1), dtype="float32", mask_dtype="float32",
                               band=(n, 0, None, True))
    q, k, v = torch.randn(b, hk, n, d), torch.randn(b, hk, n, d), torch.randn(b, hk, n, d)
    m = _mask(n, n, n, 0)
    c = compile_ugraph(kg, [q, k, v, m])
    out, colsum = c(q, k, v, m)
    col_src = c.sources[-1]
    assert re.search(r"v\d+ \* \(1\.0 / x\d+\)", col_src) and not re.search(r"v\d+ / x\d+", col_src), col_src
    p = torch.softmax(q.double() @ k.double().transpose(-1, -2) * 0.25 + m.double(), -1)
    assert_close(out, (p @ v.double()).float(), torch.float32)
    assert_close(colsum, p.sum(-2).float(), torch.float32)


@interp
@pytest.mark.parametrize("split,kind", [(1, "additive"), (2, "additive"), (2, "bool")])
def test_mask_scan_skips_unseen_key_tiles_eager_equal(split, kind, tmp_path):
    """A mask passed in as a tensor (no band known): with ``mask_scan`` each program reads its mask tiles first
    and walks only the key tiles one of its rows sees. Causal -inf plus right padding, soft-cap, a block whose
    rows see no key (eager's NaN rows) and a split of the keys (folded in-kernel): fp64-equal, and equal to the
    same launch without the scan. A mask at a finite floor is never scanned (:func:`scanned_mask`)."""
    from torch_mirage.codegen.ugraph_triton import scanned_mask

    b, hk, rows, skv, d = 1, 2, 32, 32, 16
    kg = flash_attention(b, hk, rows, skv, d, scale=0.3, softcap=20.0, mask=(1, 1), dtype="float32",
                         q_blocks=4, forloop_range=8, mask_dtype="bool" if kind == "bool" else "float32")
    bg = _body(kg)
    assert scanned_mask(bg) is not None
    q, k, v = torch.randn(b, hk, rows, d), torch.randn(b, hk, skv, d), torch.randn(b, hk, skv, d)
    m = torch.full((rows, skv), float("-inf")).triu(1)[None, None].clone()
    m[..., 28:] = float("-inf")                        # padding: the last keys are never seen
    m[..., :8, :] = float("-inf")                      # the first row block sees nothing
    want = _reference(q, k, v, m, 0.3, 20.0).float()
    arg = m == 0 if kind == "bool" else m
    outs = []
    for scan in (False, True):
        cfg = LaunchConfig(tuple(bg.grid), 8, split, 4, 2, combine_in_kernel=split > 1, mask_scan=scan)
        launcher = BlockLauncher(bg, cfg, [4, 4, 4, 4], str(tmp_path), f"scan{int(scan)}{split}", Target.INTERPRETER)
        assert ("scan_lo" in launcher.source) == scan
        outs.append(launcher(q, k, v, arg)[0])
    for out in outs:
        assert torch.isnan(out[..., :8, :]).all()      # eager's 0/0 on rows that see no key
        assert_close(out[..., 8:, :], want[..., 8:, :], torch.float32)
    assert torch.equal(outs[0][..., 8:, :], outs[1][..., 8:, :])
    k2, v2 = k.clone(), v.clone()
    k2[..., 28:, :], v2[..., 28:, :] = float("nan"), float("nan")     # in the tile no row sees: never read
    cfg = LaunchConfig(tuple(bg.grid), 8, split, 4, 2, combine_in_kernel=split > 1, mask_scan=True)
    skipped = BlockLauncher(bg, cfg, [4, 4, 4, 4], str(tmp_path), f"scan{split}", Target.INTERPRETER)(q, k2, v2, arg)[0]
    assert_close(skipped[..., 8:, :], want[..., 8:, :], torch.float32)
    floor = _body(flash_attention(b, hk, rows, skv, d, scale=0.3, mask=(1, 1), dtype="bool", mask_dtype="bool",
                                  mask_fill=-1e30))
    assert scanned_mask(floor) is None


def test_a_stored_decode_launch_needs_its_mask_scan_round_too(tmp_path):
    """Read back from the cache (a warm compile), a masked decode launch is an answer only when the mask-scan
    round after it is stored as well (that round's key holds the share of the mask hidden); then its winner,
    the scanned twin or not, is the answer."""
    from torch_mirage.cache import DiskCache
    from torch_mirage.superopt import launch

    b, hk, rows, skv, d = 2, 2, 4, 64, 16
    bg = _body(flash_decoding(b, hk, rows, skv, d, scale=0.25, mask=(b, 1), dtype="float32", splits=4, tile=4))
    mask = torch.zeros(b, 1, rows, skv)
    mask[..., 16:] = float("-inf")
    inputs = [torch.randn(b, hk, rows, d), torch.randn(b, hk, skv, d), torch.randn(b, hk, skv, d), mask]
    cache, key = DiskCache(str(tmp_path)), "d" * 64
    first = LaunchConfig(tuple(bg.grid), bg.forloop_range)
    twin = launch.scan_twin(bg, first)
    assert twin is not None
    cache.put_json(key, {"times": {launch._config_name(first): 1.0}})
    assert launch.cached_launch(bg, cache, key) == first
    assert launch._cached_answer(bg, inputs, cache, key) is None            # the scan round is not stored
    cache.put_json(launch.scan_key(bg, inputs, key), {"times": {launch._config_name(first): 2.0,
                                                                launch._config_name(twin): 1.0}})
    assert launch._cached_answer(bg, inputs, cache, key) == twin
    mask[..., 16:] = 0.0                                                     # another hidden share: another key
    assert launch._cached_answer(bg, inputs, cache, key) is None


@interp
def test_decode_mask_scan_walks_only_written_slots(tmp_path):
    """Decode over a static cache early in it: split-KV (a grid dim over the key splits) with the mask scan walks
    only the slots written so far — its unwritten slots hold NaN and are never read, whole splits included — and
    matches fp64 after the combine; :func:`scan_twin` offers the scanned twin of a decode config only."""
    from torch_mirage.superopt.launch import scan_twin

    b, hk, rows, skv, d = 2, 2, 4, 64, 16
    kg = flash_decoding(b, hk, rows, skv, d, scale=0.25, mask=(b, 1), dtype="float32", splits=4, tile=4)
    bg = _body(kg)
    q, k, v = torch.randn(b, hk, rows, d), torch.randn(b, hk, skv, d), torch.randn(b, hk, skv, d)
    mask = torch.zeros(b, 1, rows, skv)
    mask[0, ..., 20:] = float("-inf")              # row 0 wrote 20 slots: two whole splits unwritten
    mask[1, ..., 37:] = float("-inf")
    want = _reference(q, k, v, mask, 0.25, None).float()
    k[0, :, 20:], v[0, :, 20:], k[1, :, 40:], v[1, :, 40:] = (float("nan"),) * 4    # the tiles no row sees
    cfg = scan_twin(bg, LaunchConfig(tuple(bg.grid), bg.forloop_range))
    assert cfg is not None and cfg.mask_scan
    launcher = BlockLauncher(bg, cfg, [4, 4, 4, 4], str(tmp_path), "dec_scan", Target.INTERPRETER)
    assert "scan_lo" in launcher.source
    m, l, o = (x.reshape(b * hk, 4, rows, -1) for x in launcher(q, k, v, mask))
    w = torch.exp(m - m.amax(1, keepdim=True))
    out = ((w * o).sum(1) / (w * l).sum(1)).reshape(b, hk, rows, d)
    assert_close(out, want, torch.float32)
    assert scan_twin(bg, LaunchConfig(tuple(bg.grid), 1)) is None                 # one step: nothing to bound
    prefill = _body(flash_attention(1, 2, 256, 256, 16, scale=0.25, mask=(1, 1), dtype="float32"))
    assert scan_twin(prefill, LaunchConfig(tuple(prefill.grid), prefill.forloop_range)) is None
    unmasked = _body(flash_decoding(b, hk, rows, skv, d, scale=0.25, dtype="float32", splits=4, tile=4))
    assert scan_twin(unmasked, LaunchConfig(tuple(unmasked.grid), unmasked.forloop_range)) is None


def test_scan_choice_is_kept_per_hidden_share():
    """Whether a decode launch scans its mask is timed on the call's mask and cached per share of the mask that
    hides its key (-inf, or False in a bool mask), in eighths: a step early in a long cache and a late one are
    separate answers; unscanned graphs have no share."""
    from torch_mirage.superopt.launch import hidden_share

    b, hk, rows, skv, d = 2, 2, 4, 64, 16
    bg = _body(flash_decoding(b, hk, rows, skv, d, scale=0.25, mask=(b, 1), dtype="float32", splits=4, tile=4))
    q, k, v = torch.randn(b, hk, rows, d), torch.randn(b, hk, skv, d), torch.randn(b, hk, skv, d)
    early, late = torch.zeros(b, 1, rows, skv), torch.zeros(b, 1, rows, skv)
    early[..., 8:] = float("-inf")                 # 8 of 64 slots written: 7 / 8 hidden
    late[..., 60:] = float("-inf")
    assert hidden_share(bg, [q, k, v, early]) == 0.875 and hidden_share(bg, [q, k, v, late]) == 0.0
    keep = torch.zeros(b, 1, rows, skv, dtype=torch.bool)
    keep[..., :16] = True
    boolean = _body(flash_decoding(b, hk, rows, skv, d, scale=0.25, mask=(b, 1), dtype="float32",
                                   mask_dtype="bool", splits=4, tile=4))
    assert hidden_share(boolean, [q, k, v, keep]) == 0.75
    unmasked = _body(flash_decoding(b, hk, rows, skv, d, scale=0.25, dtype="float32", splits=4, tile=4))
    assert hidden_share(unmasked, [q, k, v]) is None


def _tile_table(m: torch.Tensor, t: int = 64) -> torch.Tensor:
    """The mask's tile table as the seed's kernel graph makes it: each square row's maxima, then its sums."""
    bm, hm, rows, keys = m.shape
    squares = m.reshape(bm, hm, rows // t, t, keys // t, t)
    return torch.stack([squares.amax(dim=(3, 5)), squares.sum(dim=(3, 5))], dim=3).reshape(bm, hm, 2 * rows // t, -1)


@interp
def test_scan_table_skips_what_the_mask_hides(tmp_path):
    """FlashAttention with its mask's tile table (kernel-level maxima and sums of 64 x 64 squares, read by the
    launch only): eager-equal under a causal mask with right padding and a row block that sees nothing (eager's
    NaN there), keys in squares no row sees hold NaN and are never read, the mask is not read on the squares
    where it is all 0 (but is where a square's max is 0 and one entry is not), and with no launch scanning the
    table the kernel reads the mask as before."""
    n, h, d = 256, 2, 16
    kg = flash_attention(1, h, n, n, d, scale=0.25, softcap=20.0, mask=(1, 1), dtype="float32", scan_table=True)
    bg = _body(kg)
    q, k, v = (torch.randn(1, h, n, d) for _ in range(3))
    m = torch.full((n, n), float("-inf")).triu(1)[None, None].clone()
    m[..., 192:] = float("-inf")                       # padding: the last 64 keys
    m[..., :64, :] = float("-inf")                     # the first 64 rows see nothing
    m[..., 200, 10] = -3.0                             # a square of 0 but one entry: read, not skipped
    want = _reference(q, k, v, m, 0.25, 20.0).float()
    k[..., 192:, :], v[..., 192:, :] = float("nan"), float("nan")
    table = _tile_table(m)
    maxima, sums = table[0, 0, 0::2], table[0, 0, 1::2]
    assert maxima.isneginf().sum() == 8 and ((maxima == 0) & (sums == 0)).sum() == 5    # squares: all -inf / all 0
    # rows 128-255 see keys 0-63 partly (the -3), 64-127 whole (all 0: poisoned, never loaded), 128-191 partly
    poisoned = m.clone()
    poisoned[..., 128:, 64:128] = float("nan")
    for scan in (True, False):
        cfg = LaunchConfig((h, 1, 2), 4, mask_scan=scan)      # 128-row blocks, 64-key tiles
        launcher = BlockLauncher(bg, cfg, [4] * 5, str(tmp_path), f"table{int(scan)}", Target.INTERPRETER)
        assert ("scan_lo" in launcher.source) == scan and ("zero_lo" in launcher.source) == scan
        assert ("pid_2 = 1 - tl.program_id(2)" in launcher.source) == scan      # query blocks heaviest first
        out = launcher(q, k, v, m, table)[0]
        if scan:
            assert torch.isnan(out[..., :64, :]).all()
            assert_close(out[..., 64:, :], want[..., 64:, :], torch.float32)
            skipped = launcher(q, k, v, poisoned, table)[0]      # rows 128-255 walk keys 0-63 as all-zero squares
            assert_close(skipped[..., 64:, :], want[..., 64:, :], torch.float32)
        else:                                         # every key read: the NaN keys reach every row
            assert torch.isnan(out).all()
    c = compile_ugraph(kg, [q, k.nan_to_num(), v.nan_to_num(), m])    # the kernel graph makes its table itself
    out = c(q, k.nan_to_num(), v.nan_to_num(), m)[0]
    assert_close(out[..., 64:, :], _reference(q, k.nan_to_num(), v.nan_to_num(), m, 0.25, 20.0).float()[..., 64:, :],
                 torch.float32)
