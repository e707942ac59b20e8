"""The pipeline, top to bottom, for one functional ATen graph.

capture (AOTAutograd, in :mod:`torch_mirage.backend`) → lower → analyse (the
graph's value properties and its device's cost model, once:
:mod:`torch_mirage.analysis.graph`) → partition (claimers, each reading that
analysis and returning ``Claim(nodes, plan)`` or a typed ``Decline``) → build (plans to
kernels, :mod:`torch_mirage.build`; launch configurations and alternative
μGraphs tuned through :mod:`torch_mirage.tune`) → check (each kernel against
eager) → measure (GPU: each region against Inductor's) → assemble (kernels +
Inductor for the rest) → CUDA graph. The execution target (GPU or Triton's
interpreter) is a field of the typed :class:`CompileContext` every stage takes.
Each stage runs under :meth:`CompileContext.stage`, which records its time in
the graph's report and tags an exception leaving it with the stage's name.
Whatever fails inside mirage, the original graph goes to Inductor by a route
that re-runs none of mirage's stages (:func:`_after_failure`), with one warning
naming the stage and the ops; ``strict`` raises instead.
"""
from __future__ import annotations

import collections
import logging
from typing import Any, Sequence

import torch
import torch.fx as fx
from functorch.compile import make_boxed_func

from .capture.ir import Graph, Node, connected_components
from .capture.lower import lower
from .capture.rewrite import outer_products
from .analysis.cost import CostModel, matmul_rows, skinny_matmul
from .analysis.graph import analyse
from .build import build_regions
from .codegen.dependent_launch import dependent_launches
from .compile_pool import compile_workers
from .capture.ops import OpKind
from .config import Config
from .context import CompileContext
from .failures import Failure, describe_error, format_failure, fx_graph_summary, stage_of
from .partition.record import PartitionRecord
from .partition.region import Claim, ClaimedRegions, Claimer, Decline, Outcome, Reason, Region, is_convex
from .partition.stitch import StitchClaimer
from .report import DeclineReport, GraphReport, RegionReport
from .runtime.assemble import assemble, inductor_configs, prelude_mode, rematerialize_sizes
from .runtime.cudagraph import (CudaGraphRunner, SizedCudaGraphs, cuda_graph_blocker, input_device,
                                move_constants_to_device, symbolic_sizes)
from .runtime.choose import declared_mutations, is_timeable, mutated_inputs
from .runtime.inductor_quiet import without_artifact_warning
from .runtime.measure import check_regions, keep_faster
from .superopt.attention_claim import AttentionClaimer
from .superopt.gemv_claim import GemvClaimer
from .superopt.optimise import plans_kept_in
from .superopt.search.claimer import SearchClaimer
from .superopt.search.seeds import SEED_WORKLOADS
from .tune import budget as tune_budget

log = logging.getLogger("torch_mirage")


class WholeGraphToInductor(Exception):
    """Raised by the forward / inference compile when mirage keeps no region of the graph, or when one of its
    stages failed (``failure``): the backend then hands the original Dynamo graph to Inductor's own
    ``compile_fx``, so the result is exactly Inductor's."""

    def __init__(self, cuda_graph_blocker: str | None, static_input_indices: Sequence[int],
                 mutated_input_indices: Sequence[int] = (), *, failure: Failure | None = None):
        super().__init__("no mirage region: whole graph to Inductor" if failure is None else
                         f"the {failure.stage} stage failed: whole graph to Inductor")
        self.cuda_graph_blocker = cuda_graph_blocker
        self.static_input_indices = tuple(static_input_indices)
        self.mutated_input_indices = tuple(mutated_input_indices)
        self.failure = failure


class MirageError(RuntimeError):
    """An error inside mirage's compilation, naming the node it concerns."""

    def __init__(self, message: str, node: Node | None = None):
        where = f" at {node.describe()}" if node is not None else ""
        super().__init__(f"{message}{where}")
        self.node = node


AHEAD = ("qknorm_attention",)        # library seeds tried before the attention claimer
WIDER = ("lora", "ntrans")          # library seeds tried before the weight-streaming claimer


