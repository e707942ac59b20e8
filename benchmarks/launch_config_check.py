"""Every launch config of an attention seed, run on the GPU and checked against an fp64 reference.

``superopt.launch.choose`` compares candidate configs with the first one that ran; this script instead checks
each candidate (the μGraph's own schedule and its re-tilings, split-KV included) against fp64 attention with
soft-cap and an additive mask, and names the configs whose output is non-finite or wrong, with the path of
their generated Triton source. Prints one line per config; exits 1 when any config is wrong.

    python benchmarks/launch_config_check.py [--seed flash_decoding] [--dtype float16] [--limit 8]
        [--band causal|window]

``--band``: the seeds with a for-loop band (masked-tile skipping) and a mask that is exactly that band (bottom-right
causal, offset skv - rows, or a 1024-key sliding window: most KV splits of a decode row are then empty).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from torch_mirage.numerics import relative_error, tolerance  # noqa: E402
from torch_mirage.superopt.launch import candidates  # noqa: E402
from torch_mirage.superopt.attention_seeds import SEEDS  # noqa: E402
from torch_mirage.superopt.compile import BlockLauncher  # noqa: E402


def reference(q, k, v, m, scale, cap):
    s = torch.tanh(q.double() @ k.double().transpose(-1, -2) * scale / cap) * cap + m.double()
    return torch.softmax(s, -1) @ v.double()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", nargs="+", default=list(SEEDS))
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--masked-from", type=int, default=3000, help="keys from here on get -1e30 (default 3000)")
    ap.add_argument("--band", choices=["none", "causal", "window"], default="none")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    out_dir = os.environ.get("OUT") or tempfile.mkdtemp()
    bad = 0
    for seed in args.seed:
        b, hk, rows, skv, d = 2, 8, 4 if seed == "flash_decoding" else 256, 4096, 128
        window = 1024 if args.band == "window" else None
        band = None if args.band == "none" else (rows, skv - rows, window, True)
        g = SEEDS[seed](b, hk, rows, skv, d, scale=d ** -0.5, softcap=50.0, mask=(1, 1), dtype=args.dtype,
                        mask_dtype="float32", band=band)
        q, k, v = (torch.randn(s, device="cuda", dtype=dtype)
                   for s in ((b, hk, rows, d), (b, hk, skv, d), (b, hk, skv, d)))
        m = torch.zeros(1, 1, rows, skv, device="cuda")
        if band is None:
            m[..., args.masked_from:] = -1e30
        else:
            i = torch.arange(rows, device="cuda")[:, None] + skv - rows
            j = torch.arange(skv, device="cuda")[None, :]
            m[..., (j > i) | ((j <= i - window) if window else torch.zeros_like(j > i))] = -1e30
        want = reference(q, k, v, m, d ** -0.5, 50.0)
        kernels = [o for o in g.ops if o.name != "input"]
        if len(kernels) != 1 or kernels[0].name != "customized":
            print(f"{seed}: skipped (not one graph-defined kernel over the inputs: {[o.name for o in kernels]})")
            continue
        op = kernels[0]
        n_sm = torch.cuda.get_device_properties(0).multi_processor_count
        for cfg in candidates(op.body, n_sm, args.limit):
            try:
                run = BlockLauncher(op.body, cfg, [4, 4, 4, 4], out_dir, f"{seed}_check")
                ws = [torch.zeros(shape, dtype=dt, device="cuda") for shape, dt in run.ws_specs]
                (got,) = run(q, k, v, m, workspaces=ws)
                torch.cuda.synchronize()
            except Exception as e:   # a config that does not compile (shared memory, registers) is not wrong
                print(f"{seed} {cfg}: not built ({type(e).__name__}: {str(e)[:80]})")
                continue
            finite = bool(torch.isfinite(got).all())
            err = relative_error(got, want) if finite else float("nan")
            ok = finite and err <= tolerance(dtype)
            bad += not ok
            print(f"{seed} band={args.band} {cfg}: {'ok' if ok else 'WRONG'} rel.err {err:.2e} finite={finite} "
                  f"nan rows={int(got.isnan().any(-1).sum())} source={getattr(run, 'path', '?')}")
            if not finite and ws:   # which split's partial results (running max, sum, P·V) are not finite
                for j, (t, n) in enumerate(zip(ws, run.kernel.workspaces)):
                    per_split = (~torch.isfinite(t.view(-1, cfg.split, n))).sum(dim=(0, 2)).tolist()
                    print(f"    workspace {j}: non-finite entries per split {per_split}; "
                          f"min {float(t[torch.isfinite(t)].min()) if torch.isfinite(t).any() else 'none'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
