"""The μGraph optimiser (superopt/optimise.py): the layout and order ILPs against their greedy choices, what the
codegen emits from the plan (run in the Triton interpreter against eager), the shared-memory decline and the
fallback without a solver."""
import itertools
import logging
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on CPU tensors

import pulp  # noqa: E402
import pytest  # noqa: E402
from helpers import assert_close  # noqa: E402

from torch_mirage.codegen.ugraph_triton import emit_block_kernel, layout_rules, module_source  # noqa: E402
from torch_mirage.superopt import attention_seeds, library, optimise, validate  # noqa: E402
from torch_mirage.superopt.builder import new_kernel_graph, new_threadblock_graph  # noqa: E402
from torch_mirage.superopt.compile import compile_ugraph  # noqa: E402
from torch_mirage.superopt.launch import combine_tiling, retile  # noqa: E402
from torch_mirage.superopt.search.generate import Skeleton, SkelOp, to_kernel_graph  # noqa: E402
from torch_mirage.superopt.validate import SMEM_BYTES, InvalidMuGraph  # noqa: E402

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


@pytest.fixture(autouse=True)
def _fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("MIRAGE_CACHE_DIR", str(tmp_path))
    optimise._plan.cache_clear()
    yield
    optimise._plan.cache_clear()


def _body(g):
    return next(op.body for op in g.ops if op.name == "customized")


def scaled_linear(m=6, k=40, n=24, grid=2, forloop_range=4):
    """``x @ (W.t() * s)``: nn.Linear's weight W[N, K], transposed, then scaled per output column (s[N])."""
    g = new_kernel_graph()
    X, W, S = g.new_input((m, k), "float32"), g.new_input((n, k), "float32"), g.new_input((n,), "float32")
    tb = new_threadblock_graph((grid,), forloop_range)
    tX = tb.new_input(X, imap=(None,), fmap=1)
    tW = tb.new_input(W, imap=(0,), fmap=1)
    tS = tb.new_input(S, imap=(0,), fmap=None)
    tb.new_output(tb.forloop_accum(tb.matmul(tX, tb.mul(tb.transpose(tW), tS)), "sum"), omap=(1,))
    (y,) = g.customized([X, W, S], tb)
    g.mark_output(y)
    return g.build()


def two_row_sums(m, k, forloop_range):
    """Row sums of two inputs in one block graph: two independent load -> reduce chains in the for-loop."""
    g = new_kernel_graph()
    X1, X2 = g.new_input((m, k), "float32"), g.new_input((m, k), "float32")
    tb = new_threadblock_graph((1,), forloop_range)
    for t in (tb.new_input(X1, imap=(None,), fmap=1), tb.new_input(X2, imap=(None,), fmap=1)):
        tb.new_output(tb.forloop_accum(tb.reduce_sum(t, dim=1), "sum"), omap=(None,))
    for y in g.customized([X1, X2], tb):
        g.mark_output(y)
    return g.build()


def searched_linear():
    """The search's nn.Linear skeleton: matmul_t(x, W[N, K]) summed over the K loop."""
    sk = Skeleton((1, 1), (SkelOp("matmul_t", (0, 1)), SkelOp("acc_sum", (2,), (("dim", None),))), (3,), 2)
    return to_kernel_graph(sk, [((6, 40), "float32"), ((24, 40), "float32")], grid=(2,), forloop_range=4,
                           imaps=[(None,), (0,)], omap=(1,))


SEEDS = {
    "rmsnorm_linear": library.rmsnorm_linear(3, 15, 21, dtype="float16", grid=3, forloop_range=5),
    "gated_mlp": library.gated_mlp(7, 6, 10, dtype="float32", grid=5, forloop_range=2),
    "lora": library.lora(3, 15, 21, 5, dtype="float16", grid=3, forloop_range=5),
    "gqa_flashdecoding": library.gqa_flashdecoding(2, 3, 5, 12, 7, dtype="float32", splits=3, forloop_range=2),
    "qknorm_attention": library.qknorm_attention(1, 1, 5, 10, 6, dtype="float16", q_blocks=5, forloop_range=2),
    "ntrans": library.ntrans(5, 12, dtype="float32", grid=5),
    "flash_attention_softcap_mask": attention_seeds.flash_attention(2, 2, 8, 32, 16, scale=0.25, softcap=30.0,
                                                                     mask=(1, 2), dtype="float16"),
    "flash_decoding": attention_seeds.flash_decoding(1, 2, 4, 64, 16, scale=0.25, dtype="float32"),
    "searched_linear": searched_linear(),
}


