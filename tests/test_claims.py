"""The partition stage's typed contract: claimers return Claim / Decline values, the pipeline and the report read
their typed fields (never a reason out of text), and the execution target comes from the compile context."""
import pytest
import torch
import torch.nn.functional as F

import torch_mirage
from torch_mirage.build import build_regions, built_regions
from torch_mirage.codegen import loader
from torch_mirage.codegen.stitch_plan import StitchPlan
from torch_mirage.config import load
from torch_mirage.context import CompileContext, Target
from torch_mirage.partition.region import Claim, Decline, Reason, Region, claims, declines, inputs_of
from torch_mirage.partition.stitch import StitchClaimer
from torch_mirage.pipeline import MirageError, claim_regions
from torch_mirage.report import DeclineReport
from torch_mirage.superopt.attention_claim import AttentionClaimer
from torch_mirage.superopt.search.claimer import SearchClaimer
from torch_mirage.superopt.ugraph_plan import UGraphPlan
from torch_mirage.testing.aten import trace_ir
from helpers import assert_close


class _Declines:
    """Declines every free exp node with the given reason and detail; claims nothing."""
    name = "test-declines"

    def __init__(self, reason, detail):
        self.reason, self.detail = reason, detail

    def claim(self, graph, free, ctx):
        return [Decline([n], self.reason, self.detail) for n in free if n.op.name == "exp"]


def _compile_report(fn, x, claimers):
    report = torch_mirage.Report()
    compiled = torch.compile(fn, backend=torch_mirage.MirageBackend(report=report, claimers=claimers))
    compiled(x)
    return report


def test_a_claimers_decline_reaches_the_report_as_the_enum():
    report = _compile_report(lambda x: torch.exp(x) * 2, torch.randn(4, 8),
                             [_Declines(Reason.NOT_CONVEX, "a test decline")])
    (region,) = report.regions
    assert region.compiled_by == "inductor" and region.reason is Reason.NOT_CLAIMED
    (decline,) = region.declines
    assert isinstance(decline, DeclineReport) and decline.reason is Reason.NOT_CONVEX
    assert decline.claimer == "test-declines" and decline.detail == "a test decline"
    assert len(decline.nodes) == 1 and decline.nodes[0].startswith("exp")


def test_the_min_region_decline_is_recognised_by_its_enum_not_its_words():
    """The report's note on groups too small for a kernel comes from Reason.BELOW_MIN_REGION alone: a decline
    with that reason is named whatever its detail says, and a detail naming the knob under another reason is
    not."""
    graph = trace_ir(lambda x: torch.exp(x) * 2, torch.randn(4, 8))
    ctx = CompileContext.standalone()
    (small,) = claim_regions(graph, [_Declines(Reason.BELOW_MIN_REGION, "0.01 µs of memory traffic")], ctx)
    assert small.detail == ("memory-bound groups too small for a kernel of their own (MIRAGE_MIN_REGION_US): "
                            f"{small.declines[0].nodes[0].name} (0.01 µs of memory traffic)")
    (other,) = claim_regions(graph, [_Declines(Reason.TOO_LITTLE_WORK, "MIRAGE_MIN_REGION_US < 3 µs")], ctx)
    assert other.detail == "" and other.declines[0].reason is Reason.TOO_LITTLE_WORK


def test_stitch_below_the_threshold_declines_with_the_memory_time():
    graph = trace_ir(lambda x: torch.softmax(x * 2, -1), torch.randn(8, 32))
    ctx = CompileContext.standalone(load({"min_region_us": 1000.0}))
    outcomes = StitchClaimer().claim(graph, list(graph.nodes), ctx)
    assert claims(outcomes) == []
    (decline,) = [d for d in declines(outcomes) if d.reason is Reason.BELOW_MIN_REGION]
    assert decline.detail.endswith("µs of memory traffic") and len(decline.nodes) >= 5
    (region,) = claim_regions(graph, [StitchClaimer()], ctx)
    assert region.compiled_by == "inductor" and decline.nodes[0].name in region.detail
    assert any(d.reason is Reason.BELOW_MIN_REGION and d.claimer == "stitch" for d in region.declines)


