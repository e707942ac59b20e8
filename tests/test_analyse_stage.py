"""The analyse stage (torch_mirage/analysis/graph.py): the graph's value properties and cost model are computed
once, before partitioning; claimers cost their regions with them instead of re-running the value analysis over the
whole graph for each question, and claim exactly what they claimed before. The build stage after it runs inside the
graph's tuning budget (``MIRAGE_TUNE_BUDGET_S``; the budget's own rules are tests/test_tune.py's)."""
import torch
import torch.nn.functional as F

import torch_mirage
from torch_mirage.analysis import properties
from torch_mirage.analysis.graph import analyse
from torch_mirage.config import load
from torch_mirage.context import CompileContext
from torch_mirage.partition.region import claims
from torch_mirage.partition.stitch import StitchClaimer
from torch_mirage.testing.aten import trace_ir
from helpers import assert_close


def _block(x, r, g, b):
    h = x + r
    return F.layer_norm(torch.softmax(h * 0.5, -1) + h, (h.shape[-1],), g, b), h.sum(-1)


def _inputs():
    return torch.randn(16, 64), torch.randn(16, 64), torch.rand(64) + 0.5, torch.randn(64)


def _stitch_regions(graph, ctx):
    return sorted(sorted(n.name for n in c.nodes) for c in claims(StitchClaimer().claim(graph, list(graph.nodes), ctx)))


def test_claimers_read_the_analysis_instead_of_recomputing_values(monkeypatch):
    graph = trace_ir(_block, *_inputs())
    config = load({"min_region_us": 0.0})
    without = _stitch_regions(graph, CompileContext.standalone(config))   # analysed inside, on first need
    ctx = CompileContext.standalone(config)
    ctx.analysis = analyse(graph)
    calls = []
    real = properties.analyze_values
    monkeypatch.setattr(properties, "analyze_values", lambda *a, **k: calls.append(a) or real(*a, **k))
    assert _stitch_regions(graph, ctx) == without and without
    assert calls == []          # every region's cost reused the stage's values


def test_analysis_of_another_graph_is_recomputed():
    first, second = trace_ir(_block, *_inputs()), trace_ir(lambda x: torch.softmax(x, -1), torch.randn(4, 8))
    ctx = CompileContext.standalone()
    assert ctx.analysis_of(first).graph is first
    assert ctx.analysis_of(second).graph is second and ctx.analysis_of(second) is ctx.analysis


def test_compile_runs_the_analyse_stage_before_partition():
    torch._dynamo.reset()
    backend = torch_mirage.MirageBackend(options={"min_region_us": 0.0})
    fn = torch.compile(_block, backend=backend)
    xs = _inputs()
    for got, want in zip(fn(*xs), _block(*xs)):
        assert_close(got, want, torch.float32)
    (graph,) = backend.report.graphs
    stages = list(graph.stage_times_ms)
    assert stages.index("lower") < stages.index("analyse") < stages.index("partition")


def test_the_build_stage_runs_inside_the_graphs_tuning_budget(monkeypatch):
    from torch_mirage import pipeline, tune

    seen = []
    real = pipeline.build_regions
    monkeypatch.setattr(pipeline, "build_regions", lambda *a: seen.append(tune._BUDGET.get()) or real(*a))
    torch._dynamo.reset()
    fn = torch.compile(_block, backend=torch_mirage.MirageBackend(options={"min_region_us": 0.0, "tune_budget_s": 7.5}))
    xs = _inputs()
    for got, want in zip(fn(*xs), _block(*xs)):
        assert_close(got, want, torch.float32)
    assert len(seen) == 1 and seen[0].seconds == 7.5 and tune._BUDGET.get() is None
