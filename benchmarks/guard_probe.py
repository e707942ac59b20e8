"""What the whole-graph guard times, taken apart: for one HF model's prefill forward under ``backend="mirage"``,
each version the guard (``runtime.choose.FasterOf``) chose between — mirage's and Inductor's — is called on the
guard's own first-call arguments and measured four ways:

* host µs per call: Python's time to enqueue one call (no synchronisation), the floor of a host-bound loop;
* loop µs per call: calls back to back, synchronised at the end (what the guard's host-launched timing sees);
* device µs and kernels per call: torch.profiler's kernel time and kernel count for one call;
* the top Python functions of one call by cumulative time (cProfile).

A version whose loop time exceeds its device time by much more than the other's is host-bound, or its kernels
leave gaps; the tables say which.

    python benchmarks/guard_probe.py [--model bert] [--batch 4] [--tokens 256] [--mask]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from torch_mirage import backend as B  # noqa: E402
from torch_mirage.bench import models as M  # noqa: E402

_GUARDS: list = []


class _RecordedGuard(B.FasterOf):
    """The guard, keeping every version and its first call's arguments for the probe."""

    def __init__(self, candidates, *a, **k):
        super().__init__(candidates, *a, **k)
        self.versions, self.args = dict(candidates), None
        _GUARDS.append(self)

    def __call__(self, *args):
        if self.args is None:
            self.args = args
        return super().__call__(*args)


def _measure(name: str, fn, args, calls: int = 30) -> None:
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    host = []
    for _ in range(5):   # enqueue time: each call alone, the GPU drained before it
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn(*args)
        host.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    loops = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        torch.cuda.synchronize()
        loops.append((time.perf_counter() - t) / calls * 1e6)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        fn(*args)
        torch.cuda.synchronize()
    events = prof.key_averages()
    dev = lambda e: getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)  # noqa: E731
    kernels = [e for e in events if dev(e) > 0 and e.device_type == torch.autograd.DeviceType.CUDA]
    n_kernels = sum(e.count for e in kernels)
    print(f"--- {name}: host {min(host):.1f} µs (median {sorted(host)[2]:.1f}), loop {min(loops):.1f} µs "
          f"(median {sorted(loops)[2]:.1f}), device {sum(dev(e) for e in kernels):.1f} µs in {n_kernels} "
          f"kernels / copies per call")
    for e in sorted(kernels, key=dev, reverse=True)[:12]:
        print(f"      {dev(e):8.1f} µs  x{e.count:<3d} {e.key[:90]}")
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    fn(*args)
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(18)
    print("\n".join(line for line in s.getvalue().splitlines()[4:] if line.strip())[:4000])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bert", choices=list(M.MODELS))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--mask", action="store_true", help="pass an all-ones attention mask (the HF bench passes none)")
    args = ap.parse_args()
    B.FasterOf = _RecordedGuard
    spec = M.get([args.model])[0]
    device = torch.device("cuda")
    model = M.build(spec, "default", torch.bfloat16, device, tiny=False)
    prompt = torch.randint(1, model.config.vocab_size, (args.batch, args.tokens),
                           generator=torch.Generator().manual_seed(1)).to(device)
    extra = {"attention_mask": torch.ones_like(prompt)} if args.mask else {}
    if spec.causal:
        extra["use_cache"] = False
    forward = lambda: model(input_ids=prompt, **extra).logits   # noqa: E731  (the HF bench's prefill call)
    M.compile_forward(model, "mirage")
    with torch.no_grad():
        t = time.perf_counter()
        forward()
        torch.cuda.synchronize()
        print(f"first call (compile + guard) {time.perf_counter() - t:.1f} s; guards: {len(_GUARDS)}")
        for i, guard in enumerate(_GUARDS):
            print(f"=== guard {i}: chose {guard.choice}; {len(guard.args or ())} arguments")
            if guard.args is None:
                continue
            for name, fn in guard.versions.items():
                _measure(f"guard {i} {name}", fn, guard.args)
        for _ in range(3):
            forward()
        torch.cuda.synchronize()
        loops = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(20):
                forward()
            torch.cuda.synchronize()
            loops.append((time.perf_counter() - t) / 20 * 1e6)
        print(f"=== whole model forward (Dynamo + guard's choice): loop {min(loops):.1f} µs "
              f"(median {sorted(loops)[2]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
