"""Probe: how much of a decode layer's per-kernel overhead Programmatic Dependent Launch (PDL) can hide.

A chain of ``--kernels`` GEMVs, y_i = W_i · y_(i-1) (bf16 nn.Linear-style (n, k) weights, one row, fp32
accumulation), each a plain Triton kernel streaming its weight in 16-row x ``BLOCK_K`` tiles over n / 16 programs,
replayed in one CUDA graph with the weights rotated past L2. Three variants, each timed the same way:

- ``plain``: ordinary launches (what mirage's kernels do today);
- ``pdl``: launched with ``launch_pdl=True``; each kernel lets its dependents launch at once
  (``gdc_launch_dependents``) and waits for its predecessor (``gdc_wait``) before loading anything;
- ``pdl+tile0``: as ``pdl``, but each kernel loads its first weight tile *before* the wait — the weights do not
  depend on the previous kernel, only the activation does — so that load overlaps the predecessor's tail;
- ``pdl-late``: as ``pdl``, but each kernel lets its dependents launch only after its own wait (so at most the
  next kernel runs ahead, not the whole chain);
- ``pdl-late+prefetch``: as ``pdl-late``, and before its wait each program asks the L2 for its whole weight slice
  (Hopper's ``cp.async.bulk.prefetch.L2``, one request per ``PREFETCH_BYTES``; the slice's rows are contiguous), so
  the weight stream starts while the predecessor is still running and the main loop reads from L2;
- ``prefetch``: the same prefetch without PDL (a control: prefetch alone, no overlap with the predecessor);
- ``persistent``: the whole chain as one launch (issue 17's MPK-style persistent kernel, in its simplest form): a
  program per (GEMV, row tile), each taking its task from a ticket counter in launch order, so that a task waits
  only for tasks taken before it (no deadlock whatever the hardware schedules); it loads its first weight tile,
  then waits (polling with back-off) until every tile of the previous GEMV has stored its rows and counted itself
  done, then streams the rest. No launch boundary and no ramp per GEMV: a GEMV's programs are resident and hold
  their first tile when the previous one ends. The last task puts the counters back to zero for the next replay.

Prints µs per kernel and the fraction of copy bandwidth for each (the floor is the weights' bytes at the copy
bandwidth measured here) and checks every variant against torch. NOTES (2026-11-26, third session) says why
this matters: at b1 a Llama layer's 8 kernels each lose a roughly fixed 2-4 µs.

    python benchmarks/pdl_probe.py [--kernels 8] [--n 4096] [--k 4096]
    TRITON_INTERPRET=1 python benchmarks/pdl_probe.py --cpu-check     # the plain and persistent kernels' arithmetic
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl


PREFETCH_BYTES = 4096     # bytes one L2 prefetch request covers (a multiple of 16)


@triton.jit
def prefetch_l2(base_ptr, nbytes: tl.constexpr):
    """Ask the L2 for ``nbytes`` contiguous bytes from ``base_ptr`` (a byte pointer), PREFETCH_BYTES per request."""
    chunks = tl.arange(0, nbytes // 4096) * 4096
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], 4096;\n mov.u32 $0, 0;", "=r,l",
                              [base_ptr + chunks], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def gemv_kernel(w_ptr, x_ptr, y_ptr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                USE_PDL: tl.constexpr, TILE0_EARLY: tl.constexpr, NUM_STAGES: tl.constexpr,
                LATE_TRIGGER: tl.constexpr, PREFETCH: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows[:, None] * K
    if PREFETCH:                          # this program's rows are one contiguous slice of the weight
        prefetch_l2(w_ptr.to(tl.pointer_type(tl.int8)) + pid * BLOCK_N * K * 2, BLOCK_N * K * 2)
    if TILE0_EARLY:                       # the weight does not depend on the previous kernel: load before the wait
        w0 = tl.load(w_rows + cols[None, :])
    if USE_PDL:
        if not LATE_TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()          # the activation is the previous kernel's output
        if LATE_TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
    x0 = tl.load(x_ptr + cols)
    if not TILE0_EARLY:
        w0 = tl.load(w_rows + cols[None, :])
    acc = tl.sum(w0.to(tl.float32) * x0.to(tl.float32)[None, :], axis=1)
    for kk in tl.range(BLOCK_K, K, BLOCK_K, num_stages=NUM_STAGES):
        w = tl.load(w_rows + (kk + cols)[None, :])
        x = tl.load(x_ptr + kk + cols)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty))


@triton.jit
def persistent_chain_kernel(w_ptr, x_ptr, y_ptr, state_ptr, GEMVS: tl.constexpr, N: tl.constexpr,
                            K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                            SLEEP: tl.constexpr):
    """GEMVS chained GEMVs y_g = W_g · y_(g-1) (W stacked (GEMVS, N, K), y (GEMVS, N)) in one launch of GEMVS · N /
    BLOCK_N programs. ``state``: int32 [ticket, done_0 .. done_(GEMVS-1)], zero before a launch and after it."""
    TILES: tl.constexpr = N // BLOCK_N
    task = tl.atomic_add(state_ptr, 1)                 # tasks in the order programs start: waits point backwards
    g = task // TILES
    rows = (task % TILES) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + g.to(tl.int64) * N * K + rows[:, None] * K
    w0 = tl.load(w_rows + cols[None, :])               # the weight does not wait for the previous GEMV
    if g == 0:
        src = x_ptr
    else:
        src = y_ptr + (g - 1) * N
        while tl.load(state_ptr + g, volatile=True) < TILES:   # every tile of GEMV g - 1 stored and counted
            if SLEEP > 0:
                tl.inline_asm_elementwise(f"nanosleep.u32 {SLEEP};\n mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                          is_pure=False, pack=1)
        # what those tiles stored is visible from here on: an acquire, its value (TILES) used so it stays
        src += tl.atomic_add(state_ptr + g, 0, sem="acquire") - TILES
    x0 = tl.load(src + cols, cache_modifier=".cg")
    acc = tl.sum(w0.to(tl.float32) * x0.to(tl.float32)[None, :], axis=1)
    for kk in tl.range(BLOCK_K, K, BLOCK_K, num_stages=NUM_STAGES):
        w = tl.load(w_rows + (kk + cols)[None, :])
        x = tl.load(src + kk + cols, cache_modifier=".cg")
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(y_ptr + g * N + rows, acc.to(y_ptr.dtype.element_ty))
    tl.debug_barrier()                                 # the whole tile stored before it counts itself done
    done = tl.atomic_add(state_ptr + 1 + g, 1, sem="release")
    if (g == GEMVS - 1) & (done == TILES - 1):         # the chain's last task: every counter back to zero
        for i in tl.static_range(GEMVS + 1):
            tl.atomic_xchg(state_ptr + i, 0)


def persistent_chain(stacked, x, out, state, block_n: int = 16, block_k: int = 512, warps: int = 2,
                     stages: int = 3, sleep: int = 64):
    """The ``persistent`` variant: stacked (GEMVS, n, k) weights, out (GEMVS, n), state zeroed int32 (GEMVS + 1)."""
    gemvs, n, k = stacked.shape
    persistent_chain_kernel[(gemvs * n // block_n,)](stacked, x, out, state, GEMVS=gemvs, N=n, K=k, BLOCK_N=block_n,
                                                     BLOCK_K=block_k, NUM_STAGES=stages, SLEEP=sleep,
                                                     num_warps=warps)
    return out[-1]


def chain(weights, x, outs, variant: str, block_n: int = 16, block_k: int = 512, warps: int = 2, stages: int = 3):
    pdl, early = variant.startswith("pdl"), variant == "pdl+tile0"
    late, prefetch = variant.startswith("pdl-late"), variant.endswith("prefetch")
    extra = {"launch_pdl": True} if pdl else {}
    src = x
    for w, y in zip(weights, outs):
        n, k = w.shape
        gemv_kernel[(n // block_n,)](w, src, y, K=k, BLOCK_N=block_n, BLOCK_K=block_k, USE_PDL=pdl,
                                     TILE0_EARLY=early, NUM_STAGES=stages, LATE_TRIGGER=late,
                                     PREFETCH=prefetch, num_warps=warps, **extra)
        src = y
    return outs[-1]


def reference(weights, x):
    y = x.float()
    for w in weights:
        y = (w.float() @ y).to(x.dtype).float()
    return y


def cpu_check() -> None:
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(64, 64, generator=gen) / 8 for _ in range(3)]
    x = torch.randn(64, generator=gen)
    outs = [torch.empty(64) for _ in ws]
    got = chain(ws, x, outs, "plain", block_k=32, warps=1)
    want = reference(ws, x)
    err = (got - want).abs().max().item()
    print(json.dumps({"cpu_check": "plain", "max_abs_err": err}))
    assert err < 1e-3, err
    # the interpreter runs programs one after another in launch order: each takes the next ticket, and its wait is
    # already met; the second call checks that the first left the counters at zero
    state = torch.zeros(len(ws) + 1, dtype=torch.int32)
    out = torch.empty(len(ws), 64)
    for call in range(2):
        got = persistent_chain(torch.stack(ws), x, out, state, block_k=32, warps=1, sleep=0)
        err = (got - want).abs().max().item()
        print(json.dumps({"cpu_check": "persistent", "call": call, "max_abs_err": err,
                          "state_after": state.tolist()}))
        assert err < 1e-3 and not state.any(), (err, state)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kernels", type=int, default=8)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--cpu-check", action="store_true")
    args = p.parse_args()
    if args.cpu_check:
        return cpu_check()
    from torch_mirage.analysis.device import calibrate
    from torch_mirage.timing import cuda_graph_time_us
    copy_bps = calibrate().measured_copy_bandwidth
    dev, bf = "cuda", torch.bfloat16
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    nbytes = args.kernels * args.n * args.k * 2
    sets_n = max(2, -(-3 * l2 // nbytes))          # weight sets rotated past L2
    gen = torch.Generator(device=dev).manual_seed(0)
    sets = [[[torch.randn(args.n, args.k, device=dev, dtype=bf, generator=gen) * args.k ** -0.5
              for _ in range(args.kernels)], torch.randn(args.k, device=dev, dtype=bf, generator=gen)]
            for _ in range(sets_n)]
    outs = [torch.empty(args.n, device=dev, dtype=bf) for _ in range(args.kernels)]
    floor_us = nbytes / copy_bps * 1e6
    rows = {}
    stacked = [[torch.stack(ws), x] for ws, x in sets]      # the persistent variant's weights, one tensor a set
    out = torch.empty(args.kernels, args.n, device=dev, dtype=bf)
    state = torch.zeros(args.kernels + 1, device=dev, dtype=torch.int32)
    for variant in ("plain", "pdl", "pdl+tile0", "pdl-late", "pdl-late+prefetch", "prefetch", "persistent"):
        try:
            if variant == "persistent":
                run = lambda w, x: persistent_chain(w, x, out, state)    # noqa: E731
                timing_sets = stacked
            else:
                run = lambda ws, x, v=variant: chain(ws, x, outs, v)     # noqa: E731
                timing_sets = sets
            got = run(*timing_sets[0]).float()
            want = reference(*sets[0])
            err = ((got - want).norm() / want.norm()).item()
            us = cuda_graph_time_us(run, timing_sets, replays=10, repeats=5)
        except Exception as e:      # PDL missing from this Triton / driver: say so, keep the other rows
            print(f"{variant}: failed ({type(e).__name__}: {str(e)[:200]})")
            continue
        rows[variant] = {"us": round(us, 2), "us_per_kernel": round(us / args.kernels, 2),
                         "floor_fraction": round(floor_us / us, 3), "rel_err": err}
        print(f"{variant:10s} {us:8.2f} µs  {us / args.kernels:6.2f} µs/kernel  {floor_us / us:5.2f} of the floor"
              f"  err {err:.1e}")
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
           "kernels": args.kernels, "n": args.n, "k": args.k, "floor_us": round(floor_us, 2), "variants": rows}
    print(json.dumps(out))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "pdl_probe.json"), "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
