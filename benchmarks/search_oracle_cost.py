"""Cost and verdicts of the abstract-subexpression oracle (search/oracle.py), on the CPU.

Workload: for each library μGraph's target expressions, every op output of every library μGraph
(small shapes; inputs are positional, so another workload's prefixes are realistic wrong candidates
with the same op mix) plus one generator step from the admitted ones (each binary op on each pair,
a sum over each divisor of a target's sum size, exp / silu / sqrt of each; at most ``--step`` terms)
is queried. Measured per target: µs per uncached front query, per countermodel
query, per cached ``admits``; how many queries the front admits / the countermodel refutes / leave
open; and Z3 (``z3_admits``, per-query timeout) on the open ones and on the target's own prefixes:
unsat (proven) / sat (refuted) / unknown counts and ms per query; and µs per first-time expression
construction of the one-step candidates (the generator's ``expr_of_op`` work). ``--gc-freeze`` calls
``gc.freeze()`` after the imports: with torch's heap, CPython's full collections (triggered as the
hash-consing table grows) cost ~200 ms each, which dominates construction unless frozen. Prints a
table and one JSON line (also written to ``$OUT/search_oracle_cost.json`` when ``OUT`` is set).

    python benchmarks/search_oracle_cost.py [--z3-timeout-ms 200] [--z3-queries 8] [--gc-freeze]
"""
import argparse
import gc
import json
import os
import statistics
import time

from torch_mirage.superopt import library as L
import itertools

from torch_mirage.superopt.search.expr import add, div, fn, graph_exprs, mul, sub_exprs, sum_
from torch_mirage.superopt.search.oracle import SubexprOracle

WORKLOADS = {
    "rmsnorm_linear": lambda: L.rmsnorm_linear(4, 12, 8, eps=1e-6, grid=2, forloop_range=3),
    "gated_mlp": lambda: L.gated_mlp(4, 12, 8, grid=2, forloop_range=3),
    "lora": lambda: L.lora(4, 12, 8, 2, grid=2, forloop_range=3),
    "ntrans": lambda: L.ntrans(4, 6),
    "gqa_flashattention": lambda: L.gqa_flashattention(1, 2, 4, 8, 4, forloop_range=2),
    "qknorm_attention": lambda: L.qknorm_attention(1, 2, 4, 8, 4, forloop_range=2),
}


def _us(f, xs) -> float:
    t0 = time.perf_counter()
    for e in xs:
        f(e)
    return (time.perf_counter() - t0) / max(1, len(xs)) * 1e6


def _z3(oracle, terms) -> dict:
    ms, verdicts = [], []
    for e in terms:
        t0 = time.perf_counter()
        verdicts.append(oracle.z3_admits(e))
        ms.append((time.perf_counter() - t0) * 1e3)
    return {"n": len(terms), "unsat": verdicts.count(True), "sat": verdicts.count(False),
            "unknown": verdicts.count(None), "ms_median": round(statistics.median(ms), 1) if ms else None,
            "ms_max": round(max(ms), 1) if ms else None}


def _step(admitted, targets, limit: int) -> list:
    """One generator step from admitted terms: the candidates a search would query next."""
    sizes = sorted({d for t in targets for s in t.subterms() if s.op == "sum"
                    for d in range(2, s.attr + 1) if s.attr % d == 0})
    out = []
    for a, b in itertools.product(admitted, repeat=2):
        out += [mul(a, b), add(a, b), div(a, b)]
    for a in admitted:
        out += [sum_(n, a) for n in sizes] + [fn(f, a) for f in ("exp", "silu", "sqrt")]
    return list(dict.fromkeys(out))[:limit]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--z3-timeout-ms", type=int, default=200)
    ap.add_argument("--z3-queries", type=int, default=8, help="Z3 queries per target and kind (0: no Z3)")
    ap.add_argument("--step", type=int, default=3000, help="one-step candidates per target, at most")
    ap.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after the imports")
    args = ap.parse_args()
    if args.gc_freeze:
        gc.freeze()
    graphs = {k: f() for k, f in WORKLOADS.items()}
    own = {k: list(dict.fromkeys(sub_exprs(g))) for k, g in graphs.items()}
    prefixes = list(dict.fromkeys(e for k in graphs for e in own[k]))
    rows = {}
    for name, g in graphs.items():
        targets = graph_exprs(g)
        o = SubexprOracle(targets, use_z3=False)
        t0 = time.perf_counter()
        step = _step([e for e in prefixes if o.front(e)], targets, args.step)
        build_us = (time.perf_counter() - t0) / max(1, len(step)) * 1e6   # 3 constructions per binary pair
        queries = prefixes + step
        o = SubexprOracle(targets, use_z3=False)
        front_us = _us(o.front, queries)
        model_us = _us(o.refutes, queries)          # uncached: the model memo holds only the targets
        admitted = [e for e in queries if o.front(e)]
        refuted = [e for e in queries if not o.front(e) and o.refutes(e)]
        open_ = [e for e in queries if not o.front(e) and not o.refutes(e)]
        for e in queries:
            o.admits(e)
        cached_us = _us(o.admits, queries)
        row = {"queries": len(queries), "front_us": round(front_us, 2), "countermodel_us": round(model_us, 2),
               "cached_us": round(cached_us, 2), "build_us": round(build_us, 2), "front_admits": len(admitted), "refuted": len(refuted),
               "open": len(open_), "own_prefixes_admitted": sum(o.front(e) for e in own[name]),
               "own_prefixes": len(own[name])}
        if args.z3_queries:
            oz = SubexprOracle(targets, z3_timeout_ms=args.z3_timeout_ms)
            row["z3_open"] = _z3(oz, open_[:args.z3_queries])
            row["z3_own_prefixes"] = _z3(oz, own[name][:args.z3_queries])
        rows[name] = row
        z = row.get("z3_open", {})
        zp = row.get("z3_own_prefixes", {})
        print(f"{name:20s} q={row['queries']:4d} front {row['front_us']:6.2f}µs model {row['countermodel_us']:6.2f}µs "
              f"cached {row['cached_us']:5.2f}µs build {row['build_us']:6.1f}µs | admit {len(admitted):4d} refuted {len(refuted):4d} open "
              f"{len(open_):4d} | Z3 open u/s/? {z.get('unsat')}/{z.get('sat')}/{z.get('unknown')} "
              f"{z.get('ms_median')}ms | Z3 own u/s/? {zp.get('unsat')}/{zp.get('sat')}/{zp.get('unknown')} "
              f"{zp.get('ms_median')}ms", flush=True)
    out = {"z3_timeout_ms": args.z3_timeout_ms, "gc_freeze": args.gc_freeze, "targets": rows}
    print(json.dumps(out))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "search_oracle_cost.json"), "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
