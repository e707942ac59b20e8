"""Grouped-query attention for the search: query heads packed onto their KV head (a kernel-level view).

In GQA the query input Q (…, hq, s, d) has ``g`` heads per KV head of K, V (…, hk, t, d), hq = g·hk, and KV head
``i`` serves query heads ``i·g … i·g + g − 1`` (HF's ``repeat_kv``, SDPA's ``enable_gqa``). One block graph cannot
read K's head ``pid // g`` (an imap splits a dim evenly across the grid), so — as the library's and
:mod:`..attention_seeds`' GQA μGraphs do — the search works on the *packed* problem: every input and output with
hq heads is viewed as (…, hk, g·s, ·), the group's rows stacked, which is a plain reshape of a contiguous tensor.
Then all head dims agree and the block graph is ordinary attention, one block per KV head reading its K and V
tile once for the whole group.

:func:`group_heads` gives the packed problem's shapes; :func:`unpack` puts the views around a μGraph found for
it, and the driver probes and verifies that against the region's own program. Reshapes have the identity as
abstract expression, so the target expressions do not change.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ...ugraph import KernelGraph, MuGraphError, Ref
from ..builder import new_kernel_graph


@dataclass(frozen=True)
class HeadGroups:
    group: int                  # query heads per KV head
    packed: tuple               # per kernel input: its packed shape, or None (not viewed)
    out_packed: tuple           # per output: its packed shape, or None
    inputs: list                # (shape, dtype) of the packed problem
    out_shapes: list


def _heads(shape) -> int | None:
    return shape[-3] if len(shape) >= 3 else None


def _pack(shape, hk: int) -> tuple:
    *lead, h, s, d = shape
    return (*lead, hk, (h // hk) * s, d)


def group_heads(inputs: Sequence, out_shapes: Sequence) -> HeadGroups | None:
    """The packed problem when the rank ≥ 3 inputs have two head counts hq = g·hk (g > 1) with equal leading
    dims, the hq-head inputs and every output being (…, hq, s, d); None otherwise."""
    inputs = [(tuple(s), d) for s, d in inputs]
    out_shapes = [tuple(s) for s in out_shapes]
    heads = sorted({_heads(s) for s, _ in inputs} - {None})
    if len(heads) != 2 or heads[0] < 1 or heads[1] % heads[0]:
        return None
    hk, hq = heads
    ranked = [s for s, _ in inputs if len(s) >= 3]
    if len({len(s) for s in ranked}) != 1 or len({s[:-3] for s in ranked}) != 1:
        return None
    if any(len(s) != len(ranked[0]) or s[:-3] != ranked[0][:-3] or _heads(s) != hq for s in out_shapes):
        return None
    packed = tuple(_pack(s, hk) if _heads(s) == hq else None for s, _ in inputs)
    out_packed = tuple(_pack(s, hk) for s in out_shapes)
    return HeadGroups(hq // hk, packed, out_packed, [(p or s, d) for p, (s, d) in zip(packed, inputs)],
                      list(out_packed))


def unpack(graph: KernelGraph, groups: HeadGroups, inputs: Sequence) -> KernelGraph:
    """``graph`` (a μGraph of the packed problem) on the original inputs: the packed inputs viewed before it and
    its outputs viewed back after it."""
    originals = [tuple(s) for s, _ in inputs]
    out_shapes = [_unpacked(p, groups) for p in groups.out_packed]
    return _replay(graph, originals,
                   lambda g, i, t: g.reshape(t, shape=groups.packed[i]) if groups.packed[i] else t,
                   lambda g, k, t: g.reshape(t, shape=out_shapes[k]))


def _unpacked(packed_out, groups: HeadGroups) -> tuple:
    """The original shape of a packed output (…, hk, g·s, d): (…, g·hk, s, d)."""
    *lead, hk, rows, d = packed_out
    return (*lead, hk * groups.group, rows // groups.group, d)


def _replay(graph: KernelGraph, in_shapes: Sequence, on_input: Callable, on_output: Callable) -> KernelGraph:
    """``graph`` rebuilt with input ``k`` of shape ``in_shapes[k]`` passed through ``on_input(builder, k, t)``
    and output ``k`` through ``on_output(builder, k, t)``."""
    g = new_kernel_graph()
    env: dict[Ref, object] = {}
    inputs = sorted((op.attrs["index"], i) for i, op in enumerate(graph.ops) if op.name == "input")
    for k, i in inputs:
        if k != g.n_inputs:
            raise MuGraphError(f"head grouping: input indices are not 0..n-1 ({[k for k, _ in inputs]})")
        env[Ref(i, 0)] = on_input(g, k, g.new_input(in_shapes[k], graph.ops[i].attrs["dtype"]))
    for i, op in enumerate(graph.ops):
        if op.name == "input":
            continue
        outs = g.add_op(op.name, [env[Ref(*r)] for r in op.inputs], body=op.body, **dict(op.attrs))
        for j, t in enumerate(outs):
            env[Ref(i, j)] = t
    for k, r in enumerate(graph.outputs):
        g.mark_output(on_output(g, k, env[Ref(*r)]))
    return g.build()
