"""Device model and roofline cost model: bytes, flops, boundedness and parallelism on known shapes."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from torch_mirage.analysis.cost import CostModel, CostModelError, is_compute_bound, real_bytes, region_io
from torch_mirage.analysis import device as device_module
from torch_mirage.analysis.device import DeviceModel, calibrate
from torch_mirage.analysis.properties import analyze_properties
from torch_mirage.testing.aten import trace_ir

H100 = DeviceModel.profile("H100")
f16 = torch.float16
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _trace(fn, *shapes, dtype=f16):
    """The IR of ``fn`` traced on fake inputs of ``shapes``: nothing runs, so large shapes cost nothing."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch_mirage.capture.lower import lower

    inputs = [torch.empty(s, dtype=dtype) for s in shapes]
    gm = make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*inputs)
    gm.graph.eliminate_dead_code()
    return lower(gm)


def _bias_gelu(x, b):
    return torch.nn.functional.gelu(x + b, approximate="tanh")


def test_bias_gelu_region_reads_and_writes_once():
    m, n = 512, 3072
    g = _trace(_bias_gelu, (m, n), (n,))
    cost = CostModel(H100).region_cost(g.nodes, g)
    assert cost.bytes == 2 * m * n * 2 + n * 2
    assert cost.bound == "memory" and cost.kernels == 1
    assert cost.flops == sum(node.op.flops for node in g.nodes) * m * n   # every node is elementwise over (m, n)
    floor_us = cost.bytes / H100.bandwidth * 1e6
    assert cost.predicted_us == pytest.approx(floor_us + H100.kernel_overhead_s * 1e6)


def test_intermediates_used_outside_are_written():
    g = trace_ir(lambda x, b: (x + b, torch.tanh(x + b)), torch.randn(64, 32, dtype=f16), torch.randn(32, dtype=f16))
    add = next(n for n in g.nodes if n.op.name == "add")
    ins, outs = region_io(g.nodes, g)
    assert {v.name for v in ins} == {v.name for v in g.inputs}
    assert add.outputs[0] in outs and len(outs) == 2
    assert CostModel(H100).region_cost(g.nodes, g).bytes == 3 * 64 * 32 * 2 + 32 * 2


def _rmsnorm_linear(x, w_norm, w):
    r = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * w_norm
    return r @ w


def test_rmsnorm_linear_matmul_flops_and_bytes():
    m, k, n = 16, 256, 512
    g = trace_ir(_rmsnorm_linear, torch.randn(m, k, dtype=f16), torch.randn(k, dtype=f16), torch.randn(k, n, dtype=f16))
    mm = next(node for node in g.nodes if node.op.name == "matmul")
    model = CostModel(H100)
    assert model.node_cost(mm).flops == 2 * m * n * k
    whole = model.region_cost(g.nodes, g)
    assert whole.bytes == (m * k + k + k * n + m * n) * 2
    assert whole.flops > 2 * m * n * k


@pytest.mark.parametrize("device", ["H100", "H200", "A100"])
def test_matmul_bound_by_intensity_not_op_type(device):
    dev = DeviceModel.profile(device)
    skinny = _trace(torch.mm, (16, 4096), (4096, 4096))
    square = _trace(torch.mm, (4096, 4096), (4096, 4096))
    model = CostModel(dev)
    c_skinny, c_square = model.node_cost(skinny.nodes[0]), model.node_cost(square.nodes[0])
    assert c_skinny.intensity < dev.balance_point(f16) < c_square.intensity
    assert not is_compute_bound(skinny.nodes[0], dev) and c_skinny.bound == "memory"
    assert is_compute_bound(square.nodes[0], dev) and c_square.bound == "compute"
    assert c_square.flops == 2 * 4096 ** 3


def test_fp32_matmul_uses_cuda_core_rate():
    g = _trace(torch.mm, (1024, 1024), (1024, 1024), dtype=torch.float32)
    cost = CostModel(H100).node_cost(g.nodes[0])
    assert cost.compute_us == pytest.approx(2 * 1024 ** 3 / H100.peak_fp32_flops * 1e6)


