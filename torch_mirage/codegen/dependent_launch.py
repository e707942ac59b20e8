"""Programmatic dependent launch (PDL) of generated μGraph kernels: the next kernel is launched while this one runs.

In a CUDA graph each kernel still pays a fixed cost between the end of its predecessor and the start of its own
loads: the launch, its programs' setup. With PDL (Hopper and later) a kernel launched with ``launch_pdl=True`` may
start as soon as every program of its predecessor has called ``griddepcontrol.launch_dependents``; its programs
then wait in ``griddepcontrol.wait`` until the predecessor has finished and its writes are visible. A kernel emitted
here waits first and lets its dependents launch right after (:data:`WAIT_LINES`), so at most the next kernel is
resident ahead of time and nothing is read before its producer is done.

Measured on the H100 (2026-11-27, NOTES "Session 2026-11-27 (ninth)"): ``benchmarks/pdl_probe.py``, a chain of
eight 4096 x 4096 bf16 GEMVs in one CUDA graph, took 118.9 µs plain and 114.6 with this wait-then-trigger order
(126.0 when each kernel let its dependents launch before its wait, so that the whole chain sat resident at once;
178.8 with the weights asked into L2 before the wait). But the llama3-8b-4l decode step (b1, the same launches)
took 0.913 ms with it against 0.825 without (one run each, one machine): it is off by default until the cause is
known.

A predecessor that is not such a kernel (Inductor's, a copy) never triggers early: the launch then waits for its
end as any launch does. ``gdc_wait`` is a no-op where a kernel was launched without PDL. On: ``MIRAGE_PDL=1``, or
``options={"pdl": True}``; never on Triton's interpreter or a GPU before sm_90.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools

from ..config import load
from ..context import Target

# the first lines of a PDL kernel's body: wait for the predecessor, then let the next kernel launch
WAIT_LINES = ("tl.extra.cuda.gdc_wait()", "tl.extra.cuda.gdc_launch_dependents()")

_SETTING: contextvars.ContextVar[bool | None] = contextvars.ContextVar("torch_mirage_pdl", default=None)


@contextlib.contextmanager
def dependent_launches(enabled: bool):
    """Inside, generated kernels use PDL where :func:`enabled` allows it, as ``enabled`` says (a compile's
    configuration: the pipeline sets it from its ``pdl`` knob); outside, the environment's knob decides."""
    token = _SETTING.set(enabled)
    try:
        yield
    finally:
        _SETTING.reset(token)


def enabled(target: Target) -> bool:
    """Whether kernels generated now for ``target`` wait for their predecessor and are launched with PDL."""
    setting = _SETTING.get()
    if not (load().pdl if setting is None else setting):
        return False
    return target is Target.CUDA and _supported()


@functools.lru_cache(maxsize=None)
def _supported() -> bool:
    """The current CUDA device is sm_90 or later and this Triton has the grid dependency control ops."""
    import torch
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra import cuda
    except ImportError:
        return False
    return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents") and \
        "launch_pdl" in CUDAOptions.__dataclass_fields__
