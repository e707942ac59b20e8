"""The hand-built Mirage set on one GPU: our compiled μGraphs against eager and Inductor.

For each workload of ``torch_mirage.superopt.library`` at DESIGN.md's shapes (fp16, b = 1 and 8): build
the μGraph, compile it (``compile_ugraph``: generated Triton, launch parameters timed on the device),
check its output against an fp64 reference (relative norm error < 1e-2), then time µs per call of

* ``mirage``: the compiled μGraph,
* ``eager``: the PyTorch program,
* ``inductor``: ``torch.compile(ref)``,
* ``max_autotune``: ``torch.compile(ref, mode="max-autotune-no-cudagraphs")``,

each captured in one CUDA graph over input sets rotated past 3× L2
(``torch_mirage.runtime.measure``). Prints a table; writes ``$OUT/mirage_set.json`` when ``$OUT`` is set.

With ``--profile`` each row also gets ``steps``: every kernel-level op of the compiled μGraph timed alone the
same way, with the bytes it reads and writes and the fraction of the measured copy bandwidth that is; and the
run records the time of one minimal kernel in a CUDA graph (``launch_floor_us``). Together they say where a
μGraph's time goes: which op, how far from bandwidth, how many launches.

    python benchmarks/mirage_set_gpu.py [--batches 1 8] [--only gqa_flashdecoding ...] [--no-max-autotune] [--profile]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch_mirage.cache import DiskCache  # noqa: E402
from torch_mirage.timing import cuda_graph_time_us, rotated_input_sets  # noqa: E402
from torch_mirage.superopt import library  # noqa: E402
from torch_mirage.numerics import relative_error, tolerance  # noqa: E402
from torch_mirage.superopt.compile import compile_ugraph  # noqa: E402

# issue 4's targets, µs per call (b = 1 and 8 alike); gqa's holds for both attention μGraphs
TARGETS = {"rmsnorm_linear": 13.0, "gated_mlp": 26.0, "lora": 4.0, "gqa_flashdecoding": 12.0,
           "gqa_flashattention": 12.0, "qknorm_attention": 14.0, "ntrans": 2.0}
REL_TOL = tolerance(torch.float16)
rel_error = relative_error


def make_inputs(name: str, dims: tuple, gen: torch.Generator) -> list[torch.Tensor]:
    shapes = library.WORKLOADS[name].input_shapes(*dims)
    xs = [torch.randn(s, generator=gen, device="cuda", dtype=torch.float32) for s in shapes]
    if name in ("rmsnorm_linear", "gated_mlp", "lora"):      # weights scaled like a trained layer's
        xs = [x if i == 0 or x.dim() == 1 else x / x.shape[0] ** 0.5 for i, x in enumerate(xs)]
    return [x.half() for x in xs]


def device_floors() -> dict:
    """Copy bandwidth (read + write bytes) and one minimal kernel's time inside a CUDA graph, measured now."""
    from torch_mirage.analysis.device import calibrate

    model = calibrate()
    return {"copy_GBps": round(model.measured_copy_bandwidth / 1e9, 1),
            "launch_floor_us": round(model.kernel_overhead_s * 1e6, 2)}


