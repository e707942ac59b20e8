"""The stitch partitioner (AStitch §4): memory-intensive sub-graphs → claims of a stitch plan each.

1. Candidates: free elementwise / reduction / constant-fill nodes the stitch
   codegen can emit, on static shapes, fp16 / bf16 / fp32 (bool masks), on CUDA
   (or CPU when the context's target is Triton's interpreter). Matmuls and opaque ops are boundaries.
2. Stitch ops grow over data edges in topological order (the BFS of the paper),
   a node joining its producers' group when the union still has one iteration
   space and the condensed graph stays acyclic; independent groups of the same
   space are merged when that creates no cycle.
3. View-like layout ops feeding only the group (prologue) or reading only its
   results (epilogue) join it: they run on real tensors around the kernel.
4. Each group gets dominant ops, a scheme per edge and a thread mapping
   (:mod:`torch_mirage.codegen.stitch_plan`) and becomes a :class:`Claim` of that plan; the build stage
   (:mod:`torch_mirage.build`) has it emitted by :mod:`torch_mirage.codegen.stitch_emit` and launched by
   :mod:`~torch_mirage.codegen.stitch_launch`.
Groups that are only layout ops or one cheap elementwise op, or whose memory traffic is below
``min_region_us``, stay with Inductor: the claimer returns a :class:`Decline` for them, and for each
candidate-kind node it cannot take (with the reason: dtype, device, dynamic shape, ...).
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from ..analysis.cost import Cost, CostModel
from ..analysis.device import DeviceModel
from ..analysis.graph import GraphAnalysis
from ..capture.ir import Graph, Node, Value, connected_components, topo_sorted
from ..capture.ops import OpKind
from ..codegen.stitch_ops import node_support, reduction_spec
from ..codegen.stitch_plan import DominantOp, Scheme, StitchLimits, StitchPlan, Strategy, ThreadMapping
from ..codegen.stitch_schedule import schedule_facts
from ..context import CompileContext, Target
from .region import Claim, Decline, Outcome, Reason, outputs_of

log = logging.getLogger("torch_mirage")

DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.bool}
VIEW_OPS = {"view", "permute", "expand", "unsqueeze", "squeeze", "slice"}
_INT32 = 2 ** 31


# ---------------------------------------------------------------- device and cost

def device_model() -> Any:
    return DeviceModel.current() if torch.cuda.is_available() else DeviceModel.profile("H100")


def _cost(nodes: Sequence[Node], analysis: GraphAnalysis, device: Any) -> Cost | None:
    """``nodes`` as one kernel on ``device``; None where the cost model has no answer (symbolic sizes, say): the
    report then lacks the figure and no size threshold applies."""
    try:
        return analysis.region_cost(nodes, CostModel(device))
    except Exception as e:
        log.debug("torch_mirage stitch: cost model failed on %s: %s", [n.name for n in nodes], e)
        return None


# ---------------------------------------------------------------- candidates

def _tensor_problem(node: Node, target: Target) -> tuple[Reason, str] | None:
    for v in list(node.inputs) + list(node.outputs):
        if v.meta is None:
            reason = Reason.DYNAMIC_SHAPE if isinstance(v.example, torch.SymInt) else Reason.NOT_CLAIMED
            return reason, f"{node.name}: non-tensor value {v!r}"
        if not v.meta.is_static:
            return Reason.DYNAMIC_SHAPE, f"{node.name}: {v.meta}"
        if v.meta.dtype not in DTYPES:
            return Reason.UNSUPPORTED_DTYPE, f"{node.name}: {v.meta.dtype}"
        if not target.runs_on(v.meta.device.type):
            return Reason.UNSUPPORTED_DEVICE, f"{node.name}: {v.meta.device} (Triton kernels need CUDA)"
        if v.meta.numel == 0:
            return Reason.NOT_CLAIMED, f"{node.name}: 0-size tensor {v.meta} (nothing to compute)"
        if v.meta.numel >= _INT32:
            return Reason.NOT_CLAIMED, f"{node.name}: {v.meta.numel} elements overflow int32 offsets"
    return None


def candidate_problem(node: Node, target: Target) -> tuple[Reason, str] | None:
    """None when ``node`` may join a stitch group; else (reason, detail)."""
    if node.kind not in (OpKind.ELEMENTWISE, OpKind.REDUCTION, OpKind.CREATION):
        return Reason.NOT_CLAIMED, f"{node.name}: {node.kind.value}"
    why = node_support(node)
    if why is not None:
        return Reason.NOT_CLAIMED, why
    return _tensor_problem(node, target)


def _is_view(node: Node, target: Target) -> bool:
    return node.kind is OpKind.LAYOUT and node.op.name in VIEW_OPS and len(node.outputs) == 1 \
        and _tensor_problem(node, target) is None


# ---------------------------------------------------------------- iteration space

def _keepdim_false(node: Node) -> bool:
    return node.kind is OpKind.REDUCTION and not reduction_spec(node).keepdim


def iteration_space(nodes: Sequence[Node]) -> tuple[int, ...] | None:
    """The broadcast shape every computed value fits into, its last dim reduced by every reduction; None if none."""
    shapes, reduced_inputs = [], []
    produced_nokeep = set()
    for n in nodes:
        if _keepdim_false(n):
            produced_nokeep.update(id(v) for v in n.outputs)
    for n in nodes:
        if any(id(v) in produced_nokeep for v in n.inputs):
            return None                      # a keepdim=False result broadcasts against the wrong dims
        for v in n.inputs:
            shapes.append(tuple(v.meta.shape))
        if n.kind is OpKind.REDUCTION:
            reduced_inputs.append(tuple(n.inputs[0].meta.shape))
            if reduction_spec(n).keepdim:
                shapes.extend(tuple(v.meta.shape) for v in n.outputs)
        else:
            shapes.extend(tuple(v.meta.shape) for v in n.outputs)
    try:
        space = tuple(torch.broadcast_shapes(*shapes)) if shapes else ()
    except RuntimeError:
        return None
    space = space or (1,)
    for s in reduced_inputs:
        if len(s) != len(space) or s[-1] != space[-1]:
            return None
    return space


# ---------------------------------------------------------------- grouping

def _edges(graph: Graph) -> tuple[list[int], list[tuple[int, int]]]:
    """Node ids and (producer id, consumer id) data edges of ``graph``, built once per graph."""
    cached = getattr(graph, "_data_edges", None)
    if cached is None or len(cached[0]) != len(graph.nodes):
        ids = [id(n) for n in graph.nodes]
        edges = [(id(v.producer), id(n)) for n in graph.nodes for v in n.inputs if v.producer is not None]
        cached = (ids, edges)
        graph._data_edges = cached
    return cached


def _acyclic(graph: Graph, group_of: dict[int, int]) -> bool:
    """The graph with every group contracted to one vertex has no cycle."""
    ids, edges = _edges(graph)
    key = lambda i: -1 - group_of[i] if i in group_of else i     # groups as negative ints, nodes by id
    vertices = {key(i) for i in ids}
    succ: dict[int, set] = {k: set() for k in vertices}
    indeg = dict.fromkeys(vertices, 0)
    for p, c in edges:
        p, c = key(p), key(c)
        if p != c and c not in succ[p]:
            succ[p].add(c)
            indeg[c] += 1
    ready = [k for k, d in indeg.items() if d == 0]
    seen = 0
    while ready:
        k = ready.pop()
        seen += 1
        for s2 in succ[k]:
            indeg[s2] -= 1
            if indeg[s2] == 0:
                ready.append(s2)
    return seen == len(indeg)


def grow_groups(graph: Graph, candidates: Sequence[Node]) -> list[list[Node]]:
    """Stitch ops: candidates joined with their producers' groups while the space and acyclicity hold."""
    next_id = 0
    groups: dict[int, list[Node]] = {}
    group_of: dict[int, int] = {}
    for n in topo_sorted(candidates, graph):
        producers = []
        for v in n.inputs:
            g = group_of.get(id(v.producer)) if v.producer is not None else None
            if g is not None and g not in producers:
                producers.append(g)
        options = ([producers] if len(producers) > 1 else []) + [[g] for g in sorted(
            producers, key=lambda g: (-any(m.kind is OpKind.REDUCTION for m in groups[g]), -len(groups[g])))]
        placed = False
        for opt in options:
            nodes = [m for g in opt for m in groups[g]] + [n]
            if iteration_space(nodes) is None:
                continue
            trial = dict(group_of)
            for m in nodes:
                trial[id(m)] = opt[0]
            if _acyclic(graph, trial):
                for g in opt[1:]:
                    del groups[g]
                groups[opt[0]] = nodes
                group_of = trial
                placed = True
                break
        if not placed:
            gid = next_id
            next_id += 1
            groups[gid] = [n]
            group_of[id(n)] = gid
    return merge_independent(graph, groups, group_of)


