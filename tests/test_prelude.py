"""The prelude (``MIRAGE_PRELUDE``): the fallback's small ops that read only the graph's inputs, run first as one
Inductor graph. Which ops it takes (:func:`~torch_mirage.runtime.assemble.prelude_nodes`: never an in-place write
ahead of a reader of the old value, never a large tensor), and an HF decode step through it equal to eager."""
import tempfile

import pytest
import torch
import torch.fx as fx

import torch_mirage
from torch_mirage.runtime.assemble import PRELUDE_MAX_ELEMENTS, prelude_nodes

aten, prims = torch.ops.aten, torch.ops.prims


def _graph(late_counter_reader: bool = False, big: bool = False) -> tuple[fx.GraphModule, dict]:
    """counter (int64 scalar), x (2, 8), w (8, 8): positions ``iota + counter`` and the counter's ``+1`` written
    back (input-only), ``x @ w`` (standing for a mirage region) and what reads it; ``late_counter_reader``: an op
    after the matmul reads the counter's old value; ``big``: an input-only op makes more than
    PRELUDE_MAX_ELEMENTS."""
    g = fx.Graph()
    counter, x, w = g.placeholder("counter"), g.placeholder("x"), g.placeholder("w")
    iota = g.call_function(prims.iota.default, (1,), dict(start=0, step=1, dtype=torch.int64,
                                                          device=torch.device("cpu"), requires_grad=False))
    pos = g.call_function(aten.add.Tensor, (iota, counter))
    mm = g.call_function(aten.mm.default, (x, w))
    used = g.call_function(aten.add.Tensor, (mm, g.call_function(aten.unsqueeze.default, (pos, 0))))
    outs = [used]
    if late_counter_reader:
        outs.append(g.call_function(aten.add.Tensor, (mm, counter)))
    if big:
        outs.append(g.call_function(aten.full.default, ([PRELUDE_MAX_ELEMENTS + 1], 1.0),
                                    dict(dtype=torch.float32, device=torch.device("cpu"))))
    bumped = g.call_function(aten.add.Tensor, (counter, 1))
    g.call_function(aten.copy_.default, (counter, bumped))
    g.output(tuple(outs))
    gm = fx.GraphModule(torch.nn.Module(), g)
    args = [torch.tensor(3), torch.randn(2, 8), torch.randn(8, 8)]
    for n, a in zip(gm.graph.find_nodes(op="placeholder"), args):
        n.meta["val"] = a
    env = {n: a for n, a in zip(gm.graph.find_nodes(op="placeholder"), args)}
    for n in gm.graph.nodes:            # each op's result as its "val", the way the backend's graphs carry them
        if n.op == "call_function":
            n.meta["val"] = env[n] = n.target(*fx.node.map_arg(n.args, env.get), **n.kwargs)
    fallback = {n: 0 for n in gm.graph.nodes if n.op == "call_function" and n is not mm}
    return gm, fallback


def _names(nodes) -> list[str]:
    return sorted(n.target.__name__ if hasattr(n.target, "__name__") else str(n.target) for n in nodes)


def test_the_prelude_takes_input_only_ops_and_the_counter_update():
    gm, fallback = _graph()
    got = prelude_nodes(gm, fallback)
    # the positions (iota, add, unsqueeze) and the counter's add + copy_; not the matmul nor the add that reads it
    assert _names(got) == ["add.Tensor", "add.Tensor", "copy_.default", "iota.default", "unsqueeze.default"]


def test_an_in_place_write_stays_behind_a_later_reader_of_the_old_value():
    gm, fallback = _graph(late_counter_reader=True)
    got = prelude_nodes(gm, fallback)
    assert aten.copy_.default not in {n.target for n in got}        # the add after the matmul reads the counter
    assert prims.iota.default in {n.target for n in got}


def test_a_large_input_only_tensor_is_not_taken():
    gm, fallback = _graph(big=True)
    assert aten.full.default not in {n.target for n in prelude_nodes(gm, fallback)}


