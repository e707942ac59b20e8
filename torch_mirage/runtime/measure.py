"""Measured choice between mirage's kernel for a region and Inductor's version of the same region.

On a CUDA device each claimed region is timed once — both versions inside a CUDA graph, over input sets
rotated past L2 — and the faster one is kept; the result is cached on disk under the region's fingerprint,
the device and the versions, so later compiles reuse it.
"""
from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..cache import cache_key
from ..capture.ir import Graph, fingerprint, subgraph
from ..capture.lower import to_fx
from ..failures import nodes_summary, note
from ..partition.region import Reason, Region
from .inductor_quiet import without_artifact_warning

log = logging.getLogger("torch_mirage")


@dataclass
class RegionTiming:
    mirage_us: float
    inductor_us: float


def random_like(meta, device=None) -> torch.Tensor:
    """Real-valued test data for a TensorMeta: normal floats, small non-negative ints, random bools."""
    device = device or meta.device
    shape, dtype = tuple(meta.shape), meta.dtype
    if dtype.is_floating_point:
        t = torch.randn(shape, device=device, dtype=torch.float32).to(dtype)
    elif dtype == torch.bool:
        t = torch.rand(shape, device=device) > 0.5
    else:
        t = torch.randint(0, 8, shape, device=device, dtype=dtype)
    if not meta.is_contiguous and all(s > 0 for s in shape):
        t = torch.empty_strided(shape, meta.stride, device=device, dtype=dtype).copy_(t)
    return t


def _repeated_timing(run_once: Callable[[], Any], calls_per_run: int, replays: int | None, target_ms: float | None,
                     repeats: int) -> dict:
    """Time ``run_once`` ``replays`` times per repeat (or as often as fills ``target_ms``): µs per call."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    run_once()
    if replays is None:
        start.record()
        run_once()
        end.record()
        end.synchronize()
        replays = max(1, math.ceil((target_ms or 10.0) / max(start.elapsed_time(end), 1e-3)))
    per_call = []
    for _ in range(repeats):
        start.record()
        for _ in range(replays):
            run_once()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) * 1e3 / (replays * calls_per_run))
    return {"us": statistics.median(per_call), "us_min": min(per_call), "us_max": max(per_call),
            "replays": replays, "repeats": repeats, "sets": calls_per_run, "samples": per_call}


def cuda_graph_timing(fn: Callable[..., Any], input_sets: Sequence[Sequence[Any]], *, replays: int | None = None,
                      target_ms: float | None = None, repeats: int = 5) -> dict:
    """µs per call of ``fn`` in one CUDA graph that calls it once per input set (warmed up on a side stream, so
    compilation and autotuning happen before capture), replayed ``replays`` times per repeat or for about
    ``target_ms``; median, min and max over the repeats."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for inputs in input_sets:
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for inputs in input_sets:
            fn(*inputs)
    try:
        return _repeated_timing(graph.replay, len(input_sets), replays, target_ms, repeats)
    finally:
        del graph


def plain_timing(fn: Callable[..., Any], inputs: Sequence[Any], *, replays: int | None = None,
                 target_ms: float = 10.0, repeats: int = 5) -> dict:
    """µs per call of ``fn(*inputs)`` launched from Python, no CUDA graph (for what cannot be captured, and for
    calls long enough that launching does not count)."""
    return _repeated_timing(lambda: fn(*inputs), 1, replays, target_ms, repeats)


def alternating_medians(names: Sequence[str], time_half: Callable[[str], list[float]],
                        on_error: Callable[[str, Exception], None] | None = None) -> dict[str, float]:
    """Median µs per call of each named candidate, timed in the order A B … B A by ``time_half(name)`` (which
    returns per-call samples): the GPU's clock and temperature drift between back-to-back timings, and each
    candidate then meets the drift alike. A candidate whose timing raises is dropped when ``on_error`` is given
    (and told), else the error propagates."""
    samples: dict[str, list[float] | None] = {name: [] for name in names}
    for name in [*names, *reversed(names)]:
        if samples[name] is None:
            continue
        try:
            samples[name] += time_half(name)
        except Exception as e:
            if on_error is None:
                raise
            on_error(name, e)
            samples[name] = None
    return {name: statistics.median(got) for name, got in samples.items() if got}


def cuda_graph_time_us(fn: Callable[..., Any], input_sets: Sequence[Sequence[Any]], replays: int = 20,
                       repeats: int = 5) -> float:
    """Median µs per call of :func:`cuda_graph_timing`."""
    return cuda_graph_timing(fn, input_sets, replays=replays, repeats=repeats)["us"]


