"""Tensor properties (FlashTensor §4) on hand-checked graphs; value properties checked against eager results."""
from __future__ import annotations

import math
import time

import pytest
import torch

from torch_mirage.analysis.properties import ReduceDep, analyze_properties
from torch_mirage.analysis.values import Affine, ValueKind, analyze_values
from torch_mirage.capture.ir import Graph, map_values
from torch_mirage.testing.aten import trace_ir

B, R, N = ReduceDep.BATCH, ReduceDep.REUSE, ReduceDep.NONPARA


def _run_ir(graph: Graph, *inputs: torch.Tensor) -> dict[int, torch.Tensor]:
    """Every IR value's eager result, keyed by ``id(value)``."""
    env = {id(v): x for v, x in zip(graph.inputs, inputs)}
    for node in graph.nodes:
        args, kwargs = map_values((node.args, node.kwargs), lambda v: env[id(v)])
        res = node.target(*args, **kwargs)
        res = list(res) if isinstance(res, (tuple, list)) else [res]
        for v, r in zip(node.outputs, res):
            env[id(v)] = r
    return env


def _index_grid(expr: Affine, shape: tuple) -> torch.Tensor:
    val = torch.full(shape, expr.const, dtype=torch.int64)
    for d, c in expr.terms:
        idx = torch.arange(shape[d]).view([-1] + [1] * (-d - 1))
        val = val + c * idx
    return val


def _check_value(p, t: torch.Tensor) -> int:
    """Assert that the property ``p`` holds for tensor ``t``; 1 if something was checked."""
    t = t.double() if t.dtype != torch.bool else t
    if p.kind is ValueKind.CONSTANT:
        expect = torch.full(t.shape, float(p.fill), dtype=t.dtype)
        assert torch.equal(t, expect), f"{p} does not hold"
    elif p.kind is ValueKind.AFFINE:
        assert torch.equal(t.long(), _index_grid(p.expr, tuple(t.shape)).expand(t.shape))
    elif p.kind is ValueKind.MASK:
        assert torch.equal(t, (_index_grid(p.expr, tuple(t.shape)) >= 0).expand(t.shape))
    elif p.kind is ValueKind.PIECEWISE:
        pred = (_index_grid(p.expr, tuple(t.shape)) >= 0).expand(t.shape)
        for side, where in ((p.inside, pred), (p.outside, ~pred)):
            if side.is_constant:
                assert torch.equal(t[where], torch.full_like(t[where], float(side.fill))), f"{p}: {side} fails"
    else:
        return 0
    return 1


def _check_all_values(graph: Graph, *inputs: torch.Tensor) -> int:
    env = _run_ir(graph, *inputs)
    props = analyze_properties(graph)
    return sum(_check_value(props.value(v), env[id(v)]) for v in graph.values() if v.is_tensor)


def _producer(graph: Graph, op: str, nth: int = 0) -> Value:
    return [n for n in graph.nodes if n.op.name == op][nth].outputs[0]


def _softmax(x):
    return torch.softmax(x, dim=-1)


def test_softmax_rows_batch_last_dim_nonpara():
    g = trace_ir(_softmax, torch.randn(6, 33))
    props = analyze_properties(g)
    x, out = g.inputs[0], g.output_values[0]
    assert [p.reduce_dep for p in props.dims(x)] == [B, N]
    assert [p.reduce_dep for p in props.dims(out)] == [B, N]
    assert props.grid_dims(out) == [0]
    amax = _producer(g, "amax")
    assert [p.broadcast for p in props.dims(amax)] == [False, True]   # the row max is broadcast along the row
    assert [p.size for p in props.dims(x)] == [6, 33]


def test_layer_norm_rows_reuse_weights():
    def ln(x, w, b):
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b)
    g = trace_ir(ln, torch.randn(5, 24), torch.randn(24), torch.randn(24))
    props = analyze_properties(g)
    x, w, b = g.inputs
    # the affine weights are broadcast over rows: rows are parallel with reuse; the normalised dim is reduced
    assert props.reduce_deps(x) == [R, N]
    assert props.reduce_deps(w) == [N] and props.reduce_deps(b) == [N]
    assert props.grid_dims(g.output_values[0]) == [0]


def _h2o(q, k, v):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    n = s.shape[-1]
    mask = torch.full((n, n), float("-inf")).triu(1)
    p = torch.softmax(s + mask, dim=-1)
    return p @ v, p.sum(dim=-2)


def _attention(q, k, v):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(s, dim=-1) @ v


