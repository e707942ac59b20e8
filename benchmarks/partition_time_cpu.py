"""Compile-time cost of partitioning, on the CPU: the stitch partitioner and the μGraph library seeds (the search
claimer with seeds only: regions grown, lowered, bound to the seeds by shape, verified) on a 4-layer Qwen2-shaped model's ATen graph (small dims, the node count of the real model; no
kernel is compiled or run). Prints one JSON line; ``--profile`` adds a cProfile listing.

    python benchmarks/partition_time_cpu.py [--profile]
"""
import os, sys, time, json
os.environ["TRITON_INTERPRET"] = "1"
import torch, transformers
from torch_mirage.testing.aten import trace_ir
from torch_mirage.config import load
from torch_mirage.context import CompileContext
from torch_mirage.partition.region import claims
from torch_mirage.partition.stitch import StitchClaimer
from torch_mirage.superopt.search.claimer import SearchClaimer
from torch_mirage.superopt.search.seeds import SEED_WORKLOADS
cfg = transformers.Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
      num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)
cfg._attn_implementation = "sdpa"
model = transformers.Qwen2ForCausalLM(cfg).eval()
ids = torch.randint(0, 512, (1, 16))
with torch.no_grad():
    graph = trace_ir(lambda i: model(i).logits, ids)
print("nodes", len(graph.nodes))
ctx = CompileContext.standalone(load({"min_region_us": 0.0}))   # every group size, as before the threshold
t = time.perf_counter(); regions = claims(StitchClaimer().claim(graph, list(graph.nodes), ctx)); ts = time.perf_counter() - t
sig = sorted(sorted(n.name for n in r.nodes) for r in regions)
seeded = lambda: SearchClaimer(seeds=SEED_WORKLOADS, enumerates=False).claim(graph, list(graph.nodes), ctx)
t = time.perf_counter(); seeded(); tl = time.perf_counter() - t
print(json.dumps({"stitch_s": round(ts, 3), "library_seeds_s": round(tl, 3), "regions": len(regions),
                  "signature": __import__("hashlib").md5(json.dumps(sig).encode()).hexdigest()[:12]}))
if "--profile" in sys.argv:
    import cProfile, pstats
    pr = cProfile.Profile(); pr.enable(); StitchClaimer().claim(graph, list(graph.nodes), ctx); seeded(); pr.disable()
    pstats.Stats(pr).sort_stats("cumulative").print_stats(30)
