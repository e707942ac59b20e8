"""Launch-config sweep of one hand-built μGraph's kernel op: every re-tiling the launch tuner scores (not only
the few it times) × more (num_warps, num_stages) pairs than it tries, each timed replayed in a CUDA graph over
inputs rotated past L2, with the fraction of copy bandwidth its bytes reach. Says whether a better config
exists than the one the tuner picks, and how far from bandwidth the best one is.

    python benchmarks/ugraph_config_sweep.py --workload rmsnorm_linear --batches 1 8 --limit 8
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mirage_set_gpu import make_inputs, rel_error  # noqa: E402  (this directory)
from torch_mirage.superopt.launch import LaunchConfig, candidates, choose  # noqa: E402
from torch_mirage.timing import cuda_graph_time_us, rotated_input_sets  # noqa: E402
from torch_mirage.superopt import library  # noqa: E402
from torch_mirage.superopt.compile import BlockLauncher  # noqa: E402

PAIRS = ((2, 3), (4, 3), (4, 5), (8, 4), (8, 6))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", nargs="+", default=["rmsnorm_linear"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--extra", nargs="*", default=[], metavar="GRID:LOOP:SPLIT",
                   help="more re-tilings to time, e.g. 128:64:1 or 2x8x2:64:4 (grid dims joined by x, "
                        "forloop_range, split)")
    p.add_argument("--pairs", nargs="*", default=[], metavar="WARPS:STAGES",
                   help=f"(num_warps, num_stages) pairs (default: {' '.join(f'{w}:{s}' for w, s in PAIRS)})")
    args = p.parse_args()
    from torch_mirage.analysis.device import calibrate

    copy_bps = calibrate().measured_copy_bandwidth   # read + write bytes / s, measured now
    props = torch.cuda.get_device_properties(0)
    cache_dir = "/tmp/sweep-cache"
    for name in args.workload:
        for b in args.batches:
            dims = library.bench_dims(name, b)
            w = library.WORKLOADS[name]
            kg = w.build(*dims)
            xs = make_inputs(name, dims, torch.Generator(device="cuda").manual_seed(0))
            op = next(o for o in kg.ops if o.name == "customized")
            bg = op.body
            ranks = [x.dim() for x in xs]
            nbytes = sum(x.numel() * x.element_size() for x in xs)
            sets = rotated_input_sets(xs, props.L2_cache_size, max_sets=16)
            tilings = {(c.grid, c.forloop_range, c.split) for c in candidates(bg, props.multi_processor_count, args.limit)}
            tilings |= {(tuple(int(x) for x in g.split("x")), int(f), int(sp))
                        for g, f, sp in (e.split(":") for e in args.extra)}
            pairs = [tuple(int(v) for v in x.split(":")) for x in args.pairs] or PAIRS
            t0 = time.time()
            chosen = choose(bg, lambda cfg: BlockLauncher(bg, cfg, ranks, cache_dir), xs)
            rows, want = [], None
            for grid, f, s in sorted(tilings):
                for warps, stages in pairs:
                    cfg = LaunchConfig(grid, f, s, warps, stages)
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
