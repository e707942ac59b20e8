"""The build stage: each claimed region's plan made into its kernel.

Claimers return plans, never kernels (:mod:`.partition.region`). This stage turns each mirage region's plan into
a callable from the region's input tensors to its output tensors, dispatching on the plan's type
(:func:`kernel_of`): a :class:`~.codegen.stitch_plan.StitchPlan` is emitted, written and loaded as one stitched
Triton kernel (:func:`~.codegen.stitch_launch.build_kernel`; on a GPU all of them compiled at once in the compile
pool, :mod:`.compile_pool`, at the end of the stage); a :class:`~.superopt.ugraph_plan.UGraphPlan` has each
of its μGraphs compiled (:func:`~.superopt.compile.compile_ugraph`, whose launch configurations are tuned on a GPU)
and, where it has several, the fastest chosen on a GPU — both choices through :func:`~.tune.tune`, the one loop of
candidates, check, timing and winner cache. On a GPU the launch candidates of every μGraph plan of the graph compile
first, in one round of the pool (:func:`compile_candidates_ahead`), not one round per region; a region of the same
μGraph as an earlier one (a model's next layer) shares its compiled kernels. A plan that fails to build leaves its
region to the fallback (reason ``COMPILE_ERROR``, the error in its detail and in a typed decline, one grouped
warning); under ``strict`` it raises. Another plan type gets its builder with ``kernel_of.register``.
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .cache import cache_key
from .capture.ir import Graph
from .codegen.stitch_launch import build_kernel
from .codegen.stitch_plan import StitchPlan
from .compile_pool import run_all, workers
from .context import CompileContext, Target
from .failures import describe_error, nodes_summary, note, stage
from .partition.region import Decline, Outcome, Reason, Region, claims
from .report import gpu_peak_mib, gpu_peak_rise_mib
from .superopt.compile import compile_ugraph, tuning_compiles
from .superopt.launch import candidates
from .superopt.ugraph_plan import Alternative, UGraphPlan
from .timing import cuda_graph_timing, rotated_input_sets
from .tune import budget_left, cached_choice, tune

log = logging.getLogger("torch_mirage")


@dataclass
class Built:
    """A plan's kernel, and what the region's report says about it once built."""
    kernel: Callable[..., tuple]                           # (*region inputs) -> tuple(region outputs)
    detail: str | None = None                              # the region's detail (None: the claim's stands)
    info: dict[str, Any] = field(default_factory=dict)     # facts added to the region's info
    warmup: Callable[[], None] | None = None               # compiles the kernel without running it (any thread)


def build_regions(regions: Sequence[Region], graph: Graph, ctx: CompileContext) -> None:
    """The build stage: every mirage region without a kernel gets the one its plan builds, or goes to the
    fallback with the error (:func:`build_region`). The kernels that are not compiled by then (the stitch kernels:
    nothing tunes them) compile at once in the compile pool, before the check stage first runs them."""
    warmups: dict[str, Callable[[], None]] = {}
    compile_candidates_ahead(regions, ctx)
    for region in regions:
        if region.compiled_by == "mirage" and region.kernel is None:
            warmup = build_region(region, graph, ctx)
            if warmup is not None:
                warmups[f"{region.claimer} kernel for {nodes_summary(region.nodes)} ({len(warmups)})"] = warmup
    if ctx.target is Target.CUDA and warmups:
        start = time.perf_counter()
        compiled = run_all(list(warmups), lambda name: warmups[name](), workers())
        if compiled is not None:   # a kernel that failed to compile fails again in the check stage, which says why
            log.info("torch_mirage: compiled %d region kernels ahead in %.2f s (%s; %d failed)", len(warmups),
                     time.perf_counter() - start, compiled.how, len(compiled.errors))


def compile_candidates_ahead(regions: Sequence[Region], ctx: CompileContext) -> None:
    """On a GPU, the launch candidates the build will tune for every μGraph plan of ``regions`` (each once where
    regions share one: a model's layers) compiled in one round of the compile pool, where each region's round would
    wait for its own slowest compile (H100 2026-11-27: a decode layer's cold build spent 19.5 of its 29 s waiting on
    the rounds). Each plan's example inputs are made, read for their shapes, dtypes and strides, and freed, one plan
    at a time; the plans are marked (:attr:`UGraphPlan.candidates_compiled`), so that their own build skips its
    round. Nothing off CUDA or once the tuning budget is spent."""
    if ctx.target is not Target.CUDA or not torch.cuda.is_available() or not budget_left():
        return
    jobs: dict[str, Callable[[], None]] = {}
    seen: set = set()
    for k, region in enumerate(regions):
        plan = region.plan
        if region.compiled_by != "mirage" or region.kernel is not None or not isinstance(plan, UGraphPlan):
            continue
        try:
            device, metas = _example_metas(plan)
        except Exception as e:   # its own build makes them again, and says what fails
            log.info("torch_mirage: no compiles ahead for %s (%s: %s)", plan.what, type(e).__name__, e)
            continue
        if device.type != "cuda":
            continue
        hit = _cached_alternative(plan, metas, ctx.cache, device)
        alternatives = [hit[0]] if hit else plan.alternatives
        key = _plan_key(alternatives, plan.propose, metas)
        plan.candidates_compiled = True
        if key not in seen:      # else another region's plan (an earlier layer's) compiles the same kernels
            seen.add(key)
            jobs.update(_candidate_jobs(alternatives, metas, _compile_where(plan, ctx), device, f"region {k} "))
    _compile_round(jobs, "the graph's μGraphs")


def _plan_key(alternatives: Sequence[Alternative], propose: Any, tensors: Sequence[torch.Tensor]) -> tuple:
    """What a plan's kernels are made from: its μGraphs, its launch proposer and its example inputs' shapes, dtypes
    and strides (a model's layers share one)."""
    return (tuple(a.graph.hash() for a in alternatives), getattr(propose, "__name__", None),
            tuple((tuple(x.shape), x.dtype, x.stride()) for x in tensors))


def _example_metas(plan: UGraphPlan) -> tuple[torch.device, list[torch.Tensor]]:
    """The device of the plan's example inputs and meta tensors of their shapes, dtypes and strides (the real ones
    made and freed: what a kernel is compiled for, besides alignment, which a fresh buffer has)."""
    with unset_fake_temporarily():
        examples = plan.examples()
        return examples[0].device, [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
                                    for x in examples]


def _candidate_jobs(alternatives: Sequence[Alternative], examples: list, where: dict[str, Any],
                    device: torch.device | None = None, prefix: str = "") -> dict[str, Callable[[], None]]:
    """The compiles of every launch candidate of ``alternatives``' ops (:func:`tuning_compiles`), by name."""
    jobs: dict[str, Callable[[], None]] = {}
    for a in alternatives:
        try:
            jobs.update({prefix + name: job for name, job in
                         tuning_compiles(a.graph, examples, label=a.name, device=device, **where).items()})
        except Exception as e:   # its compile_one meets the same error, and drops it or says why
            log.info("torch_mirage: no compiles ahead for μGraph %s (%s: %s)", a.name, type(e).__name__, e)
    return jobs


def _compile_round(jobs: dict[str, Callable[[], None]], what: str) -> None:
    """``jobs`` in one round of the compile pool, logged with its seconds."""
    start = time.perf_counter()
    compiled = run_all(list(jobs), lambda name: jobs[name](), workers())
    if compiled is not None:   # a launch that failed here fails again in its tuning round, which drops it
        log.info("torch_mirage: compiled the launch candidates of %s ahead, %d kernels in %.2f s (%s; %d failed)",
                 what, len(jobs), time.perf_counter() - start, compiled.how, len(compiled.errors))


def _compile_where(plan: UGraphPlan, ctx: CompileContext) -> dict[str, Any]:
    """Where a plan's kernels compile and how their launches are proposed (compile_ugraph's and
    tuning_compiles' keyword arguments)."""
    return dict(cache=ctx.cache, cache_dir=ctx.config.cache_dir, target=ctx.target, propose=plan.propose or candidates)


def _cached_alternative(plan: UGraphPlan, examples: list, cache: Any,
                        device: torch.device | None = None) -> tuple[Alternative, dict[str, float]] | None:
    """The plan's μGraph the cache says is fastest for these μGraphs on the examples' (or ``device``'s) device,
    with the times it was chosen by; None where the plan has one μGraph or the cache has no answer."""
    if len(plan.alternatives) < 2:
        return None
    hit = cached_choice(cache, _alternatives_key([a.graph for a in plan.alternatives], examples, cache, device),
                        [a.name for a in plan.alternatives])
    if hit is None:
        return None
    return next(a for a in plan.alternatives if a.name == hit.winner), hit.times


def build_region(region: Region, graph: Graph, ctx: CompileContext) -> Callable[[], None] | None:
    """``region``'s kernel from its plan; a plan that fails to build leaves the region to the fallback, with the
    error as its detail and a :class:`Decline` of the claimer (raised under ``strict``). Returns what compiles the
    kernel ahead where the build left that to its first run (:attr:`Built.warmup`), else None."""
    start, peak0 = time.perf_counter(), gpu_peak_mib()
    try:
        # the compile runs under AOT's fake mode; compiling and timing a kernel needs real tensors
        with unset_fake_temporarily(), stage("build"):
            built = kernel_of(region.plan, region, graph, ctx)
    except Exception as e:
        if ctx.config.strict:
            raise
        what = f" ({region.plan.what})" if isinstance(region.plan, UGraphPlan) else ""
        note(ctx, "build", f"the {region.claimer} kernel for {nodes_summary(region.nodes)}{what}", e,
             f"the region runs through {ctx.config.fallback}")
        detail = describe_error(e)
        region.declines.append(Decline(region.nodes, Reason.COMPILE_ERROR, detail, region.claimer))
        region.compiled_by, region.reason, region.detail, region.kernel = \
            ctx.config.fallback, Reason.COMPILE_ERROR, detail, None
        return None
    region.kernel = built.kernel
    if built.detail is not None:
        region.detail = built.detail
    region.info.update(built.info)
    # issue 15: where the build stage's seconds go, per region (compiles, tuning, disk-cache hits)
    region.info["build_s"] = round(time.perf_counter() - start, 2)
    rise = gpu_peak_rise_mib(peak0)
    if peak0 is not None and rise is not None and rise >= 1:   # its tuning raised the GPU memory peak
        region.info["build_peak_rise_mib"] = round(rise)
    return built.warmup


def built_regions(outcomes: Sequence[Outcome], graph: Graph, ctx: CompileContext, claimer: str = "") -> list[Region]:
    """The claims among one claimer's ``outcomes`` as regions, built: a claimer and the build stage run on their
    own, outside the pipeline (tests, scripts)."""
    regions = [Region.of_claim(c, claimer) for c in claims(outcomes)]
    build_regions(regions, graph, ctx)
    return regions


@functools.singledispatch
def kernel_of(plan: Any, region: Region, graph: Graph, ctx: CompileContext) -> Built:
    """The kernel of ``region`` from ``plan``, by the plan's type; raises where it does not build."""
    raise TypeError(f"no builder for a {type(plan).__name__} plan (claimer {region.claimer!r}, ops {region.ops}); "
                    f"a claimer's plan is a StitchPlan or a UGraphPlan, or registers its builder with "
                    f"build.kernel_of.register")


@kernel_of.register
def _stitch(plan: StitchPlan, region: Region, graph: Graph, ctx: CompileContext) -> Built:
    """One stitched Triton kernel: emitted, written into the cache and loaded."""
    kernel, path = build_kernel(plan, region.inputs, ctx.config.cache_dir)
    return Built(kernel, info={"kernel_source": path}, warmup=kernel.warmup)


@kernel_of.register
def _ugraph(plan: UGraphPlan, region: Region, graph: Graph, ctx: CompileContext) -> Built:
    """The plan's μGraph compiled (:func:`_compiled_ugraph`), or the one compiled for an earlier region of this
    graph with the same μGraphs and example inputs of the same shapes, dtypes and strides (a model's next layer:
    its tuning would read the same cached choices; its kernels are the same)."""
    examples = plan.examples()
    key = (_plan_key(plan.alternatives, plan.propose, examples), examples[0].device)
    if key not in ctx.built_ugraphs:
        ctx.built_ugraphs[key] = _compiled_ugraph(plan, examples, ctx)
    name, compiled, times = ctx.built_ugraphs[key]
    return _built(plan, next(a for a in plan.alternatives if a.name == name), compiled, times)


def _compiled_ugraph(plan: UGraphPlan, examples: list, ctx: CompileContext) -> tuple[str, Any, dict[str, float]]:
    """Each of the plan's μGraphs compiled (launches tuned on a GPU); of several, the fastest on a GPU: ``(its
    name, the compiled μGraph, the times it was chosen by)``. Where the cache already holds that choice for these
    μGraphs and device, only its winner is compiled (a warm compile builds one alternative, not all); should it
    fail, every alternative is built as on a cold compile."""
    where = _compile_where(plan, ctx)

    def compile_one(alternative: Alternative, warmups: dict | None = None) -> Any:
        return compile_ugraph(alternative.graph, examples, label=alternative.name, warmups=warmups, **where)

    def compile_ahead(alternatives: Sequence[Alternative]) -> None:
        """The launch candidates of every op of ``alternatives`` in one round of the compile pool: each op's tuning
        then finds its kernels compiled, instead of waiting for a round of its own."""
        if ctx.target is not Target.CUDA or not examples[0].is_cuda or not budget_left() or plan.candidates_compiled:
            return     # a spent tuning budget times nothing: each op takes its first candidate; or compiled with all
        _compile_round(_candidate_jobs(alternatives, examples, where), f"{len(alternatives)} μGraph(s)")
    hit = _cached_alternative(plan, examples, ctx.cache)
    if hit is not None:
        chosen, times = hit
        try:
            compile_ahead([chosen])
            return chosen.name, compile_one(chosen), times
        except Exception as e:
            log.info("torch_mirage: cached μGraph choice %s of %s does not compile (%s: %s); building all",
                     chosen.name, plan.what, type(e).__name__, e)
            plan.candidates_compiled = False      # the round ahead compiled the cached choice's only
    built: list[tuple[Alternative, Any]] = []
    errors: list[Exception] = []
    warmups: dict[str, Callable[[], None]] = {}   # the alternatives' last rebuilt kernels, compiled in one round
    compile_ahead(plan.alternatives)
    for alternative in plan.alternatives:
        try:
            compiled = compile_one(alternative, warmups)
        except Exception as e:   # one alternative that does not compile: the others may
            if ctx.config.strict or len(plan.alternatives) == 1:
                raise
            log.info("torch_mirage: μGraph %s of %s does not compile (%s: %s); not used", alternative.name,
                     plan.what, type(e).__name__, e)
            errors.append(e)
            continue
        built.append((alternative, compiled))
    if not built:
        raise errors[-1]
    if ctx.target is Target.CUDA and examples[0].is_cuda:   # what fails here fails again, and says why, when timed
        run_all(list(warmups), lambda name: warmups[name](), workers())
    (chosen, compiled), times = fastest(built, examples, ctx.cache)
    return chosen.name, compiled, times


def _built(plan: UGraphPlan, chosen: Alternative, compiled: Any, times: dict[str, float]) -> Built:
    info = {**chosen.info, "ugraph_hash": chosen.graph.hash()[:16],
            "launch": [c.to_json() for c in compiled.configs]}
    if getattr(compiled, "sibling_launches", None):
        info["sibling_launches"] = compiled.sibling_launches     # kernel ops launched together, per launch
    if getattr(compiled, "stored_updates", 0):
        info["stored_updates"] = compiled.stored_updates         # cache writes its kernels store (superopt.updates)
    if times:
        info["ugraph_us"] = {name: round(us, 2) for name, us in times.items()}
    return Built(plan.bind(compiled), chosen.detail, info)


def _alternatives_key(graphs: Sequence[Any], examples: list, cache: Any,
                      device: torch.device | None = None) -> str | None:
    """The cache key of the choice among μGraphs ``graphs`` on the examples' (or ``device``'s) device; None off
    CUDA (nothing is timed there) or without a cache."""
    device = device or examples[0].device
    if cache is None or device.type != "cuda":
        return None
    return cache_key(kind="ugraph-alternatives/2", graphs=[g.hash() for g in graphs],
                     device=torch.cuda.get_device_name(device))


def _timing_sets(examples: list) -> list | None:
    """Copies of ``examples`` rotated past L2 for timing on CUDA; None off CUDA (nothing is timed there)."""
    if examples[0].device.type != "cuda":
        return None
    return rotated_input_sets(examples, torch.cuda.get_device_properties(examples[0].device).L2_cache_size)


def _time_ugraph(compiled: Callable, sets: list) -> list[float]:
    """Per-call µs samples of a compiled μGraph replayed in a CUDA graph over ``sets``."""
    return cuda_graph_timing(compiled, sets, replays=20, repeats=3)["samples"]


def fastest(built: list[tuple[Alternative, Any]], examples: list, cache: Any) -> tuple[tuple, dict[str, float]]:
    """The fastest of several compiled μGraphs ``(alternative, compiled)`` of one program (the first where none
    can be timed), with the times; a choice made once per μGraph set and device is read back from ``cache``
    (:func:`~torch_mirage.tune.tune`)."""
    if len(built) == 1:
        return built[0], {}
    by_name = {a.name: (a, c) for a, c in built}
    key = _alternatives_key([a.graph for a, _ in built], examples, cache)
    sets: list = []

    def timing_sets(name: str) -> list:        # the copies only when the cache has no answer
        if not sets:
            got = _timing_sets(examples)
            if got is None:
                raise RuntimeError("nothing is timed off CUDA")
            sets.extend(got)
        return sets

    tuned = tune(list(by_name), lambda name, sets: _time_ugraph(by_name[name][1], sets), build=timing_sets,
                 cache=cache, key=key, label="μGraph")
    if tuned.winner is None:
        return built[0], {}
    return by_name[tuned.winner], tuned.times
