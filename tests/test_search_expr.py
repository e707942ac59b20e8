"""Abstract expressions (search/expr.py): normal-form laws, and the μGraphs of the
library equal plain kernel-op programs of the same math under A_eq."""
import pickle
import random
from fractions import Fraction

import pytest

from torch_mirage.superopt import library as L
from torch_mirage.superopt.builder import fuse_thread_graphs, new_kernel_graph
from torch_mirage.superopt.search import expr as E
from torch_mirage.superopt.search.expr import add, const, div, fn, graph_exprs, mul, sub, sum_, var

x, y, z, w = (var(i) for i in range(4))


def test_hash_consing_and_ac():
    assert add(x, y) is add(y, x)
    assert mul(x, mul(y, z)) is mul(mul(z, x), y)
    assert add(x, add(y, z)) is add(z, add(y, x))
    assert hash(mul(x, y)) == hash(mul(y, x))
    assert add(x, y) is not mul(x, y)
    assert pickle.loads(pickle.dumps(mul(x, fn("exp", y)))) is mul(x, fn("exp", y))
    assert str(sum_(4, mul(x, y))) == "sum(4, (v0·v1))"


def test_constants_fold():
    assert add(x, const(0)) is x
    assert mul(x, const(1)) is x
    assert mul(const(2), x, const(0.5)) is x
    assert mul(x, const(0)) is const(0)
    assert const(1.0 / 3) is const(Fraction(1, 3))
    assert sub(x, x) is add(x, mul(const(-1), x))       # no cancellation axiom: stays a term


def test_sums():
    assert sum_(1, x) is x
    assert sum_(2, sum_(3, x)) is sum_(6, x)
    assert sum_(2, add(x, y)) is add(sum_(2, x), sum_(2, y))
    assert mul(sum_(4, x), y) is sum_(4, mul(x, y))          # sum(a, x)·y = sum(a, x·y)
    assert mul(sum_(2, x), sum_(3, y)) is sum_(6, mul(x, y))
    assert div(sum_(4, x), y) is sum_(4, div(x, y))
    assert div(x, sum_(4, y)).op == "div"                    # a sum stays under a denominator
    assert fn("exp", sum_(4, x)).args[0] is sum_(4, x)


def test_division():
    assert mul(div(x, z), y) is div(mul(x, y), z)             # x/z·y = (x·y)/z
    assert div(div(x, y), z) is div(x, mul(y, z))
    assert div(x, div(y, z)) is div(mul(x, z), y)
    assert div(x, const(4)) is mul(x, const(Fraction(1, 4)))
    assert add(div(x, z), div(y, z)) is div(add(x, y), z)      # x/z + y/z = (x+y)/z


def test_random_terms_are_order_independent():
    """Building a term from shuffled operands always gives the same object."""
    rng = random.Random(0)
    leaves = [var(i) for i in range(5)] + [const(2), sum_(3, var(1)), fn("silu", var(2))]
    for _ in range(200):
        xs = rng.sample(leaves, rng.randint(2, 5))
        op = rng.choice([add, mul])
        ys = xs[:]
        rng.shuffle(ys)
        assert op(*xs) is op(*ys)
        assert op(xs[0], op(*xs[1:])) is op(op(*xs[1:]), xs[0])


# ------------------------------------------------------------------ μGraph vs plain program
def _plain_rmsnorm_linear(m, k, n, eps=0.0):
    g = new_kernel_graph()
    X, G, W = g.new_input((m, k), "float32"), g.new_input((k,), "float32"), g.new_input((k, n), "float32")
    r = g.rsqrt(g.scalar_add(g.reduce_mean(g.mul(X, X), dim=1), value=eps))
    g.mark_output(g.matmul(g.mul(g.mul(X, r), G), W))
    return g.build()


def _plain_rmsnorm_linear_div(m, k, n, eps=0.0):
    """The same math written another way: x / sqrt(sum(x²)/k + eps), weight after."""
    g = new_kernel_graph()
    X, G, W = g.new_input((m, k), "float32"), g.new_input((k,), "float32"), g.new_input((k, n), "float32")
    ms = g.scalar_mul(g.reduce_sum(g.square(X), dim=1), value=1.0 / k)
    y = g.div(g.mul(G, X), g.sqrt(g.scalar_add(ms, value=eps)))
    g.mark_output(g.matmul(y, W))
    return g.build()