def test_broadcast_input_counts_its_real_size():
    g = trace_ir(lambda x, b: x * b.expand(256, 128), torch.randn(256, 128, dtype=f16), torch.randn(1, 128, dtype=f16))
    mul = next(n for n in g.nodes if n.op.name == "mul")
    expanded = next(v for v in mul.inputs if v.producer is not None and v.producer.op.name == "expand")
    assert real_bytes(expanded.meta) == 128 * 2   # stride-0 rows are one row in memory
    assert CostModel(H100).region_cost([mul], g).bytes == 256 * 128 * 2 * 2 + 128 * 2


def test_views_alone_are_free():
    g = trace_ir(lambda x: x.view(8, 4, 4).permute(0, 2, 1), torch.randn(8, 16))
    cost = CostModel(H100).region_cost(g.nodes, g)
    assert cost.bytes == 0 and cost.kernels == 0 and cost.predicted_us == 0.0


def test_parallelism_scales_time_when_tasks_are_few():
    model = CostModel(H100)
    rows = _trace(lambda x: x.sum(-1), (1024, 512))
    total = _trace(lambda x: x.sum(), (1024, 512))
    c_rows, c_total = model.region_cost(rows.nodes, rows), model.region_cost(total.nodes, total)
    assert c_rows.parallel_tasks == 1024 and c_total.parallel_tasks == 1
    assert c_total.memory_us == pytest.approx(c_rows.memory_us, rel=1e-2)
    launch_us = H100.kernel_overhead_s * 1e6
    slowdown = (c_total.predicted_us - launch_us) / (c_rows.predicted_us - launch_us)
    assert slowdown == pytest.approx(H100.sm_count, rel=1e-2)


def test_matmul_parallelism_counts_reuse_tiles():
    g = _trace(torch.mm, (16, 512), (512, 1024))
    cost = CostModel(H100).node_cost(g.nodes[0])
    assert cost.parallel_tasks == 16 * (1024 // CostModel.reuse_tile)   # M below one tile counts whole


def test_given_properties_are_used():
    g = trace_ir(lambda x: torch.softmax(x, -1), torch.randn(300, 64))
    props = analyze_properties(g, g.nodes)
    assert CostModel(H100).region_cost(g.nodes, g, props).parallel_tasks == 300


def test_symbolic_shapes_raise_a_clear_error():
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch_mirage.capture.lower import lower

    gm = make_fx(lambda x: torch.softmax(x, -1), decomposition_table=select_decomp_table(),
                 tracing_mode="symbolic")(torch.randn(4, 16))
    g = lower(gm)
    props = analyze_properties(g)   # the property analysis itself works on symbolic sizes
    assert props.grid_dims(g.inputs[0]) == [0]
    with pytest.raises(CostModelError, match="static shapes"):
        CostModel(H100).region_cost(g.nodes, g)


def test_device_profiles():
    assert DeviceModel.profile("NVIDIA H100 80GB HBM3") is H100
    assert DeviceModel.for_cpu() is H100
    a100, h200 = DeviceModel.profile("A100"), DeviceModel.profile("h200")
    assert (H100.sm_count, h200.sm_count, a100.sm_count) == (132, 132, 108)
    assert H100.bandwidth == H100.measured_copy_bandwidth < H100.mem_bandwidth
    assert a100.bandwidth == a100.mem_bandwidth           # no measurement on record
    assert H100.balance_point(f16) == pytest.approx(H100.measured_matmul_flops / H100.measured_copy_bandwidth)
    assert H100.balance_point(torch.float32) < H100.balance_point(f16)
    with pytest.raises(KeyError, match="known"):
        DeviceModel.profile("V100")
    with pytest.raises(dataclasses.FrozenInstanceError):
        H100.sm_count = 1


def test_blocks_per_wave_limits():
    assert H100.blocks_per_wave(1024) == 2 * 132                      # thread limit
    assert H100.blocks_per_wave(64) == 32 * 132                       # block limit
    assert H100.blocks_per_wave(256, smem_bytes=100 * 1024) == 2 * 132
    assert H100.blocks_per_wave(256, smem_bytes=300 * 1024) == 0      # does not fit one block


def test_no_cuda_graph_uses_measured_launch_overhead_when_known():
    dev = H100.with_measurements(launch_overhead_s=5e-6)
    assert CostModel(dev, cuda_graph=False).kernel_overhead_s == 5e-6
    assert CostModel(dev, cuda_graph=True).kernel_overhead_s == H100.kernel_overhead_s
    assert CostModel(H100, cuda_graph=False).kernel_overhead_s == H100.kernel_overhead_s


def test_current_without_cuda_is_the_cpu_profile():
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    assert DeviceModel.current() is DeviceModel.for_cpu()


@pytest.mark.gpu
@gpu
def test_current_reads_the_device():
    dev = DeviceModel.current()
    props = torch.cuda.get_device_properties(0)
    assert dev.sm_count == props.multi_processor_count and dev.l2_bytes == props.L2_cache_size
    assert dev.source.startswith("cuda:")
    assert 1e11 < dev.mem_bandwidth < 2e13 and 1e12 < dev.peak_fp16_flops < 1e16
    print(dev)


@pytest.mark.gpu
@pytest.mark.gpu_alone
@gpu
def test_calibrate_measures_below_the_datasheet():
    dev = calibrate()
    assert 0.5 * dev.mem_bandwidth < dev.measured_copy_bandwidth <= 1.05 * dev.mem_bandwidth
    assert 0.3 * dev.peak_fp16_flops < dev.measured_matmul_flops <= 1.1 * dev.peak_fp16_flops
    assert 0 < dev.kernel_overhead_s < 2e-5 and 0 < dev.launch_overhead_s < 1e-4
    print(dev)


def _fake_cuda(monkeypatch, **props):
    from types import SimpleNamespace
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda idx: SimpleNamespace(**props))
    monkeypatch.setattr(device_module, "_nvml_figures", lambda idx: {})   # not the real GPU's NVML


