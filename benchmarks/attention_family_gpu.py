"""Attention family on one GPU: mirage's attention claimer against eager, Inductor, SDPA and flex_attention.

Cases (issue 16's targets): gemma2_softcap (causal + tanh soft-cap, H=32, d=128) at n=1024 and 8192, h2o_core
(causal + column sums of P) at n=1024, gqa (bench shapes) at b=1 and 8, and decode over a 4k KV cache with
Llama-3-8B heads (32 q / 8 KV, d=128) written as HF eager (repeat_kv + additive mask) and as SDPA (enable_gqa).
The ``*_inmask`` cases build the causal (or sliding-window) mask inside the compiled function from index
comparisons, as HF models do, so its value property gives mirage's attention seeds a for-loop band (entirely masked
key tiles are never visited); ``mirage_noband`` is the same compile with ``options={"attention_band": False}``. A mask passed in as
an input (gemma2_1k / 8k, h2o) has unknown values and gets no band. Each implementation is checked against an fp32 reference (relative Frobenius error) and timed with
``triton.testing.do_bench`` (median ms, L2 flushed); every case runs in its own try/except so one failure only
loses its row. Prints a table; writes JSON to ``$OUT/attention_family.json`` when ``$OUT`` is set.

    python benchmarks/attention_family_gpu.py [--dtypes float16 bfloat16] [--only gemma2_1k decode_eager ...]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch_mirage  # noqa: E402
from torch_mirage.bench import workloads as W  # noqa: E402
from torch_mirage.numerics import relative_error, same_non_finite, tolerance  # noqa: E402


def _causal_additive(n, dtype, device):
    return torch.full((n, n), float("-inf"), device=device).triu(1).view(1, 1, n, n).to(dtype)


def _inmask(n, window, dtype, device):
    """A causal (sliding-window) additive mask made from index comparisons inside the compiled graph."""
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    keep = j <= i
    if window is not None:
        keep = keep & (j > i - window)
    low = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=device)
    return torch.where(keep, torch.zeros((), dtype=dtype, device=device), low)[None, None]


def gemma2_inmask(q, k, v):
    return W.gemma2_softcap(q, k, v, _inmask(q.shape[-2], None, q.dtype, q.device))


def gemma2_window_inmask(q, k, v):
    return W.gemma2_softcap(q, k, v, _inmask(q.shape[-2], 1024, q.dtype, q.device))


def sdpa_is_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def repeat_kv(x, n_rep):
    b, hk, s, d = x.shape
    return x[:, :, None, :, :].expand(b, hk, n_rep, s, d).reshape(b, hk * n_rep, s, d)


def decode_eager(q, k, v, mask):
    """HF eager attention for one new token over a static cache (repeat_kv, additive mask, fp32 softmax)."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    w = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5 + mask
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(w, v)


def decode_sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def cases(dtype, device):
    """name -> (fn, inputs, {reference label: (callable on the same inputs, computes the same output)}); built
    lazily per case."""
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*s, scale=1.0):
        return torch.randn(s, generator=gen, device=device, dtype=torch.float32).mul_(scale).to(dtype)

    def attn_inputs(h, n, d):
        return [randn(1, h, n, d), randn(1, h, n, d), randn(1, h, n, d), _causal_additive(n, dtype, device)]

    def decode_inputs():
        ctx, pos = 4096, 4096 - 4096 // 32 - 1
        mask = torch.where(torch.arange(ctx, device=device) <= pos, 0.0, float("-inf")).view(1, 1, 1, ctx).to(dtype)
        return [randn(1, 32, 1, 128), randn(1, 8, ctx, 128), randn(1, 8, ctx, 128), mask]

    def refs(name):
        return {r.label: (r.make(), r.same) for r in W.REFERENCES.get(name, ())}

    yield "gemma2_1k", lambda: (W.gemma2_softcap, attn_inputs(32, 1024, 128), refs("gemma2_softcap"))
    yield "gemma2_8k", lambda: (W.gemma2_softcap, attn_inputs(32, 8192, 128), refs("gemma2_softcap"))
    for n, tag in ((1024, "1k"), (8192, "8k")):
        yield f"gemma2_{tag}_inmask", (lambda n=n: (gemma2_inmask, attn_inputs(32, n, 128)[:3],
                                                    refs("gemma2_softcap")))
    yield "gemma2_8k_window_inmask", lambda: (gemma2_window_inmask, attn_inputs(32, 8192, 128)[:3], {})
    yield "sdpa_causal_8k", lambda: (sdpa_is_causal, attn_inputs(32, 8192, 128)[:3], {})
    yield "h2o_1k", lambda: (W.h2o_core, attn_inputs(32, 1024, 128), refs("h2o_core"))
    for b in (1, 8):
        yield f"gqa_b{b}", (lambda b=b: (W.gqa, [randn(b, 2, 256, 64), randn(b, 2, 4096, 64), randn(b, 2, 4096, 64)],
                                         refs("gqa")))
    yield "decode_eager", lambda: (decode_eager, decode_inputs(), {"sdpa(enable_gqa)": (decode_sdpa, True)})
    yield "decode_sdpa", lambda: (decode_sdpa, decode_inputs(), {})


