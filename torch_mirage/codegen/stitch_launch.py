"""The launcher of a stitch region: emit, load and wrap its kernel so that it runs on real tensors.

This module owns :func:`build_kernel` (emit the source with :func:`~.stitch_emit.emit_kernel`, write and import it
through the cache, wrap it) and :class:`StitchLauncher`: the region's prologue views on the inputs, the outputs
allocated with the strides the IR recorded, the launch (two for a split row: the partial statistics into an fp32
workspace, then the combining kernel), the epilogue views; or the same on meta tensors to compile the kernels
ahead (:meth:`StitchLauncher.warmup`).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch

from ..capture.ir import Node, Value, map_values
from .aot import compile_ahead, run_kernel
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


class StitchLauncher:
    """``(*region inputs) -> tuple(region outputs)``: prologue views, allocation, launch(es), epilogue views.

    A split row (``partials_fn``) first writes per-program statistics to an fp32 workspace, then ``jit_fn``
    combines them and stores. :meth:`warmup` compiles the kernel(s) for the region's inputs as traced, ahead of the
    first call.
    """
    __name__ = "stitch_region"

    def __init__(self, plan: StitchPlan, inputs: Sequence[Value], jit_fn: Any, partials_fn: Any = None):
        self.plan, self.inputs, self.jit_fn, self.partials_fn = plan, list(inputs), jit_fn, partials_fn
        self.ws_elems = len(stat_slots(plan)) * plan.rows * plan.mapping.split if partials_fn is not None else 0

    def __call__(self, *tensors: torch.Tensor) -> tuple:
        return self._launch(tensors, run_kernel)

    def warmup(self) -> None:
        """Compile the kernel(s) for the region's inputs with their traced shapes, strides and dtypes (as meta
        tensors: aligned addresses) without running them (:func:`.aot.compile_ahead`; any thread). Nothing where
        a shape is dynamic."""
        metas = [v.meta for v in self.inputs]
        if not metas or any(m is None or not m.is_static for m in metas):
            return
        device = next((m.device for m in metas if m.device.type == "cuda"), metas[0].device)   # not a CPU scalar's
        tensors = [torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta") for m in metas]
        self._launch(tensors, functools.partial(compile_ahead, device=device))

    def _launch(self, tensors: Sequence[torch.Tensor], run: Callable[..., Any]) -> tuple:
        plan, mapping = self.plan, self.plan.mapping
        space, grid = tuple(plan.space), mapping.grid
        env: dict[int, Any] = {id(v): t for v, t in zip(self.inputs, tensors)}
        for node in plan.prologue:
            _apply_layout(node, env)
        args: list[Any] = []
        device = None
        for v in plan.loads:
            t = env[id(v)]
            device = t.device if device is None else device
            args.append(t)
            args.extend(broadcast_strides(t, space))
        metas = [v.meta for v in plan.stored]
        device = device or metas[0].device
        for v, meta in zip(plan.stored, metas):
            out = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=device)
            env[id(v)] = out
            strides = list(meta.stride) if len(meta.shape) == len(space) else list(meta.stride) + [0]
            args.append(out)
            shape = list(meta.shape) + [1] * (len(space) - len(meta.shape))
            args.extend(0 if s == 1 else st for s, st in zip(shape, strides))
        meta = dict(BLOCK_M=mapping.block_m, BLOCK_N=mapping.block_n, num_warps=mapping.num_warps)
        if self.partials_fn is not None:
            args.append(torch.empty(self.ws_elems, dtype=torch.float32, device=device))
            run(self.partials_fn, *args, grid=grid, **meta)
        run(self.jit_fn, *args, grid=grid, **meta)
        for node in plan.epilogue:
            _apply_layout(node, env)
        return tuple(env[id(v)] for v in plan.outputs)


def build_kernel(plan: StitchPlan, inputs: Sequence[Value], cache_dir: str) -> tuple[StitchLauncher, str]:
    """Emit, write, import and wrap the region's kernel; returns (launcher, source path)."""

    source = emit_kernel(plan)
    module, path = load_source(source, cache_dir, prefix="stitch")
    return StitchLauncher(plan, inputs, module.stitch_kernel, getattr(module, "stitch_partials", None)), path