def default_claimers(config: Config) -> list[Claimer]:
    """Claiming passes in priority order (earlier passes see the graph first)."""
    # With the library (``ugraph_library``): the search's library seeds alone for QK-norm attention (norms +
    # attention in one μGraph) before the attention claimer takes the attention alone, then for LoRA (three
    # matmuls in one kernel: no weight-streaming cut holds it) and nTrans; memory-bound matmuls with their norm and
    # epilogue (one weight-streaming kernel) before RMSNorm + Linear and gated MLP could take the matmuls without
    # the norm or the residual; then the search claimer: every seed, then the enumeration where ``search`` is on
    # (off by default); stitching last
    stitch = [StitchClaimer()] if config.stitch else []
    if not config.ugraph_library:
        return ([SearchClaimer()] if config.search else []) + stitch
    rest = tuple(w for w in SEED_WORKLOADS if w not in AHEAD + WIDER)
    return [SearchClaimer(seeds=AHEAD, enumerates=False), AttentionClaimer(),
            SearchClaimer(seeds=WIDER, enumerates=False), GemvClaimer(),
            SearchClaimer(seeds=rest, enumerates=config.search)] + stitch


def claim_regions(graph: Graph, claimers: Sequence[Claimer], ctx: CompileContext) -> list[Region]:
    """The partition stage: each claimer in turn claims from the nodes still free (a claim holds a plan; the build
    stage makes its kernel); the rest become fallback regions, each carrying the declines of the claimers that
    passed over its nodes. Where the disk cache holds this graph's :class:`~.partition.record.PartitionRecord`,
    the claimers replay it (their recorded claims planned again, without the exploration); where that does not
    come out the same, the graph is partitioned afresh and recorded."""
    # a node that reads or writes a tensor of symbolic size or stride is never claimed (kernels and the cost
    # model need static shapes): the claimers do not see it, and it joins the fallback's regions
    free = [n for n in graph.nodes if not _touches_symbolic(n)]
    record = PartitionRecord(graph, claimers, ctx)
    entries = record.load()
    if entries is not None and len(entries) == len(claimers):
        replayed = _taken(graph, claimers, free,
                          lambda i, claimer, now_free: record.replay(claimer, entries[i], now_free))
        if replayed is not None:
            regions, passed, _, claimed = replayed
            return regions + _fallback_regions(graph, claimed, passed, ctx)
    regions, passed, outcomes, claimed = _taken(graph, claimers, free,
                                                lambda i, claimer, now_free: list(claimer.claim(graph, now_free, ctx)))
    record.save(outcomes)
    return regions + _fallback_regions(graph, claimed, passed, ctx)


def _taken(graph: Graph, claimers: Sequence[Claimer], free: list[Node], outcomes_of
           ) -> tuple[list[Region], list[Decline], list[list[Outcome]], set[int]] | None:
    """Each claimer's outcomes (``outcomes_of(index, claimer, free nodes)``, None: stop) taken in turn: the
    regions claimed, the declines, every claimer's outcomes and the claimed nodes' ids; None where
    ``outcomes_of`` gave None."""
    claimed: set[int] = set()
    held = ClaimedRegions(graph)
    regions: list[Region] = []
    passed: list[Decline] = []
    every: list[list[Outcome]] = []
    for index, claimer in enumerate(claimers):
        outcomes = outcomes_of(index, claimer, free)
        if outcomes is None:
            return None
        every.append(outcomes)
        for outcome in outcomes:
            if isinstance(outcome, Decline):
                outcome.claimer = outcome.claimer or claimer.name
                passed.append(outcome)
                continue
            if not isinstance(outcome, Claim):
                raise MirageError(f"claimer {claimer.name} returned a {type(outcome).__name__}; a claimer returns "
                                  f"Claim and Decline values only")
            taken = {id(n) for n in outcome.nodes}
            if not taken <= {id(f) for f in free}:
                raise MirageError(f"claimer {claimer.name} claimed a node twice")
            if not is_convex(graph, outcome.nodes):
                raise MirageError(f"claimer {claimer.name} claimed a non-convex region {outcome.ops}")
            if not held.admits(outcome.nodes):
                # each convex, but this claim and an earlier one would each need the other to run first: the
                # nodes stay free for the claimers after this one (the assemble stage has no order for them)
                log.debug("torch_mirage: %s's claim of %s would need an earlier claim first and be needed by it; "
                          "passed over", claimer.name, outcome.ops)
                passed.append(Decline(outcome.nodes, Reason.NOT_CONVEX, "a cycle with an earlier claim: each "
                                      "reads a value of the other", claimer.name))
                continue
            regions.append(Region.of_claim(outcome, claimer.name))
            held.add(outcome.nodes)
            free = [n for n in free if id(n) not in taken]
            claimed |= taken
    return regions, passed, every, claimed


