"""A graph of symbolic sizes compiled again at each concrete size (``MIRAGE_STATIC_SIZES``, issue 18's serving
case): the wrapper's own rules, and an HF model served at two prompt lengths under torch.compile's default
``dynamic=None`` with mirage's kernels at both."""
import logging
import operator
import os

import pytest
import torch

from torch_mirage.runtime.static_sizes import StaticSizes, size_key


def _wrapper(limit=2, fail_at=()):
    compiled = []

    def compile_at(args):
        if args[1] in fail_at:
            raise RuntimeError(f"no kernel at {args[1]}")
        compiled.append(args[1])
        return lambda x, n: ("static", n)
    return StaticSizes(compile_at, lambda x, n: ("symbolic", n), positions=(1,), limit=limit), compiled


def test_a_size_that_comes_back_is_compiled_once_up_to_the_limit():
    """A size's first call runs the symbolic graph (a size met once — a growing KV cache's — is never compiled);
    its second compiles it; the first ``limit`` sizes that come back are compiled, later ones are not."""
    run, compiled = _wrapper(limit=2)
    x = torch.zeros(2)
    assert [run(x, n)[0] for n in (3, 5, 3, 7, 5, 3, 9, 7, 7)] == [
        "symbolic", "symbolic", "static", "symbolic", "static", "static", "symbolic", "symbolic", "symbolic"]
    assert compiled == [3, 5]


def test_a_growing_size_is_never_compiled():
    run, compiled = _wrapper(limit=4)
    assert all(run(torch.zeros(2), n)[0] == "symbolic" for n in range(10, 40))
    assert compiled == []


def test_a_growing_cache_called_again_is_not_compiled(caplog):
    """A second pass over a growing cache's sizes (a second ``generate`` at the same prompt length): every size
    comes back, but after more than ``SPREAD_SIZES`` others, so none is compiled (said once in the log); a
    graph whose first size comes back among few others compiles as before."""
    from torch_mirage.runtime.static_sizes import SPREAD_SIZES

    run, compiled = _wrapper(limit=4)
    steps = range(10, 11 + SPREAD_SIZES)                    # one size more than the spread allows
    with caplog.at_level(logging.INFO, logger="torch_mirage"):
        for _ in range(3):
            assert all(run(torch.zeros(2), n)[0] == "symbolic" for n in steps)
    assert compiled == []
    said = [r.getMessage() for r in caplog.records if "before" in r.getMessage() and "came back" in r.getMessage()]
    assert len(said) == 1 and f"met {SPREAD_SIZES + 1} sizes" in said[0], said
    run, compiled = _wrapper(limit=4)
    steps = range(10, 10 + SPREAD_SIZES)                    # as many as it allows: compiled when they come back
    second = [run(torch.zeros(2), n)[0] for _ in range(2) for n in steps][len(steps):]
    assert second == ["static"] * 4 + ["symbolic"] * (len(steps) - 4) and compiled == list(steps)[:4]


def test_a_failed_static_compile_runs_the_symbolic_graph_and_is_not_retried(caplog):
    run, compiled = _wrapper(limit=4, fail_at=(5,))
    x = torch.zeros(2)
    with caplog.at_level(logging.WARNING, logger="torch_mirage"):
        assert [run(x, n)[0] for n in (5, 5, 5, 3, 3)] == ["symbolic"] * 4 + ["static"]
    assert compiled == [3]
    assert sum("no kernel at 5" in r.getMessage() for r in caplog.records) == 1


def test_strict_raises_the_failed_compile():
    compile_at = lambda args: (_ for _ in ()).throw(RuntimeError("boom"))    # noqa: E731
    run = StaticSizes(compile_at, lambda *a: None, positions=(0,), limit=1, strict=True)
    run(4)
    with pytest.raises(RuntimeError, match="boom"):
        run(4)


