"""The compile pool: jobs that compile kernels ahead of their first launch, run in threads at once.

A Triton compile spends its time in C++ (MLIR passes, LLVM) and in ``ptxas``, a subprocess, with Python's lock
released, so threads overlap them (measured on 2 CPU cores: 11 launch configurations of an RMSNorm + Linear kernel
for sm_90 in 3.7 s one after another, 2.2 s on 2 threads, the same as on 2 processes), and threads need neither a
CUDA context per worker nor the kernels pickled back. The pool knows nothing of kernels: :func:`run_all` runs
``job(name)`` for every name and keeps what each raised; the caller decides what a failure means
(:func:`~torch_mirage.tune.tune` ignores it: the build after the pool meets the same error).
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .config import load

log = logging.getLogger("torch_mirage")

# the threads of the compile being made (the knob's setting: 0 = the usable cores); None: the knob as the environment
# sets it (a choice made outside a graph's compile, by a test or a script)
_SETTING: contextvars.ContextVar[int | None] = contextvars.ContextVar("torch_mirage_compile_workers", default=None)


@dataclass
class PoolRun:
    workers: int                                              # threads the jobs ran on
    errors: dict[str, BaseException] = field(default_factory=dict)   # what a job raised, by name


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # no affinity masks (macOS, Windows)
        return os.cpu_count() or 1


def resolve_workers(setting: int) -> int:
    """Threads for a ``MIRAGE_COMPILE_WORKERS`` setting: 0 means the usable cores."""
    return usable_cores() if setting == 0 else setting


@contextlib.contextmanager
def compile_workers(setting: int):
    """Compiles ahead inside use ``setting`` threads (``MIRAGE_COMPILE_WORKERS``: 0 = the usable cores, 1 = none
    ahead: each kernel compiles when it first runs)."""
    token = _SETTING.set(setting)
    try:
        yield
    finally:
        _SETTING.reset(token)


def workers() -> int:
    """Threads for compiles ahead here: the enclosing :func:`compile_workers`, else the environment's knob."""
    setting = _SETTING.get()
    return resolve_workers(load().compile_workers if setting is None else setting)


def run_all(names: Sequence[str], job: Callable[[str], Any], threads: int) -> PoolRun | None:
    """``job(name)`` for every name, on up to ``threads`` threads at once; returns once all have finished, with
    what each that failed raised. None, and nothing run, where that would be one thread (``threads`` 1 or a
    single name): the caller's own loop then compiles as it goes."""
    names = list(names)
    threads = min(threads, len(names))
    if threads <= 1:
        return None
    with ThreadPoolExecutor(threads, thread_name_prefix="torch_mirage_compile") as pool:
        futures = [(name, pool.submit(job, name)) for name in names]
    run = PoolRun(threads)
    for name, future in futures:
        error = future.exception()
        if error is not None:
            log.debug("torch_mirage: compiling %s ahead failed (%s: %s)", name, type(error).__name__, error)
            run.errors[name] = error
    return run
