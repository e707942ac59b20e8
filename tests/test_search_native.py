"""The search generator's C++ core (csrc/search_core.cpp via search/native.py) against its pure-Python path:
the same skeletons, expressions and counts on the same inputs; the fallback when the core is not built."""
import pytest

from torch_mirage.superopt.search import driver as D
from torch_mirage.superopt.search import expr as E
from torch_mirage.superopt.search import native
from torch_mirage.superopt.search.generate import KIND_ORDER, GenStats, enumerate_skeletons
from torch_mirage.superopt.search.oracle import SubexprOracle
from test_search_driver import M, K, N, _gated_mlp, _rms_sum_div_sqrt, _specs
from test_search_reductions import _ntrans_ref, _rms_mean_rsqrt
from torch_mirage.superopt.builder import new_kernel_graph

needs_core = pytest.mark.skipif(native.search_core() is None,
                                reason=f"the C++ search core is not built: {native.why_not()}")

INS = [((4, 8), "float32"), ((8, 6), "float32")]


@pytest.fixture(autouse=True)
def _restore():
    old = native.set_enabled(True)
    yield
    native.set_enabled(old)


def _run(native_flag, inputs, out_shapes, max_ops, **kw):
    st = GenStats()
    got = [(str(s), tuple(map(str, es))) for s, es in enumerate_skeletons(inputs, out_shapes, max_ops=max_ops,
                                                                          stats=st, native=native_flag, **kw)]
    return got, st.as_dict()


def _both(*args, **kw):
    py = _run(False, *args, **kw)
    cpp = _run(True, *args, **kw)
    assert cpp == py
    return py


@needs_core
def test_every_kind_unpruned():
    """No pruning, every op kind (free concat and the LoRA macro included), real abstract expressions."""
    (got, st) = _both(INS, [(4, 6)], 2, kinds=KIND_ORDER, eps_values=(0.0, 1e-6))
    assert got and st["duplicates"] > 0 and st["generated"] > 1000


@needs_core
def test_stand_in_expressions_and_admits():
    """Any hashable expression and admits() the generator is given: the core only looks them up."""
    def expr_of(op, args, ctx, in_shapes):
        return ((op.name, tuple(args)) if op.name not in ("exp", "sqrt") else "reject",)
    (got, st) = _both(INS, [(4, 6)], 2, expr_of=expr_of, admits=lambda e: e != "reject")
    assert got and st["pruned"] > 0


def _lora():
    g = new_kernel_graph()
    X, W, A, B = (g.new_input(s, "float32") for s in ((M, K), (K, N), (K, 4), (4, N)))
    g.mark_output(g.add(g.matmul(g.matmul(X, A), B), g.matmul(X, W)))
    return g.build()


@needs_core
@pytest.mark.parametrize("make,depth", [(_rms_sum_div_sqrt, 5), (_gated_mlp, 4), (_lora, 3),
                                        (lambda: _ntrans_ref(_rms_mean_rsqrt), 6)],
                         ids=["rmsnorm_linear", "gated_mlp", "lora", "ntrans_whole_rows"])
def test_the_search_targets_with_the_oracle(make, depth):
    """The driver's enumeration (oracle pruning, is_target, eps constants, the LoRA concat-matmul macro) on
    its own targets, depth by depth."""
    ref = make()
    specs, targets = _specs(ref), E.graph_exprs(ref)
    outs = [ref.ops[r[0]].shapes[r[1]] for r in ref.outputs]
    found = []
    for d in range(1, depth + 1):
        res = []
        for flag in (False, True):
            oracle = SubexprOracle(targets, use_z3=False)
            res.append(_run(flag, specs, outs, d, exact_ops=True, probe_range=D.probe_range(specs),
                            eps_values=D._eps_values(ref), admits=oracle.admits, kinds=D.op_kinds(targets),
                            is_target=lambda es, o=oracle: [o.equivalent(e) for e in es] == [0]))
        assert res[1] == res[0], f"depth {d}"
        found += res[0][0]
    assert found or make is _gated_mlp        # gated MLP's skeleton has 6 ops: depth 4 is kept short here
    if make is _lora:
        assert any("concat_matmul" in sk for sk, _ in found)


@needs_core
def test_worker_shares():
    """The first-level branches dealt to 3 workers: each share the same on both paths (stats.branch
    included), and together the whole space."""
    whole, _ = _both(INS, [(4, 6)], 2)
    shares = [_both(INS, [(4, 6)], 2, share=(k, 3)) for k in range(3)]
    assert sorted(g for got, _ in shares for g in got) == sorted(whole)
    assert all(st["branch"] >= 0 for _, st in shares)


@needs_core
def test_search_chooses_the_same_ugraph():
    ref = _gated_mlp()
    res = []
    for flag in (False, True):
        native.set_enabled(flag)
        r = D.search(ref, _specs(ref), budget_s=20, tile=8, oracle_kwargs=dict(use_z3=False), workers=1)
        res.append((r.best.hash() if r.best else None, r.stats.generated, r.stats.pruned, r.stats.candidates))
    assert res[0][0] is not None and res[1] == res[0]


def test_fallback_without_the_core(monkeypatch):
    """Core unavailable: the generator runs its Python path; asking for the core says why it is missing."""
    monkeypatch.setattr(native, "_state", {"mod": None, "why": "torch_mirage._C not importable: test"})
    got, st = _run(None, INS, [(4, 6)], 2)
    assert got and st["generated"] > 0
    with pytest.raises(RuntimeError, match="not built .*torch_mirage._C not importable"):
        _run(True, INS, [(4, 6)], 2)


def test_a_core_of_another_abi_is_not_used(monkeypatch):
    import types
    import importlib
    monkeypatch.setattr(importlib, "import_module", lambda name: types.SimpleNamespace(ABI=native.ABI + 1))
    monkeypatch.setattr(native, "_state", {})
    assert native.search_core() is None and "reinstall" in native.why_not()


@needs_core
def test_attention_moves():
    """The online-softmax accumulator (two values) and scalar_mul by the target's temperature: unpruned at depth 2
    and with the oracle at depth 4, where FlashAttention's skeleton is among the candidates."""
    ins = [((1, 2, 4, 8), "float32"), ((1, 2, 16, 8), "float32"), ((1, 2, 16, 8), "float32")]
    g = new_kernel_graph()
    q, k, v = (g.new_input(s, d) for s, d in ins)
    s = g.scalar_mul(g.matmul(q, g.transpose(k)), value=8 ** -0.5)
    e = g.exp(g.sub(s, g.reduce_max(s, dim=3)))
    g.mark_output(g.matmul(g.div(e, g.reduce_sum(e, dim=3)), v))
    ref = g.build()
    targets, scales = E.graph_exprs(ref), D._scale_values(ref, E.graph_exprs(ref))
    assert scales == (8 ** -0.5,)
    kinds = D.op_kinds(targets)
    (got, st) = _both(ins, [(1, 2, 4, 8)], 2, kinds=kinds, scale_values=scales, fmap_choices=[[None], [2], [2]])
    assert st["generated"] > 100
    oracle = SubexprOracle(targets, use_z3=False)
    (got, st) = _both(ins, [(1, 2, 4, 8)], 4, exact_ops=True, kinds=kinds, scale_values=scales,
                      admits=oracle.admits, is_target=lambda es: [oracle.equivalent(e) for e in es] == [0],
                      fmap_choices=[[None], [2], [2]])
    assert any("acc_online_softmax(v4, v2)" in s and "matmul_t" in s for s, _ in got), got