def test_a_call_that_records_gradients_runs_the_symbolic_graph():
    run, compiled = _wrapper()
    w = torch.zeros(2, requires_grad=True)
    assert run(w, 3)[0] == "symbolic" and compiled == []
    with torch.no_grad():
        assert [run(w, 3)[0] for _ in range(2)] == ["symbolic", "static"] and compiled == [3]


def test_the_size_key_reads_scalars_shapes_and_strides():
    x = torch.zeros(4, 6)
    assert size_key([x, 7, x.t()], (1, 2)) == (7, (6, 4, 1, 6))
    assert size_key([x], (0,)) != size_key([torch.zeros(6, 4).t()], (0,))


@pytest.mark.parametrize("symbolic_to_inductor", [True, False])
def test_static_compiles_are_timed_against_the_symbolic_graphs_inductor_compile(monkeypatch, symbolic_to_inductor):
    """A static compile of a size is timed against what runs that size otherwise — Inductor's compile of the
    graph at symbolic sizes, already made — not against a fresh Inductor compile at the size (seconds a size);
    where the symbolic graph is not Inductor's whole (mirage claimed part of it), a fresh compile as before."""
    from torch_mirage import backend as B

    backend, given = B.MirageBackend(options={"static_sizes": 2}), []

    def compile_graph(self, gm, inputs, *, inductor_version=None, **kwargs):
        graph = self.report.new_graph("inference")
        graph.whole_graph_to_inductor = symbolic_to_inductor and inductor_version is None
        given.append(inductor_version)
        return symbolic if inductor_version is None and not given[1:] else (lambda *a: "static")

    def symbolic(*args):
        return "symbolic"
    monkeypatch.setattr(B.MirageBackend, "_compile", compile_graph)
    monkeypatch.setattr(B, "symbolic_positions", lambda gm, inputs: [0])
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    served = backend._compile_sized(gm, [torch.ones(3)])
    assert [served(torch.ones(5)) for _ in range(3)] == ["symbolic", "static", "static"]
    assert given == [None, symbolic if symbolic_to_inductor else None]


def test_a_static_compile_without_mirage_regions_runs_the_symbolic_graphs_inductor_compile(monkeypatch):
    """A size at which mirage claims nothing is not compiled by Inductor once more: Inductor's compile at
    symbolic sizes, already made, serves it (none of Inductor's compile runs)."""
    from torch_mirage import backend as B

    def no_compile(*args, **kwargs):
        raise AssertionError("Inductor compiled the graph again")
    monkeypatch.setattr(B.MirageBackend, "_inductor_compile", no_compile)
    backend = B.MirageBackend()
    gm = torch.fx.symbolic_trace(lambda x: (torch.cos(x),))    # cos: outside mirage's IR, no region

    def symbolic(*args):
        return "symbolic"
    assert backend._compile(gm, [torch.randn(4, 8)], inductor_version=symbolic) is symbolic
    (graph,) = backend.report.graphs
    assert graph.whole_graph_to_inductor and "symbolic sizes" in graph.cuda_graph_reason, str(backend.report)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU kernels run only in Triton's interpreter (TRITON_INTERPRET=1)")
