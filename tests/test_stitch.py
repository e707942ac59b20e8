"""The stitch partitioner: which ops form which region, dominant ops, schemes, thread mappings, what is left alone."""
import os


import pytest
import torch
import torch.nn.functional as F

from torch_mirage.capture.ops import OpKind
from torch_mirage.codegen.stitch_plan import Scheme, StitchLimits, Strategy
from torch_mirage.context import CompileContext, Target
from torch_mirage.partition.region import Decline, Reason, claims, declines, is_convex
from torch_mirage.partition.stitch import StitchClaimer, _acyclic, choose_mapping
from torch_mirage.testing import models as M
from torch_mirage.testing.aten import trace_ir
from helpers import built_claims

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU kernels run only in Triton's interpreter (TRITON_INTERPRET=1)")


def claim(fn, *inputs, claimer=None):
    graph = trace_ir(fn, *inputs)
    regions = built_claims(claimer or StitchClaimer(), graph, CompileContext.standalone())
    return graph, regions


def op_names(region):
    return sorted(n.op.name for n in region.nodes)


def check_regions_valid(graph, regions):
    seen = set()
    for r in regions:
        assert is_convex(graph, r.nodes)
        assert not any(n.kind in (OpKind.MATMUL, OpKind.OPAQUE) for n in r.nodes)
        assert not seen & {id(n) for n in r.nodes}
        seen |= {id(n) for n in r.nodes}
    group_of = {id(n): i for i, r in enumerate(regions) for n in r.nodes}
    assert _acyclic(graph, group_of), "claimed regions form a cycle"


def test_bert_layer_regions():
    torch.manual_seed(0)
    model = M.BertLayer().eval()
    x, mask = M.bert_inputs(64, 2, 16)
    graph, regions = claim(model, x, mask)
    check_regions_valid(graph, regions)
    by_dom = {}
    for r in regions:
        dom = r.plan.dominants[0].node.op.name if r.plan.dominants else "elementwise"
        by_dom.setdefault(dom, []).append(r)
    # attention softmax with the additive mask, two layer norms (residual adds included), the GELU
    assert len(by_dom["amax"]) == 1 and len(by_dom["var_mean"]) == 2 and len(by_dom["elementwise"]) == 1
    softmax = by_dom["amax"][0]
    assert {"add", "amax", "sub", "exp", "sum", "div"} <= set(op_names(softmax))
    assert [d.node.op.name for d in softmax.plan.dominants] == ["amax", "sum"]
    assert softmax.plan.dominants[1].role == "sub-dominant"
    assert softmax.plan.space == (2, 4, 16, 16)
    for ln in by_dom["var_mean"]:
        assert "add" in op_names(ln) and "rsqrt" in op_names(ln)     # residual add stitched into the norm
        assert any(d.node.op.name == "rsqrt" and d.role == "sub-dominant" for d in ln.plan.dominants)
        assert Scheme.REGIONAL in ln.plan.schemes.values()
    gelu = by_dom["elementwise"][0]
    assert "tanh" in op_names(gelu)
    assert set(gelu.plan.schemes.values()) == {Scheme.LOCAL}
    assert gelu.plan.mapping.strategy is Strategy.ELEMENTWISE


def test_llama_block_regions():
    torch.manual_seed(0)
    cfg = M.LlamaConfig()
    model = M.LlamaBlock(cfg).eval()
    graph, regions = claim(model, *M.llama_inputs(cfg, 2, 16))
    check_regions_valid(graph, regions)
    doms = sorted(r.plan.dominants[0].node.op.name for r in regions if r.plan.dominants)
    assert doms == ["amax", "mean", "mean"]        # causal softmax, two RMSNorms
    causal = next(r for r in regions if r.plan.dominants and r.plan.dominants[0].node.op.name == "amax")
    assert {"where", "amax", "exp", "sum", "div"} <= set(op_names(causal))
    assert "iota" not in op_names(causal)          # int64 index arithmetic stays outside
    silu_mul = [r for r in regions if {"neg", "exp", "div", "mul"} <= set(op_names(r)) and not r.plan.dominants]
    assert len(silu_mul) == 1                      # SwiGLU's silu(a) * b in one kernel
    claimed = {id(n) for r in regions for n in r.nodes}
    assert not any(id(n) in claimed for n in graph.nodes if n.op.name == "iota")


