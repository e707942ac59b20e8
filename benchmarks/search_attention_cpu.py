"""The μGraph search on attention, on the CPU (issue 15): GQA attention and QK-norm attention in the forms
``tests/test_search_attention.py`` checks, fp32 and fp16, compiled with the search claimer alone (library seeds
and stitching off, no cache). Per form and dtype it reports whether the search claimed one region, its search
seconds, candidates, verified μGraphs, the whole compile's seconds and the largest difference from an fp64 eager
reference; then, per form, the same search on the region's reference program with the goal-directed skeletons
off (``search(decompose=False)``: the DFS alone) within the budget. Prints a table and one JSON object; writes
``benchmarks/results/search_attention_cpu.json`` with ``--write``.

    PYTHONPATH=. python benchmarks/search_attention_cpu.py [--budget 30] [--only gqa_sdpa] [--no-dfs] [--write]
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
import test_search_attention as T  # noqa: E402
from torch_mirage.superopt.search import native  # noqa: E402
from torch_mirage.superopt.search.driver import search  # noqa: E402

FORMS = dict(zip(T.IDS, T.FORMS))


def _fn(name):
    kind, fn = FORMS[name]
    return kind, (fn(T.D_) if isinstance(fn, type) else fn), isinstance(fn, type)


def run(name: str, dtype: torch.dtype, budget: float) -> dict:
    kind, fn, module = _fn(name)
    torch.manual_seed(0)
    xs = [x.to(dtype) for x in T._inputs(kind)[:3 if module else None]]
    report = torch_mirage.Report()
    opts = dict(ugraph_library=False, stitch=False, search=True, search_budget_s=budget, measure_regions=False,
                cache=False)
    torch._dynamo.reset()
    t0 = time.monotonic()
    with torch.no_grad():
        out = torch.compile(fn.to(dtype) if module else fn,
                            backend=torch_mirage.MirageBackend(options=opts, report=report))(*xs)
        wall = time.monotonic() - t0
        want = (fn.double() if module else fn)(*[x.double() for x in xs])
    searched = [r for r in report.regions if r.claimer == "ugraph-search"]
    row = {"shapes": [list(x.shape) for x in xs], "claimed": len(searched), "compile_s": round(wall, 2),
           "max_abs_err": float((out.double() - want).abs().max())}
    if searched:
        info = searched[0].info
        row.update({k: info[k] for k in ("search_s", "candidates", "verified", "rejected_by_probe",
                                         "rejected_by_verifier", "source")})
    return row


def dfs_only(name: str, budget: float) -> dict:
    """The region's reference searched with the DFS alone (fp32, one process)."""
    kind, fn, module = _fn(name)
    xs = T._inputs(kind)[:3 if module else None]
    if module:
        names = [n for n, _ in fn.named_parameters()]
        params = [p.detach() for _, p in fn.named_parameters()]
        call = lambda *a: torch.func.functional_call(fn, dict(zip(names, a[3:])), a[:3])  # noqa: E731
        xs = xs + params
    else:
        call = fn
    ref = T._reference(call, xs)
    t0 = time.monotonic()
    r = search(ref.graph, T._specs(ref), budget_s=budget, workers=1, decompose=False)
    return {"found": r.best is not None, "seconds": round(time.monotonic() - t0, 2), "depth": r.stats.depth,
            "generated": r.stats.generated, "pruned": r.stats.pruned, "timed_out": r.stats.timed_out}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=30.0)
    ap.add_argument("--only", default=None)
    ap.add_argument("--no-dfs", action="store_true", help="skip the DFS-alone runs (each may take the budget)")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)
    out = {"budget_s": args.budget, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
           "torch": torch.__version__, "search_core": "C++" if native.search_core() is not None else "Python",
           "results": {}, "dfs_only": {}}
    print(f"{'form':24} {'dtype':8} {'claimed':>7} {'search_s':>8} {'cand':>4} {'verif':>5} {'compile_s':>9} err")
    for name in FORMS:
        if args.only and name != args.only:
            continue
        for dtype in (torch.float32, torch.float16):
            r = out["results"][f"{name}/{str(dtype)[6:]}"] = run(name, dtype, args.budget)
            print(f"{name:24} {str(dtype)[6:]:8} {r['claimed']:>7} {r.get('search_s', '-'):>8} "
                  f"{r.get('candidates', '-'):>4} {r.get('verified', '-'):>5} {r['compile_s']:>9} "
                  f"{r['max_abs_err']:.2e}")
    if not args.no_dfs:
        print(f"\n{'DFS alone':24} {'found':>5} {'seconds':>8} {'depth':>5} {'generated':>10} {'pruned':>10}")
        for name in FORMS:
            if args.only and name != args.only:
                continue
            r = out["dfs_only"][name] = dfs_only(name, args.budget)
            print(f"{name:24} {str(r['found']):>5} {r['seconds']:>8} {r['depth']:>5} {r['generated']:>10} "
                  f"{r['pruned']:>10}")
    print(json.dumps(out, indent=1))
    if args.write:
        with open(os.path.join(HERE, "results", "search_attention_cpu.json"), "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
