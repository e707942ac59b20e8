"""Failure policy and the awkward cases: every one gives eager's results."""
import logging

import pytest
import torch

import torch_mirage
from torch_mirage.partition.region import Claim, Reason, inputs_of
from torch_mirage.report import GraphReport
from helpers import ReadyKernel, assert_close


def _mirage(fn, **options):
    report = torch_mirage.Report()
    return torch.compile(fn, backend=torch_mirage.MirageBackend(options=options, report=report)), report


def test_dynamic_shapes_sizes_4_5_6_4():
    def fn(x, w):
        return torch.softmax(x @ w, dim=-1) * 2 + x.sum()
    compiled, report = _mirage(fn)
    w = torch.randn(8, 8)
    for n in (4, 5, 6, 4):
        x = torch.randn(n, 8)
        assert_close(compiled(x, w), fn(x, w))


@pytest.mark.parametrize("how", ["dynamic_true", "mark_dynamic"])
def test_dynamic_true_and_mark_dynamic(how):
    def fn(x):
        return torch.nn.functional.layer_norm(x, (x.shape[-1],)) * x.shape[0]
    report = torch_mirage.Report()
    backend = torch_mirage.MirageBackend(report=report)
    compiled = torch.compile(fn, backend=backend, dynamic=(how == "dynamic_true"))
    for n in (3, 7, 5):
        x = torch.randn(n, 16)
        if how == "mark_dynamic":
            torch._dynamo.mark_dynamic(x, 0)
        assert_close(compiled(x), fn(x))
    assert any(r.reason is Reason.DYNAMIC_SHAPE or r.compiled_by == "inductor" for r in report.regions)


def test_static_ops_reading_a_symbolic_stride_are_left_to_the_fallback():
    """A view of a dynamic-length tensor can have static sizes and a symbolic stride (``x[:, -1]`` of a (b, s, d)
    prompt: the last position's rows, HF GPT-2's generate when a second call changes the cache length). The
    weight-streaming claimer took its skinny matmul and the cost model then raised for the stride, failing the
    partition stage (the whole graph went to Inductor with a warning); such a node is now never claimed."""
    def fn(x, w, b):
        return torch.nn.functional.linear(x[:, -1, :], w, b).relu() + x.sum(1)

    compiled, report = _mirage(fn, strict=True, min_region_us=0)
    w, b = torch.randn(64, 64), torch.randn(64)
    for s in (5, 9, 7):
        x = torch.randn(4, s, 64)
        torch._dynamo.mark_dynamic(x, 1)
        assert_close(compiled(x, w, b), fn(x, w, b))
    dynamic = report.graphs[-1]
    assert dynamic.fallback_error is None
    assert any(r.reason is Reason.DYNAMIC_SHAPE and "mm" in " ".join(r.ops) for r in dynamic.regions), dynamic


def test_graph_break():
    def fn(x):
        y = torch.relu(x) * 3
        print("graph break here", end="\r")
        return torch.sigmoid(y).sum(-1)
    compiled, report = _mirage(fn)
    x = torch.randn(4, 9)
    assert_close(compiled(x), fn(x))
    assert len(report.graphs) == 2


def test_input_mutation():
    def fn(x, buf):
        buf.add_(x)
        return buf * 2
    compiled, _ = _mirage(fn)
    x, buf = torch.randn(6), torch.randn(6)
    buf_ref = buf.clone()
    out = compiled(x, buf)
    ref = fn(x, buf_ref)
    assert_close(out, ref)
    assert_close(buf, buf_ref)


@pytest.mark.parametrize("shape", [(0, 5), (3, 0)])
def test_zero_size(shape):
    fn = lambda x: torch.softmax(x * 2, dim=-1) + 1
    compiled, _ = _mirage(fn)
    x = torch.randn(shape)
    out = compiled(x)
    assert out.shape == fn(x).shape


def test_non_contiguous_inputs():
    fn = lambda x, y: torch.exp(x) + y.sum(-1, keepdim=True)
    compiled, _ = _mirage(fn)
    x = torch.randn(7, 12).t()           # transposed
    y = torch.randn(12, 14)[:, ::2]       # strided slice
    assert_close(compiled(x, y), fn(x, y))


def test_unsupported_ops_run_correctly():
    fn = lambda x: torch.sort(torch.cumsum(x, 0), dim=-1).values + torch.topk(x, 2).values.sum()
    compiled, report = _mirage(fn)
    x = torch.randn(5, 6)
    assert_close(compiled(x), fn(x))
    assert any(r.reason is Reason.OPAQUE_OP for r in report.regions)