def test_independent_groups_of_one_space_merge():
    def fn(x, y):
        return torch.softmax(x, -1), torch.softmax(y * 2.0, -1)

    graph, regions = claim(fn, torch.randn(6, 40), torch.randn(6, 40))
    assert len(regions) == 1 and regions[0].plan.groups == 2
    assert regions[0].plan.scheme_counts()["independent"] == 1
    graph, regions = claim(fn, torch.randn(6, 40), torch.randn(5, 40))
    assert len(regions) == 2


def test_no_cycle_through_a_matmul():
    def fn(x, w):
        a = torch.exp(x)
        return torch.tanh(a @ w + a)

    graph, regions = claim(fn, torch.randn(8, 8), torch.randn(8, 8))
    check_regions_valid(graph, regions)
    for r in regions:
        names = op_names(r)
        assert not ("exp" in names and "tanh" in names), "exp and tanh would make a cycle through the matmul"


@pytest.mark.parametrize("fn", [
    lambda x: x + 1.0,                        # one cheap elementwise op
    lambda x: x.view(4, 10).t().contiguous(),  # layout only
    lambda x: x.sum(0),                        # reduction over a non-last dim
], ids=["single-cheap-op", "layout-only", "non-last-dim-reduction"])
def test_not_claimed(fn):
    _, regions = claim(fn, torch.randn(10, 4))
    assert regions == []


def test_cpu_without_interpreter_is_unsupported_device():
    """The target comes from the context, not the environment (TRITON_INTERPRET=1 in this process)."""
    graph = trace_ir(lambda x: torch.softmax(x, -1), torch.randn(3, 5))
    outcomes = StitchClaimer().claim(graph, list(graph.nodes), CompileContext.standalone(target=Target.CUDA))
    assert claims(outcomes) == [] and outcomes and all(isinstance(o, Decline) for o in outcomes)
    assert {d.reason for d in declines(outcomes)} == {Reason.UNSUPPORTED_DEVICE}
    assert all("Triton kernels need CUDA" in d.detail for d in outcomes)
    # the same graph on the interpreter target is claimed whole
    (claim,) = StitchClaimer().claim(graph, list(graph.nodes), CompileContext.standalone(target=Target.INTERPRETER))
    assert len(claim.nodes) == len(graph.nodes)


def test_info_for_the_report():
    _, (region,) = claim(lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b),
                         torch.randn(64, 96), torch.randn(96), torch.randn(96))
    info = region.info
    assert info["dominant"].startswith("var_mean")
    assert "rows=64 x 96" in info["thread_mapping"]
    assert os.path.exists(info["kernel_source"])
    assert info["schemes"]["regional"] >= 1


class _Device:
    name = "test device"

    def __init__(self, sm_count=132, smem_per_block=227 * 1024):
        self.sm_count, self.smem_per_block = sm_count, smem_per_block


def test_thread_mapping_choices():
    h100 = _Device()
    # bias_residual_layernorm b=8: many short rows -> horizontal packing, row on chip
    m = choose_mapping(4096 * 8, 768, True, 2, h100)
    assert m.strategy is Strategy.PACKED and m.block_n == 1024 and m.block_m >= 2
    assert m.grid[0] >= 2 * h100.sm_count
    # bert_softmax b=8: rows of 512
    m = choose_mapping(8 * 12 * 512, 512, True, 2, h100)
    assert m.strategy is Strategy.PACKED and m.block_m * m.block_n <= 4096
    # few rows: one row per program so the SMs have work
    m = choose_mapping(64, 512, True, 2, h100)
    assert m.strategy is Strategy.ROW and m.block_m == 1
    # a long row whole in one program's registers when the rows fill the SMs; longer rows, or more tiles than
    # the register file holds: looped (global scheme)
    m = choose_mapping(4096, 32768, True, 2, h100)
    assert m.strategy is Strategy.ROW and m.block_n == 32768 and m.num_warps == 32
    m = choose_mapping(4096, 65536, True, 2, h100)
    assert m.strategy is Strategy.LOOPED and m.block_n <= 8192
    m = choose_mapping(4096, 32768, True, 3, h100)
    assert m.strategy is Strategy.LOOPED
    # the shared-memory budget degrades regional to global
    m = choose_mapping(4096, 4096, True, 3, _Device(smem_per_block=32 * 1024))
    assert m.strategy is Strategy.LOOPED
    # elementwise: 2-D tiles
    m = choose_mapping(512 * 8, 3072, False, 0, h100)
    assert m.strategy is Strategy.ELEMENTWISE and m.block_n == 1024


