"""Probe: which pair of launch configs makes the fastest sibling launch of a decode layer's QKV + RoPE seed.

The build stage tunes each kernel op of a weight-streaming μGraph alone, then runs siblings as one launch at the
configs each won alone (:mod:`torch_mirage.superopt.siblings`). At b8 the llama layer's QKV launch streams 50 MB
in 26 µs (NOTES, 11-27 ninth: 0.65 of copy) where each part alone is near its floor. This times every part's
launch candidates alone, then the sibling launch of each pair among each part's ``--top`` fastest (at each part's
num_warps), against the pair of alone-winners, so that it shows whether tuning the pair would gain.

    python benchmarks/sibling_pairs_gpu.py [--model llama|qwen2] [--batch 8] [--top 4] [--dtype bfloat16]
        [--extra 1:8x8:16:4 ...]

``--extra PART:GRID:LOOP:SPLIT`` times one more re-tiling of kernel op PART (grid dims joined by x; a split folded
in-kernel) at 4 warps / 3 stages and 4 / 4.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch.nn.functional as F  # noqa: E402

from ugraph_config_sweep import SEED_VARIANTS, _rope  # noqa: E402
from torch_mirage.numerics import rms_norm  # noqa: E402  (this directory)
from torch_mirage.bench import workloads  # noqa: E402
from torch_mirage.capture.lower import trace  # noqa: E402
from torch_mirage.superopt.compile import BlockLauncher, op_arguments  # noqa: E402
from torch_mirage.superopt.gemv_seed import gemv_seed  # noqa: E402
from torch_mirage.superopt.launch import LaunchConfig, streaming_candidates  # noqa: E402
from torch_mirage.superopt.search.reference import reference_of  # noqa: E402
from torch_mirage.superopt.siblings import SiblingLauncher, regroup  # noqa: E402
from torch_mirage.timing import cuda_graph_time_us, rotated_input_sets  # noqa: E402


# (hidden, query heads, KV heads, q / k / v biases) of the LLM bench's models' QKV projections (heads of 128)
SHAPES = {"llama": (4096, 32, 8, False), "qwen2": (3584, 28, 4, True)}


def _qkv_rope_bias(x, cos, sin, g, wq, wk, wv, bq, bk, bv):
    h = rms_norm(x, 1e-5, g)
    heads = [F.linear(h, w, b).view(x.shape[0], 1, -1, 128).transpose(1, 2) for w, b in ((wq, bq), (wk, bk), (wv, bv))]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return _rope(heads[0], cos, sin), _rope(heads[1], cos, sin), heads[2]


def _inputs(model: str, batch: int, dtype: torch.dtype, device: str) -> tuple:
    """The QKV program of ``model`` and its inputs: llama's from the bench's decode layer, the others' made here."""
    if model == "llama":
        base, keep, fn = SEED_VARIANTS["rmsnorm_rope_qkv_t"]
        xs = workloads.WORKLOADS[base].make_inputs(batch, dtype, device, 0)
        return fn, [xs[i] for i in keep]
    hidden, heads, kv, bias = SHAPES[model]
    gen = torch.Generator().manual_seed(0)
    w = lambda n: (torch.randn(n, hidden, generator=gen) * hidden ** -0.5).to(device, dtype)   # noqa: E731
    angle = torch.rand(batch, 1, 64, generator=gen) * 6.0
    cos, sin = (torch.cat([f(angle)] * 2, -1).to(device, dtype) for f in (torch.cos, torch.sin))
    xs = [torch.randn(batch, 1, hidden, generator=gen).to(device, dtype), cos, sin,
          (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device, dtype), w(heads * 128), w(kv * 128), w(kv * 128)]
    if not bias:
        return SEED_VARIANTS["rmsnorm_rope_qkv_t"][2], xs
    return _qkv_rope_bias, xs + [(0.1 * torch.randn(n * 128, generator=gen)).to(device, dtype) for n in (heads, kv, kv)]


