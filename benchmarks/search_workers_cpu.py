"""Time to the first verified μGraph at a given worker count: python benchmarks/search_workers_cpu.py TARGET WORKERS (targets of search_pruning_cpu.py; run with PYTHONPATH=the repo root)."""
import sys, time, json
sys.path.insert(0, 'benchmarks')
from search_pruning_cpu import TARGETS
from torch_mirage.superopt.search.driver import search
import torch
import torch_mirage.superopt.search.driver as D; print(D.__file__)
if __name__ == "__main__":
    name, w = sys.argv[1], int(sys.argv[2])
    g = TARGETS[name]()
    specs = [((tuple(op.attrs["shape"])), op.attrs.get("dtype","float32")) for op in g.ops if op.name=="input"]
    t=time.monotonic(); r = search(g, specs, budget_s=30, workers=w)
    print(json.dumps(dict(target=name, workers=w, found=r.best is not None, wall=time.monotonic()-t, stats=r.stats.as_dict(), hash=r.best.hash() if r.best else None), default=str))
