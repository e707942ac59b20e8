"""Sibling launches (superopt/siblings.py): graph-defined ops of a μGraph that read nothing the others write run
as one kernel, their programs side by side. Which ops may join (the group rule), the joined kernel equal to the
parts launched apart at every launch the tuner could give each part (2-d grids, splits folded in-kernel, one row
and several, fp32 and fp16 in Triton's interpreter), through ``compile_ugraph`` equal to eager, and on a GPU the
timed choice between the two."""
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from helpers import assert_close, rel_error
from torch_mirage.capture.lower import trace
from torch_mirage.codegen.ugraph_triton import CodegenError, emit_block_kernel
from torch_mirage.config import Config
from torch_mirage.numerics import tolerance
from torch_mirage.superopt.compile import BlockLauncher, compile_ugraph, op_arguments
from torch_mirage.superopt.gemv_claim import verified_halves
from torch_mirage.superopt.gemv_seed import gemv_seed
from torch_mirage.superopt.launch import LaunchConfig, streaming_candidates
from torch_mirage.superopt.search.reference import reference_of
from torch_mirage.superopt.siblings import SiblingLauncher, sibling_groups

sys.path.insert(0, os.path.dirname(__file__))
from test_gemv_rope import _inputs, qkv_rope, rotate_cat, rotate_stack  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU kernels run only in Triton's interpreter (TRITON_INTERPRET=1)")


def _graph(*ops):
    """A stand-in kernel graph: ``(name, inputs)`` per op, inputs as op indices."""
    return SimpleNamespace(ops=[SimpleNamespace(name=n, inputs=[(i, 0) for i in ins]) for n, ins in ops])


def test_groups_join_independent_kernels_only():
    every = range(10)
    # two projections of one input, then a kernel reading the first: the first two share a launch
    g = _graph(("input", []), ("customized", [0]), ("customized", [0]), ("customized", [1]))
    assert sibling_groups(g, every[:4], lambda i: True) == [[1, 2]]
    # a view of the input between them does not read the group: still one launch
    g = _graph(("input", []), ("customized", [0]), ("reshape", [0]), ("customized", [2]))
    assert sibling_groups(g, every[:4], lambda i: True) == [[1, 3]]
    # a view of the first's output between them needs it before the second runs: apart
    g = _graph(("input", []), ("customized", [0]), ("reshape", [1]), ("customized", [0]))
    assert sibling_groups(g, every[:4], lambda i: True) == []
    # reading the first through a chain of ops is reading it
    g = _graph(("input", []), ("customized", [0]), ("customized", [0]), ("customized", [0]), ("reshape", [1]),
               ("customized", [4]))
    assert sibling_groups(g, every[:6], lambda i: True) == [[1, 2, 3]]
    # an op that cannot join (a split with a combine kernel) ends a group and starts none
    g = _graph(("input", []), ("customized", [0]), ("customized", [0]), ("customized", [0]))
    assert sibling_groups(g, every[:4], lambda i: i != 2) == []
    assert sibling_groups(g, every[:4], lambda i: i != 1) == [[2, 3]]


def test_a_split_with_a_combine_kernel_is_not_a_part():
    fn = qkv_rope(rotate_cat)
    xs = _inputs(1, torch.float32, d=128)
    graph = trace(fn, xs)
    seed = gemv_seed(reference_of(graph.nodes, graph).graph)
    body = next(op.body for op in seed.ops if op.name == "customized")
    with pytest.raises(CodegenError, match="combine kernel"):
        emit_block_kernel(body, [2] * len(body.iterators), split=2, flat_pid=True)


def _region(rows, dtype, rotate=rotate_cat):
    fn = qkv_rope(rotate)
    xs = _inputs(rows, dtype, d=128)
    graph = trace(fn, xs)
    ref = reference_of(graph.nodes, graph)
    pos = {id(v): i for i, v in enumerate(graph.inputs)}
    return fn, xs, ref.graph, [xs[pos[id(v)]] for v in ref.inputs]


