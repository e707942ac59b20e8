"""Where the μGraph search's time goes on the CPU: cProfile of one in-process search (seeds off) per target of
the search's tests, its own time (tottime) summed per part of the search. Parts: the generator's DFS step
(search/generate.py), the oracle's structural front (search/oracle.py), Z3 (the z3 package), abstract
expressions (search/expr.py), block-op shape rules (ugraph.py), the fp64 probe and executor
(superopt/executor.py, arith.py, torch), the finite-field and float verifier (verify.py, finite_field.py,
ff_interpret.py), the rest. ``--path python|cpp`` picks the generator's path (search/native.py).
Prints a table and one JSON object; writes ``$OUT/search_profile_cpu_ORACLE_PATH.json`` when ``$OUT`` is set.

    python benchmarks/search_profile_cpu.py [--oracle front|front+z3] [--path python|cpp]
"""
import argparse
import cProfile
import json
import os
import pstats
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from search_native_cpu import CASES                              # noqa: E402
from torch_mirage.superopt.search import driver as D             # noqa: E402
from torch_mirage.superopt.search import native                  # noqa: E402

PARTS = [("generator", ("search/generate.py", "_C.children")), ("oracle front", ("search/oracle.py",)),
         ("z3", ("/z3/",)), ("expressions", ("search/expr.py", "fractions.py")), ("shape rules", ("/ugraph.py",)),
         ("verifier", ("superopt/verify.py", "finite_field.py", "ff_interpret.py")),
         ("probe / executor", ("superopt/executor.py", "superopt/arith.py", "torch.", "torch/"))]


def part_of(filename: str, func: str) -> str:
    where = f"{filename}:{func}"
    return next((name for name, keys in PARTS if any(k in where for k in keys)), "other")


def profile(ref, oracle: dict) -> tuple[float, dict, dict]:
    specs = [(op.shapes[0], op.dtypes[0]) for op in ref.inputs]
    pr = cProfile.Profile()
    t = time.perf_counter()
    pr.enable()
    r = D.search(ref, specs, budget_s=60, tile=8, workers=1, oracle_kwargs=oracle)
    pr.disable()
    wall = time.perf_counter() - t
    parts: dict = {}
    for (filename, _, func), (_, _, tottime, _, _) in pstats.Stats(pr).stats.items():
        p = part_of(filename, func)
        parts[p] = parts.get(p, 0.0) + tottime
    return wall, {k: round(v, 3) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])}, r.stats.as_dict()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--oracle", choices=["front", "front+z3"], default="front+z3")
    ap.add_argument("--path", choices=["python", "cpp"], default="python")
    args = ap.parse_args(argv)
    native.set_enabled(args.path == "cpp")
    if args.path == "cpp" and native.search_core() is None:
        sys.exit(f"search_profile_cpu: the C++ core is not built ({native.why_not()})")
    oracle = dict(use_z3=False) if args.oracle == "front" else {}
    out = {"oracle": args.oracle, "path": args.path, "results": {}}
    for name, make in CASES.items():
        wall, parts, st = profile(make(), oracle)
        out["results"][name] = {"wall_s": round(wall, 3), "parts_s": parts, "generated": st["generated"],
                                "verified": st["verified"], "depth": st["depth"]}
        print(f"{name:17} {wall:6.2f} s  " + "  ".join(f"{k} {v:.2f}" for k, v in parts.items()), flush=True)
    print(json.dumps(out))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"search_profile_cpu_{args.oracle.replace('+', '_')}_{args.path}.json"), "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
