"""The pipeline, top to bottom, for one functional ATen graph.

capture (AOTAutograd, in :mod:`torch_mirage.backend`) → lower → analyse →
partition (claimers) → assemble (kernels + Inductor for the rest) → CUDA graph.
Each stage's time lands in the graph's report. Any error inside mirage's own
stages falls the whole graph back (or raises under ``strict``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.fx as fx
from functorch.compile import make_boxed_func

from .cache import DiskCache
from .capture.ir import Graph, Node, connected_components
from .capture.lower import lower
from .capture.ops import OpKind
from .config import Config
from .partition.region import Claimer, Reason, Region, is_convex
from .report import GraphReport, RegionReport
from .runtime.assemble import assemble
from .runtime.cudagraph import CudaGraphRunner, cuda_graph_blocker
from .runtime.choose import declared_mutations, is_timeable, mutated_inputs
from .runtime.measure import check_regions, keep_faster

log = logging.getLogger("torch_mirage")


class WholeGraphToInductor(Exception):
    """Raised by the forward / inference compile when mirage keeps no region of the graph: the backend then
    hands the original Dynamo graph to Inductor's own ``compile_fx``, so the result is exactly Inductor's."""

    def __init__(self, cuda_graph_blocker: str | None, static_input_indices: Sequence[int]):
        super().__init__("no mirage region: whole graph to Inductor")
        self.cuda_graph_blocker = cuda_graph_blocker
        self.static_input_indices = tuple(static_input_indices)


class MirageError(RuntimeError):
    """An error inside mirage's compilation, naming the node it concerns."""

    def __init__(self, message: str, node: Node | None = None):
        where = f" at {node.describe()}" if node is not None else ""
        super().__init__(f"{message}{where}")
        self.node = node


@dataclass
class CompileContext:
    config: Config
    report: GraphReport
    cache: DiskCache | None
    static_input_indices: Sequence[int] = ()
    facts: dict[str, Any] = field(default_factory=dict)   # analysis results, by analysis name


def default_claimers(config: Config) -> list[Claimer]:
    """Claiming passes in priority order (earlier passes see the graph first)."""
    from .partition.stitch import StitchClaimer
    from .superopt.attention_claim import AttentionClaimer
    from .superopt.claim import DEFAULT_WORKLOADS, LibraryClaimer

    # QK-norm attention (norms + attention in one μGraph) is matched before the attention claimer takes the
    # attention alone; the rest of the library after it
    library = ([LibraryClaimer(("qknorm_attention",)), AttentionClaimer(),
                LibraryClaimer([w for w in DEFAULT_WORKLOADS if w != "qknorm_attention"])]
               if config.ugraph_library else [])
    return library + ([StitchClaimer()] if config.stitch else [])


def claim_regions(graph: Graph, claimers: Sequence[Claimer], ctx: CompileContext) -> list[Region]:
    free = list(graph.nodes)
    regions: list[Region] = []
    for claimer in claimers:
        for region in claimer.claim(graph, free, ctx):
            taken = {id(n) for n in region.nodes}
            if not taken <= {id(f) for f in free}:
                raise MirageError(f"claimer {claimer.name} claimed a node twice")
            if not is_convex(graph, region.nodes):
                raise MirageError(f"claimer {claimer.name} claimed a non-convex region {region.ops}")
            region.claimer = region.claimer or claimer.name
            regions.append(region)
            free = [n for n in free if id(n) not in taken]
    regions.extend(_unclaimed_regions(graph, free, ctx.config, ctx.facts.get("stitch.skipped", ())))
    return regions


def _unclaimed_regions(graph: Graph, free: Sequence[Node], config: Config,
                       skipped: Sequence[tuple[str, str, str]] = ()) -> list[Region]:
    """Connected groups of unclaimed nodes, each a fallback region with its reason; memory-bound groups a
    claimer passed over as too small are named in the detail."""
    small = {name: why for name, _, why in skipped if "MIRAGE_MIN_REGION_US" in why}
    out = []
    for nodes in connected_components(free):
        kinds = {n.kind for n in nodes}
        if OpKind.OPAQUE in kinds:
            reason, detail = Reason.OPAQUE_OP, ", ".join(sorted({n.target_name for n in nodes if n.kind is OpKind.OPAQUE}))
        elif any(not (v.meta and v.meta.is_static) for n in nodes for v in n.outputs if v.meta):
            reason, detail = Reason.DYNAMIC_SHAPE, ""
        elif OpKind.MATMUL in kinds:
            reason, detail = Reason.COMPUTE_BOUND, ""
        else:
            reason, detail = Reason.NOT_CLAIMED, ""
        left = [f"{n.name} ({small[n.name].split(' <')[0]})" for n in nodes if n.name in small]
        if left:
            note = f"memory-bound groups too small for a kernel of their own (MIRAGE_MIN_REGION_US): {', '.join(left)}"
            detail = f"{detail}; {note}" if detail else note
        out.append(Region(nodes, config.fallback, reason, detail))
    return out


def _report_regions(report: GraphReport, regions: Sequence[Region]) -> None:
    report.regions = [RegionReport(r.ops, r.compiled_by, r.reason.value, r.detail, r.claimer, dict(r.info))
                      for r in regions]


