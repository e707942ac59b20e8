"""Where a bench run's peak of allocated GPU memory comes from (the GPU; one run).

Runs ``torch_mirage.bench.cli`` with the given arguments under CUDA's allocator history
(``torch.cuda.memory._record_memory_history``), then replays the recorded allocations to the moment of the highest
total allocated, and prints the blocks alive then, summed by the allocating call site: the innermost
``torch_mirage`` frame (or the innermost frame at all where none is ours) and the ``torch_mirage`` frames above it.

    python benchmarks/memory_peak_gpu.py --workloads none --llms llama3-8b-4l --batch 1 \
        --llm-modes mirage --llm-scenarios prefill

The bench's own ``stage_peak_rise_mib`` (its JSON) says which compile stage raised the peak; this says which line.
"""
from __future__ import annotations

import argparse
import collections
import sys

import torch

MAX_ENTRIES = 1_000_000
TOP = 20


def _site(frames: list[dict]) -> str:
    """The allocating call site: the innermost torch_mirage frame, and up to three torch_mirage frames above it."""
    ours = [f for f in frames if "torch_mirage" in f.get("filename", "")]
    picked = ours[:4] or frames[:1]
    return " <- ".join(f"{f['filename'].split('torch_mirage/')[-1]}:{f['line']} {f['name']}" for f in picked) or "?"


def live_at_peak(trace: list[dict]) -> tuple[int, list[dict]]:
    """The highest total of allocated bytes over ``trace`` (one device's allocator events) and the alloc events of
    the blocks alive at that moment. Blocks allocated before the history began are not in the trace: the total
    is the rise over what was allocated then."""
    live: dict[int, dict] = {}
    total = best = best_at = 0
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
        if total > best:
            best, best_at = total, i
    live = {}
    for e in trace[:best_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    return best, list(live.values())


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=False)
    p.add_argument("--top", type=int, default=TOP, help="call sites printed")
    args, bench_args = p.parse_known_args(argv)
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=MAX_ENTRIES)
    from torch_mirage.bench import cli

    rc = cli.main(bench_args)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    for device, trace in enumerate(snap["device_traces"]):
        if not trace:
            continue
        peak, blocks = live_at_peak(trace)
        sites: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
        for e in blocks:
            s = sites[_site(e.get("frames", []))]
            s[0] += e["size"]
            s[1] += 1
        print(f"\ncuda:{device}: peak {peak / 2**20:.0f} MiB above the start of the history "
              f"({len(trace)} events{', the ring buffer wrapped' if len(trace) >= MAX_ENTRIES else ''}); "
              f"alive then, by call site:")
        for site, (nbytes, n) in sorted(sites.items(), key=lambda kv: -kv[1][0])[:args.top]:
            print(f"  {nbytes / 2**20:9.1f} MiB  {n:5d} blocks  {site}")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
