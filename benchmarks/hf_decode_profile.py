"""Where one greedy ``generate`` spends its time, per compile mode: torch.profiler over a warmed-up call.

The HF bench (``bench/models.py``) reports µs per generated token, which includes ``generate``'s Python work.
This script profiles one call per mode on the same model and prints the CPU-side and GPU-side totals, the top
ops by self CPU time and by device time, and how many CUDA-graph replays and kernel launches it made, so a
per-token gap between two modes can be placed (graph kernels, launches, copies or Python); then the ops the second
mode calls more or less often than the first, with their input shapes and Python call sites.

    python benchmarks/hf_decode_profile.py [--model llama] [--modes reduce-overhead mirage] [--new-tokens 16]
        [--prefill] [--tokens 64] [--shared] [--python]

``--shared`` compiles every mode on one model first and then profiles each with its forward put back, the HF
bench's setting (one Dynamo cache with every mode's graphs), where mirage's µs/token has measured slower than
reduce-overhead's although its decode step is faster (H200 11-29: llama 2396 against 2068 µs/token, decode step
220 against 345 µs; profiled one mode per process, 2472 against 2714).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from torch_mirage.bench import models as M  # noqa: E402


def profile_mode(spec, mode: str, new_tokens: int, batch: int, tokens: int, top: int, prefill: bool = False,
                 shared: tuple | None = None, python: bool = False) -> dict:
    """Profile one warmed-up ``generate`` under ``mode`` (``prefill``: one forward over the prompt, no cache);
    returns the calls per (op, input shapes, Python stack). ``shared`` ``(model, forwards)``: the HF bench's setting
    (:func:`compile_all`), the mode's forward put in place on the one model instead of a model and compile of its
    own."""
    device = torch.device("cuda")
    if shared is None:
        model = M.build(spec, "default", torch.bfloat16, device, tiny=False)
        M.compile_forward(model, mode)
    else:
        model, forwards = shared
        M.use_forward(model, forwards[mode])
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, model.config.vocab_size, (batch, tokens), generator=gen).to(device)
    if prefill:
        mask = torch.ones_like(prompt)
        call = lambda: model(input_ids=prompt, attention_mask=mask)   # noqa: E731
    else:
        call = lambda: M.greedy_generate(model, prompt, new_tokens)   # noqa: E731
    with torch.no_grad():
        for _ in range(3):   # compile, record, settle
            call()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) / 5 * 1e6
        if python:      # the Python the call runs, which the op profile below does not see
            import cProfile
            import pstats

            py = cProfile.Profile()
            py.enable()
            call()
            torch.cuda.synchronize()
            py.disable()
            print(f"=== {spec.name} {mode}: Python profile of one call")
            for order in ("tottime", "cumulative"):
                pstats.Stats(py).sort_stats(order).print_stats(top * 2)
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        verbose = getattr(torch._C._profiler, "_ExperimentalConfig", None)   # Python stacks on ATen ops
        extra = {"experimental_config": verbose(verbose=True)} if verbose is not None else {}
        with torch.profiler.profile(activities=acts, record_shapes=True, with_stack=True, **extra) as prof:
            call()
            torch.cuda.synchronize()
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    replays = sum(e.count for e in events if "cudaGraphLaunch" in e.key)
    device_us = sum(getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
                    for e in events)
    what = "prefill forward" if prefill else f"generate ({wall_us / new_tokens:.0f} µs/token)"
    print(f"=== {spec.name} {mode}: {wall_us:.0f} µs per {what}, "
          f"device time {device_us:.0f} µs, kernel launches {launches}, CUDA-graph launches {replays}")
    print(events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))
    sort = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    print(events.table(sort_by=sort, row_limit=top, max_name_column_width=60))
    calls: dict = {}
    for e in prof.key_averages(group_by_input_shape=True, group_by_stack_n=_STACK):
        # object addresses in frame names ("<built-in method to of Tensor object at 0x…>") differ between modes
        key = (e.key, str(e.input_shapes), tuple(re.sub(r" at 0x[0-9a-f]+", "", f) for f in e.stack[:_STACK]))
        calls[key] = calls.get(key, 0) + e.count
    if shared is None:
        M.compile_forward(model, "eager")
        model = call = None   # frees the model before the next mode builds its own
        torch.cuda.empty_cache()
    else:
        M.use_forward(model, None)
    return calls


def compile_all(spec, modes, new_tokens: int, batch: int, tokens: int) -> tuple:
    """One model with every mode compiled and warmed up in this process before any is profiled, each mode's forward
    kept (one Dynamo cache holds every mode's graphs, guarded on the backend), as ``bench/models.py`` times them:
    ``(model, {mode: forward})``; called, and its forwards profiled, under ``models.room_for_modes``."""
    model = M.build(spec, "default", torch.bfloat16, torch.device("cuda"), tiny=False)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, model.config.vocab_size, (batch, tokens), generator=gen).to("cuda")
    forwards = {}
    torch._dynamo.reset()
    for mode in modes:
        M.compile_forward(model, mode, reset=False)
        with torch.no_grad():
            for _ in range(2):
                M.greedy_generate(model, prompt, new_tokens)
        forwards[mode] = model.__dict__.get("forward")
        M.use_forward(model, None)
    return model, forwards


_STACK = 6   # Python frames kept per op when two modes' calls are compared


def print_call_differences(first: tuple[str, dict], second: tuple[str, dict]) -> None:
    """The ops (with input shapes and where in Python they were called) that one mode runs more often than the
    other in one ``generate``: what a per-token gap between two modes with equal device time is made of."""
    (a, ca), (b, cb) = first, second
    diff = sorted(((cb.get(k, 0) - ca.get(k, 0), k) for k in set(ca) | set(cb)), key=lambda t: -abs(t[0]))
    print(f"=== calls {b} makes more (+) or fewer (-) than {a} in one generate")
    for d, (key, shapes, stack) in diff:
        if d and key.startswith("aten::"):
            print(f"{d:+5d}  {key}  {shapes[:120]}")
            for frame in stack:
                print(f"         {frame}")


def generate_arguments(ap: argparse.ArgumentParser) -> None:
    """The model, modes and ``generate`` sizes, as this script and ``per_token_alone.py`` take them."""
    ap.add_argument("--model", default="llama", choices=list(M.MODELS))
    ap.add_argument("--modes", nargs="+", default=["reduce-overhead", "mirage"])
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64, help="prompt length")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    generate_arguments(ap)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--prefill", action="store_true", help="profile one forward over the prompt, not a generate")
    ap.add_argument("--python", action="store_true", help="also cProfile one call per mode (the Python it runs)")
    ap.add_argument("--shared", action="store_true",
                    help="compile every mode on one model in this process first, as the HF bench does")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("hf_decode_profile: needs a CUDA GPU", file=sys.stderr)
        return 2
    profiled = []
    spec = M.MODELS[args.model]
    with M.room_for_modes(args.modes):
        shared = compile_all(spec, args.modes, args.new_tokens, args.batch, args.tokens) if args.shared else None
        for mode in args.modes:
            try:
                profiled.append((mode, profile_mode(spec, mode, args.new_tokens, args.batch, args.tokens, args.top,
                                                    args.prefill, shared, args.python)))
            except Exception as e:   # one mode failing does not hide the other's profile
                print(f"=== {args.model} {mode}: failed: {type(e).__name__}: {e}")
    if len(profiled) >= 2:
        print_call_differences(profiled[0], profiled[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
