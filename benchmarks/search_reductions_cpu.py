"""The μGraph search on reduction chains without a matmul, on the CPU (issue 15): nTrans and residual
RMSNorm / LayerNorm, each in the forms ``tests/test_search_reductions.py`` checks, compiled with the
search claimer alone (library seeds and stitching off, no cache). Per form it reports whether the
search claimed one region, its search seconds, block ops generated / pruned, candidates, verified
μGraphs, the whole compile's seconds and the largest difference from eager. Prints a table and one
JSON object; writes ``benchmarks/results/search_reductions_cpu.json`` with ``--write``.

    PYTHONPATH=. python benchmarks/search_reductions_cpu.py [--budget 30] [--only ntrans_rsqrt] [--write]
"""
import argparse
import json
import os
import platform
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))      # the forms the tests check (and their conftest)

import torch  # noqa: E402

import torch_mirage  # noqa: E402
import test_search_reductions as T  # noqa: E402
from torch_mirage.superopt.search import native  # noqa: E402

NT = [(4, 32)] * 3
LN = [(4, 32), (4, 32), (32,), (32,)]
FORMS = {"ntrans_rsqrt": (T.ntrans_rsqrt, NT), "ntrans_div_sqrt": (T.ntrans_div_sqrt, NT),
         "ntrans_F_rms_norm": (T.ntrans_f_rms_norm, NT),
         "hf_residual_rmsnorm_3d": (lambda: T.ResidualNorm(32), [(2, 4, 32)] * 2),
         "layernorm_F": (T.layernorm_f, LN), "layernorm_by_hand": (T.layernorm_by_hand, LN),
         "nn_LayerNorm_residual_3d": (lambda: T.PreNormResidual(32), [(2, 4, 32)] * 2)}
MODULES = {"hf_residual_rmsnorm_3d", "nn_LayerNorm_residual_3d"}


def run(name: str, budget: float) -> dict:
    make, shapes = FORMS[name]
    fn = make() if name in MODULES else make
    torch.manual_seed(0)
    xs = [torch.randn(s) for s in shapes]
    report = torch_mirage.Report()
    opts = dict(ugraph_library=False, stitch=False, search=True, search_budget_s=budget, measure_regions=False,
                cache=False)
    torch._dynamo.reset()
    t0 = time.monotonic()
    out = torch.compile(fn, backend=torch_mirage.MirageBackend(options=opts, report=report))(*xs)
    wall = time.monotonic() - t0
    searched = [r for r in report.regions if r.claimer == "ugraph-search"]
    row = {"shapes": [list(s) for s in shapes], "claimed": len(searched), "compile_s": round(wall, 2),
           "max_abs_err": float((out - fn(*xs)).detach().abs().max())}
    if searched:
        info = searched[0].info
        row.update({k: info[k] for k in ("search_s", "generated", "pruned", "candidates", "verified",
                                         "rejected_by_probe", "rejected_by_verifier", "source")})
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=30.0)
    ap.add_argument("--only", default=None)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)
    out = {"budget_s": args.budget, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
           "torch": torch.__version__, "search_core": "C++" if native.search_core() is not None else "Python",
           "results": {}}
    print(f"{'form':26} {'claimed':>7} {'search_s':>8} {'generated':>9} {'pruned':>9} {'cand':>4} {'verif':>5} "
          f"{'compile_s':>9} err")
    for name in FORMS:
        if args.only and name != args.only:
            continue
        r = out["results"][name] = run(name, args.budget)
        print(f"{name:26} {r['claimed']:>7} {r.get('search_s', '-'):>8} {r.get('generated', '-'):>9} "
              f"{r.get('pruned', '-'):>9} {r.get('candidates', '-'):>4} {r.get('verified', '-'):>5} "
              f"{r['compile_s']:>9} {r['max_abs_err']:.2e}")
    print(json.dumps(out, indent=1))
    if args.write:
        with open(os.path.join(HERE, "results", "search_reductions_cpu.json"), "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
