"""Launch-config sweep of one hand-built μGraph's kernel op: every re-tiling the launch tuner scores (not only
the few it times) × more (num_warps, num_stages) pairs than it tries, each timed replayed in a CUDA graph over
inputs rotated past L2, with the fraction of copy bandwidth its bytes reach. Says whether a better config
exists than the one the tuner picks, and how far from bandwidth the best one is.

With ``--seed`` the μGraph is the weight-streaming seed (``superopt/gemv_seed.py``) of the bench workload's program
(``torch_mirage.bench.workloads``, bf16 by default; ``rmsnorm_linear_t`` is rmsnorm_linear with nn.Linear's (n, k)
weight), its candidates :func:`streaming_candidates` plus the ``--extra`` re-tilings, each with and without the
norm's loop of its own (``prologue``) where the kernel has one; ``--gain-on-weights`` the seed form with the norm's gain
on the weight tiles.

    python benchmarks/ugraph_config_sweep.py --workload rmsnorm_linear --batches 1 8 --limit 8
    python benchmarks/ugraph_config_sweep.py --seed --workload rmsnorm_linear gated_mlp --extra 128:16:1 --pairs 4:5
    python benchmarks/ugraph_config_sweep.py --seed --halves --workload rmsnorm_rope_q_t --batches 1
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mirage_set_gpu import make_inputs, rel_error  # noqa: E402  (this directory)
from torch_mirage.bench import workloads  # noqa: E402
from torch_mirage.capture.lower import trace  # noqa: E402
from torch_mirage.codegen.ugraph_triton import prologue_accumulators  # noqa: E402
from torch_mirage.numerics import rms_norm  # noqa: E402
from torch_mirage.superopt.gemv_seed import gemv_seed  # noqa: E402
from torch_mirage.superopt.launch import LaunchConfig, candidates, choose, streaming_candidates  # noqa: E402
from torch_mirage.superopt.search.reference import reference_of  # noqa: E402
from torch_mirage.timing import cuda_graph_time_us, rotated_input_sets  # noqa: E402
from torch_mirage.superopt import library  # noqa: E402
from torch_mirage.superopt.compile import BlockLauncher, op_arguments  # noqa: E402

PAIRS = ((2, 3), (4, 3), (4, 5), (8, 4), (8, 6))


def _qkv_rope(x, cos, sin, g, wq, wk, wv):
    h = rms_norm(x, 1e-5, g)
    heads = [F.linear(h, w).view(x.shape[0], 1, -1, 128).transpose(1, 2) for w in (wq, wk, wv)]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return _rope(heads[0], cos, sin), _rope(heads[1], cos, sin), heads[2]


def _rope(q, cos, sin):
    half = q.shape[-1] // 2
    return q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin


# --seed programs beyond the bench's: (bench workload whose inputs they take, which of those, program)
SEED_VARIANTS = {
    "rmsnorm_linear_t": ("rmsnorm_linear", (0, 1, 2), lambda x, g, w: F.linear(rms_norm(x, weight=g), w)),
    "linear": ("rmsnorm_linear", (0, 2), lambda x, w: x @ w),
    "linear_t": ("rmsnorm_linear", (0, 2), lambda x, w: F.linear(x, w)),
    "gated_mlp_llama8b_t": ("gated_mlp_llama8b", (0, 1, 2), lambda x, w1, w3: F.silu(F.linear(x, w1)) * F.linear(x, w3)),
    # Llama's post-attention norm + gate / up (the gain: an input of EXTRA_INPUTS)
    "rmsnorm_gated_mlp_t": ("gated_mlp_llama8b", (0, 1, 2),
                            lambda x, w1, w3, g: (lambda h: F.silu(F.linear(h, w1)) * F.linear(h, w3))(rms_norm(x, weight=g))),
    # Llama's input norm + q projection + RoPE (HF's rotate_half over 32 heads of 128; cos / sin: EXTRA_INPUTS)
    "rmsnorm_rope_q_t": ("rmsnorm_linear", (0, 1, 2), lambda x, g, w, cos, sin: _rope(
        F.linear(rms_norm(x, weight=g), w).view(x.shape[0], 1, -1, 128).transpose(1, 2), cos, sin)),
    # llama_layer_decode's QKV region: input norm, q / k / v projections, RoPE on q and k (kernel ops: --op)
    "rmsnorm_rope_qkv_t": ("llama_layer_decode", (0, 1, 2, 7, 8, 9, 10), _qkv_rope),
}


# inputs appended to a SEED_VARIANTS program's (from its first input and the dtype): a norm gain, RoPE's cos / sin
EXTRA_INPUTS = {
    "rmsnorm_gated_mlp_t": lambda x, dt: [1 + 0.1 * torch.randn(x.shape[-1], device="cuda", dtype=dt)],
    "rmsnorm_rope_q_t": lambda x, dt: [torch.randn(128, device="cuda", dtype=dt).cos(),
                                       torch.randn(128, device="cuda", dtype=dt).sin()],
}


def seed_case(name: str, batch: int, dtype: torch.dtype, gains_on_weights: bool = False, halves: bool = False,
              op_index: int = 0):
    """(block graph, its inputs on the GPU, propose) of the weight-streaming seed of bench workload ``name`` or of
    a :data:`SEED_VARIANTS` program (``_t``: the weight stored (n, k), nn.Linear's layout); ``gains_on_weights``:
    the seed form with the norm's gain on the weight tiles; ``halves``: RoPE's heads in paired halves; ``op_index``:
    which of the seed's kernel ops (customized ops in graph order)."""
    base, keep, fn = SEED_VARIANTS.get(name, (name, None, None))
    wl = workloads.WORKLOADS[base]
    xs = wl.make_inputs(batch, dtype, "cuda", 0)
    if keep is not None:
        xs = [xs[i] for i in keep]
    else:
        fn = wl.fn
    if name.endswith("_t") and base != "llama_layer_decode":      # the square (k, n) weight stored transposed
        xs = [x.t().contiguous() if i > 0 and x.dim() == 2 else x for i, x in enumerate(xs)]
    if name in EXTRA_INPUTS:
        xs += EXTRA_INPUTS[name](xs[0], dtype)
    graph = trace(fn, [x.cpu() for x in xs])
    ref = reference_of(graph.nodes, graph)
    kg = gemv_seed(ref.graph, gains_on_weights=gains_on_weights, halves=halves)
    op = [o for o in kg.ops if o.name == "customized"][op_index]
    pos = {id(v): i for i, v in enumerate(graph.inputs)}
    ins = [xs[pos[id(v)]] for v in ref.inputs]
    return op.body, op_arguments(kg, op, ins), streaming_candidates


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", nargs="+", default=["rmsnorm_linear"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--extra", nargs="*", default=[], metavar="GRID:LOOP:SPLIT",
                   help="more re-tilings to time, e.g. 128:64:1 or 2x8x2:64:4 (grid dims joined by x, "
                        "forloop_range, split)")
    p.add_argument("--seed", action="store_true", help="the weight-streaming seed of the bench workload")
    p.add_argument("--dtype", default="bfloat16", help="--seed: the inputs' dtype")
    p.add_argument("--gain-on-weights", action="store_true", help="--seed: the form with the gain on the weight tiles")
    p.add_argument("--halves", action="store_true", help="--seed: RoPE's heads in paired halves (one row)")
    p.add_argument("--fold", action="store_true", help="time each split also folded in-kernel (combine_in_kernel)")
    p.add_argument("--op", type=int, default=0, help="--seed: which kernel op of the seed (0: the first)")
    p.add_argument("--only-extra", action="store_true", help="time the --extra re-tilings only (no candidates)")
    p.add_argument("--pairs", nargs="*", default=[], metavar="WARPS:STAGES",
                   help=f"(num_warps, num_stages) pairs (default: {' '.join(f'{w}:{s}' for w, s in PAIRS)})")
    args = p.parse_args()
    from torch_mirage.analysis.device import calibrate

    copy_bps = calibrate().measured_copy_bandwidth   # read + write bytes / s, measured now
    props = torch.cuda.get_device_properties(0)
    cache_dir = "/tmp/sweep-cache"
    for name in args.workload:
        for b in args.batches:
            if args.seed:
                dims = (name, b)
                bg, xs, propose = seed_case(name, b, getattr(torch, args.dtype), args.gain_on_weights, args.halves,
                                               args.op)
            else:
                dims = library.bench_dims(name, b)
                kg = library.WORKLOADS[name].build(*dims)
                xs = make_inputs(name, dims, torch.Generator(device="cuda").manual_seed(0))
                bg, propose = next(o for o in kg.ops if o.name == "customized").body, candidates
            ranks = [x.dim() for x in xs]
            nbytes = sum(x.numel() * x.element_size() for x in xs)
            sets = rotated_input_sets(xs, props.L2_cache_size, max_sets=16)
            proposed = [] if args.only_extra else propose(bg, props.multi_processor_count, args.limit)
            tilings = {(tuple(int(x) for x in g.split("x")), int(f), int(sp))
                       for g, f, sp in (e.split(":") for e in args.extra)}
            if not args.seed:
                tilings |= {(c.grid, c.forloop_range, c.split) for c in proposed}
            pairs = [tuple(int(v) for v in x.split(":")) for x in args.pairs] or PAIRS
            fission = (False, True) if prologue_accumulators(bg) else (False,)
            configs = [LaunchConfig(grid, f, s, warps, stages, pro) for grid, f, s in sorted(tilings)
                       for warps, stages in pairs for pro in fission]
            configs = list(dict.fromkeys(configs + (proposed if args.seed else [])))
            if args.fold:
                configs = list(dict.fromkeys(configs + [dataclasses.replace(c, combine_in_kernel=True)
                                                        for c in configs if c.split > 1]))
            t0 = time.time()
            chosen = None if args.only_extra else choose(bg, lambda cfg: BlockLauncher(bg, cfg, ranks, cache_dir), xs,
                                                         propose=propose)
            rows, want = [], None
            for cfg in configs:
                try:
                    run = BlockLauncher(bg, cfg, ranks, cache_dir)
                    out = run(*xs)[0]
                    if want is None:
                        want = out.clone()
                    err = rel_error(out, want.double())
                    us = cuda_graph_time_us(run, sets, replays=10, repeats=3)
                except Exception as e:
                    print(f"  {cfg}: failed ({type(e).__name__}: {str(e)[:100]})")
                    continue
                print(f"  {name} b={b} {us:8.2f} µs  {cfg}")
                rows.append((us, cfg, err))
            rows.sort(key=lambda r: r[0])
            print(f"== {name} b={b} dims {dims}: {len(rows)} configs in {time.time() - t0:.0f} s; "
                  f"tuner's choice {chosen}; bytes {nbytes / 1e6:.1f} MB")
            for us, cfg, err in rows[: args.top]:
                mark = " <- tuner" if cfg == chosen else ""
                print(f"  {us:8.2f} µs  {nbytes / (us * 1e-6) / copy_bps:5.2f} of copy  err {err:.1e}  {cfg}{mark}")
            got = next((r for r in rows if r[1] == chosen), None)
            if got:
                print(f"  tuner's choice: {got[0]:.2f} µs (rank {rows.index(got) + 1} of {len(rows)})")


if __name__ == "__main__":
    main()
