"""The build stage: each claimed region's plan made into its kernel.

Claimers return plans, never kernels (:mod:`.partition.region`). This stage turns each mirage region's plan into
a callable from the region's input tensors to its output tensors, dispatching on the plan's type
(:func:`kernel_of`): a :class:`~.codegen.stitch_plan.StitchPlan` is emitted, written and loaded as one stitched
Triton kernel (:func:`~.codegen.stitch_launch.build_kernel`; on a GPU all of them compiled at once in the compile
pool, :mod:`.compile_pool`, at the end of the stage); a :class:`~.superopt.ugraph_plan.UGraphPlan` has each
of its μGraphs compiled (:func:`~.superopt.compile.compile_ugraph`, whose launch configurations are tuned on a GPU)
and, where it has several, the fastest chosen on a GPU — both choices through :func:`~.tune.tune`, the one loop of
candidates, check, timing and winner cache. A plan that fails to build leaves its region to the fallback (reason
``COMPILE_ERROR``, the error in its detail and in a typed decline, one grouped warning); under ``strict`` it raises.
Another plan type gets its builder with ``kernel_of.register``.
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


def build_region(region: Region, graph: Graph, ctx: CompileContext) -> Callable[[], None] | None:
    """``region``'s kernel from its plan; a plan that fails to build leaves the region to the fallback, with the
    error as its detail and a :class:`Decline` of the claimer (raised under ``strict``). Returns what compiles the
    kernel ahead where the build left that to its first run (:attr:`Built.warmup`), else None."""
    start = time.perf_counter()
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
    """Each of the plan's μGraphs compiled (launches tuned on a GPU); of several, the fastest on a GPU. Where the
    cache already holds that choice for these μGraphs and device, only its winner is compiled (a warm compile
    builds one alternative, not all); should it fail, every alternative is built as on a cold compile."""
    examples = plan.examples()
    where = dict(cache=ctx.cache, cache_dir=ctx.config.cache_dir, target=ctx.target,
                 propose=plan.propose or candidates)

    def compile_one(alternative: Alternative, warmups: dict | None = None) -> Any:
        return compile_ugraph(alternative.graph, examples, label=alternative.name, warmups=warmups, **where)

    def compile_ahead(alternatives: Sequence[Alternative]) -> None:
        """The launch candidates of every op of ``alternatives`` in one round of the compile pool: each op's tuning
        then finds its kernels compiled, instead of waiting for a round of its own."""
        if ctx.target is not Target.CUDA or not examples[0].is_cuda or not budget_left():
            return                 # a spent tuning budget times nothing: each op takes its first candidate
        jobs: dict[str, Callable[[], None]] = {}
        for a in alternatives:
            try:
                jobs.update(tuning_compiles(a.graph, examples, label=a.name, **where))
            except Exception as e:   # its compile_one meets the same error, and drops it or says why
                log.debug("torch_mirage: no compiles ahead for μGraph %s (%s: %s)", a.name, type(e).__name__, e)
        start = time.perf_counter()
        compiled = run_all(list(jobs), lambda name: jobs[name](), workers())
        if compiled is not None:   # a launch that failed here fails again in its tuning round, which drops it
            log.info("torch_mirage: compiled the launch candidates of %d μGraph(s) ahead, %d kernels in %.2f s (%s; "
                     "%d failed)", len(alternatives), len(jobs), time.perf_counter() - start, compiled.how,
                     len(compiled.errors))
    hit = cached_choice(ctx.cache, _alternatives_key([a.graph for a in plan.alternatives], examples, ctx.cache),
                        [a.name for a in plan.alternatives]) if len(plan.alternatives) > 1 else None
    if hit is not None:
        chosen = next(a for a in plan.alternatives if a.name == hit.winner)
        try:
            compile_ahead([chosen])
            return _built(plan, chosen, compile_one(chosen), hit.times)
        except Exception as e:
            log.info("torch_mirage: cached μGraph choice %s of %s does not compile (%s: %s); building all",
                     chosen.name, plan.what, type(e).__name__, e)
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
    return _built(plan, chosen, compiled, times)


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


def _alternatives_key(graphs: Sequence[Any], examples: list, cache: Any) -> str | None:
    """The cache key of the choice among μGraphs ``graphs`` on the examples' device; None off CUDA (nothing is
    timed there) or without a cache."""
    if cache is None or examples[0].device.type != "cuda":
        return None
    return cache_key(kind="ugraph-alternatives/2", graphs=[g.hash() for g in graphs],
                     device=torch.cuda.get_device_name(examples[0].device))


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
