"""``python -m torch_mirage demo``: compile a Llama-style decoder block with ``backend="mirage"``,
check it against eager, print the explain report and timings.

On a GPU: a block of realistic width, default settings, CUDA-event timings of eager, Inductor and mirage.
Without one: a small block whose generated kernels run in Triton's interpreter, with every stitch region kept
whatever its size (``min_region_us=0``) so that the report shows what mirage would compile; no timings (the
interpreter says nothing about speed).
"""
from __future__ import annotations

import argparse
import os
import time

import torch


def _time_ms(fn, args, iters: int) -> float:
    sync = torch.cuda.synchronize if args[0].is_cuda else (lambda: None)
    for _ in range(2):
        fn(*args)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(*args)
    sync()
    return (time.perf_counter() - t0) / iters * 1e3


def main(argv: list[str] | None = None) -> int:
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before anything defines a Triton kernel
    from .backend import MirageBackend
    from .numerics import relative_error, tolerance
    from .report import Report
    from .testing.models import LlamaBlock, LlamaConfig, llama_inputs

    parser = argparse.ArgumentParser(prog="python -m torch_mirage demo", description=__doc__)
    parser.add_argument("--batch", type=int, default=None, help="default: 4 on a GPU, 1 on the CPU")
    parser.add_argument("--seq", type=int, default=None, help="default: 512 on a GPU, 32 on the CPU")
    parser.add_argument("--dim", type=int, default=None, help="default: 2048 on a GPU, 256 on the CPU")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)

    device, dtype = ("cuda", torch.float16) if on_gpu else ("cpu", torch.float32)
    options = {} if on_gpu else {"min_region_us": 0.0}
    batch, seq, dim = (args.batch or (4 if on_gpu else 1)), (args.seq or (512 if on_gpu else 32)), \
        (args.dim or (2048 if on_gpu else 256))
    torch.manual_seed(0)
    cfg = LlamaConfig(dim=dim, heads=max(2, dim // 64), kv_heads=max(1, dim // 128), hidden=dim * 8 // 3)
    model = LlamaBlock(cfg).to(device=device, dtype=dtype).eval()
    inputs = llama_inputs(cfg, batch, seq, device=device, dtype=dtype)
    print(f"torch_mirage demo: Llama-style decoder block dim={cfg.dim} heads={cfg.heads}/{cfg.kv_heads} "
          f"mlp={cfg.hidden}, batch={batch} seq={seq}, {device} {str(dtype).replace('torch.', '')}"
          + ("" if on_gpu else " (no GPU: kernels in Triton's interpreter, regions of every size kept)"))

    with torch.no_grad():
        reference = model(*inputs)
        report = Report()
        # the same backend as backend="mirage" (with these options), as an instance so its report can be read
        compiled = torch.compile(model, backend=MirageBackend(options=options, report=report))
        t0 = time.perf_counter()
        out = compiled(*inputs)
        compile_s = time.perf_counter() - t0
        err, tol = relative_error(out, reference), tolerance(dtype)
        print(report)
        print(f"\ncompile + first call: {compile_s:.1f} s")
        print(f"relative error vs eager: {err:.2e} ({'ok' if err < tol else 'MISMATCH'}, tolerance {tol:g})")
        if on_gpu:
            torch._dynamo.reset()
            inductor = torch.compile(model)
            times = {name: _time_ms(fn, inputs, args.iters)
                     for name, fn in (("eager", model), ("inductor", inductor), ("mirage", compiled))}
            print("time per call: " + ", ".join(f"{k} {v:.3f} ms" for k, v in times.items())
                  + f" (CUDA-synchronized wall clock, {args.iters} iterations; benchmarks/ has the careful numbers)")
        else:
            print("no timings without a GPU: the generated kernels ran in Triton's interpreter")
    return 0 if err < tol else 1
