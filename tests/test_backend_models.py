"""Whole models under backend="mirage" on CPU match eager (fp64 references)."""
import copy

import pytest
import torch

import torch_mirage
from torch_mirage.testing.models import CNN, MLP, BertLayer, LlamaBlock, LlamaConfig, bert_inputs, llama_inputs
from helpers import assert_close


def _check_model(model, inputs, dtype):
    model = model.eval()
    ref = copy.deepcopy(model).double()(*[x.double() if x.is_floating_point() else x for x in inputs])
    model = model.to(dtype)
    inputs = [x.to(dtype) if x.is_floating_point() else x for x in inputs]
    with torch.no_grad():
        report = torch_mirage.explain(model, *inputs)
        torch._dynamo.reset()
        out = torch.compile(model, backend="mirage")(*inputs)
    assert_close(out, ref.to(dtype), dtype)
    assert report.graphs and report.regions
    return report


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlp(dtype):
    _check_model(MLP(), [torch.randn(8, 64)], dtype)


def test_cnn_convs_fall_back():
    report = _check_model(CNN(), [torch.randn(2, 3, 16, 16)], torch.float32)
    conv_regions = [r for r in report.regions if any("convolution" in op for op in r.ops)]
    assert conv_regions and all(r.compiled_by == "inductor" for r in conv_regions)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bert_layer(dtype):
    x, mask = bert_inputs(64, 2, 16)
    _check_model(BertLayer(), [x, mask], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_llama_block(dtype):
    cfg = LlamaConfig()
    _check_model(LlamaBlock(cfg), list(llama_inputs(cfg, 2, 16)), dtype)


def test_training_step_loss_and_grads_match_eager():
    torch.manual_seed(0)
    cfg = LlamaConfig()
    model = LlamaBlock(cfg)
    twin = copy.deepcopy(model)
    x, cos, sin = llama_inputs(cfg, 2, 8)
    target = torch.randn_like(x)

    def step(m, fn):
        m.zero_grad()
        loss = torch.nn.functional.mse_loss(fn(x, cos, sin), target)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in m.parameters()]

    report = torch_mirage.Report()
    compiled = torch.compile(model, backend=torch_mirage.MirageBackend(report=report))
    loss_c, grads_c = step(model, compiled)
    loss_e, grads_e = step(twin, twin)
    assert_close(loss_c, loss_e)
    for gc, ge in zip(grads_c, grads_e):
        assert_close(gc, ge)
    kinds = {g.kind for g in report.graphs}
    assert {"forward", "backward"} <= kinds


def test_training_with_optimizer_two_steps():
    torch.manual_seed(1)
    model = MLP(32, 64)
    twin = copy.deepcopy(model)
    opt_c = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_e = torch.optim.SGD(twin.parameters(), lr=0.1)
    compiled = torch.compile(model, backend="mirage")
    for _ in range(2):
        x = torch.randn(16, 32)
        for m, fn, opt in ((model, compiled, opt_c), (twin, twin, opt_e)):
            opt.zero_grad()
            fn(x).square().mean().backward()
            opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert_close(a, b)
