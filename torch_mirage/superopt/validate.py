"""μGraph validity, Mirage Definition 2.1.

A μGraph is valid iff (1) every kernel, block and thread op's inputs and
outputs match its spec (the op table's shape rules, re-run here on the stored
graph); (2) all tensors of each kernel, block and thread graph fit the device
memory, the shared memory and the register file; (3) in each block graph,
every path from an input to an output passes through exactly one input
iterator, one for-loop accumulator and one output saver.

``problems(graph)`` lists every violation; ``validate(graph)`` raises
:class:`InvalidMuGraph` with all of them. Capacities are parameters:
``smem_bytes`` (default 227 KiB, an H100's per-block maximum) is what a device
model passes in.
"""
from __future__ import annotations

from ..ugraph import B, K, T, BlockGraph, Graph, KernelGraph, MuGraphError, Ref, band_geometry, nbytes, spec
from .optimise import memory_problem

SMEM_BYTES = 227 * 1024
REGS_BYTES = 64 * 1024 * 4          # 64K 32-bit registers per SM
DMEM_BYTES = 80 * 1024 ** 3


class InvalidMuGraph(MuGraphError):
    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid μGraph:\n  " + "\n  ".join(problems))


def validate(graph: Graph, *, smem_bytes: int = SMEM_BYTES, regs_bytes: int = REGS_BYTES,
             dmem_bytes: int = DMEM_BYTES) -> None:
    found = problems(graph, smem_bytes=smem_bytes, regs_bytes=regs_bytes, dmem_bytes=dmem_bytes)
    if found:
        raise InvalidMuGraph(found)


def problems(graph: Graph, *, smem_bytes: int = SMEM_BYTES, regs_bytes: int = REGS_BYTES,
             dmem_bytes: int = DMEM_BYTES) -> list[str]:
    caps = {K: dmem_bytes, B: smem_bytes, T: regs_bytes}
    return _check(graph, caps, "kernel graph")


def _check(g: Graph, caps: dict, where: str) -> list[str]:
    out = _structure(g, where)
    if out:
        return out   # shapes and paths are meaningless on a broken structure
    out += _shapes(g, caps, where)
    if isinstance(g, BlockGraph):
        out += _block(g, where)
        if out:
            return out   # the memory plan of a block graph is meaningless on broken shapes or paths
    out += _memory(g, caps, where)
    return out


def _structure(g: Graph, where: str) -> list[str]:
    out = []
    if isinstance(g, BlockGraph) and (not 1 <= len(g.grid) <= 3 or min(g.grid) < 1 or g.forloop_range < 1):
        out.append(f"{where}: grid {tuple(g.grid)} / forloop_range {g.forloop_range} invalid (1-3 dims, all >= 1)")
    if isinstance(g, BlockGraph) and g.forloop_band is not None:
        try:
            band_geometry(g)
        except MuGraphError as e:
            out.append(f"{where}: {e}")
        if any(op.name.startswith("acc_") and op.name != "acc_online_softmax"
               and not (op.name == "acc_sum" and _vanishes_where_masked(g, op.inputs[0])) for op in g.ops):
            out.append(f"{where}: forloop_band needs online-softmax accumulators, or sums of exp(masked scores "
                       "− ·)·…, only (skipped tiles are entirely masked scores, which add nothing only to those)")
    for i, op in enumerate(g.ops):
        try:
            s = spec(op.name)
        except MuGraphError as e:
            out.append(f"{where} op {i}: {e}")
            continue
        if g.level not in s.levels:
            out.append(f"{where} op {i} ({op.name}): not allowed at {g.level} level")
        if s.arity is not None and len(op.inputs) != s.arity:
            out.append(f"{where} op {i} ({op.name}): {len(op.inputs)} inputs, spec says {s.arity}")
        for r in op.inputs:
            if not (0 <= r[0] < i and 0 <= r[1] < len(g.ops[r[0]].shapes)):
                out.append(f"{where} op {i} ({op.name}): input {tuple(r)} is not an earlier op's output")
    for r in g.outputs:
        if not (0 <= r[0] < len(g.ops) and 0 <= r[1] < len(g.ops[r[0]].shapes)):
            out.append(f"{where}: output {tuple(r)} names no tensor")
    io = "iterator" if isinstance(g, BlockGraph) else "input"
    for name in (io, "saver"):
        idx = sorted(op.attrs.get("index", -1) for op in g.ops if op.name == name)
        if idx != list(range(len(idx))):
            out.append(f"{where}: {name} indices {idx} are not 0..{len(idx) - 1}, each once")
    return out


