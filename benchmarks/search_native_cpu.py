"""The μGraph search with the generator's C++ core (csrc/search_core.cpp) vs its pure-Python path, on the
CPU, on the search's own test targets (tests/test_search_driver.py, benchmarks/search_pruning_cpu.py; seeds
off, one process). Each (target, oracle mode) runs ``--repeats`` times per path, the two paths interleaved;
reports the median seconds of the whole search and of the skeleton generator alone (the same enumeration
outside the driver, no Z3, no verification), the speed-ups, and whether both paths chose the same μGraph and
counted the same states. ``--pipeline`` instead times the first call of ``torch.compile`` on the search
claimer's test functions (tests/test_search_claim.py: library claimer and stitching off, the search on, cache
off), reporting the region's search seconds and the whole first call. Seconds are this process's CPU time (``time.process_time``: the search runs in this
process, Z3 and the verifier included), which other jobs on a shared machine do not inflate; the whole
search's wall-clock medians are reported beside them. Prints one JSON object; writes ``$OUT/search_native_cpu.json`` when ``$OUT`` is set.

    python benchmarks/search_native_cpu.py [--repeats 3] [--budget 30] [--pipeline]
"""
import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from search_pruning_cpu import M, K, N, TARGETS, emit                    # noqa: E402
from torch_mirage.superopt.builder import new_kernel_graph           # noqa: E402
from torch_mirage.superopt.search import driver as D                 # noqa: E402
from torch_mirage.superopt.search import expr as E                   # noqa: E402
from torch_mirage.superopt.search import native                      # noqa: E402
from torch_mirage.superopt.search.generate import GenStats, enumerate_skeletons  # noqa: E402
from torch_mirage.superopt.search.oracle import SubexprOracle         # noqa: E402


def rms_sum_div_sqrt():
    """RMSNorm+Linear written as (x·g) / sqrt(sum(x²)/k) @ w (tests/test_search_driver.py)."""
    g = new_kernel_graph()
    X, G, W = g.new_input((M, K), "float32"), g.new_input((K,), "float32"), g.new_input((K, N), "float32")
    ms = g.scalar_mul(g.reduce_sum(g.square(X), dim=1), value=1.0 / K)
    g.mark_output(g.matmul(g.div(g.mul(G, X), g.sqrt(ms)), W))
    return g.build()


def lora():
    g = new_kernel_graph()
    X, W, A, B = (g.new_input(s, "float32") for s in ((M, K), (K, N), (K, 4), (4, N)))
    g.mark_output(g.add(g.matmul(g.matmul(X, A), B), g.matmul(X, W)))
    return g.build()


CASES = dict(TARGETS, rms_sum_div_sqrt=rms_sum_div_sqrt, lora=lora)
MODES = {"front": dict(use_z3=False), "front+z3": {}}     # the tests' oracle, the driver's default


def generator_only(ref, depth: int) -> tuple[float, dict]:
    """Seconds of the enumeration of depths 1..depth with the structural oracle, and its stats."""
    specs = [(op.shapes[0], op.dtypes[0]) for op in ref.inputs]
    targets = E.graph_exprs(ref)
    outs = [ref.ops[r[0]].shapes[r[1]] for r in ref.outputs]
    oracle, st = SubexprOracle(targets, use_z3=False), GenStats()
    t = time.process_time()
    for d in range(1, depth + 1):
        for _ in enumerate_skeletons(specs, outs, max_ops=d, exact_ops=True, probe_range=D.probe_range(specs),
                                     eps_values=D._eps_values(ref), admits=oracle.admits, stats=st,
                                     kinds=D.op_kinds(targets)):
            pass
    return time.process_time() - t, st.as_dict()


