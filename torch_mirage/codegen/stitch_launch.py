"""The launcher of a stitch region: emit, load and wrap its kernel so that it runs on real tensors.

This module owns :func:`build_kernel` (emit the source with :func:`~.stitch_emit.emit_kernel`, write and import it
through the cache, wrap it) and :func:`make_launcher`: the region's prologue views on the inputs, the outputs
allocated with the strides the IR recorded, the launch (two for a split row: the partial statistics into an fp32
workspace, then the combining kernel), the epilogue views.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..capture.ir import Node, Value, map_values
from .loader import load_source
from .stitch_emit import emit_kernel
from .stitch_plan import StitchPlan
from .stitch_schedule import stat_slots

aten = torch.ops.aten


def broadcast_strides(t: torch.Tensor, space: Sequence[int]) -> list[int]:
    """``t``'s strides right-aligned into ``space``; broadcast (size-1 or missing) dims get stride 0."""
    r, k = len(space), t.dim()
    out = [0] * r
    for d in range(k):
        sd = r - k + d
        if t.shape[d] != 1:
            out[sd] = t.stride(d)
    return out


def _apply_layout(node: Node, env: dict[int, Any]) -> None:

    args, kwargs = map_values((node.args, node.kwargs), lambda v: env[id(v)])
    target = node.target
    if target in (aten.view.default, aten._unsafe_view.default):
        target = aten.reshape.default   # same values; tolerates inputs whose strides differ from the trace
    env[id(node.outputs[0])] = target(*args, **kwargs)


def make_launcher(plan: StitchPlan, inputs: Sequence[Value], jit_fn: Any,
                  partials_fn: Any = None) -> Callable[..., tuple]:
    """``(*region inputs) -> tuple(region outputs)``: prologue views, allocation, launch(es), epilogue views.

    A split row (``partials_fn``) first writes per-program statistics to an fp32 workspace, then ``jit_fn``
    combines them and stores.
    """
    space, mapping = tuple(plan.space), plan.mapping
    grid = mapping.grid
    ws_elems = len(stat_slots(plan)) * plan.rows * mapping.split if partials_fn is not None else 0
    input_ids = [id(v) for v in inputs]
    metas = [v.meta for v in plan.stored]

    def run(*tensors: torch.Tensor) -> tuple:
        env: dict[int, Any] = dict(zip(input_ids, tensors))
        for node in plan.prologue:
            _apply_layout(node, env)
        args: list[Any] = []
        device = None
        for v in plan.loads:
            t = env[id(v)]
            device = t.device if device is None else device
            args.append(t)
            args.extend(broadcast_strides(t, space))
        device = device or metas[0].device
        for v, meta in zip(plan.stored, metas):
            out = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=device)
            env[id(v)] = out
            strides = list(meta.stride) if len(meta.shape) == len(space) else list(meta.stride) + [0]
            args.append(out)
            args.extend(0 if s == 1 else st for s, st in zip(list(meta.shape) + [1] * (len(space) - len(meta.shape)), strides))
        meta = dict(BLOCK_M=mapping.block_m, BLOCK_N=mapping.block_n, num_warps=mapping.num_warps)
        if partials_fn is not None:
            args.append(torch.empty(ws_elems, dtype=torch.float32, device=device))
            partials_fn[grid](*args, **meta)
        jit_fn[grid](*args, **meta)
        for node in plan.epilogue:
            _apply_layout(node, env)
        return tuple(env[id(v)] for v in plan.outputs)

    run.__name__ = "stitch_region"
    return run


def build_kernel(plan: StitchPlan, inputs: Sequence[Value], cache_dir: str) -> tuple[Callable[..., tuple], str]:
    """Emit, write, import and wrap the region's kernel; returns (launcher, source path)."""

    source = emit_kernel(plan)
    module, path = load_source(source, cache_dir, prefix="stitch")
    return make_launcher(plan, inputs, module.stitch_kernel, getattr(module, "stitch_partials", None)), path
