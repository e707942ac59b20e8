"""The μGraph search driver (search/driver.py): rediscovery with seeds off, verification, deadline."""
import time

import pytest
import torch

from conftest import assert_close
from torch_mirage.superopt import library as L
from torch_mirage.superopt.builder import new_kernel_graph, new_threadblock_graph
from torch_mirage.superopt.executor import execute
from torch_mirage.superopt.search.driver import search

pytest.importorskip("torch_mirage.superopt.search.oracle")

M, K, N = 4, 32, 24
FRONT = dict(use_z3=False)     # the structural front decides alone: deterministic and fast


def _rms_mean_rsqrt():
    """rms_norm(x)·g @ w written as x · rsqrt(mean(x·x)) · g, then the matmul."""
    g = new_kernel_graph()
    X, G, W = g.new_input((M, K), "float32"), g.new_input((K,), "float32"), g.new_input((K, N), "float32")
    r = g.rsqrt(g.reduce_mean(g.mul(X, X), dim=1))
    g.mark_output(g.matmul(g.mul(g.mul(X, r), G), W))
    return g.build()


def _rms_sum_div_sqrt():
    """The same written another way: (x·g) / sqrt(sum(x²)/k), the weight applied before the norm."""
    g = new_kernel_graph()
    X, G, W = g.new_input((M, K), "float32"), g.new_input((K,), "float32"), g.new_input((K, N), "float32")
    ms = g.scalar_mul(g.reduce_sum(g.square(X), dim=1), value=1.0 / K)
    g.mark_output(g.matmul(g.div(g.mul(G, X), g.sqrt(ms)), W))
    return g.build()


def _gated_mlp():
    g = new_kernel_graph()
    X, W1, W3 = (g.new_input(s, "float32") for s in ((M, K), (K, N), (K, N)))
    g.mark_output(g.mul(g.matmul(X, W3), g.silu(g.matmul(X, W1))))
    return g.build()


def _specs(ref):
    return [(op.shapes[0], op.dtypes[0]) for op in ref.inputs]


def _one_kernel(g):
    return [op.name for op in g.ops if op.name != "input"] == ["customized"]


@pytest.mark.parametrize("make", [_rms_mean_rsqrt, _rms_sum_div_sqrt], ids=["mean_rsqrt", "sum_div_sqrt"])
def test_rediscovers_rmsnorm_linear(make):
    ref = make()
    r = search(ref, _specs(ref), budget_s=20, tile=8, oracle_kwargs=FRONT)
    assert r.best is not None, r.reason
    assert r.source == "search" and _one_kernel(r.best)
    body = next(op.body for op in r.best.ops if op.name == "customized")
    names = [op.name for op in body.ops]
    assert "acc_rms" in names and "acc_sum" in names and "matmul" in names
    assert body.forloop_range > 1 and body.grid[0] > 1          # the for-loop walks K, the grid splits N
    assert r.stats.verified == 1 and r.stats.pruned > r.stats.candidates
    x, gw, w = torch.randn(M, K), torch.randn(K), torch.randn(K, N)
    (y,) = execute(r.best, [x, gw, w])
    assert_close(y, L.rmsnorm_linear_ref(x, gw, w))


def test_rediscovers_gated_mlp():
    ref = _gated_mlp()
    r = search(ref, _specs(ref), budget_s=20, tile=8, oracle_kwargs=FRONT)
    assert r.best is not None, r.reason
    assert _one_kernel(r.best)
    body = next(op.body for op in r.best.ops if op.name == "customized")
    assert sorted(op.name for op in body.ops if op.name.startswith("acc_")) == ["acc_sum", "acc_sum"]
    x, w1, w3 = torch.randn(M, K), torch.randn(K, N), torch.randn(K, N)
    (y,) = execute(r.best, [x, w1, w3])
    assert_close(y, L.gated_mlp_ref(x, w1, w3))