def _fallback_regions(graph: Graph, claimed: set[int], passed: list[Decline], ctx: CompileContext) -> list[Region]:
    return _unclaimed_regions(graph, [n for n in graph.nodes if id(n) not in claimed], ctx.config, passed,
                              ctx.analysis_of(graph).cost)


def _touches_symbolic(node: Node) -> bool:
    """Whether ``node`` reads or writes a tensor whose sizes or strides are symbolic."""
    return any(v.meta is not None and not v.meta.is_static for v in (*node.inputs, *node.outputs))


def _unclaimed_regions(graph: Graph, free: Sequence[Node], config: Config,
                       passed: Sequence[Decline] = (), model: CostModel | None = None) -> list[Region]:
    """Connected groups of unclaimed nodes, each a fallback region with its reason and the declines that
    concern its nodes; memory-bound groups a claimer passed over as too small are named in the detail."""
    out = []
    for nodes in connected_components(free):
        kinds = {n.kind for n in nodes}
        if OpKind.OPAQUE in kinds:
            reason, detail = Reason.OPAQUE_OP, ", ".join(sorted({n.target_name for n in nodes if n.kind is OpKind.OPAQUE}))
        elif any(_touches_symbolic(n) for n in nodes):
            reason, detail = Reason.DYNAMIC_SHAPE, ""
        elif OpKind.MATMUL in kinds and not (skinny := _skinny_matmuls(nodes, model or CostModel())):
            reason, detail = Reason.COMPUTE_BOUND, ""
        elif OpKind.MATMUL in kinds:
            reason, detail = Reason.NOT_CLAIMED, f"memory-bound matmul {skinny}"
        else:
            reason, detail = Reason.NOT_CLAIMED, ""
        inside = {id(n) for n in nodes}
        here = [d for d in passed if any(id(n) in inside for n in d.nodes)]
        small = {id(d.nodes[0]): d.detail for d in here if d.reason is Reason.BELOW_MIN_REGION}
        left = [f"{n.name} ({small[id(n)]})" for n in nodes if id(n) in small]
        if left:
            note = f"memory-bound groups too small for a kernel of their own (MIRAGE_MIN_REGION_US): {', '.join(left)}"
            detail = f"{detail}; {note}" if detail else note
        out.append(Region(nodes, config.fallback, reason, detail, declines=here))
    return out


def _skinny_matmuls(nodes: Sequence[Node], model: CostModel) -> str:
    """The memory-bound matmuls among ``nodes`` (:func:`~.analysis.cost.skinny_matmul`), described; empty when
    any matmul of the group is compute-bound (the group is then the library call's)."""
    described = []
    for n in nodes:
        if n.kind is not OpKind.MATMUL:
            continue
        cost = skinny_matmul(n, model)
        if cost is None:
            return ""
        described.append(f"{n.name} ({matmul_rows(n)} rows, AI {cost.intensity:.3g} FLOP/B)")
    return ", ".join(described)


def _report_regions(report: GraphReport, regions: Sequence[Region]) -> None:
    report.regions = [RegionReport(r.ops, r.compiled_by, r.reason, r.detail, r.claimer, dict(r.info),
                                   [DeclineReport(d.claimer, d.reason, d.detail, [n.name for n in d.nodes])
                                    for d in r.declines])
                      for r in regions]


def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: CompileContext,
                  claimers: Sequence[Claimer] | None = None) -> Any:
    """Compile one ATen graph; returns a boxed callable. A failure in any stage hands the graph to
    Inductor whole (see :func:`_after_failure`), or raises under ``strict``."""
    report, config = ctx.report, ctx.config
    report.symbolic_sizes = symbolic_sizes(example_inputs)
    report.num_nodes = sum(n.op == "call_function" for n in gm.graph.nodes)
    report.num_inputs = sum(n.op == "placeholder" for n in gm.graph.nodes)
    try:
        with plans_kept_in(ctx.cache):
            fn = _mirage_stages(gm, example_inputs, ctx, claimers)
        with ctx.stage("cuda graph"):
            return _maybe_cuda_graph(fn, gm, example_inputs, ctx)
    except WholeGraphToInductor:
        raise
    except Exception as e:
        if config.strict:
            raise
        return _after_failure(gm, example_inputs, ctx, e)
    finally:
        ctx.failures.flush()


