"""Attention at a KV length no tile divides (issue 16): the seeds' own schedule walks the keys in the short tiles that
divide them (131, a prime: one key a step), and a launch re-tiles the walk into whole tiles with a ragged last one
(``LaunchConfig.ragged``, :func:`~torch_mirage.superopt.launch.ragged_walk`): loads past the keys read 0, their scores
are -inf. The launch tuner checks every such launch against the seed's own schedule on the GPU; here the CPU
interpreter runs both against fp64 references, and the candidate lists and the claimer's decline are checked."""
import os

import pytest
import torch

from helpers import assert_close
from torch_mirage.codegen.ugraph_triton import emit_block_kernel
from torch_mirage.context import Target
from torch_mirage.superopt.attention_seeds import attention_column_sums, flash_attention
from torch_mirage.superopt.compile import BlockLauncher
from torch_mirage.superopt.launch import (LaunchConfig, candidates, default_config, launch_tiling, ragged_rows,
                                          ragged_steps, ragged_walk, untuned_config)

interp = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                            reason="CPU kernels run only in Triton's interpreter (TRITON_INTERPRET=1)")


def _body(kg):
    return next(op.body for op in kg.ops if op.name == "customized")


def _band_mask(sq, skv):
    """(1, 1, sq, skv) additive causal mask of a prompt's last ``sq`` positions over ``skv`` keys (-1e30 hides)."""
    i = torch.arange(sq)[:, None] + skv - sq
    return torch.zeros(sq, skv).masked_fill(torch.arange(skv)[None] > i, -1e30)[None, None]


@interp
@pytest.mark.parametrize("mask", ["none", "additive", "band", "band_from_indices"])
@pytest.mark.parametrize("steps,split,cover", [(3, 1, 48), (2, 1, 64), (4, 2, 64), (4, 4, 64)])
def test_ragged_launches_equal_fp64(mask, steps, split, cover, tmp_path):
    """37 keys (a prime) walked one key a step by the seed, and by launches of whole 16- or 32-key tiles whose last
    one runs past the keys — alone, split with a combine kernel, and split so that the last split holds no key
    (keys 48-63 of 37) — with no mask, an additive mask hiding keys (one by -inf), and a causal band read from the
    mask or computed from indices: every launch fp64-equal, and the ragged ones load with the keys' bound."""
    b, hk, sq, skv, d = 1, 2, 4, 37, 16
    band = {"band": (sq, skv - sq, None, True, False), "band_from_indices": (sq, skv - sq, None, True, True)}
    kg = flash_attention(b, hk, sq, skv, d, scale=d ** -0.5, dtype="float32", forloop_range=skv,
                         mask=None if mask == "none" else (1, 1), band=band.get(mask))
    bg = _body(kg)
    assert ragged_walk(bg) == skv
    q, k, v = torch.randn(b, hk, sq, d), torch.randn(b, hk, skv, d), torch.randn(b, hk, skv, d)
    xs = [q, k, v]
    m = torch.zeros(1, 1, sq, skv)
    if mask == "additive":
        m[..., -5:] = -1e30
        m[..., 0, 3] = float("-inf")
    elif mask.startswith("band"):
        m = _band_mask(sq, skv)
    if mask != "none":
        xs.append(m)
    s = q.double() @ k.double().transpose(-1, -2) * d ** -0.5 + m.double()
    want = torch.softmax(s, -1) @ v.double()
    for config in (default_config(bg), LaunchConfig(tuple(bg.grid), steps, split, ragged=cover)):
        launcher = BlockLauncher(bg, config, [x.dim() for x in xs], str(tmp_path), f"r{config.ragged}",
                                 Target.INTERPRETER)
        assert_close(launcher(*xs)[0], want.float(), torch.float32)
        assert (f"< {skv})" in launcher.source) == bool(config.ragged)