def rotated_input_sets(inputs: Sequence[Any], l2_bytes: int, max_sets: int = 64) -> list[list[Any]]:
    """Enough copies of ``inputs`` that one pass over them touches more than 3× L2 (one set, not copied twice,
    when it is that large by itself: a 2 GiB logits region needs no second copy)."""
    nbytes = sum(t.numel() * t.element_size() for t in inputs if isinstance(t, torch.Tensor)) or 1
    count = max(1, min(max_sets, -(-3 * l2_bytes // nbytes)))
    if count == 1:
        return [list(inputs)]   # the inputs themselves: no copy of a set that large
    return [[t.clone() if isinstance(t, torch.Tensor) else t for t in inputs] for _ in range(count)]


def timing_input_sets(args: Sequence[Any], l2_bytes: int) -> list[list[Any]]:
    """:func:`rotated_input_sets` of a caller's real arguments where a copy is the same input to the callee:
    every tensor dense and non-overlapping (``clone`` keeps its strides) and no two sharing storage (a copy
    would break the aliasing). Otherwise, or without the memory for the copies, the arguments themselves."""
    tensors = [t for t in args if isinstance(t, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    if len(storages) != len(tensors) or not all(_dense(t) for t in tensors):
        return [list(args)]
    try:
        return rotated_input_sets(args, l2_bytes)
    except torch.cuda.OutOfMemoryError:
        return [list(args)]


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory once in some order of dims (what ``clone`` reproduces)."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _inductor_region(sub: Graph, inputs: Sequence[torch.Tensor], mode: str) -> Callable[..., Any]:
    from torch._inductor import standalone_compile

    options = {"max_autotune": True} if mode == "max-autotune-no-cudagraphs" else {}
    with without_artifact_warning():
        compiled = standalone_compile(to_fx(sub), list(inputs), dynamic_shapes="from_example_inputs",
                                      options=options)
    return lambda *args: compiled(*args)


def measure_region(region: Region, graph: Graph, ctx: Any) -> RegionTiming:
    outs = region.outputs(graph)
    sub = subgraph(graph, region.nodes, outs)
    key = None
    if ctx.cache is not None:
        key = cache_key(kind="region-timing", graph=fingerprint(sub), claimer=region.claimer,
                        device=torch.cuda.get_device_name(), config=ctx.config.output_key())
        hit = ctx.cache.get_json(key)
        if hit is not None:
            return RegionTiming(**hit)
    inputs = [random_like(v.meta) if v.meta else v.example for v in sub.inputs]
    sets = rotated_input_sets(inputs, torch.cuda.get_device_properties(inputs[0].device).L2_cache_size)
    fns = {"mirage": region.kernel, "inductor": _inductor_region(sub, inputs, ctx.config.inductor_mode)}
    us = alternating_medians(list(fns), lambda name: cuda_graph_timing(fns[name], sets, replays=20,
                                                                        repeats=3)["samples"])
    timing = RegionTiming(mirage_us=us["mirage"], inductor_us=us["inductor"])
    if key is not None:
        ctx.cache.put_json(key, timing.__dict__)
    return timing


def keep_faster(regions: Sequence[Region], graph: Graph, ctx: Any) -> None:
    """Hand each mirage region whose kernel measured slower than Inductor's back to the fallback."""
    from tqdm.auto import tqdm

    timed = [r for r in regions if r.compiled_by == "mirage" and r.kernel is not None
             and all(v.meta is None or v.meta.device.type == "cuda" for v in r.inputs)]
    # seconds each (an Inductor compile of the region, two CUDA graphs): a bar on a terminal, nothing elsewhere
    for region in tqdm(timed, desc="torch_mirage: timing regions against Inductor", unit="region",
                       leave=False, disable=None):
        try:
            with unset_fake_temporarily():
                timing = measure_region(region, graph, ctx)
        except Exception as e:   # measuring is advice: keep mirage's verified kernel and say so
            if ctx.config.strict:
                raise
            log.info("torch_mirage: could not time region %s against Inductor (%s: %s); keeping mirage's kernel",
                     region.ops, type(e).__name__, e)
            region.info["measured"] = f"failed: {type(e).__name__}"
            continue
        region.info["mirage_us"] = round(timing.mirage_us, 2)
        region.info["inductor_us"] = round(timing.inductor_us, 2)
        if timing.mirage_us > timing.inductor_us:
            region.compiled_by, region.reason = ctx.config.fallback, Reason.SLOWER_THAN_INDUCTOR
            region.detail = f"{timing.mirage_us:.1f} µs vs Inductor {timing.inductor_us:.1f} µs"
            region.kernel = None


_EAGER_SLACK = 3.0   # a kernel may be this many times as far from float64 as eager itself
_CHECK_TOL = {torch.float16: 1e-2, torch.bfloat16: 3e-2, torch.float32: 1e-4, torch.float64: 1e-10}


_CHUNK = 1 << 22   # elements compared at a time: the check of a 2 GiB logits output needs no 4 GiB float64 copy


def _chunks(*tensors: torch.Tensor):
    flat = [t.reshape(-1) for t in tensors]
    for i in range(0, flat[0].numel(), _CHUNK):
        yield [f[i:i + _CHUNK] for f in flat]


def _same_non_finite(got: torch.Tensor, want: torch.Tensor) -> bool:
    """NaN and ±inf in the same places, with the same infinities."""
    for g, w in _chunks(got, want):
        finite = torch.isfinite(w)
        if not torch.equal(finite, torch.isfinite(g)):
            return False
        if not torch.equal(g[~finite].double().nan_to_num(), w[~finite].double().nan_to_num()):
            return False
    return True


def _relative_error(got: torch.Tensor, ref: torch.Tensor, where_finite: torch.Tensor) -> float:
    """‖got − ref‖ / ‖ref‖ in float64 over the elements where ``where_finite`` (eager's output) is finite."""
    diff = norm = 0.0
    for g, r, w in _chunks(got, ref, where_finite):
        keep = torch.isfinite(w)
        g, r = g[keep].double(), r[keep].double()
        diff += (g - r).pow(2).sum().item()
        norm += r.pow(2).sum().item()
    return math.sqrt(diff) / (math.sqrt(norm) or 1.0)


def numerics_problem(region: Region, graph: Graph) -> str | None:
    """Run the region's kernel and its ATen subgraph on the same random inputs; describe any mismatch.

    NaN / inf must fall where eager's do. Float outputs are compared with the subgraph run in float64: the
    kernel may be off by the dtype's tolerance, or by a few times eager's own error where eager rounds
    intermediates to fp16 / bf16 (the kernel keeps them in fp32, as Inductor does).
    """
    outs = region.outputs(graph)
    sub = subgraph(graph, region.nodes, outs)
    inputs = [random_like(v.meta) if v.meta else v.example for v in sub.inputs]
    program = to_fx(sub)
    with torch.no_grad():
        want = program(*inputs)
        got = region.kernel(*inputs)
        exact = None
    for v, g, w in zip(outs, got, want):
        if not isinstance(w, torch.Tensor):
            continue
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"output {v.name}: {g.dtype}{list(g.shape)} instead of {w.dtype}{list(w.shape)}"
        if w.dtype == torch.bool or not w.dtype.is_floating_point:
            if not torch.equal(g, w):
                return f"output {v.name}: {(g != w).sum().item()} of {w.numel()} elements differ"
            continue
        if not _same_non_finite(g, w):
            return f"output {v.name}: NaN / inf pattern differs from eager"
        tol = _CHECK_TOL.get(w.dtype, 1e-2)
        err = _relative_error(g, w, w)
        if err <= tol:
            continue
        if exact is None:
            with torch.no_grad():
                exact = program(*[x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                                  for x in inputs])
        ref = exact[outs.index(v)]
        err, eager_err = _relative_error(g, ref, w), _relative_error(w, ref, w)
        if err > max(tol, _EAGER_SLACK * eager_err):
            return (f"output {v.name}: relative error {err:.2e} against float64 (eager's own {eager_err:.2e}, "
                    f"{w.dtype})")
    return None


def check_regions(regions: Sequence[Region], graph: Graph, ctx: Any) -> None:
    """Hand back every mirage region whose kernel disagrees with eager, or fails to run, on random inputs."""
    for region in regions:
        if region.compiled_by != "mirage" or region.kernel is None:
            continue
        try:
            with unset_fake_temporarily():   # the compile runs under AOT's fake mode; this needs real tensors
                problem = numerics_problem(region, graph)
        except Exception as e:
            if ctx.config.strict:
                raise
            problem = f"kernel failed to run: {type(e).__name__}: {e}"
        if problem is not None:
            if ctx.config.strict:
                raise RuntimeError(f"torch_mirage: region {region.ops} ({region.claimer}) is wrong: {problem}")
            note(ctx, "check", f"the {region.claimer} kernel for {nodes_summary(region.nodes)}",
                 f"disagrees with eager: {problem}", f"the region runs through {ctx.config.fallback}")
            region.compiled_by, region.reason, region.detail = ctx.config.fallback, Reason.COMPILE_ERROR, problem
            region.kernel = None
