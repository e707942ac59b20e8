"""Where one greedy ``generate`` spends its time, per compile mode: torch.profiler over a warmed-up call.

The HF bench (``bench/models.py``) reports µs per generated token, which includes ``generate``'s Python work.
This script profiles one call per mode on the same model and prints the CPU-side and GPU-side totals, the top
ops by self CPU time and by device time, and how many CUDA-graph replays and kernel launches it made, so a
per-token gap between two modes can be placed (graph kernels, launches, copies or Python).

    python benchmarks/hf_decode_profile.py [--model llama] [--modes reduce-overhead mirage] [--new-tokens 16]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from torch_mirage.bench import models as M  # noqa: E402


def profile_mode(spec, mode: str, new_tokens: int, batch: int, tokens: int, top: int) -> None:
    device = torch.device("cuda")
    model = M.build(spec, "default", torch.bfloat16, device, tiny=False)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, model.config.vocab_size, (batch, tokens), generator=gen).to(device)
    M.compile_forward(model, mode)
    with torch.no_grad():
        for _ in range(3):   # compile, record, settle
            M.greedy_generate(model, prompt, new_tokens)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            M.greedy_generate(model, prompt, new_tokens)
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) / 5 * 1e6
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            M.greedy_generate(model, prompt, new_tokens)
            torch.cuda.synchronize()
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    replays = sum(e.count for e in events if "cudaGraphLaunch" in e.key)
    device_us = sum(getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
                    for e in events)
    print(f"=== {spec.name} {mode}: {wall_us:.0f} µs per generate ({wall_us / new_tokens:.0f} µs/token), "
          f"device time {device_us:.0f} µs, kernel launches {launches}, CUDA-graph launches {replays}")
    print(events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))
    sort = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    print(events.table(sort_by=sort, row_limit=top, max_name_column_width=60))
    M.compile_forward(model, "eager")
    del model
    torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama", choices=list(M.MODELS))
    ap.add_argument("--modes", nargs="+", default=["reduce-overhead", "mirage"])
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("hf_decode_profile: needs a CUDA GPU", file=sys.stderr)
        return 2
    for mode in args.modes:
        try:
            profile_mode(M.MODELS[args.model], mode, args.new_tokens, args.batch, args.tokens, args.top)
        except Exception as e:   # one mode failing does not hide the other's profile
            print(f"=== {args.model} {mode}: failed: {type(e).__name__}: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