@interp
def test_ragged_launch_of_a_head_per_program(tmp_path):
    """GQA prefill with a program per query head (``q_heads``: the programs of a group read their KV head's
    tiles) at 37 keys: the ragged launch is fp64-equal."""
    b, hk, heads, sq, skv, d = 1, 2, 4, 8, 37, 16
    kg = flash_attention(b, hk, sq, skv, d, scale=d ** -0.5, dtype="float32", forloop_range=skv, q_heads=heads)
    bg = _body(kg)
    q, k, v = torch.randn(b, heads, sq, d), torch.randn(b, hk, skv, d), torch.randn(b, hk, skv, d)
    kk, vv = (x.repeat_interleave(heads // hk, 1).double() for x in (k, v))
    want = torch.softmax(q.double() @ kk.transpose(-1, -2) * d ** -0.5, -1) @ vv
    launcher = BlockLauncher(bg, LaunchConfig(tuple(bg.grid), 3, ragged=48), [4, 4, 4], str(tmp_path), "heads",
                             Target.INTERPRETER)
    assert_close(launcher(q, k, v)[0], want.float(), torch.float32)


@interp
def test_ragged_launches_with_a_bias_and_v_heads_of_their_own(tmp_path):
    """A mask and a bias at their own shapes (BLOOM's ALiBi: (b, h, 1, skv)) both walked along the keys, V heads
    of their own size (latent attention): the ragged launches, alone and split, are fp64-equal."""
    b, hk, sq, skv, d, dv = 1, 2, 4, 37, 16, 8
    kg = flash_attention(b, hk, sq, skv, d, scale=d ** -0.5, dtype="float32", forloop_range=skv, mask=(1, 1),
                         bias=(b, hk, 1), dv=dv)
    bg = _body(kg)
    q, k, v = torch.randn(b, hk, sq, d), torch.randn(b, hk, skv, d), torch.randn(b, hk, skv, dv)
    m = torch.zeros(1, 1, sq, skv)
    m[..., -3:] = -1e30
    bias = torch.randn(b, hk, 1, skv)
    s = q.double() @ k.double().transpose(-1, -2) * d ** -0.5 + m.double() + bias.double()
    want = torch.softmax(s, -1) @ v.double()
    for config in (LaunchConfig(tuple(bg.grid), 3, ragged=48), LaunchConfig(tuple(bg.grid), 4, 2, ragged=64)):
        launcher = BlockLauncher(bg, config, [4] * 5, str(tmp_path), f"bias{config.split}", Target.INTERPRETER)
        assert_close(launcher(q, k, v, m, bias)[0], want.float(), torch.float32)


def test_ragged_steps():
    """Whole tiles over a length they do not divide, the steps a multiple of a split's; none where they divide."""
    assert ragged_steps(131, 64) == (3, 192)
    assert ragged_steps(131, 64, 2) == (4, 256)
    assert ragged_steps(128, 64) is None and ragged_steps(256, 64, 4) is None


def test_candidates_walk_a_prime_kv_length_in_whole_tiles():
    """Decode at 131 keys (the seed: 131 one-key steps) is timed at its own schedule and at whole 64-key tiles
    with a ragged last one (the decode schedules' first two pipeline depths); 67 keys (one padded tile) gets two
    64-key tiles too; prefill at 4100 keys (the seed's tiles of 50) gets 64-key tiles, 4160 covered. The launches
    re-tile the block graph."""
    decode = _body(flash_attention(4, 8, 2, 131, 64, scale=0.125, dtype="bfloat16"))
    assert decode.forloop_range == 131 and ragged_walk(decode) == 131
    cands = candidates(decode, 132)
    assert cands[0] == default_config(decode)
    ragged = [c for c in cands if c.ragged]
    assert {(c.forloop_range, c.ragged, c.num_stages) for c in ragged} >= {(3, 192, 2), (3, 192, 3)}
    assert all(launch_tiling(decode, c) is not None for c in ragged)
    assert launch_tiling(decode, LaunchConfig(decode.grid, 3, ragged=128)) is None     # covers fewer than 131
    one_tile = _body(flash_attention(4, 8, 2, 67, 64, scale=0.125, dtype="bfloat16"))
    assert (2, 128) in {(c.forloop_range, c.ragged) for c in candidates(one_tile, 132)}
    prefill = _body(flash_attention(1, 8, 128, 4100, 64, scale=0.125, dtype="bfloat16"))
    assert prefill.forloop_range == 82
    assert (65, 4160) in {(c.forloop_range, c.ragged) for c in candidates(prefill, 132)}


def test_column_sums_and_mask_tables_are_not_walked_ragged():
    """A column-sum pass (its keys are the programs', its outputs lie along them) and a seed with a table of its
    mask's tiles (the table's tiles fix the walk) have no ragged launch."""
    cols = attention_column_sums(1, 2, 2, 64, 16, group=1, kernels=("flash_stats", "column_sums"), scale=0.25,
                                 dtype="float32", tile=16)
    walks = [ragged_walk(op.body) for op in cols.ops if op.name == "customized"]
    assert walks == [64, None], walks        # the first pass (P·V and its row stats) may; the column pass not
    scan = next(op.body for op in flash_attention(1, 2, 128, 128, 16, scale=0.25, mask=(1, 1), dtype="float32",
                                                  scan_table=True).ops
                if op.name == "customized" and op.body.forloop_scan is not None)
    assert ragged_walk(scan) is None
    assert launch_tiling(scan, LaunchConfig(scan.grid, 3, ragged=192)) is None


def test_the_emitter_bounds_only_the_walked_dim_in_the_last_tile():
    """The ragged kernel walks the whole 64-key tiles (keys 0-127 of 131) unbounded, then its last, ragged tile in
    a loop of its own (one step, not pipelined) whose K and V loads and scores are bounded by the keys; Q, read
    once, is not (H200 12-02: gemma2_softcap at 1031 tokens took 46.0 µs against 29.8 at 1024 with every tile
    bounded)."""
    bg = _body(flash_attention(1, 2, 2, 131, 64, scale=0.125, dtype="float16"))
    tiled = launch_tiling(bg, LaunchConfig(bg.grid, 3, ragged=192))
    src = emit_block_kernel(tiled, [4, 4, 4], target=Target.CUDA, walked_extent=131).source
    main, tail = src.split("for it in tl.range(2, 3, num_stages=1):")
    assert "for it in tl.range(0, 2, num_stages=NUM_STAGES):" in main
    loads = [line for line in src.splitlines() if "tl.load(" in line]
    assert sum("< 131)" in line for line in loads) == 2, loads
    assert "< 131" not in main and tail.count("< 131)") == 2
    assert "tl.where((it * 64 + r64)[None, :] < 131" in tail


def test_a_ragged_walk_peels_its_last_tile_at_run_time_bounds():
    """Loop bounds known only at run time (a split's share; a causal band's per-block range) are cut at the last
    whole tile with ``tl.minimum`` / ``tl.maximum``; a length the tiles divide has no bounded loop; segments that
    end before the cut or start after it are not split."""
    from torch_mirage.codegen.ugraph_triton import _peel_ragged_tail
    assert _peel_ragged_tail([("split * 2", "tl.minimum(split * 2 + 2, 5)", False)], 4) == [
        ("split * 2", "tl.minimum(tl.minimum(split * 2 + 2, 5), 4)", False, False),
        ("tl.maximum(split * 2, 4)", "tl.minimum(split * 2 + 2, 5)", False, True)]
    assert _peel_ragged_tail([("0", "4", False)], 4) == [("0", "4", False, False)]
    assert _peel_ragged_tail([("0", "2", False), ("2", "band_hi", True)], 3) == [
        ("0", "2", False, False), ("2", "tl.minimum(band_hi, 3)", True, False), ("3", "band_hi", True, True)]


def test_a_split_past_the_keys_visits_no_tile():
    """131 keys in 4 splits of two 32-key steps (256 covered): the loop stops after the fifth step, so the fourth
    split — wholly past the keys — visits no tile (H200 12-01: 4099 keys ran as 16 splits of 5 steps, 5120)."""
    bg = _body(flash_attention(1, 2, 2, 131, 64, scale=0.125, dtype="float16"))
    config = LaunchConfig(bg.grid, 8, 4, combine_in_kernel=True, ragged=256)
    src = emit_block_kernel(launch_tiling(bg, config), [4, 4, 4], split=4, combine_in_kernel=True,
                            target=Target.CUDA, walked_extent=131).source
    assert "for it in tl.range(tl.maximum(split * 2, 4), tl.minimum(split * 2 + 2, 5), num_stages=1)" in src, src


@interp
@pytest.mark.parametrize("ragged", [False, True])
def test_one_query_row_under_a_band_from_indices(ragged, tmp_path):
    """A decode step's one query row under a causal band computed from indices (keys up to its position): the
    index mask has no position dim of extent > 1 — it failed to build (`band_mask_dims`, found by a fuzz of ragged
    launches on 12-02) — and is fp64-equal, at the seed's own schedule and at a ragged walk of 16-key tiles."""
    b, hk, skv, d = 1, 2, 37, 16
    kg = flash_attention(b, hk, 1, skv, d, scale=d ** -0.5, dtype="float32", forloop_range=skv, mask=(1, 1),
                         band=(1, skv - 1, None, True, True))
    bg = _body(kg)
    q, k, v = torch.randn(b, hk, 1, d), torch.randn(b, hk, skv, d), torch.randn(b, hk, skv, d)
    want = torch.softmax(q.double() @ k.double().transpose(-1, -2) * d ** -0.5, -1) @ v.double()
    config = LaunchConfig(tuple(bg.grid), 3, ragged=48) if ragged else default_config(bg)
    launcher = BlockLauncher(bg, config, [4] * 4, str(tmp_path), f"one{ragged}", Target.INTERPRETER)
    assert_close(launcher(q, k, v, torch.zeros(1, 1, 1, skv))[0], want.float(), torch.float32)


@interp
def test_random_ragged_launches_equal_fp64(tmp_path):
    """Six ragged launches drawn afresh each run — decode (1-5 query rows, 17-200 keys, 16- to 64-key tiles, splits
    of 1, 2 or 4 folded in-kernel or by a combine kernel, no mask / an additive one / a causal band read or
    computed) and prompts (17-100 tokens, ragged row blocks and key walks, with and without the band): each
    fp64-equal; the drawn case is in the failure message."""
    import random

    rng = random.Random()
    b, hk, d = 1, 2, 16
    for i in range(6):
        if i % 2 == 0:
            sq, skv = rng.choice([1, 2, 3, 5]), rng.randint(17, 200)
            tile, split = rng.choice([16, 32, 64]), rng.choice([1, 2, 4])
            mask = rng.choice(["none", "additive", "band", "band_from_indices"])
            band = {"band": (sq, skv - sq, None, True, False),
                    "band_from_indices": (sq, skv - sq, None, True, True)}.get(mask)
            bg = _body(flash_attention(b, hk, sq, skv, d, scale=d ** -0.5, dtype="float32", forloop_range=skv,
                                       mask=None if mask == "none" else (1, 1), band=band))
            if ragged_steps(skv, tile, split) is None:      # the tiles divide the keys: one whole walk
                split = 1
            steps, cover = ragged_steps(skv, tile, split) or (skv // tile, skv)
            config = LaunchConfig(tuple(bg.grid), steps, split, ragged=cover,
                                  combine_in_kernel=split > 1 and rng.random() < 0.5)
        else:
            sq = skv = rng.randint(17, 100)
            rows_per, tile = rng.choice([16, 32, 64]), rng.choice([16, 32, 64])
            mask = rng.choice(["none", "band", "band_from_indices"])
            band = {"band": (sq, 0, None, True, False), "band_from_indices": (sq, 0, None, True, True)}.get(mask)
            bg = _body(flash_attention(b, hk, sq, skv, d, scale=d ** -0.5, dtype="float32", forloop_range=skv,
                                       q_blocks=sq, mask=None if mask == "none" else (1, 1), band=band))
            g, rows = ragged_rows(bg)
            grid = tuple(-(-rows // rows_per) if j == g else x for j, x in enumerate(bg.grid))
            steps = -(-skv // tile)
            config = LaunchConfig(grid, steps, ragged=steps * tile, ragged_rows=grid[g] * rows_per)
        q, k, v = torch.randn(b, hk, sq, d), torch.randn(b, hk, skv, d), torch.randn(b, hk, skv, d)
        m = torch.zeros(1, 1, sq, skv)
        if mask == "additive":
            m[..., rng.randint(1, skv - 1):] = -1e30
        elif mask != "none":
            m = _band_mask(sq, skv)
        xs = [q, k, v] + ([m] if mask != "none" else [])
        s = q.double() @ k.double().transpose(-1, -2) * d ** -0.5 + m.double()
        want = torch.softmax(s, -1) @ v.double()
        case = dict(sq=sq, skv=skv, mask=mask, config=config)
        launcher = BlockLauncher(bg, config, [x.dim() for x in xs], str(tmp_path), f"rand{i}", Target.INTERPRETER)
        out = launcher(*xs)[0]
        assert torch.allclose(out.double(), want, rtol=1e-4, atol=1e-4), (case, (out.double() - want).abs().max())


# ------------------------------------------------------------------ ragged row blocks (a prompt no tile divides)
@interp
@pytest.mark.parametrize("mask", ["none", "band", "band_from_indices", "heads", "packed"])
@pytest.mark.parametrize("rows_per,keys_per", [(16, 16), (32, 16), (64, 64)])
def test_ragged_row_blocks_equal_fp64(mask, rows_per, keys_per, tmp_path):
    """A 37-token prompt against 37 keys, its seed one row a program and one key a step, launched in whole blocks
    of 16 / 32 / 64 rows and 16 / 64 keys with a ragged last one of each — with no mask, a causal band read from
    the mask or computed from indices, a program per query head, and two query heads packed in a KV head's rows
    (74 rows, positions modulo 37) — fp64-equal, the outputs of the prompt's own rows."""
    b, hk, sq, skv, d = 1, 2, 37, 37, 16
    group = 2 if mask in ("heads", "packed") else 1
    rows = sq * (group if mask == "packed" else 1)
    band = {"band": (sq, 0, None, True, False), "band_from_indices": (sq, 0, None, True, True),
            "packed": (sq, 0, None, True, True)}.get(mask)
    kg = flash_attention(b, hk, rows, skv, d, scale=d ** -0.5, dtype="float32", forloop_range=skv, q_blocks=rows,
                         mask=(1, 1) if band else None, band=band, q_heads=hk * group if mask == "heads" else None)
    bg = _body(kg)
    g, extent = ragged_rows(bg)
    assert extent == rows and bg.grid[g] == rows
    heads = hk * group if mask == "heads" else hk
    q, k, v = torch.randn(b, heads, rows, d), torch.randn(b, hk, skv, d), torch.randn(b, hk, skv, d)
    m = torch.zeros(sq, skv).masked_fill(torch.arange(skv)[None] > torch.arange(sq)[:, None], -1e30)
    m = m.repeat(rows // sq, 1)[None, None]
    xs = [q, k, v] + ([m] if band else [])
    kk, vv = (x.repeat_interleave(heads // hk, 1).double() for x in (k, v))
    s = q.double() @ kk.transpose(-1, -2) * d ** -0.5 + (m.double() if band else 0)
    want = torch.softmax(s, -1) @ vv
    grid = tuple(-(-rows // rows_per) if i == g else x for i, x in enumerate(bg.grid))
    steps = -(-skv // keys_per)
    config = LaunchConfig(grid, steps, ragged=steps * keys_per, ragged_rows=grid[g] * rows_per)
    launcher = BlockLauncher(bg, config, [x.dim() for x in xs], str(tmp_path), "rows", Target.INTERPRETER)
    out = launcher(*xs)[0]
    assert out.shape == want.shape
    assert_close(out, want.float(), torch.float32)


def test_ragged_row_blocks_in_the_candidates_and_the_untuned_launch():
    """A 131-token prompt (the seed: 131 one-row programs, 131 one-key steps): the prefill schedules cut its rows
    and keys into whole blocks with a ragged last one, and a compile that does not tune runs 64-long ones; a
    split of ragged row blocks does not tile (its combine kernel stores whole blocks); a prompt that divides
    keeps its own schedule untuned."""
    bg = _body(flash_attention(1, 8, 131, 131, 64, scale=0.125, dtype="bfloat16", band=(131, 0, None, True, True),
                               mask=(1, 1)))
    assert bg.forloop_range == 131 and ragged_rows(bg) == (2, 131)
    cands = candidates(bg, 132)
    assert cands[0] == default_config(bg)
    tilings = {(c.grid[2], c.ragged_rows, c.forloop_range, c.ragged) for c in cands}
    assert tilings >= {(2, 256, 3, 192), (3, 192, 3, 192)}
    assert untuned_config(bg) == LaunchConfig((8, 1, 3), 3, ragged=192, ragged_rows=192)
    assert launch_tiling(bg, LaunchConfig((8, 1, 3), 4, 2, ragged=256, ragged_rows=192)) is None
    whole = _body(flash_attention(1, 8, 256, 256, 64, scale=0.125, dtype="bfloat16"))
    assert untuned_config(whole) == default_config(whole)


def test_ragged_row_blocks_store_the_prompts_rows_only():
    """The ragged-row kernel bounds Q's loads and the output's stores by the 131 rows; its output tensor has 131."""
    bg = _body(flash_attention(1, 2, 131, 131, 64, scale=0.125, dtype="float16"))
    config = LaunchConfig((2, 1, 3), 3, ragged=192, ragged_rows=192)
    kernel = emit_block_kernel(launch_tiling(bg, config), [4, 4, 4], target=Target.CUDA, walked_extent=131,
                               row_bound=(2, 131))
    stores = [line for line in kernel.source.splitlines() if "tl.store(" in line]
    assert stores and all("< 131)" in line for line in stores), stores
    assert kernel.outputs == [((1, 2, 131, 64), "float16")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [131, 1031])
def test_gpu_prompt_at_a_prime_length(n, caplog):
    """A causal prompt of a prime length (HF's SDPA path, GQA by ``repeat_kv``, bf16, 16 query / 8 KV heads): claimed
    (no timing against Inductor), compiled strict, no tuned launch disagreeing with the seed's own schedule (one row
    a program, one key a step), the launch picked cutting rows and keys into whole blocks with a ragged last
    one; fp64-equal."""
    import torch.nn.functional as F

    from helpers import strict_attention_compile
    from test_attention_family import repeat_kv

    b, h, hk, d, dtype = 1, 16, 8, 64, torch.bfloat16
    q = torch.randn(b, h, n, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(b, hk, n, d, device="cuda", dtype=dtype) for _ in range(2))

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, repeat_kv(k, h // hk), repeat_kv(v, h // hk), is_causal=True)

    out, (region,) = strict_attention_compile(f, (q, k, v), caplog)
    assert all(c["ragged"] and c["ragged_rows"] for c in region.info["launch"]), region.info
    assert_close(out, f(q.double(), k.double(), v.double()).to(dtype), dtype)