def merge_independent(graph: Graph, groups: dict[int, list[Node]], group_of: dict[int, int]) -> list[list[Node]]:
    """Stitch independent groups of one iteration space into one kernel when no cycle results."""
    spaces = {g: iteration_space(nodes) for g, nodes in groups.items()}
    order = sorted(groups, key=lambda g: graph.nodes.index(groups[g][0]))
    merged: dict[int, int] = {}
    for i, a in enumerate(order):
        if a in merged:
            continue
        for b in order[i + 1:]:
            if b in merged or spaces[a] != spaces[b]:
                continue
            nodes = groups[a] + groups[b]
            if iteration_space(nodes) != spaces[a]:
                continue
            trial = {k: (a if g == b else g) for k, g in group_of.items()}
            if _acyclic(graph, trial):
                groups[a] = topo_sorted(nodes, graph)
                group_of = trial
                merged[b] = a
    for b in merged:
        del groups[b]
    return [topo_sorted(nodes, graph) for nodes in groups.values()]


def attach_layout(graph: Graph, compute: Sequence[Node], free_ids: set[int], taken: set[int],
                  target: Target) -> tuple[list[Node], list[Node]]:
    """View-like ops that only feed the group (prologue) or only read its results (epilogue)."""
    inside = {id(n) for n in compute}
    prologue: list[Node] = []
    changed = True
    while changed:
        changed = False
        for n in graph.nodes:
            if id(n) in inside or id(n) not in free_ids or id(n) in taken or not _is_view(n, target):
                continue
            users = n.outputs[0].users
            if users and all(id(u) in inside for u in users) and \
                    all(v.producer is None or id(v.producer) not in {id(c) for c in compute} for v in n.inputs):
                if id(n.outputs[0]) in {id(v) for v in graph.output_values}:
                    continue
                inside.add(id(n))
                prologue.append(n)
                changed = True
    made = {id(n) for n in compute}
    epilogue: list[Node] = []
    for n in graph.nodes:
        if id(n) in inside or id(n) not in free_ids or id(n) in taken or not _is_view(n, target):
            continue
        ins = n.inputs
        if len(ins) == 1 and ins[0].producer is not None and id(ins[0].producer) in made \
                and not any(id(u) in inside for u in n.outputs[0].users):
            made.add(id(n))
            inside.add(id(n))
            epilogue.append(n)
    return topo_sorted(prologue, graph), topo_sorted(epilogue, graph)


