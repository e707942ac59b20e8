"""Stitch kernels against eager (fp64 references): odd shapes, broadcast, strides, -inf masks, NaN; and end to end.

Kernels run on CPU tensors under TRITON_INTERPRET=1 (tests/conftest.py sets it when there is no GPU).
"""
import os


import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close, built_claims
from torch_mirage.testing.functions import (bert_softmax, bias_gelu, bias_residual_layernorm, layer_norm,
                                            padding_mask, rmsnorm, softmax)
from torch_mirage.codegen.stitch_plan import StitchLimits, Strategy
from torch_mirage.context import CompileContext
from torch_mirage.partition.stitch import StitchClaimer
from torch_mirage.testing.aten import trace_ir

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU kernels run only in Triton's interpreter (TRITON_INTERPRET=1)")


# ------------------------------------------------------------------ the workloads, as model authors write them

def _rows(shape, dtype):
    return torch.randn(*shape, dtype=dtype)


def _vec(n, dtype):
    return torch.randn(n, dtype=dtype)


def _mask(shape, dtype):
    return padding_mask(shape[0], shape[-1], dtype)


CASES = {
    "softmax": (softmax, lambda s, dt: (_rows(s, dt),)),
    "layer_norm": (layer_norm, lambda s, dt: (_rows(s, dt), _vec(s[-1], dt), _vec(s[-1], dt))),
    "rmsnorm": (rmsnorm, lambda s, dt: (_rows(s, dt), _vec(s[-1], dt))),
    "bias_gelu": (bias_gelu, lambda s, dt: (_rows(s, dt), _vec(s[-1], dt))),
    "bias_residual_layernorm": (bias_residual_layernorm, lambda s, dt: (
        _rows(s, dt), _vec(s[-1], dt), _rows(s, dt), _vec(s[-1], dt), _vec(s[-1], dt))),
}
SHAPES = [(1, 1), (3, 17), (4097, 33), (7, 1), (1, 65536), (2, 3, 40)]


def stitched(fn, *inputs, limits=None):
    """The single stitch region covering ``fn``'s graph, and a callable running its kernel on ``inputs``."""
    graph = trace_ir(fn, *inputs)
    regions = built_claims(StitchClaimer(limits=limits), graph, CompileContext.standalone())
    assert len(regions) == 1, [r.ops for r in regions]
    region = regions[0]
    assert len(region.nodes) == len(graph.nodes), "the region should hold the whole graph"
    # Dynamo orders graph inputs by first use: the workloads use their arguments in order; check it
    assert [(tuple(v.meta.shape), v.meta.stride) for v in graph.inputs] == \
        [(tuple(t.shape), t.stride()) for t in inputs], "graph inputs are not in argument order"
    by_value = {id(v): t for v, t in zip(graph.inputs, inputs)}
    outs = region.kernel(*[by_value[id(v)] for v in region.inputs])
    assert [id(v) for v in region.outputs(graph)] == [id(v) for v in graph.output_values]
    return region, outs


def reference(fn, *inputs):
    return fn(*[t.double() if t.is_floating_point() else t for t in inputs])


def assert_matches(out, ref, dtype):
    """Same NaN and inf positions as eager, close elsewhere."""
    assert out.shape == ref.shape and out.dtype == dtype
    o, r = out.double(), ref.double()
    assert torch.equal(torch.isnan(o), torch.isnan(r)), "NaN positions differ from eager"
    assert torch.equal(torch.isinf(o), torch.isinf(r)) and torch.equal(o[torch.isinf(o)], r[torch.isinf(r)])
    fin = torch.isfinite(r)
    if fin.any():
        assert_close(o[fin], r[fin], dtype)


