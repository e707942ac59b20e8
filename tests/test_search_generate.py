"""The skeleton generator (search/generate.py): canonical order, Def. 2.1, pruning hook."""
import functools

from torch_mirage.superopt.search.generate import GenStats, enumerate_skeletons, to_kernel_graph
from torch_mirage.superopt.validate import problems

INS = [((4, 8), "float32"), ((8, 6), "float32")]


@functools.lru_cache(maxsize=None)
def _all(max_ops, exact_ops=False):
    st = GenStats()
    res = list(enumerate_skeletons(INS, [(4, 6)], max_ops=max_ops, stats=st, expr_of=None, exact_ops=exact_ops))
    return res, st


def test_canonical_order_gives_each_graph_once():
    res, st = _all(3)
    assert len(res) > 20
    jsons = [to_kernel_graph(s, INS).to_json() for s, _ in res]   # to_json is over Graph.canonical()
    assert len(set(jsons)) == len(jsons)
    # commutative ops only i <= j: no add(v1, v0) style duplicates
    for s, _ in res:
        for op in s.ops:
            if op.kind in ("add", "mul"):
                assert op.inputs[0] <= op.inputs[1]


def test_complete_graphs_are_valid_mugraphs():
    res, _ = _all(3)
    for s, _ in res:
        g = to_kernel_graph(s, INS)
        assert problems(g) == [], str(s)
        # Def. 2.1 (3): each output passed exactly one accumulator
        assert sum(op.kind.startswith("acc_") for op in s.ops) >= 1


def test_exact_ops_partitions_the_space():
    total = {str(s) for s, _ in _all(3)[0]}
    parts = set()
    for k in (1, 2, 3):
        got = {str(s) for s, _ in _all(k, exact_ops=True)[0]}
        assert not (parts & got)
        parts |= got
    assert parts == total


def test_the_matmul_skeleton_is_found_with_consistent_fmaps():
    res, _ = _all(2)
    found = {(s.fmaps, tuple(op.kind for op in s.ops)) for s, _ in res}
    assert ((1, 0), ("matmul", "acc_sum")) in found          # the for-loop walks K in both operands


def test_admits_is_called_and_prunes():
    calls = []

    def admits(e):
        calls.append(e)
        return e != "reject"

    def expr_of(op, args, ctx, in_shapes):       # a stand-in expression: the op name
        return ("reject" if op.name in ("silu", "exp", "sqrt") else op.name,)

    st = GenStats()
    res = list(enumerate_skeletons(INS, [(4, 6)], max_ops=3, stats=st, expr_of=expr_of, admits=admits))
    assert calls and st.pruned > 0
    assert all(op.kind not in ("silu", "exp", "sqrt") for s, _ in res for op in s.ops)


def test_deadline_stops_the_search():
    import time
    st = GenStats()
    list(enumerate_skeletons(INS, [(4, 6)], max_ops=6, stats=st, expr_of=None, deadline=time.monotonic() + 0.2))
    assert st.timed_out


def test_schedules_split_the_reduction_and_an_output_dim():
    from torch_mirage.superopt.search.generate import SkelOp, Skeleton
    from torch_mirage.superopt.search.schedule import schedules

    ins = [((4, 32), "float32"), ((32, 24), "float32")]
    skel = Skeleton((1, 0), (SkelOp("matmul", (0, 1)), SkelOp("acc_sum", (2,), (("dim", None),))), (3,), 2)
    got = list(schedules(skel, ins, [(4, 24)], tile=8))
    assert got
    for sched, g in got:
        assert problems(g) == []
    first = got[0][0]
    assert first["forloop_range"] == 4 and first["grid"] == (3,) and first["omap"] == (1,)
    assert first["imaps"] == [(None,), (1,)]          # X replicated, W split along N
    # rank-3 outputs: a second grid dim walks the batch
    ins3 = [((2, 4, 32), "float32"), ((32, 24), "float32")]
    skel3 = Skeleton((2, 0), skel.ops, (3,), 2)
    sched3, g3 = next(iter(schedules(skel3, ins3, [(2, 4, 24)], tile=8)))
    assert sched3["grid"] == (3, 2) and sched3["omap"] == (2, 0) and sched3["imaps"][0][1] == 0
    assert problems(g3) == []
