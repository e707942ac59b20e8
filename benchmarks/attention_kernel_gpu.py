"""Attention kernels on one GPU (issue 16): mirage's compiled gemma2_softcap and h2o_core (prefill) and
llama_layer_decode's attention (decode) against SDPA, flex_attention and Inductor.

Cases: the bench's gemma2_softcap (causal, tanh soft-cap 50, P·V) and h2o_core (causal, P·V and the column sums
of P) with B=1, H=32, d=128 at n = 1024 and 8192, bf16 and fp16. The causal mask is built inside the compiled
function from index comparisons (as HF models do), so mirage's attention claimer sees its value property and
runs the banded FlashAttention seed. Columns:

* ``mirage``: ``torch.compile`` with the mirage backend (its own CUDA graphs and the region / whole-graph timing
  against Inductor off, so the column is mirage's kernels); the launch config it tuned is recorded;
* ``inductor``: ``torch.compile`` default of the same function;
* ``sdpa``: ``scaled_dot_product_attention(is_causal=True)`` — no soft-cap, no column sums (a speed reference);
* ``flex``: compiled ``flex_attention`` with a causal block mask (made once, outside the timing) and, for
  gemma2, the soft-cap as ``score_mod`` (same output); for h2o P·V only.

Decode (``--workloads decode``): the attention region of llama_layer_decode — one new token per sequence against a
static KV cache of ``--context`` slots (4096), Llama-3-8B heads (32 query, 8 KV, d 128), the query heads packed per
KV head by a reshape, an additive mask per batch row hiding the slots not written yet (row r has written
``context - 128·r`` slots), fp32 softmax — at each of ``--batches`` (1 8). Columns as above; ``sdpa`` is
``scaled_dot_product_attention(attn_mask=mask, enable_gqa=True)`` and ``flex`` compiled ``flex_attention`` with
the mask as ``score_mod`` (both the same output). Each decode row also gives the KV floor — the K and V bytes
(every slot is read: the mask is an input of unknown values) over the copy bandwidth measured at the start of
the run — and, with ``--profile``, mirage's attention kernels alone (its ``ugraph`` kernels: split-KV and the
combine, without the per-call mask clamp around them) against that floor.

Each column is checked against an fp32 eager reference (relative Frobenius error, the bench tolerance; columns
that compute something else are marked ``ref``) and timed with ``torch_mirage.bench.harness.time_in_cuda_graph``:
one CUDA graph calling the function once per input set, sets rotated past L2. Writes ``attention_kernel.json``
and ``attention_kernel.md`` to ``$OUT`` (or ``--out``). ``--root DIR`` imports ``torch_mirage`` from DIR (an
older checkout, for a before/after column under ``--label``).

    python benchmarks/attention_kernel_gpu.py [--sizes 1024 8192] [--dtypes bfloat16 float16]
        [--workloads gemma2_softcap h2o_core decode] [--batches 1 8] [--context 4096]
        [--modes mirage inductor sdpa flex] [--budget-s 400]
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
import time
import traceback


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    p.add_argument("--workloads", nargs="+", default=["gemma2_softcap", "h2o_core"])
    p.add_argument("--modes", nargs="+", default=["mirage", "inductor", "sdpa", "flex"])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="decode: batch rows")
    p.add_argument("--context", type=int, default=4096, help="decode: static-cache slots")
    p.add_argument("--kv-heads", type=int, default=8, help="decode: KV heads")
    p.add_argument("--written", type=int, default=None,
                   help="decode: slots batch row 0 has written (default: the whole context); row r has 128·r fewer")
    p.add_argument("--budget-s", type=float, default=420.0, help="cases not started by then are skipped")
    p.add_argument("--root", default=None, help="import torch_mirage from this directory")
    p.add_argument("--label", default="after", help="names this run in the JSON / table (before / after)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--profile", action="store_true",
                   help="also list each GPU kernel of one call (torch.profiler) per column, in the JSON and the table")
    return p.parse_args()


ARGS = _args()
sys.path.insert(0, os.path.abspath(ARGS.root) if ARGS.root else
                os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention.flex_attention import flex_attention  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import torch_mirage  # noqa: E402
from torch_mirage.bench import harness  # noqa: E402
from torch_mirage.bench import workloads as W  # noqa: E402
from torch_mirage.numerics import tolerance  # noqa: E402


def causal_inmask(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The additive causal mask made in the graph from index comparisons (its value property gives the band)."""
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    low = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=device)
    return torch.where(j <= i, torch.zeros((), dtype=dtype, device=device), low)[None, None]


def gemma2(q, k, v):
    return W.gemma2_softcap(q, k, v, causal_inmask(q.shape[-2], q.dtype, q.device))