class _ExplodingClaimer:
    name = "exploding"

    def claim(self, graph, free, ctx):
        raise RuntimeError("boom in a claiming pass")


def test_internal_error_falls_back_and_logs_once(caplog):
    report = torch_mirage.Report()
    backend = torch_mirage.MirageBackend(report=report, claimers=[_ExplodingClaimer()])
    fn = lambda x: torch.tanh(x) * x
    compiled = torch.compile(fn, backend=backend)
    x = torch.randn(4, 4)
    with caplog.at_level(logging.WARNING, logger="torch_mirage"):
        assert_close(compiled(x), fn(x))
        assert_close(compiled(x), fn(x))
    warnings = [r for r in caplog.records if "boom in a claiming pass" in r.getMessage()]
    assert len(warnings) == 1
    assert "aten.tanh" in warnings[0].getMessage() and "float32[4, 4]" in warnings[0].getMessage()
    assert report.graphs[0].fallback_error and report.regions[0].compiled_by == "inductor"


def test_strict_mode_raises():
    backend = torch_mirage.MirageBackend(options={"strict": True}, claimers=[_ExplodingClaimer()])
    compiled = torch.compile(lambda x: torch.tanh(x) * x, backend=backend)
    with pytest.raises(Exception, match="boom in a claiming pass"):
        compiled(torch.randn(4, 4))


def test_inductor_failure_falls_back_to_eager(monkeypatch):
    import torch.fx.passes.regional_inductor as ri

    def broken(*args, **kwargs):
        raise RuntimeError("inductor broke")
    import torch._inductor.compile_fx as cfx
    monkeypatch.setattr(ri, "regional_inductor", broken)
    monkeypatch.setattr(cfx, "compile_fx", broken)
    compiled, report = _mirage(lambda x: torch.cos(x) + 1)
    x = torch.randn(3)
    assert_close(compiled(x), torch.cos(x) + 1)
    assert report.regions[0].compiled_by == "eager"


class _EagerClaimer:
    """Claims every elementwise node and runs it through the node's own ATen op: exercises assembly."""
    name = "test-eager"

    def claim(self, graph, free, ctx):
        from torch_mirage.capture.ir import map_values
        from torch_mirage.capture.ops import OpKind
        claims = []
        for node in free:
            if node.kind is not OpKind.ELEMENTWISE or len(node.outputs) != 1:
                continue
            inputs = inputs_of([node])

            def kernel(*tensors, node=node, inputs=inputs):
                env = {id(v): t for v, t in zip(inputs, tensors)}
                args, kwargs = map_values((node.args, node.kwargs), lambda v: env[id(v)])
                return (node.target(*args, **kwargs),)
            claims.append(Claim([node], ReadyKernel(kernel), "test claimer"))
        return claims


def test_claimed_regions_are_assembled_between_inductor_regions():
    def fn(x, w):
        h = x @ w
        a = torch.exp(h) * 0.5          # claimed
        b, c = torch.var_mean(a, -1, keepdim=True)   # inductor
        return (a - c) / (b + 1).sqrt(), c
    report = torch_mirage.Report()
    compiled = torch.compile(fn, backend=torch_mirage.MirageBackend(report=report, claimers=[_EagerClaimer()]))
    x, w = torch.randn(5, 8), torch.randn(8, 6)
    assert_close(compiled(x, w), fn(x, w))
    by = {r.compiled_by for r in report.regions}
    assert by == {"mirage", "inductor"}
    assert all(r.claimer == "test-eager" for r in report.regions if r.compiled_by == "mirage")


class _WrongClaimer(_EagerClaimer):
    """Claims like _EagerClaimer but its exp kernel is off by a little: the compile-time check must catch it."""
    name = "wrong"

    def claim(self, graph, free, ctx):
        claims = super().claim(graph, free, ctx)
        for claim in claims:
            if claim.nodes[0].op.name == "exp":
                good = claim.plan.kernel
                claim.plan = ReadyKernel(lambda *t, good=good: tuple(o * 1.01 for o in good(*t)))
        return claims


