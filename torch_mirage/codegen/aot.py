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

Inside :func:`captured_compiles` a compile ahead compiles nothing either: Triton's ``jit_cache_hook`` records what
the launch would compile (:class:`CompileRequest`: the generated file, the kernel, Triton's specialisation data of
the launch, the target and Triton's cache directory) and skips it, so that worker processes
(:mod:`.compile_worker`) compile it into Triton's cache, and the launch after them only loads it.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch

from ..context import Target

_BIND = threading.Lock()


def inductor_ptxas() -> str | None:
    """The ptxas Inductor points Triton at when it compiles its first kernel: torch's own (``torch/bin/ptxas``),
    where this torch ships one (CUDA builds), as ``_set_triton_ptxas_path`` finds it (torch 2.11-2.13)."""
    path = os.path.join(os.path.dirname(torch.__file__), "bin", "ptxas")
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


def pin_triton_environment(device: torch.device | None) -> dict[str, str | None] | None:
    """Triton's cache directory and ptxas for the rest of the process, fixed before mirage compiles anything for
    CUDA ``device``: what Inductor sets anyway, but only when it compiles or loads its first kernel, unless the
    user set them. Both are part of where a kernel is found: Triton reads ``TRITON_CACHE_DIR`` at every compile
    and load, and keys every kernel by the version of the ptxas ``TRITON_PTXAS_PATH`` names. Left to Inductor,
    mirage's kernels before that moment went to ``~/.triton/cache`` under Triton's bundled ptxas and the later
    ones to Inductor's directory under torch's ptxas; a later process — whose compiles come in another order once
    the disk caches answer the tuning — looked for them under the other directory or key and compiled them again
    (H200, HF llama: 10 launchers built with gcc and 12 kernels compiled in a warm process on 12-02; 12 kernels on
    12-03 with the directory pinned, the cold process's log saying "Triton's ptxas changed in this process").
    A value the user set is kept (where Triton compiled before, its cached ptxas version is the caller's to align:
    :func:`~torch_mirage.compile_pool.align_ptxas_version`). Returns the two values (None off CUDA: nothing is
    set)."""
    if device is None or device.type != "cuda":
        return None
    if os.environ.get("TRITON_CACHE_DIR") is None:
        from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

        os.environ["TRITON_CACHE_DIR"] = triton_cache_dir(device.index or 0)
    if os.environ.get("TRITON_PTXAS_PATH") is None and (ptxas := inductor_ptxas()) is not None:
        os.environ["TRITON_PTXAS_PATH"] = ptxas
    return {name: os.environ.get(name) for name in ("TRITON_CACHE_DIR", "TRITON_PTXAS_PATH")}


@dataclass(frozen=True)
class CompileRequest:
    """One launch's compile as a worker process makes it (:func:`.compile_worker.compile_request` reads it)."""
    path: str             # the generated module's file
    name: str             # the kernel's function in it
    specialization: str   # Triton's specialization_data of the launch (JSON)
    target: tuple         # (backend, arch, warp size)
    cache_dir: str        # Triton's cache directory, where the launch will look

    def to_json(self) -> dict:
        return {"path": self.path, "name": self.name, "specialization": self.specialization,
                "target": list(self.target), "cache_dir": self.cache_dir}


# the requests recorded in this context (None: compiles ahead compile); per thread, as contexts are
_CAPTURED: contextvars.ContextVar[list[CompileRequest] | None] = contextvars.ContextVar(
    "torch_mirage_captured_compiles", default=None)


@contextlib.contextmanager
def captured_compiles():
    """Compiles ahead inside record a :class:`CompileRequest` each and compile nothing; yields the list."""
    import triton

    got: list[CompileRequest] = []
    token = _CAPTURED.set(got)
    previous = triton.knobs.runtime.jit_cache_hook

    def hook(*, fn, compile, **kwargs):   # Triton calls it before every compile; True skips that compile
        captured = _CAPTURED.get()
        if captured is None:       # another thread's compile: as without this hook
            return previous(fn=fn, compile=compile, **kwargs) if previous is not None else None
        jit = fn.jit_function
        target = jit.device_caches[compile["device"]][2]
        captured.append(CompileRequest(jit.fn.__code__.co_filename, jit.fn.__name__, compile["specialization_data"],
                                       (target.backend, target.arch, target.warp_size), triton.knobs.cache.dir))
        return True
    triton.knobs.runtime.jit_cache_hook = hook
    try:
        yield got
    finally:
        triton.knobs.runtime.jit_cache_hook = previous
        _CAPTURED.reset(token)


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