def test_claims_become_mirage_regions_with_the_claimers_name_and_the_build_stage_makes_their_kernels():
    graph = trace_ir(lambda x: torch.softmax(x, -1), torch.randn(3, 5))
    ctx = CompileContext.standalone(target=Target.INTERPRETER)
    regions = claim_regions(graph, [StitchClaimer()], ctx)
    (region,) = regions
    assert region.compiled_by == "mirage" and region.reason is Reason.CLAIMED and region.claimer == "stitch"
    assert isinstance(region.plan, StitchPlan) and region.kernel is None and region.detail.startswith("stitch: ")
    build_regions(regions, graph, ctx)
    assert region.kernel is not None and region.compiled_by == "mirage" and region.info["kernel_source"]
    x = torch.randn(3, 5)
    assert_close(region.kernel(x)[0], torch.softmax(x, -1))


def _lora(x, w, a, b):
    return x @ w + (x @ a) @ b


@pytest.mark.parametrize("claimer", ["stitch", "library"])
def test_claimers_compile_nothing_they_return_plans(monkeypatch, claimer):
    """Nothing a claimer calls compiles a kernel: with generated source unloadable (every kernel, stitch or μGraph,
    is loaded through codegen.loader), claims still come back as plans (data) and the build stage is where they
    fail — the region goes to the fallback with a typed COMPILE_ERROR decline naming the claimer and the error,
    never a crash."""
    def broken(*args, **kwargs):
        raise RuntimeError("compiler broken for the test")
    monkeypatch.setattr(loader, "source_path", broken)
    monkeypatch.setattr(loader, "_LOADED", {})          # nothing memoized from earlier tests
    ctx = CompileContext.standalone(load({"stitch": claimer == "stitch"}), target=Target.INTERPRETER)
    if claimer == "stitch":
        graph, chosen = trace_ir(lambda x: torch.softmax(x, -1), torch.randn(3, 5)), StitchClaimer()
    else:
        xs = torch.randn(8, 16), torch.randn(16, 12), torch.randn(16, 2), torch.randn(2, 12)
        graph, chosen = trace_ir(_lora, *xs), SearchClaimer(seeds=["lora"], enumerates=False)
    (claim,) = claims(chosen.claim(graph, list(graph.nodes), ctx))
    assert not hasattr(claim, "kernel")
    assert isinstance(claim.plan, StitchPlan if claimer == "stitch" else UGraphPlan)
    if claimer == "library":
        assert [a.name for a in claim.plan.alternatives] == ["lora"] and claim.detail.startswith("μGraph lora")
    (region,) = built_regions([claim], graph, ctx, chosen.name)
    assert region.compiled_by == "inductor" and region.reason is Reason.COMPILE_ERROR and region.kernel is None
    assert "compiler broken for the test" in region.detail
    (decline,) = region.declines
    assert decline.reason is Reason.COMPILE_ERROR and decline.claimer == chosen.name and decline.detail == region.detail
    strict = CompileContext.standalone(load({"strict": True}), target=Target.INTERPRETER)
    with pytest.raises(RuntimeError, match="compiler broken for the test"):
        built_regions([claim], graph, strict, chosen.name)


def test_a_plan_without_a_builder_leaves_its_region_to_the_fallback():
    graph = trace_ir(lambda x: x.exp(), torch.randn(3))
    (region,) = built_regions([Claim(list(graph.nodes), "not a plan")], graph, CompileContext.standalone(), "odd")
    assert region.compiled_by == "inductor" and region.reason is Reason.COMPILE_ERROR
    assert "no builder for a str plan" in region.detail and region.declines[0].claimer == "odd"


