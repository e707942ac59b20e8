"""Ahead-of-time compiles of generated kernels: a kernel compiled for a launch's arguments without running it.

A launcher (:class:`~torch_mirage.superopt.compile.BlockLauncher`, :class:`.stitch_launch.StitchLauncher`)
assembles its kernels' arguments in one place and hands them to :func:`run_kernel` for a call or to
:func:`compile_ahead` for a warmup, so the two cannot differ. :func:`compile_ahead` calls Triton's
``JITFunction.warmup`` with the arguments and options of a launch: Triton specialises them as the launch will
(pointer dtypes and 16-byte alignment, integers equal to 1 or divisible by 16, constexprs, ``num_warps`` /
``num_stages``), compiles, keeps the kernel in the function's cache and launches nothing; the launch after it finds
the kernel compiled. A buffer the launch allocates itself is passed as a meta
tensor (or a dtype): Triton takes its address as aligned, as a fresh allocation's is. Compiles of different kernels
may run in threads at once (:mod:`torch_mirage.compile_pool`); under Triton's interpreter nothing is compiled and
:func:`compile_ahead` does nothing.
"""
from __future__ import annotations

import threading
from typing import Any

import torch

from ..context import Target

_BIND = threading.Lock()


def run_kernel(fn: Any, *args: Any, grid: tuple, **meta: Any) -> None:
    """Run ``fn`` on ``grid`` (compiling it first where its cache has no kernel for these arguments)."""
    fn[grid](*args, **meta)


def compile_ahead(fn: Any, *args: Any, grid: tuple, device: torch.device, **meta: Any) -> None:
    """Compile ``fn`` for the launch ``fn[grid](*args, **meta)`` on ``device`` without running it (any thread)."""
    if Target.current() is Target.INTERPRETER:
        return
    args = tuple(a.dtype if isinstance(a, torch.Tensor) and a.is_meta else a for a in args)
    with torch.cuda.device(device):
        caches = getattr(fn, "device_caches", None)   # Triton >= 3.2: a defaultdict made on the first launch
        if caches is not None:
            with _BIND:   # two threads making it at once would each keep a kernel cache, one of them lost
                caches[torch.cuda.current_device()]
        fn.warmup(*args, grid=grid, **meta)