def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: CompileContext,
                  claimers: Sequence[Claimer] | None = None) -> Any:
    """Compile one ATen graph; returns a boxed callable."""
    report, config = ctx.report, ctx.config
    report.num_nodes = sum(n.op == "call_function" for n in gm.graph.nodes)
    report.num_inputs = sum(n.op == "placeholder" for n in gm.graph.nodes)
    claimers = default_claimers(config) if claimers is None else claimers
    try:
        with report.stage("lower"):
            graph = lower(gm, list(example_inputs))
        with report.stage("partition"):
            regions = claim_regions(graph, claimers, ctx)
        if config.check_regions:
            with report.stage("check"):
                check_regions(regions, graph, ctx)
        if config.measure_regions and torch.cuda.is_available():
            with report.stage("measure"):
                keep_faster(regions, graph, ctx)
        _report_regions(report, regions)
        if (config.fallback == "inductor" and report.kind in ("inference", "forward")
                and not any(r.compiled_by == "mirage" for r in regions)):
            report.whole_graph_to_inductor = True
            raise WholeGraphToInductor(cuda_graph_blocker(gm, example_inputs, report.kind), ctx.static_input_indices)
        with report.stage("assemble"):
            fn = assemble(gm, graph, regions, config.fallback, config.inductor_mode)
        report.mutated_inputs = mutated_inputs(gm)
        declared = declared_mutations(report.num_inputs)
        # timed on the first call only when every write is one the timing can save and put back
        report.timeable = (is_timeable(gm, list(example_inputs)) and declared is not None
                           and declared <= set(report.mutated_inputs))
    except WholeGraphToInductor:
        raise
    except Exception as e:
        if config.strict:
            raise
        summary = _graph_summary(gm)
        log.warning("torch_mirage: compiling %s graph %d failed (%s: %s); graph of %s falls back to %s. "
                    "Set MIRAGE_STRICT=1 to raise instead.", report.kind, report.index, type(e).__name__, e,
                    summary, config.fallback)
        report.fallback_error = f"{type(e).__name__}: {e}"
        fn = _fallback(gm, example_inputs, ctx)
    return _maybe_cuda_graph(fn, gm, example_inputs, ctx)


def _fallback(gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: CompileContext) -> Any:
    """The whole graph through the fallback target; eager when Inductor itself fails."""
    config, report = ctx.config, ctx.report
    graph_nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    ops = [str(n.target) for n in graph_nodes]
    if config.fallback == "inductor":
        try:
            with report.stage("inductor"):
                graph = lower(gm, list(example_inputs))
                region = Region(list(graph.nodes), "inductor", Reason.COMPILE_ERROR, report.fallback_error or "")
                fn = assemble(gm, graph, [region], "inductor", config.inductor_mode)
            report.regions = [RegionReport(ops, "inductor", Reason.COMPILE_ERROR.value, report.fallback_error or "")]
            return fn
        except Exception as e:
            if config.strict:
                raise
            log.warning("torch_mirage: Inductor could not compile the fallback graph either (%s: %s); running eager.",
                        type(e).__name__, e)
    report.regions = [RegionReport(ops, "eager", Reason.COMPILE_ERROR.value, report.fallback_error or "")]
    return make_boxed_func(gm)


def _maybe_cuda_graph(fn: Any, gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: CompileContext) -> Any:
    return wrap_cuda_graph(fn, cuda_graph_blocker(gm, example_inputs, ctx.report.kind), ctx.static_input_indices,
                           ctx.config, ctx.report)


def wrap_cuda_graph(fn: Any, blocker: str | None, static_input_indices: Sequence[int], config: Config,
                    report: GraphReport) -> Any:
    """``fn`` (boxed) inside a :class:`CudaGraphRunner` when capture is allowed; the reason in the report."""
    if not config.cuda_graphs:
        report.cuda_graph_reason = "disabled (MIRAGE_CUDA_GRAPHS=0)"
    else:
        if blocker is None:
            report.cuda_graph = True
            def on_disable(why: str) -> None:
                report.cuda_graph, report.cuda_graph_reason = False, why

            runner = CudaGraphRunner(fn, static_input_indices, on_disable=on_disable)
            return _boxed(runner)
        report.cuda_graph_reason = blocker
    log.debug("torch_mirage: %s graph %d runs without a CUDA graph: %s", report.kind, report.index,
              report.cuda_graph_reason)
    return fn


def _boxed(fn: Any) -> Any:
    def run(args):
        return fn(args)
    run._boxed_call = True
    return run


def _graph_summary(gm: fx.GraphModule, limit: int = 6) -> str:
    parts = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and len(parts) < limit:
            val = n.meta.get("val")
            meta = f"{str(val.dtype).replace('torch.', '')}{list(val.shape)}" if isinstance(val, torch.Tensor) else ""
            parts.append(f"{n.target}{meta}")
    more = sum(n.op == "call_function" for n in gm.graph.nodes) - len(parts)
    return "[" + ", ".join(parts) + (f", +{more} more" if more > 0 else "") + "]"
