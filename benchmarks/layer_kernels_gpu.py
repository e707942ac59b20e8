"""Per-kernel device time of one llama_layer_decode call (bf16, batch from argv, default 1; or of the bench workload
and dtype given after the batch) under the torch
profiler: mirage with every claimed region kept (``measure_regions`` off, no CUDA graph), then Inductor default.
Shows which of mirage's kernels lose where the bench's region times say a region was handed back (11-26: the
output projection's kernel read nn.Linear's transposed weight through a strided view, 40.8 µs instead of 15).
Not rotated past L2: per-kernel times of one call, for comparison within a run.

    python benchmarks/layer_kernels_gpu.py 1      # or: benchmarks/device_check.sh layerkernels:1
    python benchmarks/layer_kernels_gpu.py 1 gqa float16
"""
import sys

import torch
sys.path.insert(0, '.')
import torch_mirage
from torch_mirage.bench.workloads import WORKLOADS
from torch.profiler import profile, ProfilerActivity
b = int(sys.argv[1]) if len(sys.argv) > 1 else 1
w = WORKLOADS[sys.argv[2] if len(sys.argv) > 2 else "llama_layer_decode"]
xs = w.make_inputs(b, getattr(torch, sys.argv[3] if len(sys.argv) > 3 else "bfloat16"), "cuda", 0)
def prof(name, fn):
    for _ in range(3): fn(*xs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn(*xs); torch.cuda.synchronize()
    evs = [(e.name, e.device_time_total if hasattr(e, 'device_time_total') else e.cuda_time_total) for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    tot = sum(t for _, t in evs)
    print(f"== {name}: {len(evs)} kernels, {tot:.1f} us device time")
    for n, t in evs:
        print(f"   {t:8.1f}  {n[:110]}")
report = torch_mirage.Report()
m = torch.compile(w.fn, backend=torch_mirage.MirageBackend(options={"measure_regions": False, "cuda_graphs": False}, report=report))
prof("mirage (all regions kept)", m)
print(report)
torch._dynamo.reset()
ind = torch.compile(w.fn)
prof("inductor", ind)