def test_h2o_two_reductions_leave_only_batch_and_heads():
    qkv = [torch.randn(2, 3, 16, 8) for _ in range(3)]
    g = trace_ir(_h2o, *qkv)
    props = analyze_properties(g)
    p = _producer(g, "div", 1)             # softmax's division: P
    assert tuple(p.meta.shape) == (2, 3, 16, 16)
    assert props.reduce_deps(p) == [B, B, N, N]
    assert props.grid_dims(p) == [0, 1]
    q = g.inputs[0]
    assert props.reduce_deps(q)[:2] == [B, B] and props.reduce_deps(q)[2:] == [N, N]


def test_attention_without_column_sum_keeps_query_dim_parallel():
    qkv = [torch.randn(2, 3, 16, 8) for _ in range(3)]
    g = trace_ir(_attention, *qkv)
    props = analyze_properties(g)
    p = _producer(g, "div", 1)
    assert props.reduce_deps(p)[2] is not N and props.reduce_deps(p)[3] is N
    assert props.grid_dims(p) == [0, 1, 2]


def test_matmul_chain_backward_propagation():
    def chain(x, w1, w2):
        return (x @ w1) @ w2
    g = trace_ir(chain, torch.randn(8, 16), torch.randn(16, 24), torch.randn(24, 32))
    props = analyze_properties(g)
    x, w1, w2 = g.inputs
    z = g.output_values[0]
    assert props.reduce_deps(x) == [R, N]
    assert props.reduce_deps(w1) == [N, N]       # N1 is the K dim of the second matmul (FlashTensor Fig. 8b)
    assert props.reduce_deps(w2) == [N, R]
    assert props.reduce_deps(z) == [R, R]
    first = analyze_properties(g, [g.nodes[0]])   # the first matmul as a kernel of its own
    assert first.reduce_deps(w1) == [N, R]


def test_bmm_batch_dims_are_batch():
    g = trace_ir(lambda a, b: torch.bmm(a, b), torch.randn(4, 8, 16), torch.randn(4, 16, 8))
    props = analyze_properties(g)
    assert props.reduce_deps(g.output_values[0]) == [B, R, R]


def test_reductions_negative_dims_keepdim_and_multi_dim():
    def f(x):
        return x.sum(dim=-2), x.amax(dim=(0, 2), keepdim=True), torch.var_mean(x, dim=1, correction=0)
    g = trace_ir(f, torch.randn(3, 5, 7))
    props = analyze_properties(g, [g.nodes[0]])
    assert props.reduce_deps(g.inputs[0]) == [B, N, B]
    amax = _producer(g, "amax")
    p2 = analyze_properties(g, [amax.producer])
    assert p2.reduce_deps(g.inputs[0]) == [N, B, N] and p2.reduce_deps(amax) == [N, B, N]
    whole = analyze_properties(g)
    assert whole.reduce_deps(g.inputs[0]) == [N, N, N]


def test_view_that_splits_a_reduced_dim_links_conservatively():
    g = trace_ir(lambda x: x.view(4, 4, 3).sum(-1), torch.randn(4, 12))
    props = analyze_properties(g)
    view = _producer(g, "view")
    assert props.reduce_deps(g.inputs[0]) == [B, N]
    assert props.reduce_deps(view) == [B, N, N]   # the kept half of the split dim is linked to the reduced half


def test_causal_mask_from_iota_compare_is_a_triangle():
    def causal(s):
        n = s.shape[-1]
        i = torch.arange(n)
        return torch.where(i[:, None] >= i[None, :], s, float("-inf")).softmax(-1)
    s = torch.randn(2, 11, 11)
    g = trace_ir(causal, s)
    props = analyze_properties(g)
    ge = _producer(g, "ge")
    mask = props.value(ge)
    assert mask.kind is ValueKind.MASK and mask.is_triangle
    where = props.value(_producer(g, "where"))
    assert where.is_triangle and where.constant_where(-math.inf) is not None
    assert _check_all_values(g, s) >= 5


def test_h2o_values_match_eager():
    qkv = [torch.randn(1, 2, 9, 4) for _ in range(3)]
    g = trace_ir(_h2o, *qkv)
    props = analyze_properties(g)
    p = props.value(_producer(g, "div", 1))
    assert p.is_triangle and p.constant_where(0.0) is not None    # P is zero above the diagonal
    assert _check_all_values(g, *qkv) >= 8


