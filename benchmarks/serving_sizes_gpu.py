"""Serving with changing prompt lengths: one HF model's prefill forward under ``dynamic=None`` (torch.compile's
default) called at several prompt lengths in turn, in mirage and in Inductor's reduce-overhead mode, each mode
in a fresh Dynamo.

Per mode and length it prints and writes (JSON under ``--out``):

* the wall seconds of the first three calls at that length (a compile shows here: Dynamo's static first graph,
  its symbolic recompile at the second length, mirage's static compile of a symbolic graph at a size's second
  call, a CUDA graph's recording);
* the prefill µs once every length has been seen and called ``--calls`` times more (a size that Dynamo's
  symbolic graph, compiled after it, now catches is compiled again there), host-launched, fastest sample per
  half, as the HF bench;
* the relative error of the logits against eager's at that length;
* for mirage, its graphs: which are symbolic, which are static compiles of which sizes, which run in CUDA graphs,
  their stage seconds; and per length, the fallback partitions Inductor compiled in mirage's assemble stage
  (count, seconds, the slowest three).

    python benchmarks/serving_sizes_gpu.py [--model llama] [--batch 4] [--lengths 256,192,320]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from torch_mirage.bench import models as M  # noqa: E402
from torch_mirage.bench.harness import rel_error  # noqa: E402
from torch_mirage.report import Report  # noqa: E402
from torch_mirage.timing import fastest_per_half, plain_timing  # noqa: E402


class PartitionCompiles:
    """Inductor's compiles of the fallback's partitions (``regional_inductor`` calls ``standalone_compile`` once
    per partition in mirage's assemble stage), timed: where a static compile's assemble seconds go."""

    def __init__(self):
        import torch._inductor
        self.calls: list[tuple[float, int]] = []
        self._orig = torch._inductor.standalone_compile

        def timed(gm, *args, **kwargs):
            start = time.perf_counter()
            try:
                return self._orig(gm, *args, **kwargs)
            finally:
                self.calls.append((time.perf_counter() - start,
                                   sum(n.op == "call_function" for n in gm.graph.nodes)))
        torch._inductor.standalone_compile = timed

    def take(self) -> dict:
        calls, self.calls = self.calls, []
        slowest = sorted(calls, reverse=True)[:3]
        return {"partitions": len(calls), "seconds": round(sum(t for t, _ in calls), 2),
                "slowest": [{"s": round(t, 2), "ops": n} for t, n in slowest]}


def _timed_call(fn, ids) -> tuple[float, torch.Tensor]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn(ids).float().clone()
    torch.cuda.synchronize()
    return time.perf_counter() - start, out


def run_mode(model, spec, mode: str, prompts: dict[int, torch.Tensor], eager: dict[int, torch.Tensor],
             calls: int, partitions: PartitionCompiles) -> dict:
    report = Report() if mode == "mirage" else None
    M.compile_forward(model, mode, report, dynamic=None, reset=True)
    fwd = M.forward_logits(model, spec)
    res: dict = {"lengths": {}}
    with torch.no_grad():
        for n, ids in prompts.items():
            seconds, out = [], None
            for _ in range(calls):
                s, out = _timed_call(fwd, ids)
                seconds.append(round(s, 3))
            res["lengths"][n] = {"call_s": seconds, "rel_err_vs_eager": rel_error(out, eager[n]),
                                 "partition_compiles": partitions.take()}
            got = res["lengths"][n]
            print(f"  {mode:16s} length {n:4d}: calls {seconds} s, rel err {got['rel_err_vs_eager']:.2e}, "
                  f"fallback partitions compiled {got['partition_compiles']}", flush=True)
        for n, ids in prompts.items():
            for _ in range(calls):   # a size the symbolic graph now catches first compiles here, not in the timing
                fwd(ids)
            halves = [plain_timing(lambda: fwd(ids), [], target_ms=20, repeats=4)["samples"] for _ in range(2)]
            res["lengths"][n]["prefill_us"] = round(fastest_per_half(halves), 1)
    if report is not None:
        res["graphs"] = [{"graph": g.index, "kind": g.kind, "cuda_graph": bool(g.cuda_graph),
                          "symbolic_sizes": g.symbolic_sizes, "static_sizes": g.static_sizes,
                          "sizes_of": g.sizes_of, "reason": g.cuda_graph_reason,
                          "stages_ms": {k: round(v) for k, v in g.stage_times_ms.items()}} for g in report.graphs]
        for g in res["graphs"]:
            print(f"    graph {g}", flush=True)
    M.compile_forward(model, "eager")
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lengths", default="256,192,320")
    p.add_argument("--modes", default="reduce-overhead,mirage")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    a = p.parse_args()
    spec = M.MODELS[a.model]
    dtype, device = torch.bfloat16, torch.device("cuda")
    model = M.build(spec, "default", dtype, device, tiny=False)
    gen = torch.Generator().manual_seed(1)
    lengths = [int(x) for x in a.lengths.split(",")]
    prompts = {n: torch.randint(1, model.config.vocab_size, (a.batch, n), generator=gen).to(device) for n in lengths}
    with torch.no_grad():
        eager = {n: M.forward_logits(model, spec)(ids).float() for n, ids in prompts.items()}
    doc = {"model": a.model, "batch": a.batch, "lengths": lengths, "dtype": "bfloat16",
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "modes": {}}
    import triton
    doc["triton"] = triton.__version__
    print(f"{a.model} batch {a.batch}, prompt lengths {lengths}, dynamic=None", flush=True)
    partitions = PartitionCompiles()
    for mode in a.modes.split(","):
        with torch._dynamo.config.patch(recompile_limit=64):
            doc["modes"][mode] = run_mode(model, spec, mode, prompts, eager, a.calls, partitions)
    print("\n| length | " + " | ".join(f"{m} calls (s) | {m} prefill µs" for m in doc["modes"]) + " |")
    print("|---" * (1 + 2 * len(doc["modes"])) + "|")
    for n in lengths:
        cells = []
        for m, r in doc["modes"].items():
            c = r["lengths"][n]
            cells += [" / ".join(f"{s:.2f}" for s in c["call_s"]), f"{c['prefill_us']:.0f}"]
        print(f"| {n} | " + " | ".join(cells) + " |")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"serving-{a.model}.json"), "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
