"""Roofline cost of IR nodes and of candidate regions (one kernel each).

A region reads each external input once and writes each external output once (bytes from the values' metadata;
an expanded / broadcast value counts its real elements; inputs that only pass through views, and views of external
inputs that leave the region, count nothing). Flops come from the op table (``flops`` per output element for
elementwise ops, per input element for reductions, ``2·M·N·K`` for a matmul). Time is

    max(bytes / bandwidth, matmul_flops / matmul_rate + other_flops / vector_rate) / utilisation + kernel overhead

where utilisation is ``min(1, parallel_tasks / SMs)`` and the parallel tasks come from the region's iteration axes
(FlashTensor: BATCH axes count every index, REUSE axes count tiles of :attr:`CostModel.reuse_tile` once longer than a
tile, NONPARA axes count one). A region with one task (a full reduction) is predicted SMs times slower: AStitch's
task splitting is the partitioner's answer to that, not the model's. Whether work is compute- or memory-bound is decided by its arithmetic intensity
against the device's balance point for the region's mix of arithmetic (PowerFusion), never by op type.
The model needs static shapes: symbolic sizes raise :class:`CostModelError`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence


from ..capture.ir import Graph, Node, TensorMeta, Value
from ..capture.ops import OpKind
from .device import DeviceModel
from .op_dims import matmul_operands, reduction_dims
from .properties import ReduceDep, TensorProperties, analyze_properties

# layout ops that only alias their input: no kernel, no bytes of their own
ALIASING_OPS = frozenset({"view", "permute", "expand", "unsqueeze", "squeeze", "slice", "split"})


# output rows up to which a matmul counts as memory-bound whatever the dtype (a 16-row bf16 GEMV's intensity,
# 16 FLOP/B, is far below the H100's ridge point of ~257)
SKINNY_ROWS = 16


class CostModelError(ValueError):
    pass


@dataclass(frozen=True)
class Cost:
    bytes: int
    flops: int
    intensity: float           # flops / byte
    predicted_us: float
    bound: str                 # "memory" | "compute"
    parallel_tasks: int
    memory_us: float = 0.0
    compute_us: float = 0.0
    kernels: int = 1

    def describe(self) -> str:
        return (f"{self.bound}-bound: {self.bytes / 1e6:.3g} MB, {self.flops / 1e6:.3g} MFLOP, "
                f"AI {self.intensity:.3g} FLOP/B, {self.predicted_us:.3g} µs, {self.parallel_tasks} tasks")


def _static(meta: TensorMeta, what: str) -> None:
    if not meta.is_static:
        raise CostModelError(f"cost model: {what} has symbolic shape {meta}; the roofline model needs static "
                             f"shapes (specialise the shape, or use a shape bucket)")


def real_bytes(meta: TensorMeta) -> int:
    """Bytes a kernel must move for this tensor: dims of stride 0 (expanded) count once."""
    n = 1
    for size, stride in zip(meta.shape, meta.stride):
        n *= size if stride != 0 else 1
    return n * meta.dtype.itemsize


# ----------------------------------------------------------------------------- flops per op kind

def _flops_elementwise(node: Node) -> tuple[int, int]:
    return 0, node.outputs[0].meta.numel * node.op.flops


def _flops_reduction(node: Node) -> tuple[int, int]:
    x, _, _ = reduction_dims(node)
    return 0, x.meta.numel * node.op.flops


def _flops_matmul(node: Node) -> tuple[int, int]:
    bias, a, _ = matmul_operands(node)
    out = node.outputs[0].meta
    return out.numel * a.meta.shape[-1] * node.op.flops, (out.numel if bias is not None else 0)


def _flops_none(node: Node) -> tuple[int, int]:
    return 0, 0


# (matmul flops, other flops) of one node; opaque ops have no modelled arithmetic
FLOPS_RULES: dict[OpKind, Callable[[Node], tuple[int, int]]] = {
    OpKind.ELEMENTWISE: _flops_elementwise,
    OpKind.REDUCTION: _flops_reduction,
    OpKind.MATMUL: _flops_matmul,
    OpKind.LAYOUT: _flops_none,
    OpKind.CREATION: _flops_none,
    OpKind.OPAQUE: _flops_none,
}


# ----------------------------------------------------------------------------- region boundary

def region_io(nodes: Sequence[Node], graph: Graph | None) -> tuple[list[Value], list[Value]]:
    """External tensor inputs and outputs of ``nodes``; without ``graph`` every output leaves the region."""
    inside = {id(n) for n in nodes}
    produced = {id(v) for n in nodes for v in n.outputs}
    graph_outs = {id(v) for v in graph.output_values} if graph is not None else set()
    ins: dict[int, Value] = {}
    outs: dict[int, Value] = {}
    for n in nodes:
        for v in n.inputs:
            if v.is_tensor and id(v) not in produced:
                ins.setdefault(id(v), v)
        for v in n.outputs:
            leaves = graph is None or id(v) in graph_outs or any(id(u) not in inside for u in v.users)
            if v.is_tensor and leaves:
                outs.setdefault(id(v), v)
    return list(ins.values()), list(outs.values())


def _alias_base(v: Value, inside: set[int]) -> Value:
    """Follow aliasing ops inside the region back to the value that owns the memory."""
    while v.producer is not None and id(v.producer) in inside and v.producer.op.name in ALIASING_OPS:
        v = next(i for i in v.producer.inputs if i.is_tensor)
    return v


def _is_read(v: Value, inside: set[int]) -> bool:
    """Some non-aliasing node of the region reads ``v``, directly or through views."""
    for u in v.users:
        if id(u) not in inside:
            continue
        if u.op.name not in ALIASING_OPS or any(_is_read(o, inside) for o in u.outputs if o.is_tensor):
            return True
    return False


def region_bytes(nodes: Sequence[Node], graph: Graph | None, outputs: Sequence[Value] | None = None) -> int:
    """Bytes read and written by ``nodes`` as one kernel; ``outputs``: the values it writes, where a kernel
    writes other values than those leaving the node set (FlashTensor's non-convex kernels name theirs)."""
    ins, outs = region_io(nodes, graph)
    outs = outs if outputs is None else list(outputs)
    inside = {id(n) for n in nodes}
    external = {id(v) for v in ins}
    total = 0
    for v in ins:
        if not _is_read(v, inside):
            continue
        _static(v.meta, f"input %{v.name}")
        total += real_bytes(v.meta)
    written: set[int] = set()
    for v in outs:
        base = _alias_base(v, inside)
        if id(base) in external or id(base) in written:
            continue
        written.add(id(base))
        _static(base.meta, f"output %{base.name}")
        total += real_bytes(base.meta)
    return total


# ----------------------------------------------------------------------------- the model

class CostModel:
    """Roofline + parallelism cost of nodes and regions on one :class:`DeviceModel`."""

    reuse_tile = 128   # tile edge of a REUSE axis: a typical Triton matmul BLOCK_M / BLOCK_N

    def __init__(self, device: DeviceModel | None = None, *, cuda_graph: bool = True) -> None:
        self.device = device or DeviceModel.current()
        self.cuda_graph = cuda_graph

    @property
    def kernel_overhead_s(self) -> float:
        d = self.device
        if self.cuda_graph or d.launch_overhead_s is None:
            return d.kernel_overhead_s
        return d.launch_overhead_s

    def parallel_tasks(self, props: TensorProperties) -> int:
        tasks = 1
        for axis in props.axes():
            if axis.size is None:
                raise CostModelError(f"cost model: axis {axis.dims[:3]} has only symbolic sizes")
            if axis.reduce_dep is ReduceDep.BATCH:
                tasks *= axis.size
            elif axis.reduce_dep is ReduceDep.REUSE:
                tasks *= axis.size if axis.size <= self.reuse_tile else math.ceil(axis.size / self.reuse_tile)
        return tasks

    def node_cost(self, node: Node) -> Cost:
        """The node as a kernel of its own: every input read, every output written."""
        return self.region_cost([node], None)

    def region_cost(self, nodes: Iterable[Node], graph: Graph | None, props: TensorProperties | None = None,
                    values: dict | None = None, outputs: Sequence[Value] | None = None) -> Cost:
        """Cost of ``nodes`` as one kernel of ``graph``. ``props``: this region's properties if already computed
        (``analyze_properties(graph, nodes)``); ``values``: the graph's value properties, to skip recomputing them;
        ``outputs``: the values the kernel writes (default: those leaving ``nodes``)."""
        nodes = list(nodes)
        d = self.device
        nbytes = region_bytes(nodes, graph, outputs)
        mm_time = mm_flops = other = 0.0
        for n in nodes:
            for v in n.outputs:
                if v.is_tensor:
                    _static(v.meta, f"{n.describe()} output")
            mm, vec = FLOPS_RULES[n.kind](n)
            if mm:
                mm_flops += mm
                mm_time += mm / d.matmul_flops(matmul_operands(n)[1].meta.dtype)
            other += vec
        flops = int(mm_flops + other)
        compute_s = mm_time + other / d.vector_flops
        memory_s = nbytes / d.bandwidth
        if props is None:
            props = analyze_properties(graph, nodes, values=values) if nodes else None
        tasks = self.parallel_tasks(props) if props is not None else 0
        utilisation = min(1.0, tasks / d.sm_count) if tasks else 1.0
        kernels = int(any(n.op.name not in ALIASING_OPS for n in nodes))
        seconds = (max(memory_s, compute_s) / utilisation if kernels else 0.0) + kernels * self.kernel_overhead_s
        intensity = flops / nbytes if nbytes else (math.inf if flops else 0.0)
        return Cost(bytes=nbytes, flops=flops, intensity=intensity, predicted_us=seconds * 1e6,
                    bound="compute" if compute_s > memory_s else "memory", parallel_tasks=tasks,
                    memory_us=memory_s * 1e6, compute_us=compute_s * 1e6, kernels=kernels)


def matmul_rows(node: Node) -> int:
    """Rows of a matmul node's output (all dims but the last multiplied: batch dims included)."""
    return math.prod(node.outputs[0].meta.shape[:-1])


def skinny_matmul(node: Node, model: "CostModel | None" = None) -> Cost | None:
    """The node's cost when it is a matmul that streams its weight — at most :data:`SKINNY_ROWS` output rows,
    or arithmetic intensity below the device's ridge point — else None. Such a matmul is memory-bound (a
    decode GEMV: one weight read per few rows), so it is a claimer's, not the library call's."""
    if node.kind is not OpKind.MATMUL or not node.outputs or node.outputs[0].meta is None \
            or not node.outputs[0].meta.is_static:
        return None
    cost = (model or CostModel()).node_cost(node)
    return cost if matmul_rows(node) <= SKINNY_ROWS or cost.bound == "memory" else None


def is_compute_bound(node_or_region: Node | Sequence[Node], device: DeviceModel | None = None,
                     graph: Graph | None = None) -> bool:
    """True when the work's arithmetic intensity is above the device's balance point for its arithmetic
    (compute time above memory time), whatever the op types (PowerFusion)."""
    model = CostModel(device)
    if isinstance(node_or_region, Node):
        return model.node_cost(node_or_region).bound == "compute"
    return model.region_cost(node_or_region, graph).bound == "compute"
