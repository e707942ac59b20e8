"""Cuts of a graph around an anchor node, and the kernel of a cut from a μGraph of its reference program.

:func:`grow` is the region the μGraph claimers (the search's, the weight-streaming one) start from: producers of
the given op kinds whose every result is read inside (a norm before a matmul, a transposed weight, a gated MLP's
sibling matmul) and, while the region has one result (or views of one: a ``split``, slices) read by free
elementwise or layout nodes, those readers (a gate after the matmul, a residual add, the view of a flattened matmul
back to (batch, seq, n)); a reduction chain
(kinds :data:`CHAIN`) also goes on from a row statistic to the ops that apply it. :func:`levels` are the smaller
cuts ending at an anchor: its producers one step further back at a time (the sub-programs a library seed may be,
inside a larger region). :func:`reference_kernel` wraps a
compiled μGraph of the cut's reference (:func:`.search.reference.reference_of`) as the region's kernel;
:func:`lowered_reference` is that reference, or the decline of a cut that has none the target can run.
"""
from __future__ import annotations

import math

import torch

from ..capture.ir import Node, Value
from ..capture.ops import OpKind
from ..context import CompileContext, Target
from ..partition.region import Decline, Reason, inputs_of, outputs_of
from .search.reference import Decline as NotLowered, Reference, indexed_update, looked_through, reference_of

DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

GROW = {OpKind.ELEMENTWISE, OpKind.REDUCTION, OpKind.LAYOUT, OpKind.MATMUL}
CHAIN = GROW - {OpKind.MATMUL}                     # a reduction chain: row reductions and elementwise ops
FORWARD = {OpKind.ELEMENTWISE, OpKind.LAYOUT}     # a gate after the matmul; the view back to (b, s, n)
MAX_NODES = 32


def grow(graph, anchor, free_ids: set, max_nodes: int = MAX_NODES, kinds=GROW, forward: bool = True,
         counts=None, every_result: bool = False) -> list:
    """The region around ``anchor`` (a node, or a list of nodes grown together: the sibling matmuls of one
    activation), taking producers of the op ``kinds`` (see the module docstring). ``forward`` False: producers
    only (no readers of the region's result); ``every_result``: the readers of each of several results (a QKV
    projection's RoPE on q and k). ``counts(node)``: whether a node counts towards ``max_nodes`` (default: every
    node does; :func:`computes` leaves out casts and layout ops)."""
    anchors = list(anchor) if isinstance(anchor, (list, tuple)) else [anchor]
    inside = {id(a): a for a in anchors}
    returned = {id(v) for v in graph.output_values}
    rows = max((_numel(v) for v in anchors[0].inputs if getattr(v, "is_tensor", False)), default=0)
    size = (lambda: len(inside)) if counts is None else (lambda: sum(1 for n in inside.values() if counts(n)))
    changed = True
    while changed and size() < max_nodes:
        changed = False
        for n in list(inside.values()):
            for v in n.inputs:
                p = getattr(v, "producer", None)
                if p is None or id(p) in inside or id(p) not in free_ids or p.op.kind not in kinds:
                    continue
                if all(id(u) in inside for w in p.outputs for u in w.users) and \
                        not any(id(w) in returned for w in p.outputs):
                    inside[id(p)] = p
                    changed = True
        outs = [v for n in inside.values() for v in n.outputs
                if id(v) in returned or any(id(u) not in inside for u in v.users)]
        ahead = outs if (_one_result(outs) or every_result) and forward else []
        if kinds is CHAIN:      # a row statistic (mean, variance) goes on to where it is applied to the rows
            ahead = ahead + [v for v in outs if _numel(v) < rows and v not in ahead]
        for v in ahead:
            users = [u for u in v.users if id(u) not in inside]
            if id(v) not in returned and users and all(id(u) in free_ids and u.op.kind in FORWARD for u in users):
                for u in users:
                    inside[id(u)] = u
                changed = True
    return list(inside.values())


def _one_result(outs: list) -> bool:
    """``outs`` (a region's results) are one value, or views of one value (a fused projection's ``chunk`` /
    ``split`` or slices of it): its readers may join the region."""
    if len(outs) <= 1:
        return bool(outs)
    return len({id(v.producer.inputs[0]) if v.producer.op.kind is OpKind.LAYOUT and v.producer.inputs else id(v)
                for v in outs}) == 1