def pipeline(repeats: int) -> dict:
    """First-call CPU seconds and the region's search seconds (wall) through torch.compile, per path."""
    import torch
    import torch_mirage
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from test_search_claim import gated_mlp, linear_gated_mlp, lora, rmsnorm_linear, rmsnorm_linear_3d
    cases = {"lora": (lora, [(4, 32), (32, 24), (32, 8), (8, 24)]), "gated_mlp": (gated_mlp, [(4, 32), (32, 24), (32, 24)]),
             "linear_gated_mlp": (linear_gated_mlp, [(4, 32), (24, 32), (24, 32)]),
             "rmsnorm": (rmsnorm_linear, [(4, 32), (32,), (32, 24)]),
             "rmsnorm_3d_eps": (rmsnorm_linear_3d, [(2, 4, 32), (32,), (32, 24)])}
    opts = dict(ugraph_library=False, stitch=False, search=True, search_budget_s=25.0, measure_regions=False,
                cache=False, search_workers=1)
    out = {}
    for name, (fn, shapes) in cases.items():
        runs: dict = {"python": [], "cpp": []}
        for _ in range(repeats):
            for path in ("python", "cpp"):
                native.set_enabled(path == "cpp")
                torch._dynamo.reset()
                report = torch_mirage.Report()
                compiled = torch.compile(fn, backend=torch_mirage.MirageBackend(options=opts, report=report))
                xs = [torch.randn(s) for s in shapes]
                t = time.process_time()
                compiled(*xs)
                cpu = time.process_time() - t
                searched = [r.info for r in report.regions if r.claimer == "ugraph-search"]
                runs[path].append((cpu, searched[0]["search_s"] if searched else None,
                                   searched[0]["ugraph_hash"] if searched else None))
        native.set_enabled(True)
        med = {p: statistics.median(c for c, _, _ in v) for p, v in runs.items()}
        out[name] = {"python_first_call_cpu_s": round(med["python"], 3), "cpp_first_call_cpu_s": round(med["cpp"], 3),
                     "python_search_wall_s": [s for _, s, _ in runs["python"]],
                     "cpp_search_wall_s": [s for _, s, _ in runs["cpp"]],
                     "same_ugraph": len({h for v in runs.values() for _, _, h in v}) == 1 and runs["cpp"][0][2] is not None}
        print(name, json.dumps(out[name]), flush=True)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=float, default=30.0)
    ap.add_argument("--pipeline", action="store_true")
    args = ap.parse_args(argv)
    if native.search_core() is None:
        sys.exit(f"search_native_cpu: the C++ core is not built ({native.why_not()})")
    if args.pipeline:
        out = {"repeats": args.repeats, "seconds": "process CPU time of the first call; search_s: wall",
               "load_average_before": os.getloadavg(), "results": pipeline(args.repeats)}
        out["load_average_after"] = os.getloadavg()
        return emit(out, "search_native_pipeline_cpu.json")
    out = {"repeats": args.repeats, "budget_s": args.budget, "cpus": os.cpu_count(), "seconds": "process CPU time",
           "load_average_before": os.getloadavg(), "results": {}}
    for name, make in CASES.items():
        ref = make()
        specs = [(op.shapes[0], op.dtypes[0]) for op in ref.inputs]
        res = {}
        for mode, okw in MODES.items():
            runs = {"python": [], "cpp": []}
            for _ in range(args.repeats):
                for path in ("python", "cpp"):
                    native.set_enabled(path == "cpp")
                    t = time.process_time()
                    r = D.search(ref, specs, budget_s=args.budget, tile=8, workers=1, oracle_kwargs=okw)
                    runs[path].append((time.process_time() - t, r.stats.seconds, r.best.hash() if r.best else None,
                                       r.stats.generated))
            native.set_enabled(True)
            med = {p: statistics.median(c for c, _, _, _ in v) for p, v in runs.items()}
            wall = {p: statistics.median(w for _, w, _, _ in v) for p, v in runs.items()}
            res[mode] = {"python_s": round(med["python"], 3), "cpp_s": round(med["cpp"], 3),
                         "speedup": round(med["python"] / med["cpp"], 2),
                         "python_wall_s": round(wall["python"], 3), "cpp_wall_s": round(wall["cpp"], 3),
                         "same_ugraph": len({h for v in runs.values() for _, _, h, _ in v}) == 1,
                         "found": runs["cpp"][0][2] is not None,
                         "generated": sorted({g for v in runs.values() for _, _, _, g in v})}
        depth = D.search(ref, specs, budget_s=args.budget, tile=8, workers=1, oracle_kwargs=MODES["front"]).stats.depth
        gen = {"python": [], "cpp": []}
        for _ in range(args.repeats):
            for path in ("python", "cpp"):
                native.set_enabled(path == "cpp")
                gen[path].append(generator_only(ref, depth))
        native.set_enabled(True)
        gmed = {p: statistics.median(s for s, _ in v) for p, v in gen.items()}
        res["generator"] = {"depth": depth, "python_s": round(gmed["python"], 3), "cpp_s": round(gmed["cpp"], 3),
                            "speedup": round(gmed["python"] / gmed["cpp"], 2),
                            "same_stats": all(st == gen["python"][0][1] for v in gen.values() for _, st in v)}
        out["results"][name] = res
        print(name, json.dumps(res), flush=True)
    out["load_average_after"] = os.getloadavg()
    return emit(out, "search_native_cpu.json")


if __name__ == "__main__":
    main(sys.argv[1:])