# ------------------------------------------------------------------ layout
def test_layout_ilp_beats_greedy_where_greedy_is_wrong():
    """x @ (W.t() * s): greedy loads W upright, relabels the transpose, then converts it for the scaling (a
    tl.trans read by a multiply); the ILP loads W transposed and converts nothing."""
    bg = _body(scaled_linear())
    w_it = next(i for i, op in enumerate(bg.ops) if op.name == "iterator" and op.attrs["index"] == 1)
    tr = next(i for i, op in enumerate(bg.ops) if op.name == "transpose")
    tile = optimise.nbytes(bg.ops[w_it].shapes[0], "float32")
    greedy, best = optimise.greedy_layout(bg), optimise.ilp_layout(bg)
    assert greedy == {tr} and optimise.layout_cost(bg, greedy) == optimise.CONVERT * tile
    assert best == {w_it} and optimise.layout_cost(bg, best) == optimise.TRANSPOSED_LOAD * tile
    assert optimise.layout_cost(bg, best) < optimise.layout_cost(bg, greedy)
    # the ILP's layout is the least-cost one of all
    flex = sorted(layout_rules(bg).flexible)
    costs = [optimise.layout_cost(bg, {i for i, b in zip(flex, bits) if b})
             for bits in itertools.product((0, 1), repeat=len(flex))]
    assert optimise.layout_cost(bg, best) == min(costs)
    plan = optimise.plan_block(bg, SMEM_BYTES)
    assert plan.transposed == best and plan.solver == "cbc"


@pytest.mark.parametrize("name", list(SEEDS))
def test_layout_ilp_equals_greedy_where_greedy_is_right(name):
    """Seeds and a searched nn.Linear: the greedy layout is free (a transposed K or W goes to tl.dot as a
    tl.trans), the ILP finds the same cost and the plan keeps the emitter's own layout."""
    for op in (o for o in SEEDS[name].ops if o.name == "customized"):
        bg = op.body
        greedy = optimise.greedy_layout(bg)
        assert optimise.layout_cost(bg, optimise.ilp_layout(bg)) == optimise.layout_cost(bg, greedy) == 0
        assert optimise.plan_block(bg, SMEM_BYTES).transposed == layout_rules(bg).default == greedy


def test_transposed_load_in_generated_triton_matches_eager():
    g = scaled_linear()
    gen = torch.Generator().manual_seed(0)
    x, w, s = (torch.randn(sh, generator=gen).to(DEVICE) for sh in ((6, 40), (24, 40), (24,)))
    compiled = compile_ugraph(g, [x, w, s])
    (source,) = compiled.sources
    assert "tl.trans" not in source                                  # W is loaded as K x N: nothing converted
    assert "[:, None] * in1_s1" in source and "[None, :] * in1_s0" in source
    before = module_source([emit_block_kernel(_body(g), [2, 2, 1])])  # the emitter's own layout converts W
    assert before.count("tl.trans") == 1
    (y,) = compiled(x, w, s)
    want = x.double() @ (w.double().t() * s.double())
    assert_close(y, want)


# ------------------------------------------------------------------ order and memory
def _topological_orders(bg, ops):
    """Every order of ``ops`` that respects their dependencies among themselves."""
    inside = set(ops)
    for perm in itertools.permutations(ops):
        pos = {i: k for k, i in enumerate(perm)}
        if all(pos[r[0]] < pos[i] for i in perm for r in bg.ops[i].inputs if r[0] in inside):
            yield list(perm)


def test_order_ilp_beats_depth_order_where_depth_order_is_wrong():
    """Depth order loads both inputs before reducing either; the ILP reduces the first before loading the second.
    Its peak is the least over every topological order of the loop's ops."""
    bg = _body(two_row_sums(16, 64, 4))
    depth = optimise.depth_order(bg)
    best = optimise.ilp_order(bg)
    tile = optimise.nbytes((16, 16), "float32")
    assert optimise.peak(bg, best)[0] < optimise.peak(bg, depth)[0]
    assert optimise.peak(bg, depth)[0] - optimise.peak(bg, best)[0] == tile - optimise.nbytes((16, 1), "float32")
    loop = [i for i in depth if bg.ops[i].name in ("iterator", "reduce_sum")]
    rest = [i for i in depth if i not in loop]
    least = min(optimise.peak(bg, perm + rest)[0] for perm in _topological_orders(bg, loop))
    assert optimise.peak(bg, best)[0] == least
    pos = {i: k for k, i in enumerate(best)}
    assert all(pos[r[0]] < pos[i] for i, op in enumerate(bg.ops) for r in op.inputs)