def _assert_wrong_exp_kernel_handed_back(fn):
    """Compile ``fn`` with :class:`_WrongClaimer`: the result is eager's and its exp region went back."""
    report = torch_mirage.Report()
    compiled = torch.compile(fn, backend=torch_mirage.MirageBackend(report=report, claimers=[_WrongClaimer()]))
    x = torch.randn(64, 64)
    assert_close(compiled(x), fn(x))
    exp_region = next(r for r in report.regions if any("exp" in op for op in r.ops))
    assert exp_region.compiled_by == "inductor" and "relative error" in exp_region.detail
    return report


def test_wrong_kernel_is_caught_at_compile_time_and_handed_back():
    report = _assert_wrong_exp_kernel_handed_back(lambda x: torch.exp(x) * 3)
    assert any(r.compiled_by == "mirage" for r in report.regions)   # the correct mul kernel stays


def test_strict_mode_raises_on_a_wrong_kernel():
    backend = torch_mirage.MirageBackend(options={"strict": True}, claimers=[_WrongClaimer()])
    with pytest.raises(Exception, match="relative error"):
        torch.compile(lambda x: torch.exp(x) * 3, backend=backend)(torch.randn(8, 8))


def test_mutated_inputs_are_found_through_views():
    from torch_mirage.runtime.choose import mutated_inputs
    from torch_mirage.testing.aten import trace_aten

    def writes(x, cache, pos, y):
        cache[:, 0].index_copy_(0, pos, y)   # through a view of the cache
        x.add_(1)
        return (cache * 2).sum(-1)

    def pure(x, cache, pos, y):
        return (cache * x.sum()).sum(-1) + y.sum()

    inputs = (torch.randn(3), torch.randn(8, 2, 4), torch.tensor([1, 5]), torch.randn(2, 4))
    gm = trace_aten(writes, *inputs)   # Dynamo orders a graph's inputs by first use: find them by shape
    shapes = [tuple(n.meta["val"].shape) for n in gm.graph.nodes if n.op == "placeholder"]
    assert sorted(shapes[i] for i in mutated_inputs(gm)) == [(3,), (8, 2, 4)]
    assert mutated_inputs(trace_aten(pure, *inputs)) == ()


def _write_back_graph(blocker: str | None):
    import torch.fx as fx

    g = fx.Graph()
    cache, idx, v = g.placeholder("cache"), g.placeholder("idx"), g.placeholder("v")
    new = g.call_function(torch.ops.aten.index_put.default, (cache, [idx], v))
    out = g.call_function(torch.ops.aten.mul.Tensor, (new, 2))
    if blocker == "old value read":   # after the update: an in-place update would change what it sees
        out = g.call_function(torch.ops.aten.add.Tensor, (out, g.call_function(torch.ops.aten.sum.default, (cache,))))
    g.call_function(torch.ops.aten.copy_.default, (cache, new))
    if blocker == "returned as a view":   # made in place, the caller would get the cache itself
        g.output((out, g.call_function(torch.ops.aten.view.default, (new, [24]))))
    else:
        g.output((out,))
    return g


@pytest.mark.parametrize("blocker", [None, "old value read", "returned as a view"])
def test_kv_cache_write_back_becomes_an_in_place_update(blocker):
    """copy_(cache, index_put(cache, ...)) → index_put_(cache, ...) where nothing else reads the cache and the
    update is not returned; the graph computes the same result and leaves the cache in the same state."""
    import torch.fx as fx

    from torch_mirage.runtime.assemble import reinplace_write_backs

    g = _write_back_graph(blocker)
    assert reinplace_write_backs(g) == (0 if blocker else 1)
    targets = [n.target for n in g.nodes if n.op == "call_function"]
    assert (torch.ops.aten.copy_.default in targets) == bool(blocker)
    assert (torch.ops.aten.index_put_.default in targets) != bool(blocker)
    cache, idx, v = torch.randn(6, 4), torch.tensor([1, 4]), torch.randn(2, 4)
    before = cache.clone()
    out = fx.GraphModule(torch.nn.Module(), g)(cache, idx, v)
    want = before.index_put([idx], v)
    assert torch.equal(cache, want)
    assert_close(out[0], want * 2 + (before.sum() if blocker == "old value read" else 0))
    if blocker == "returned as a view":
        assert out[1].data_ptr() != cache.data_ptr() and torch.equal(out[1], want.view(24))


