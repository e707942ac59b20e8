"""Lowering ATen graphs into the IR and back."""
import torch
import torch.nn.functional as F

from torch_mirage.capture.lower import lower, to_fx
from torch_mirage.capture.ops import OpKind
from torch_mirage.testing.aten import trace_aten
from torch_mirage.testing.models import BertLayer, LlamaBlock, LlamaConfig, bert_inputs, llama_inputs
from helpers import assert_close


def _roundtrip(fn, *inputs):
    gm = trace_aten(fn, *inputs)
    graph = lower(gm)
    graph.validate()
    back = to_fx(graph)
    args = [torch.randn(v.meta.shape, dtype=v.meta.dtype) if v.meta.dtype.is_floating_point else v.example
            for v in graph.inputs]   # parameters are graph inputs too
    with torch.no_grad():
        got = back(*args)
        want = gm(*args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    return graph


def test_roundtrip_layernorm_softmax_split():
    def fn(x, w):
        h = F.layer_norm(x, (x.shape[-1],))
        a, b = h.split(4, dim=-1)
        return torch.softmax(a @ w, -1) + b.sum(), torch.var_mean(x, -1)[0]
    graph = _roundtrip(fn, torch.randn(3, 8), torch.randn(4, 4))
    kinds = {n.op.name for n in graph.nodes}
    assert {"var_mean", "matmul", "amax", "exp", "sum", "div", "split"} <= kinds


def test_every_value_has_meta():
    cfg = LlamaConfig()
    graph = _roundtrip(LlamaBlock(cfg).eval(), *llama_inputs(cfg, 2, 8))
    for v in graph.values():
        if isinstance(v.example, torch.Tensor):
            assert v.meta.shape == tuple(v.example.shape) and v.meta.dtype == v.example.dtype
            assert v.meta.stride == tuple(v.example.stride()) and v.meta.device == v.example.device


def test_unknown_ops_are_opaque_and_printed():
    graph = _roundtrip(lambda x: torch.cumsum(x, 0) * 2, torch.randn(5, 3))
    opaque = [n for n in graph.nodes if n.kind is OpKind.OPAQUE]
    assert opaque and "cumsum" in opaque[0].target_name
    text = str(graph)
    assert "opaque<aten.cumsum.default>" in text and "mul(" in text and "float32[5,3]" in text


def test_bert_layer_roundtrip():
    layer = BertLayer().eval()
    x, mask = bert_inputs(64, 2, 8)
    _roundtrip(layer, x, mask)


def test_describe_names_op_shape_dtype():
    graph = lower(trace_aten(lambda x, y: x + y, torch.randn(2, 3, dtype=torch.float16), torch.randn(3, dtype=torch.float16)))
    assert graph.nodes[0].describe() == "aten.add.Tensor(float16[2,3], float16[3])"