def _mirage_stages(gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: CompileContext,
                   claimers: Sequence[Claimer] | None) -> Any:
    """lower → analyse → partition → build → check → measure → assemble; raises :class:`WholeGraphToInductor` when mirage
    keeps no region of a forward / inference graph."""
    report, config = ctx.report, ctx.config
    with ctx.stage("lower"):
        if report.kind == "inference" and (device := input_device(example_inputs)) is not None:
            move_constants_to_device(gm, device)   # once, before anything reads the constants
        outer_products(gm)                          # before lowering: the fallback partitions get it too
        graph = lower(gm, list(example_inputs))
    with ctx.stage("analyse"):
        ctx.analysis = analyse(graph)
    with ctx.stage("partition"), eager_dispatch():
        claimers = default_claimers(config) if claimers is None else claimers
        regions = claim_regions(graph, claimers, ctx)
    try:
        with ctx.stage("build"), eager_dispatch(), tune_budget(config.tune_budget_s), dependent_launches(config.pdl), \
                compile_workers(config.compile_workers, config.compile_processes):
            build_regions(regions, graph, ctx)
        if config.check_regions:
            with ctx.stage("check"), eager_dispatch():
                check_regions(regions, graph, ctx)
        if _measures(config):
            with ctx.stage("measure"):
                keep_faster(regions, graph, ctx)
    finally:
        ctx.observed_inputs.clear()     # the call's tensors: tuning and timing only, not kept alive by the plans
    _report_regions(report, regions)
    if (config.fallback == "inductor" and report.kind in ("inference", "forward")
            and not any(r.compiled_by == "mirage" for r in regions)):
        report.whole_graph_to_inductor = True
        raise WholeGraphToInductor(cuda_graph_blocker(gm, example_inputs, report.kind),
                                   ctx.static_input_indices, mutated_inputs(gm))
    with ctx.stage("assemble"):
        taken: list[str] = []
        prelude = prelude_mode(config.prelude, example_inputs)
        try:
            fn = _assemble_regions_in_inductor(gm, graph, regions, config, prelude, taken)
            if taken:
                counts = collections.Counter(taken).most_common()
                report.prelude = f"{len(taken)} ops in one Inductor graph run first ({prelude}): " + \
                    ", ".join(f"{op} x{k}" if k > 1 else op for op, k in counts)
        except Exception as e:      # the prelude's own Inductor graph (combo kernels) failed: its ops go inline
            if prelude == "inline" or config.strict:
                raise
            log.warning("torch_mirage: Inductor failed on the prelude graph (MIRAGE_PRELUDE=%s, %s here: %s: %s); its "
                        "ops run inline instead (MIRAGE_PRELUDE=inline says so from the start)", config.prelude,
                        prelude, type(e).__name__, str(e)[:200])
            report.prelude = f"none: Inductor failed on its graph ({type(e).__name__}), its ops ran inline"
            fn = assemble(gm, graph, regions, config.fallback, config.inductor_mode, "inline")
        report.mutated_inputs = mutated_inputs(gm)
        declared = declared_mutations(report.num_inputs)
        # timed on the first call only when every write is one the timing can save and put back
        report.timeable = (is_timeable(gm, list(example_inputs)) and declared is not None
                           and declared <= set(report.mutated_inputs))
    return fn


def _assemble_regions_in_inductor(gm, graph: Graph, regions, config: Config, prelude: str, taken: list[str]):
    """:func:`assemble` with the regions inside Inductor's partitions where the knob says so; where Inductor fails on
    that graph, the regions between its partitions (one warning), as without the knob."""
    inside = config.regions_in_inductor and config.fallback == "inductor"
    try:
        return assemble(gm, graph, regions, config.fallback, config.inductor_mode, prelude, taken,
                        regions_in_inductor=inside)
    except Exception as e:
        if not inside or config.strict:
            raise
        log.warning("torch_mirage: Inductor failed on the graph with mirage's regions inside its partitions (%s: %s); "
                    "the regions run between its partitions instead (MIRAGE_REGIONS_IN_INDUCTOR=0 says so from "
                    "the start)", type(e).__name__, str(e)[:200])
        return assemble(gm, graph, regions, config.fallback, config.inductor_mode, prelude, taken)