def test_current_on_a_known_device_keeps_datasheet_peaks(monkeypatch):
    _fake_cuda(monkeypatch, name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132,
               max_threads_per_multi_processor=2048, L2_cache_size=50 * 2 ** 20, warp_size=32,
               memory_bus_width=5120, memory_clock_rate=2_619_000, clock_rate=1_980_000)
    dev = DeviceModel.current()
    assert dev.source == "cuda:0" and dev.peak_fp16_flops == H100.peak_fp16_flops
    assert dev.mem_bandwidth == pytest.approx(3.35e12, rel=0.01)   # bus width x memory clock x 2
    assert dev.measured_copy_bandwidth == H100.measured_copy_bandwidth
    assert dev.smem_per_block == H100.smem_per_block                # not reported by this torch: profile figure


def test_current_on_an_unknown_device_derives_peaks(monkeypatch):
    _fake_cuda(monkeypatch, name="NVIDIA H100 PCIe", major=9, minor=0, multi_processor_count=114,
               L2_cache_size=50 * 2 ** 20, clock_rate=1_755_000)
    dev = DeviceModel.current()
    assert dev.sm_count == 114 and dev.measured_copy_bandwidth is None and dev.measured_matmul_flops is None
    assert dev.peak_fp16_flops == pytest.approx(114 * 2048 * 2 * 1.755e9)
    assert dev.clock_hz == 1.755e9


def test_current_reads_nvml_once_per_device(monkeypatch):
    """NVML's figures (the board's maxima) are read once per device in a process, not at every
    ``DeviceModel.current()`` (each read initialises and shuts NVML down)."""
    _fake_cuda(monkeypatch, name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132,
               L2_cache_size=50 * 2 ** 20, clock_rate=1_980_000)
    reads = []
    monkeypatch.setattr(device_module, "_nvml_figures", lambda idx: reads.append(idx) or {"clock_hz": 1.5e9})
    first, second = DeviceModel.current(), DeviceModel.current()
    assert reads == [0] and first.clock_hz == second.clock_hz == 1.5e9