def h2o(q, k, v):
    return W.h2o_core(q, k, v, causal_inmask(q.shape[-2], q.dtype, q.device))


CASES = {"gemma2_softcap": (gemma2, 50.0), "h2o_core": (h2o, None)}


def decode_attention(q, k, v, mask):
    """llama_layer_decode's attention: the query heads of each KV head packed by a reshape, the additive mask,
    fp32 softmax; returned as (b, h, 1, d)."""
    b, h, t, d = q.shape
    out, _ = W._attention(q.reshape(b, k.shape[1], h // k.shape[1] * t, d), k, v, mask)
    return out.reshape(b, h, t, d)


def sdpa_decode(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def flex_decode(q, k, v, mask):
    def add_mask(score, b, h, q_idx, kv_idx):
        return score + mask[b, 0, 0, kv_idx]
    return flex_attention(q, k, v, score_mod=add_mask, enable_gqa=True)


def decode_inputs(b: int, dtype: torch.dtype, dev, seed: int) -> list[torch.Tensor]:
    """q (b, h, 1, d), the cache's K and V (b, hk, context, d), the additive mask (b, 1, 1, context): row r has
    written ``written - 128·r`` slots (``--written``, default the context: a step early in a long static cache
    with it set low)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    ctx, d = ARGS.context, 128

    def randn(*shape):
        return torch.randn(shape, device=dev, generator=g, dtype=torch.float32).to(dtype)
    first = ctx if ARGS.written is None else ARGS.written
    written = torch.tensor([max(1, first - 128 * r) for r in range(b)], device=dev)
    mask = torch.where(torch.arange(ctx, device=dev)[None] < written[:, None], 0.0, float("-inf"))
    return [randn(b, ARGS.heads, 1, d), randn(b, ARGS.kv_heads, ctx, d), randn(b, ARGS.kv_heads, ctx, d),
            mask.to(dtype).view(b, 1, 1, ctx)]


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device copy bandwidth in bytes/s (read + write) of a ``nbytes`` copy, median of 10 CUDA-event timings."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    del src, dst
    return 2 * nbytes / sorted(times[2:])[len(times[2:]) // 2]


class _Configs(logging.Handler):
    """Collects the launch configs the mirage backend logs for its μGraph ops."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if "μGraph op" in msg and " uses " in msg:
            self.lines.append(re.sub(r" \(/.*\)$", "", msg.replace("torch_mirage: ", "")))


def compile_mode(mode: str, fn, softcap, info: dict):
    if fn is decode_attention and mode in ("sdpa", "flex"):
        return (sdpa_decode if mode == "sdpa" else torch.compile(flex_decode, dynamic=False)), True
    if mode == "mirage":
        report = torch_mirage.Report()
        info["report"] = report
        backend = torch_mirage.MirageBackend(options={"cuda_graphs": False, "measure_regions": False}, report=report)
        return torch.compile(fn, backend=backend, dynamic=False), True
    if mode == "inductor":
        return torch.compile(fn, dynamic=False), True
    if mode == "sdpa":
        return W.sdpa_causal, False
    if mode == "flex":
        return W.flex(softcap), softcap is not None     # h2o: P·V only, no column sums
    raise KeyError(mode)


def run_case(name: str, n: int, dtype: torch.dtype, modes, cfg_log: _Configs, b: int = 1,
             bandwidth: float | None = None) -> dict:
    dev = torch.device("cuda")
    if name == "decode":
        fn, softcap = decode_attention, None

        def make(seed: int) -> list[torch.Tensor]:
            return decode_inputs(b, dtype, dev, seed)
    else:
        fn, softcap = CASES[name]
        shape = (1, ARGS.heads, n, 128)

        def make(seed: int) -> list[torch.Tensor]:
            g = torch.Generator(device=dev).manual_seed(seed)
            return [torch.randn(shape, device=dev, generator=g, dtype=torch.float32).to(dtype) for _ in range(3)]

    inputs = make(0)
    with torch.no_grad():
        refs = harness.run_outputs(fn, [x.float() for x in inputs])
    tol = tolerance(dtype, "bench")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    n_sets = harness.rotation_count(sum(x.numel() * x.element_size() for x in inputs), l2)
    sets = [inputs] + [make(s) for s in range(1, n_sets)]
    flops = 4 * ARGS.heads * n * n * 128 / 2                         # causal: half of the score matrix
    row = {"workload": name, "b": b, "n": n, "dtype": str(dtype).replace("torch.", ""), "sets": n_sets, "columns": {}}
    if name == "decode":
        flops = 4 * b * ARGS.heads * n * 128
        kv_bytes = inputs[1].numel() * inputs[1].element_size() * 2
        row.update(kv_bytes=kv_bytes, bandwidth=bandwidth, floor_us=round(kv_bytes / bandwidth * 1e6, 2))
    for mode in modes:
        col: dict = {"status": "failed"}
        info: dict = {}
        try:
            harness._free()
            cfg_log.lines.clear()
            call, same = compile_mode(mode, fn, softcap, info)
            t0 = time.perf_counter()
            with torch.no_grad():
                outs = harness.run_outputs(call, inputs)
            torch.cuda.synchronize()
            col["first_call_s"] = round(time.perf_counter() - t0, 2)
            if same:
                ok, err, why = harness.check(outs, refs, tol)
                col["rel_err"] = err
                if not ok:
                    col["error"] = why
                    row["columns"][mode] = col
                    continue
            else:
                col["compares"] = "ref"                          # computes something else: timed only
                col["rel_err"] = harness.rel_error(outs[0], refs[0]) if outs[0].shape == refs[0].shape else None
            del outs
            with torch.no_grad():
                t = harness.time_in_cuda_graph(call, sets, target_ms=20.0, repeats=5)
            col.update(status="ok", us=round(t["us"], 2), us_min=round(t["us_min"], 2), us_max=round(t["us_max"], 2),
                       tflops=round(flops / (t["us"] * 1e-6) / 1e12, 1))
            if ARGS.profile:
                col["kernels"] = profile_kernels(call, sets)
                if mode == "mirage":
                    col["attention_kernels_us"] = round(sum(k["us"] for k in col["kernels"]
                                                            if k["kernel"].startswith("ugraph")), 2)
        except Exception as e:   # one column's failure is a result
            col["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            traceback.print_exc()
        finally:
            if mode == "mirage":
                col["summary"] = harness.mirage_summary(info)
                col["launch"] = list(cfg_log.lines)
                report = info.get("report")
                if report is not None:
                    col["claims"] = [{k: r.info[k] for k in ("attention", "ugraph", "ugraph_us", "plan") if k in r.info}
                                     for r in report.regions if r.info.get("attention")]
            info.clear()
            harness._free()
        row["columns"][mode] = col
        us = col.get("us")
        print(f"  {name:<15} b={b} n={n:<5} {row['dtype']:<8} {mode:<8} "
              + (f"{us:9.1f} us {col['tflops']:6.1f} TFLOP/s" if us else f"FAILED {col.get('error', '')[:200]}")
              + (f"  err {col['rel_err']:.2e}" if isinstance(col.get("rel_err"), float) else "")
              + (f"  {col['launch']}" if col.get("launch") else ""), flush=True)
    del sets, inputs, refs
    return row


def profile_kernels(call, sets, calls: int = 10) -> list[dict]:
    """Each GPU kernel one call of ``call`` launches, with its mean time per call (µs): torch.profiler over
    ``calls`` calls (inputs rotated as in the timing), kernels grouped by name, heaviest first."""
    with torch.no_grad():
        for xs in sets[:2]:
            call(*xs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(calls):
                call(*sets[i % len(sets)])
            torch.cuda.synchronize()
    per: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            k = per.setdefault(e.name, [0, 0.0])
            k[0] += 1
            k[1] += e.device_time
    rows = [{"kernel": name[:120], "per_call": round(c / calls, 2), "us": round(t / calls, 2)}
            for name, (c, t) in per.items()]
    return sorted(rows, key=lambda r: -r["us"])


def kernel_lines(rows) -> str:
    """The profiled kernels of every column, as markdown lists."""
    out = []
    for r in rows:
        for m, c in r["columns"].items():
            if c.get("kernels"):
                total = sum(k["us"] for k in c["kernels"])
                out.append(f"\n**{r['workload']} b={r.get('b', 1)} n={r['n']} {r['dtype']} {m}** (kernels sum "
                           f"{total:.1f} µs/call, "
                           f"timed {c['us']:.1f} µs):\n")
                out += [f"- {k['us']:8.2f} µs  x{k['per_call']:g}  `{k['kernel']}`" for k in c["kernels"]]
    return "\n".join(out)


def table(rows, modes) -> str:
    head = "| workload | b | n | dtype | " + " | ".join(f"{m} µs" for m in modes) + " |"
    lines = [head, "|" + "---|" * (4 + len(modes))]
    for r in rows:
        cells = []
        for m in modes:
            c = r["columns"].get(m, {})
            if c.get("status") == "ok":
                cells.append(f"{c['us']:.1f}" + (" (ref)" if c.get("compares") == "ref" else ""))
            else:
                cells.append(c.get("status", "skipped"))
        lines.append(f"| {r['workload']} | {r.get('b', 1)} | {r['n']} | {r['dtype']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def floor_table(rows, modes) -> str:
    """Decode rows against their KV floor: each column's µs over the floor, and mirage's attention kernels alone."""
    dec = [r for r in rows if r.get("floor_us")]
    if not dec:
        return ""
    lines = ["| b | dtype | KV MB | floor µs | " + " | ".join(f"{m} / floor" for m in modes)
             + " | mirage attention kernels µs | kernels / floor |", "|" + "---|" * (6 + len(modes))]
    for r in dec:
        f = r["floor_us"]
        cells = [f"{r['columns'][m]['us'] / f:.2f}" if r["columns"].get(m, {}).get("status") == "ok" else "-"
                 for m in modes]
        k = r["columns"].get("mirage", {}).get("attention_kernels_us")
        lines.append(f"| {r['b']} | {r['dtype']} | {r['kv_bytes'] / 1e6:.1f} | {f:.2f} | " + " | ".join(cells)
                     + (f" | {k:.2f} | {k / f:.2f} |" if k else " | - | - |"))
    return "\n".join(lines)


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    start = time.perf_counter()
    cfg_log = _Configs()
    logging.getLogger("torch_mirage").addHandler(cfg_log)
    logging.getLogger("torch_mirage").setLevel(logging.INFO)
    device = {"name": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
              "label": ARGS.label, "root": ARGS.root}
    print(device, flush=True)
    rows, skipped = [], []
    if "decode" in ARGS.workloads:
        device["copy_bandwidth"] = copy_bandwidth()
        print(f"copy bandwidth {device['copy_bandwidth'] / 1e12:.2f} TB/s", flush=True)
    cases = [c for name in ARGS.workloads           # in the order the workloads are named
             for c in ([("decode", ARGS.context, dt, b) for dt in ARGS.dtypes for b in ARGS.batches] if name == "decode"
                       else [(name, n, dt, 1) for n in ARGS.sizes for dt in ARGS.dtypes])]
    for name, n, dt, b in cases:
        if time.perf_counter() - start > ARGS.budget_s:
            skipped.append(f"{name} b={b} n={n} {dt}")
            continue
        rows.append(run_case(name, n, getattr(torch, dt), ARGS.modes, cfg_log, b, device.get("copy_bandwidth")))
        md = write(device, rows, skipped, start)          # after every case: a run cut short keeps what it has
    md = write(device, rows, skipped, start)
    print(md)
    print(f"done in {round(time.perf_counter() - start, 1)} s")
    return 0


def write(device: dict, rows: list, skipped: list, start: float) -> str:
    """The JSON and the markdown table under ``--out``; returns the table."""
    res = {"device": device, "modes": ARGS.modes, "rows": rows, "skipped": skipped,
           "wall_s": round(time.perf_counter() - start, 1),
           "timing": "harness.time_in_cuda_graph: one CUDA graph per call over input sets rotated past 3x L2, "
                     "median of 5 repeats of ~20 ms",
           "flops": "prefill 4·H·n²·d/2 (causal half); decode 4·b·H·n·d"}
    floors = floor_table(rows, ARGS.modes)
    md = (f"# Attention kernels ({ARGS.label}): {device['name']}, torch {device['torch']}, "
          f"triton {device['triton']}\n\nPrefill: B=1, H={ARGS.heads}, d=128, causal. Decode: n = the static cache's "
          f"slots, {ARGS.heads} query / {ARGS.kv_heads} KV heads, d=128, one new token per row. µs per call in a CUDA "
          f"graph, inputs rotated past L2. (ref): computes something else (SDPA: no soft-cap, no column sums; flex on "
          f"h2o: P·V only).\n\n"
          + table(rows, ARGS.modes) + ("\n\nskipped (time budget): " + ", ".join(skipped) if skipped else "") + "\n"
          + (f"\n## Decode against the KV floor (copy bandwidth {device['copy_bandwidth'] / 1e12:.2f} TB/s measured "
             f"in this run)\n\n" + floors + "\n" if floors else "")
          + (("\n## Kernels per call (torch.profiler)\n" + kernel_lines(rows) + "\n") if ARGS.profile else ""))
    os.makedirs(ARGS.out, exist_ok=True)
    stem = "attention_kernel" + ("" if ARGS.label == "after" else f"_{ARGS.label}")
    with open(os.path.join(ARGS.out, stem + ".json"), "w") as f:
        json.dump(res, f, indent=1, default=lambda x: None if isinstance(x, float) and not math.isfinite(x) else str(x))
    with open(os.path.join(ARGS.out, stem + ".md"), "w") as f:
        f.write(md)
    return md


if __name__ == "__main__":
    sys.exit(main())
