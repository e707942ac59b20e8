"""The μGraph search's share of a cold compile, on the CPU: each Mirage-set workload at the bench's shapes (fp16
inputs, batch 1 and 8) compiled with the search on and the library's seeds off, stopped after the partition stage
(where the search runs; no kernel is compiled or run). Per case: the partition seconds, whether the search claimed
the region and how it shrank the problem. ``--library``: the default path instead (the library's seeds verified,
no search). ``--maps conservative`` searches with :func:`.shrink.size_map` alone (the
sizes up to 16 kept), as before 2026-11-27, for a before / after on one machine.

    python benchmarks/search_partition_cpu.py [--workloads gqa qknorm_attention] [--batches 1 8]
        [--maps default|conservative] [--library] [--out FILE]
    python benchmarks/search_partition_cpu.py --hf llama --batches 4     # an HF model's prefill, search on
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import tempfile
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import torch_mirage  # noqa: E402
import torch_mirage.pipeline as pipeline  # noqa: E402
from torch_mirage.bench import workloads  # noqa: E402
from torch_mirage.superopt.search import shrink  # noqa: E402

MIRAGE_SET = ("rmsnorm_linear", "gated_mlp", "gated_mlp_llama8b", "gqa", "qknorm_attention", "lora", "ntrans")


class _Stop(Exception):
    """Raised in place of the build stage: the partition stage's work is all that is timed."""


def _workload(name: str, batch: int) -> tuple:
    wl = workloads.WORKLOADS[name]
    return wl.fn, wl.make_inputs(batch, torch.float16, "cpu", 0)


def _hf_prefill(name: str, batch: int) -> tuple:
    """An HF model of the model bench (hidden 1024, 4 layers) at its sizes: ``batch`` x 256 tokens, fp32 on the CPU
    (fp16 matmuls are slow there; the search's work does not depend on the dtype)."""
    from torch_mirage.bench import models
    spec = models.MODELS[name]
    model = models.build(spec, "default", torch.float32, "cpu", tiny=False)
    forward = models.forward_logits(model, spec)
    return (lambda ids: forward(ids)), [torch.randint(0, 1000, (batch, 256))]


def partition_seconds(name: str, batch: int, library: bool = False, hf: bool = False) -> dict:
    torch._dynamo.reset()       # a fresh compile of each case (the same function at another batch recompiles)
    fn, args = (_hf_prefill if hf else _workload)(name, batch)
    seconds = []
    claim = pipeline.claim_regions

    def timed(*a, **k):
        start = time.perf_counter()
        try:
            return claim(*a, **k)
        finally:
            seconds.append(time.perf_counter() - start)

    def stop(*a, **k):
        raise _Stop
    pipeline.claim_regions, build = timed, pipeline.build_regions
    pipeline.build_regions = stop
    said = _Said()
    log = logging.getLogger("torch_mirage")
    log.addHandler(said)
    level = log.level
    log.setLevel(logging.INFO)
    try:
        with tempfile.TemporaryDirectory() as cache:
            opts = dict(search=False) if library else dict(search=True) if hf else dict(search=True, ugraph_library=False)
            with torch.no_grad():
                torch_mirage.explain(fn, *args, options=dict(opts, measure_regions=False, cache_dir=cache))
    finally:
        pipeline.claim_regions, pipeline.build_regions = claim, build
        log.removeHandler(said)
        log.setLevel(level)
    found = [m for m in said.messages if m.startswith("μGraph search: ") and " μGraph (" in m]
    shrunk = re.search(r"verified on the shrunk shapes \(([^)]*)\)", found[0]) if found else None
    ended = [m for m in said.messages if "found nothing" in m or " skips " in m]
    return {"workload": name, "batch": batch, "partition_s": round(sum(seconds), 2), "found": bool(found),
            "shrunk": shrunk.group(1) if shrunk else None, "searched_nothing": len(ended)}


class _Said(logging.Handler):
    """The package's log messages of one compile."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", nargs="+", default=list(MIRAGE_SET))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--maps", choices=["default", "conservative"], default="default")
    ap.add_argument("--library", action="store_true", help="the default path instead: the library's seeds, no search")
    ap.add_argument("--hf", nargs="+", default=[], metavar="MODEL",
                    help="HF models of the model bench instead (prefill of --batches x 256 tokens, fp32; the search on "
                    "with the library's seeds too, as MIRAGE_SEARCH=1 alone runs it)")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.maps == "conservative":
        shrink.SIZE_MAPS = (shrink.size_map,)
    rows = []
    for name in args.hf or args.workloads:
        for b in args.batches:
            row = partition_seconds(name, b, args.library, hf=bool(args.hf))
            rows.append(row)
            print(f"{name:18s} b{b}  partition {row['partition_s']:6.2f} s  found {row['found']!s:5s}  "
                  f"shrunk {row['shrunk']}  regions searched to no result {row['searched_nothing']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"maps": args.maps, "library": args.library, "torch": torch.__version__, "machine": f"{os.cpu_count()} CPU cores",
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