def _vanishes_where_masked(g: BlockGraph, r) -> bool:
    """Whether block value ``r`` is ``exp(scores + mask − x)`` times or over other factors, the mask a tile the
    for-loop walks: 0 on a tile the band skips (every score there at the mask's floor, ``x`` a finite row
    statistic — under a band every row sees a key), so a sum of it may skip that tile."""
    op = g.ops[r[0]]
    if op.name in ("mul", "div"):
        return any(_vanishes_where_masked(g, x) for x in (op.inputs if op.name == "mul" else op.inputs[:1]))
    if op.name != "exp":
        return False
    x = g.ops[op.inputs[0][0]]
    while x.name == "sub":
        x = g.ops[x.inputs[0][0]]
    return x.name == "add" and any(g.ops[y[0]].name == "iterator" and g.ops[y[0]].attrs["fmap"] is not None
                                   for y in x.inputs)


def _shapes(g: Graph, caps: dict, where: str) -> list[str]:
    out = []
    for i, op in enumerate(g.ops):
        if op.body is not None:
            out += _check(op.body, caps, f"{where} op {i} ({op.name}) body")
        try:
            shapes, dtypes = op.infer([g.shape(r) for r in op.inputs], [g.dtype(r) for r in op.inputs],
                                      g.ctx(op.body))
        except MuGraphError as e:
            out.append(f"{where} op {i}: {e}")
            continue
        if shapes != tuple(op.shapes) or dtypes != tuple(op.dtypes):
            out.append(f"{where} op {i} ({op.name}): records {list(op.shapes)} {list(op.dtypes)}, "
                       f"its spec gives {list(shapes)} {list(dtypes)}")
    if isinstance(g, KernelGraph):
        for i, op in g.named("customized"):
            n_it = len(op.body.iterators)
            if n_it != len(op.inputs):
                out.append(f"{where} op {i}: {len(op.inputs)} kernel inputs but {n_it} iterators "
                           "(each input needs exactly one)")
    return out


def _block(g: BlockGraph, where: str) -> list[str]:
    """Definition 2.1 (3): every iterator -> saver path has exactly one accumulator."""
    out = []
    counts = g.accum_counts()
    users = g.consumers()
    for i, op in enumerate(g.ops):
        kind = op.spec.kind
        ins = set().union(*(counts[r[0]][r[1]] for r in op.inputs)) if op.inputs else {0}
        if kind == "accum" and ins != {0}:
            out.append(f"{where} op {i} ({op.name}): accumulates a value already past an accumulator "
                       "(a path would cross two accumulators)")
        if op.name == "saver" and ins != {1}:
            out.append(f"{where} saver {op.attrs['index']}: paths into it cross {sorted(ins)} accumulators, "
                       "need exactly 1")
        if kind != "accum" and op.name != "saver" and len(ins) > 1:
            out.append(f"{where} op {i} ({op.name}): mixes for-loop values with post-loop values")
        scan_table = op.name == "iterator" and op.attrs["index"] == g.forloop_scan   # read by the launch only
        if op.name != "saver" and not scan_table and not any(Ref(i, j) in users for j in range(len(op.shapes))):
            out.append(f"{where} op {i} ({op.name}): result never used (every path must end in a saver)")
    return out


def _memory(g: Graph, caps: dict, where: str) -> list[str]:
    """Definition 2.1 (2): the graph's tensors fit its level's memory. A thread
    op's inner tensors live in registers (checked in its body), only its
    outputs take shared memory; a block graph's kernel tensors stay in device
    memory, its tiles are counted where they live at once (the μGraph
    optimiser's shared-memory plan, :func:`.optimise.memory_problem`)."""
    if isinstance(g, BlockGraph):
        found = memory_problem(g, caps[B])
        return [f"{where}: {found}"] if found else []
    total = sum(nbytes(s, d) for op in g.ops for s, d in zip(op.shapes, op.dtypes))
    cap = caps[g.level]
    if total > cap:
        big = max(((nbytes(s, d), op.name, s, d) for op in g.ops for s, d in zip(op.shapes, op.dtypes)))
        return [f"{where}: its tensors need {total} bytes of {g.level}-level memory, capacity {cap} "
                f"(largest: {big[1]} {big[3]}{list(big[2])}, {big[0]} bytes); use smaller tiles "
                "(larger grid or forloop_range)"]
    return []
