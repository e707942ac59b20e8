"""CUDA-graph safety rules (runtime/cudagraph.cuda_graph_blocker, runtime/choose.draws_random_numbers).

Graphs are traced on the CPU and their values re-labelled as CUDA fake tensors, so the rules are tested
without a GPU; tests/test_gpu_backend.py runs the captured graphs for real.
"""
import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from torch_mirage.runtime.choose import draws_random_numbers
from torch_mirage.runtime.cudagraph import cuda_graph_blocker

aten = torch.ops.aten
_FAKE = FakeTensorMode(allow_non_fake_inputs=True)


def _cuda(t: torch.Tensor) -> torch.Tensor:
    with _FAKE:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")


def traced_on_cuda(fn, *inputs, keep_cpu=()):
    """``fn`` traced to ATen on the CPU, every tensor value re-labelled CUDA except the nodes named in
    ``keep_cpu`` (prefixes); returns the graph and CUDA fake example inputs."""
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if not any(node.name.startswith(k) for k in keep_cpu):
            relabel = lambda v: _cuda(v) if isinstance(v, torch.Tensor) else v
            node.meta["val"] = type(val)(map(relabel, val)) if isinstance(val, (tuple, list)) else relabel(val)
    return gm, [_cuda(x) for x in inputs]


def _node(target, *args, **kwargs) -> fx.Node:
    g = fx.Graph()
    x = g.placeholder("x")
    return g.call_function(target, tuple(x if a == "x" else a for a in args), kwargs)


@pytest.mark.parametrize("target,args,kwargs,random", [
    (aten._scaled_dot_product_flash_attention.default, ("x", "x", "x"), {}, False),
    (aten._scaled_dot_product_flash_attention.default, ("x", "x", "x", 0.1), {}, True),
    (aten._scaled_dot_product_efficient_attention.default, ("x", "x", "x", None, False), {}, False),
    (aten._scaled_dot_product_efficient_attention.default, ("x", "x", "x", None, False, 0.2), {}, True),
    (aten._scaled_dot_product_cudnn_attention.default, ("x", "x", "x", None, False, 0.0, True), {}, False),
    (aten._scaled_dot_product_flash_attention_for_cpu.default, ("x", "x", "x"), {"dropout_p": 0.0}, False),
    (aten.native_dropout.default, ("x", 0.5, False), {}, False),
    (aten.native_dropout.default, ("x", 0.5, True), {}, True),
    (aten.native_dropout.default, ("x", 0.0, True), {}, False),
    (aten.bernoulli.p, ("x", 0.5), {}, True),
    (aten.rand.default, ([4],), {}, True),
    (aten.randn_like.default, ("x",), {}, True),
    (aten.sin.default, ("x",), {}, False),
])
def test_randomness_rules(target, args, kwargs, random):
    assert draws_random_numbers(_node(target, *args, **kwargs)) is random


def test_sdpa_at_dropout_zero_is_captured():
    q = torch.randn(1, 2, 8, 4)
    gm, inputs = traced_on_cuda(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, q, q)
    assert any("scaled_dot_product" in str(n.target) for n in gm.graph.nodes)
    assert cuda_graph_blocker(gm, inputs, "inference") is None


def test_real_randomness_is_refused_with_the_op_named():
    gm, inputs = traced_on_cuda(lambda x: torch.rand_like(x) + x, torch.randn(8))
    why = cuda_graph_blocker(gm, inputs, "inference")
    assert why is not None and why.startswith("random op") and "rand" in why


def test_trace_time_scalar_constant_on_cpu_is_allowed():
    def fn(x):
        return x * torch.tensor(2.0)          # lift_fresh_copy of a CPU constant made while tracing
    gm, inputs = traced_on_cuda(fn, torch.randn(8), keep_cpu=("_tensor_constant", "lift_fresh"))
    assert any(n.op == "get_attr" for n in gm.graph.nodes)
    assert cuda_graph_blocker(gm, inputs, "inference") is None


def test_cpu_values_computed_from_inputs_still_block():
    gm, inputs = traced_on_cuda(lambda x: x.sum() * 2, torch.randn(8), keep_cpu=("sum",))
    assert "CPU tensor produced by aten.sum" in cuda_graph_blocker(gm, inputs, "inference")


def test_non_scalar_cpu_constant_blocks():
    gm, inputs = traced_on_cuda(lambda x: x + torch.tensor([1.0, 2.0]).sum(), torch.randn(8),
                                keep_cpu=("_tensor_constant", "lift_fresh"))
    assert "CPU tensor produced by aten.lift_fresh_copy" in cuda_graph_blocker(gm, inputs, "inference")


def test_writes_to_stable_inputs_are_captured_in_place_others_block():
    def fn(x, cache):
        cache.copy_(x * 2)
        return cache + 1
    gm, inputs = traced_on_cuda(fn, torch.randn(8), torch.zeros(8))
    assert any(str(n.target) == "aten.copy_.default" for n in gm.graph.nodes)
    why = cuda_graph_blocker(gm, inputs, "inference")
    assert why is not None and why.startswith("input mutation") and "not stable" in why
    assert cuda_graph_blocker(gm, inputs, "inference", static_input_indices=(1,)) is None
    assert cuda_graph_blocker(gm, inputs, "inference", static_input_indices=(0,)) is not None


def test_training_graphs_and_cpu_inputs_are_refused():
    gm, inputs = traced_on_cuda(lambda x: x.sin(), torch.randn(8))
    assert cuda_graph_blocker(gm, inputs, "forward").startswith("forward graph")
    assert cuda_graph_blocker(gm, [torch.randn(8)], "inference") == "inputs not all CUDA tensors"