def test_a_static_compiles_inductor_partitions_are_cached(tmp_path, monkeypatch):
    """The Inductor partitions of a static-size compile (a size of a symbolic graph that came back) go through
    AOTAutograd's cache, not around it: its context's fake mode has no ShapeEnv, and the cache bypasses every
    compile without one ("No shape env"), so each process compiled them again. The outputs stay eager's."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    import torch_mirage

    def fn(x, w):
        h = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
        return torch.softmax(h, -1) * 2, torch.sort(x, dim=-1).values.cumsum(-1)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    report = torch_mirage.Report()
    backend = torch_mirage.MirageBackend(report=report, options={"min_region_us": 0, "measure_regions": False,
                                                                 "cache_dir": str(tmp_path / "mirage")})
    compiled = torch.compile(fn, backend=backend, dynamic=True)
    w, x = torch.randn(64), torch.randn(8, 64)
    # the caches as users have them (the bench's runs in this process turn them off); config.patch, not
    # monkeypatch, which deletes a config module's entry on undo
    with functorch_config.patch(enable_autograd_cache=True), inductor_config.patch(fx_graph_cache=True):
        compiled(torch.randn(8, 64), w)                        # the symbolic graph
        counters.clear()
        got = compiled(x, w)                                   # the size comes back: its static compile
    assert [g.symbolic_sizes for g in report.graphs] == [True, False]
    assert any(r.compiled_by == "mirage" for r in report.graphs[1].regions)
    aot = dict(counters["aot_autograd"])
    assert aot.get("autograd_cache_bypass", 0) == 0 and aot.get("autograd_cache_saved", 0) + \
        aot.get("autograd_cache_hit", 0) >= 1, aot
    for a, b in zip(got, fn(x, w)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.slow   # ~25 s on a 2-core CPU: three compiles of the model
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU kernels run only in Triton's interpreter (TRITON_INTERPRET=1)")
def test_an_hf_model_served_at_two_prompt_lengths_runs_mirage_at_both():
    """Tiny Llama, torch.compile's default ``dynamic=None``: the second prompt length makes Dynamo's graph
    symbolic; mirage compiles it again at that length when it comes back (its second prompt), claiming there what
    it claims in the first length's static graph; logits equal eager's at each call."""
    pytest.importorskip("transformers")
    import torch_mirage
    from torch_mirage.bench import models as M
    from torch_mirage.report import Report

    model = M.build(M.MODELS["llama"], "default", torch.float32, "cpu", tiny=True)
    report = Report()
    prompts = [torch.randint(1, model.config.vocab_size, (2, n)) for n in (12, 20, 20)]
    with torch.no_grad():
        expected = [model(ids).logits for ids in prompts]
        forward = model.forward
        model.forward = torch.compile(forward, backend=torch_mirage.MirageBackend(
            options={"min_region_us": 0}, report=report), dynamic=None)
        try:
            got = [model(ids).logits for ids in prompts]
        finally:
            model.forward = forward
            torch._dynamo.reset()
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
    symbolic = [g for g in report.graphs if g.symbolic_sizes]
    fixed = [g for g in report.graphs if g.sizes_of]
    assert len(symbolic) == 1 and len(fixed) == 1 and "20" in fixed[0].sizes_of, str(report)
    assert not any(r.compiled_by == "mirage" for r in symbolic[0].regions)      # nothing of symbolic size
    ours = [sum(r.compiled_by == "mirage" for r in g.regions) for g in (report.graphs[0], fixed[0])]
    assert ours[0] > 0 and ours[1] == ours[0], str(report)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_static_compiles_run_in_cuda_graphs_on_gpu():
    """On the GPU each static compile of a size that came back runs in a CUDA graph of its own, its results
    eager-equal and none overwritten by a later call (``_serve``)."""
    from test_cudagraph_rules import _serve

    report = _serve([8, 16, 16, 24, 24, 16, 40], device="cuda", options={"min_region_us": 0})
    fixed = [g for g in report.graphs if g.sizes_of]
    assert len(fixed) == 2 and all(g.cuda_graph for g in fixed), str(report)
    # each timed against the symbolic graph's Inductor compile, which serves the size otherwise
    assert all(g.choice and "symbolic sizes" in g.choice_against for g in fixed), str(report)


def test_a_partition_takes_no_compound_size_so_its_cache_entry_loads(tmp_path, monkeypatch):
    """An Inductor partition fed a compound size (``s + 1``, computed outside it) and not ``s`` itself: AOTAutograd's
    cache writes that input's guard in the outer graph's sources (``L['k']``) and no later lookup can load the entry
    ("unable to load compiled graph: 'k'"; a warm process compiled the symbolic decode graph's attention partitions
    again). ``rematerialize_sizes`` computes the size inside the partition from its leaves; a second compile of the
    same graph then hits the cache, and the results stay eager's."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.utils import counters
    from torch.fx.passes.regional_inductor import regional_inductor

    from torch_mirage.runtime.assemble import rematerialize_sizes

    rewritten = []

    def fw(gm, example):   # as ``assemble`` annotates: tensor ops for Inductor, size arithmetic left outside
        for n in gm.graph.nodes:
            if n.op == "call_function" and not isinstance(n.meta.get("val"), (torch.SymInt, int)):
                n.meta["custom"] = {"compile_with_inductor": {"inductor_configs": {}, "inductor_region": 0}}
        rewritten.append(rematerialize_sizes(gm.graph))
        gm.recompile()
        return regional_inductor(gm, *example)

    def fn(k, knew):
        kc = torch.cat([k, knew], 1)
        n = kc.shape[1]
        return kc, kc[:, None].expand(2, 2, n, 16).reshape(4, n, 16).sum(1) * 2

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    seen = []
    for length in (5, 7):   # a second compile, as a warm process makes it (Dynamo reset, the disk caches kept)
        torch._dynamo.reset()
        k, knew = torch.randn(2, length, 16), torch.randn(2, 1, 16)
        torch._dynamo.mark_dynamic(k, 1)
        with functorch_config.patch(enable_autograd_cache=True), inductor_config.patch(fx_graph_cache=True):
            counters.clear()
            got = torch.compile(fn, backend=aot_autograd(fw_compiler=fw))(k, knew)
        seen.append(dict(counters["aot_autograd"]))
        for a, b in zip(got, fn(k, knew)):
            torch.testing.assert_close(a, b)
    assert rewritten and all(n >= 1 for n in rewritten), rewritten
    assert seen[0].get("autograd_cache_saved", 0) >= 1, seen
    assert seen[1].get("autograd_cache_hit", 0) >= 1 and not seen[1].get("autograd_cache_miss"), seen