# ---------------------------------------------------------------- the plan

def _row_values(compute: Sequence[Node], loads: Sequence[Value], space: tuple[int, ...]) -> frozenset[int]:
    """Values constant along the row: per-row loads, constants, reductions and what only they feed."""
    n = space[-1]
    row: set[int] = set()
    for v in loads:
        if n == 1 or len(v.meta.shape) == 0 or v.meta.shape[-1] == 1:
            row.add(id(v))
    for node in compute:
        if node.kind is OpKind.REDUCTION or node.kind is OpKind.CREATION or \
                all(id(v) in row for v in node.inputs):
            row.update(id(v) for v in node.outputs)
    return frozenset(row)


def _value_levels(compute: Sequence[Node]) -> dict[int, int]:
    """How many reductions (in sequence) each value waits for."""
    lvl: dict[int, int] = {}
    for node in compute:
        base = max((lvl.get(id(v), 0) for v in node.inputs), default=0)
        for v in node.outputs:
            lvl[id(v)] = base + (1 if node.kind is OpKind.REDUCTION else 0)
    return lvl


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _warps(elems: int) -> int:
    return 2 if elems <= 512 else 4 if elems <= 2048 else 8 if elems <= 8192 else 16 if elems <= 16384 else 32


def choose_mapping(rows: int, row_len: int, has_reduction: bool, regional_tiles: int, device: Any,
                   limits: StitchLimits | None = None, reduction_passes: int = 1,
                   fusions: tuple[str, ...] = (), store_pass: bool = True) -> ThreadMapping:
    """Thread mapping from the dominant op's rows and row length and the device's SMs / shared memory.

    ``reduction_passes`` / ``fusions`` / ``store_pass``: what a looped row costs (from the loop schedule).
    """
    lim = limits or StitchLimits()
    waves = 2 * int(getattr(device, "sm_count", 132))
    smem = lim.on_chip_bytes or int(getattr(device, "smem_per_block", 227 * 1024))
    regs = lim.on_chip_bytes or 4 * int(getattr(device, "regs_per_sm", 65536))
    bn = _pow2(row_len)
    if not has_reduction:
        bn = min(bn, 1024)
        bm = min(_pow2(rows), max(1, lim.tile_elems // bn))
        while bm > 1 and -(-rows // bm) * -(-row_len // bn) < waves:
            bm //= 2
        return ThreadMapping(Strategy.ELEMENTWISE, rows, row_len, bm, bn, _warps(bm * bn))
    if bn <= lim.max_row_on_chip and bn * 4 * max(1, regional_tiles) <= smem:
        bm = min(_pow2(rows), max(1, lim.tile_elems // bn))
        while bm > 1 and (-(-rows // bm) < waves or bm * bn * 4 * max(1, regional_tiles) > smem):
            bm //= 2
        return ThreadMapping(Strategy.PACKED if bm > 1 else Strategy.ROW, rows, row_len, bm, bn,
                             lim.row_warps or _warps(bm * bn))
    if (lim.max_row_on_chip < bn <= lim.max_row_whole and bn * 4 * max(1, regional_tiles) <= regs
            and rows >= int(getattr(device, "sm_count", 132))):
        # a long row whole in one program's registers (one program per SM): read once, no second pass through L2;
        # with fewer rows than SMs, task splitting below keeps the device busy instead
        return ThreadMapping(Strategy.ROW, rows, row_len, 1, bn, lim.row_warps or _warps(bn))
    passes = reduction_passes + int(store_pass)
    split = _split_count(rows, row_len, device, lim) if reduction_passes == 1 else 1
    if split > 1:
        piece = -(-row_len // split)
        chunk = min(lim.loop_chunk, _pow2(piece))
        piece = -(-piece // chunk) * chunk
        if -(-row_len // piece) > 1:
            return ThreadMapping(Strategy.SPLIT, rows, row_len, 1, chunk, lim.loop_warps or _warps(chunk),
                                 split=-(-row_len // piece),
                                 split_len=piece, passes=passes, fusions=fusions)
    chunk, warps = min(bn, lim.loop_chunk), lim.loop_warps or _warps(min(bn, lim.loop_chunk))
    if "Welford" in fusions and lim.loop_warps is None:
        # three fp32 statistics per lane: twice the chunk over twice the warps (H100 sweep, 4096 x 32768 fp16
        # layer norm: 193.7 µs against 247.5 at 4096 / 8 warps; benchmarks/results/stitch_gpu_check_h100.json)
        chunk, warps = min(bn, 2 * lim.loop_chunk), 16
    return ThreadMapping(Strategy.LOOPED, rows, row_len, 1, chunk, warps, passes=passes, fusions=fusions)


def _split_count(rows: int, row_len: int, device: Any, lim: StitchLimits) -> int:
    """Task splitting (AStitch): programs per long row so that few rows still fill about two waves of SMs."""
    if lim.split is not None:
        want = lim.split
    else:
        sms = int(getattr(device, "sm_count", 132))
        if rows >= sms:
            return 1
        want = -(-2 * sms // rows)
    return max(1, min(want, row_len // max(1, lim.min_split_len)))


def build_plan(graph: Graph, compute: list[Node], prologue: list[Node], epilogue: list[Node],
               outputs: list[Value], device: Any, limits: StitchLimits | None = None) -> StitchPlan | None:
    space = iteration_space(compute)
    if space is None:
        return None
    made = {id(v) for n in compute for v in n.outputs}
    loads: list[Value] = []
    for n in compute:
        for v in n.inputs:
            if id(v) not in made and all(v is not x for x in loads):
                loads.append(v)
    graph_outs = {id(v) for v in graph.output_values}
    inside = {id(n) for n in compute}
    stored = [v for n in compute for v in n.outputs
              if id(v) in graph_outs or any(id(u) not in inside for u in v.users)]
    rows = 1
    for s in space[:-1]:
        rows *= s
    for v in stored:
        shape = tuple(v.meta.shape)
        if shape not in (space, space[:-1] + (1,)) and not (_keepdim_false(v.producer) and shape == space[:-1]):
            log.debug("torch_mirage stitch: stored value %r has shape %s outside the space %s", v, shape, space)
            return None
    row = _row_values(compute, loads, space)
    lvl = _value_levels(compute)
    reductions = [n for n in compute if n.kind is OpKind.REDUCTION]
    kept = [v for n in compute for v in n.outputs if id(v) not in row
            and any(id(u) in inside and lvl[id(u.outputs[0])] > lvl[id(v)] for u in v.users)]
    kept += [v for v in loads if id(v) not in row
             and any(lvl[id(u.outputs[0])] > 0 for u in v.users if id(u) in inside)]
    passes, fusions = schedule_facts(compute)
    tile_out = any(len(v.meta.shape) == len(space) and v.meta.shape[-1] == space[-1] for v in stored)
    mapping = choose_mapping(rows, space[-1], bool(reductions), len(kept), device, limits, passes, fusions,
                             tile_out and space[-1] > 1)
    schemes: dict[tuple[str, str], Scheme] = {}
    for n in compute:
        for v in n.inputs:
            if v.producer is None or id(v.producer) not in inside:
                continue
            if id(v) in row:
                s = Scheme.LOCAL if all(id(o) in row for o in n.outputs) or n.kind is OpKind.REDUCTION \
                    else Scheme.REGIONAL
            elif lvl[id(n.outputs[0])] > lvl[id(v)] or any(x is v for x in kept):
                s = Scheme.REGIONAL if mapping.single_pass else Scheme.GLOBAL
            else:
                s = Scheme.LOCAL
            schemes[(v.name, n.name)] = s
    dominants = [DominantOp(r, "dominant" if i == 0 else "sub-dominant",
                            "reduction over the row: fixes the thread mapping" if i == 0
                            else "reduction over the dominant's rows") for i, r in enumerate(reductions)]
    for n in compute:
        if n.kind is OpKind.ELEMENTWISE and n.op.flops >= 4 and id(n.outputs[0]) in row and \
                any(id(u) in inside and id(u.outputs[0]) not in row for u in n.outputs[0].users):
            dominants.append(DominantOp(n, "sub-dominant", "heavy elementwise broadcast along the row"))
    smem = mapping.block_m * mapping.block_n * 4 * len(kept) if mapping.single_pass and reductions else 0
    return StitchPlan(prologue, compute, epilogue, space, loads, stored, outputs, row, dominants, schemes,
                      mapping, groups=len(connected_components(compute)), smem_bytes=smem)


def worth_claiming(compute: Sequence[Node]) -> bool:
    """Fewer launches is the point: a reduction, or two real elementwise ops, or one heavy one."""
    real = [n for n in compute if n.kind is OpKind.REDUCTION or
            (n.kind is OpKind.ELEMENTWISE and n.op.name not in ("copy", "to_dtype"))]
    if any(n.kind is OpKind.REDUCTION for n in real):
        return True
    return len(real) >= 2 or (len(real) == 1 and real[0].op.flops >= 4)


# ---------------------------------------------------------------- the claimer

class StitchClaimer:
    """Claims memory-intensive regions, each with the plan of one stitched Triton kernel."""
    name = "stitch"

    def __init__(self, device: Any = None, limits: StitchLimits | None = None):
        self.device = device
        self.limits = limits or StitchLimits()
        self._current: dict[int, Any] = {}     # device_model() by CUDA device index, read once each

    def claim(self, graph: Graph, free: Sequence[Node], ctx: CompileContext) -> list[Outcome]:
        outcomes: list[Outcome] = []
        candidates = []
        for n in free:
            problem = candidate_problem(n, ctx.target)
            if problem is None:
                candidates.append(n)
            elif n.kind in (OpKind.ELEMENTWISE, OpKind.REDUCTION):
                outcomes.append(Decline([n], *problem))
        if not candidates:
            return outcomes
        device = self._device()
        free_ids = {id(n) for n in free}
        taken: set[int] = set()
        min_us = ctx.config.min_region_us
        for compute in grow_groups(graph, candidates):
            if not worth_claiming(compute):
                outcomes.append(Decline(compute, Reason.TOO_LITTLE_WORK))
                continue
            cost = _cost(compute, ctx.analysis_of(graph), device)
            memory_us = None if cost is None else cost.memory_us
            if memory_us is not None and memory_us < min_us:
                # too little traffic to pay for a kernel of its own: Inductor fuses it with its neighbours
                outcomes.append(Decline(compute, Reason.BELOW_MIN_REGION, f"{memory_us:.2f} µs of memory traffic"))
                continue
            outcome = self._claim(graph, compute, free_ids, taken, device, ctx)
            if isinstance(outcome, Claim):
                taken.update(id(n) for n in outcome.nodes)
            outcomes.append(outcome)
        return outcomes

    def replan(self, graph: Graph, nodes: list[Node], hint, free: Sequence[Node], ctx: CompileContext
               ) -> Outcome | None:
        """``nodes``, a group this claimer claimed before (:class:`~.record.PartitionRecord`), claimed again from
        its compute nodes (``hint["compute"]``: their places in ``nodes``) without growing every group."""
        try:
            compute = [nodes[i] for i in hint["compute"]]
        except (TypeError, KeyError, IndexError):
            return None
        return self._claim(graph, compute, {id(n) for n in free}, set(), self._device(), ctx)

    def _device(self) -> Any:
        """The device model the plans are made for: the one given, else the current device's, read once per claimer
        and device (on CUDA each read queries NVML, which a replay's per-claim :meth:`replan` would otherwise
        repeat)."""
        if self.device is not None:
            return self.device
        index = torch.cuda.current_device() if torch.cuda.is_available() else -1
        if index not in self._current:
            self._current[index] = device_model()
        return self._current[index]

    def _claim(self, graph: Graph, compute: list[Node], free_ids: set[int], taken: set[int], device: Any,
               ctx: CompileContext) -> Outcome:
        prologue, epilogue = attach_layout(graph, compute, free_ids, taken, ctx.target)
        nodes = topo_sorted(prologue + compute + epilogue, graph)
        plan = build_plan(graph, compute, prologue, epilogue, outputs_of(nodes, graph), device,
                          self.limits)
        if plan is None:
            return Decline(compute, Reason.NOT_CLAIMED, "a stored value lies outside the group's iteration space")
        summary = plan.summary()
        inside = {id(n) for n in compute}
        return Claim(nodes, plan, detail=f"stitch: {summary['thread_mapping']}",
                     info=dict(summary, predicted_us=getattr(_cost(nodes, ctx.analysis_of(graph), device), "predicted_us", None),
                               device_profile=getattr(device, "name", str(device))),
                     hint={"compute": [i for i, n in enumerate(nodes) if id(n) in inside]})
