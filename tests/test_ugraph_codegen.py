"""Generated Triton for μGraphs (Triton interpreter on the CPU): every hand-built μGraph matches its
PyTorch program (fp64 reference) on odd shapes in fp32 and fp16, under re-tiling and split-K / split-KV
too; a golden copy of one kernel's source shows codegen changes in review."""
import dataclasses
import math
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on CPU tensors

import pathlib  # noqa: E402

import pytest  # noqa: E402
from helpers import assert_close  # noqa: E402

from torch_mirage.superopt import launch  # noqa: E402
from torch_mirage.superopt.launch import LaunchConfig, retile  # noqa: E402
from torch_mirage.codegen.ugraph_triton import (FOLD_UNROLLED, emit_block_kernel, module_source,  # noqa: E402
                                                order_by_depth)
from torch_mirage.superopt import builder, library  # noqa: E402
from torch_mirage.superopt.compile import BlockLauncher, compile_ugraph  # noqa: E402

GOLDEN = pathlib.Path(__file__).parent / "golden" / "ugraph_rmsnorm_linear.py.txt"
DT = {torch.float32: "float32", torch.float16: "float16"}
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"   # same tests, interpreter or GPU

# odd / non-power-of-two shapes with the schedules that split them (tile dims < 16 are padded and masked)
CASES = [
    ("rmsnorm_linear", (3, 15, 21), dict(grid=3, forloop_range=5)),
    ("rmsnorm_linear", (1, 6, 10), dict(grid=1, forloop_range=1)),
    ("gated_mlp", (7, 6, 10), dict(grid=5, forloop_range=2)),
    ("lora", (3, 15, 21, 5), dict(grid=3, forloop_range=5)),
    ("lora", (6, 10, 9, 1), dict(grid=9, forloop_range=2)),
    ("gqa_flashdecoding", (2, 3, 5, 12, 7), dict(splits=3, forloop_range=2)),
    ("gqa_flashattention", (2, 3, 6, 15, 7), dict(q_blocks=3, forloop_range=5)),
    ("qknorm_attention", (1, 1, 5, 10, 6), dict(q_blocks=5, forloop_range=2)),
    ("ntrans", (5, 12), dict(grid=5)),
]
IDS = [f"{n}-{'x'.join(map(str, d))}" for n, d, _ in CASES]


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MIRAGE_CACHE_DIR", str(tmp_path))


def _inputs(name, dims, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)
            for s in library.WORKLOADS[name].input_shapes(*dims)]


def _check(name, got, xs, dtype):
    want = library.WORKLOADS[name].reference(*[x.double() for x in xs])
    assert got.dtype == dtype and got.shape == want.shape
    assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name,dims,sched", CASES, ids=IDS)
def test_generated_triton_matches_eager(name, dims, sched, dtype):
    g = library.WORKLOADS[name].build(*dims, dtype=DT[dtype], **sched)
    xs = _inputs(name, dims, dtype, seed=len(IDS[0]) + sum(dims))
    compiled = compile_ugraph(g, xs, tune=False)
    assert compiled.sources and all("@triton.jit" in s for s in compiled.sources)
    (got,) = compiled(*xs)
    _check(name, got, xs, dtype)