def test_static_cache_update_next_to_a_mirage_region(monkeypatch):
    """A decode step's shape: a cache buffer updated in place at a position, read by a region mirage claims;
    outputs and cache match eager over several steps, and the cache is written in place, not copied."""
    import torch_mirage.runtime.assemble as assemble

    rewritten = []
    real = assemble.reinplace_write_backs
    monkeypatch.setattr(assemble, "reinplace_write_backs", lambda g: rewritten.append(real(g)) or rewritten[-1])

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cache", torch.zeros(16, 32))

        def forward(self, x, pos):
            self.cache.index_copy_(0, pos, x)
            return torch.softmax(self.cache * 2, dim=-1) @ self.cache.t()

    eager, model = Step(), Step()
    report = torch_mirage.Report()
    compiled = torch.compile(model, backend=torch_mirage.MirageBackend(report=report))
    for step in range(3):
        x, pos = torch.randn(2, 32), torch.tensor([2 * step, 2 * step + 1])
        assert_close(compiled(x, pos), eager(x, pos))
        assert torch.equal(model.cache, eager.cache)
    assert any(r.compiled_by == "mirage" for r in report.regions), str(report)
    assert rewritten == [1], rewritten


def test_attention_without_dropout_does_not_count_as_random():
    """SDPA is tagged as seeded for its dropout: at dropout_p = 0 a graph using it may still be timed."""
    from torch_mirage.runtime.choose import draws_random_numbers
    from torch_mirage.testing.aten import trace_aten

    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))

    def seeded(fn):
        return [draws_random_numbers(n) for n in trace_aten(fn, q, k, v).graph.nodes if draws_random_numbers(n)]

    attention = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True) * 2
    assert seeded(attention) == []
    dropout = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.25) * 2
    noisy = lambda q, k, v: (q + torch.rand_like(q)) * k * v
    assert seeded(dropout) and seeded(noisy)


def test_fp32_kernel_over_fp16_intermediates_is_not_handed_back():
    """Eager rounds x + 1 to fp16 before the fp32 softmax; the kernel does not. The check compares both with
    float64, so the (more accurate) kernel is kept and the result stays close to float64."""
    def fn(x, bias):
        return torch.softmax((x + 1).float() + bias, dim=-1) * 2

    compiled, report = _mirage(fn)
    x, bias = torch.randn(64, 384, dtype=torch.float16) * 30, torch.randn(384)
    out = compiled(x, bias)
    assert [r.compiled_by for r in report.regions] == ["mirage"], str(report)
    assert_close(out, fn(x.double(), bias.double()).float(), torch.float16)


def test_in_place_ops_are_seen_in_dynamo_graphs():
    from torch_mirage.runtime.choose import writes_in_place

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def fns():
        yield lambda x, c: (c.add_(x), x * 2)[1], True
        yield lambda x, c: c.__setitem__(0, x[0]) or x * 2, True
        yield lambda x, c: torch.add(x, 1, out=c) * 2, True
        yield lambda x, c: (c * x).softmax(-1), False

    for fn, writes in fns():
        torch._dynamo.reset()
        graphs.clear()
        torch.compile(fn, backend=keep, fullgraph=True)(torch.randn(4, 4), torch.randn(4, 4))
        assert writes_in_place(graphs[0]) is writes, graphs[0].code


def test_mutation_of_a_value_mirage_computes_keeps_the_region():
    """x.add_(1) computed inside a mirage region: the copy back into x runs after the region, no fallback."""
    def fn(x, bias):
        x.add_(1)
        return torch.softmax(x + bias, dim=-1) * 2

    compiled, report = _mirage(fn)
    x, bias = torch.randn(64, 96), torch.randn(96)
    x0 = x.clone()
    out = compiled(x, bias)
    assert_close(x, x0 + 1)
    assert_close(out, fn(x0.clone().double(), bias.double()).float())
    g = report.graphs[0]
    assert g.fallback_error is None and g.mutated_inputs and any(r.compiled_by == "mirage" for r in g.regions), str(report)


def test_groups_below_the_region_threshold_are_named_in_the_report():
    compiled, report = _mirage(lambda x: torch.softmax(x * 2, dim=-1), min_region_us=1000.0)
    x = torch.randn(8, 32)
    assert_close(compiled(x), torch.softmax(x.double() * 2, dim=-1).float())
    (region,) = report.regions
    assert region.compiled_by == "inductor" and "MIRAGE_MIN_REGION_US" in region.detail, str(report)