def profile_steps(ours, xs: list[torch.Tensor], copy_gbps: float) -> list[dict]:
    """Every kernel-level op of the compiled μGraph alone: µs (CUDA graph, inputs rotated past L2), bytes, GB/s."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    steps = []
    for run in ours.run_steps(xs):
        tensors = [t for t in run.inputs + run.outputs if isinstance(t, torch.Tensor)]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        us = cuda_graph_time_us(run.fn, rotated_input_sets(run.inputs, l2))
        steps.append({"index": run.index, "op": run.op, "config": run.config.to_json() if run.config else None,
                      "us": round(us, 2), "bytes": nbytes, "GBps": round(nbytes / us / 1e3, 1),
                      "copy_fraction": round(nbytes / us / 1e3 / copy_gbps, 3)})
    return steps


def bench_one(name: str, b: int, modes: list[str], cache: DiskCache, limit: int, compiled_refs: dict,
              floors: dict | None = None) -> dict:
    w = library.WORKLOADS[name]
    dims = library.bench_dims(name, b)
    gen = torch.Generator(device="cuda").manual_seed(1000 * b + len(name))
    xs = make_inputs(name, dims, gen)
    row: dict = {"workload": name, "b": b, "dims": list(dims), "target_us": TARGETS[name]}
    t0 = time.perf_counter()
    graph = w.build(*dims, dtype="float16")
    ours = compile_ugraph(graph, xs, cache=cache, limit=limit)
    torch.cuda.synchronize()
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    row["configs"] = [c.to_json() for c in ours.configs]
    ref64 = w.reference(*[x.double() for x in xs])
    row["rel_error"] = rel_error(ours(*xs)[0], ref64)
    row["eager_rel_error"] = rel_error(w.reference(*xs), ref64)
    row["correct"] = row["rel_error"] < REL_TOL
    del ref64
    sets = rotated_input_sets(xs, torch.cuda.get_device_properties(0).L2_cache_size)
    fns = {"mirage": ours, "eager": w.reference}
    for mode in modes:
        key = (w.reference, tuple(dims), mode)
        if key not in compiled_refs:
            compiled_refs[key] = torch.compile(w.reference, mode=None if mode == "inductor" else
                                               "max-autotune-no-cudagraphs", dynamic=False)
        fns[mode] = compiled_refs[key]
    for mode, fn in fns.items():
        try:
            row[f"{mode}_us"] = round(cuda_graph_time_us(fn, sets), 2)
        except Exception as e:       # a mode that fails is reported, the others still run
            row[f"{mode}_us"] = None
            row[f"{mode}_error"] = f"{type(e).__name__}: {e}"[:300]
    if floors is not None:
        row["steps"] = profile_steps(ours, xs, floors["copy_GBps"])
        row["steps_sum_us"] = round(sum(st["us"] for st in row["steps"]), 2)
    inductor = [row.get(f"{m}_us") for m in modes if row.get(f"{m}_us") is not None]
    row["best_inductor_us"] = min(inductor) if inductor else None
    us = row["mirage_us"]
    row["meets_target"] = bool(row["correct"] and us is not None and us <= TARGETS[name])
    row["over_target_us"] = None if us is None else round(max(0.0, us - TARGETS[name]), 2)
    return row


def print_table(rows: list[dict]) -> None:
    cols = ["workload", "b", "mirage_us", "eager_us", "inductor_us", "max_autotune_us", "target_us",
            "meets_target", "rel_error", "compile_s"]
    print(" | ".join(f"{c:>16}" for c in cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append(f"{v:>16.2e}" if c == "rel_error" and v is not None else f"{str(v):>16}")
        print(" | ".join(cells))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--only", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    p.add_argument("--no-max-autotune", action="store_true", help="skip torch.compile max-autotune (slow to compile)")
    p.add_argument("--limit", type=int, default=3, help="re-tilings timed per kernel op (each x 2 warp/stage pairs)")
    p.add_argument("--profile", action="store_true", help="time every kernel-level op of each μGraph alone")
    p.add_argument("--cache-dir", default=os.environ.get("MIRAGE_CACHE_DIR", "/tmp/mirage-bench-cache"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("mirage_set_gpu: needs a CUDA GPU", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)
    # every launch config tried, its time or why it was dropped: the log says why a config was chosen
    logging.getLogger("torch_mirage").setLevel(logging.INFO)
    torch._dynamo.config.cache_size_limit = 64
    modes = ["inductor"] + ([] if args.no_max_autotune else ["max_autotune"])
    cache = DiskCache(args.cache_dir, "ugraph-launch")
    start = time.perf_counter()
    rows, compiled_refs = [], {}
    floors = device_floors() if args.profile else None
    if floors:
        print(json.dumps(floors), flush=True)
    for b in args.batches:
        for name in args.only:
            try:
                row = bench_one(name, b, modes, cache, args.limit, compiled_refs, floors)
            except Exception as e:
                row = {"workload": name, "b": b, "error": f"{type(e).__name__}: {e}"[:500]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print_table(rows)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "wall_s": round(time.perf_counter() - start, 1),
              **(floors or {}), "rows": rows}
    print(f"total {result['wall_s']} s")
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "mirage_set.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all(r.get("correct") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
