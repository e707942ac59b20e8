"""Searching big regions on shrunk shapes (search/shrink.py) and carrying the μGraph back to the real sizes."""
import pytest
import torch

import test_search_driver as D
from torch_mirage.superopt.builder import new_kernel_graph
from torch_mirage.superopt.executor import execute
from torch_mirage.superopt.search import driver
from torch_mirage.superopt.search.driver import search
from torch_mirage.superopt.search.shrink import block_steps, shrink, size_map

pytest.importorskip("torch_mirage.superopt.search.oracle")

BIG_K, BIG_N = 320, 288        # above SHRINK_ABOVE: searched shrunk


@pytest.fixture
def big(monkeypatch):
    monkeypatch.setattr(D, "M", 4)
    monkeypatch.setattr(D, "K", BIG_K)
    monkeypatch.setattr(D, "N", BIG_N)


def _fp64_equal(graph, ref):
    xs = [torch.randn(s, dtype=torch.float64) for s, _ in D._specs(ref)]
    got, want = execute(graph, xs)[0], execute(ref, xs)[0]
    assert got.shape == want.shape
    assert ((got - want).norm() / want.norm()).item() < 1e-12


def test_size_map():
    m = size_map([1, 4, 16, 4096, 14336, 4000])
    assert m[1] == 1 and m[4] == 4 and m[16] == 16                 # rows kept
    assert len({m[4096], m[14336], m[4000]}) == 3                   # distinct sizes stay distinct
    assert all(16 < m[d] <= 64 for d in (4096, 14336, 4000))
    assert size_map([4, 200]) is None                               # small problems search as they are
    m = size_map([4, 16, 48, 64, 4096])                             # one-tile sizes stay one tile, distinct
    assert m[48] <= 16 and m[64] <= 16 and len({m[4], m[16], m[48], m[64], m[4096]}) == 5


@pytest.mark.parametrize("rows", [4, 48])
@pytest.mark.parametrize("make", [D._rms_mean_rsqrt, D._gated_mlp], ids=["rmsnorm_linear", "gated_mlp"])
def test_big_target_found_on_shrunk_shapes(big, make, rows, monkeypatch):
    monkeypatch.setattr(D, "M", rows)
    ref = make()
    small = shrink(ref, D._specs(ref), [ref.shape(ref.outputs[0])])
    assert small is not None and small.inputs[0][0] == (small.sizes[rows], small.sizes[BIG_K])
    r = search(ref, D._specs(ref), budget_s=30, oracle_kwargs=D.FRONT)
    assert r.best is not None, r.reason
    assert "shrunk" in r.reason and D._one_kernel(r.best)
    assert [op.shapes[0] for op in r.best.ops if op.name == "customized"] == [(rows, BIG_N)]
    _fp64_equal(r.best, ref)


def test_carried_back_without_real_size_verify(big, monkeypatch):
    """Above RECHECK_STEPS the real-size μGraph is not re-verified here (the compile stage float-checks it);
    it is still the verified skeleton with the same imaps and splits, so it computes the same function."""
    monkeypatch.setattr(driver, "RECHECK_STEPS", 0)
    ref = D._rms_mean_rsqrt()
    r = search(ref, D._specs(ref), budget_s=30, oracle_kwargs=D.FRONT)
    assert r.best is not None and "float-checked by the compile stage" in r.reason
    assert block_steps(r.best) > 1
    _fp64_equal(r.best, ref)


def test_size_constant_falls_back_to_real_sizes(big):
    """sum(x²)/K holds K as a constant: the shrunk problem is not the same function of its sizes, nothing
    verified there carries back, and the real sizes are searched (and found)."""
    ref = D._rms_sum_div_sqrt()
    r = search(ref, D._specs(ref), budget_s=30, oracle_kwargs=D.FRONT)
    assert r.best is not None, r.reason
    assert "shrunk" not in r.reason
    _fp64_equal(r.best, ref)


