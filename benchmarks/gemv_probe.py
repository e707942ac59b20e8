"""What a decode GEMV (1–16 activation rows against a fp16/bf16 weight) can reach on this GPU, before codegen.

Issue 17 asks for skinny GEMMs that stream weights at ≥ 90 % of measured copy bandwidth. The RMSNorm + Linear
μGraph reached 0.69 (NOTES.md, 94 swept configs, all ``tl.dot`` tiles with a split-K combine kernel). This probe
times, on the same shapes, each replayed in a CUDA graph over weights rotated past L2:

* ``read``: a kernel that only reads the weight once (sums it) — the practical floor for streaming it;
* ``copy``: ``torch`` device-to-device copy of the weight (bytes read + written), the bandwidth yardstick;
* ``cublas``: ``x @ w.T`` (nn.Linear layout, w of shape (N, K));
* ``fma``: one kernel, grid over N only, each program walks all of K with elementwise multiply-adds (no
  ``tl.dot``), weight tile (BN, BK) loaded along K, ``x`` rows broadcast; no combine kernel;
* ``fma_norm``: the same with the RMS norm of ``x`` and the gain ``g`` fused as a prologue (rms computed per
  program from ``x``, which is tiny), i.e. ``(rms(x)·g) @ w.T``.

Prints a table (µs, fraction of the read floor, GB/s); with ``$OUT`` set, writes ``gemv_probe.json`` there.
Nothing here is used by the backend.

    python benchmarks/gemv_probe.py --rows 1,2,8,16 --k 4096 --n 4096,14336
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch_mirage.numerics import relative_error, rms_norm  # noqa: E402
from torch_mirage.timing import cuda_graph_time_us  # noqa: E402


@triton.jit
def read_kernel(w_ptr, out_ptr, total, BLOCK: tl.constexpr, PER: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), tl.float32)
    for i in tl.range(0, PER, num_stages=4):
        offs = (pid * PER + i) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(w_ptr + offs, mask=offs < total, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


@triton.jit
def gemv_fma(x_ptr, g_ptr, w_ptr, y_ptr, K, N, M, MP: tl.constexpr,
             BN: tl.constexpr, BK: tl.constexpr, NORM: tl.constexpr, EPS: tl.constexpr, STAGES: tl.constexpr,
             DOT: tl.constexpr):
    """y[M, N] = x[M, K] @ w[N, K]^T; w row-major (nn.Linear). Programs split N; each walks all of K. The RMS norm
    of x (NORM) accumulates in the same loop and divides the result once at the end (Mirage's RMSNorm+Linear)."""
    pid = tl.program_id(0)
    rn = pid * BN + tl.arange(0, BN)
    rm = tl.arange(0, MP)
    mrow = rm < M
    ss = tl.zeros((MP,), tl.float32)
    acc = tl.zeros((MP, BN), tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        rk = k0 + tl.arange(0, BK)
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :]).to(tl.float32)                      # (BN, BK)
        xv = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=mrow[:, None], other=0.0).to(tl.float32)
        if NORM:
            ss += tl.sum(xv * xv, 1)
            xv = xv * tl.load(g_ptr + rk).to(tl.float32)[None, :]
        if DOT:
            acc = tl.dot(xv.to(w_ptr.dtype.element_ty), tl.trans(w.to(w_ptr.dtype.element_ty)), acc)
        else:
            acc += tl.sum(xv[:, None, :] * w[None, :, :], 2)                                      # (MP, BN)
    if NORM:
        acc = acc / tl.sqrt(ss / K + EPS)[:, None]
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mrow[:, None])