def shifted_row_moments(m, k, forloop_range):
    """``Σ(x − c)``, ``Σ(x − c)²``, ``Σ(x − c)³`` over the loop with ``c`` (m, 1) loaded once before it: a tile
    made before the loop, read only by the loop's first part and held to its end, over a phase (the accumulators)
    that does not read it (the LayerNorm + GEMV seed's shift by the rows' first column has this form)."""
    g = new_kernel_graph()
    X, C = g.new_input((m, k), "float32"), g.new_input((m, 1), "float32")
    tb = new_threadblock_graph((1,), forloop_range)
    d = tb.sub(tb.new_input(X, imap=(None,), fmap=1), tb.new_input(C, imap=(None,), fmap=None))
    d2 = tb.mul(d, d)
    for t in (d, d2, tb.mul(d2, d)):
        tb.new_output(tb.forloop_accum(tb.reduce_sum(t, dim=1), "sum"), omap=(None,))
    for y in g.customized([X, C], tb):
        g.mark_output(y)
    return g.build()


def test_order_ilp_holds_a_tile_made_before_the_loop_over_a_phase_that_does_not_read_it():
    """The order ILP of a phase with a tile held across it but read by none of its ops (BLOOM's LayerNorm + GEMV,
    fp16 at 256 rows, raised KeyError (2, 0) in the ILP's constraints and sent the whole graph to Inductor): the
    ILP's order is topological, no worse than depth order, and the timeline counts the held tile in every step
    of the phase."""
    bg = _body(shifted_row_moments(16, 64, 4))
    best = optimise.ilp_order(bg)
    pos = {i: k for k, i in enumerate(best)}
    assert sorted(best) == list(range(len(bg.ops)))
    assert all(pos[r[0]] < pos[i] for i, op in enumerate(bg.ops) for r in op.inputs)
    assert optimise.peak(bg, best)[0] <= optimise.peak(bg)[0]
    held = next(i for i, op in enumerate(bg.ops) if op.name == "iterator" and op.shapes[0][1] == 1)
    segs, live = optimise._live(bg, best)
    assert len(segs[2]) == 3, segs                     # three accumulators: the ILP orders that phase
    loop_end = len(segs[0]) + len(segs[1]) + len(segs[2]) - 1
    steps = [k for k, ts in enumerate(live) if any(ref[0] == held for _, ref in ts)]
    assert steps == list(range(steps[0], loop_end + 1)), (steps, segs)


@pytest.mark.parametrize("name", ["rmsnorm_linear", "gated_mlp", "ntrans"])
def test_order_ilp_equals_depth_order_where_depth_order_is_right(name):
    bg = _body(SEEDS[name])
    assert optimise.peak(bg, optimise.ilp_order(bg))[0] == optimise.peak(bg)[0]


def test_a_block_graph_that_fits_only_in_the_planned_order_is_valid_and_emitted_in_it():
    """Two 128 KB tiles: in depth order both live at once (past the H100's 227 KiB), in the plan's order one
    after the other. validate accepts it (its tiles' sum would not fit), and the kernel loads the second input
    only after reducing the first, and matches eager."""
    g = two_row_sums(128, 256, 1)
    bg = _body(g)
    tiles = sum(optimise.nbytes(s, d) for op in bg.ops for s, d in zip(op.shapes, op.dtypes))
    assert tiles > SMEM_BYTES and optimise.peak(bg)[0] > SMEM_BYTES
    plan = optimise.plan_block(bg, SMEM_BYTES)
    assert plan.peak_bytes <= SMEM_BYTES and plan.order != optimise.depth_order(bg) and plan.solver == "cbc"
    validate.validate(g)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(128, 256, generator=gen).to(DEVICE) for _ in range(2)]
    compiled = compile_ugraph(g, xs)
    lines = compiled.sources[0].splitlines()
    first_sum = next(k for k, ln in enumerate(lines) if "tl.sum" in ln)
    loads = [k for k, ln in enumerate(lines) if "tl.load" in ln]
    assert len(loads) == 2 and loads[0] < first_sum < loads[1]
    for y, x in zip(compiled(*xs), xs):
        want = x.double().sum(1, keepdim=True)
        assert_close(y, want)