def test_inductor_artifact_warning_is_filtered_only_while_we_compile(caplog):
    """standalone_compile's 'cannot save' warning (seen on the H100 logs) is dropped inside our calls only."""
    import logging

    from torch_mirage.runtime.inductor_quiet import without_artifact_warning

    logger = logging.getLogger("torch._inductor.standalone_compile")
    spurious = "standalone_compile artifact generation failed, cannot save. Run with TORCH_LOGS=..."
    with caplog.at_level(logging.WARNING, logger=logger.name):
        with without_artifact_warning():
            logger.warning(spurious)
            logger.warning("a real Inductor problem")
        logger.warning(spurious)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["a real Inductor problem", spurious]


def test_rotated_input_sets_copy_only_what_l2_needs():
    from torch_mirage.timing import rotated_input_sets

    x, y = torch.randn(256), torch.randn(256)           # 2 KiB a set against a 64 KiB "L2": 96 sets, capped
    sets = rotated_input_sets([x, y, 3], l2_bytes=64 * 1024, max_sets=8)
    assert len(sets) == 8 and all(s[2] == 3 for s in sets)
    assert len({s[0].data_ptr() for s in sets}) == 8 and all(torch.equal(s[0], x) for s in sets)
    big = torch.randn(64 * 1024)                         # 256 KiB: past 3x L2 alone, used as it is
    (only,) = rotated_input_sets([big], l2_bytes=64 * 1024)
    assert only[0] is big


def test_rotated_input_sets_keep_strides_inductor_checks():
    """Copies keep each tensor's sizes and strides (a mask expanded over the batch, stride 0; a slice with gaps):
    Inductor's version of a region, compiled for those strides, runs on every set (it raised AssertionError on
    contiguous copies of a b8 decode attention region's mask)."""
    from torch._inductor import standalone_compile
    from torch_mirage.timing import rotated_input_sets

    mask = (torch.rand(1, 1, 1, 64) > 0.5).expand(8, 1, 1, 64)
    x = torch.randn(8, 4, 1, 80)[..., 8:72]                       # a slice: strides with a gap
    sets = rotated_input_sets([mask, x], l2_bytes=64 * 1024, max_sets=3)
    assert len(sets) == 3
    for m, y in sets:
        assert m.stride() == mask.stride() and y.stride() == x.stride()
        assert torch.equal(m, mask) and torch.equal(y, x) and y.data_ptr() != x.data_ptr()

    def fn(m, y):
        return torch.where(m, y, 0.0).sum(-1)
    compiled = standalone_compile(torch.fx.symbolic_trace(fn), [mask, x], dynamic_shapes="from_example_inputs")
    for m, y in sets:   # fp32 sums of 64 terms in another order: absolute error ~1e-6 where a sum is near 0
        torch.testing.assert_close(compiled(m, y), fn(mask, x), rtol=1e-5, atol=1e-5)


def test_timing_input_sets_copy_only_what_a_copy_keeps_the_same():
    """A caller's arguments are rotated only when copies are the same input: dense, unaliased tensors."""
    from torch_mirage.timing import timing_input_sets

    x, w = torch.randn(64, 8), torch.randn(8, 16).t()    # a transposed weight keeps its strides in the copies
    sets = timing_input_sets([x, w, 2.0], l2_bytes=4 * 1024)
    assert len(sets) > 1 and all(s[1].stride() == w.stride() and torch.equal(s[1], w) for s in sets)
    for shared in ([x, x[1:]], [torch.randn(8, 1).expand(8, 16)]):   # aliased, overlapping: as they are
        (only,) = timing_input_sets(shared, l2_bytes=4 * 1024)
        assert all(a is b for a, b in zip(only, shared))


def test_alternating_times_order_and_failures():
    """A B C C B A; a candidate whose timing raises is dropped and reported, or its error propagates."""
    from torch_mirage.timing import alternating_times

    order, errors = [], []

    def half(name):
        order.append(name)
        if name == "c":
            raise RuntimeError("not capturable")
        return [len(order) + {"a": 0.0, "b": 10.0}[name]]

    times = alternating_times(["a", "b", "c"], half, on_error=lambda n, e: errors.append((n, str(e))))
    assert order == ["a", "b", "c", "b", "a"] and errors == [("c", "not capturable")]
    assert times == {"a": 3.0, "b": 13.0}
    with pytest.raises(RuntimeError, match="not capturable"):
        alternating_times(["a", "c"], half)