# one long row (1 x 65536) only for softmax and layer norm: they cover task splitting, test_long_rows_* the rest
_EAGER_CASES = [(name, shape) for name in sorted(CASES) for shape in SHAPES
                if shape != (1, 65536) or name in ("softmax", "layer_norm")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name,shape", _EAGER_CASES, ids=lambda c: c if isinstance(c, str) else "x".join(map(str, c)))
def test_against_eager(name, shape, dtype):
    torch.manual_seed(hash((name, shape)) % 1000)
    fn, make = CASES[name]
    inputs = make(shape, dtype)
    region, (out,) = stitched(fn, *inputs)
    assert_matches(out, reference(fn, *inputs).to(dtype), dtype)
    if shape == (1, 65536):    # one long row: split over programs (task splitting) on the default H100 profile
        assert region.plan.mapping.strategy is Strategy.SPLIT and region.plan.mapping.split > 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 3, 5, 17), (2, 12, 9, 512)], ids=lambda s: "x".join(map(str, s)))
def test_bert_softmax_with_mask(shape, dtype):
    torch.manual_seed(1)
    s, mask = _rows(shape, dtype), _mask(shape, dtype)
    region, (out,) = stitched(bert_softmax, s, mask)
    assert_matches(out, reference(bert_softmax, s, mask).to(dtype), dtype)
    assert region.plan.dominants[0].node.op.name == "amax"


def test_all_minus_inf_row_gives_nan_like_eager():
    x = torch.randn(4, 19)
    x[1] = float("-inf")
    x[2, :5] = float("-inf")
    _, (out,) = stitched(softmax, x)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[[0, 2, 3]]).any()
    assert_matches(out, reference(softmax, x).float(), torch.float32)


# long rows forced through the looped and split strategies at interpreter-friendly sizes
LOOPED = StitchLimits(max_row_on_chip=1024, loop_chunk=1024, split=1)
SPLIT = StitchLimits(max_row_on_chip=1024, loop_chunk=1024, split=4)
WHOLE = StitchLimits(max_row_on_chip=256, max_row_whole=2048)   # rows >= the SM count: each row whole
LONG_PATHS = {"in-registers": ((5, 23), None, Strategy.ROW), "looped": ((3, 5000), LOOPED, Strategy.LOOPED),
              "split": ((3, 20000), SPLIT, Strategy.SPLIT), "whole-long-row": ((140, 1500), WHOLE, Strategy.ROW)}


@pytest.mark.parametrize("path", sorted(LONG_PATHS))
def test_nan_propagates_through_reductions(path):
    shape, limits, _ = LONG_PATHS[path]
    x = torch.randn(*shape)
    x[1, 3] = float("nan")
    for fn in (softmax, lambda t: t.amax(-1, keepdim=True) * 2.0, lambda t: t.amin(-1, keepdim=True) + 1.0,
               lambda t: F.layer_norm(t, (t.shape[-1],))):
        _, (out,) = stitched(fn, x, limits=limits)
        ref = reference(fn, x).float()
        assert torch.isnan(out[1]).all()
        assert_matches(out, ref, torch.float32)


def test_maximum_and_relu_propagate_nan():
    x = torch.randn(6, 10)
    x[2, 2] = float("nan")

    def fn(t):
        return torch.relu(t * 2.0) + torch.clamp_min(t, 0.5)

    _, (out,) = stitched(fn, x)
    assert_matches(out, reference(fn, x).float(), torch.float32)


def test_strided_and_broadcast_inputs():
    base = torch.randn(33, 12)
    x = base.t()                                  # (12, 33), strides (1, 12)
    col = torch.randn(12, 1)                      # per-row operand
    w = torch.randn(33)

    def fn(a, v, c):
        return torch.softmax(a * v + c, -1) * torch.sigmoid(c)

    _, (out,) = stitched(fn, x, w, col)
    assert_matches(out, reference(fn, x, w, col).float(), torch.float32)


