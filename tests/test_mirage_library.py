"""The hand-built Mirage set: the reference executor, run block by block and
iteration by iteration, equals each PyTorch program on odd shapes."""
import math

import pytest
import torch

from torch_mirage.superopt import builder, executor, library, validate
from torch_mirage.superopt.arith import TorchArith

# odd / non-power-of-two shapes and the schedules that split them
CASES = {
    "rmsnorm_linear": [((3, 15, 21), dict(grid=3, forloop_range=5)), ((5, 9, 14), dict(grid=7, forloop_range=3)),
                       ((1, 6, 10), dict(grid=1, forloop_range=1))],
    "gated_mlp": [((3, 15, 21), dict(grid=3, forloop_range=5)), ((7, 6, 10), dict(grid=5, forloop_range=2))],
    "lora": [((3, 15, 21, 5), dict(grid=3, forloop_range=5)), ((6, 10, 9, 1), dict(grid=9, forloop_range=2))],
    "gqa_flashdecoding": [((2, 3, 5, 12, 7), dict(splits=3, forloop_range=2)),
                          ((1, 1, 3, 15, 5), dict(splits=5, forloop_range=3))],
    "gqa_flashattention": [((2, 3, 6, 15, 7), dict(q_blocks=3, forloop_range=5)),
                           ((1, 2, 5, 9, 3), dict(q_blocks=1, forloop_range=9))],
    "qknorm_attention": [((2, 3, 6, 15, 7), dict(q_blocks=2, forloop_range=3)),
                         ((1, 1, 5, 10, 6), dict(q_blocks=5, forloop_range=2))],
    "ntrans": [((6, 9), dict(grid=3)), ((5, 12), dict(grid=5))],
}
PARAMS = [(n, dims, sched) for n, cases in CASES.items() for dims, sched in cases]
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.float64: dict(rtol=1e-11, atol=1e-11)}
DTYPES = {torch.float32: "float32", torch.float64: "float64"}


def _inputs(name, dims, dtype, gen):
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype)
            for s in library.WORKLOADS[name].input_shapes(*dims)]


def _check(name, dims, sched, dtype, graph_fn=None, seed=0):
    w = library.WORKLOADS[name]
    g = (graph_fn or w.build)(*dims, dtype=DTYPES[dtype], **sched)
    validate.validate(g)
    gen = torch.Generator().manual_seed(seed)
    xs = _inputs(name, dims, dtype, gen)
    (got,) = executor.execute(g, xs)
    want = w.reference(*[x.double() for x in xs])
    return got, want


def test_every_workload_has_cases():
    assert set(CASES) == set(library.WORKLOADS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("name,dims,sched", PARAMS, ids=[f"{n}-{'x'.join(map(str, d))}" for n, d, _ in PARAMS])
def test_executor_matches_reference(name, dims, sched, dtype):
    got, want = _check(name, dims, sched, dtype, seed=hash((name, dims)) % 1000)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, **TOL[dtype])


@pytest.mark.parametrize("name,dims,sched", PARAMS[::2], ids=[f"{n}-{'x'.join(map(str, d))}" for n, d, _ in PARAMS[::2]])
def test_thread_fused_graph_matches_reference(name, dims, sched):
    def fused(*a, **k):
        return builder.fuse_thread_graphs(library.WORKLOADS[name].build(*a, **k))
    got, want = _check(name, dims, sched, torch.float64, graph_fn=fused, seed=7)
    torch.testing.assert_close(got, want, **TOL[torch.float64])


def test_every_rmsnorm_linear_schedule_matches():
    m, k, n = 2, 12, 15
    for grid in (1, 3, 5, 15):
        for rng in (1, 2, 3, 4, 6, 12):
            got, want = _check("rmsnorm_linear", (m, k, n), dict(grid=grid, forloop_range=rng), torch.float64)
            torch.testing.assert_close(got, want, **TOL[torch.float64])


def test_eps_is_honoured():
    w = library.WORKLOADS["rmsnorm_linear"]
    xs = [torch.randn(s, dtype=torch.float64) * 1e-3 for s in w.input_shapes(3, 6, 4)]
    for eps in (0.0, 1e-5):
        (got,) = executor.execute(library.rmsnorm_linear(3, 6, 4, dtype="float64", eps=eps, tile=3), xs)
        torch.testing.assert_close(got, library.rmsnorm_linear_ref(*xs, eps=eps))
    hs = [torch.randn(4, 6, dtype=torch.float64) * 1e-3 for _ in range(3)]
    for eps in (0.0, 1e-5):
        (got,) = executor.execute(library.ntrans(4, 6, dtype="float64", eps=eps, grid=2), hs)
        torch.testing.assert_close(got, library.ntrans_ref(*hs, eps=eps))