def test_a_reduction_over_a_large_input_is_not_taken_but_a_gather_from_one_is():
    """Work that grows with a large input (a sum over 70000 values) stays with its users; the embedding's rows
    from a large table join."""
    g = fx.Graph()
    big, table, ids, x = (g.placeholder(n) for n in ("big", "table", "ids", "x"))
    total = g.call_function(aten.sum.default, (big,))
    rows = g.call_function(aten.embedding.default, (table, ids))
    mean = g.call_function(aten.mean.default, (rows,))
    used = g.call_function(aten.add.Tensor, (g.call_function(aten.add.Tensor, (g.call_function(aten.mm.default, (x, x)),
                                                                               total)), mean))
    g.output((used,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    args = [torch.randn(PRELUDE_MAX_ELEMENTS + 10), torch.randn(1000, 80), torch.tensor([[3, 5]]), torch.randn(4, 4)]
    env = dict(zip(gm.graph.find_nodes(op="placeholder"), args))
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            n.meta["val"] = env[n]
        elif n.op == "call_function":
            n.meta["val"] = env[n] = n.target(*fx.node.map_arg(n.args, env.get), **n.kwargs)
    fallback = {n: 0 for n in gm.graph.nodes if n.op == "call_function" and n.target is not aten.mm.default}
    got = {n.target for n in prelude_nodes(gm, fallback)}
    assert aten.embedding.default in got and aten.sum.default not in got


def test_a_prelude_that_feeds_nothing_else_is_empty():
    g = fx.Graph()
    counter = g.placeholder("counter")
    bumped = g.call_function(aten.add.Tensor, (counter, 1))
    g.call_function(aten.copy_.default, (counter, bumped))
    g.output(())
    gm = fx.GraphModule(torch.nn.Module(), g)
    counter.meta["val"] = torch.tensor(1)
    bumped.meta["val"] = torch.tensor(2)
    for n in gm.graph.nodes:
        if n.target is aten.copy_.default:
            n.meta["val"] = torch.tensor(2)
    assert prelude_nodes(gm, {n: 0 for n in gm.graph.nodes if n.op == "call_function"}) == set()


def _decode_steps_equal_eager(prelude: str, device: torch.device, caplog, counter_in_prelude: bool = True) -> None:
    """Three decode steps of a tiny HF llama with a static cache (transformers 5.x: each layer's counter written in
    place) through mirage with ``prelude``: logits, cache contents and counters as eager's, and the prelude's graph
    compiled (no fallback to inline). ``counter_in_prelude``: each prelude holds the counters' ``copy_`` (on the
    CPU; on CUDA it was not among them, H100 11-28, not traced yet: the update runs outside the prelude)."""
    import logging

    pytest.importorskip("transformers")
    from torch_mirage.bench import llm

    model, config = llm.build_model(llm.MODELS["llama3-8b-4l"], torch.float32, device, quick=True)
    report = torch_mirage.Report()

    def steps(compiled: bool):
        cache = llm.static_cache(config, 1, 64, device, torch.float32)

        def step(ids, position_ids, cache_position):
            return model(input_ids=ids, position_ids=position_ids, cache_position=cache_position,
                         past_key_values=cache, use_cache=True).logits
        backend = torch_mirage.MirageBackend(options=dict(min_region_us=0, measure_regions=False, prelude=prelude,
                                                          cache_dir=tempfile.mkdtemp()), report=report)
        f = torch.compile(step, backend=backend) if compiled else step
        ids = torch.randint(0, config.vocab_size, (3, 1, 1), device=device)
        with torch.no_grad():
            return [f(ids[p], torch.tensor([[p]], device=device), torch.tensor([p], device=device))
                    for p in range(3)], cache
    torch.manual_seed(0)
    want, want_cache = steps(False)
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="torch_mirage"):
        got, got_cache = steps(True)
    assert "prelude graph" not in caplog.text
    said = [g.prelude for g in report.graphs if g.prelude]     # each layer's counter update among the prelude's ops
    assert said, "no graph ran a prelude"
    lacking = [p for p in said if f"({prelude})" not in p or (counter_in_prelude and "copy_" not in p)]
    assert not lacking, "\n".join(lacking)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for a, b in zip(got_cache.layers, want_cache.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a.values, b.values, rtol=1e-4, atol=1e-4)
        if hasattr(b, "cumulative_length"):
            assert int(a.cumulative_length) == int(b.cumulative_length) == 3


@pytest.mark.parametrize("prelude", ["hoist", "combo"])
def test_hf_decode_steps_through_the_prelude_equal_eager(prelude, caplog):
    _decode_steps_equal_eager(prelude, torch.device("cpu"), caplog)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_hf_decode_steps_through_combo_kernels_on_gpu(caplog):
    """On CUDA the prelude is Inductor's combo kernels (Triton): it compiles, and the steps equal eager's."""
    _decode_steps_equal_eager("combo", torch.device("cuda"), caplog, counter_in_prelude=False)


def test_a_failing_prelude_graph_leaves_its_ops_inline(monkeypatch, caplog):
    """Inductor failing on the prelude's graph (combo kernels are experimental) costs the prelude, not mirage's
    regions: the ops go inline, with one warning."""
    import logging

    from torch_mirage import pipeline
    from test_backend_robustness import _EagerClaimer

    real, seen = pipeline.assemble, []

    def assemble(gm, graph, regions, fallback, mode, prelude="inline", taken=None):
        seen.append(prelude)
        if prelude != "inline":
            raise RuntimeError("combo kernel codegen failed")
        return real(gm, graph, regions, fallback, mode, prelude, taken)
    monkeypatch.setattr(pipeline, "assemble", assemble)

    def fn(x, w, n):
        h = x @ w
        a = torch.exp(h) * 0.5          # claimed
        return a - a.mean(-1, keepdim=True), torch.arange(3) + n    # the arange + n: input-only
    report = torch_mirage.Report()
    backend = torch_mirage.MirageBackend(report=report, claimers=[_EagerClaimer()], options=dict(prelude="combo"))
    x, w, n = torch.randn(5, 8), torch.randn(8, 6), torch.tensor(2)
    with caplog.at_level(logging.WARNING, logger="torch_mirage"):
        got = torch.compile(fn, backend=backend)(x, w, n)
    torch.testing.assert_close(got, fn(x, w, n))
    assert seen == ["combo", "inline"]
    assert "prelude graph" in caplog.text
    assert any(r.compiled_by == "mirage" for r in report.regions)
    assert "Inductor failed" in report.graphs[0].prelude and "prelude (MIRAGE_PRELUDE)" in str(report)


def test_symbolic_sizes_stay_out_of_the_prelude():
    """With dynamic shapes an input-only op of symbolic size is not taken (no guard on its size); the graph runs
    equal to eager at each size."""
    from test_backend_robustness import _EagerClaimer

    def fn(x, w, n):
        h = x @ w
        a = torch.exp(h) * 0.5
        return a - a.mean(-1, keepdim=True), torch.arange(x.shape[0]) + n, n * 2
    backend = torch_mirage.MirageBackend(claimers=[_EagerClaimer()], options=dict(prelude="combo"))
    compiled = torch.compile(fn, backend=backend, dynamic=True)
    w, n = torch.randn(8, 6), torch.tensor(2)
    for rows in (4, 5, 6):
        x = torch.randn(rows, 8)
        torch.testing.assert_close(compiled(x, w, n), fn(x, w, n))


def test_auto_prelude_is_combo_on_cuda_and_inline_elsewhere():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch_mirage.runtime.assemble import prelude_mode
    with FakeTensorMode():    # a CUDA tensor as the compiler sees it, without a GPU
        on_cuda = torch.empty(2, device="cuda")
    cpu = torch.zeros(2)
    assert prelude_mode("auto", [cpu, 3]) == "inline"
    assert prelude_mode("auto", [cpu, on_cuda]) == "combo"
    assert prelude_mode("inline", [on_cuda]) == "inline"
    assert prelude_mode("hoist", [cpu]) == "hoist"
