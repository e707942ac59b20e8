"""μGraph IR: builder, Definition 2.1 validation, canonical JSON / hash, thread-graph fusion."""
import json

import pytest
import torch

from torch_mirage import ugraph
from torch_mirage.superopt import builder, executor, library, validate
from torch_mirage.superopt.builder import new_kernel_graph, new_threadblock_graph
from torch_mirage.ugraph import MuGraphError


def _tamper(graph, fn):
    """Edit a graph through its JSON (as a search bug or a bad cache entry would)."""
    d = json.loads(graph.to_json())
    fn(d)
    return ugraph.from_dict(d)


def _block(d, k=-1):
    return [o for o in d["ops"] if o["name"] == "customized"][k]["body"]


def _matmul_graph(m=3, k=12, n=9, grid=3, rng=4, order=0, w_fmap=0, dtype="float32"):
    g = new_kernel_graph()
    X, W = g.new_input((m, k), dtype), g.new_input((k, n), dtype)
    tb = new_threadblock_graph((grid,), rng)
    if order == 0:
        tX = tb.new_input(X, imap=(None,), fmap=1)
        tW = tb.new_input(W, imap=(1,), fmap=w_fmap)
    else:   # the same graph, iterators created in the other order
        tW = tb.new_input(W, imap=(1,), fmap=w_fmap)
        tX = tb.new_input(X, imap=(-1,), fmap=1)
    acc = tb.forloop_accum(tb.matmul(tX, tW), "sum")
    tb.new_output(tb.exp(acc), omap=(1,))
    (Y,) = g.customized([X, W], tb)
    g.mark_output(Y)
    return g.build()


# ------------------------------------------------------------------ accept
@pytest.mark.parametrize("name", sorted(library.WORKLOADS))
@pytest.mark.parametrize("b", [1, 8])
def test_library_graphs_valid_at_benchmark_shapes(name, b):
    w = library.WORKLOADS[name]
    g = w.build(*library.bench_dims(name, b), dtype="float16")
    validate.validate(g)
    assert [tuple(op.attrs["shape"]) for op in g.inputs] == w.input_shapes(*library.bench_dims(name, b))
    validate.validate(builder.fuse_thread_graphs(g))


# ------------------------------------------------------------------ reject
def test_two_accumulators_on_a_path_rejected():
    g = new_kernel_graph()
    X = g.new_input((4, 8), "float32")
    tb = new_threadblock_graph((2,), 2)
    tX = tb.new_input(X, imap=(0,), fmap=1)
    tb.new_output(tb.forloop_accum(tb.forloop_accum(tX, "sum"), "sum"), omap=(0,))
    (Y,) = g.customized([X], tb)
    g.mark_output(Y)
    found = validate.problems(g.build())
    assert any("two accumulators" in p for p in found), found
    with pytest.raises(validate.InvalidMuGraph):
        validate.validate(g.build())


def test_path_without_accumulator_and_mixed_phases_rejected():
    g = new_kernel_graph()
    X = g.new_input((4, 8), "float32")
    tb = new_threadblock_graph((2,), 2)
    tX = tb.new_input(X, imap=(0,), fmap=1)
    tb.new_output(tX, omap=(0,))                                  # no accumulator
    tb.new_output(tb.mul(tb.forloop_accum(tX, "sum"), tX), omap=(0,))   # post-loop value × loop value
    (Y, Z) = g.customized([X], tb)
    g.mark_output(Y)
    g.mark_output(Z)
    found = "\n".join(validate.problems(g.build()))
    assert "saver 0: paths into it cross [0] accumulators" in found
    assert "mixes for-loop values with post-loop values" in found


def test_tile_exceeding_shared_memory_rejected():
    g = library.gated_mlp(64, 512, 512, dtype="float16", grid=1, forloop_range=1)
    found = validate.problems(g)
    assert len(found) == 1 and "block-level memory" in found[0] and "capacity 232448" in found[0], found
    validate.validate(g, smem_bytes=4 * 2 ** 20)        # fits a device with more shared memory
    validate.validate(library.gated_mlp(64, 512, 512, dtype="float16", grid=8, forloop_range=8))
    assert validate.problems(library.gated_mlp(64, 512, 512, dtype="float16", grid=8, forloop_range=8),
                             smem_bytes=1024)