def test_the_library_plan_builds_to_a_kernel_that_matches_eager():
    xs = torch.randn(8, 16), torch.randn(16, 12), torch.randn(16, 2), torch.randn(2, 12)
    graph = trace_ir(_lora, *xs)
    ctx = CompileContext.standalone(target=Target.INTERPRETER)
    (region,) = built_regions(SearchClaimer(seeds=["lora"], enumerates=False).claim(graph, list(graph.nodes), ctx), graph, ctx,
                              "ugraph-search")
    assert region.compiled_by == "mirage" and region.info["ugraph"] == "lora" and region.info["launch"]
    assert region.info["ugraph_hash"] == region.plan.alternatives[0].graph.hash()[:16]
    inputs = dict(zip([v.name for v in graph.inputs], xs))
    (out,) = region.kernel(*[inputs[v.name] for v in region.inputs])
    assert_close(out, _lora(*xs))


def test_a_claimer_returning_anything_else_is_an_error():
    class _Regions:
        name = "returns-regions"

        def claim(self, graph, free, ctx):
            return [Region(list(free), "mirage", Reason.CLAIMED)]

    graph = trace_ir(lambda x: x.exp(), torch.randn(3))
    with pytest.raises(MirageError, match="returns-regions returned a Region; a claimer returns Claim and Decline"):
        claim_regions(graph, [_Regions()], CompileContext.standalone())


def test_claim_inputs_and_outputs_are_the_regions():
    graph = trace_ir(lambda x, y: (x.exp() + y).sum(-1), torch.randn(3, 4), torch.randn(3, 4))
    claim = Claim(list(graph.nodes), None)
    assert [v.name for v in claim.inputs] == [v.name for v in inputs_of(graph.nodes)] == \
        [v.name for v in graph.inputs]
    assert [v.name for v in claim.outputs(graph)] == [v.name for v in graph.output_values]
    assert all(n in claim for n in graph.nodes)


# ---------------------------------------------------------------- the execution target

@pytest.mark.parametrize("value,target", [("1", Target.INTERPRETER), ("true", Target.INTERPRETER),
                                          ("On", Target.INTERPRETER), ("0", Target.CUDA), ("", Target.CUDA),
                                          (None, Target.CUDA)])
def test_the_target_is_read_from_the_environment_as_triton_reads_it(monkeypatch, value, target):
    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    assert Target.current() is target
    assert CompileContext.standalone().target is target


def test_the_target_decides_which_devices_run_kernels():
    assert Target.CUDA.runs_on("cuda") and not Target.CUDA.runs_on("cpu")
    assert Target.INTERPRETER.runs_on("cuda") and Target.INTERPRETER.runs_on("cpu")
    assert not Target.INTERPRETER.runs_on("meta")


def _attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def test_claimers_take_the_target_from_the_context_not_the_environment():
    """This process runs with TRITON_INTERPRET=1 (conftest): a context saying CUDA makes every claimer pass over
    CPU tensors, with the device named where the claimer gives a reason."""
    cuda = CompileContext.standalone(target=Target.CUDA)
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    graph = trace_ir(_attention, q, k, v)
    outcomes = AttentionClaimer().claim(graph, list(graph.nodes), cuda)
    assert [d.reason for d in outcomes] == [Reason.UNSUPPORTED_DEVICE] and "cpu" in outcomes[0].detail

    x, w, a, b = torch.randn(8, 16), torch.randn(16, 12), torch.randn(16, 2), torch.randn(2, 12)
    graph = trace_ir(lambda x, w, a, b: x @ w + (x @ a) @ b, x, w, a, b)
    assert claims(SearchClaimer(seeds=["lora"], enumerates=False).claim(graph, list(graph.nodes), cuda)) == []
    outcomes = SearchClaimer(budget_s=0.0).claim(graph, list(graph.nodes), cuda)
    assert claims(outcomes) == [] and {d.reason for d in outcomes} == {Reason.UNSUPPORTED_DEVICE}