def test_outputs_of_several_kinds():
    """A row-level output (keepdim=False), a tile output and an intermediate read outside are all stored."""
    x = torch.randn(9, 21)

    def fn(t):
        m = t.mean(-1)
        c = t - t.mean(-1, keepdim=True)
        return m, c.exp(), c * 3.0

    graph = trace_ir(fn, x)
    regions = built_claims(StitchClaimer(), graph, CompileContext.standalone())
    assert len(regions) == 1
    outs = regions[0].kernel(x)
    refs = reference(fn, x)
    by_id = {id(v): o for v, o in zip(regions[0].outputs(graph), outs)}
    for v, r in zip(graph.output_values, refs):
        assert_matches(by_id[id(v)], r.float(), torch.float32)


def test_interpreter_flag_is_picked_up():
    region, _ = stitched(softmax, torch.randn(2, 8))
    import sys
    mod = next(m for m in list(sys.modules.values())
               if getattr(m, "__file__", None) == region.info["kernel_source"])
    assert type(mod.stitch_kernel).__name__ == "InterpretedFunction"


# ------------------------------------------------------------------ end to end through the backend

def test_backend_runs_stitch_regions():
    import torch_mirage
    from torch_mirage.backend import MirageBackend

    def fn(x, w, b):
        return F.layer_norm(torch.softmax(x, -1) * 3.0 + x, (x.shape[-1],), w, b)

    x, w, b = torch.randn(37, 45), torch.randn(45), torch.randn(45)
    compiled = torch.compile(fn, backend=MirageBackend(options={"cuda_graphs": False}))
    assert_close(compiled(x, w, b), fn(x, w, b))
    torch._dynamo.reset()
    report = torch_mirage.explain(fn, x, w, b, options={"cuda_graphs": False})
    mirage = [r for r in report.regions if r.compiled_by == "mirage"]
    assert mirage and all(r.claimer == "stitch" for r in mirage)
    assert any("amax" in " ".join(r.ops) and "var_mean" in " ".join(r.ops) for r in mirage)
    assert "thread_mapping" in mirage[0].info and "dominant" in mirage[0].info


def test_generated_source_shape():
    """Row on chip: one straight-line pass, each input loaded once. Looped: one pass per reduction level + stores."""
    region, _ = stitched(softmax, torch.randn(3, 100))
    src = open(region.info["kernel_source"]).read()
    body = src.split("def stitch_kernel")[1]
    assert "for start" not in body and body.count("tl.load(") == 1 and body.count("tl.store(") == 1
    region, _ = stitched(softmax, torch.randn(2, 5000), limits=LOOPED)
    body = open(region.info["kernel_source"]).read().split("def stitch_kernel")[1]
    assert body.count("for start in range(0, N, BLOCK_N):") == 2    # online max + sum, normalise-and-store
    assert body.count("tl.load(") == 2 and "online softmax, 2 passes" in region.info["thread_mapping"]
    region, _ = stitched(lambda x: F.layer_norm(x, (x.shape[-1],)), torch.randn(2, 5000), limits=LOOPED)
    body = open(region.info["kernel_source"]).read().split("def stitch_kernel")[1]
    assert body.count("for start in range(0, N, BLOCK_N):") == 2    # Welford mean + M2, store
    assert "Welford, 2 passes" in region.info["thread_mapping"]
    region, _ = stitched(softmax, torch.randn(1, 20000), limits=SPLIT)
    src = open(region.info["kernel_source"]).read()
    assert "def stitch_partials" in src and src.count("for start in range(lo, lo + 5120, BLOCK_N):") == 2
    assert "row split over 4 programs" in region.info["thread_mapping"]


# ------------------------------------------------------------------ long rows: fewer passes, task splitting

