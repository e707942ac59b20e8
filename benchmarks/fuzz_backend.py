"""Differential fuzz of the backend (on the CPU, or a GPU with --device cuda): random small transformer-like programs
(:mod:`torch_mirage.testing.random_programs`) compiled with ``backend="mirage"`` (kernels in Triton's
interpreter, every region kept whatever its size and none handed back by timing: ``min_region_us=0``,
``measure_regions=False``) and compared with the same program in
float64. A program whose error is both above ``--tol`` (5e-3 at least where the program rounds to fp16 on the way)
and more than ``--ratio`` times eager's own (in the same dtype) is a mismatch: its source, errors and regions are printed. Prints which claimers ran how often.

    python benchmarks/fuzz_backend.py [--seeds 0:50] [--kind chains|attention|decode] [--dtype float32] [--device cpu]
        [--out FILE]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

if "--device" not in sys.argv or sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before anything defines a Triton kernel
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from torch_mirage.backend import MirageBackend  # noqa: E402
from torch_mirage.report import Report  # noqa: E402
from torch_mirage.testing.random_programs import check, draw, draw_attention, draw_decode, tolerance  # noqa: E402


def fuzz_one(seed: int, dtype: torch.dtype, tol: float | None, ratio: float, options: dict, device: str = "cpu",
             kind: str = "chains") -> dict:
    prog = {"chains": draw, "attention": draw_attention, "decode": draw_decode}[kind](seed)
    report = Report()

    def compile_fn(fn):
        torch._dynamo.reset()
        return torch.compile(fn, backend=MirageBackend(dict(options), report=report), fullgraph=True)

    try:
        got = check(prog, compile_fn, dtype, device)
    except Exception as e:   # a crash is a finding too: the backend should fall back, not raise
        return {"seed": seed, "status": "raised", "error": f"{type(e).__name__}: {e}"[:500], "source": prog.source()}
    finally:
        torch._dynamo.reset()
    tol = tolerance(prog, dtype, tol)
    # NaN (a NaN where float64 has none, or the reverse) is never within tolerance
    bad = [i for i, (e, ref) in enumerate(zip(got["errors"], got["eager_errors"])) if not (e <= tol or e <= ratio * ref)]
    regions = [(r.compiled_by, r.claimer) for g in report.graphs for r in g.regions]
    return {"seed": seed, "status": "mismatch" if bad else "ok", **got, "regions": regions,
            "source": prog.source() if bad else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0:30", help="start:stop")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device", default="cpu", help="cuda: real Triton kernels (in CUDA graphs), bf16 allowed (the "
                   "interpreter gets bf16 wrong)")
    p.add_argument("--tol", type=float, default=None, help="default: random_programs.tolerance (1e-4 fp32, 5e-3 fp16, 2e-2 bf16)")
    p.add_argument("--ratio", type=float, default=20.0)
    p.add_argument("--kind", default="chains", choices=["chains", "attention", "decode"],
                   help="chains of elementwise / norm / matmul ops, attention calls, or decode steps of a layer "
                        "with a static KV cache")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    start, stop = map(int, args.seeds.split(":"))
    results, claimers = [], collections.Counter()
    t0 = time.perf_counter()
    for seed in range(start, stop):
        # every region kept, none handed back to Inductor by timing: mirage's own kernels are what is tested
        options = {"min_region_us": 0.0, "cache": False, "measure_regions": False}
        r = fuzz_one(seed, dtype, args.tol, args.ratio, options, args.device, args.kind)
        results.append(r)
        claimers.update(f"{by}:{c}" for by, c in r.get("regions", []) if by == "mirage")
        worst = max(r.get("errors") or [0.0])
        print(f"seed {seed:4d} {r['status']:8s} worst err {worst:.2e}", flush=True)
        if r["status"] != "ok":
            print("  " + (r.get("error") or f"errors {r['errors']} eager {r['eager_errors']}"))
            print("  " + r["source"].replace("\n", "\n  "))
            print(f"  regions {r.get('regions')}")
    bad = [r for r in results if r["status"] != "ok"]
    print(f"{len(results)} programs in {time.perf_counter() - t0:.0f} s: {len(bad)} not ok; mirage regions by "
          f"claimer: {dict(claimers)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"dtype": args.dtype, "device": args.device, "kind": args.kind, "tol": args.tol, "ratio": args.ratio, "torch": torch.__version__,
                       "results": results, "claimers": dict(claimers)}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