def eager_dispatch():
    """A context in which mirage's own stages run torch as eager code does. AOTAutograd calls the compiler with
    its Python dispatcher on, which sends every composite op (``matmul``, broadcasting) through its Python
    decomposition. That is about 3x the host time of each small op in the reference executor, the finite-field
    test and the float checks. On the CPU, a Llama-3-8B-shaped 4-layer decode graph's partition stage took
    7.8 s with it and 4.5 s without it. Inductor's compiles (measure, fallback) keep the caller's state."""
    return torch._C._DisablePythonDispatcher()


def _measures(config: Config) -> bool:
    """Whether regions are timed against Inductor: only on a GPU (the timing uses CUDA graphs)."""
    return config.measure_regions and torch.cuda.is_available()


def _after_failure(gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: CompileContext, error: Exception) -> Any:
    """The graph after a failure inside mirage, independent of the stage that failed (nothing of mirage's is
    re-run): a forward / inference graph is handed whole to Inductor's own ``compile_fx`` on the Dynamo graph (by
    :class:`WholeGraphToInductor`; the backend logs the warning once it knows the outcome); a backward graph,
    whose forward is already compiled, goes through ``regional_inductor`` over the whole ATen graph. Eager only
    with ``fallback="eager"`` or when Inductor fails too."""
    config, report = ctx.config, ctx.report
    failure = Failure(stage_of(error), fx_graph_summary(gm), describe_error(error), "")
    report.fallback_error = f"{failure.stage} stage: {failure.error}"
    ops = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    if config.fallback == "inductor" and report.kind in ("inference", "forward"):
        report.regions = [RegionReport(ops, "inductor", Reason.COMPILE_ERROR, report.fallback_error)]
        report.whole_graph_to_inductor = True
        raise WholeGraphToInductor(_blocker_after(failure, gm, example_inputs, report.kind),
                                   ctx.static_input_indices, mutated_inputs(gm), failure=failure) from error
    fn, compiled_by, failure.outcome = _fallback(gm, ctx)
    report.regions = [RegionReport(ops, compiled_by, Reason.COMPILE_ERROR, report.fallback_error)]
    log.warning("%s", format_failure(failure, f"{report.kind} graph {report.index}"))
    blocker = _blocker_after(failure, gm, example_inputs, report.kind)
    try:
        return wrap_cuda_graph(fn, blocker, ctx.static_input_indices, config, report, mutated_inputs(gm))
    except Exception as e:   # our CUDA-graph wrapper failed on the fallback too: run it as it is
        report.cuda_graph, report.cuda_graph_reason = False, f"cuda graph stage failed: {describe_error(e)}"
        return fn


def _blocker_after(failure: Failure, gm: fx.GraphModule, example_inputs: Sequence[Any], kind: str) -> str | None:
    """Why the fallback of a failed graph is not captured in our CUDA graph (None: it may be)."""
    if failure.stage == "cuda graph":
        return f"the cuda graph stage failed ({failure.error})"
    try:
        return cuda_graph_blocker(gm, example_inputs, kind)
    except Exception as e:
        return f"could not decide whether capture is safe ({describe_error(e)})"


def _fallback(gm: fx.GraphModule, ctx: CompileContext) -> tuple[Any, str, str]:
    """The whole ATen graph through the fallback target, without any of mirage's stages: ``(boxed callable,
    compiled_by, what the warning says runs)``; eager when Inductor itself fails."""
    config, report = ctx.config, ctx.report
    if config.fallback != "inductor":
        return make_boxed_func(gm), "eager", "the graph runs eagerly (MIRAGE_FALLBACK=eager)"
    try:
        with report.stage("inductor"):
            return (inductor_whole_aten_graph(gm, config.inductor_mode), "inductor",
                    "the whole graph runs through Inductor instead")
    except Exception as e:
        return (make_boxed_func(gm), "eager",
                f"Inductor could not compile the graph either ({describe_error(e)}), so it runs eagerly")