def _long_inputs(name, shape, dtype):
    """Inputs with the awkward rows: a normal row, one all -inf (softmax) or NaN row, -inf masks."""
    x = torch.randn(*shape, dtype=dtype)
    if name == "softmax":
        x[0, : shape[-1] // 3] = float("-inf")
        if shape[0] > 2:
            x[1] = float("-inf")
            x[2, 17] = float("nan")
        return (x,)
    if name == "bert_softmax":
        s = x.view(1, shape[0], 1, shape[-1])
        if shape[0] > 2:
            s[0, 1, 0] = float("-inf")
            s[0, 2, 0, 5] = float("nan")
        return s, padding_mask(1, shape[-1], dtype)
    w = torch.randn(shape[-1], dtype=dtype)
    x = x + 100.0                                    # a large mean: sum-of-squares variance would lose it
    if shape[0] > 2:
        x[2, 11] = float("nan")
    return (x, w, torch.randn(shape[-1], dtype=dtype)) if name == "layer_norm" else (x, w)


LONG_FNS = {"softmax": (softmax, "online softmax"), "bert_softmax": (bert_softmax, "online softmax"),
            "layer_norm": (layer_norm, "Welford"), "rmsnorm": (rmsnorm, None)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("path", ["looped", "split"])
@pytest.mark.parametrize("name", sorted(LONG_FNS))
def test_long_rows_against_eager(name, path, dtype):
    shape, limits, strategy = LONG_PATHS[path]
    torch.manual_seed(hash((name, path)) % 1000)
    fn, fusion = LONG_FNS[name]
    inputs = _long_inputs(name, shape if dtype is torch.float32 else (1,) + shape[1:], dtype)
    region, (out,) = stitched(fn, *inputs, limits=limits)
    m = region.plan.mapping
    assert m.strategy is strategy and m.passes == 2, m.describe()     # two reads of the row, one write
    assert (fusion in m.fusions) if fusion else not m.fusions
    if strategy is Strategy.SPLIT:
        assert m.split == 4 and m.grid == (m.rows, 4) and (m.split - 1) * m.split_len < m.row_len
    assert_matches(out, reference(fn, *inputs).to(dtype), dtype)


@pytest.mark.parametrize("path", ["looped", "split"])
def test_long_rows_with_row_outputs(path):
    """keepdim=False row outputs next to tile outputs: each row's value stored once, also when the row is split."""
    shape, limits, _ = LONG_PATHS[path]
    x = torch.randn(*shape)

    def fn(t):
        v, mu = torch.var_mean(t, -1, keepdim=True)
        return t.mean(-1), (t - t.amax(-1, keepdim=True)).exp(), v * 2.0 + mu

    graph = trace_ir(fn, x)
    (region,) = built_claims(StitchClaimer(limits=limits), graph, CompileContext.standalone())
    assert region.plan.mapping.strategy is LONG_PATHS[path][2]
    outs = dict(zip([id(v) for v in region.outputs(graph)], region.kernel(x)))
    for v, r in zip(graph.output_values, reference(fn, x)):
        assert_matches(outs[id(v)], r.float(), torch.float32)


def _safe_softmax(t):
    """What SDPA's math path computes (and what HF BERT's prefill without a mask reaches): softmax whose all -inf
    rows give zeros, through ``all(x == -inf)`` — a bool reduction (``aten.any``) next to the float ones."""
    return torch.ops.aten._safe_softmax(t, -1)


@pytest.mark.parametrize("path", sorted(LONG_PATHS))
def test_safe_softmax_is_one_region_on_every_path(path):
    shape, limits, strategy = LONG_PATHS[path]
    x = torch.randn(*shape)
    x[0, : shape[-1] // 3] = float("-inf")   # a partly masked row
    x[1] = float("-inf")                     # a fully masked row: zeros, not NaN
    if shape[0] > 2:
        x[2, 7] = float("nan")               # NaN stays NaN
    region, (out,) = stitched(_safe_softmax, x, limits=limits)
    assert region.plan.mapping.strategy is strategy
    assert "any" in {n.op.name for n in region.nodes}
    assert (out[1] == 0).all()
    assert_matches(out, reference(_safe_softmax, x).float(), torch.float32)