@pytest.mark.parametrize("offset", [-2, 0, 3])
def test_tril_offsets_and_ne_inf_fill(offset):
    def f(x):
        n = x.shape[-1]
        m = torch.ones(n, n, dtype=torch.bool).tril(offset)
        return x.masked_fill(~m, float("-inf")), torch.full_like(x, float("-inf")).exp() + x * 0
    x = torch.randn(3, 7, 7)
    g = trace_ir(f, x)
    assert _check_all_values(g, x) >= 3
    props = analyze_properties(g)
    masked = props.value(g.output_values[0])
    assert masked.is_triangle and masked.constant_where(-math.inf) is not None


def test_minus_inf_fill_is_constant():
    def f(x):
        m = torch.full((x.shape[0], x.shape[1]), float("-inf"))
        return x + m, torch.exp(m)
    x = torch.randn(4, 5)
    g = trace_ir(f, x)
    props = analyze_properties(g)
    add, exp = g.output_values
    m = _producer(g, "full")
    assert props.value(m).is_constant and props.value(m).fill == -math.inf
    assert props.value(exp).is_constant and props.value(exp).fill == 0.0
    assert not props.value(add).known      # exact on whole tensors: x = +inf or NaN would not give -inf
    assert _check_all_values(g, x) >= 2


def test_masked_side_assumes_finite_but_whole_tensors_stay_exact():
    def f(x):
        n = x.shape[-1]
        i = torch.arange(n)
        s = x + torch.where(i[:, None] >= i[None, :], 0.0, float("-inf"))
        return s * 1, x * 0
    x = torch.randn(5, 5)
    g = trace_ir(f, x)
    props = analyze_properties(g)
    s1, zero = g.output_values
    assert props.value(s1).constant_where(-math.inf) is not None   # through the identity x * 1
    assert not props.value(zero).known
    assert _check_all_values(g, x) >= 4


def test_padding_mask_gathered_from_ones_keeps_the_causal_triangle():
    """transformers 5.17's causal mask: the triangle ANDed with a padding mask indexed out of an all-ones tensor
    (BLOOM's prompt without a mask); a gather of a constant is that constant, so the triangle survives. A gather
    of data is not known."""
    def mask(x, data):
        n = x.shape[-1]
        pad = torch.ones(2, n).to(torch.bool)
        b, kv = torch.arange(2)[:, None, None, None], torch.arange(n)[None, None, None, :]
        q = torch.arange(n)[None, None, :, None]
        keep = (kv <= q) & pad[b, kv]
        return torch.where(keep, 0.0, float("-inf")) + x, data[b, kv]
    x, data = torch.randn(2, 1, 6, 6), torch.randn(2, 6)
    g = trace_ir(mask, x, data)
    props = analyze_properties(g)
    masked, gathered = g.output_values
    assert props.value(masked).constant_where(-math.inf) is not None and props.value(masked).is_triangle
    assert not props.value(gathered).known
    assert _check_all_values(g, x, data) >= 4


def _positions_mask(x, start: int = 0):
    """transformers 5.24's causal mask for positions derived in the graph (no ``position_ids`` passed): the
    positions gathered per (batch, query) and (batch, key) index, ANDed with its packed-sequence check (a cumsum
    of where the positions do not step by one, all 0 here)."""
    b, n = x.shape[0], x.shape[-1]
    pos = (torch.arange(n) + start).unsqueeze(0)
    e = pos.expand(b, -1)
    c = torch.cat([e[:, 0:1] - 1, e], -1)
    seq = ((c[..., 1:n + 1] - c[..., 0:n]) != 1).cumsum(-1)
    bi = torch.arange(b)[:, None, None, None]
    qi, ki = torch.arange(n)[None, None, :, None], torch.arange(n)[None, None, None, :]
    keep = qi.new_ones((), dtype=torch.bool) & (e[bi, ki] <= e[bi, qi]) & (seq[bi, qi] == seq[bi, ki])
    return torch.where(keep.expand(b, -1, n, n), 0.0, float("-inf")) + x


@pytest.mark.parametrize("start", [0, 3])
def test_positions_gathered_by_index_keep_the_causal_triangle(start):
    """Index arithmetic through a slice with an offset, a cat of one expression's pieces, a cumsum of a constant
    and advanced indexing by index tensors: the mask HF builds from positions is still the causal triangle, and
    every value the analysis claims holds in eager."""
    x = torch.randn(2, 1, 7, 7)
    g = trace_ir(lambda x: _positions_mask(x, start), x)
    props = analyze_properties(g)
    out = props.value(g.output_values[0])
    assert out.is_triangle and out.constant_where(-math.inf) is not None, str(out)
    assert props.value(_producer(g, "cat")).kind is ValueKind.AFFINE
    assert _check_all_values(g, x) >= 30


