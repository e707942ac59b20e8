"""Measured choice between mirage's kernel for a region and Inductor's version of the same region.

On a CUDA device each claimed region is timed once — both versions inside a CUDA graph, over input sets
rotated past L2 — and the faster one is kept; the result is cached on disk under the region's fingerprint,
the device and the versions, so later compiles reuse it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..cache import cache_key
from ..capture.ir import Graph, fingerprint, subgraph
from ..capture.lower import computed_from_constants, constant_value, to_fx
from ..context import CompileContext
from ..failures import nodes_summary, note
from ..numerics import TOLERANCE, relative_error, same_non_finite, tolerance
from ..partition.region import Reason, Region
from ..timing import random_like, cuda_graph_timing, rotated_input_sets, strided_copy
from ..tune import tune
from .assemble import inductor_configs
from .inductor_quiet import without_artifact_warning

log = logging.getLogger("torch_mirage")


@dataclass
class RegionTiming:
    mirage_us: float
    inductor_us: float


def _inductor_region(sub: Graph, inputs: Sequence[torch.Tensor], mode: str) -> Callable[..., Any]:
    from torch._inductor import standalone_compile

    options = inductor_configs(mode)
    with without_artifact_warning():
        compiled = standalone_compile(to_fx(sub), list(inputs), dynamic_shapes="from_example_inputs",
                                      options=options)
    return lambda *args: compiled(*args)


def measure_region(region: Region, graph: Graph, ctx: CompileContext) -> RegionTiming:
    """Mirage's kernel for ``region`` and Inductor's compile of the same region, each replayed in a CUDA graph
    over input sets rotated past L2 (:func:`~torch_mirage.tune.tune`); cached per region, claimer, device and
    configuration. Raises when either cannot be timed."""
    outs = region.outputs(graph)
    sub = subgraph(graph, region.nodes, outs)
    key = None
    if ctx.cache is not None:
        key = cache_key(kind="region-timing/3", graph=fingerprint(sub), claimer=region.claimer,
                        device=torch.cuda.get_device_name(), config=ctx.config.output_key())
    inputs: list = []
    sets: list = []

    def build(name: str) -> Callable[..., Any]:   # inputs and timing sets only when the cache has no answer
        if not sets:
            inputs.extend(region_check_inputs(region, graph, sub, ctx.observed_inputs))
            sets.extend(rotated_input_sets(inputs, torch.cuda.get_device_properties(inputs[0].device).L2_cache_size))
        return region.kernel if name == "mirage" else _inductor_region(sub, inputs, ctx.config.inductor_mode)

    tuned = tune(["mirage", "inductor"], lambda name, fn: cuda_graph_timing(fn, sets, replays=20, repeats=3)["samples"],
                 build=build, cache=ctx.cache, key=key, label="region version")
    if set(tuned.times) != {"mirage", "inductor"}:
        raise RuntimeError(f"could not time both versions ({', '.join(f'{k}: {v}' for k, v in tuned.dropped.items())})")
    return RegionTiming(mirage_us=tuned.times["mirage"], inductor_us=tuned.times["inductor"])


def keep_faster(regions: Sequence[Region], graph: Graph, ctx: CompileContext) -> None:
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
            region.info["measured"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
            continue
        region.info["mirage_us"] = round(timing.mirage_us, 2)
        region.info["inductor_us"] = round(timing.inductor_us, 2)
        if timing.mirage_us > timing.inductor_us:
            region.compiled_by, region.reason = ctx.config.fallback, Reason.SLOWER_THAN_INDUCTOR
            region.detail = f"{timing.mirage_us:.1f} µs vs Inductor {timing.inductor_us:.1f} µs"
            region.kernel = None


_EAGER_SLACK = 3.0   # a kernel may be this many times as far from float64 as eager itself


OBSERVED_COPY_BYTES = 512 << 20   # the largest input of the compiled call a region is timed on (a copy of it)


def region_check_inputs(region: Region, graph: Graph, sub: Graph, observed: dict[int, Any] | None = None) -> list:
    """Inputs for ``sub`` (the region as a standalone graph): random tensors shaped as the region's inputs, except
    values the graph computes from its constants alone (a mask built from ``arange``), which keep their real
    contents — the kernel may rely on their value properties (:func:`~..capture.lower.constant_value`).
    ``observed``: the compiled call's own inputs by graph input index (timing only: a kernel that skips what a
    passed-in mask hides is timed on the call's mask, not a random one); what the region reads of them, or
    computes from them alone, is a copy of the call's value (the region may write its inputs), up to
    ``OBSERVED_COPY_BYTES`` each."""
    named = {graph.inputs[i].name: t for i, t in (observed or {}).items() if i < len(graph.inputs)}
    known = {}
    for v in region.inputs:
        if v.meta is None or (t := constant_value(graph, v, named)) is None:
            continue
        if any(t is x for x in named.values()):       # the call's own tensor: a copy, or random where too large
            if t.numel() * t.element_size() > OBSERVED_COPY_BYTES:
                continue
            t = strided_copy(t)
        known[v.name] = t
    return [known[v.name] if v.name in known else random_like(v.meta) if v.meta else v.example
            for v in sub.inputs]


def numerics_problem(region: Region, graph: Graph, sub: Graph | None = None) -> str | None:
    """Run the region's kernel and its ATen subgraph on the same random inputs; describe any mismatch.

    NaN / inf must fall where eager's do. Float outputs are compared with the subgraph run in float64: the
    kernel may be off by the dtype's tolerance, or by a few times eager's own error where eager rounds
    intermediates to fp16 / bf16 (the kernel keeps them in fp32, as Inductor does). ``sub``: the region as a
    standalone graph, where the caller has it.
    """
    outs = region.outputs(graph)
    sub = sub or subgraph(graph, region.nodes, outs)
    inputs = region_check_inputs(region, graph, sub)
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
        if not same_non_finite(g, w):
            return f"output {v.name}: NaN / inf pattern differs from eager"
        # a float dtype without its own entry (float8) is held to fp16's
        tol = tolerance(w.dtype if w.dtype in TOLERANCE["kernel"] else torch.float16)
        err = relative_error(g, w, where=w)
        if err <= tol:
            continue
        if exact is None:
            with torch.no_grad():
                exact = to_fx(sub, float64=True)(*[x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                                  for x in inputs])
        ref = exact[outs.index(v)]
        err, eager_err = relative_error(g, ref, where=w), relative_error(w, ref, where=w)
        if not err <= max(tol, _EAGER_SLACK * eager_err):     # a NaN error (a reference with none) passes nothing
            return (f"output {v.name}: relative error {err:.2e} against float64 (eager's own {eager_err:.2e}, "
                    f"{w.dtype})")
    return None


def check_key(region: Region, graph: Graph, sub: Graph) -> tuple:
    """What a region's check depends on: its subgraph (structure, shapes, strides, dtypes, constants), its claimer
    and built kernel (the μGraph and its launches, or the stitch kernel's source), and which of the graph's values
    its inputs computed from constants alone are (the check runs on their real contents). Two regions with one key
    (a model's layers) run the same code on the same kind of inputs."""
    info = region.info
    constants = tuple(v.name for v in region.inputs if v.meta is not None and computed_from_constants(graph, v))
    return (fingerprint(sub), region.claimer, info.get("ugraph_hash"), repr(info.get("launch")),
            repr(info.get("sibling_launches")), info.get("kernel_source"), constants)


def check_regions(regions: Sequence[Region], graph: Graph, ctx: CompileContext) -> None:
    """Hand back every mirage region whose kernel disagrees with eager, or fails to run, on random inputs; a region
    whose :func:`check_key` an earlier region of the graph passed with is not run again."""
    passed: set[tuple] = set()
    for region in regions:
        if region.compiled_by != "mirage" or region.kernel is None:
            continue
        try:
            with unset_fake_temporarily():   # the compile runs under AOT's fake mode; this needs real tensors
                sub = subgraph(graph, region.nodes, region.outputs(graph))
                key = check_key(region, graph, sub)
                if key in passed:
                    continue
                problem = numerics_problem(region, graph, sub)
                if problem is None:
                    passed.add(key)
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