def inductor_whole_aten_graph(gm: fx.GraphModule, inductor_mode: str = "default") -> Any:
    """Every node of an ATen graph marked for Inductor and compiled by ``regional_inductor`` (the route for a
    graph inside AOTAutograd, where ``compile_fx`` of the Dynamo graph is no longer possible). A ``copy_`` of an
    input into an input stays an ATen call: alone it would be a partition without outputs."""
    from torch.fx.passes.regional_inductor import regional_inductor

    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    for n in graph.nodes:
        if n.op != "call_function" or (n.target is torch.ops.aten.copy_.default
                                       and all(a.op == "placeholder" for a in n.all_input_nodes)):
            continue
        n.meta["custom"] = dict(n.meta.get("custom") or {}, compile_with_inductor={
            "inductor_configs": inductor_configs(inductor_mode), "inductor_region": 0})
    rematerialize_sizes(graph)
    copy = fx.GraphModule(gm, graph)
    example = [n.meta.get("val") for n in copy.graph.nodes if n.op == "placeholder"]
    with without_artifact_warning():
        return regional_inductor(copy, *example)


def _maybe_cuda_graph(fn: Any, gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: CompileContext) -> Any:
    return wrap_cuda_graph(fn, cuda_graph_blocker(gm, example_inputs, ctx.report.kind), ctx.static_input_indices,
                           ctx.config, ctx.report, mutated_inputs(gm))


def wrap_cuda_graph(fn: Any, blocker: str | None, static_input_indices: Sequence[int], config: Config,
                    report: GraphReport, mutated_input_indices: Sequence[int] = (), log_symbolic: bool = True) -> Any:
    """``fn`` (boxed) inside a :class:`CudaGraphRunner` when capture is allowed (a graph of symbolic sizes: one
    per input size, :class:`SizedCudaGraphs`, up to ``config.cuda_graph_sizes``); the reason in the report.
    Static inputs (parameters, buffers, KV caches) are captured in place; written user inputs are copied back.
    ``log_symbolic``: a graph of symbolic sizes says how it runs in one INFO line (not for Inductor's version that
    its whole-graph timing wraps: the graph's own line says it)."""
    if not config.cuda_graphs:
        report.cuda_graph_reason = "disabled (MIRAGE_CUDA_GRAPHS=0)"
    elif blocker is None and report.symbolic_sizes and config.cuda_graph_sizes == 0:
        report.cuda_graph_reason = "symbolic sizes (MIRAGE_CUDA_GRAPH_SIZES=0)"
    elif blocker is None:
        report.cuda_graph = True

        def on_disable(why: str) -> None:
            report.cuda_graph, report.cuda_graph_reason = False, why

        if report.symbolic_sizes:
            if log_symbolic:
                when = ("recorded at its first call" if config.cuda_graph_record_at == 1 else
                        f"recorded at its call {config.cuda_graph_record_at}, MIRAGE_CUDA_GRAPH_RECORD_AT")
                _log_symbolic(report, f"in a CUDA graph per input size ({when}; up to {config.cuda_graph_sizes}, "
                                      "MIRAGE_CUDA_GRAPH_SIZES)", config)
            runner = SizedCudaGraphs(fn, static_input_indices, config.cuda_graph_sizes, on_disable,
                                     mutated_input_indices, record_at=config.cuda_graph_record_at)
        else:
            runner = CudaGraphRunner(fn, static_input_indices, on_disable=on_disable,
                                     mutated_input_indices=mutated_input_indices)
        return _boxed(runner)
    else:
        report.cuda_graph_reason = blocker
    if report.symbolic_sizes:
        if log_symbolic:
            _log_symbolic(report, f"without a CUDA graph ({report.cuda_graph_reason})", config)
        return fn
    log.debug("torch_mirage: %s graph %d runs without a CUDA graph: %s", report.kind, report.index,
              report.cuda_graph_reason)
    return fn


def _log_symbolic(report: GraphReport, how: str, config: Config) -> None:
    """The one line a serving user sees for a graph of symbolic sizes: what runs it, how, and the way to mirage's
    own kernels at each size."""
    ran = ("mirage's static parts and Inductor" if any(r.compiled_by == "mirage" for r in report.regions)
           else "Inductor")
    fixed = (f"sizes that come back (up to {config.static_sizes}) are compiled again with the sizes fixed, "
             "mirage's kernels there (MIRAGE_STATIC_SIZES)" if report.kind == "inference" and config.static_sizes else
             "compile with dynamic=False for mirage's kernels at each size (one static graph per size)")
    log.info("torch_mirage: %s graph %d has symbolic sizes: %s runs it, %s; %s", report.kind, report.index, ran, how,
             fixed)


def _boxed(fn: Any) -> Any:
    def run(args):
        return fn(args)
    run._boxed_call = True
    return run
