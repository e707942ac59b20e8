"""Mirage's regions inside Inductor's partitions (``MIRAGE_REGIONS_IN_INDUCTOR``, :mod:`torch_mirage.runtime.region_op`):
a graph's fallback ops make one Inductor compile with the regions as extern calls, equal to eager; outputs that
share memory with an input or another output come back as copies; regions that write an input in place or have
symbolic sizes stay between the partitions; where Inductor fails on the graph with the regions inside, the
regions go between its partitions with one warning."""
import logging
import tempfile

import pytest
import torch
from torch._dynamo.utils import counters

import torch_mirage
from torch_mirage.capture.ir import Graph
from torch_mirage.partition.region import Reason, Region
from torch_mirage.runtime import region_op
from torch_mirage.testing.models import LlamaBlock, LlamaConfig, llama_inputs


class _TwoBlocks(torch.nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.a, self.b = LlamaBlock(cfg), LlamaBlock(cfg)

    def forward(self, x, cos, sin):
        return self.b(self.a(x, cos, sin), cos, sin)


def _compile(inside: bool, cache_dir: str | None = None):
    """Two tiny Llama blocks compiled by mirage with the knob ``inside`` (mirage's disk cache in ``cache_dir``, a
    fresh one if None): (error against fp64 eager, Inductor partitions compiled, extern calls Inductor made, the
    report)."""
    torch.manual_seed(0)
    cfg = LlamaConfig()
    model = _TwoBlocks(cfg).eval()
    x, cos, sin = llama_inputs(cfg, 2, 8)
    with torch.no_grad():
        ref = model.double()(x.double(), cos.double(), sin.double())
        model.float()
        counters.clear()
        torch._dynamo.reset()
        with tempfile.TemporaryDirectory() as d:
            report = torch_mirage.Report()
            backend = torch_mirage.MirageBackend(
                options=dict(regions_in_inductor=inside, cache_dir=cache_dir or d, min_region_us=0.0), report=report)
            out = torch.compile(model, backend=backend)(x, cos, sin)
    partitions = counters["aot_autograd"]["total"] - 1      # the backend's own AOTAutograd call is one
    return (out.double() - ref).abs().max().item(), partitions, counters["inductor"]["extern_calls"], report


def test_regions_run_inside_one_inductor_partition_and_match_eager():
    err_in, parts_in, extern_in, report = _compile(True)
    err_out, parts_out, extern_out, _ = _compile(False)
    mirage = sum(r.compiled_by == "mirage" for r in report.regions)
    assert mirage >= 4, report
    assert err_in < 1e-4 and err_out < 1e-4
    assert parts_in == 1 < parts_out, (parts_in, parts_out)
    assert extern_in >= mirage and extern_out == 0


def test_a_second_compile_of_the_graph_loads_its_one_partition_from_the_caches(tmp_path, monkeypatch):
    """The region keys are the same in every compile of the graph, so Inductor's caches answer the partition that
    holds them (a warm process does the same: the keys are made of the graph's text)."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    with inductor_config.patch(fx_graph_cache=True), functorch_config.patch(enable_autograd_cache=True):
        _compile(True, str(tmp_path / "mirage"))
        err, parts, _, _ = _compile(True, str(tmp_path / "mirage"))
        hits = counters["aot_autograd"]["autograd_cache_hit"]
    assert err < 1e-4 and parts == 1 and hits == 1


def _region(graph: Graph, kernel) -> Region:
    return Region(list(graph.nodes), "mirage", Reason.CLAIMED, kernel=kernel)


def _graph_of(fn, *examples) -> Graph:
    import torch.fx as fx
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch_mirage.capture.lower import lower

    gm: fx.GraphModule = make_fx(fn)(*examples)
    for n, a in zip(gm.graph.find_nodes(op="placeholder"), examples):
        n.meta["val"] = a
    return lower(gm, list(examples))


def test_an_output_sharing_memory_with_an_input_or_another_output_comes_back_as_a_copy():
    x = torch.randn(4, 6)
    region_op.register("test-alias", lambda a: (a.t(), a[1:], a[1:] * 2), [
        _value(x.t()), _value(x[1:]), _value(x[1:])])
    ta, rows, doubled = region_op.region_op()("test-alias", [x])
    assert ta.stride() == (1, 6) and torch.equal(ta, x.t())          # strides kept, memory its own
    assert rows.stride() == x[1:].stride() and torch.equal(rows, x[1:])
    for t in (ta, rows):
        assert not _shares(t, x)
    assert torch.equal(doubled, x[1:] * 2)
    before = x[1:].clone()
    x.add_(1.0)                      # the caller's input changes: the outputs do not
    assert torch.equal(rows, before)


def test_a_broadcast_output_is_copied_with_its_zero_strides():
    x = torch.randn(1, 5)
    region_op.register("test-broadcast", lambda a: (a.expand(3, 5),), [_value(x.expand(3, 5))])
    (out,) = region_op.region_op()("test-broadcast", [x])
    assert out.stride() == (0, 1) and torch.equal(out, x.expand(3, 5)) and not _shares(out, x)


def test_an_unregistered_key_names_the_way_out():
    with pytest.raises(RuntimeError, match="MIRAGE_REGIONS_IN_INDUCTOR=0"):
        region_op.region_op()("no-such-region", [torch.zeros(1)])


def test_regions_that_write_an_input_or_have_symbolic_sizes_stay_out():
    cache, pos, rows = torch.zeros(8, 4), torch.tensor([1, 3]), torch.randn(2, 4)
    g = _graph_of(lambda c, p, r: (torch.index_copy(c, 0, p, r * 2),), cache, pos, rows)
    r = _region(g, kernel=lambda *a: a)
    assert not region_op.eligible(r, r.outputs(g))
    g2 = _graph_of(lambda r: (r * 2 + 1,), rows)
    r2 = _region(g2, kernel=lambda *a: a)
    assert region_op.eligible(r2, r2.outputs(g2))
    assert not region_op.eligible(_region(g2, kernel=None), r2.outputs(g2))


def test_region_keys_are_the_same_for_the_same_graph_and_differ_by_graph_and_place():
    rows = torch.randn(2, 4)
    g = _graph_of(lambda r: (r * 2 + 1,), rows)
    h = _graph_of(lambda r: (r * 3 + 1,), rows)
    g_again = _graph_of(lambda r: (r * 2 + 1,), rows)
    def key(graph, i):
        region = _region(graph, None)
        return region_op.region_key(region_op.graph_digest(graph), i, region, graph, region.outputs(graph))
    assert key(g, 0) == key(g_again, 0)
    assert key(g, 0) != key(h, 0) and key(g, 0) != key(g, 1)


def test_where_inductor_fails_with_the_regions_inside_they_go_between_its_partitions(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("planted failure")

    monkeypatch.setattr(region_op, "region_op", broken)
    with caplog.at_level(logging.WARNING, logger="torch_mirage"):
        err, parts, extern, _ = _compile(True)
    assert err < 1e-4 and parts > 1 and extern == 0
    assert sum("regions run between its partitions instead" in r.message for r in caplog.records) == 1


def _value(t: torch.Tensor):
    from torch_mirage.capture.ir import TensorMeta, Value

    return Value("v", TensorMeta.of(t), example=t)


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return region_op._overlap(region_op._span(a), region_op._span(b))