# (workload, dims, schedule, launch config, combine on a finer grid): re-tiled grids / for-loops and kernel-level
# splits; states with an odd dim keep the combine on the partial kernel's grid, power-of-two ones cut into chunks
SPLITS = [
    ("rmsnorm_linear", (3, 15, 21), dict(grid=3, forloop_range=5), LaunchConfig((7,), 5, 5), False),
    ("gated_mlp", (3, 16, 32), dict(grid=2, forloop_range=4), LaunchConfig((1,), 2, 2), True),
    ("lora", (3, 15, 21, 5), dict(grid=3, forloop_range=5), LaunchConfig((1,), 5, 5), False),
    ("gqa_flashattention", (2, 3, 6, 15, 7), dict(q_blocks=3, forloop_range=5), LaunchConfig((3, 2, 1), 5, 5), False),
    ("qknorm_attention", (2, 3, 6, 15, 7), dict(q_blocks=2, forloop_range=3), LaunchConfig((3, 2, 2), 3, 3), False),
    ("gqa_flashattention", (1, 2, 64, 32, 16), dict(q_blocks=1, forloop_range=4), LaunchConfig((2, 1, 1), 4, 4), True),
    ("qknorm_attention", (2, 1, 32, 16, 16), dict(q_blocks=1, forloop_range=2), LaunchConfig((1, 2, 1), 2, 2), True),
    ("rmsnorm_linear", (3, 32, 64), dict(grid=1, forloop_range=2), LaunchConfig((1,), 2, 2), True),
    ("gated_mlp", (5, 32, 64), dict(grid=2, forloop_range=2), LaunchConfig((2,), 2, 2), True),
    # 32 split states: folded in unrolled chunks (ugraph_triton.FOLD_CHUNK) after the first
    ("rmsnorm_linear", (3, 64, 24), dict(grid=1, forloop_range=32), LaunchConfig((1,), 32, 32), False),
]


@pytest.mark.parametrize("name,dims,sched,cfg,finer", SPLITS,
                         ids=[f"{s[0]}-{'x'.join(map(str, s[1]))}" for s in SPLITS])
def test_retiled_and_split_kernels_match_eager(name, dims, sched, cfg, finer, tmp_path):
    g = library.WORKLOADS[name].build(*dims, dtype="float16", **sched)
    (op,) = [o for o in g.ops if o.name == "customized"]
    xs = _inputs(name, dims, torch.float16, seed=7)
    run = BlockLauncher(op.body, cfg, [x.dim() for x in xs], str(tmp_path))
    assert (run.combine_fn is not None) == (cfg.split > 1)
    assert (math.prod(run.combine_grid) > math.prod(cfg.grid)) == finer, run.combine_grid
    assert ("chunk = " in run.source) == finer
    assert ("for chunk in tl.range(" in run.source) == (cfg.split > FOLD_UNROLLED)   # many states: in chunks
    (got,) = run(*xs)
    _check(name, got, xs, torch.float16)


def test_combine_tiling_keeps_the_grid_where_an_epilogue_op_reduces_the_chunked_dim():
    """``sum_j (X @ W)[i, j]`` after the loop: cutting the accumulator's columns would give each combine
    program a part of the row it sums, so the combine keeps the partial kernel's grid."""
    g = builder.new_kernel_graph()
    X, W = g.new_input((4, 32), "float32"), g.new_input((32, 64), "float32")
    tb = builder.new_threadblock_graph((1,), 2)
    acc = tb.forloop_accum(tb.matmul(tb.new_input(X, imap=(None,), fmap=1), tb.new_input(W, imap=(None,), fmap=0)),
                           "sum")
    tb.new_output(tb.reduce_sum(acc, dim=1), omap=(None,))
    (Y,) = g.customized([X, W], tb)
    g.mark_output(Y)
    bg = next(o for o in g.build().ops if o.name == "customized").body
    assert launch.combine_tiling(bg, 2).grid == bg.grid
    fa = next(o for o in library.gqa_flashattention(1, 2, 64, 32, 16, q_blocks=1, forloop_range=4).ops
              if o.name == "customized").body
    assert launch.combine_tiling(fa, 4).grid == (2, 1, 64)       # 64 query rows, one per combine program
    assert launch.combine_tiling(fa, 4, programs=8).grid == (2, 1, 4)   # the fewest chunks that reach ``programs``
    assert launch.combine_tiling(fa, 1).grid == fa.grid          # no split: no combine kernel


def test_strided_inputs_are_read_through_their_strides():
    g = library.rmsnorm_linear(5, 9, 14, dtype="float32", grid=7, forloop_range=3)
    x, gw = torch.randn(5, 9, device=DEVICE), torch.randn(9, device=DEVICE)
    w = torch.randn(14, 9, device=DEVICE).t()          # non-contiguous (9, 14)
    (got,) = compile_ugraph(g, [x, gw, w], tune=False)(x, gw, w)
    _check("rmsnorm_linear", got, [x, gw, w], torch.float32)