def _plain_gated_mlp(m, k, n):
    g = new_kernel_graph()
    X, W1, W3 = (g.new_input(s, "float32") for s in ((m, k), (k, n), (k, n)))
    g.mark_output(g.mul(g.silu(g.matmul(X, W1)), g.matmul(X, W3)))
    return g.build()


def _plain_lora(m, k, n, r):
    g = new_kernel_graph()
    X, W, A, B = (g.new_input(s, "float32") for s in ((m, k), (k, n), (k, r), (r, n)))
    g.mark_output(g.add(g.matmul(X, W), g.matmul(g.matmul(X, A), B)))
    return g.build()


@pytest.mark.parametrize("schedule", [dict(grid=2, forloop_range=3), dict(grid=1, forloop_range=1),
                                      dict(grid=4, forloop_range=6)])
def test_library_equals_plain_program(schedule):
    m, k, n, r = 4, 12, 8, 2
    assert graph_exprs(L.rmsnorm_linear(m, k, n, **schedule)) == graph_exprs(_plain_rmsnorm_linear(m, k, n))
    assert graph_exprs(L.rmsnorm_linear(m, k, n, **schedule)) == graph_exprs(_plain_rmsnorm_linear_div(m, k, n))
    assert graph_exprs(L.rmsnorm_linear(m, k, n, eps=1e-5, **schedule)) == \
        graph_exprs(_plain_rmsnorm_linear(m, k, n, eps=1e-5))
    assert graph_exprs(L.gated_mlp(m, k, n, **schedule)) == graph_exprs(_plain_gated_mlp(m, k, n))
    assert graph_exprs(L.lora(m, k, n, r, **schedule)) == graph_exprs(_plain_lora(m, k, n, r))
    # thread graphs (fused elementwise chains) are inlined
    assert graph_exprs(fuse_thread_graphs(L.gated_mlp(m, k, n, **schedule))) == graph_exprs(_plain_gated_mlp(m, k, n))


def test_different_math_differs():
    m, k, n, r = 4, 12, 8, 2
    (lib,) = graph_exprs(L.rmsnorm_linear(m, k, n, grid=2, forloop_range=3))
    assert lib != graph_exprs(_plain_rmsnorm_linear(m, k, n, eps=1e-5))[0]
    assert graph_exprs(L.gated_mlp(m, k, n))[0] != graph_exprs(_plain_lora(m, k, n, r))[0]
    # silu on the other matmul: inputs 1 and 2 swap roles
    g = new_kernel_graph()
    X, W1, W3 = (g.new_input(s, "float32") for s in ((m, k), (k, n), (k, n)))
    g.mark_output(g.mul(g.matmul(X, W1), g.silu(g.matmul(X, W3))))
    assert graph_exprs(g.build()) != graph_exprs(L.gated_mlp(m, k, n))


def test_every_op_has_an_expression():
    """Every op of the table used by the library graphs maps to an expression;
    max (non-LAX) is an uninterpreted symbol; online softmax ends as its math."""
    exprs = E.sub_exprs(L.gqa_flashdecoding(1, 2, 4, 8, 4, splits=2, forloop_range=2, q_blocks=1,
                                            combine_q_blocks=1))
    names = {e.attr[0] for t in exprs for e in t.subterms() if e.op == "sym"}
    assert names == {"reduce_max"}
    (nt,) = graph_exprs(L.ntrans(4, 6))
    assert nt.op == "div" and nt.args[1].op == "fn" and nt.args[1].attr == "sqrt"
    assert E.max_(2, E.max_(3, x)) is E.max_(6, x) and E.max_(1, x) is x


def test_flashattention_equals_plain_softmax():
    b, h, sq, kv, d = 1, 2, 4, 8, 4
    g = new_kernel_graph()
    Q, K, V = g.new_input((b, h, sq, d), "float32"), g.new_input((b, h, kv, d), "float32"), \
        g.new_input((b, h, kv, d), "float32")
    s = g.scalar_mul(g.matmul(Q, g.transpose(K)), value=1 / d ** 0.5)
    e = g.exp(g.sub(s, g.reduce_max(s, dim=3)))
    g.mark_output(g.matmul(g.div(e, g.reduce_sum(e, dim=3)), V))
    plain = graph_exprs(g.build())
    for fr in (1, 2, 4):
        assert graph_exprs(L.gqa_flashattention(b, h, sq, kv, d, forloop_range=fr)) == plain
    assert graph_exprs(L.gqa_flashattention(b, h, sq, kv, 2 * d)) != graph_exprs(
        L.gqa_flashattention(b, h, sq, kv, d))