def test_rediscovers_lora():
    """x@w + (x@a)@b: found through Mirage's concat-then-matmul macro, (x ‖ x·a) @ (w ‖ b) per K tile."""
    g = new_kernel_graph()
    X, W, A, B = (g.new_input(s, "float32") for s in ((M, K), (K, N), (K, 4), (4, N)))
    g.mark_output(g.add(g.matmul(g.matmul(X, A), B), g.matmul(X, W)))
    ref = g.build()
    r = search(ref, _specs(ref), budget_s=20, tile=8, oracle_kwargs=FRONT)
    assert r.best is not None, r.reason
    assert _one_kernel(r.best)
    body = next(op.body for op in r.best.ops if op.name == "customized")
    assert [op.name for op in body.ops].count("concat") == 2
    x, w, a, b = torch.randn(M, K), torch.randn(K, N), torch.randn(K, 4), torch.randn(4, N)
    (y,) = execute(r.best, [x, w, a, b])
    assert_close(y, L.lora_ref(x, w, a, b))


def _wrong_gated_mlp():
    """silu on the wrong product: silu(x@w3)·(x@w1)."""
    g = new_kernel_graph()
    X, W1, W3 = (g.new_input(s, "float32") for s in ((M, K), (K, N), (K, N)))
    tb = new_threadblock_graph((3,), 4)
    tX, tW1, tW3 = tb.new_input(X, (None,), 1), tb.new_input(W1, (1,), 0), tb.new_input(W3, (1,), 0)
    a1 = tb.forloop_accum(tb.matmul(tX, tW1), "sum")
    a3 = tb.forloop_accum(tb.matmul(tX, tW3), "sum")
    tb.new_output(tb.mul(a1, tb.silu(a3)), omap=(1,))
    (Y,) = g.customized([X, W1, W3], tb)
    g.mark_output(Y)
    return g.build()


@pytest.mark.parametrize("probe", [True, False])
def test_planted_wrong_candidate_is_rejected(probe):
    ref, wrong = _gated_mlp(), _wrong_gated_mlp()
    r = search(ref, _specs(ref), budget_s=20, tile=8, oracle_kwargs=FRONT, extra_candidates=[wrong], probe=probe)
    assert r.best is not None and r.best.hash() != wrong.hash()
    if probe:
        assert r.stats.rejected_by_probe == 1 and r.stats.rejected_by_verifier == 0
    else:
        assert r.stats.rejected_by_verifier == 1
    assert r.stats.verified == 1


def test_seeds_are_verified_and_used():
    ref = _gated_mlp()
    r = search(ref, _specs(ref), budget_s=20, tile=8, seeds=True, oracle_kwargs=FRONT)
    assert r.source == "seed" and r.stats.verified == 1
    assert r.best.hash() == L.gated_mlp(M, K, N, dtype="float32").hash()
    assert r.stats.generated == 0            # a verified seed ends the search before depth 1


def test_budget_zero_returns_nothing():
    ref = _gated_mlp()
    r = search(ref, _specs(ref), budget_s=0)
    assert r.best is None and r.stats.generated == 0


def test_deadline_is_honoured():
    ref = _rms_mean_rsqrt()
    t = time.monotonic()
    r = search(ref, _specs(ref), budget_s=0.5, tile=8, prune=False)     # unpruned depth 5 takes minutes
    assert time.monotonic() - t < 3.0
    assert r.best is None and r.stats.timed_out


def test_pruning_cuts_states_with_the_same_result():
    g = new_kernel_graph()
    X, W = g.new_input((M, K), "float32"), g.new_input((K, N), "float32")
    g.mark_output(g.silu(g.matmul(X, W)))
    ref = g.build()
    on = search(ref, _specs(ref), budget_s=20, tile=8, oracle_kwargs=FRONT)
    off = search(ref, _specs(ref), budget_s=20, tile=8, prune=False)
    assert on.best is not None and off.best is not None
    assert on.best.hash() == off.best.hash()
    assert on.stats.generated * 5 < off.stats.generated