def test_a_compare_no_index_can_change_is_a_constant():
    """Indices are >= 0: ``i + j >= 0`` holds everywhere and ``-i - 1 >= 0`` nowhere, so both are constants (and a
    ``where`` over them one of its sides); ``i - j >= 0`` stays a mask."""
    def f(x):
        i, j = torch.arange(x.shape[0])[:, None], torch.arange(x.shape[1])
        return torch.where(i + j >= 0, 0.0, float("-inf")) + x, (-i - 1) >= 0, i - j >= 0
    x = torch.randn(5, 6)
    g = trace_ir(f, x)
    props = analyze_properties(g)
    always, never, tri = (props.value(v) for v in g.output_values)
    assert not always.known          # x itself: the where was the constant 0
    assert props.value(_producer(g, "where")).is_constant and props.value(_producer(g, "where")).fill == 0.0
    assert never.is_constant and never.fill is False and tri.kind is ValueKind.MASK
    assert _check_all_values(g, x) >= 6


@pytest.mark.parametrize("window", [3, 256])
def test_a_sliding_window_wider_than_the_prompt_is_the_causal_triangle(window):
    """Gemma-2's sliding-window mask ANDs ``j > i - window`` with ``j <= i``: over a prompt no longer than the
    window the first holds for every index below the sizes, and the mask is the causal triangle; a narrower
    window is two half-planes, not one (not known)."""
    def f(x):
        n = x.shape[-1]
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        keep = torch.ones((), dtype=torch.bool) & (j > i - window) & (j <= i)
        return torch.where(keep, 0.0, float("-inf")) + x
    x = torch.randn(2, 7, 7)
    g = trace_ir(f, x)
    props = analyze_properties(g)
    out = props.value(g.output_values[0])
    assert (out.is_triangle and out.constant_where(-math.inf) is not None) == (window >= 7), str(out)
    assert _check_all_values(g, x) >= 6


def test_gather_by_data_and_a_cat_of_different_pieces_are_not_known():
    """Gathers at data-dependent or wrapping (negative) indices and a cat of two expressions are not known."""
    def f(x):
        n = x.shape[-1]
        i = torch.arange(n)
        return torch.cat([i[:2], i[:3]]), i[x.argmax(-1)], torch.cat([i, i * 2]).cumsum(0), i[i - 1]
    x = torch.randn(4, 6)
    g = trace_ir(f, x)
    props = analyze_properties(g)
    assert all(not props.value(v).known for v in g.output_values)
    assert _check_all_values(g, x) >= 2


def test_opaque_ops_neither_link_nor_fail():
    g = trace_ir(lambda x: torch.sort(x, dim=-1).values.sum(-1), torch.randn(4, 9))
    props = analyze_properties(g)
    assert props.reduce_deps(g.inputs[0]) == [B, B]   # the sort is a kernel boundary
    assert "%" in str(props)


def test_str_is_readable():
    g = trace_ir(_softmax, torch.randn(2, 3))
    text = str(analyze_properties(g))
    assert "2:B 3:N" in text and len(text.splitlines()) == len([v for v in g.values() if v.is_tensor])


def test_analysis_is_fast_on_a_decoder_sized_graph():
    def block(x, w, g1, wq, wk, wv, wo):
        h = x
        for _ in range(4):
            r = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * g1
            q, k, v = (r @ wq).view(2, 8, 4, 8), (r @ wk).view(2, 8, 4, 8), (r @ wv).view(2, 8, 4, 8)
            a = torch.softmax(q.transpose(1, 2) @ k.permute(0, 2, 3, 1) / 8 ** 0.5, -1) @ v.transpose(1, 2)
            h = h + a.transpose(1, 2).reshape(2, 8, 32) @ wo
            h = h + torch.nn.functional.silu(h @ w) * h
        return h
    ins = [torch.randn(2, 8, 32), torch.randn(32, 32), torch.randn(32)] + [torch.randn(32, 32) for _ in range(4)]
    g = trace_ir(block, *ins)
    assert len(g.nodes) > 100
    t0 = time.perf_counter()
    values = analyze_values(g.nodes)
    analyze_properties(g, values=values)
    for n in g.nodes:
        analyze_properties(g, [n], values=values)
    assert time.perf_counter() - t0 < 1.0