def test_a_hopeless_candidate_is_timed_once():
    """Tuning: a candidate whose first half is more than ``HOPELESS`` times the fastest first half gets no second
    half (its time is its first's); one within that factor, and every candidate of a call without ``hopeless``
    (the bench), is timed twice. Through :func:`tune` the hopeless one is still reported, and never chosen."""
    from torch_mirage.timing import HOPELESS, alternating_times
    from torch_mirage.tune import tune

    speed = {"fast": 10.0, "close": 10.0 * HOPELESS * 0.9, "slow": 10.0 * HOPELESS * 1.1}
    order = []

    def half(name):
        order.append(name)
        return [speed[name] + 0.1 * len(order), speed[name]]

    times = alternating_times(list(speed), half, hopeless=HOPELESS)
    assert order == ["fast", "close", "slow", "close", "fast"], order
    assert set(times) == set(speed) and min(times, key=times.get) == "fast"
    order.clear()
    assert set(alternating_times(list(speed), half)) == set(speed) and len(order) == 6
    order.clear()
    got = tune(["slow", "fast"], lambda name, built: half(name))
    assert order == ["slow", "fast", "fast"] and got.winner == "fast" and set(got.times) == {"slow", "fast"}


def test_a_slow_call_is_replayed_fewer_times():
    """A fixed replay count holds for µs-long calls; a replay long enough that the count would run past
    ``REPEAT_MS`` a repeat is replayed fewer times (one at least), so a hopeless tuning candidate costs a fraction
    of a second, not seconds."""
    from torch_mirage.timing import REPEAT_MS, replays_within

    assert replays_within(10, 0.05) == 10                       # 16 sets of a 3 µs kernel: unchanged
    assert replays_within(10, REPEAT_MS / 4) == 4
    assert replays_within(10, 208.0) == 1                       # 16 sets of 13 ms: one replay a repeat
    assert replays_within(20, 0.0) == 20 and replays_within(1, 1e9) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_slow_calls_are_timed_within_the_repeat_bound():
    """A call of more than 20 ms replayed in a CUDA graph: asked for 10 replays a repeat, it gets at most four
    (the bound is 100 ms; the count comes from one replay of its own, timed apart from the test's)."""
    from torch_mirage.timing import cuda_graph_timing

    a = torch.randn(4096, 4096, device="cuda")

    def slow(x):
        for _ in range(40):
            x = x @ a
        return x

    one = cuda_graph_timing(slow, [[a]], replays=1, repeats=1)["us"] / 1e3
    got = cuda_graph_timing(slow, [[a]], replays=10, repeats=2)
    assert one > 20 and 1 <= got["replays"] <= 4, (one, got)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_timing_and_captures_leave_no_cublas_workspace_per_run():
    """Forty timings and captures of a matmul leave at most two cuBLAS workspaces behind (the side stream's and the
    capture stream's), not one for every stream of the pool that ``torch.cuda.Stream()`` hands out in turn."""
    from torch_mirage.runtime.cudagraph import CudaGraphRunner
    from torch_mirage.timing import cuda_graph_timing, side_stream

    a = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16)
    mm = lambda x: x @ x   # noqa: E731
    cuda_graph_timing(mm, [[a]], replays=1, repeats=1)      # the side stream's and capture stream's workspaces
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(20):
        cuda_graph_timing(mm, [[a]], replays=1, repeats=1)
        runner = CudaGraphRunner(lambda args: [mm(args[0])], static_input_indices=(), warmup=1)
        runner([a])
        del runner
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    assert side_stream() is side_stream(torch.device("cuda"))
    assert grown < 1 << 20, f"{grown / 2 ** 20:.1f} MiB more allocated after 40 runs"


def test_mirage_warms_up_on_one_side_stream_only():
    """Every warm-up before a capture runs on :func:`~torch_mirage.timing.side_stream`: no module of the package
    makes a stream of its own (each fresh one costs a cuBLAS workspace for the life of the process)."""
    import pathlib
    import re

    root = pathlib.Path(torch_mirage.__file__).parent
    fresh = [str(f.relative_to(root)) for f in root.rglob("*.py")
             if re.search(r"torch\.cuda\.Stream\(", f.read_text()) and f.name != "timing.py"]
    assert not fresh, f"modules making their own CUDA streams: {fresh}"