def test_online_softmax_survives_large_scores():
    """Scores around ±3000 overflow exp without the running max; the rescaling accumulator copes."""
    dims = (1, 2, 4, 12, 5)
    g = library.gqa_flashattention(*dims, dtype="float32", q_blocks=2, forloop_range=4)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(s, generator=gen) for s in library.WORKLOADS["gqa_flashattention"].input_shapes(*dims))
    q = q * 300
    (got,) = executor.execute(g, [q, k, v])
    want = library.attention_ref(q.double(), k.double(), v.double())
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    dec = library.gqa_flashdecoding(*dims, dtype="float32", splits=3, forloop_range=2)
    torch.testing.assert_close(executor.execute(dec, [q, k, v])[0].double(), want, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ broken partitions are caught
def test_off_by_one_tile_is_caught(monkeypatch):
    name, dims, sched = "gated_mlp", (3, 15, 21), dict(grid=3, forloop_range=5)
    got, want = _check(name, dims, sched, torch.float64)
    torch.testing.assert_close(got, want)
    real = executor.tile_slices

    def shifted(full, imap, fmap, grid, block, rng, it):
        idx = list(real(full, imap, fmap, grid, block, rng, it))
        if fmap is not None and it == rng - 1:          # last k tile starts one row early
            s = idx[fmap]
            idx[fmap] = slice(s.start - 1, s.stop - 1)
        return tuple(idx)

    monkeypatch.setattr(executor, "tile_slices", shifted)
    got, want = _check(name, dims, sched, torch.float64)
    assert not torch.allclose(got, want, rtol=1e-3, atol=1e-3)


def test_wrong_partition_graph_is_caught():
    """W3 partitioned along its rows instead of its columns: valid shapes, wrong program."""
    m, k, n = 3, 12, 12
    g = builder.new_kernel_graph()
    X, W1, W3 = g.new_input((m, k), "float64"), g.new_input((k, n), "float64"), g.new_input((k, n), "float64")
    tb = builder.new_threadblock_graph((3,), 3)
    tX = tb.new_input(X, imap=(None,), fmap=1)
    tW1 = tb.new_input(W1, imap=(1,), fmap=0)
    tW3 = tb.new_input(W3, imap=(0,), fmap=1)
    acc1 = tb.forloop_accum(tb.matmul(tX, tW1), "sum")
    acc3 = tb.forloop_accum(tb.matmul(tX, tW3), "sum")
    tb.new_output(tb.mul(tb.silu(acc1), acc3), omap=(1,))
    (Y,) = g.customized([X, W1, W3], tb)
    g.mark_output(Y)
    graph = g.build()
    validate.validate(graph)
    xs = [torch.randn(s, dtype=torch.float64) for s in ((m, k), (k, n), (k, n))]
    (got,) = executor.execute(graph, xs)
    assert not torch.allclose(got, library.gated_mlp_ref(*xs), rtol=1e-3, atol=1e-3)


def test_executor_does_all_arithmetic_through_arith():
    """A recording Arith sees every op: no tile arithmetic bypasses it."""
    class Counting(TorchArith):
        def __init__(self):
            self.calls = {}

        def __getattribute__(self, item):
            attr = object.__getattribute__(self, item)
            if callable(attr) and not item.startswith("_") and item not in ("calls",):
                calls = object.__getattribute__(self, "calls")
                calls[item] = calls.get(item, 0) + 1
            return attr

    a = Counting()
    g = library.gqa_flashattention(1, 1, 2, 6, 3, dtype="float64", q_blocks=1, forloop_range=3)
    xs = [torch.randn(s, dtype=torch.float64) for s in library.WORKLOADS["gqa_flashattention"].input_shapes(1, 1, 2, 6, 3)]
    (got,) = executor.execute(g, xs, arith=a)
    torch.testing.assert_close(got, library.attention_ref(*xs))
    assert a.calls["acc_online_softmax"] == 3 and a.calls["acc_online_softmax_final"] == 1
    assert a.calls["matmul"] == 3 + 3 and a.calls["exp"] >= 3 and a.calls["zeros"] == 1
    assert math.isclose(a.calls["scalar_mul"], 3)


@pytest.mark.parametrize("extent,tile,want", [(256, 64, 4), (100, 64, 2), (5, 64, 1), (67, 64, 1), (134, 64, 2),
                                              (131, 64, 131), (201, 64, 3), (12, 4, 3), (16, 4, 4)])
def test_tiles_walk_a_length_without_a_short_divisor_in_whole_tiles(extent, tile, want):
    """A length whose divisors up to ``tile`` are all shorter than tl.dot's 16 (67, a prime) is walked in one
    padded tile of 67 (two of 67 for 134, three for 201), not 67 one-key steps; 131 has no such tile within
    2·64 and stays; a length that divides well, or a tile below 16 asked for (4 of 16), is
    :func:`library.blocks`' answer."""
    assert library.tiles(extent, tile) == want
    if extent // library.blocks(extent, tile) >= library.DOT_MIN or extent <= tile or tile < library.DOT_MIN:
        assert want == library.blocks(extent, tile)