def test_mismatched_shapes_rejected():
    g = new_kernel_graph()
    X, W = g.new_input((3, 5), "float32"), g.new_input((4, 7), "float32")
    tb = new_threadblock_graph((1,), 1)
    tX, tW = tb.new_input(X, imap=(None,)), tb.new_input(W, imap=(None,))
    with pytest.raises(MuGraphError, match=r"matmul.*\(3, 5\).*\(4, 7\)"):
        tb.matmul(tX, tW)
    with pytest.raises(MuGraphError, match="do not broadcast"):
        tb.add(tX, tW)
    # a stored graph whose recorded shapes disagree with the op table
    def edit(d):
        (mm,) = [o for o in _block(d)["ops"] if o["name"] == "matmul"]
        mm["shapes"] = [[3, 4]]
    found = validate.problems(_tamper(_matmul_graph(), edit))
    assert any("(matmul): records [(3, 4)]" in p and "spec gives [(3, 3)]" in p for p in found), found


def test_imap_on_non_dividing_dim_rejected():
    g = new_kernel_graph()
    X = g.new_input((6, 10), "float32")
    tb = new_threadblock_graph((4,), 1)
    with pytest.raises(MuGraphError, match="grid dim 0 = 4: neither divides the other"):
        tb.new_input(X, imap=(1,))
    tb5 = new_threadblock_graph((5,), 3)
    with pytest.raises(MuGraphError, match="does not divide by forloop_range 3"):
        tb5.new_input(X, imap=(1,), fmap=1)
    # a stored graph edited to a grid that does not divide
    bad = _tamper(_matmul_graph(), lambda d: _block(d).__setitem__("grid", [2]))
    assert any("neither divides" in p for p in validate.problems(bad)), validate.problems(bad)


def test_omap_must_separate_blocks():
    bad = _tamper(_matmul_graph(), lambda d: _block(d)["ops"][-1]["attrs"].__setitem__("omap", [None]))
    assert any("overwrite each other" in p for p in validate.problems(bad))
    with pytest.raises(executor.ExecutionError, match="written more than once"):
        executor.execute(bad, [torch.randn(3, 12), torch.randn(12, 9)])


def test_op_levels_enforced():
    g = new_kernel_graph()
    X = g.new_input((4, 4), "float32")
    with pytest.raises(MuGraphError, match="not allowed in a kernel graph"):
        g.acc_sum(X)
    tg = builder.new_thread_graph()
    t = tg.new_input((4, 4), "float32")
    with pytest.raises(MuGraphError, match="not allowed in a thread graph"):
        tg.matmul(t, t)


# ------------------------------------------------------------------ serialisation
def test_json_round_trip_and_hash():
    for name, w in library.WORKLOADS.items():
        g = w.build(*library.bench_dims(name, 1), dtype="float16")
        back = ugraph.from_json(g.to_json())
        assert back.to_json() == g.to_json() and back.hash() == g.hash()
        assert back == g
        assert not validate.problems(back)
    hashes = {w.build(*library.bench_dims(n, 1)).hash() for n, w in library.WORKLOADS.items()}
    assert len(hashes) == len(library.WORKLOADS)


def test_hash_ignores_construction_order_but_not_semantics():
    a, b = _matmul_graph(order=0), _matmul_graph(order=1)
    assert a.to_json() == b.to_json() and a.hash() == b.hash()
    assert _matmul_graph(grid=9).hash() != a.hash()
    assert _matmul_graph(rng=2).hash() != a.hash()
    assert _matmul_graph(dtype="float16").hash() != a.hash()
    d = json.loads(a.to_json())
    assert list(d) == sorted(d)
    xs = [torch.randn(3, 12), torch.randn(12, 9)]
    torch.testing.assert_close(executor.execute(a, xs)[0], executor.execute(b, xs)[0])


def test_str_is_readable():
    text = str(library.rmsnorm_linear(3, 15, 21, dtype="float32", tile=8))
    for piece in ("KernelGraph", "BlockGraph grid=[3] forloop_range=3", "imap={x:φ}", "fmap=1",
                  "acc_rms", "matmul", "saver", "omap={x:1}", "float32[3, 21]"):
        assert piece in text, (piece, text)


# ------------------------------------------------------------------ thread graphs
def test_thread_graph_fusion_keeps_values_and_saves_shared_memory():
    g = library.gated_mlp(3, 15, 21, dtype="float32", tile=8)
    f = builder.fuse_thread_graphs(g)
    bg = [op for op in f.ops if op.name == "customized"][0].body
    (thread,) = [op for op in bg.ops if op.name == "thread"]
    assert [op.name for op in thread.body.ops if op.name != "input"] == ["silu", "mul"]
    assert not validate.problems(f)
    assert ugraph.from_json(f.to_json()) == f and f.hash() != g.hash()
    smem = lambda graph: sum(validate.nbytes(s, d) for op in [o for o in graph.ops if o.name == "customized"][0].body.ops
                             for s, d in zip(op.shapes, op.dtypes))
    assert smem(f) < smem(g)
    xs = [torch.randn(s, dtype=torch.float64) for s in ((3, 15), (15, 21), (15, 21))]
    torch.testing.assert_close(executor.execute(f, xs)[0], library.gated_mlp_ref(*xs))