def test_host_launched_times_drop_host_noise_and_keep_the_drift_balance():
    """Launched from Python, a candidate's time is the mean of each half's fastest sample: a spike the host adds
    to a few samples (another process, a collection) changes nothing, and the A B B A halves still cancel a
    steady drift (the fastest of all samples would favour whichever is timed first)."""
    from torch_mirage.timing import alternating_times, fastest_per_half, pooled_median

    calls = []

    def half(name, spikes):
        calls.append(name)
        drift = 2.0 * len(calls)                       # the GPU slows down as it is timed
        return [100.0 + drift + (80.0 if i in spikes.get((name, len(calls)), ()) else 0.0) for i in range(5)]

    noisy = {("a", 1): (0, 1, 2), ("a", 4): (3,)}      # three of a's first five samples hit by the host
    times = alternating_times(["a", "b"], lambda n: half(n, noisy), estimate=fastest_per_half)
    assert times == {"a": 105.0, "b": 105.0}
    calls.clear()
    medians = alternating_times(["a", "b"], lambda n: half(n, noisy), estimate=pooled_median)
    assert medians["a"] > medians["b"]                 # the median of the samples sees the spikes
    assert fastest_per_half([[3.0, 1.0], [], [5.0]]) == 3.0


@pytest.mark.parametrize("in_callers_graph", [False, True])
def test_faster_of_times_in_a_b_b_a_order(monkeypatch, in_callers_graph):
    """With the GPU slowing down as it is timed, two equally fast candidates come out equal (timed one after
    the other, the second would look slower), and the faster of two different ones is kept."""
    import torch_mirage.runtime.choose as choose

    base = {"mirage": 100.0, "inductor": 100.0}
    order: list[str] = []

    def fake_timing(fn, inputs, target_ms, repeats):   # 1 µs slower on each run: drift
        name = fn(*(inputs[0] if in_callers_graph else inputs))
        order.append(name)
        drift = float(len(order))
        return {"samples": [base[name] + drift] * repeats}

    monkeypatch.setattr(choose, "plain_timing", fake_timing)
    monkeypatch.setattr(choose, "cuda_graph_timing", fake_timing)
    monkeypatch.setattr(choose, "timing_input_sets", lambda args, l2: [list(args)])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"L2_cache_size": 1})())
    seen = {}
    candidates = {name: (lambda name=name: (lambda *a: name))() for name in base}
    chooser = choose.FasterOf(dict(candidates), lambda c, times: seen.update(times, choice=c),
                              in_callers_graph=in_callers_graph)
    chooser(torch.ones(1))
    assert order == ["mirage", "inductor", "inductor", "mirage"] and seen["mirage"] == seen["inductor"]
    base["inductor"] = 99.0
    order.clear()
    graph_report = GraphReport(0, "inference")
    chooser = choose.FasterOf(dict(candidates), lambda c, times: seen.update(times, choice=c),
                              in_callers_graph=in_callers_graph, stage=graph_report.stage)
    assert chooser(torch.ones(1)) == "inductor" and seen["choice"] == "inductor"
    assert list(chooser.candidates) == ["inductor"]
    assert list(graph_report.stage_times_ms) == ["first-call timing"]   # the first call's timing is reported
    chooser(torch.ones(1))
    assert graph_report.stage_times_ms.keys() == {"first-call timing"}   # and only the first call's


def test_stages_report_how_far_they_raised_the_gpu_memory_peak(monkeypatch):
    """Each stage records how far it raised the process's peak of allocated GPU memory (where CUDA is in use),
    and the report prints the rises; without CUDA nothing is recorded."""
    import torch_mirage.report as report_mod

    peaks = iter([100.0, 100.0, 100.0, 612.0, 612.0, 600.0])
    monkeypatch.setattr(report_mod, "gpu_peak_mib", lambda: next(peaks))
    r = GraphReport(0, "inference")
    for stage in ("partition", "build", "check"):
        with r.stage(stage):
            pass
    assert r.stage_peak_rise_mib == {"partition": 0.0, "build": 512.0, "check": 0.0}
    assert "build" in str(r) and "GPU peak +512 MiB" in str(r) and "+0 MiB" not in str(r)
    monkeypatch.setattr(report_mod, "gpu_peak_mib", lambda: None)
    r = GraphReport(1, "inference")
    with r.stage("build"):
        pass
    assert r.stage_peak_rise_mib == {} and "build" in r.stage_times_ms


