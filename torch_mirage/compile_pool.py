"""The compile pool: jobs that compile kernels ahead of their first launch, run at once.

:func:`run_all` runs ``job(name)`` for every name and keeps what each raised; the caller decides what a failure
means (:func:`~torch_mirage.tune.tune` ignores it: the build after the pool meets the same error). The pool knows
nothing of kernels beyond :mod:`.codegen.aot`'s recorded compiles. Two ways to run them:

- **processes** (``MIRAGE_COMPILE_PROCESSES``, the default where kernels compile for CUDA): the jobs run one after
  another in the calling thread with their compiles recorded, not made (:func:`.codegen.aot.captured_compiles`);
  worker processes (:mod:`.codegen.compile_worker`, started once and kept) then compile the recorded launches
  into Triton's cache, and the launches after them only load the kernels. A Triton compile holds Python's lock
  for much of its time (its front end is Python): on 2 CPU cores a thread spinning beside a compile of the QKV
  kernel got about 40 % of its time; on the H100 machine's 16 cores 18 launch configurations of one decode
  kernel compiled in 7.0 s on 16 threads and in 3.5 s on 16 worker processes (2026-11-27).
- **threads**: the jobs themselves on up to ``threads`` threads (measured on 2 CPU cores: 11 launch configurations
  of an RMSNorm + Linear kernel for sm_90 in 3.7 s one after another, 2.2 s on 2 threads, the same as on 2
  processes). Where worker processes cannot start or die, the pool says so once and uses threads from then on.
"""
from __future__ import annotations

import atexit
import contextlib
import contextvars
import json
import logging
import os
import select
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .codegen import compile_worker
from .codegen.aot import captured_compiles
from .config import load
from .context import Target

log = logging.getLogger("torch_mirage")

# the compile workers of the compile being made (the knob's setting: 0 = the usable cores); None: the knob as the environment
# sets it (a choice made outside a graph's compile, by a test or a script)
_SETTING: contextvars.ContextVar[int | None] = contextvars.ContextVar("torch_mirage_compile_workers", default=None)
# whether those compiles run in worker processes (``MIRAGE_COMPILE_PROCESSES``); None: the environment's knob
_PROCESSES: contextvars.ContextVar[bool | None] = contextvars.ContextVar("torch_mirage_compile_processes", default=None)


@dataclass
class PoolRun:
    workers: int                                              # threads or processes the compiles ran on
    errors: dict[str, BaseException] = field(default_factory=dict)   # what a job raised, by name
    processes: bool = False                                   # compiled in worker processes (else threads)

    @property
    def how(self) -> str:
        """``"16 processes"`` / ``"2 threads"``: for the log lines that time a round."""
        return f"{self.workers} {'processes' if self.processes else 'threads'}"


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
def compile_workers(setting: int, processes: bool | None = None):
    """Compiles ahead inside use ``setting`` workers (``MIRAGE_COMPILE_WORKERS``: 0 = the usable cores, 1 = none
    ahead: each kernel compiles when it first runs), worker processes where ``processes``
    (``MIRAGE_COMPILE_PROCESSES``; None: as the environment says)."""
    token, token2 = _SETTING.set(setting), _PROCESSES.set(processes)
    try:
        yield
    finally:
        _SETTING.reset(token)
        _PROCESSES.reset(token2)


def workers() -> int:
    """Threads for compiles ahead here: the enclosing :func:`compile_workers`, else the environment's knob."""
    setting = _SETTING.get()
    return resolve_workers(load().compile_workers if setting is None else setting)


def _processes_wanted() -> bool:
    """Worker processes for the compiles ahead here: the setting says so, kernels compile for CUDA (not Triton's
    interpreter) and the workers have not failed in this process."""
    setting = _PROCESSES.get()
    if not (load().compile_processes if setting is None else setting) or _BROKEN.is_set():
        return False
    return Target.current() is Target.CUDA and torch.cuda.is_available()


