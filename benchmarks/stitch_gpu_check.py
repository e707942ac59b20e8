"""Stitch kernels on a CUDA GPU: numerics against fp64 eager (fp16 / bf16 / fp32) and µs per call against Inductor.

    PYTHONPATH=. python benchmarks/stitch_gpu_check.py [--quick]

Timing: ``triton.testing.do_bench`` (median, no CUDA graph, L2 flushed between calls) of the stitch region's
launcher against ``torch.compile(fn)`` (Inductor default) on the same inputs. The project's CUDA-graph benchmark
harness is the reference for published numbers; this script checks the kernels and gives a first comparison.
Every timing row reports GB/s (inputs read once + output written once) for both, and the fraction of the copy
ceiling, measured here with a 2 GiB device-to-device copy (read + write bytes). The long-row rows cover the
looped strategy (4096 rows) and task splitting (1 and 8 rows).
Writes ``$OUT/stitch_gpu_check.json`` when ``OUT`` is set. Exit status 1 when a numerics check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from torch_mirage.config import load  # noqa: E402
from torch_mirage.context import CompileContext  # noqa: E402
from torch_mirage.numerics import relative_error, tolerance  # noqa: E402
from torch_mirage.build import built_regions  # noqa: E402
from torch_mirage.partition.stitch import StitchClaimer  # noqa: E402
from torch_mirage.testing.aten import trace_ir  # noqa: E402
from torch_mirage.testing.functions import (bert_softmax, bias_gelu, bias_residual_layernorm, layer_norm,  # noqa: E402
                                            padding_mask, rmsnorm, softmax)


def workloads(b: int, dtype: torch.dtype, dev: str):
    r = lambda *s: torch.randn(*s, dtype=dtype, device=dev)
    return {
        "bias_residual_layernorm": (bias_residual_layernorm, (r(4096 * b, 768), r(768), r(4096 * b, 768), r(768), r(768))),
        "bert_softmax": (bert_softmax, (r(b, 12, 512, 512), padding_mask(b, 512, dtype, dev))),
        "bias_gelu": (bias_gelu, (r(512 * b, 3072), r(3072))),
    }


def extra_workloads(dtype: torch.dtype, dev: str):
    r = lambda *s: torch.randn(*s, dtype=dtype, device=dev)
    return {
        "softmax_long_rows": (softmax, (r(4096, 32768),)),
        "layer_norm_long_rows": (layer_norm, (r(4096, 32768), r(32768), r(32768))),
        "rmsnorm": (rmsnorm, (r(8 * 4096, 4096), r(4096))),
        "softmax_odd": (softmax, (r(4097, 33),)),
        "softmax_one_long_row": (softmax, (r(1, 65536),)),
        "layer_norm_one_long_row": (layer_norm, (r(1, 65536), r(65536), r(65536))),
        "softmax_8_long_rows": (softmax, (r(8, 32768),)),
        "layer_norm_8_long_rows": (layer_norm, (r(8, 32768), r(32768), r(32768))),
        "rmsnorm_8_long_rows": (rmsnorm, (r(8, 32768), r(32768))),
    }


LONG_ROWS = ("softmax_long_rows", "layer_norm_long_rows", "softmax_one_long_row", "layer_norm_one_long_row",
             "softmax_8_long_rows", "layer_norm_8_long_rows", "rmsnorm_8_long_rows")


def copy_gbps(do_bench) -> float:
    """The copy ceiling: a 2 GiB device-to-device copy, bytes read + written per second."""
    src = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    t_ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    del src, dst
    return 2 * 2 ** 30 / t_ms / 1e6


def stitched(fn, inputs, cache_dir, limits=None):
    graph = trace_ir(fn, *inputs)
    options = {"min_region_us": 0.0, **({} if cache_dir is None else {"cache_dir": cache_dir})}   # every size
    ctx = CompileContext.standalone(load(options))
    regions = built_regions(StitchClaimer(limits=limits).claim(graph, list(graph.nodes), ctx), graph, ctx, "stitch")
    if len(regions) != 1 or len(regions[0].nodes) != len(graph.nodes):
        raise RuntimeError(f"expected one region over the graph, got {[r.ops for r in regions]}")
    region = regions[0]
    shapes = [(tuple(v.meta.shape), v.meta.stride) for v in graph.inputs]
    if shapes != [(tuple(t.shape), t.stride()) for t in inputs]:
        raise RuntimeError("graph inputs are not in argument order")
    by_value = {id(v): t for v, t in zip(graph.inputs, inputs)}
    args = [by_value[id(v)] for v in region.inputs]
    return region, (lambda: region.kernel(*args)[0])


def rel_error(out, ref):
    """(relative error over the reference's finite elements, NaN in the same places)."""
    return relative_error(out, ref, where=ref), torch.equal(torch.isnan(out), torch.isnan(ref))


def long_row_sweep(do_bench, copy_gbps: float, cache_dir: str, on_chip_only: bool = False) -> list[dict]:
    """The long-row kernels (4096 x 32768 fp16) at the default mapping, looped at every chunk size and warp count
    (skipped with ``on_chip_only``), and whole rows on chip at 8 / 16 / 32 warps: which mapping is best."""
    from torch_mirage.codegen.stitch_plan import StitchLimits

    rows = []
    cases = {k: v for k, v in extra_workloads(torch.float16, "cuda").items()
             if k in ("softmax_long_rows", "layer_norm_long_rows")}
    for name, (fn, inputs) in cases.items():
        limits = [("looped", chunk, warps, StitchLimits(loop_chunk=chunk, loop_warps=warps))
                  for chunk in (1024, 2048, 4096, 8192) for warps in (4, 8, 16)] if not on_chip_only else []
        limits.insert(0, ("default", None, None, StitchLimits()))
        limits += [("on chip", 32768, warps, StitchLimits(max_row_on_chip=32768, row_warps=warps,
                                                                  on_chip_bytes=1 << 20))
                   for warps in (8, 16, 32)]
        for kind, chunk, warps, lim in limits:
            row = {"workload": name, "kind": kind, "chunk": chunk, "warps": warps}
            try:
                region, run = stitched(fn, inputs, cache_dir, lim)
                out = run()
                ref = fn(*[t.double() for t in inputs]).to(out.dtype)
                t = do_bench(run, return_mode="median") * 1e3
                nbytes = sum(x.numel() * x.element_size() for x in inputs) + inputs[0].numel() * 2
                row.update({"us": round(t, 2), "copy_fraction": round(nbytes / t / 1e3 / copy_gbps, 3),
                            "rel_error": rel_error(out, ref)[0], "mapping": region.info["thread_mapping"]})
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            print("sweep", json.dumps(row))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="numerics only at b=1, no extra workloads")
    ap.add_argument("--sweep", action="store_true", help="only the long-row mapping sweep")
    opts = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    import triton
    from triton.testing import do_bench

    dev = "cuda"
    cache_dir = tempfile.mkdtemp(prefix="mirage-stitch-")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "numerics": [], "timing_us": []}
    failed = False
    torch.manual_seed(0)
    results["copy_GBps"] = round(copy_gbps(do_bench), 1)
    print(f"copy ceiling: {results['copy_GBps']} GB/s")
    if opts.sweep:
        results["long_row_sweep"] = long_row_sweep(do_bench, results["copy_GBps"], cache_dir,
                                                   on_chip_only=os.environ.get("ON_CHIP_ONLY") == "1")
        _write(results, "stitch_sweep.json")
        return 0
    # numerics, every dtype
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        cases = dict(workloads(1, dtype, dev))
        if not opts.quick:
            cases.update(extra_workloads(dtype, dev))
        for name, (fn, inputs) in cases.items():
            try:
                region, run = stitched(fn, inputs, cache_dir)
                out = run()
                ref = fn(*[t.double() for t in inputs]).to(dtype)
                err, same_nan = rel_error(out, ref)
                ok = same_nan and err <= tolerance(dtype)
                row = {"workload": name, "dtype": str(dtype), "rel_error": err, "nan_match": same_nan, "ok": ok,
                       "mapping": region.info["thread_mapping"]}
            except Exception as e:  # report and go on
                row = {"workload": name, "dtype": str(dtype), "ok": False, "error": f"{type(e).__name__}: {e}"}
            failed |= not row["ok"]
            results["numerics"].append(row)
            print(("ok  " if row["ok"] else "FAIL"), json.dumps(row))
    # timing, fp16
    batches = (1,) if opts.quick else (1, 8)
    for b in batches:
        cases = dict(workloads(b, torch.float16, dev))
        if b == 1 and not opts.quick:
            cases.update({k: v for k, v in extra_workloads(torch.float16, dev).items() if k in LONG_ROWS})
        for name, (fn, inputs) in cases.items():
            try:
                region, run = stitched(fn, inputs, cache_dir)
                torch._dynamo.reset()
                ind = torch.compile(fn)
                ind(*inputs)
                t_mirage = do_bench(run, return_mode="median") * 1e3
                t_inductor = do_bench(lambda: ind(*inputs), return_mode="median") * 1e3
                out = run()
                nbytes = sum(t.numel() * t.element_size() for t in inputs) + out.numel() * out.element_size()
                gbps = nbytes / t_mirage / 1e3
                row = {"workload": name, "b": b, "mirage_us": round(t_mirage, 2), "inductor_us": round(t_inductor, 2),
                       "speedup": round(t_inductor / t_mirage, 3), "mirage_GBps": round(gbps, 1),
                       "inductor_GBps": round(nbytes / t_inductor / 1e3, 1),
                       "copy_fraction": round(gbps / results["copy_GBps"], 3),
                       "inductor_copy_fraction": round(nbytes / t_inductor / 1e3 / results["copy_GBps"], 3),
                       "mapping": region.info["thread_mapping"]}
            except Exception as e:
                row = {"workload": name, "b": b, "error": f"{type(e).__name__}: {e}"}
            results["timing_us"].append(row)
            print(json.dumps(row))
    if not opts.quick:
        results["long_row_sweep"] = long_row_sweep(do_bench, results["copy_GBps"], cache_dir)
    _write(results, "stitch_gpu_check.json")
    return 1 if failed else 0


def _write(results: dict, name: str) -> None:
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