def test_disk_cache_warm_and_corrupted(tmp_path):
    """A verified result is cached: the warm search returns it at once; a corrupted entry is ignored and rewritten."""
    from torch_mirage.cache import DiskCache
    cache = DiskCache(str(tmp_path), "search")
    ref = _gated_mlp()
    cold = search(ref, _specs(ref), budget_s=20, tile=8, oracle_kwargs=FRONT, cache=cache)
    assert cold.best is not None and cold.source == "search"
    (entry,) = list(tmp_path.rglob("*.bin"))
    t = time.monotonic()
    warm = search(ref, _specs(ref), budget_s=20, tile=8, oracle_kwargs=FRONT, cache=cache)
    assert time.monotonic() - t < 1.0
    assert warm.source == "cache" and warm.stats.generated == 0 and warm.best.hash() == cold.best.hash()
    x, w1, w3 = torch.randn(M, K), torch.randn(K, N), torch.randn(K, N)
    assert_close(execute(warm.best, [x, w1, w3])[0], L.gated_mlp_ref(x, w1, w3))
    good = cache.get_json(entry.stem)["graph"]
    # a truncated entry (checksum mismatch) and a well-formed entry holding no valid μGraph are both misses
    for bad in ("truncated", None):
        if bad is None:
            cache.put_json(entry.stem, {"graph": {"level": "kernel", "ops": [], "outputs": [[7, 0]]}})
        else:
            entry.write_bytes(entry.read_bytes()[:40])
        again = search(ref, _specs(ref), budget_s=20, tile=8, oracle_kwargs=FRONT, cache=cache)
        assert again.source == "search" and again.best.hash() == cold.best.hash()
        assert cache.get_json(entry.stem)["graph"] == good       # rewritten
    # another shape is another key
    other = search(ref, [((2 * M, K), "float32"), ((K, N), "float32"), ((K, N), "float32")], budget_s=0.0,
                   cache=cache)
    assert other.best is None



def test_misses_are_cached_a_timed_out_one_for_its_budget(tmp_path):
    """A search that explored everything within its op limit and found nothing is cached: the same target (a
    model's next layer) gets the answer at once, without generating; one cut by its deadline answers searches of
    at most its budget, and a longer budget searches again."""
    from torch_mirage.cache import DiskCache
    cache = DiskCache(str(tmp_path / "a"), "search")
    ref = _gated_mlp()
    cold = search(ref, _specs(ref), budget_s=20, tile=8, max_ops=3, oracle_kwargs=FRONT, cache=cache)
    assert cold.best is None and not cold.stats.timed_out and cold.stats.generated > 0, cold.reason
    t = time.monotonic()
    warm = search(ref, _specs(ref), budget_s=20, tile=8, max_ops=3, oracle_kwargs=FRONT, cache=cache)
    assert time.monotonic() - t < 1.0
    assert warm.best is None and warm.source == "cache" and warm.stats.generated == 0
    assert warm.reason == f"cached: {cold.reason}"
    # a larger op limit is another question: it searches (and finds the fused μGraph)
    found = search(ref, _specs(ref), budget_s=20, tile=8, oracle_kwargs=FRONT, cache=cache)
    assert found.best is not None and found.source == "search"
    cut = DiskCache(str(tmp_path / "b"), "search")
    slow = _rms_mean_rsqrt()
    timed_out = search(slow, _specs(slow), budget_s=0.5, tile=8, prune=False, cache=cut)
    assert timed_out.best is None and timed_out.stats.timed_out
    again = search(slow, _specs(slow), budget_s=0.4, tile=8, prune=False, cache=cut)
    assert again.source == "cache" and again.reason == "cached: deadline" and again.stats.generated == 0
    # 3 s, not just above 0.5 s: on a loaded 2-core CI machine the setup before the first graph has taken 0.9 s
    longer = search(slow, _specs(slow), budget_s=3.0, tile=8, prune=False, cache=cut)
    assert longer.source != "cache" and longer.stats.generated > 0
