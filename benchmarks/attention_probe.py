"""Where the attention μGraph's partial kernel loses time against what Triton can do on the same tiles.

For one launch config of the FlashAttention μGraph (gqa shapes of DESIGN.md), times on the GPU, each replayed
in a CUDA graph over inputs rotated past L2:

* ``generated``: the kernel pair codegen emits (partial kernel + combine);
* ``exp2``: the same source with ``exp`` as ``exp2`` and log2(e) folded into the score scale (the combine
  kernel rescales with ``exp2`` too, so the states stay consistent);
* ``partial only`` rows: the partial kernel alone, for both;
* ``hand``: a hand-written partial kernel on the same grid and tiles, written the way Triton's attention
  tutorial is (1-d row states, exp2, K read transposed through its strides), writing the same workspaces.

and counts ``convert_layout`` ops and ``ex2`` instructions of the generated partial kernel (TTGIR / PTX).
With ``--qknorm``, instead: the QK-norm attention μGraph (norms fused into the attention kernel) against plain
attention, each compiled and launch-tuned the way the backend does. (A form with K's norm moved after the matmul
as a per-key scale of the score columns was measured this way too, and dropped: 47.7 µs at b = 8 against the
fused rows' 23.4, `results/raw/attnprobe-qknorm-b8.log`.) Prints a table; nothing here is used by the backend.

    python benchmarks/attention_probe.py --batch 8 --config 2x8x2:64:4:4:3
    python benchmarks/attention_probe.py --batch 8 --qknorm
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tempfile

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch_mirage.superopt.launch import LaunchConfig  # noqa: E402
from torch_mirage.codegen.loader import load_source  # noqa: E402
from torch_mirage.numerics import relative_error  # noqa: E402
from torch_mirage.timing import cuda_graph_time_us, rotated_input_sets  # noqa: E402
from torch_mirage.superopt import library  # noqa: E402
from torch_mirage.superopt.compile import BlockLauncher, compile_ugraph  # noqa: E402

LOG2E = 1.4426950408889634


@triton.jit
def hand_partial(q_ptr, k_ptr, v_ptr, m_ws, l_ws, o_ws, sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
                 B: tl.constexpr, QB: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 D: tl.constexpr, PER: tl.constexpr, qk_scale: tl.constexpr, NUM_STAGES: tl.constexpr):
    h = tl.program_id(0) // SPLIT
    split = tl.program_id(0) % SPLIT
    b = tl.program_id(1)
    qb = tl.program_id(2)
    rm = qb * BM + tl.arange(0, BM)
    rd = tl.arange(0, D)
    rn = tl.arange(0, BN)
    q = tl.load(q_ptr + b * sq_b + h * sq_h + rm[:, None] * sq_m + rd[None, :])
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, D), tl.float32)
    for it in tl.range(split * PER, split * PER + PER, num_stages=NUM_STAGES):
        kt = tl.load(k_ptr + b * sk_b + h * sk_h + (it * BN + rn)[None, :] * sk_n + rd[:, None])
        v = tl.load(v_ptr + b * sv_b + h * sv_h + (it * BN + rn)[:, None] * sv_n + rd[None, :])
        qk = tl.dot(q, kt)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    slot = ((h * B + b) * QB + qb) * SPLIT + split
    tl.store(m_ws + slot * BM + tl.arange(0, BM), m_i)
    tl.store(l_ws + slot * BM + tl.arange(0, BM), l_i)
    tl.store(o_ws + slot * BM * D + tl.arange(0, BM)[:, None] * D + rd[None, :], acc)


def exp2_variant(source: str, d: int) -> str:
    scale = 1.0 / math.sqrt(d)
    out = source.replace(f"* {scale!r}", f"* {scale * LOG2E!r}")
    assert out != source, "score scale not found in the generated source"
    return out.replace("tl.exp(", "tl.math.exp2(")


def compiled_asm(fn, key: str) -> str:
    """The text of one stage (ttgir / ptx) of the last specialisation of a JIT function that ran."""
    for cache in getattr(fn, "device_caches", {}).values():
        kernels = cache[0] if isinstance(cache, tuple) else cache
        for k in list(kernels.values())[-1:]:
            return k.asm.get(key, "")
    return ""


def qknorm_forms(batch: int) -> None:
    b, h, sq, kv, d = library.bench_dims("qknorm_attention", batch)
    gen = torch.Generator(device="cuda").manual_seed(0)
    xs = [torch.randn(s, generator=gen, device="cuda").half()
          for s in library.WORKLOADS["qknorm_attention"].input_shapes(b, h, sq, kv, d)]
    want = library.qknorm_attention_ref(*[x.double() for x in xs], eps=1e-6)
    sets = rotated_input_sets(xs, torch.cuda.get_device_properties(0).L2_cache_size, max_sets=64)
    print(f"qknorm_attention b={batch} dims {(b, h, sq, kv, d)}, {len(sets)} input sets")
    for name, g, n_in in (("QK norms fused", library.qknorm_attention(b, h, sq, kv, d, eps=1e-6), 5),
                          ("attention without norms", library.gqa_flashattention(b, h, sq, kv, d), 3)):
        run = compile_ugraph(g, xs[:n_in])
        out = run(*xs[:n_in])[0]
        err = relative_error(out, want) if n_in == 5 else float("nan")
        us = cuda_graph_time_us(run, [s_[:n_in] for s_ in sets], replays=10, repeats=5)
        cfg = [st.launcher.config for st in run.steps if st.launcher is not None]
        print(f"    {name:28s} {us:8.2f} µs  err {err:.1e}  {cfg}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--config", nargs="+", default=["2x8x2:64:4:4:3"], metavar="GRID:LOOP:SPLIT:WARPS:STAGES")
    p.add_argument("--qknorm", action="store_true", help="compare the QK-norm attention forms instead")
    args = p.parse_args()
    if args.qknorm:
        return qknorm_forms(args.batch)
    b, h, sq, kv, d = library.bench_dims("gqa_flashattention", args.batch)
    kg = library.gqa_flashattention(b, h, sq, kv, d)
    bg = next(o for o in kg.ops if o.name == "customized").body
    gen = torch.Generator(device="cuda").manual_seed(0)
    xs = [torch.randn(s, generator=gen, device="cuda").half() for s in library.WORKLOADS["gqa_flashattention"]
          .input_shapes(b, h, sq, kv, d)]
    want = library.attention_ref(*[x.double() for x in xs])
    props = torch.cuda.get_device_properties(0)
    sets = rotated_input_sets(xs, props.L2_cache_size, max_sets=16)
    flops = 4.0 * b * h * sq * kv * d
    cache_dir = tempfile.mkdtemp()
    print(f"gqa_flashattention b={args.batch} dims {(b, h, sq, kv, d)}, {flops / 1e9:.2f} GFLOP")
    for spec in args.config:
        g, f, s, w, st = spec.split(":")
        cfg = LaunchConfig(tuple(int(x) for x in g.split("x")), int(f), int(s), int(w), int(st))
        run = BlockLauncher(bg, cfg, [4, 4, 4], cache_dir)
        rows = []

        def timed(name, fn, check=True):
            out = fn(*xs)
            err = relative_error(out[0], want) if check else float("nan")
            us = cuda_graph_time_us(fn, sets, replays=10, repeats=5)
            rows.append((name, us, err))

        timed("generated", run)
        ws = [torch.empty(sh, dtype=dt, device="cuda") for sh, dt in run.ws_specs]

        def partial(*ins, fn=None):
            fn = fn or run.fn
            a = []
            for t in ins:
                a += [t, *t.stride()]
            fn[run.launch_grid](*a, *ws, NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps,
                                num_stages=cfg.num_stages)
            return ws
        timed("generated, partial only", partial, check=False)
        ttgir = compiled_asm(run.fn, "ttgir")
        ptx = compiled_asm(run.fn, "ptx")
        loop = ttgir[ttgir.find("scf.for"):] if "scf.for" in ttgir else ""
        n_ex2 = len(re.findall(r"ex2\.approx", ptx))
        print(f"  {cfg}: TTGIR convert_layout {ttgir.count('convert_layout')} (after scf.for: "
              f"{loop.count('convert_layout')}), wgmma {ttgir.count('warp_group_dot')}, "
              f"ex2 in PTX {n_ex2}, local (spill) {ptx.count('ld.local')}")

        mod, _ = load_source(exp2_variant(run.source, d), cache_dir, prefix="probe")
        run.fn, run.combine_fn = getattr(mod, run.kernel.name), getattr(mod, run.kernel.combine)
        timed("exp2", run)
        timed("exp2, partial only", partial, check=False)

        grid = cfg.grid
        bm, bn = sq // grid[2], kv // cfg.forloop_range

        def hand(*ins):
            q, k, v = ins
            hand_partial[run.launch_grid](q, k, v, *ws, q.stride(0), q.stride(1), q.stride(2), k.stride(0),
                                          k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                                          B=b, QB=grid[2], SPLIT=cfg.split, BM=bm, BN=bn, D=d,
                                          PER=cfg.forloop_range // cfg.split, qk_scale=LOG2E / math.sqrt(d),
                                          NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps,
                                          num_stages=cfg.num_stages)
            return ws

        def hand_full(*ins):
            hand(*ins)
            out = torch.empty_like(ins[0])
            run.combine_fn[run.combine_grid](out, *out.stride(), *ws, num_warps=cfg.num_warps)
            return [out]
        timed("hand (tutorial-style) + exp2 combine", hand_full)
        timed("hand, partial only", hand, check=False)
        for name, us, err in rows:
            tf = flops / (us * 1e-6) / 1e12
            print(f"    {name:40s} {us:8.2f} µs  {tf:6.1f} TFLOP/s  err {err:.1e}")


if __name__ == "__main__":
    main()
