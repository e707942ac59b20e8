"""The measurement method (METHOD.md, DESIGN.md's timing rule) for one callable.

* :func:`measure_ceilings`: the device's copy bandwidth and fp16 matmul rate, measured now.
* :data:`COMPILERS`: the modes side by side — eager, Inductor, Inductor max-autotune, mirage
  (its own CUDA-graph wrapping off, since the harness captures).
* :func:`check`: relative error against a higher-precision reference (float64 on the CPU,
  float32 on a GPU), on fresh random inputs, with poisoned memory, NaN never passing.
* :func:`time_in_cuda_graph`: one CUDA graph that calls the function once per rotated input
  set (together more than 3× L2), replayed until ~``target_ms``; median over repeats, per call.
* :func:`run_case`: one workload × batch × dtype through every mode: correctness first, a failed
  mode is reported failed and never timed; compile time (first call) recorded apart.
"""
from __future__ import annotations

import gc
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..backend import MirageBackend
from ..numerics import relative_error, tolerance
from ..report import Report
from ..timing import activity_table, cuda_graph_timing, device_activity, kernel_total, plain_timing
from . import workloads as W

log = logging.getLogger("torch_mirage")

MODES = ("eager", "inductor", "inductor-max-autotune", "mirage")
INDUCTOR_MODES = ("inductor", "inductor-max-autotune")

# a mode's output may be off the higher-precision reference by numerics.tolerance(dtype, "bench"), or by up to
# ERR_SLACK times as much as eager itself
ERR_SLACK = 3.0


# ---------------------------------------------------------------------------------------------
# Modes


def _mirage(fn: Callable, info: dict) -> Callable:
    report = Report()
    info["report"] = report
    # the same backend as backend="mirage"; an instance so that its report can be read back
    return torch.compile(fn, backend=MirageBackend(options={"cuda_graphs": False}, report=report), dynamic=False)


COMPILERS: dict[str, Callable[[Callable, dict], Callable]] = {
    "eager": lambda fn, info: fn,
    "inductor": lambda fn, info: torch.compile(fn, dynamic=False),
    "inductor-max-autotune": lambda fn, info: torch.compile(fn, mode="max-autotune-no-cudagraphs", dynamic=False),
    "mirage": _mirage,
}


def mirage_summary(info: dict) -> dict | None:
    report = info.get("report")
    if report is None:
        return None
    regions = report.regions
    return {"graphs": len(report.graphs), "regions": len(regions),
            "mirage_regions": sum(r.compiled_by == "mirage" for r in regions),
            "fallback_errors": [g.fallback_error for g in report.graphs if g.fallback_error],
            # graphs timed against Inductor's compile on the first call: which one was kept, and the times
            "choices": [{"graph": g.index, "kept": g.choice, "us": g.choice_times_us} for g in report.graphs if g.choice],
            # why a graph with mirage regions was not timed against Inductor; where compile time went
            "untimed": [{"graph": g.index, "reason": g.untimed_reason} for g in report.graphs if g.untimed_reason],
            # each region timed against Inductor's compile of it: who ran it after, both times, its matmul count and
            # the launch configs its μGraph kernels were tuned to
            "region_times": [{"claimer": r.claimer, "kept": r.compiled_by, "ops": len(r.ops),
                              "matmuls": sum(o.startswith(("aten.mm", "aten.bmm", "aten.addmm")) for o in r.ops),
                              "mirage_us": r.info["mirage_us"], "inductor_us": r.info["inductor_us"],
                              "launch": r.info.get("launch"), "sibling_launches": r.info.get("sibling_launches"),
                              "stored_updates": r.info.get("stored_updates"),
                              # an attention region's form as analysis read it (mask, band, heads)
                              **({"attention": r.info["attention"]} if "attention" in r.info else {})}
                             for r in regions if "mirage_us" in r.info],
            # mirage regions kept without a time: Inductor's version of them could not be timed (why)
            # each built mirage region's build seconds (compiles and tuning; a cached plan's take far less)
            "build_s": [{"claimer": r.claimer, "ops": len(r.ops), "s": r.info["build_s"],
                         "peak_rise_mib": r.info.get("build_peak_rise_mib", 0)}
                        for r in regions if "build_s" in r.info],
            "untimed_regions": [{"claimer": r.claimer, "ops": len(r.ops), "why": r.info["measured"]}
                                for r in regions if str(r.info.get("measured", "")).startswith("failed")],
            "stage_ms": _summed_stages(report.graphs, "stage_times_ms"),
            # how far each stage raised the GPU's peak of allocated memory (MiB, summed over graphs)
            "stage_peak_rise_mib": _summed_stages(report.graphs, "stage_peak_rise_mib")}