def gemv(x, g, w, y, bn, bk, warps, stages, norm, eps=1e-6, dot=False):
    m, k = x.shape
    n = w.shape[0]
    mp = 16 if dot else max(1, triton.next_power_of_2(m))
    gemv_fma[(n // bn,)](x, g, w, y, k, n, m, mp, bn, bk, norm, eps, stages, dot, num_warps=warps)
    return y


def rotated(make, nbytes, l2=50 * 2**20):
    sets = max(2, min(16, (3 * l2) // max(1, nbytes) + 1))
    return [make() for _ in range(sets)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,8,16")
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", default="4096,14336")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--seconds", type=float, default=420, help="stop sweeping after this long")
    args = ap.parse_args()
    dt = getattr(torch, args.dtype)
    dev = "cuda"
    deadline = time.time() + args.seconds
    rows = []
    for n, m in itertools.product([int(v) for v in args.n.split(",")], [int(v) for v in args.rows.split(",")]):
        k = args.k
        wbytes = n * k * dt.itemsize
        sets = rotated(lambda: [torch.randn(m, k, device=dev, dtype=dt), torch.rand(k, device=dev, dtype=dt) + 0.5,
                                torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5], wbytes)
        x, g, w = sets[0]
        ref = (x.double() @ w.double().T)
        refn = rms_norm(x.double(), 1e-6, g.double(), upcast=False) @ w.double().T
        out = torch.empty(m, n, device=dev, dtype=dt)
        base = {"n": n, "k": k, "m": m, "dtype": args.dtype, "weight_MB": wbytes / 1e6}

        def add(name, us, err=None, **kw):
            rows.append({**base, "kernel": name, "us": us, "GBps": wbytes / us / 1e3, "err": err, **kw})

        blk, total = 1024, n * k
        per = max(1, total // (blk * 264))
        part = torch.empty(triton.cdiv(total, blk * per), device=dev, dtype=torch.float32)
        add("read", cuda_graph_time_us(lambda x, g, w: read_kernel[(part.numel(),)](w, part, total, blk, per), sets))
        dst = torch.empty_like(w)
        add("copy(r+w)", cuda_graph_time_us(lambda x, g, w: dst.copy_(w), sets))
        add("cublas", cuda_graph_time_us(lambda x, g, w: x @ w.T, sets),
            relative_error(x @ w.T, ref))
        best = {}
        for norm, dot in itertools.product((False, True), (False, True)):
            mp = 16 if dot else triton.next_power_of_2(m)
            for bn, bk, warps, stages in itertools.product((8, 16, 32, 64), (128, 256, 512), (4, 8), (3, 5)):
                if (n % bn or k % bk or bn * bk > 16384 or (not dot and bn * bk * mp > 65536) or (dot and bn < 16)
                        or (not dot and m > 4) or time.time() > deadline):
                    continue
                try:
                    gemv(x, g, w, out, bn, bk, warps, stages, norm, dot=dot)
                    r = refn if norm else ref
                    err = relative_error(out, r)
                    us = cuda_graph_time_us(lambda x, g, w: gemv(x, g, w, out, bn, bk, warps, stages, norm, dot=dot), sets,
                                            replays=10, repeats=3)
                except Exception as e:  # noqa: BLE001 — a config that does not compile is skipped and named
                    print(f"skip n={n} m={m} bn={bn} bk={bk} w={warps} s={stages}: {type(e).__name__}", flush=True)
                    continue
                key = ("dot" if dot else "fma") + ("_norm" if norm else "")
                if key not in best or us < best[key][0]:
                    best[key] = (us, err, dict(bn=bn, bk=bk, warps=warps, stages=stages))
        for key, (us, err, cfg) in best.items():
            add(key, us, err, **cfg)
        floor = next(r["us"] for r in rows if r["kernel"] == "read" and r["n"] == n and r["m"] == m)
        for r in rows:
            if r["n"] == n and r["m"] == m:
                r["of_read"] = floor / r["us"]
        print(f"n={n} m={m} done", flush=True)
    print(f"\n{'n':>6} {'m':>3} {'kernel':<10} {'us':>8} {'GB/s':>7} {'of read':>7} {'err':>9}  config")
    for r in rows:
        cfg = " ".join(f"{a}={r[a]}" for a in ("bn", "bk", "warps", "stages") if a in r)
        err = f"{r['err']:.1e}" if r["err"] is not None else ""
        print(f"{r['n']:>6} {r['m']:>3} {r['kernel']:<10} {r['us']:>8.2f} {r['GBps']:>7.0f} {r['of_read']:>7.2f} "
              f"{err:>9}  {cfg}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gemv_probe.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