def run_all(names: Sequence[str], job: Callable[[str], Any], threads: int) -> PoolRun | None:
    """``job(name)`` for every name, its compiles on up to ``threads`` worker processes (:func:`_processes_wanted`)
    or threads at once; returns once all have finished, with what each that failed raised. None, and nothing run,
    where that would be one worker (``threads`` 1 or a single name): the caller's own loop then compiles as it
    goes."""
    names = list(names)
    threads = min(threads, len(names))
    if threads <= 1:
        return None
    if _processes_wanted():
        try:
            return _run_in_processes(names, job, threads)
        except CompileWorkersFailed as e:
            _BROKEN.set()
            log.warning("torch_mirage: the compile worker processes failed (%s); compiling in threads from now on "
                        "(MIRAGE_COMPILE_PROCESSES=0 says so from the start)", e)
    with ThreadPoolExecutor(threads, thread_name_prefix="torch_mirage_compile") as pool:
        # each job in a copy of this context: the compile's settings (contextvars: dependent launches, ...) hold there
        futures = [(name, pool.submit(contextvars.copy_context().run, job, name)) for name in names]
    run = PoolRun(threads)
    for name, future in futures:
        error = future.exception()
        if error is not None:
            log.debug("torch_mirage: compiling %s ahead failed (%s: %s)", name, type(error).__name__, error)
            run.errors[name] = error
    return run


class CompileWorkersFailed(RuntimeError):
    """A compile worker process could not start, or died: the pool falls back to threads."""


_BROKEN = threading.Event()                     # set once the workers failed: threads from then on
_LOCK = threading.Lock()                        # one round at a time uses the workers
_WORKERS: list[subprocess.Popen] = []


_WORKER_PTXAS: list[str | None] = []           # the TRITON_PTXAS_PATH the running workers were started under


def align_ptxas_version() -> bool:
    """Make this process's Triton key its compiles by the ptxas that ``TRITON_PTXAS_PATH`` names now, as a worker
    started now does; True where it had to. Triton caches its ptxas's version (part of every kernel's cache key)
    the first time it needs it; Inductor points ``TRITON_PTXAS_PATH`` at torch's own ptxas later in the same
    process. Workers started after that compiled under keys this process never looked up, so every kernel compiled
    twice, the second time here, one at a time (H100 2026-11-27: a llama decode layer's build stage 132 s after
    an Inductor compile in the process, 29 s without one). :func:`_workers` calls it where the variable changed; a
    Triton without that cache (another version or backend) is left as it is."""
    path = os.environ.get("TRITON_PTXAS_PATH")
    try:
        from triton.backends.nvidia import compiler as nvidia
        cached = nvidia.get_ptxas_version
        if not (hasattr(cached, "cache_info") and hasattr(cached, "__wrapped__")) or not cached.cache_info().currsize:
            return False
        arch = 10 * torch.cuda.get_device_capability()[0] + torch.cuda.get_device_capability()[1]
        if cached(arch) == cached.__wrapped__(arch):
            return False
        old = cached(arch).strip().splitlines()[-1:]
        cached.cache_clear()
        log.info("torch_mirage: Triton's ptxas changed in this process (TRITON_PTXAS_PATH=%s, set after Triton first "
                 "used %s); its kernels are keyed by the new one from now on, as the compile workers key theirs",
                 path, old)
        return True
    except Exception as e:        # a Triton without these internals: nothing to align
        log.debug("torch_mirage: checking Triton's ptxas version failed (%s: %s)", type(e).__name__, e)
        return False


def _workers(count: int) -> list[subprocess.Popen]:
    """``count`` running compile workers (:mod:`.codegen.compile_worker`), started on first use and kept for the
    process's life (a worker that exited is replaced; all are replaced where ``TRITON_PTXAS_PATH`` changed since
    they started: Inductor sets it, and :func:`align_ptxas_version` then keys this process's kernels by the new
    ptxas, so workers must too)."""
    ptxas = os.environ.get("TRITON_PTXAS_PATH")
    if not _WORKER_PTXAS or _WORKER_PTXAS[0] != ptxas:
        _stop_workers()           # started under another ptxas: they would key their kernels by its version
        align_ptxas_version()
        _WORKER_PTXAS[:] = [ptxas]
    _WORKERS[:] = [w for w in _WORKERS if w.poll() is None]
    # they compile for the GPU whatever runs here (a test under Triton's interpreter compiles nothing itself)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    while len(_WORKERS) < count:
        try:
            _WORKERS.append(subprocess.Popen([sys.executable, compile_worker.__file__], stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, text=True, bufsize=1, env=env))
        except OSError as e:
            raise CompileWorkersFailed(f"cannot start {sys.executable} {compile_worker.__file__}: {e}") from e
    return _WORKERS[:count]


