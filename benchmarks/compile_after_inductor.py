"""Probe: why mirage's build stage is 4-5x slower in a process where Inductor compiled first (NOTES, 2026-11-27
ninth session: qwen2 decode b1, 119-136 s against 27 s alone; not the profiler).

Runs one bench workload (default ``llama_layer_decode`` b1 bf16) cold twice, each in a fresh child process with
its own mirage, Triton and Inductor caches: ``alone`` (mirage only) and ``after-inductor`` (Inductor's default mode
compiles and runs the same function first). Each child prints mirage's first-call seconds and stage times, its
process's CPU affinity, its threads (name and the function each is in: one that runs Python holds the lock mirage's
kernel loads need), the environment variables Inductor set, Triton's cache directory, and
Triton's cached ptxas version against the one of the ptxas ``TRITON_PTXAS_PATH`` names (they differed: the
cause, fixed by :func:`torch_mirage.compile_pool.align_ptxas_version`), and (``--profile``) the 40
functions of mirage's compile with the most own time (cProfile of the parent; worker processes are not in it;
``PROFILE_SORT=cumtime`` sorts by cumulative time).

``--runs warm`` (issue 15's warm compile, 11 s on an LLM decode graph, about 4 s of it mirage's stages): the
workload compiled twice in one set of caches, each in a fresh process; the second (the warm one) is the one printed
and, with ``--profile``, profiled.

    python benchmarks/compile_after_inductor.py [--workload llama_layer_decode] [--batch 1] [--profile]
        [--runs alone after-inductor warm]
    MIRAGE_COMPILE_PROCESSES=0 python benchmarks/compile_after_inductor.py    # the same with compile threads
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def child(args) -> None:
    import cProfile
    import io
    import pstats
    import threading

    import torch

    from torch_mirage.bench import workloads
    from torch_mirage.bench.harness import COMPILERS, mirage_summary

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    (w,) = workloads.get([args.workload])
    inputs = w.make_inputs(args.batch, dtype, device, seed=0, quick=args.quick)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    env_before = dict(os.environ)
    out: dict = {"run": args.child}
    if args.child == "after-inductor":
        t0 = time.perf_counter()
        with torch.no_grad():
            COMPILERS["inductor"](w.fn, {})(*[x.clone() for x in inputs])
        sync()
        out["inductor_s"] = round(time.perf_counter() - t0, 2)
        torch._dynamo.reset()
    import triton
    out["env_set_by_inductor"] = {k: v for k, v in os.environ.items() if env_before.get(k) != v}
    out["triton_cache_dir"] = triton.knobs.cache.dir
    if device.type == "cuda":    # Triton's cached ptxas version (its cache keys) against the tool the env names now
        from triton.backends.nvidia import compiler as nvidia
        arch = 10 * torch.cuda.get_device_capability()[0] + torch.cuda.get_device_capability()[1]
        cached = nvidia.get_ptxas_version
        out["ptxas_cached"] = cached(arch).strip().splitlines()[-1] if cached.cache_info().currsize else None
        out["ptxas_now"] = cached.__wrapped__(arch).strip().splitlines()[-1]
    out["affinity"] = len(os.sched_getaffinity(0))
    frames = sys._current_frames()           # every thread's name and where it is (a busy one holds the GIL)
    out["threads_before_mirage"] = [f"{t.name}: {frames[t.ident].f_code.co_name} "
                                    f"({os.path.basename(frames[t.ident].f_code.co_filename)})"
                                    for t in threading.enumerate() if t.ident in frames]
    info: dict = {}
    prof = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    with torch.no_grad():
        COMPILERS["mirage"](w.fn, info)(*[x.clone() for x in inputs])
    sync()
    if prof:
        prof.disable()
    out["mirage_s"] = round(time.perf_counter() - t0, 2)
    out["stage_ms"] = (mirage_summary(info) or {}).get("stage_ms")
    if device.type == "cuda":
        out["ptxas_after"] = cached(arch).strip().splitlines()[-1]
    print(json.dumps(out))
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(os.environ.get("PROFILE_SORT", "tottime")).print_stats(40)
        print(s.getvalue())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="llama_layer_decode")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1 (fp32)")
    p.add_argument("--quick", action="store_true", help="the workload's tiny sizes")
    p.add_argument("--runs", nargs="+", default=["alone", "after-inductor"], choices=["alone", "after-inductor", "warm"])
    p.add_argument("--child", choices=["alone", "after-inductor"])
    args = p.parse_args()
    if args.child:
        return child(args)
    for run in args.runs:
        with tempfile.TemporaryDirectory() as d:
            # as in the bench: TRITON_CACHE_DIR unset (Inductor sets it where it is), Triton's default cache under a
            # fresh HOME, so each child compiles cold
            env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
            env.update(HOME=d, MIRAGE_CACHE_DIR=f"{d}/mirage", TORCHINDUCTOR_CACHE_DIR=f"{d}/inductor",
                       TORCHINDUCTOR_FX_GRAPH_CACHE="0")
            cmd = [sys.executable, __file__, "--workload", args.workload, "--batch", str(args.batch),
                   "--device", args.device] + ["--quick"] * args.quick
            if run == "warm":     # the cold compile first, its output dropped: it fills the caches the next one reads
                subprocess.run(cmd + ["--child", "alone"], env=env, check=False, stdout=subprocess.DEVNULL)
            subprocess.run(cmd + ["--child", "alone" if run == "warm" else run] + ["--profile"] * args.profile,
                           env=env, check=False)


if __name__ == "__main__":
    main()
