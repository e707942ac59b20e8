"""The partition stage of mirage's compile at a real model's sizes, on the CPU: the bench's HF llama (4 layers,
hidden 1024, fp32 here) through ``generate`` with a DynamicCache, each graph's ``claim_regions`` timed and
profiled, then stopped (the backend falls back to Inductor for the graph: no kernel is built or run in Triton's
interpreter). Prints each graph's partition seconds and the profile of all of them.

    python benchmarks/partition_stage_cpu.py
"""
import os, sys, time, cProfile, pstats, io
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("MIRAGE_LOG_LEVEL", "ERROR")
import torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from torch_mirage.bench import models as M
import torch_mirage.pipeline as P
times = []
prof = cProfile.Profile()
real = P.claim_regions
class Stop(Exception): pass
def wrapped(graph, claimers, ctx):
    t = time.perf_counter(); prof.enable()
    try:
        r = real(graph, claimers, ctx)
    finally:
        prof.disable(); times.append(round(time.perf_counter() - t, 3))
    print("partition", times[-1], "s", len(graph.nodes), "nodes", [getattr(c, "__class__").__name__ for c in claimers], flush=True)
    raise Stop("probe: partition timed")
P.claim_regions = wrapped
spec = M.get(["llama"])[0]
model = M.build(spec, "default", torch.float32, torch.device("cpu"), tiny=False)
M.compile_forward(model, "mirage", dynamic=None)
ids = torch.randint(0, model.config.vocab_size, (4, 64))
with torch.no_grad():
    M.greedy_generate(model, ids, 3, "dynamic")
print("times", times)
s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(45); print(s.getvalue())
s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25); print(s.getvalue())
