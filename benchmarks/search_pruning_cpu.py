"""Abstract-expression pruning on vs off in the μGraph search, on the CPU (issue 15's acceptance: the
pruning cuts candidates by >= 10x). For each target (written with pre-defined kernel ops, seeds off)
the search runs with the oracle's structural front alone, with the front plus Z3, and without pruning
(each mode under the same budget); it reports the block ops generated (states), those pruned, the
complete candidates, verified μGraphs, seconds, and whether a verified μGraph was found. Prints a
table and one JSON object; writes ``$OUT/search_pruning_cpu.json`` when ``$OUT`` is set.

    python benchmarks/search_pruning_cpu.py [--budget 60] [--only rmsnorm_linear]
"""
import argparse
import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

from torch_mirage.superopt.builder import new_kernel_graph   # noqa: E402
from torch_mirage.superopt.search.driver import search          # noqa: E402

M, K, N = 4, 32, 24


def silu_matmul():
    g = new_kernel_graph()
    X, W = g.new_input((M, K), "float32"), g.new_input((K, N), "float32")
    g.mark_output(g.silu(g.matmul(X, W)))
    return g.build()


def rmsnorm_linear():
    g = new_kernel_graph()
    X, G, W = g.new_input((M, K), "float32"), g.new_input((K,), "float32"), g.new_input((K, N), "float32")
    r = g.rsqrt(g.reduce_mean(g.mul(X, X), dim=1))
    g.mark_output(g.matmul(g.mul(g.mul(X, r), G), W))
    return g.build()


def gated_mlp():
    g = new_kernel_graph()
    X, W1, W3 = (g.new_input(s, "float32") for s in ((M, K), (K, N), (K, N)))
    g.mark_output(g.mul(g.silu(g.matmul(X, W1)), g.matmul(X, W3)))
    return g.build()


TARGETS = {"silu_matmul": silu_matmul, "rmsnorm_linear": rmsnorm_linear, "gated_mlp": gated_mlp}
MODES = {"front": dict(prune=True, oracle_kwargs=dict(use_z3=False)),
         "front+z3": dict(prune=True),                                       # the driver's default policy
         "front+z3 keep": dict(prune=True, oracle_kwargs=dict(strict=False)),  # unproven misses kept
         "off": dict(prune=False)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=60.0)
    ap.add_argument("--only", default=None)
    args = ap.parse_args(argv)
    out = {"budget_s": args.budget, "shapes": {"m": M, "k": K, "n": N}, "results": {}}
    print(f"{'target':16} {'mode':13} {'generated':>10} {'pruned':>10} {'cand':>5} {'verif':>5} {'seconds':>8} found")
    for name, make in TARGETS.items():
        if args.only and name != args.only:
            continue
        ref = make()
        specs = [(op.shapes[0], op.dtypes[0]) for op in ref.inputs]
        res = {}
        for mode, kw in MODES.items():
            r = search(ref, specs, budget_s=args.budget, tile=8, **kw)
            s = r.stats
            res[mode] = {"generated": s.generated, "pruned": s.pruned, "candidates": s.candidates,
                         "verified": s.verified, "depth": s.depth, "timed_out": s.timed_out,
                         "seconds": round(s.seconds, 3), "found": r.best is not None, "oracle": s.oracle}
            print(f"{name:16} {mode:13} {s.generated:>10} {s.pruned:>10} {s.candidates:>5} {s.verified:>5} "
                  f"{s.seconds:>8.2f} {r.best is not None}{' (timed out)' if s.timed_out else ''}", flush=True)
        if res["front"]["generated"]:
            res["off_over_front_generated"] = round(res["off"]["generated"] / res["front"]["generated"], 1)
        out["results"][name] = res
    return emit(out, "search_pruning_cpu.json")


def emit(out: dict, filename: str) -> dict:
    """Print ``out`` as one JSON line and, where $OUT is set (a device run), write it there as ``filename``."""
    print(json.dumps(out))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], filename), "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
