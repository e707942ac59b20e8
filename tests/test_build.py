"""The build stage (torch_mirage/build.py): plans become kernels there, alternatives that do not compile are
dropped, and a plan none of whose μGraphs compiles leaves its region to the fallback with a typed decline."""
import logging

import pytest
import torch

from torch_mirage import build
from torch_mirage.build import built_regions
from torch_mirage.config import load
from torch_mirage.context import CompileContext, Target
from torch_mirage.partition.region import Reason, claims
from torch_mirage.superopt.search.claimer import SearchClaimer
from torch_mirage.superopt.ugraph_plan import Alternative
from torch_mirage.testing.aten import trace_ir
from helpers import assert_close


def _lora(x, w, a, b):
    return x @ w + (x @ a) @ b


def _lora_claim(ctx, n: int = 12):
    xs = torch.randn(8, 16), torch.randn(16, n), torch.randn(16, 2), torch.randn(2, n)
    graph = trace_ir(_lora, *xs)
    (claim,) = claims(SearchClaimer(seeds=["lora"], enumerates=False).claim(graph, list(graph.nodes), ctx))
    return graph, xs, claim


def _failing_first(monkeypatch, count: int):
    """compile_ugraph failing for its first ``count`` calls in the build stage."""
    real, calls = build.compile_ugraph, []

    def compile_ugraph(graph, *args, **kwargs):
        calls.append(graph)
        if len(calls) <= count:
            raise RuntimeError(f"alternative {len(calls)} does not compile")
        return real(graph, *args, **kwargs)
    monkeypatch.setattr(build, "compile_ugraph", compile_ugraph)
    return calls


def test_an_alternative_that_does_not_compile_is_dropped_and_another_runs(monkeypatch, caplog):
    ctx = CompileContext.standalone(target=Target.INTERPRETER)
    graph, xs, claim = _lora_claim(ctx)
    (lora,) = claim.plan.alternatives
    claim.plan.alternatives = [Alternative("first", lora.graph, "the first alternative", {"ugraph": "first"}), lora]
    calls = _failing_first(monkeypatch, 1)
    with caplog.at_level(logging.INFO, logger="torch_mirage"):
        (region,) = built_regions([claim], graph, ctx, "ugraph-search")
    assert len(calls) == 2 and region.compiled_by == "mirage" and region.info["ugraph"] == "lora"
    assert region.detail == lora.detail and "ugraph_us" not in region.info      # one left: nothing timed
    assert any("μGraph first of μGraph lora" in r.getMessage() and "does not compile" in r.getMessage()
               for r in caplog.records)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    inputs = dict(zip([v.name for v in graph.inputs], xs))
    assert_close(region.kernel(*[inputs[v.name] for v in region.inputs])[0], _lora(*xs))


@pytest.mark.parametrize("strict", [False, True])
def test_a_plan_none_of_whose_alternatives_compiles_goes_to_the_fallback(monkeypatch, strict):
    ctx = CompileContext.standalone(load({"strict": strict}), target=Target.INTERPRETER)
    graph, _, claim = _lora_claim(ctx)
    (lora,) = claim.plan.alternatives
    claim.plan.alternatives = [lora, Alternative("again", lora.graph, "again", {"ugraph": "again"})]
    _failing_first(monkeypatch, 2)
    if strict:
        with pytest.raises(RuntimeError, match="alternative 1 does not compile"):
            built_regions([claim], graph, ctx, "ugraph-search")
        return
    (region,) = built_regions([claim], graph, ctx, "ugraph-search")
    assert region.compiled_by == "inductor" and region.reason is Reason.COMPILE_ERROR and region.kernel is None
    assert "alternative 2 does not compile" in region.detail
    assert [(d.claimer, d.reason) for d in region.declines] == [("ugraph-search", Reason.COMPILE_ERROR)]
    assert len(ctx.failures) == 1


