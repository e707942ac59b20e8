"""A failure injected into each stage of mirage's pipeline: eager's results, Inductor's own compile_fx (not eager)
where Inductor can compile, and exactly one warning that names the stage and what to do."""
import logging

import pytest
import torch
import torch.nn.functional as F

import torch_mirage
from torch_mirage import backend, failures, pipeline
from helpers import assert_close


class Injected(ZeroDivisionError):
    pass


def _raise(*args, **kwargs):
    raise Injected("injected failure")


def softmax_plus_one(x):
    return torch.softmax(x, -1) + 1


def gated_mlp(x, w1, w3):
    return F.silu(x @ w1) * (x @ w3)


def _softmax_inputs():
    return [torch.randn(4, 8)]


def _mlp_inputs():
    """Compute-bound matmuls (AI 36 FLOP/B in fp32): the library claimer's, not the weight-streaming claimer's."""
    return [torch.randn(192, 1024), torch.randn(1024, 128) * 0.03, torch.randn(1024, 128) * 0.03]


def _inject_capture(mp):
    mp.setattr(backend, "aot_autograd", lambda **kwargs: _raise)


def _inject_measure(mp):
    mp.setattr(pipeline, "_measures", lambda config: True)   # timing runs only on a GPU otherwise
    mp.setattr(pipeline, "keep_faster", _raise)


def _inject_build(mp):
    import torch_mirage.build as build
    mp.setattr(build, "compile_ugraph", _raise)   # the build stage's compile of the library claimer's μGraph


# stage name -> (how to inject, program, inputs, options)
STAGES = {
    "capture": (_inject_capture, softmax_plus_one, _softmax_inputs, {}),
    "lower": (lambda mp: mp.setattr(pipeline, "lower", _raise), softmax_plus_one, _softmax_inputs, {}),
    "partition": (lambda mp: mp.setattr(pipeline, "claim_regions", _raise), softmax_plus_one, _softmax_inputs, {}),
    "check": (lambda mp: mp.setattr(pipeline, "check_regions", _raise), softmax_plus_one, _softmax_inputs, {}),
    "measure": (_inject_measure, softmax_plus_one, _softmax_inputs, {}),
    "assemble": (lambda mp: mp.setattr(pipeline, "assemble", _raise), softmax_plus_one, _softmax_inputs, {}),
    "cuda graph": (lambda mp: mp.setattr(pipeline, "_maybe_cuda_graph", _raise), softmax_plus_one,
                   _softmax_inputs, {}),
    "build": (_inject_build, gated_mlp, _mlp_inputs, {"stitch": False}),
}


@pytest.fixture
def compile_fx_calls(monkeypatch):
    """Every call of Inductor's own compile_fx (the backend imports it where it is used)."""
    import torch._inductor.compile_fx as cfx

    calls, real = [], cfx.compile_fx

    def spy(gm, *args, **kwargs):
        calls.append(gm)
        return real(gm, *args, **kwargs)
    monkeypatch.setattr(cfx, "compile_fx", spy)
    return calls


def _stage_warnings(caplog):
    return [r.getMessage() for r in caplog.records
            if r.name == "torch_mirage" and r.levelno == logging.WARNING and "stage failed" in r.getMessage()]


def _compile(fn, options):
    report = torch_mirage.Report()
    return torch.compile(fn, backend=torch_mirage.MirageBackend(options=options, report=report)), report


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_failing_stage_hands_the_graph_to_inductor_with_one_warning(stage, monkeypatch, caplog,
                                                                     compile_fx_calls):
    inject, fn, inputs, options = STAGES[stage]
    inject(monkeypatch)
    compiled, report = _compile(fn, options)
    xs = inputs()
    with caplog.at_level(logging.WARNING, logger="torch_mirage"):
        assert_close(compiled(*xs), fn(*xs))
        assert_close(compiled(*xs), fn(*xs))      # no recompile, no second warning
    (warning,) = _stage_warnings(caplog)
    assert f"the {stage} stage failed" in warning and "MIRAGE_STRICT=1" in warning, warning
    assert "float32" in warning, warning          # the region's dtypes (and shapes) are named
    assert compile_fx_calls, "Inductor's compile_fx was not used"
    assert report.regions and all(r.compiled_by == "inductor" for r in report.regions), str(report)
    if stage != "build":                          # a μGraph not built changes the region, not the graph
        assert "Inductor's compile_fx" in warning and "eager" not in warning
        assert report.graphs[-1].fallback_error.startswith(f"{stage} stage: Injected")


