"""``python -m torch_mirage demo``: compile a Llama-style decoder block with ``backend="mirage"``,
check it against eager, print the explain report and timings."""
from __future__ import annotations

import argparse
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
    from .report import explain
    from .testing.models import LlamaBlock, LlamaConfig, llama_inputs

    parser = argparse.ArgumentParser(prog="python -m torch_mirage demo", description=__doc__)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    cfg = LlamaConfig(dim=args.dim, heads=max(2, args.dim // 64), kv_heads=max(1, args.dim // 128), hidden=args.dim * 8 // 3)
    model = LlamaBlock(cfg).to(device=device, dtype=dtype).eval()
    inputs = llama_inputs(cfg, args.batch, args.seq, device=device, dtype=dtype)
    print(f"torch_mirage demo: Llama-style decoder block dim={cfg.dim} heads={cfg.heads}/{cfg.kv_heads} "
          f"mlp={cfg.hidden}, batch={args.batch} seq={args.seq}, {device} {str(dtype).replace('torch.', '')}")

    with torch.no_grad():
        reference = model(*inputs)
        t0 = time.perf_counter()
        report = explain(model, *inputs)
        compile_s = time.perf_counter() - t0
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="mirage")
        out = compiled(*inputs)
        err = ((out.double() - reference.double()).norm() / reference.double().norm()).item()
        tol = 1e-2 if dtype == torch.float16 else 1e-4
        print(report)
        print(f"\ncompile + first call: {compile_s:.1f} s")
        print(f"relative error vs eager: {err:.2e} ({'ok' if err < tol else 'MISMATCH'}, tolerance {tol:g})")
        eager_ms = _time_ms(model, inputs, args.iters)
        mirage_ms = _time_ms(compiled, inputs, args.iters)
    print(f"time per call: eager {eager_ms:.3f} ms, mirage {mirage_ms:.3f} ms (wall clock, {args.iters} iterations)")
    return 0 if err < tol else 1