def test_reshape_merging_big_dims_does_not_shrink():
    g = new_kernel_graph()
    x = g.new_input((2, 320, 288), "float32")
    w = g.new_input((288, 300), "float32")
    g.mark_output(g.matmul(g.reshape(x, shape=(640, 288)), w))
    ref = g.build()
    assert shrink(ref, [((2, 320, 288), "float32"), ((288, 300), "float32")], [(640, 300)]) is None


def test_product_map_shrinks_rows_merged_by_a_reshape():
    """A prompt's rows (4 x 64, merged into 256 for the matmul) shrink as a product of their images; the plain map
    cannot rebuild that reshape, and a merge of a size above BIG still does not shrink."""
    from torch_mirage.superopt.search.shrink import SIZE_MAPS, SMALL_TILE, product_size_map

    m = product_size_map([4, 64, 256, 1024, 2816])
    assert m[256] == m[4] * m[64] and m[256] % SMALL_TILE == 0 and m[256] >= 2 * SMALL_TILE
    assert len(set(m.values())) == 5 and all(v <= 64 for v in m.values())
    assert product_size_map([4, 16, 4096]) is None                  # no product: the plain map serves
    m2 = product_size_map([2, 288, 320, 640])                       # 2 x 320: 320 mapped first, then the product
    assert m2[640] == 2 * m2[320] and len(set(m2.values())) == 4
    assert product_size_map([4, 64, 256, 1024])[1024] <= 64         # 4 x 256 only by chance: not made large
    assert product_size_map([64, 128, 8192]) is None                # 64 x 128: a product too large to be small
    assert product_size_map in SIZE_MAPS
    g = new_kernel_graph()
    x = g.new_input((4, 64, 320), "float32")
    w = g.new_input((320, 288), "float32")
    g.mark_output(g.matmul(g.reshape(x, shape=(256, 320)), w))
    ref = g.build()
    ins, out = [((4, 64, 320), "float32"), ((320, 288), "float32")], [(256, 288)]
    assert shrink(ref, ins, out) is None
    small = shrink(ref, ins, out, product_size_map)
    assert small is not None and small.inputs[0][0] == (4, m[64], small.sizes[320])
    xs = [torch.randn(s, dtype=torch.float64) for s, _ in small.inputs]
    assert execute(small.target, xs)[0].shape == (4 * m[64], small.sizes[288])


def test_compact_map_shrinks_kept_sizes_and_keeps_reshapes():
    """The search shrinks sizes up to KEEP too (the verifier then steps fewer blocks): the next free of 3, 4, ...,
    or with ``products`` the product of two mapped sizes (8 x 2 heads merged into 16 by a reshape: 3 x 2); the
    driver tries the maps in order until one rebuilds the target, the conservative map last."""
    from torch_mirage.capture.lower import trace
    from torch_mirage.superopt.search.reference import reference_of
    from torch_mirage.superopt.search.shrink import SIZE_MAPS, compact_size_map

    sizes = [1, 2, 8, 16, 64, 256, 4096]
    assert compact_size_map(sizes) == {1: 1, 2: 2, 8: 3, 16: 4, 64: 15, 256: 32, 4096: 48}
    assert compact_size_map(sizes, products=True)[16] == 6
    assert compact_size_map([1, 2, 64, 4096]) is None            # nothing kept above 2: the plain map serves
    assert SIZE_MAPS[-1] is size_map
    def scores(q, k):      # heads merged into the batch for a bmm, as HF's eager attention does
        return (q.reshape(16, 256, 64) @ k.reshape(16, 4096, 64).transpose(1, 2)).reshape(8, 2, 256, 4096)
    graph = trace(scores, [torch.randn(8, 2, 256, 64), torch.randn(8, 2, 4096, 64)])
    ref = reference_of(graph.nodes, graph).graph
    ins = [((8, 2, 256, 64), "float32"), ((8, 2, 4096, 64), "float32")]
    out = [(8, 2, 256, 4096)]
    assert shrink(ref, ins, out, compact_size_map) is None       # 3 x 2 is not 4: the reshape does not shrink
    small = shrink(ref, ins, out, SIZE_MAPS[1])
    assert small is not None and small.inputs[0][0] == (3, 2, 32, 15)