def test_thread_fused_graph_compiles():
    g = builder.fuse_thread_graphs(library.ntrans(6, 9, dtype="float32", grid=3))
    assert any(o.name == "thread" for op in g.ops if op.body is not None for o in op.body.ops)
    xs = _inputs("ntrans", (6, 9), torch.float32, seed=3)
    (got,) = compile_ugraph(g, xs, tune=False)(*xs)
    _check("ntrans", got, xs, torch.float32)


def test_retile_keeps_outputs_or_refuses():
    bg = next(o for o in library.rmsnorm_linear(4, 64, 96, dtype="float16", grid=3, forloop_range=4).ops
              if o.name == "customized").body
    new = retile(bg, (6,), 2)
    assert new is not None and new.grid == (6,) and new.forloop_range == 2
    assert retile(bg, (5,), 2) is None                       # 96 does not split 5 ways
    fd = library.gqa_flashdecoding(1, 2, 16, 64, 16, dtype="float16", splits=4, forloop_range=1)
    first = next(o for o in fd.ops if o.name == "customized").body
    assert retile(first, (2, 1, 2), 2) is None                # the split-KV grid dim shapes the output


def test_grid_dims_that_share_an_iterators_elements():
    """A grid dim that is a multiple of the tensor dim it maps reads each element from that many consecutive
    programs (GQA's KV heads under a program per query head); sizes where neither divides the other are refused,
    and a re-tiling may neither start nor stop sharing a read."""
    from torch_mirage.superopt.attention_seeds import flash_attention
    from torch_mirage.ugraph import MuGraphError, grid_split, iterator_tile

    assert grid_split(8, 16) == (2, 1) and grid_split(16, 4) == (1, 4) and grid_split(6, 4) is None
    assert iterator_tile((2, 8, 64, 16), (1, 0, None), 2, (16, 2, 1), 4) == (1, 1, 16, 16)
    with pytest.raises(MuGraphError, match="neither divides"):
        iterator_tile((2, 6, 64, 16), (1, 0, None), 2, (16, 2, 1), 4)
    fa = next(o for o in flash_attention(2, 8, 256, 256, 16, scale=0.25, q_heads=16).ops
              if o.name == "customized").body
    assert launch._shared(fa) == {(1, 0), (2, 0)}            # K and V, over the query heads' grid dim
    tiled = retile(fa, (16, 2, 2), 2)                         # a prefill schedule: 128-row tiles, 128-key steps
    assert tiled is not None and launch._shared(tiled) == launch._shared(fa)
    packed = next(o for o in flash_attention(2, 8, 512, 256, 16, scale=0.25).ops if o.name == "customized").body
    assert launch._shared(packed) == set() and retile(packed, (16, 2, 8), 4) is None


def test_choose_on_cpu_is_the_graphs_own_schedule():
    bg = next(o for o in library.lora(16, 64, 64, 16, dtype="float32").ops if o.name == "customized").body
    cfg = launch.choose(bg, lambda c: None, [torch.randn(16, 64)])
    assert cfg == launch.default_config(bg)
    cands = launch.candidates(bg, n_sm=132)
    assert cands[0].grid == bg.grid and all(retile(bg, c.grid, c.forloop_range) is not None for c in cands)
    assert 2 <= len(cands) <= 22