def levels(graph, anchor, free_ids: set, max_nodes: int = MAX_NODES, kinds=GROW, counts=None):
    """The cuts whose one result is ``anchor``'s, smallest first: ``anchor``, then each time with the producers (of
    ``kinds``, free, every result read inside) of the cut before, until none is left or ``max_nodes`` nodes count
    (``counts(node)``, as in :func:`grow`). Nodes that do not count (layout ops, casts) join the cut as soon as they
    can: they are no step of their own."""
    inside = {id(anchor): anchor}
    returned = {id(v) for v in graph.output_values}
    counts = counts or (lambda n: True)

    def addable() -> list:
        found: dict = {}
        for n in list(inside.values()):
            for v in n.inputs:
                p = getattr(v, "producer", None)
                if p is None or id(p) in inside or id(p) in found or id(p) not in free_ids or p.op.kind not in kinds:
                    continue
                if all(id(u) in inside for w in p.outputs for u in w.users) and \
                        not any(id(w) in returned for w in p.outputs):
                    found[id(p)] = p
        return list(found.values())

    def close():        # the nodes that count for nothing, as far as they go
        while free := [p for p in addable() if not counts(p)]:
            inside.update((id(p), p) for p in free)

    close()
    yield list(inside.values())
    while sum(1 for n in inside.values() if counts(n)) < max_nodes and (step := addable()):
        inside.update((id(p), p) for p in step)
        close()
        yield list(inside.values())


def computes(node) -> bool:
    """``node`` does arithmetic: not a layout op (view, permute, expand) and not a cast or copy (flops 0), which the
    reference lowering makes no ops of."""
    return node.op.kind is not OpKind.LAYOUT and node.op.flops > 0


def _numel(v) -> int:
    return math.prod(v.meta.shape) if v.is_tensor else 0


def reference_kernel(nodes: list, graph, ref, compiled):
    """The region's kernel from a compiled μGraph whose inputs and outputs are ``ref``'s (a
    :class:`~.reference.Reference` of ``nodes``): region inputs reordered to ``ref.inputs``, its outputs to the
    region's, each in its graph shape."""
    pos = {id(v): i for i, v in enumerate(inputs_of(nodes))}
    in_order = [pos[id(v)] for v in ref.inputs]
    out_pos = {id(v): i for i, v in enumerate(ref.outputs)}
    outputs = outputs_of(nodes, graph)
    out_order = [out_pos[id(v)] for v in outputs]
    shapes = [tuple(v.meta.shape) for v in outputs]
    # a result the graph holds as a view with gaps (q sliced off a fused QKV projection's rows) is written in
    # that layout: a fallback region compiled for the graph reads it so, Inductor asserting the strides; a dense
    # result does for a contiguous value or a broadcast (stride 0)
    laid_out = [v.meta if not v.meta.is_contiguous and all(st or n == 1 for n, st in zip(v.meta.shape, v.meta.stride))
                else None for v in outputs]
    # a cast is not an op of the reference (it tracks the computation in its float dtype), so a result the region
    # upcasts (BLOOM's residual sum, made fp32 for the next LayerNorm) comes out of the kernel in the computation's
    # dtype and is returned in the graph's
    dtypes = [v.meta.dtype for v in outputs]

    def kernel(*ins):
        outs = compiled(*[ins[i] for i in in_order])
        return tuple(with_meta_strides(y, meta) if meta is not None else y
                     for y, meta in ((_as(outs[j].reshape(sh), dt), m)
                                     for j, sh, dt, m in zip(out_order, shapes, dtypes, laid_out)))

    return kernel


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def with_meta_strides(t: torch.Tensor, meta) -> torch.Tensor:
    """``t`` with the strides the graph's value ``meta`` has (a copy where they differ; a dim of size 1 has no
    stride that matters)."""
    if (meta.is_contiguous and t.is_contiguous()) or all(
            a == m or n == 1 for a, m, n in zip(t.stride(), meta.stride, t.shape)):
        return t
    return torch.empty_strided(meta.shape, meta.stride, dtype=t.dtype, device=t.device).copy_(t)


def lowered_reference(nodes: list, graph, ctx: CompileContext, first_use: bool = False) -> Reference | Decline:
    """The cut's reference program (``first_use``: its inputs in the order the cut's nodes first read them,
    :func:`.search.reference.region_io`), or why a μGraph claimer passes over it: it does not lower, a dtype mirage
    does not generate (bf16 under the interpreter, which computes it wrongly), or a device the target does not run."""
    ref = reference_of(nodes, graph, first_use)
    if isinstance(ref, NotLowered):
        return Decline(nodes, Reason.NOT_LOWERED, str(ref))
    metas = [v.meta for i, v in enumerate(ref.inputs) if i not in positions_only(ref.graph)]
    if any(m.dtype not in DTYPES for m in metas) or \
            (ctx.target is Target.INTERPRETER and any(m.dtype == torch.bfloat16 for m in metas)):
        return Decline(nodes, Reason.UNSUPPORTED_DTYPE, ", ".join(sorted({str(m.dtype) for m in metas})))
    if not ctx.target.runs_on(metas[0].device.type):
        return Decline(nodes, Reason.UNSUPPORTED_DEVICE, str(metas[0].device))
    return ref