def test_memory_that_no_order_fits_is_a_clear_decline():
    g = two_row_sums(128, 256, 1)
    (found,) = validate.problems(g, smem_bytes=100 * 1024)
    assert "block-level memory" in found and "capacity 102400" in found and "use smaller tiles" in found
    assert "iterator (op 0) float32[128, 256] 131072 B" in found, found
    with pytest.raises(InvalidMuGraph, match="block-level memory"):
        validate.validate(g, smem_bytes=100 * 1024)


# ------------------------------------------------------------------ fallback, cache, byte-identity
class _BrokenCBC:
    def __init__(self, *args, **kwargs):
        pass

    def actualSolve(self, prob, **kwargs):
        raise pulp.PulpSolverError("cbc crashed")


@pytest.mark.parametrize("how", ["missing", "failing"])
def test_no_solver_gives_the_greedy_plan_with_one_log_line(how, monkeypatch, caplog):
    if how == "missing":
        monkeypatch.setattr(optimise, "pulp", None)
    else:
        monkeypatch.setattr(pulp, "COIN_CMD", _BrokenCBC)
    bg = _body(scaled_linear())
    with caplog.at_level(logging.INFO, logger="torch_mirage"):
        plan = optimise.plan_block(bg, SMEM_BYTES)
        optimise.plan_block(bg, SMEM_BYTES)
    assert plan.solver == "fallback" and plan.transposed == optimise.greedy_layout(bg)
    assert plan.order == optimise.depth_order(bg)
    lines = [r.getMessage() for r in caplog.records if "optimiser" in r.getMessage()]
    assert len(lines) == 1 and "greedy plan" in lines[0], lines


def test_plans_are_cached_by_the_block_graph():
    bg = _body(scaled_linear())
    plan = optimise.plan_block(bg, SMEM_BYTES)
    assert optimise.plan_block(_body(scaled_linear()), SMEM_BYTES) is plan
    assert optimise.plan_block(_body(scaled_linear(grid=1)), SMEM_BYTES) is not plan


def test_a_solved_plan_is_kept_in_the_disk_cache_and_read_back_without_a_solve(tmp_path, monkeypatch):
    """Inside ``plans_kept_in(cache)`` a plan CBC decided is kept on disk; a later process (the memo cleared)
    reads it back without running CBC, the same plan; greedy plans and a cache of another code are not read."""
    from torch_mirage.cache import DiskCache

    bg = _body(two_row_sums(128, 256, 1))          # fits only in the ILP's order
    cache = DiskCache(str(tmp_path / "plans"))
    with optimise.plans_kept_in(cache):
        solved = optimise.plan_block(bg, SMEM_BYTES)
    assert solved.solver == "cbc"
    optimise._plan.cache_clear()

    def no_solve(prob):    # a solve now would give the greedy fallback, not the kept plan
        raise optimise.SolverFailed("CBC ran for a plan the disk cache holds")

    monkeypatch.setattr(optimise, "_solve", no_solve)
    with optimise.plans_kept_in(cache):
        assert optimise.plan_block(bg, SMEM_BYTES) == solved
    optimise._plan.cache_clear()
    # outside the context (no cache): solved again, here by the failing stand-in, so the greedy fallback
    assert optimise.plan_block(bg, SMEM_BYTES).solver == "fallback"
    optimise._plan.cache_clear()
    monkeypatch.setattr(optimise, "_plan_code", lambda: "another code")
    with optimise.plans_kept_in(cache):
        assert optimise.plan_block(bg, SMEM_BYTES).solver == "fallback"


@pytest.mark.parametrize("name", list(SEEDS))
def test_seed_sources_are_byte_identical_under_the_plan(name):
    """The plan changes no seed's generated Triton: its own schedule and a split re-tiling (combine kernel)."""
    g = SEEDS[name]
    for op in (o for o in g.ops if o.name == "customized"):
        ranks = [len(g.ops[r[0]].shapes[r[1]]) for r in op.inputs]
        split = 2 if op.body.forloop_range % 2 == 0 else 1
        for bg, s in ((op.body, 1), (retile(op.body, op.body.grid, op.body.forloop_range), split)):
            plan = optimise.plan_block(bg, SMEM_BYTES)
            combine = combine_tiling(bg, s)
            planned = emit_block_kernel(bg, ranks, "k", s, combine, False, plan.order, plan.transposed).source
            assert planned == emit_block_kernel(bg, ranks, "k", s, combine).source