def test_rematerialize_sizes_copies_size_arithmetic_into_its_user():
    """The compound size an annotated node reads (``sym_size(cat) + 2``, unannotated) is computed again right
    before it, annotated alike, from the tensor it is the size of; the originals nothing reads any more are
    erased; a plain-symbol size and an unannotated reader are left alone; the graph computes the same."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from torch_mirage.runtime.assemble import rematerialize_sizes

    def f(k, knew):
        kc = torch.cat([k, knew], 1)
        return torch.zeros(kc.shape[1] + 2, 3) + kc.sum(), k.shape[1]

    k, knew = torch.randn(2, 5, 4), torch.randn(2, 1, 4)
    gm = make_fx(f, tracing_mode="symbolic")(k, knew)
    mark = {"compile_with_inductor": {"inductor_configs": {}, "inductor_region": 0}}
    for n in gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor):
            n.meta["custom"] = dict(mark)
    before = [n.name for n in gm.graph.nodes]
    assert rematerialize_sizes(gm.graph) == 1
    nodes = list(gm.graph.nodes)
    zeros = next(n for n in nodes if n.target is torch.ops.aten.zeros.default)
    (size,) = [a for a in zeros.all_input_nodes]
    assert size.target is operator.add and size.meta["custom"] == zeros.meta["custom"]
    (inner,) = size.all_input_nodes
    assert inner.target is torch.ops.aten.sym_size.int and inner.args[0].target is torch.ops.aten.cat.default
    assert nodes.index(inner) < nodes.index(size) < nodes.index(zeros)
    assert len([n for n in nodes if n.target is operator.add]) == 1          # the original add erased
    sizes = [n for n in nodes if n.target is torch.ops.aten.sym_size.int]
    assert len(sizes) == sum(x.startswith("sym_size") for x in before) == 2   # the compound one moved, k's kept
    assert any(s.args[0].op == "placeholder" and not s.meta.get("custom") for s in sizes)
    gm.recompile()
    got, want = gm(k, knew), f(k, knew)
    torch.testing.assert_close(got[0], want[0])
    assert got[1] == want[1]
