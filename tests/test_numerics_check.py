"""The check stage's float64 reference: casts written in the graph (``softmax(..., dtype=float32).to(fp16)``)
must not leave the reference with mixed dtypes; a fused SDPA kernel's is SDPA's math path; a NaN reference
passes no kernel."""
import pytest
import torch
import torch.nn.functional as F

from torch_mirage.capture.lower import to_fx
from torch_mirage.partition.region import Reason, Region
from torch_mirage.runtime.measure import numerics_problem
from torch_mirage.testing.aten import trace_ir


def _attention(q, k, v):
    w = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    w = w + torch.full((), -0.5, dtype=q.dtype, device=q.device)
    return torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _qkv(dtype):
    return [torch.randn(2, 5, 8, dtype=dtype), torch.randn(2, 6, 8, dtype=dtype), torch.randn(2, 6, 4, dtype=dtype)]


def _in_graph_order(graph, tensors):
    """Dynamo orders a graph's inputs as it meets them: pick each by its (distinct) shape."""
    by_shape = {tuple(t.shape): t for t in tensors}
    return [by_shape[tuple(v.example.shape)] for v in graph.inputs]


def test_float64_program_of_a_graph_with_casts():
    graph = trace_ir(_attention, *_qkv(torch.float16))
    q, k, v = _qkv(torch.float64)
    (out,) = to_fx(graph, float64=True)(*_in_graph_order(graph, [q, k, v]))
    w = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5 - 0.5
    want = torch.matmul(F.softmax(w, dim=-1), v)                 # the same math with no cast
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


def test_check_against_float64_reports_a_wrong_kernel_instead_of_failing():
    graph = trace_ir(_attention, *_qkv(torch.float16))
    program = to_fx(graph)
    torch.manual_seed(torch.seed() % 1000)

    def off_by_five_percent(*inputs):
        (out,) = program(*inputs)
        return (out * 1.05,)

    def exact(*inputs):
        (out,) = to_fx(graph, float64=True)(*[x.double() for x in inputs])
        return (out.to(torch.float16),)

    region = Region(list(graph.nodes), "mirage", Reason.CLAIMED, kernel=off_by_five_percent)
    problem = numerics_problem(region, graph)
    assert problem is not None and "against float64" in problem, problem
    region.kernel = exact
    assert numerics_problem(region, graph) is None


def test_a_float64_reference_without_a_value_passes_no_kernel(monkeypatch):
    """A kernel off eager by more than the tolerance is passed only by a float64 reference it is near: where the
    reference has NaN (an output the float64 program cannot compute: a fused SDPA op's RNG state), it fails."""
    import torch_mirage.runtime.measure as measure

    graph = trace_ir(_attention, *_qkv(torch.float16))
    program = to_fx(graph)

    def off_by_five_percent(*inputs):
        (out,) = program(*inputs)
        return (out * 1.05,)

    def no_reference(g, float64=False):
        run = to_fx(g, float64=float64)
        return (lambda *xs: tuple(torch.full_like(o, float("nan")) for o in run(*xs))) if float64 else run

    monkeypatch.setattr(measure, "to_fx", no_reference)
    region = Region(list(graph.nodes), "mirage", Reason.CLAIMED, kernel=off_by_five_percent)
    problem = numerics_problem(region, graph)
    assert problem is not None and "against float64" in problem, problem


def _two_layers(x, w1, w2):
    """Two matmuls of one shape on different weights (a model's layers' regions)."""
    h = torch.softmax(x @ w1, dim=-1)
    g = torch.softmax(h @ w2, dim=-1)
    return g, torch.tanh(g)


def test_the_check_runs_once_per_kind_of_region_and_hands_back_each_wrong_one():
    """Regions that run the same code on the same kind of inputs (one check key: the layers of a model) are checked
    once; a region whose kernel differs, or whose key failed, is checked itself."""
    from torch_mirage.capture.ir import subgraph
    from torch_mirage.context import CompileContext, Target
    from torch_mirage.runtime.measure import check_key, check_regions

    xs = [torch.randn(4, 8), torch.randn(8, 8), torch.randn(8, 8)]
    graph = trace_ir(_two_layers, *xs)
    mm = [n for n in graph.nodes if n.target_name == "aten.mm.default"]
    assert len(mm) == 2
    runs = []

    def kernel_of(nodes, scale=1.0):
        program = to_fx(subgraph(graph, nodes, Region(nodes, "mirage", Reason.CLAIMED).outputs(graph)))

        def run(*inputs):
            runs.append(nodes[0].name)
            return tuple(o * scale for o in program(*inputs))
        return run
    layers = [Region([m], "mirage", Reason.CLAIMED, kernel=kernel_of([m])) for m in mm]
    for r in layers:
        r.claimer, r.info = "test", {"ugraph_hash": "same"}
    keys = [check_key(r, graph, subgraph(graph, r.nodes, r.outputs(graph))) for r in layers]
    assert keys[0] == keys[1]
    ctx = CompileContext.standalone(target=Target.INTERPRETER)
    check_regions(layers, graph, ctx)
    assert len(runs) == 1 and all(r.compiled_by == "mirage" for r in layers)

    runs.clear()      # both wrong: the first fails its check, so the second is checked (and fails) too
    for r in layers:
        r.kernel = kernel_of(r.nodes, scale=1.5)
    check_regions(layers, graph, ctx)
    assert len(runs) == 2 and all(r.compiled_by != "mirage" for r in layers)

    runs.clear()      # another μGraph in the second: its own check
    for r, h in zip(layers, ["same", "other"]):
        r.compiled_by, r.kernel, r.info = "mirage", kernel_of(r.nodes), {"ugraph_hash": h}
    check_regions(layers, graph, ctx)
    assert len(runs) == 2 and all(r.compiled_by == "mirage" for r in layers)