@atexit.register
def _stop_workers() -> None:
    for w in _WORKERS:
        with contextlib.suppress(Exception):
            w.stdin.close()      # a worker exits at the end of its input
    for w in _WORKERS:
        try:
            w.wait(timeout=5)
        except subprocess.TimeoutExpired:
            w.kill()
    _WORKERS.clear()


ANSWER_TIMEOUT_S = 600.0   # a worker that has not answered one compile in this long is taken for hung


def compile_in_workers(requests: Sequence[Any], count: int, timeout_s: float = ANSWER_TIMEOUT_S) -> list[str | None]:
    """Each request (a :class:`~.codegen.aot.CompileRequest`) compiled by one of ``count`` worker processes, all
    at once; what each compile raised, as text (None: compiled). Raises :class:`CompileWorkersFailed` where a
    worker dies, cannot start or gives no answer to one request in ``timeout_s`` (it is killed). Interrupted
    (Ctrl-C), it kills the workers of the round and re-raises: none is left compiling."""
    answers: list[str | None] = [None] * len(requests)
    pending = list(enumerate(requests))[::-1]
    taking = threading.Lock()          # the round's feeders take requests off one list
    failures: list[str] = []

    def feed(worker: subprocess.Popen) -> None:   # one thread per worker: one request at a time
        while not failures:
            with taking:
                if not pending:
                    return
                i, request = pending.pop()
            try:
                worker.stdin.write(json.dumps(request.to_json()) + "\n")
                worker.stdin.flush()
                # one answer line per request and nothing else on the pipe: nothing is buffered when it waits
                if not select.select([worker.stdout], [], [], timeout_s)[0]:
                    worker.kill()
                    failures.append(f"worker {worker.pid} gave no answer in {timeout_s:g} s (killed)")
                    return
                line = worker.stdout.readline()
            except (OSError, ValueError) as e:     # its pipe broke (it died), or was closed under it
                failures.append(f"worker {worker.pid}: {type(e).__name__}: {e}")
                return
            if not line:
                failures.append(f"worker {worker.pid} exited with {worker.poll()}")
                return
            answer = json.loads(line)
            answers[i] = None if answer.get("ok") else answer.get("error", "failed")

    with _LOCK:
        workers_ = _workers(min(count, len(requests)))
        feeders = [threading.Thread(target=feed, args=(w,), name="torch_mirage_compile_feed", daemon=True)
                   for w in workers_]
        for t in feeders:
            t.start()
        try:
            for t in feeders:
                t.join()
        except BaseException:          # Ctrl-C: stop feeding, and stop the compiles under way
            failures.append("interrupted")
            for w in workers_:
                w.kill()
            raise
    if failures:
        raise CompileWorkersFailed(failures[0])
    return answers


def _run_in_processes(names: Sequence[str], job: Callable[[str], Any], count: int) -> PoolRun:
    """The jobs one after another with their compiles recorded, then the recorded compiles in ``count`` worker
    processes (:func:`compile_in_workers`); a job's error is what it raised, or its first compile's."""
    run = PoolRun(count, processes=True)
    recorded: list[tuple[str, Any]] = []
    for name in names:
        with captured_compiles() as got:
            try:
                job(name)
            except Exception as e:
                run.errors[name] = e
        recorded += [(name, r) for r in got]
    unique = list(dict.fromkeys(r for _, r in recorded))     # two candidates may launch one kernel alike
    if unique:
        answers = dict(zip(unique, compile_in_workers(unique, count)))
        for name, r in recorded:
            if answers[r] is not None and name not in run.errors:
                log.debug("torch_mirage: compiling %s ahead failed (%s)", name, answers[r])
                run.errors[name] = RuntimeError(answers[r])
    return run
