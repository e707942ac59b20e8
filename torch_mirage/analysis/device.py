"""The device model: the figures of one GPU that the cost model and the launch planner read.

:meth:`DeviceModel.current` reads the real device (``torch.cuda.get_device_properties`` and, for memory bus width,
memory clock and SM clock, nvidia-ml-py's ``pynvml``); every figure a driver or torch version may not expose falls
back to the named profile that matches the device name. :meth:`DeviceModel.profile` gives datasheet profiles (H100,
H200, A100) for analysis on a machine without a GPU; :meth:`DeviceModel.for_cpu` is the H100 profile, the device the
project's benchmarks run on (DESIGN.md). :func:`calibrate` measures copy bandwidth, matmul rate and per-kernel
overheads on the GPU and returns the model with those measurements, which then take precedence over datasheet figures.

Sources: SM counts, shared memory, L2, bandwidth and FLOP rates are NVIDIA datasheet / architecture whitepaper
figures (H100 SXM5, H200 SXM, A100 SXM4 80GB); H200's 60 MB L2 is what ``get_device_properties`` reports on it.
Measured H100 figures (3.0 TB/s copy, 771 TFLOP/s fp16 matmul) are DESIGN.md's; H200's 4.3 TB/s copy is the figure
given in the lead's brief for issue 3. The per-kernel overhead inside a CUDA graph (2.2 µs) is DESIGN.md's H100
rows for single-kernel graphs at b = 1: bias_gelu 4.3 µs measured against a 2.1 µs floor, ntrans 2.4 against 0.1.
The launch overhead outside a CUDA graph has no measurement on record until :func:`calibrate` runs.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..timing import side_stream

log = logging.getLogger("torch_mirage")

KB, MB = 1024, 1024 * 1024

# Fused multiply-adds per clock per SM by compute capability (NVIDIA architecture whitepapers):
# dense fp16/bf16 tensor cores, and fp32 on CUDA cores. Also the hardware limit of resident blocks per SM.
_FMA_TENSOR_FP16 = {(8, 0): 1024, (8, 6): 512, (8, 9): 512, (9, 0): 2048, (10, 0): 4096}
_FMA_FP32 = {(8, 0): 64, (8, 6): 128, (8, 9): 128, (9, 0): 128, (10, 0): 128}
_MAX_BLOCKS_PER_SM = {(8, 0): 32, (8, 6): 16, (8, 9): 24, (9, 0): 32, (10, 0): 32}


@dataclass(frozen=True)
class DeviceModel:
    name: str
    sm_count: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    max_threads_per_block: int
    smem_per_block: int          # bytes, the opt-in maximum for one block
    smem_per_sm: int             # bytes
    regs_per_sm: int
    l2_bytes: int
    mem_bandwidth: float         # bytes / s, datasheet (bus width x memory clock x 2)
    peak_fp16_flops: float       # dense tensor-core fp16 / bf16
    peak_fp32_flops: float       # CUDA cores, no TF32
    clock_hz: float              # max SM clock
    warp_size: int = 32
    kernel_overhead_s: float = 2.2e-6          # per kernel inside a CUDA graph (module docstring: source)
    launch_overhead_s: float | None = None     # per kernel launched from the host; None: not measured
    measured_copy_bandwidth: float | None = None   # bytes / s
    measured_matmul_flops: float | None = None     # fp16 mm, FLOP / s
    source: str = "profile"

    # ------------------------------------------------------------------ derived figures
    @property
    def bandwidth(self) -> float:
        """Bytes / s the cost model uses: measured copy bandwidth when known, else the datasheet figure."""
        return self.measured_copy_bandwidth or self.mem_bandwidth

    def matmul_flops(self, dtype: torch.dtype = torch.float16) -> float:
        """FLOP / s of a matmul in ``dtype`` (fp16 / bf16 on tensor cores; fp32 without TF32 on CUDA cores)."""
        if dtype in (torch.float16, torch.bfloat16):
            return self.measured_matmul_flops or self.peak_fp16_flops
        return self.peak_fp32_flops

    @property
    def vector_flops(self) -> float:
        """FLOP / s of elementwise and reduction arithmetic (fp32 in registers)."""
        return self.peak_fp32_flops

    def balance_point(self, dtype: torch.dtype = torch.float16, tensor_cores: bool = True) -> float:
        """FLOP per byte above which work is compute-bound (roofline ridge point)."""
        flops = self.matmul_flops(dtype) if tensor_cores else self.vector_flops
        return flops / self.bandwidth

    def blocks_per_wave(self, threads_per_block: int, smem_bytes: int = 0, regs_per_thread: int = 32) -> int:
        """How many blocks run at once (AStitch's C_blocks-per-wave) under thread, block, smem and register limits."""
        per_sm = [self.max_blocks_per_sm, self.max_threads_per_sm // max(threads_per_block, 1),
                  self.regs_per_sm // max(regs_per_thread * threads_per_block, 1)]
        if smem_bytes:
            per_sm.append(self.smem_per_sm // smem_bytes if smem_bytes <= self.smem_per_block else 0)
        return max(min(per_sm), 0) * self.sm_count

    def with_measurements(self, **figures: Any) -> "DeviceModel":
        return dataclasses.replace(self, **figures)

    # ------------------------------------------------------------------ constructors
    @staticmethod
    def profile(name: str) -> "DeviceModel":
        key = name.upper().replace("NVIDIA", "").strip()
        for prefix, p in _PROFILES.items():
            if key.startswith(prefix):
                return p
        raise KeyError(f"no device profile {name!r}; known: {', '.join(_PROFILES)}")

    @staticmethod
    def for_cpu() -> "DeviceModel":
        """The profile used when there is no GPU: H100, the device DESIGN.md's benchmarks and floors are for."""
        return _PROFILES["H100"]

    @staticmethod
    def current(device: Any = None) -> "DeviceModel":
        """The model of ``device`` (default: the current CUDA device), or :meth:`for_cpu` without CUDA."""
        if not torch.cuda.is_available():
            return DeviceModel.for_cpu()
        idx = torch.device("cuda" if device is None else device).index
        idx = torch.cuda.current_device() if idx is None else idx
        return _from_cuda(idx)


_PROFILES: dict[str, DeviceModel] = {
    "H100": DeviceModel(
        name="H100 SXM5 80GB", sm_count=132, max_threads_per_sm=2048, max_blocks_per_sm=32, max_threads_per_block=1024,
        smem_per_block=227 * KB, smem_per_sm=228 * KB, regs_per_sm=65536, l2_bytes=50 * MB,
        mem_bandwidth=3.35e12, peak_fp16_flops=989.4e12, peak_fp32_flops=66.9e12, clock_hz=1.98e9,
        measured_copy_bandwidth=3.0e12, measured_matmul_flops=771e12, source="profile H100"),
    "H200": DeviceModel(
        name="H200 SXM 141GB", sm_count=132, max_threads_per_sm=2048, max_blocks_per_sm=32, max_threads_per_block=1024,
        smem_per_block=227 * KB, smem_per_sm=228 * KB, regs_per_sm=65536, l2_bytes=60 * MB,
        mem_bandwidth=4.8e12, peak_fp16_flops=989.4e12, peak_fp32_flops=66.9e12, clock_hz=1.98e9,
        measured_copy_bandwidth=4.3e12, source="profile H200"),
    "A100": DeviceModel(
        name="A100 SXM4 80GB", sm_count=108, max_threads_per_sm=2048, max_blocks_per_sm=32, max_threads_per_block=1024,
        smem_per_block=163 * KB, smem_per_sm=164 * KB, regs_per_sm=65536, l2_bytes=40 * MB,
        mem_bandwidth=2.039e12, peak_fp16_flops=312e12, peak_fp32_flops=19.5e12, clock_hz=1.41e9,
        source="profile A100"),
}


def _nvml_figures(idx: int) -> dict[str, float]:
    """Memory bandwidth and max SM clock from NVML; empty when pynvml or a query is unavailable."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - NVML is optional
        log.debug("device model: NVML unavailable (%s)", e)
        return {}
    out: dict[str, float] = {}
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(idx)
        try:
            bus_bits = pynvml.nvmlDeviceGetMemoryBusWidth(h)
            mem_mhz = pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM)
            out["mem_bandwidth"] = bus_bits / 8 * mem_mhz * 1e6 * 2
        except Exception as e:  # noqa: BLE001
            log.debug("device model: NVML memory figures unavailable (%s)", e)
        try:
            out["clock_hz"] = pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM) * 1e6
        except Exception as e:  # noqa: BLE001
            log.debug("device model: NVML SM clock unavailable (%s)", e)
    finally:
        pynvml.nvmlShutdown()
    return out


@functools.lru_cache(maxsize=None)
def _nvml_figures_once(idx: int, read) -> dict[str, float]:
    """``read(idx)`` (:func:`_nvml_figures`) once per device and reader in this process: NVML's figures are the
    board's maxima, and each read initialises and shuts down NVML, where :meth:`DeviceModel.current` is asked
    for by every cost model and claimer (keyed by the reader too, so a test that substitutes it reads its own)."""
    return dict(read(idx))


def _from_cuda(idx: int) -> DeviceModel:
    p = torch.cuda.get_device_properties(idx)
    try:
        base = DeviceModel.profile(p.name)
    except KeyError:
        base = None
    matched = base is not None and base.sm_count == p.multi_processor_count   # not e.g. an H100 PCIe
    if not matched:
        base = DeviceModel.for_cpu()
        log.info("device model: no profile for %r; figures the device does not report come from %s",
                 p.name, base.name)
    cc = (p.major, p.minor)
    fig = dict(
        sm_count=p.multi_processor_count,
        max_threads_per_sm=getattr(p, "max_threads_per_multi_processor", base.max_threads_per_sm),
        max_blocks_per_sm=_MAX_BLOCKS_PER_SM.get(cc, base.max_blocks_per_sm),
        max_threads_per_block=getattr(p, "max_threads_per_block", base.max_threads_per_block),
        smem_per_block=getattr(p, "shared_memory_per_block_optin", base.smem_per_block),
        smem_per_sm=getattr(p, "shared_memory_per_multiprocessor", base.smem_per_sm),
        regs_per_sm=getattr(p, "regs_per_multiprocessor", base.regs_per_sm),
        l2_bytes=getattr(p, "L2_cache_size", base.l2_bytes),
        warp_size=getattr(p, "warp_size", base.warp_size),
    )
    bus, mclk, clk = (getattr(p, a, 0) for a in ("memory_bus_width", "memory_clock_rate", "clock_rate"))
    if bus and mclk:
        fig["mem_bandwidth"] = bus / 8 * mclk * 1e3 * 2
    if clk:
        fig["clock_hz"] = clk * 1e3
    fig.update(_nvml_figures_once(idx, _nvml_figures))
    fig.setdefault("mem_bandwidth", base.mem_bandwidth)
    fig.setdefault("clock_hz", base.clock_hz)
    if not matched and cc in _FMA_TENSOR_FP16:
        fig["peak_fp16_flops"] = fig["sm_count"] * _FMA_TENSOR_FP16[cc] * 2 * fig["clock_hz"]
        fig["peak_fp32_flops"] = fig["sm_count"] * _FMA_FP32[cc] * 2 * fig["clock_hz"]
    if not matched:   # measurements of another device do not apply
        fig.update(measured_copy_bandwidth=None, measured_matmul_flops=None)
    return dataclasses.replace(base, name=p.name, source=f"cuda:{idx}", **fig)


def calibrate(model: DeviceModel | None = None, device: Any = None, iters: int = 20) -> DeviceModel:
    """Measure copy bandwidth, fp16 matmul rate and per-kernel overheads on the GPU; ``model`` with those figures."""
    if not torch.cuda.is_available():
        raise RuntimeError("calibrate() needs a CUDA device; use DeviceModel.profile(...) for analysis without one")
    model = model or DeviceModel.current(device)
    dev = torch.device("cuda" if device is None else device)

    def timed(fn, n: int) -> float:
        fn()
        torch.cuda.synchronize(dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / n

    nbytes = max(8 * model.l2_bytes, 1 << 30) // 2 * 2
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=dev)
    dst = torch.empty_like(src)
    copy_bw = 2 * nbytes / timed(lambda: dst.copy_(src), iters)
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.float16, device=dev)
    mm_rate = 2 * 8192 ** 3 / timed(lambda: torch.mm(a, a), iters)
    del a
    tiny = torch.zeros(1, device=dev)
    n = 200
    launch = timed(lambda: tiny.add_(1), n)
    stream = side_stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        tiny.add_(1)
    torch.cuda.current_stream(dev).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            tiny.add_(1)
    in_graph = timed(graph.replay, 5) / n
    return model.with_measurements(measured_copy_bandwidth=copy_bw, measured_matmul_flops=mm_rate,
                                   launch_overhead_s=launch, kernel_overhead_s=in_graph,
                                   source=model.source + " + calibrate()")