def _summed_stages(graphs, field: str) -> dict:
    total: dict = {}
    for g in graphs:
        for stage, x in getattr(g, field).items():
            total[stage] = round(total.get(stage, 0.0) + x, 1)
    return total


# ---------------------------------------------------------------------------------------------
# Device ceilings


@dataclass
class Ceilings:
    copy_bytes_per_s: float
    matmul_flops_per_s: float
    copy_mib: int
    matmul_n: int
    l2_bytes: int


def measure_ceilings(copy_mib: int = 1024, matmul_n: int = 8192) -> Ceilings:
    """A large device-to-device copy (bytes read + written) and an fp16 matmul on random data."""
    src = torch.randn(copy_mib * 2 ** 19, device="cuda", dtype=torch.float16)
    dst = torch.empty_like(src)
    copy_ms = plain_timing(dst.copy_, [src], replays=10, repeats=9)["us"] / 1e3
    del src, dst
    a = torch.randn(matmul_n, matmul_n, device="cuda", dtype=torch.float16)
    b = torch.randn(matmul_n, matmul_n, device="cuda", dtype=torch.float16)
    c = torch.empty_like(a)
    mm_ms = plain_timing(lambda: torch.mm(a, b, out=c), [], replays=10, repeats=9)["us"] / 1e3
    del a, b, c
    torch.cuda.empty_cache()
    return Ceilings(copy_bytes_per_s=2 * copy_mib * 2 ** 20 / (copy_ms * 1e-3),
                    matmul_flops_per_s=2 * matmul_n ** 3 / (mm_ms * 1e-3),
                    copy_mib=copy_mib, matmul_n=matmul_n,
                    l2_bytes=int(torch.cuda.get_device_properties(0).L2_cache_size))


# ---------------------------------------------------------------------------------------------
# Correctness


def _flatten(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flatten(o)]
    raise TypeError(f"benchmark outputs must be tensors or tuples of tensors, got {type(out).__name__}")


def run_outputs(fn: Callable, inputs: Sequence[torch.Tensor], mutates: Sequence[int] = ()) -> list[torch.Tensor]:
    """The function's outputs followed by the inputs it updates in place."""
    return _flatten(fn(*inputs)) + [inputs[i] for i in mutates]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """:func:`~torch_mirage.numerics.relative_error`, NaN where ``out`` has any NaN or inf (never passes)."""
    if out.shape != ref.shape:
        raise ValueError(f"shape {tuple(out.shape)} where the reference has {tuple(ref.shape)}")
    if not torch.isfinite(out).all():
        return math.nan
    return relative_error(out, ref)