def test_a_cached_choice_of_alternatives_compiles_only_its_winner(monkeypatch, tmp_path):
    """A warm compile: the cache holds the timed choice among the plan's μGraphs (on a GPU; the key is faked for
    the interpreter here), so only the winner is compiled, and the report carries the cached times. A winner that
    then fails to compile makes the stage build every alternative, as a cold compile does."""
    from torch_mirage.cache import DiskCache

    ctx = CompileContext.standalone(target=Target.INTERPRETER, cache=DiskCache(str(tmp_path)))
    graph, xs, claim = _lora_claim(ctx)
    (lora,) = claim.plan.alternatives
    claim.plan.alternatives = [Alternative("first", lora.graph, "the first alternative", {"ugraph": "first"}), lora]
    monkeypatch.setattr(build, "_alternatives_key", lambda graphs, examples, cache, device=None: "alternatives-key")
    ctx.cache.put_json("alternatives-key", {"times": {"first": 9.0, "lora": 4.0}})
    calls = _failing_first(monkeypatch, 0)
    (region,) = built_regions([claim], graph, ctx, "ugraph-search")
    assert len(calls) == 1 and region.info["ugraph"] == "lora" and region.info["ugraph_us"] == {"first": 9.0, "lora": 4.0}
    inputs = dict(zip([v.name for v in graph.inputs], xs))
    assert_close(region.kernel(*[inputs[v.name] for v in region.inputs])[0], _lora(*xs))

    ctx = CompileContext.standalone(target=Target.INTERPRETER, cache=ctx.cache)     # another graph's compile
    graph, xs, claim = _lora_claim(ctx)
    claim.plan.alternatives = [Alternative("first", lora.graph, "the first alternative", {"ugraph": "first"}), lora]
    calls = _failing_first(monkeypatch, 1)          # the cached winner fails: both are built, the first runs
    (region,) = built_regions([claim], graph, ctx, "ugraph-search")
    assert len(calls) == 3 and region.compiled_by == "mirage"


def test_the_graphs_launch_candidates_compile_in_one_round(monkeypatch):
    """On a GPU the build stage first compiles the launch candidates of every μGraph plan in one round of the
    compile pool (each distinct plan once: a model's layers share theirs), from meta examples of the plans' shapes
    and strides, and marks the plans, so that none makes a round of its own. Faked here: the CUDA device, the
    candidates' compiles and the pool."""
    from torch_mirage.compile_pool import PoolRun
    from torch_mirage.partition.region import Region

    claiming = CompileContext.standalone(target=Target.INTERPRETER)
    made = [_lora_claim(claiming), _lora_claim(claiming), _lora_claim(claiming, n=24)]   # two layers alike, another
    ctx = CompileContext.standalone(target=Target.CUDA)
    regions = [Region.of_claim(claim, "ugraph-search") for _, _, claim in made]
    off_cuda = Region.of_claim(_lora_claim(claiming)[2], "ugraph-search")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def example_metas(plan):
        return torch.device("cuda"), [x.to("meta") for x in plan.examples()]
    asked, rounds = [], []

    def tuning_compiles(graph, examples, *, label, device, **where):
        asked.append((graph.hash(), device.type, {x.device.type for x in examples}))
        return {f"{label} op1 c{i}": (lambda: None) for i in range(3)}

    def run_all(names, job, threads):
        rounds.append(list(names))
        for name in names:
            job(name)
        return PoolRun(threads)
    monkeypatch.setattr(build, "_example_metas", example_metas)
    monkeypatch.setattr(build, "tuning_compiles", tuning_compiles)
    monkeypatch.setattr(build, "run_all", run_all)
    build.compile_candidates_ahead(regions, ctx)
    assert len(rounds) == 1 and len(rounds[0]) == 6          # 3 candidates of each of the two distinct plans
    assert {name.split(" lora")[0] for name in rounds[0]} == {"region 0", "region 2"}
    assert len(asked) == 2 and asked[0][0] != asked[1][0] and all(a[1:] == ("cuda", {"meta"}) for a in asked)
    assert all(r.plan.candidates_compiled for r in regions)

    build.compile_candidates_ahead([off_cuda], claiming)    # off CUDA: nothing ahead, nothing marked
    assert len(rounds) == 1 and not off_cuda.plan.candidates_compiled


def test_regions_of_the_same_ugraph_share_its_kernels(monkeypatch):
    """A model's layers: regions whose plans hold the same μGraphs on example inputs of the same shapes, dtypes and
    strides are compiled once per graph and share the kernels; another shape compiles its own; each region's
    kernel computes its own inputs' result."""
    ctx = CompileContext.standalone(target=Target.INTERPRETER)
    made = [_lora_claim(ctx), _lora_claim(ctx), _lora_claim(ctx, n=24)]
    calls = _failing_first(monkeypatch, 0)
    regions = [built_regions([claim], graph, ctx, "ugraph-search")[0] for graph, _, claim in made]
    assert len(calls) == 2 and all(r.compiled_by == "mirage" for r in regions)
    for (graph, xs, _), region in zip(made, regions):
        inputs = dict(zip([v.name for v in graph.inputs], xs))
        assert_close(region.kernel(*[inputs[v.name] for v in region.inputs])[0], _lora(*xs))
