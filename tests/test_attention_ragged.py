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
from torch_mirage.superopt.launch import (LaunchConfig, candidates, default_config, launch_tiling, ragged_steps,
                                          ragged_walk)

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


def test_ragged_steps():
    """Whole tiles over a length they do not divide, the steps a multiple of a split's; none where they divide."""
    assert ragged_steps(131, 64) == (3, 192)
    assert ragged_steps(131, 64, 2) == (4, 256)
    assert ragged_steps(128, 64) is None and ragged_steps(256, 64, 4) is None


def test_candidates_walk_a_prime_kv_length_in_whole_tiles():
    """Decode at 131 keys (the seed: 131 one-key steps) is timed at its own schedule and at whole 64-key tiles
    with a ragged last one (the decode schedules' first two pipeline depths); 67 keys (one padded tile) gets two 64-key tiles too; prefill at 4100 keys (the
    seed's tiles of 50) gets 64-key tiles, 4160 covered. The launches re-tile the block graph."""
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


def test_the_emitter_bounds_only_the_walked_dim():
    """The ragged kernel bounds the loads of K and V (and the scores) by the keys; Q, read once, is not."""
    bg = _body(flash_attention(1, 2, 2, 131, 64, scale=0.125, dtype="float16"))
    tiled = launch_tiling(bg, LaunchConfig(bg.grid, 3, ragged=192))
    src = emit_block_kernel(tiled, [4, 4, 4], target=Target.CUDA, walked_extent=131).source
    loads = [line for line in src.splitlines() if "tl.load(" in line]
    assert sum("< 131)" in line for line in loads) == 2, loads
    assert "tl.where((it * 64 + r64)[None, :] < 131" in src


def test_a_split_past_the_keys_visits_no_tile():
    """131 keys in 4 splits of two 32-key steps (256 covered): the loop stops after the fifth step, so the fourth
    split — wholly past the keys — visits no tile (H200 12-01: 4099 keys ran as 16 splits of 5 steps, 5120)."""
    bg = _body(flash_attention(1, 2, 2, 131, 64, scale=0.125, dtype="float16"))
    config = LaunchConfig(bg.grid, 8, 4, combine_in_kernel=True, ragged=256)
    src = emit_block_kernel(launch_tiling(bg, config), [4, 4, 4], split=4, combine_in_kernel=True,
                            target=Target.CUDA, walked_extent=131).source
    assert "for it in tl.range(split * 2, tl.minimum(split * 2 + 2, 5)" in src, src