def cut_signature(nodes: list, graph, depth: int = 3) -> tuple:
    """What a cut's reference program (:func:`~.search.reference.reference_of`) is made from, without making it:
    each node's op, scalar arguments and output metas, how the nodes read each other and the cut's inputs (numbered
    by first use), which results leave the cut, and each input's meta with the op that produces it, followed
    ``depth`` steps back where the lowering looks further (a SiLU written out may start outside the cut,
    :func:`~.search.reference.looked_through`; followed through every op, a 4-layer model's residual stream
    reached the embedding from the first two layers' cuts only, so no two layers' cuts shared a signature and
    HF gemma2's graph lowered 368 cuts). The same cut in each layer of a model has one
    signature, so a claimer that found no seed for one need not lower and look up the others
    (:class:`~.search.claimer.SearchClaimer`). Where two cuts that would lower differently shared a signature, the
    second would only go unclaimed, never be claimed wrongly: only a negative answer is shared."""
    index = {id(n): j for j, n in enumerate(nodes)}
    numbered: dict[int, int] = {}
    inputs: list = []
    returned = {id(v) for v in graph.output_values}

    def inside(v: Value) -> bool:
        return v.producer is not None and id(v.producer) in index

    def desc(v: Value) -> str:          # a tensor's meta; a scalar's value
        return str(v.meta) if v.meta is not None else repr(v.example)

    def ref(v: Value) -> tuple:
        if inside(v):
            return ("node", index[id(v.producer)], next(k for k, w in enumerate(v.producer.outputs) if w is v))
        if id(v) not in numbered:
            numbered[id(v)] = len(inputs)
            inputs.append((desc(v), producers(v, 1)))
        return ("in", numbered[id(v)])

    def producers(v: Value, level: int) -> object:
        p = v.producer
        if p is None or level > depth or not looked_through(p):
            return "graph input" if p is None else p.target_name
        return (p.target_name, tuple(ref(a) if inside(a) or id(a) in numbered else (desc(a), producers(a, level + 1))
                                     for a in p.inputs))

    def arg(a) -> object:
        if isinstance(a, Value):
            return ref(a)
        if isinstance(a, (list, tuple)):
            return tuple(arg(x) for x in a)
        if isinstance(a, dict):
            return tuple((k, arg(a[k])) for k in sorted(a))
        return repr(a)

    body = tuple((n.target_name, arg(n.args), arg(n.kwargs), tuple(desc(v) for v in n.outputs),
                  tuple(id(v) in returned or any(id(u) not in index for u in v.users) for v in n.outputs))
                 for n in nodes)
    return body, tuple(inputs)


def positions_only(g) -> set[int]:
    """The input indices of μGraph ``g`` read only as an ``index_copy``'s positions (integer tensors)."""
    users: dict[int, set] = {}
    for op in g.ops:
        for k, r in enumerate(op.inputs):
            src = g.ops[r[0]]
            if src.name == "input":
                users.setdefault(src.attrs["index"], set()).add((op.name, k))
    return {i for i, u in users.items() if u == {("index_copy", 1)}}


def cache_writes(graph, nodes: list, free_ids: set) -> list:
    """The free ``index_copy`` / ``index_put`` nodes (:func:`.search.reference.indexed_update`) that write a result
    of ``nodes`` into a graph input at positions computed outside ``nodes`` (a graph input, or HF's cache counter
    plus an ``arange``), where nothing else reads that input's old value (its other readers write the result back:
    ``copy_``): a static KV cache's update, which the region's kernel can store itself (:mod:`.updates`)."""
    inside = {id(n) for n in nodes}
    found = []
    for n in nodes:
        for v in n.outputs:
            for u in v.users:
                update = indexed_update(u) if id(u) not in inside and id(u) in free_ids else None
                if update is None or update[3] is not v or update[0].producer is not None or \
                        (update[2].producer is not None and id(update[2].producer) in inside):
                    continue
                dst = update[0]
                if dst.meta.dtype not in DTYPES or dst.meta.dtype != v.meta.dtype:
                    continue        # a cache in another dtype (fp8) or a cast on the way: the write stays outside
                if all(w is u or w.target_name == "aten.copy_.default" for w in dst.users):
                    found.append(u)
    return found


def layout_tails_dropped(nodes: list[Node]) -> list[Node]:
    """``nodes`` without the layout ops that only reshape a result for readers outside (q's regrouping for the
    attention): the kernel writes the value before them, and the views run as views."""
    nodes = list(nodes)
    while True:
        inside = {id(n) for n in nodes}
        tails = [n for n in nodes if n.kind is OpKind.LAYOUT and n.inputs and n.inputs[0].producer is not None
                 and id(n.inputs[0].producer) in inside and not any(id(u) in inside for v in n.outputs for u in v.users)]
        if not tails:
            return nodes
        nodes = [n for n in nodes if all(n is not t for t in tails)]