@interpreted
@pytest.mark.parametrize("rows,dtype,rotate", [(1, torch.float32, rotate_cat), (3, torch.float16, rotate_stack)])
def test_one_launch_equals_the_parts_apart_at_their_launches(rows, dtype, rotate, tmp_path):
    """The q and k / v kernels of the paired-halves QKV + RoPE form, each at launches the tuner times for it alone
    (its own schedule, a finer 2-d grid, a split folded in-kernel by the last program of each tile), run as one
    kernel: every output equal to the parts launched apart, twice in a row (the fold's counters are left zero)."""
    _, _, ref, ins = _region(rows, dtype, rotate)
    halves = verified_halves(ref, Config())
    ops = [op for op in halves.ops if op.name == "customized"]
    assert len(ops) == 2
    args = [op_arguments(halves, op, ins) for op in ops]
    ranks = [[a.dim() for a in xs] for xs in args]

    def pick(op, want):
        cands = [c for c in streaming_candidates(op.body, 4) if c.split == 1 or c.combine_in_kernel]
        return next((c for c in cands if want(c)), cands[0])
    plans = [
        [LaunchConfig(tuple(op.body.grid), op.body.forloop_range, 1, 1, 2) for op in ops],
        [pick(ops[0], lambda c: c.combine_in_kernel), pick(ops[1], lambda c: len(c.grid) > 1 and c.grid[1] > 1)],
        [pick(ops[0], lambda c: c.split == 1 and c.grid[1] > 1), pick(ops[1], lambda c: c.combine_in_kernel)],
    ]
    assert any(c.combine_in_kernel for plan in plans for c in plan)
    assert any(len(c.grid) > 1 and c.grid[1] > 1 for plan in plans for c in plan)
    for k, plan in enumerate(plans):
        apart = [BlockLauncher(op.body, cfg, r, str(tmp_path), f"ugraph_op{j}")(*xs)
                 for j, (op, cfg, r, xs) in enumerate(zip(ops, plan, ranks, args))]
        parts = [BlockLauncher(op.body, cfg, r, str(tmp_path), f"ugraph_op{j}", flat_pid=True)
                 for j, (op, cfg, r) in enumerate(zip(ops, plan, ranks))]
        joined = SiblingLauncher(parts, plan[0].num_warps, str(tmp_path), f"ugraph_siblings_{k}")
        assert joined.grid[0] == sum(p.programs for p in parts)
        for _ in range(2):
            got = joined(args)
            for g_part, a_part in zip(got, apart):
                for g, a in zip(g_part, a_part):
                    assert_close(g, a)
        for p in parts:
            for c in p.counters(ins[0].device):
                assert not c.any()


@interpreted
@pytest.mark.parametrize("rows", [1, 3])
def test_compiled_ugraph_runs_siblings_as_one_launch(rows):
    """``compile_ugraph(siblings=True)``: the head-per-block seed and the paired-halves form of QKV + RoPE each run
    their two kernels as one launch, equal to the same μGraph launched apart and to eager (fp64)."""
    fn, xs, ref, ins = _region(rows, torch.float32)
    eager = fn(*[x.double() for x in xs])
    for ugraph in (gemv_seed(ref), verified_halves(ref, Config())):
        joined = compile_ugraph(ugraph, ins, tune=False, siblings=True)
        apart = compile_ugraph(ugraph, ins, tune=False, siblings=False)
        assert len(joined.sibling_launches) == 1 and len(joined.sibling_launches[0]) == 2
        assert not apart.sibling_launches
        got, want = joined(*ins), apart(*ins)
        for g, w in zip(got, want):
            assert_close(g, w)
        assert sorted(g.shape for g in got) == sorted(e.shape for e in eager)
        for g in got:
            assert any(g.shape == e.shape and torch.allclose(g.double(), e, atol=1e-4, rtol=1e-4) for e in eager)
        runs = list(joined.run_steps(ins))
        assert sum(r.op == "siblings" for r in runs) == 1 and not any(r.op == "customized" for r in runs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 8])
def test_sibling_launch_is_timed_on_the_gpu(rows, tmp_path):
    """bf16 at Llama widths (2048 wide here, 16 heads of 128, 4 KV heads): the tuned μGraph (launches timed, the
    joined launch kept only where faster) equals eager, and so does the joined launch forced on at the same
    tuned launches (read back from the cache)."""
    from torch_mirage.cache import DiskCache

    bf = torch.bfloat16
    fn = qkv_rope(rotate_cat, hd=128)
    xs = _inputs(rows, bf, d=2048, hd=128, heads=16, kv_heads=4, device="cuda")
    graph = trace(fn, xs)
    ref = reference_of(graph.nodes, graph)
    pos = {id(v): i for i, v in enumerate(graph.inputs)}
    ins = [xs[pos[id(v)]] for v in ref.inputs]
    eager = fn(*[x.double() for x in xs])
    halves = verified_halves(ref.graph, Config())
    cache = DiskCache(str(tmp_path))
    for siblings in (None, True):
        compiled = compile_ugraph(halves, ins, cache=cache, cache_dir=str(tmp_path), siblings=siblings)
        if siblings:     # a part tuned to a split with a combine kernel (two launches) cannot join
            joinable = [s for s in compiled.steps if s.launcher is not None and s.launcher.combine_fn is None]
            assert len(compiled.sibling_launches) == (len(joinable) > 1)
        for _ in range(3):
            got = compiled(*ins)
            assert sorted(g.shape for g in got) == sorted(e.shape for e in eager)
            for g in got:      # k and v have one shape: each output equals one of eager's
                assert any(g.shape == e.shape and rel_error(g, e.to(bf)) <= tolerance(bf) for e in eager)