def test_a_stored_launch_is_read_back_without_proposing_candidates(tmp_path, monkeypatch):
    """A warm compile finds :func:`launch.choose`'s stored winner by its name (its JSON) and never proposes the
    candidates; a name that no longer parses, or a config that does not tile the μGraph, is no answer; where the
    mask-scan round applies, both rounds must be stored."""
    from torch_mirage.cache import DiskCache

    bg = next(o for o in library.lora(16, 64, 64, 16, dtype="float32").ops if o.name == "customized").body
    cands = launch.candidates(bg, n_sm=132)
    cache, key = DiskCache(str(tmp_path)), "k" * 64
    assert launch.cached_launch(bg, cache, key) is None
    winner = cands[-1]
    cache.put_json(key, {"times": {launch._config_name(c): (1.0 if c == winner else 2.0 + i)
                                   for i, c in enumerate(cands)}})
    monkeypatch.setattr(launch, "proposed", lambda *a, **k: pytest.fail("proposed on a cache hit"))
    assert launch.cached_launch(bg, cache, key) == winner
    assert launch._cached_answer(bg, [torch.randn(16, 64)], cache, key) == winner    # no scan round for lora
    cache.put_json(key, {"times": {'{"grid": [1]': 1.0}})                               # not JSON any more
    assert launch.cached_launch(bg, cache, key) is None
    cache.put_json(key, {"times": {launch._config_name(dataclasses.replace(winner, grid=(3, 5, 7))): 1.0}})
    assert launch.cached_launch(bg, cache, key) is None                                  # does not tile bg


def test_candidates_include_more_programs_per_sm():
    """Weight streaming at small batch: besides the model's best picks, re-tilings with 2 and 4 programs per SM
    are timed (the model ranks them like 1 per SM)."""
    bg = next(o for o in library.gated_mlp(8, 4096, 4096, dtype="float16").ops if o.name == "customized").body
    cands = launch.candidates(bg, n_sm=132)
    programs = {math.prod(c.grid) * c.split for c in cands}
    assert any(p >= 2 * 132 for p in programs) and any(p >= 4 * 132 for p in programs)
    assert all(retile(bg, c.grid, c.forloop_range) is not None for c in cands)