def qkv_parts(batch: int, dtype: torch.dtype, model: str = "llama", device: str = "cuda"):
    """The QKV seed's kernel ops (block graphs) and each one's argument tensors on ``device``."""
    fn, xs = _inputs(model, batch, dtype, device)
    graph = trace(fn, [x.cpu() for x in xs])
    ref = reference_of(graph.nodes, graph)
    kg = gemv_seed(ref.graph, halves=True)
    pos = {id(v): i for i, v in enumerate(graph.inputs)}
    ins = [xs[pos[id(v)]] for v in ref.inputs]
    return [(op.body, op_arguments(kg, op, ins)) for op in kg.ops if op.name == "customized"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--top", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--model", default="llama", choices=list(SHAPES), help="whose QKV shapes (qwen2: 28 / 4 heads, "
                                                                          "biases)")
    p.add_argument("--extra", nargs="*", default=[], metavar="PART:GRID:LOOP:SPLIT")
    args = p.parse_args()
    props = torch.cuda.get_device_properties(0)
    n_sm, l2 = props.multi_processor_count, props.L2_cache_size
    cache_dir = tempfile.mkdtemp()
    parts = qkv_parts(args.batch, getattr(torch, args.dtype), args.model)
    ranked = []
    for k, (bg, xs) in enumerate(parts):
        sets = rotated_input_sets(xs, l2, max_sets=16)
        ranks = [x.dim() for x in xs]
        rows = []
        extra = [LaunchConfig(tuple(int(x) for x in g.split("x")), int(f), int(sp), w, st, combine_in_kernel=int(sp) > 1)
                 for part, g, f, sp in (e.split(":") for e in args.extra) if int(part) == k for w, st in ((4, 3), (4, 4))]
        for cfg in dict.fromkeys(streaming_candidates(bg, n_sm) + extra):
            if cfg.split > 1 and not cfg.combine_in_kernel:
                continue                     # a combine kernel is a second launch: it cannot join a sibling launch
            try:
                run = BlockLauncher(bg, cfg, ranks, cache_dir, f"part{k}")
                run(*xs)
                us = cuda_graph_time_us(run, sets, replays=10, repeats=3)
            except Exception as e:           # a config whose stages do not fit shared memory
                print(f"part {k} {cfg}: failed ({type(e).__name__}: {str(e)[:80]})")
                continue
            rows.append((us, cfg))
        rows.sort(key=lambda r: r[0])
        nbytes = sum(x.numel() * x.element_size() for x in xs)
        print(f"== part {k} b={args.batch} grid {bg.grid}: {len(rows)} configs, {nbytes / 1e6:.1f} MB")
        for us, cfg in rows:
            print(f"  {us:7.2f} µs  {cfg}")
        ranked.append(rows[:args.top])
    flat_inputs = [x for _, xs in parts for x in xs]
    counts = [len(xs) for _, xs in parts]
    sets = rotated_input_sets(flat_inputs, l2, max_sets=16)
    results = []
    for combo in itertools.product(*ranked):
        for warps in sorted({cfg.num_warps for _, cfg in combo}):
            try:
                flat = [BlockLauncher(bg, cfg, [x.dim() for x in xs], cache_dir, f"part{k}", flat_pid=True)
                        for k, ((bg, xs), (_, cfg)) in enumerate(zip(parts, combo))]
                launcher = SiblingLauncher(flat, warps, cache_dir, "qkv_siblings")
                run = lambda *ts, launcher=launcher: launcher(regroup(counts, ts))     # noqa: E731
                run(*flat_inputs)
                us = cuda_graph_time_us(run, sets, replays=10, repeats=3)
            except Exception as e:
                print(f"pair {[c for _, c in combo]} w{warps}: failed ({type(e).__name__}: {str(e)[:80]})")
                continue
            alone = sum(u for u, _ in combo)
            results.append((us, warps, alone, [c for _, c in combo]))
    results.sort(key=lambda r: r[0])
    winners = [r[0][1] for r in ranked]
    print(f"== sibling launches b={args.batch}: {len(results)} (parts alone summed in brackets)")
    for us, warps, alone, cfgs in results:
        mark = "  <- alone-winners" if cfgs == winners else ""
        print(f"  {us:7.2f} µs ({alone:6.2f})  w{warps}  " + " | ".join(
            f"{c.grid} f{c.forloop_range} s{c.split} {c.num_warps}/{c.num_stages}{' fold' if c.combine_in_kernel else ''}"
            f"{' pro' if c.prologue else ''}" for c in cfgs) + mark)


if __name__ == "__main__":
    main()