def test_thread_graph_rejects_non_elementwise_body():
    g = _matmul_graph()

    def put_reduction(d):
        blk = _block(d)
        exp_op = blk["ops"][-2]
        body = {"level": "thread", "outputs": [[1, 0]], "ops": [
            {"name": "input", "inputs": [], "attrs": {"index": 0, "shape": exp_op["shapes"][0], "dtype": "float32"},
             "shapes": exp_op["shapes"], "dtypes": ["float32"]},
            {"name": "reduce_sum", "inputs": [[0, 0]], "attrs": {"dim": 0},
             "shapes": [[1, exp_op["shapes"][0][1]]], "dtypes": ["float32"]}]}
        blk["ops"][-2] = {**exp_op, "name": "thread", "attrs": {}, "body": body,
                          "shapes": [[1, exp_op["shapes"][0][1]]]}
    found = "\n".join(validate.problems(_tamper(g, put_reduction)))
    assert "reduce_sum): not allowed at thread level" in found


# ------------------------------------------------------------------ accumulators, one by one
ACCUMULATORS = [   # kind, dim, attrs, torch formula over the whole (rows-of-block, 12) row
    ("sum", 1, {}, lambda x: x.sum(1, keepdim=True)),
    ("sum", None, {}, lambda x: x.reshape(x.shape[0], 3, 4).sum(1)),
    ("mean", 1, {}, lambda x: x.mean(1, keepdim=True)),
    ("mean", None, {}, lambda x: x.reshape(x.shape[0], 3, 4).mean(1)),
    ("max", 1, {}, lambda x: x.amax(1, keepdim=True)),
    ("max", None, {}, lambda x: x.reshape(x.shape[0], 3, 4).amax(1)),
    ("rms", 1, {"eps": 0.5}, lambda x: (x.pow(2).mean(1, keepdim=True) + 0.5).sqrt()),
    ("rms", None, {}, lambda x: x.reshape(x.shape[0], 3, 4).pow(2).mean(1).sqrt()),
    ("concat", 1, {}, lambda x: x),
]


@pytest.mark.parametrize("kind,dim,attrs,ref", ACCUMULATORS, ids=[f"{a[0]}-{a[1]}" for a in ACCUMULATORS])
def test_accumulator_kinds(kind, dim, attrs, ref):
    g = new_kernel_graph()
    X = g.new_input((6, 12), "float64")
    tb = new_threadblock_graph((3,), 3)            # 2 rows per block, 3 iterations of 4 columns
    tX = tb.new_input(X, imap=(0,), fmap=1)
    tb.new_output(tb.forloop_accum(tX, kind, dim=dim, **attrs), omap=(0,))
    (Y,) = g.customized([X], tb)
    g.mark_output(Y)
    graph = g.build()
    validate.validate(graph)
    x = torch.randn(6, 12, dtype=torch.float64)
    torch.testing.assert_close(executor.execute(graph, [x])[0], ref(x))


def test_thread_graph_register_capacity():
    f = builder.fuse_thread_graphs(library.gated_mlp(64, 512, 512, dtype="float16", grid=8, forloop_range=8))
    assert not validate.problems(f)
    found = validate.problems(f, regs_bytes=1024)
    assert len(found) == 1 and "thread-level memory" in found[0] and "body op" in found[0], found


def test_predefined_kernel_ops():
    """A kernel graph of pre-defined ops only: ((X+Y) @ Zᵀᵀ) ‖ exp(X), then a row sum."""
    g = new_kernel_graph()
    X, Y, Z = g.new_input((3, 5), "float64"), g.new_input((3, 5), "float64"), g.new_input((7, 5), "float64")
    mm = g.matmul(g.add(X, Y), g.transpose(Z))
    cat = g.concat([mm, g.exp(X)], dim=-1)
    g.mark_output(g.reduce_sum(cat, dim=-1))
    g.mark_output(g.reshape(cat, shape=(36,)))
    graph = g.build()
    validate.validate(graph)
    assert [op.attrs["dim"] for op in graph.ops if op.name in ("concat", "reduce_sum")] == [1, 1]
    x, y, z = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64), torch.randn(7, 5, dtype=torch.float64)
    want = torch.cat([x @ z.T + y @ z.T, x.exp()], dim=1)
    s, flat = executor.execute(graph, [x, y, z])
    torch.testing.assert_close(s, want.sum(1, keepdim=True))
    torch.testing.assert_close(flat, want.reshape(36))