def test_candidates_try_a_deep_pipeline_on_long_loops_only():
    """Streaming weights over a 64-step loop: the own schedule is also tried with DEEP_PIPELINE's stages; a
    re-tiling whose programs walk fewer than DEEP_LOOP steps is not (stages beyond the loop buy nothing)."""
    bg = next(o for o in library.gated_mlp(8, 4096, 4096, dtype="float16").ops if o.name == "customized").body
    cands = launch.candidates(bg, n_sm=132)
    deep = [c for c in cands if (c.num_warps, c.num_stages) == launch.DEEP_PIPELINE]
    assert any(c.grid == bg.grid and c.forloop_range == bg.forloop_range and c.split == 1 for c in deep)
    assert all(c.forloop_range // c.split >= launch.DEEP_LOOP for c in deep)
    short = [c for c in cands if c.forloop_range // c.split < launch.DEEP_LOOP]
    assert all((c.num_warps, c.num_stages) in launch.WARPS_STAGES for c in short)


@pytest.mark.parametrize("rows", [1, 8, 16])
def test_candidates_include_the_weight_streaming_schedule_for_decode(rows):
    """A decode GEMV (rows <= 16, K = N = 4096): one wave of programs over N (128 tiles of 32 columns on 132 SMs),
    no split and no combine, 16 steps of 256 along K, 4 warps / 5 stages — the probe's 14.2 µs schedule."""
    bg = next(o for o in library.rmsnorm_linear(rows, 4096, 4096, dtype="float16").ops if o.name == "customized").body
    cands = launch.candidates(bg, n_sm=132)
    stream = [c for c in cands if (c.num_warps, c.num_stages) == launch.STREAM_PIPELINE]
    assert stream == [launch.LaunchConfig((128,), 16, 1, *launch.STREAM_PIPELINE),
                      launch.LaunchConfig((128,), 16, 1, *launch.STREAM_PIPELINE, prologue=True),
                      launch.LaunchConfig((128,), 16, 1, *launch.STREAM_PIPELINE, prologue=True, sums_after=True)]
    assert retile(bg, stream[0].grid, stream[0].forloop_range) is not None
    gated = next(o for o in library.gated_mlp(rows, 4096, 4096, dtype="float16").ops if o.name == "customized").body
    assert not any(c.prologue for c in launch.candidates(gated, n_sm=132))   # no matmul-free accumulator there


@pytest.mark.parametrize("rows", [1, 3])
def test_weight_streaming_schedule_matches_eager(rows, tmp_path):
    """The streaming re-tiling (picked for a 12-SM device at interpreter-sized shapes) run in the interpreter."""
    m, k, n = rows, 256, 96
    g = library.rmsnorm_linear(m, k, n, dtype="float32")
    bg = next(o for o in g.ops if o.name == "customized").body
    stream = [c for c in launch.candidates(bg, n_sm=12) if (c.num_warps, c.num_stages) == launch.STREAM_PIPELINE]
    assert [(c.prologue, c.sums_after) for c in stream] == [(False, False), (True, False), (True, True)]
    xs = _inputs("rmsnorm_linear", (m, k, n), torch.float32, seed=2)
    want = library.WORKLOADS["rmsnorm_linear"].reference(*[x.double() for x in xs])
    for cfg in stream:
        assert cfg.split == 1 and math.prod(cfg.grid) <= 12 and cfg.forloop_range >= launch.DEEP_LOOP
        run = BlockLauncher(bg, cfg, [x.dim() for x in xs], str(tmp_path))
        # loop fission: the sum of squares walks K in a loop of its own (before the dot loop, or after it), the dot
        # loop holds no reduction
        assert run.source.count("for it in tl.range") == (2 if cfg.prologue else 1)
        if cfg.prologue:
            loops = run.source.split("for it in tl.range")[1:]
            assert ("in2_ptr" in loops[0]) == cfg.sums_after, run.source     # input 2: the weight
        (got,) = run(*xs)
        assert_close(got, want)


def test_streaming_pick_needs_one_wave_and_a_long_loop():
    """One wave of the most programs, at least DEEP_LOOP steps; of those the widest K tile whose weight tiles stay
    within STREAM_STAGE_BYTES per step: one weight of 32 x 256 (16 KiB), two weights (a gated MLP) of 32 x 128."""
    bg = next(o for o in library.rmsnorm_linear(2, 4096, 4096, dtype="float16").ops if o.name == "customized").body
    scored = [(1.0, (256,), 16, 1), (2.0, (64,), 32, 1), (3.0, (128,), 4, 1), (4.0, (128,), 32, 2)]
    assert launch.streaming_pick(bg, scored, n_sm=132) == ((64,), 32)
    assert launch.streaming_pick(bg, [(1.0, (128,), 4, 1)], n_sm=132) is None
    scored = launch._scored(bg, 132)
    assert launch.streaming_pick(bg, scored, n_sm=132) == ((128,), 16)
    gated = next(o for o in library.gated_mlp(8, 4096, 4096, dtype="float16").ops if o.name == "customized").body
    pick = launch.streaming_pick(gated, launch._scored(gated, 132), n_sm=132)
    assert pick == ((128,), 32)
    assert launch.streamed_bytes(retile(gated, *pick)) == launch.STREAM_STAGE_BYTES


def test_memory_plan_shares_only_disjoint_lifetimes():
    g = library.gqa_flashdecoding(2, 3, 5, 12, 7, dtype="float32", splits=3, forloop_range=2)
    xs = _inputs("gqa_flashdecoding", (2, 3, 5, 12, 7), torch.float32, seed=1)
    compiled = compile_ugraph(g, xs, tune=False)
    plan, size = compiled.plan, compiled.arena_bytes
    assert len(plan) == 3 and size > 0                        # M, L, O live in the arena; the output does not
    (got,) = compiled(*xs)
    _check("gqa_flashdecoding", got, xs, torch.float32)
    offsets = sorted(plan.values())
    assert len(set(offsets)) == 3 and all(o % 256 == 0 for o in offsets)


def test_run_steps_reruns_each_kernel_op_alone():
    """The profiling view: each step's ``fn`` re-run on its own inputs reproduces its outputs; the last step's
    output is the μGraph's."""
    g = library.gqa_flashdecoding(2, 3, 5, 12, 7, dtype="float32", splits=3, forloop_range=2)
    xs = _inputs("gqa_flashdecoding", (2, 3, 5, 12, 7), torch.float32, seed=2)
    compiled = compile_ugraph(g, xs, tune=False)
    runs = list(compiled.run_steps(xs))
    assert sum(r.config is not None for r in runs) == 2          # FlashDecoding: partials, then the combine
    for r in runs:
        again = r.fn(*r.inputs)
        assert all(torch.equal(a, b) for a, b in zip(again, r.outputs)), r.op
    _check("gqa_flashdecoding", runs[-1].outputs[0], xs, torch.float32)


def test_depth_order_is_topological():
    g = library.gqa_flashdecoding(1, 2, 4, 8, 4, dtype="float32", splits=2, forloop_range=2)
    order = order_by_depth(g, range(len(g.ops)))
    pos = {i: k for k, i in enumerate(order)}
    assert all(pos[r[0]] < pos[i] for i, op in enumerate(g.ops) for r in op.inputs)


def test_golden_source():
    """The generated source of a small RMSNorm+Linear kernel is stable (update: MIRAGE_UPDATE_GOLDEN=1)."""
    g = library.rmsnorm_linear(3, 15, 21, dtype="float16", grid=3, forloop_range=5)
    bg = next(o for o in g.ops if o.name == "customized").body
    source = module_source([emit_block_kernel(bg, [2, 1, 2], "rmsnorm_linear_kernel")])
    if os.environ.get("MIRAGE_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(source)
    assert source == GOLDEN.read_text(), "codegen changed: review the diff and rerun with MIRAGE_UPDATE_GOLDEN=1"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name,dims,sched", CASES, ids=IDS)
def test_tuned_kernels_on_gpu(name, dims, sched, dtype):
    g = library.WORKLOADS[name].build(*dims, dtype={**DT, torch.bfloat16: "bfloat16"}[dtype], **sched)
    xs = _inputs(name, dims, dtype, seed=5)
    (got,) = compile_ugraph(g, xs, limit=2)(*xs)
    want = library.WORKLOADS[name].reference(*[x.double() for x in xs])
    assert_close(got, want, dtype)



@pytest.mark.parametrize("name,dims,sched,cfg,finer", [s for s in SPLITS if s[3].split > 1],
                         ids=[f"{s[0]}-{'x'.join(map(str, s[1]))}" for s in SPLITS if s[3].split > 1])
def test_split_folded_by_the_last_program_matches_eager(name, dims, sched, cfg, finer, tmp_path):
    """``combine_in_kernel``: one kernel — each split program stores its states and counts its arrival, the tile's
    last folds them — equal to eager on two calls with fresh inputs (the counters are left at zero for the next)."""
    g = library.WORKLOADS[name].build(*dims, dtype="float16", **sched)
    (op,) = [o for o in g.ops if o.name == "customized"]
    cfg = dataclasses.replace(cfg, combine_in_kernel=True)
    xs = _inputs(name, dims, torch.float16, seed=11)
    run = BlockLauncher(op.body, cfg, [x.dim() for x in xs], str(tmp_path))
    assert run.combine_fn is None and run.kernel.counters == math.prod(cfg.grid)
    assert "tl.atomic_add(cnt_ptr" in run.source
    assert ("for chunk in tl.range(" in run.source) == (cfg.split > FOLD_UNROLLED)
    for seed in (11, 12):
        xs = _inputs(name, dims, torch.float16, seed=seed)
        (got,) = run(*xs)
        _check(name, got, xs, torch.float16)
        assert not run.counters(got.device)[0].any()

def _softcap_masked_reference(q, k, v, m, scale, cap):
    s = torch.tanh(q.double() @ k.double().transpose(-1, -2) * scale / cap) * cap + m.double()
    return torch.softmax(s, -1) @ v.double()


@pytest.mark.parametrize("split", [1, 2])
def test_attention_seed_with_tanh_and_mask_iterator_splits(split, tmp_path):
    """The soft-capped, masked FlashAttention seed (tanh lowered through sigmoid; a mask iterator walking KV next
    to K, shared by every head) run whole and split over KV with the codegen's combine."""
    from torch_mirage.superopt.attention_seeds import flash_attention

    b, hk, rows, skv, d = 1, 2, 8, 32, 16
    g = flash_attention(b, hk, rows, skv, d, scale=0.25, softcap=3.0, mask=(1, 1), dtype="float16",
                        mask_dtype="float32", q_blocks=2, forloop_range=4)
    (op,) = [o for o in g.ops if o.name == "customized"]
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(s, generator=gen).half() for s in ((b, hk, rows, d), (b, hk, skv, d), (b, hk, skv, d)))
    m = torch.zeros(1, 1, rows, skv)
    m[..., 16:] = -1e30                      # the second half of KV (one split) masked for every row
    run = BlockLauncher(op.body, LaunchConfig((hk, b, 2), 4, split), [4, 4, 4, 4], str(tmp_path))
    # scale and 1/softcap fold into tanh's argument (doubled for the interpreter's sigmoid form): one multiply
    assert f"tl.sigmoid(d9 * {2.0 * (0.25 * (1.0 / 3.0))!r})" in run.source, run.source
    assert (run.combine_fn is not None) == (split > 1)
    (got,) = run(q, k, v, m)
    assert_close(got, _softcap_masked_reference(q, k, v, m, 0.25, 3.0), torch.float16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("seed", ["flash_attention", "flash_decoding"])
def test_attention_seeds_tuned_on_gpu(seed, dtype):
    from torch_mirage.superopt.attention_seeds import SEEDS

    b, hk, rows, skv, d = 2, 8, 4 if seed == "flash_decoding" else 256, 4096, 128
    g = SEEDS[seed](b, hk, rows, skv, d, scale=d ** -0.5, softcap=50.0, mask=(1, 1),
                    dtype={torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype], mask_dtype="float32")
    q, k, v = (torch.randn(s, device="cuda", dtype=dtype) for s in ((b, hk, rows, d), (b, hk, skv, d), (b, hk, skv, d)))
    m = torch.zeros(1, 1, rows, skv, device="cuda")
    m[..., 3000:] = -1e30
    (got,) = compile_ugraph(g, [q, k, v, m], limit=2)(q, k, v, m)
    assert_close(got, _softcap_masked_reference(q, k, v, m, d ** -0.5, 50.0), dtype)


def test_a_config_with_nan_where_the_reference_has_numbers_disagrees():
    """A re-tiling that produces NaN (seen on an H100: split-KV attention with a fully masked split) must never
    pass the agreement check of ``launch.choose``; NaN where both have NaN (a fully masked row) still agrees."""
    want = torch.randn(8, 16)
    bad = want.clone()
    bad[3, 5] = float("nan")
    assert launch._disagreement(bad, want) == float("inf")
    assert launch._disagreement(want + 1e-7, want) < 1e-5
    both = want.clone()
    both[2] = float("nan")
    assert launch._disagreement(both, both.clone()) == 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_warmup_in_a_thread_compiles_the_launch_so_that_the_call_compiles_nothing(tmp_path):
    """BlockLauncher.warmup (the compile pool's job) compiles the kernel and the split's combine kernel for the
    call's arguments: the call after it finds both compiled (Triton's cache key matched) and is right."""
    import threading

    g = library.rmsnorm_linear(2, 512, 768, dtype="float16")
    op = next(o for o in g.ops if o.name == "customized")
    split = next(c for c in launch.candidates(op.body, torch.cuda.get_device_properties(0).multi_processor_count)
                 if c.split > 1)
    xs = _inputs("rmsnorm_linear", (2, 512, 768), torch.float16, seed=3)
    launcher = BlockLauncher(op.body, split, [x.dim() for x in xs], str(tmp_path))
    fns = [launcher.fn, launcher.combine_fn]
    if not all(hasattr(fn, "device_caches") for fn in fns):
        pytest.skip("this Triton keeps its kernels elsewhere")
    compiled = lambda: [len(fn.device_caches[torch.cuda.current_device()][0]) for fn in fns]   # noqa: E731
    before = compiled()
    worker = threading.Thread(target=launcher.warmup, args=xs)
    worker.start()
    worker.join()
    assert compiled() == [n + 1 for n in before]
    (got,) = launcher(*xs)
    assert compiled() == [n + 1 for n in before]          # nothing compiled again
    _check("rmsnorm_linear", got, xs, torch.float16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("split", [4, 16])
def test_split_folded_by_the_last_program_on_gpu(split):
    """The in-kernel fold at decode widths (2 x 4096 x 4096, 64 tiles x ``split`` programs, all resident at once):
    every one of 64 calls with fresh inputs — eager, then replayed in a CUDA graph — equals eager, so no tile folds
    before all its states are stored (the arrival counter's release / acquire) and the counters return to zero."""
    dims = (2, 4096, 4096)
    g = library.WORKLOADS["rmsnorm_linear"].build(*dims, dtype="float16", grid=64, forloop_range=64)
    (op,) = [o for o in g.ops if o.name == "customized"]
    xs = [x.cuda() for x in _inputs("rmsnorm_linear", dims, torch.float16, seed=5)]
    run = BlockLauncher(op.body, LaunchConfig((64,), 64, split, 4, 3, combine_in_kernel=True),
                        [x.dim() for x in xs], str(pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / "fold-gpu"))
    assert run.combine_fn is None
    out = run(*xs)[0]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(*xs, outs=[out])[0]
    gen = torch.Generator(device="cuda").manual_seed(split)
    for call in range(64):
        for x in xs:
            x.copy_(torch.randn(x.shape, generator=gen, device="cuda", dtype=torch.float32))
        if call % 2:
            graph.replay()
        else:
            run(*xs, outs=[out])
        torch.cuda.synchronize()
        _check("rmsnorm_linear", out, xs, torch.float16)
    assert not run.counters(out.device)[0].any()


@pytest.mark.parametrize("in_kernel", [False, True])
def test_split_states_store_and_read_only_their_valid_part(in_kernel, tmp_path):
    """Partial states with a padded dim (3 rows in a 16-row tile) are stored under a mask and read back under one
    (0 in the padding): the combine moves the valid bytes only."""
    g = library.WORKLOADS["rmsnorm_linear"].build(3, 15, 21, dtype="float16", grid=3, forloop_range=5)
    (op,) = [o for o in g.ops if o.name == "customized"]
    run = BlockLauncher(op.body, LaunchConfig((7,), 5, 5, combine_in_kernel=in_kernel), [2, 1, 2], str(tmp_path))
    stores = [ln for ln in run.source.splitlines() if "tl.store(ws" in ln]
    loads = [ln for ln in run.source.splitlines() if "tl.load(ws" in ln]
    assert stores and loads and all("mask=" in ln for ln in stores + loads), run.source
    assert all("other=0.0" in ln for ln in loads)


def test_outputs_written_into_given_tensors():
    """``CompiledUGraph(..., outs={i: t})``: a kernel's output goes into ``t`` with ``t``'s strides where ``t`` fits
    (shape, dtype, dense); otherwise the output comes back fresh. Either way the values are the μGraph's."""
    g = library.lora(16, 64, 32, 16, dtype="float32", grid=2, forloop_range=2)
    xs = [torch.randn(s) for s in ((16, 64), (64, 32), (64, 16), (16, 32))]
    compiled = compile_ugraph(g, xs, tune=False)
    (fresh,) = compiled(*xs)
    assert_close(fresh, library.lora_ref(*xs), torch.float32)
    transposed = torch.empty(32, 16).t()                               # (16, 32), column-major
    (got,) = compiled(*xs, outs={0: transposed})
    assert got is transposed and torch.equal(got, fresh)
    for unfit in (torch.empty(16, 32, dtype=torch.float64), torch.empty(1, 32).expand(16, 32)):
        (got,) = compiled(*xs, outs={0: unfit})
        assert got is not unfit and torch.equal(got, fresh)