@pytest.mark.parametrize("stage", ["lower", "partition", "build", "assemble"])
def test_strict_mode_raises_the_stage_error(stage, monkeypatch):
    inject, fn, inputs, options = STAGES[stage]
    inject(monkeypatch)
    compiled, _ = _compile(fn, {**options, "strict": True})
    with pytest.raises(Exception, match="injected failure"):
        compiled(*inputs())


def test_eager_only_when_inductor_fails_too_and_the_log_says_so(monkeypatch, caplog):
    import torch._inductor.compile_fx as cfx

    monkeypatch.setattr(pipeline, "lower", _raise)
    monkeypatch.setattr(cfx, "compile_fx", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("inductor broke")))
    compiled, report = _compile(softmax_plus_one, {})
    (x,) = _softmax_inputs()
    with caplog.at_level(logging.WARNING, logger="torch_mirage"):
        assert_close(compiled(x), softmax_plus_one(x))
    (warning,) = _stage_warnings(caplog)
    assert "the lower stage failed" in warning and "Inductor could not compile the graph either" in warning
    assert "inductor broke" in warning and "runs eagerly" in warning
    assert [r.compiled_by for r in report.regions] == ["eager"]


def test_fallback_eager_config_says_eager(monkeypatch, caplog, compile_fx_calls):
    monkeypatch.setattr(pipeline, "lower", _raise)
    compiled, report = _compile(softmax_plus_one, {"fallback": "eager"})
    (x,) = _softmax_inputs()
    with caplog.at_level(logging.WARNING, logger="torch_mirage"):
        assert_close(compiled(x), softmax_plus_one(x))
    (warning,) = _stage_warnings(caplog)
    assert "runs eagerly (MIRAGE_FALLBACK=eager)" in warning and not compile_fx_calls


