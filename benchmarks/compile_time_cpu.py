"""Compile time of generated μGraph kernels, measured on a CPU: Triton compiles each launch's kernel for an sm_90
target (to a cubin, nothing run) the way a GPU compile would, so the seconds a launch candidate adds to a
user's first call can be found and cut without a GPU.

Cases (Llama-3-8B decode shapes, bf16):

- ``decode-attention``: FlashAttention over a 4096-slot KV cache, 8 KV heads x 4 packed query rows, d 128, at
  every launch the tuner times at batch 1 (the keys split 16 / 32 / 64 ways, folded in-kernel by each tile's last
  program) and at batch 8 (2 / 4 / 8);
- ``qkv-siblings``: the paired-halves QKV + RoPE form's q and k / v kernels alone and as one sibling launch;
- ``cache-hits``: the batch-1 decode-attention launches compiled once, then each module loaded afresh (as a warm
  process loads it) and compiled again: the seconds of that hit in Triton's cache, which a warm process pays on
  each kernel's first launch (the cache key of the kernel's source, the cache's files).

- ``--jobs FILE``: instead, the kernels listed in a pickle (:func:`compile_jobs`; written by
  ``decode_partition_cpu.py --compiles``, which claims under the interpreter, where nothing compiles).

Prints seconds per compile (one process, compiles one after another; the device's compile pool runs them in
parallel, so a round there takes about its slowest compile) and writes JSON with ``--out``.

    python benchmarks/compile_time_cpu.py [--cases decode-attention qkv-siblings cache-hits] [--jobs FILE] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import triton
from triton.backends.compiler import GPUTarget

from torch_mirage.codegen.ugraph_triton import emit_block_kernel, emit_sibling_kernel, module_source
from torch_mirage.codegen.loader import load_source
from torch_mirage.context import Target
from torch_mirage.superopt.launch import LaunchConfig, candidates, combine_tiling, retile
from torch_mirage.superopt.optimise import plan_block
from torch_mirage.superopt.validate import SMEM_BYTES

TARGET = GPUTarget("cuda", 90, 32)
PTR = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}


def _signature(params, in_dtypes, out_dtypes) -> tuple[dict, dict]:
    sig, consts = {}, {}
    for p in params:
        name = p.split(":")[0]
        parts = name.split("_")
        if name.endswith("NUM_STAGES"):
            sig[name] = "constexpr"
        elif parts[-1] == "ptr" and parts[-2].startswith("in"):
            sig[name] = PTR[in_dtypes[int(parts[-2][2:])]]
        elif parts[-1] == "ptr" and parts[-2].startswith("out"):
            sig[name] = PTR[out_dtypes[int(parts[-2][3:])]]
        elif parts[-1] == "ptr" and parts[-2].startswith("ws"):
            sig[name] = "*fp32"
        elif name.endswith("cnt_ptr"):
            sig[name] = "*i32"
        else:
            sig[name] = "i32"
    return sig, consts


def emitted(bg, cfg: LaunchConfig, in_ranks, name: str, flat_pid: bool = False):
    tiled = retile(bg, cfg.grid, cfg.forloop_range)
    plan = plan_block(tiled, SMEM_BYTES)
    return emit_block_kernel(tiled, list(in_ranks), name, cfg.split, combine_tiling(tiled, cfg.split), cfg.prologue,
                             plan.order, plan.transposed, Target.CUDA, sums_after=cfg.sums_after,
                             combine_in_kernel=cfg.combine_in_kernel, flat_pid=flat_pid)


def compile_seconds(source: str, name: str, params, in_dtypes, out_dtypes, stages: dict, warps: int,
                    num_stages: int, cache_dir: str | None = None) -> float:
    """Seconds Triton takes to compile kernel ``name`` of ``source`` for sm_90: fresh (no cache), or with Triton's
    cache and the module file under ``cache_dir`` (a second call there is a cache hit)."""
    with tempfile.TemporaryDirectory() as fresh:
        d = cache_dir or fresh
        os.environ["TRITON_CACHE_DIR"] = d
        module, _ = load_source(source, d, prefix="ct")
        sig, _ = _signature(params, in_dtypes, out_dtypes)
        src = triton.compiler.ASTSource(fn=getattr(module, name), signature=sig, constexprs=stages)
        start = time.perf_counter()
        triton.compile(src, target=TARGET, options={"num_warps": warps, "num_stages": num_stages})
        return time.perf_counter() - start


def _kernel_seconds(bg, cfg, in_ranks, in_dtypes, out_dtypes, cache_dir: str | None = None) -> float:
    k = emitted(bg, cfg, in_ranks, "kernel")
    stages = {p.split(":")[0]: cfg.num_stages for p in k.params if "NUM_STAGES" in p}
    return compile_seconds(module_source([k]), "kernel", k.params, in_dtypes, out_dtypes, stages, cfg.num_warps,
                           cfg.num_stages, cache_dir)


def decode_attention(rows_of_batch=(1, 8)) -> list[dict]:
    from torch_mirage.superopt.attention_seeds import flash_attention

    out = []
    for b in rows_of_batch:
        kg = flash_attention(b, 8, 4, 4096, 128, scale=0.088, mask=(b, 1), dtype="bfloat16")
        op = next(o for o in kg.ops if o.name == "customized")
        shapes = [kg.ops[r[0]].shapes[r[1]] for r in op.inputs]
        in_dtypes = ["bfloat16"] * len(shapes)
        for cfg in candidates(op.body, 132):
            s = _kernel_seconds(op.body, cfg, [len(x) for x in shapes], in_dtypes, ["bfloat16"] * 4)
            out.append({"case": "decode-attention", "batch": b, "config": cfg.to_json(), "compile_s": round(s, 2)})
            print(f"decode attention b{b} split {cfg.split:>2} stages {cfg.num_stages} fold {cfg.combine_in_kernel}: "
                  f"{s:6.2f} s", flush=True)
    return out


def qkv_siblings(rows: int = 1) -> list[dict]:
    from ugraph_config_sweep import SEED_VARIANTS     # this directory: the layer's QKV + RoPE program

    from torch_mirage.bench import workloads
    from torch_mirage.capture.lower import trace
    from torch_mirage.config import Config
    from torch_mirage.superopt.gemv_claim import verified_halves
    from torch_mirage.superopt.search.reference import reference_of

    base, keep, fn = SEED_VARIANTS["rmsnorm_rope_qkv_t"]
    xs = workloads.WORKLOADS[base].make_inputs(rows, torch.float32, "cpu", 0)
    graph = trace(fn, [xs[i] for i in keep])
    halves = verified_halves(reference_of(graph.nodes, graph).graph, Config())
    ops = [o for o in halves.ops if o.name == "customized"]
    # the launches the H100 tuner kept at b1 (NOTES 11-27): q at (32, 4) x 8 steps, k / v at (8, 64) x 8
    cfgs = [LaunchConfig((32, 4), 8, 1, 2, 3), LaunchConfig((8, 64), 8, 1, 1, 4)]
    ranks = [[len(halves.ops[r[0]].shapes[r[1]]) for r in op.inputs] for op in ops]
    out = []
    for op, cfg, r in zip(ops, cfgs, ranks):
        s = _kernel_seconds(op.body, cfg, r, ["bfloat16"] * len(r), ["bfloat16"] * 4)
        out.append({"case": "qkv-part", "config": cfg.to_json(), "compile_s": round(s, 2)})
        print(f"qkv part {cfg.grid}: {s:6.2f} s", flush=True)
    parts = [emitted(op.body, cfg, r, f"part{j}", flat_pid=True)
             for j, (op, cfg, r) in enumerate(zip(ops, cfgs, ranks))]
    source = module_source(parts) + "\n\n" + emit_sibling_kernel("siblings", parts)
    params = [f"p{j}_{p}" for j, k in enumerate(parts) for p in k.params if p != "lin"]
    stages = {f"p{j}_NUM_STAGES": c.num_stages for j, (k, c) in enumerate(zip(parts, cfgs)) if k.pipelined}
    in_dtypes = ["bfloat16"] * 64
    s = compile_seconds(source, "siblings", params, in_dtypes, ["bfloat16"] * 4, stages, 2, 4)
    out.append({"case": "qkv-siblings", "compile_s": round(s, 2)})
    print(f"qkv sibling launch: {s:6.2f} s", flush=True)
    return out


def compile_jobs(path: str) -> list[dict]:
    """Each kernel of the pickled job list (dicts: ``what``, ``body``, ``configs``, ``ranks``, ``in_dtypes``,
    ``out_dtypes``) compiled at each of its configs: one row per kernel (seconds in all, the slowest, failures)."""
    import pickle
    with open(path, "rb") as f:
        jobs = pickle.load(f)
    rows = []
    for job in jobs:
        times, failed = [], 0
        for cfg in job["configs"]:
            try:
                times.append(_kernel_seconds(job["body"], cfg, job["ranks"], job["in_dtypes"], job["out_dtypes"]))
            except Exception:         # the GPU's tuner skips a candidate that does not compile too
                failed += 1
        rows.append({"case": job["what"], "candidates": len(job["configs"]), "failed": failed,
                     "compile_s": round(sum(times), 2), "slowest_s": round(max(times, default=0.0), 2)})
        print(f"{job['what']:44s} {len(job['configs']):3d} candidates {sum(times):7.2f} s (slowest "
              f"{max(times, default=0.0):.2f} s, {failed} failed)", flush=True)
    print(f"all: {sum(r['compile_s'] for r in rows):.2f} s", flush=True)
    return rows


def cache_hits() -> list[dict]:
    from torch_mirage.codegen import loader
    from torch_mirage.superopt.attention_seeds import flash_attention

    kg = flash_attention(1, 8, 4, 4096, 128, scale=0.088, mask=(1, 1), dtype="bfloat16")
    op = next(o for o in kg.ops if o.name == "customized")
    out = []
    with tempfile.TemporaryDirectory() as d:
        for cfg in [c for c in candidates(op.body, 132) if c.split > 1]:
            seconds = []
            for _ in range(2):                 # compiled, then a hit for the module loaded again
                loader._LOADED.clear()
                seconds.append(_kernel_seconds(op.body, cfg, [4, 4, 4, 4], ["bfloat16"] * 4, ["bfloat16"] * 4, d))
            out.append({"case": "cache-hit", "config": cfg.to_json(), "compile_s": round(seconds[0], 3),
                        "hit_ms": round(seconds[1] * 1e3, 2)})
            print(f"decode attention split {cfg.split:>2} stages {cfg.num_stages}: compile {seconds[0]:6.2f} s, "
                  f"cache hit {seconds[1] * 1e3:6.2f} ms", flush=True)
    return out


CASES = {"decode-attention": decode_attention, "qkv-siblings": qkv_siblings, "cache-hits": cache_hits}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--jobs", help="compile the kernels of this pickled job list instead of the cases")
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = compile_jobs(args.jobs) if args.jobs else [r for c in args.cases for r in CASES[c]()]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"triton": triton.__version__, "torch": torch.__version__, "target": "sm_90 (compiled on CPU)",
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