def rel_err(out, ref):
    out = out[0] if isinstance(out, (tuple, list)) else out
    ref = ref[0] if isinstance(ref, (tuple, list)) else ref
    return relative_error(out, ref, where=ref) if same_non_finite(out, ref) else math.inf


def bench_ms(fn):
    from triton.testing import do_bench
    return do_bench(fn, warmup=10, rep=40, return_mode="median")


def run_case(name, make, dtype, results):
    fn, inputs, refs = make()
    ref = fn(*[x.float() for x in inputs])
    impls = {"eager": fn, "inductor": torch.compile(fn, dynamic=False)}
    same = {label: s for label, (_, s) in refs.items()}
    report = torch_mirage.Report()
    impls["mirage"] = torch.compile(fn, backend=torch_mirage.MirageBackend(report=report), dynamic=False)
    if name.endswith("_inmask") or name.startswith("sdpa_causal"):
        impls["mirage_noband"] = torch.compile(fn, backend=torch_mirage.MirageBackend(options={"attention_band": False}),
                                               dynamic=False)
    impls.update({label: f for label, (f, _) in refs.items()})
    row = {"case": name, "dtype": str(dtype).replace("torch.", ""), "shapes": [list(x.shape) for x in inputs]}
    for impl, f in impls.items():
        t0 = time.perf_counter()
        try:
            out = f(*inputs)
            torch.cuda.synchronize()
            # references that compute less (P·V only, no soft-cap) are compared on what they compute
            err = rel_err(out, ref) if same.get(impl, True) else None
            ms = bench_ms(lambda: f(*inputs))
            row[impl] = {"us": round(ms * 1e3, 2), "rel_err": err, "first_call_s": round(time.perf_counter() - t0, 2)}
        except Exception as e:
            print(f"  {name} {impl}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc(limit=3)
            row[impl] = {"error": f"{type(e).__name__}: {e}"[:300]}
    row["mirage_regions"] = [{"claimer": r.claimer, "by": r.compiled_by, "reason": r.reason, "detail": r.detail[:160]}
                             for r in getattr(report, "regions", [])]
    results.append(row)
    cells = []
    for impl in impls:
        c = row[impl]
        if "error" in c:
            cells.append(f"{impl}=ERR")
        else:
            bad = c["rel_err"] is not None and not (c["rel_err"] <= tolerance(dtype, "bench"))
            err = "" if c["rel_err"] is None else f" e={c['rel_err']:.1e}{'!' if bad else ''}"
            cells.append(f"{impl}={c['us']:.1f}µs{err}")
    claimed = [r["detail"][:60] for r in row["mirage_regions"] if r["claimer"] == "attention"]
    print(f"{name:13s} {row['dtype']:8s} " + "  ".join(cells) + f"  | attention claimed: {claimed or 'no'}",
          flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", nargs="+", default=["float16"])
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--budget-s", type=float, default=330.0, help="stop starting new cases after this long")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return
    device = torch.device("cuda")
    start = time.perf_counter()
    results = []
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  (µs, median of do_bench; e = rel. error "
          f"vs fp32 reference, ! over tolerance)")
    for dt in args.dtypes:
        dtype = getattr(torch, dt)
        for name, make in cases(dtype, device):
            if args.only and name not in args.only:
                continue
            if time.perf_counter() - start > args.budget_s:
                print(f"{name} {dt}: skipped (time budget {args.budget_s:.0f} s spent)")
                continue
            torch._dynamo.reset()
            try:
                run_case(name, make, dtype, results)
            except Exception as e:
                print(f"{name} {dt}: {type(e).__name__}: {e}", flush=True)
                traceback.print_exc(limit=4)
                results.append({"case": name, "dtype": dt, "error": f"{type(e).__name__}: {e}"[:300]})
            torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "attention_family.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results},
                      f, indent=1, default=str)
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