@pytest.mark.parametrize("rows,row_len", [(1, 65536), (8, 32768), (100, 20000)])
def test_task_splitting_fills_the_device(rows, row_len):
    """Few long rows: each split over programs so that rows x split reaches ~2 waves, pieces in whole chunks."""
    h100 = _Device()
    m = choose_mapping(rows, row_len, True, 2, h100, reduction_passes=1, fusions=("online softmax",))
    assert m.strategy is Strategy.SPLIT and m.grid == (rows, m.split)
    assert m.split_len % m.block_n == 0 and (m.split - 1) * m.split_len < row_len <= m.split * m.split_len
    assert m.split_len >= StitchLimits().min_split_len
    assert rows * m.split >= min(2 * h100.sm_count, rows * (row_len // StitchLimits().min_split_len))
    assert "row split over" in m.describe() and "online softmax" in m.describe()
    # more rows than SMs: one row per program (whole up to 32768, looped beyond); two reduction passes, or
    # splitting switched off: one looped row per program
    assert choose_mapping(4096, row_len, True, 2, h100).strategy is (
        Strategy.ROW if row_len <= StitchLimits().max_row_whole else Strategy.LOOPED)
    assert choose_mapping(rows, row_len, True, 2, h100, reduction_passes=2).strategy is Strategy.LOOPED
    off = choose_mapping(rows, row_len, True, 2, h100, StitchLimits(split=1), reduction_passes=1)
    assert off.strategy is Strategy.LOOPED and off.passes == 2
    # fewer SMs, fewer pieces
    assert choose_mapping(rows, row_len, True, 2, _Device(sm_count=4)).split <= max(1, -(-8 // rows))


@pytest.mark.parametrize("fn,fusion,passes", [
    (lambda x: torch.softmax(x, -1), "online softmax", 2),
    (lambda x: F.layer_norm(x, (x.shape[-1],)), "Welford", 2),
    (lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), None, 2),
    (lambda x: torch.exp(x - x.mean(-1, keepdim=True)).sum(-1, keepdim=True), None, 2),    # no store pass
    (lambda x: x / (x - x.amax(-1, keepdim=True)).sum(-1, keepdim=True), None, 3),   # not exp: two levels
], ids=["softmax", "layer_norm", "rmsnorm", "sum-after-mean", "sum-not-exp"])
def test_long_row_schedule_in_the_plan(fn, fusion, passes):
    """The plan's thread mapping says which reductions share a pass and how often the row is read."""
    limits = StitchLimits(max_row_on_chip=1024, loop_chunk=1024, split=1)
    _, (region,) = claim(fn, torch.randn(3, 3000), claimer=StitchClaimer(limits=limits))
    m = region.plan.mapping
    assert m.strategy is Strategy.LOOPED and m.passes == passes, m.describe()
    assert m.fusions == ((fusion,) if fusion else ())
    assert f"{passes} passes" in region.info["thread_mapping"]
    out = region.kernel(torch.ones(3, 3000) * 0.5)[0]
    torch.testing.assert_close(out, fn(torch.ones(3, 3000) * 0.5))


def test_smem_budget_degrades_schemes_to_global():
    def fn(x):
        return torch.softmax(x, -1)

    import dataclasses
    from torch_mirage.analysis.device import DeviceModel

    h100 = DeviceModel.profile("H100")
    x = torch.randn(4, 4096)
    _, (small,) = claim(fn, x, claimer=StitchClaimer(device=dataclasses.replace(h100, smem_per_block=16 * 1024)))
    _, (big,) = claim(fn, x, claimer=StitchClaimer(device=h100))
    assert not small.plan.mapping.single_pass and Scheme.GLOBAL in small.plan.schemes.values()
    assert big.plan.mapping.single_pass and Scheme.GLOBAL not in big.plan.schemes.values()
    out_small, out_big = small.kernel(x)[0], big.kernel(x)[0]
    torch.testing.assert_close(out_small, torch.softmax(x, -1))
    torch.testing.assert_close(out_big, torch.softmax(x, -1))


def test_regions_below_the_size_threshold_are_left_to_inductor(monkeypatch):
    import torch_mirage
    fn = lambda x: torch.softmax(x * 2, dim=-1)
    x = torch.randn(8, 64)
    monkeypatch.setenv("MIRAGE_MIN_REGION_US", "3")       # 8x64 fp32 is far below 3 µs of traffic on an H100
    small = torch_mirage.explain(fn, x)
    assert all(r.compiled_by != "mirage" for r in small.regions)
    torch._dynamo.reset()
    monkeypatch.setenv("MIRAGE_MIN_REGION_US", "0")
    claimed = torch_mirage.explain(fn, x)
    assert any(r.compiled_by == "mirage" for r in claimed.regions)