def _fused_sdpa_graph(op, q, k, v, bias, **kwargs):
    """One fused SDPA call as the backend lowers it from a CUDA graph (fake CUDA tensors: no GPU needed)."""
    import operator

    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from torch_mirage.capture.lower import lower

    g = fx.Graph()
    names = ["q", "k", "v"] + (["bias"] if bias is not None else [])
    ph = [g.placeholder(n) for n in names]
    args = (*ph[:3], ph[3] if bias is not None else None, False) if "cudnn" in str(op) or "efficient" in str(op) \
        else tuple(ph[:3])
    call = g.call_function(op, args, kwargs)
    g.output((g.call_function(operator.getitem, (call, 0)),))
    gm = fx.GraphModule(torch.nn.Module(), g)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fakes = [torch.empty(t.shape, dtype=torch.bfloat16, device="cuda") if t.is_floating_point()
                 else torch.empty(t.shape, dtype=t.dtype, device="cuda") for t in (q, k, v, bias) if t is not None]
    FakeTensorProp(gm, mode).propagate(*fakes)
    return lower(gm)


@pytest.mark.parametrize("op,gqa,bias,causal", [
    ("_scaled_dot_product_cudnn_attention", True, True, False),
    ("_scaled_dot_product_cudnn_attention", True, True, True),
    ("_scaled_dot_product_cudnn_attention", False, False, True),
    ("_scaled_dot_product_efficient_attention", True, True, False),
    ("_scaled_dot_product_flash_attention", False, False, True)])
def test_the_float64_reference_of_a_fused_sdpa_kernel_is_the_math_path(op, gqa, bias, causal):
    """A fused CUDA SDPA op's float64 reference (the check stage's) is SDPA's math path in float64 — GQA (fewer KV
    heads), an additive bias, causal (top-left, sq < skv), both at once (cuDNN's op takes both; the math path
    one), the scale — never the fused kernel called on float64 inputs; built from fake CUDA tensors, so it runs
    on the CPU."""
    b, h, hk, sq, skv, d = 2, 4, 2 if gqa else 4, 3, 7, 16
    q, k, v = (torch.randn(b, n, s, d, dtype=torch.float64) for n, s in ((h, sq), (hk, skv), (hk, skv)))
    mask = torch.randn(b, 1, sq, skv, dtype=torch.float64) if bias else None
    target = getattr(torch.ops.aten, op).default
    graph = _fused_sdpa_graph(target, q, k, v, mask, is_causal=causal, scale=0.3) if causal else \
        _fused_sdpa_graph(target, q, k, v, mask, scale=0.3)
    (out,) = to_fx(graph, float64=True)(*[t for t in (q, k, v, mask) if t is not None])
    both = causal and mask is not None      # SDPA takes one of them: the causal triangle folded into the bias
    keep = torch.ones(sq, skv, dtype=torch.bool).tril()
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.masked_fill(~keep, float("-inf")) if both else mask,
                                          is_causal=causal and not both, scale=0.3, enable_gqa=gqa)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
def test_the_float64_reference_gives_a_row_with_no_key_zeros(mask_kind):
    """A fused SDPA op's float64 reference (cuDNN's takes HF's bool masks) follows
    ``F.scaled_dot_product_attention``: a bool mask hides keys (the math op called directly adds it as 1 / 0:
    every row with a hidden key was off, torch 2.13, CPU), and a row whose keys it hides whole gives zeros."""
    from torch_mirage.capture.lower import _sdpa_in_float64

    b, h, sq, skv, d = 1, 2, 4, 6, 8
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.float64) for s in (sq, skv, skv))
    keep = torch.rand(b, 1, sq, skv) > 0.3
    keep[..., 0, :] = True
    keep[..., 2, :] = False                            # row 2 sees no key
    mask = keep if mask_kind == "bool" else torch.zeros(b, 1, sq, skv, dtype=torch.float64).masked_fill(
        ~keep, float("-inf"))
    run = _sdpa_in_float64(torch.ops.aten._scaled_dot_product_cudnn_attention.default, [torch.empty(b, h, sq, d)])
    (out,) = run(q, k, v, mask, False, scale=0.3)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    assert torch.equal(out[..., 2, :], torch.zeros_like(out[..., 2, :]))
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