@pytest.mark.parametrize("chunk", [7, 1 << 22])
def test_numerics_check_in_chunks_matches_whole(monkeypatch, chunk):
    """The compile-time check compares large outputs a chunk at a time; the verdicts do not depend on it."""
    import torch_mirage.numerics as numerics
    from torch_mirage.numerics import relative_error, same_non_finite

    monkeypatch.setattr(numerics, "_CHUNK", chunk)
    want = torch.randn(13, 17)
    want[2, 3], want[5, 0], want[7, 7] = float("nan"), float("inf"), float("-inf")
    got = want + 1e-3 * torch.randn(13, 17)
    assert same_non_finite(got, want)
    finite = torch.isfinite(want)
    whole = (got[finite].double() - want[finite].double()).norm() / want[finite].double().norm()
    assert abs(relative_error(got, want, where=want) - whole.item()) <= 1e-12
    largest = (got[finite].double() - want[finite].double()).abs().max() / want[finite].double().abs().max()
    assert abs(relative_error(got, want, where=want, norm="max") - largest.item()) <= 1e-12
    flipped = got.clone()
    flipped[7, 7] = float("inf")
    assert not same_non_finite(flipped, want)
    moved = got.clone()
    moved[2, 3], moved[2, 4] = 0.0, float("nan")
    assert not same_non_finite(moved, want)
    # end to end: the wrong exp kernel is still caught with tiny chunks
    _assert_wrong_exp_kernel_handed_back(lambda x: torch.exp(x) * 2)


class _DispatchRecorder(_EagerClaimer):
    """Claims like _EagerClaimer and records whether the Python dispatcher was on when it claimed and when its
    kernel ran in the check stage."""
    name = "dispatch"

    def __init__(self):
        self.seen = []

    def claim(self, graph, free, ctx):
        key = torch._C.DispatchKey.PythonDispatcher
        self.seen.append(("claim", torch._C._dispatch_tls_is_dispatch_key_included(key)))
        return super().claim(graph, free, ctx)


def test_own_stages_run_without_the_python_dispatcher():
    """AOTAutograd calls the compiler with its Python dispatcher on (every composite op through a Python
    decomposition, ~3x the host time of a small op); the partition, build and check stages turn it off."""
    from torch._dispatch.python import enable_python_dispatcher

    recorder = _DispatchRecorder()
    fn = lambda x: torch.exp(x) * 0.5                               # noqa: E731
    compiled = torch.compile(fn, backend=torch_mirage.MirageBackend(claimers=[recorder]))
    x = torch.randn(4, 8)
    with enable_python_dispatcher():                                # on around the compile, as AOTAutograd's is
        assert_close(compiled(x), fn(x))
    assert recorder.seen == [("claim", False)]


def test_the_whole_graph_verdict_key_names_the_graph_what_mirage_built_and_the_knobs():
    """The whole-graph verdict's cache key (backend.whole_graph_key): the same graph, inputs, regions and knobs
    give the same key; another input shape, another tuned launch or another knob that changes what runs give
    another; a region's own timing (which varies run to run) does not enter it."""
    from torch_mirage import config
    from torch_mirage.backend import whole_graph_key
    from torch_mirage.report import GraphReport, RegionReport

    gm = torch.fx.symbolic_trace(lambda x: torch.softmax(x, -1) * 2)

    def report(launch, mirage_us=10.0):
        r = GraphReport(0, "inference")
        r.regions = [RegionReport(["aten.softmax"], "mirage", Reason.CLAIMED, claimer="stitch",
                                  info={"launch": launch, "mirage_us": mirage_us}),
                     RegionReport(["aten.mul"], "inductor", Reason.NOT_CLAIMED)]
        return r
    cfg = config.load({})
    x = torch.randn(8, 16)
    key = whole_graph_key(gm, [x], cfg, report([{"grid": [8]}]))
    assert key == whole_graph_key(gm, [torch.randn(8, 16)], cfg, report([{"grid": [8]}], mirage_us=12.5))
    assert key != whole_graph_key(gm, [torch.randn(8, 32)], cfg, report([{"grid": [8]}]))
    assert key != whole_graph_key(gm, [x], cfg, report([{"grid": [4]}]))
    assert key != whole_graph_key(gm, [x], config.load({"stitch": False}), report([{"grid": [8]}]))
    assert key == whole_graph_key(gm, [x], config.load({"log_level": "INFO"}), report([{"grid": [8]}]))
    against_symbolic = report([{"grid": [8]}])        # a static compile timed against the symbolic graph's compile
    against_symbolic.choice_against = "the graph at symbolic sizes"
    assert key != whole_graph_key(gm, [x], cfg, against_symbolic)