def test_backward_graph_failure_goes_to_inductor_without_mirage_stages(monkeypatch, caplog):
    """The forward is compiled by mirage; the backward's lower fails: the backward goes through Inductor
    (regional_inductor over the whole ATen graph, lower not called again) and gradients match eager."""
    real_lower, calls = pipeline.lower, []

    def lower_failing_for_backward(gm, inputs):
        calls.append(gm)
        if len(calls) == 2:
            raise Injected("injected failure")
        return real_lower(gm, inputs)
    monkeypatch.setattr(pipeline, "lower", lower_failing_for_backward)
    whole = []
    real_whole = pipeline.inductor_whole_aten_graph
    monkeypatch.setattr(pipeline, "inductor_whole_aten_graph", lambda *a, **k: whole.append(1) or real_whole(*a, **k))
    fn = lambda x: torch.tanh(x).sum(-1) * 2
    compiled, report = _compile(fn, {})
    x = torch.randn(4, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    with caplog.at_level(logging.WARNING, logger="torch_mirage"):
        compiled(x).sum().backward()
    fn(x_ref).sum().backward()
    assert_close(x.grad, x_ref.grad)
    (warning,) = _stage_warnings(caplog)
    assert "the lower stage failed" in warning and "backward graph" in warning, warning
    assert len(calls) == 2 and whole == [1]
    (bw,) = [g for g in report.graphs if g.kind == "backward"]
    assert [r.compiled_by for r in bw.regions] == ["inductor"]


def test_identical_failures_are_grouped_into_one_line(monkeypatch, caplog):
    """Six gated MLPs whose μGraph fails to build: one warning line with the count, not six."""
    _inject_build(monkeypatch)

    def six_mlps(x, w1, w3):
        return sum(gated_mlp(x + i, w1, w3) for i in range(6))
    compiled, _ = _compile(six_mlps, {"stitch": False})
    xs = _mlp_inputs()
    with caplog.at_level(logging.WARNING, logger="torch_mirage"):
        assert_close(compiled(*xs), six_mlps(*xs))
    (warning,) = _stage_warnings(caplog)
    assert "build stage failed 6 times" in warning and "gated_mlp" in warning, warning


def test_failure_log_groups_by_stage_error_and_message_shape(caplog):
    log = failures.FailureLog("inference graph 3")
    for size in range(80):
        log.add("build", f"region {size}", RuntimeError(f"tile {size} x {size * 2} too large"), "left to Inductor")
    log.add("build", "region x", ValueError("tile 1 x 2 too large"), "left to Inductor")   # another error type
    log.add("check", "region y", RuntimeError("tile 1 x 2 too large"), "left to Inductor")  # another stage
    assert len(log) == 82
    with caplog.at_level(logging.WARNING, logger="torch_mirage"):
        log.flush()
        log.flush()                                   # flushed once: nothing left
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert "the build stage failed 80 times (first for region 0) in inference graph 3" in lines[0]
    assert "RuntimeError: tile 0 x 0 too large" in lines[0] and lines[0].endswith("MIRAGE_STRICT=1 to raise instead.")


def test_stage_tags_the_innermost_stage():
    with pytest.raises(Injected) as info:
        with failures.stage("outer"), failures.stage("inner"):
            _raise()
    assert failures.stage_of(info.value) == "inner"
    assert failures.stage_of(ValueError()) == "unknown"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("stage", ["lower", "measure", "cuda graph"])
def test_gpu_failing_stage_runs_inductor_in_our_cuda_graph_unless_that_failed(stage, monkeypatch, caplog,
                                                                              compile_fx_calls):
    """On a GPU the real measure stage runs (keep_faster raises here); Inductor's compile_fx of the graph is
    captured in our CUDA graph, except when the CUDA-graph stage itself was what failed."""
    if stage == "measure":
        monkeypatch.setattr(pipeline, "keep_faster", _raise)
    else:
        STAGES[stage][0](monkeypatch)
    # the CUDA-graph stage runs only when a region is kept: untimed, so Inductor cannot win it first
    options = {"cuda_graphs": True, **({"measure_regions": False} if stage == "cuda graph" else {})}
    compiled, report = _compile(softmax_plus_one, options)
    x = torch.randn(64, 256, device="cuda", dtype=torch.float16)
    with caplog.at_level(logging.WARNING, logger="torch_mirage"):
        for _ in range(3):
            assert_close(compiled(x), softmax_plus_one(x))
    (warning,) = _stage_warnings(caplog)
    assert f"the {stage} stage failed" in warning and "float16" in warning and compile_fx_calls
    graph = report.graphs[-1]
    if stage == "cuda graph":
        assert not graph.cuda_graph and "cuda graph stage failed" in graph.cuda_graph_reason
    else:
        assert graph.cuda_graph, graph.cuda_graph_reason


def test_a_ugraph_too_large_for_block_memory_declines_without_a_warning(monkeypatch, caplog):
    """A library seed whose tiles need more than one SM's memory at the model's sizes (gated_mlp at hidden 1024
    on the H100) is no seed, not a failure: no warning, even under strict."""
    from torch_mirage.superopt.search import seeds
    from torch_mirage.superopt import library
    from torch_mirage.superopt.validate import InvalidMuGraph

    def too_large(*args, **kwargs):
        raise InvalidMuGraph(["kernel graph op 3 (customized) body: its tensors need 1458176 bytes of block-level "
                              "memory, capacity 232448"])

    monkeypatch.setattr(seeds, "validate", too_large)
    workload = library.WORKLOADS["gated_mlp"]
    with caplog.at_level(logging.INFO, logger="torch_mirage"):
        assert seeds._instance(workload, (4, 8, 16), "float32", {}) is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("not valid at these sizes" in r.getMessage() and "block-level memory" in r.getMessage()
               for r in caplog.records)