def _poison(device: torch.device, nbytes: int) -> None:
    """Leave NaN in the allocator's free blocks so that an output element nobody writes shows up."""
    if device.type == "cuda" and nbytes > 0:
        torch.full((nbytes // 2 + 1,), float("nan"), dtype=torch.float16, device=device)


def check(outs: Sequence[torch.Tensor], refs: Sequence[torch.Tensor], tol: float) -> tuple[bool, float, str]:
    """(ok, worst relative error, why not)."""
    if len(outs) != len(refs):
        return False, math.nan, f"{len(outs)} outputs where the reference has {len(refs)}"
    worst = 0.0
    for i, (o, r) in enumerate(zip(outs, refs)):
        try:
            err = rel_error(o, r)
        except ValueError as e:
            return False, math.nan, f"output {i}: {e}"
        if math.isnan(err):
            return False, err, f"output {i} has NaN or inf (unwritten or overflowed elements)"
        worst = max(worst, err)
        if err > tol:
            return False, worst, f"output {i}: relative error {err:.3g} > tolerance {tol:.3g}"
    return True, worst, ""


# ---------------------------------------------------------------------------------------------
# Timing


def rotation_count(set_bytes: int, l2_bytes: int, limit: int = 2048) -> int:
    """How many input sets make one pass read more than 3× L2."""
    return max(1, min(limit, 3 * l2_bytes // max(set_bytes, 1) + 1))


def time_in_cuda_graph(call: Callable, input_sets: Sequence[Sequence[Any]], target_ms: float = 10.0,
                       repeats: int = 7) -> dict:
    """µs per call: one CUDA graph calling ``call`` once per input set, replayed ~``target_ms`` a repeat."""
    return cuda_graph_timing(call, input_sets, target_ms=target_ms, repeats=repeats)


# ---------------------------------------------------------------------------------------------
# One case: workload × batch × dtype × modes


@dataclass
class ModeResult:
    mode: str
    status: str = "skipped"            # ok | failed | skipped
    us: float | None = None            # median µs per call, inside the harness's CUDA graph
    us_min: float | None = None
    us_max: float | None = None
    compile_s: float | None = None     # wall time of the first call (compile, autotune, run)
    warm_compile_s: float | None = None   # mirage: the same first call again after a Dynamo reset (caches warm)
    warm_stage_ms: dict | None = None  # mirage: where the warm compile's time went, per stage (summed over graphs)
    graphs: int | None = None          # mirage: graphs compiled (the warm compile's per-graph share divides by it)
    rel_err: float | None = None       # worst relative error against the reference
    tolerance: float | None = None
    error: str | None = None
    mirage: dict | None = None         # what the mirage backend did (regions, fallbacks)
    kernels: int | None = None         # GPU kernels one call launches (profiler; None off CUDA or unseen in a graph)
    device_activity: list | None = None   # those kernels' calls and µs by name (profiler; one call, not in a graph)


@dataclass
class CaseSpec:
    """Everything :func:`run_case` needs about one function, whether a table workload or not."""
    name: str
    fn: Callable
    make_inputs: Callable[[int], list]     # seed -> fresh inputs
    mutates: tuple[int, ...] = ()
    set_bytes: int = 0
    info: dict = field(default_factory=dict)


def _short(e: BaseException, limit: int = 600) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= limit else text[:limit] + " ..."


def _free(reset_dynamo: bool = True) -> None:
    """Free what a case left behind: Dynamo's caches (unless ``reset_dynamo`` is False: graphs still to be timed),
    unreachable objects and the CUDA allocator's cached blocks."""
    if reset_dynamo:
        torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _reference(spec: CaseSpec, seed: int, ref_dtype: torch.dtype) -> list[torch.Tensor]:
    inputs = [x.to(ref_dtype) if x.is_floating_point() else x for x in spec.make_inputs(seed)]
    with torch.no_grad():
        return [t.detach() for t in run_outputs(spec.fn, inputs, spec.mutates)]


def run_mode(spec: CaseSpec, mode: str, compiler: Callable, refs: dict[int, list], tol: float,
             timing: dict | None, device: torch.device) -> ModeResult:
    """Compile, check on every reference seed (fresh inputs each), then time — or say why not."""
    res = ModeResult(mode, tolerance=tol)
    info: dict = {}
    try:
        _free()
        fn = compiler(spec.fn, info)
        worst = 0.0
        for i, (seed, ref) in enumerate(refs.items()):
            inputs = spec.make_inputs(seed)
            _poison(device, 2 * spec.set_bytes)
            outs, seconds = _timed_call(fn, inputs, spec.mutates, device)
            if i == 0 and mode != "eager":
                res.compile_s = seconds
            ok, err, why = check(outs, ref, tol)
            worst = max(worst, err) if not math.isnan(err) else err
            del inputs, outs
            if not ok:
                res.status, res.rel_err, res.error = "failed", worst, f"wrong result (seed {seed}): {why}"
                return res
        res.rel_err = worst
        if timing is not None:
            sets = [spec.make_inputs(s) for s in range(timing["sets"])]
            with torch.no_grad():
                t = time_in_cuda_graph(fn, sets, timing["target_ms"], timing["repeats"])
            del sets
            res.us, res.us_min, res.us_max = t["us"], t["us_min"], t["us_max"]
            with torch.no_grad():   # issue 17: kernels per decoder layer; one more call, its outputs not checked
                found = device_activity(fn, *spec.make_inputs(next(iter(refs))))
            res.kernels, res.device_activity = kernel_total(found), activity_table(found)
        if mode == "mirage":   # after the timing: the Dynamo reset it makes would send ``fn`` to compile again
            torch._dynamo.reset()
            warm: dict = {}
            res.warm_compile_s = _timed_call(compiler(spec.fn, warm), spec.make_inputs(next(iter(refs))),
                                             spec.mutates, device)[1]
            res.warm_stage_ms = (mirage_summary(warm) or {}).get("stage_ms")
        res.status = "ok"
    except Exception as e:   # a mode that cannot compile or run is a result, not a crash
        log.debug("bench: %s %s failed", spec.name, mode, exc_info=True)
        res.status, res.error = "failed", _short(e)
    finally:
        res.mirage = mirage_summary(info)
        res.graphs = res.mirage["graphs"] if res.mirage else None
        info.clear()
        _free()
    return res


def _timed_call(fn: Callable, inputs: Sequence, mutates: Sequence[int], device: torch.device) -> tuple[list, float]:
    """``fn``'s outputs on ``inputs`` and the call's wall seconds (a first call: its compile included; a mirage
    call after a Dynamo reset: the warm compile, with the caches the first filled)."""
    t0 = time.perf_counter()
    with torch.no_grad():
        outs = run_outputs(fn, inputs, mutates)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return outs, time.perf_counter() - t0


def run_case(spec: CaseSpec, modes: Sequence[str], dtype: torch.dtype, device: torch.device,
             timing: dict | None, compilers: dict[str, Callable] | None = None,
             echo: Callable[[str], None] = lambda s: None) -> dict[str, ModeResult]:
    """Every mode of one case, eager's error first (it sets how far off the others may be)."""
    compilers = {**COMPILERS, **(compilers or {})}
    ref_dtype = torch.float64 if device.type == "cpu" else torch.float32
    refs = {seed: _reference(spec, seed, ref_dtype) for seed in (1001, 1002)}
    base_tol = tolerance(dtype, "bench")
    results: dict[str, ModeResult] = {}
    eager = run_mode(spec, "eager", compilers["eager"], refs, math.inf,
                     timing if "eager" in modes else None, device)
    tol = max(base_tol, ERR_SLACK * eager.rel_err) if eager.rel_err is not None and not math.isnan(eager.rel_err) \
        else base_tol
    eager.tolerance = tol
    if eager.status == "ok" and eager.rel_err is not None and eager.rel_err > base_tol:
        echo(f"  note: eager itself is {eager.rel_err:.3g} off the {ref_dtype} reference (> {base_tol:g})")
    if "eager" in modes:
        results["eager"] = eager
        echo(_line(spec.name, eager))
    for mode in modes:
        if mode == "eager":
            continue
        if mode not in compilers:
            raise KeyError(f"unknown mode {mode!r}; known: {sorted(compilers)}")
        results[mode] = run_mode(spec, mode, compilers[mode], refs, tol, timing, device)
        echo(_line(spec.name, results[mode]))
    del refs
    _free()
    return results


def _line(name: str, r: ModeResult) -> str:
    t = f"{r.us:9.2f} us" if r.us is not None else "    -     "
    c = f"compile {r.compile_s:6.1f} s" if r.compile_s is not None else " " * 16
    if r.warm_compile_s is not None:
        c += f" (warm {r.warm_compile_s:.1f} s)"
    e = f"err {r.rel_err:.2e}" if r.rel_err is not None else ""
    tail = f"  FAILED {r.error}" if r.status == "failed" else ""
    return f"  {name:<34} {r.mode:<22} {t}  {c}  {e}{tail}"


def workload_spec(w: W.Workload, batch: int, dtype: torch.dtype, device: torch.device, quick: bool) -> CaseSpec:
    c = W.cost(w, batch, dtype, quick)
    return CaseSpec(f"{w.name} b{batch} {str(dtype).replace('torch.', '')}", w.fn,
                    lambda seed: w.make_inputs(batch, dtype, device, seed, quick), w.mutates, c.bytes,
                    {"bytes": c.bytes, "flops": c.flops})


def result_dict(r: ModeResult) -> dict:
    """JSON-ready: NaN and inf (a NaN output's error) become None."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(r).items()}
