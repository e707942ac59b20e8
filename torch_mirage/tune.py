"""Tuning: the fastest of named candidates — build, numeric check, timing and the winner cache, in one loop.

Every measured choice mirage makes goes through :func:`tune`: the launch configuration of a μGraph kernel
(:func:`.superopt.launch.choose`), alternative μGraphs of one program (:func:`.build.fastest`), mirage's kernel
for a region against Inductor's (:mod:`.runtime.measure`) and the whole graph against Inductor's compile on its
first call (:class:`.runtime.choose.FasterOf`). A caller that can compile a candidate's kernels without running
them passes ``precompile``: those compiles run first, all at once in a pool of threads (:mod:`.compile_pool`,
``MIRAGE_COMPILE_WORKERS`` of them), so that the loop after them only launches kernels already compiled.
Candidates are then built in order (one that fails to build is dropped), checked (one that disagrees with the
caller's reference is dropped), timed in the order A B … B A
(:func:`.timing.alternating_times`: clock and temperature drift meet every candidate alike) and the fastest
wins. The times are cached under the caller's key when every candidate that was built got a time, so a later
compile of the same choice on the same device reads the winner back without building or timing anything.

:func:`budget` bounds the seconds the choices made inside it may spend (the build stage's, by
``MIRAGE_TUNE_BUDGET_S``): once spent, a choice that the cache cannot answer takes its first candidate that builds
and passes the check, untimed and uncached (a later compile with time left tunes it).
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .compile_pool import run_all, workers
from .timing import HOPELESS, alternating_times, pooled_median

log = logging.getLogger("torch_mirage")

BUDGET_SPENT = "tuning budget spent"   # why a candidate was left out once the budget ran out


@dataclass
class _Budget:
    seconds: float
    deadline: float            # on time.perf_counter
    logged: bool = False       # the one log line saying it is spent


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("torch_mirage_tune_budget", default=None)


@contextlib.contextmanager
def budget(seconds: float | None):
    """Choices made inside share ``seconds`` of tuning (``None`` or 0: no limit)."""
    token = _BUDGET.set(_Budget(seconds, time.perf_counter() + seconds) if seconds else None)
    try:
        yield
    finally:
        _BUDGET.reset(token)


def budget_left() -> bool:
    """Whether choices made here may still time candidates: the enclosing :func:`budget` is not spent."""
    state = _BUDGET.get()
    return state is None or time.perf_counter() < state.deadline


def _budget_spent(label: str) -> bool:
    if budget_left():
        return False
    state = _BUDGET.get()
    if not state.logged:
        state.logged = True
        log.info("torch_mirage: the tuning budget (MIRAGE_TUNE_BUDGET_S=%g) is spent; each %s and later choice of this "
                 "graph takes its first candidate untimed", state.seconds, label)
    return True


@dataclass
class Tuned:
    winner: str | None                                   # None: no candidate could be timed
    times: dict[str, float] = field(default_factory=dict)   # µs per call of every timed candidate
    built: dict[str, Any] = field(default_factory=dict)     # what ``build`` returned, per surviving candidate
    dropped: dict[str, str] = field(default_factory=dict)   # why a candidate was not timed
    cached: bool = False                                 # the times were read from the cache
    budget_spent: bool = False                           # candidates left unbuilt or untimed by :func:`budget`


def cached_choice(cache: Any, key: str | None, names: Sequence[str] | None) -> Tuned | None:
    """The choice :func:`tune` stored under ``key`` (its times; the fastest the winner) where that winner is one of
    ``names`` (any name: None), else None — what :func:`tune` returns on a hit, for a caller that wants to know
    before building."""
    if cache is None or key is None:
        return None
    hit = cache.get_json(key)
    times = hit.get("times") if isinstance(hit, dict) else None
    if isinstance(times, dict) and times and all(isinstance(v, (int, float)) for v in times.values()) \
            and (names is None or min(times, key=times.get) in names):
        return Tuned(min(times, key=times.get), dict(times), cached=True)
    return None


def _progress(names: Sequence[str], desc: str | None):
    if desc is None:
        return names
    from tqdm.auto import tqdm   # optional at import time: the package imports without it
    # a Triton compile per candidate: a bar on a terminal, nothing elsewhere
    return tqdm(names, desc=desc, unit="candidate", leave=False, disable=None)


def tune(names: Sequence[str], time_half: Callable[[str, Any], list[float]], *,
         build: Callable[[str], Any] | None = None, check: Callable[[str, Any], str | None] | None = None,
         cache: Any = None, key: str | None = None, label: str = "candidate", progress: str | None = None,
         precompile: Callable[[str], Any] | None = None,
         estimate: Callable[[list[list[float]]], float] = pooled_median) -> Tuned:
    """Choose the fastest of ``names``.

    ``build(name)``: makes the candidate (its result is passed to ``check`` and ``time_half``, and kept until every
    candidate is timed: return what runs it, not its outputs — the check runs it, so that each candidate's
    outputs are freed once compared, not held all at once); raising drops it.
    ``check(name, built)``: a problem string drops the candidate (say, its output disagrees with the first one's);
    raising drops it as a build error.
    ``time_half(name, built)``: per-call µs samples of one half of the A B … B A schedule; raising drops it.
    ``estimate``: one time of a candidate's halves of samples (:func:`.timing.alternating_times`).
    ``cache`` / ``key``: a :class:`~.cache.DiskCache` and the key of this choice (the caller's versioned key):
    cached times whose winner is still among ``names`` are returned as they are.
    ``precompile(name)``: compiles the candidate's kernels without running anything on the device; called from
    worker threads, for every candidate at once, before the first build. What it raises is ignored: the build
    meets the same error and drops the candidate with it, as without a pool.
    """
    names = list(names)
    hit = cached_choice(cache, key, names)
    if hit is not None:
        return hit
    out = Tuned(None)
    start = time.perf_counter()
    if _budget_spent(label):   # the untimed choice: the first candidate that builds and passes the check
        out.budget_spent = True
        out.winner = next((n for n in names if _build_checked(n, build, check, out, label)), None)
        out.dropped.update({n: BUDGET_SPENT for n in names if n not in out.built and n not in out.dropped})
        return out
    if precompile is not None:
        compiled = run_all(names, precompile, workers())
        if compiled is not None:
            log.info("torch_mirage: compiled %d %s candidates in %.2f s (%s; %d failed, their builds say why)",
                     len(names), label, time.perf_counter() - start, compiled.how, len(compiled.errors))
    for name in _progress(names, progress):
        if out.built and _budget_spent(label):   # the budget ran out while building: time what is built
            out.budget_spent = True
            out.dropped.update({n: BUDGET_SPENT for n in names if n not in out.built and n not in out.dropped})
            break
        _build_checked(name, build, check, out, label)

    def failed(name: str, e: Exception) -> None:   # one that cannot be timed (not capturable, say) is not chosen
        log.info("torch_mirage: timing %s %s failed (%s: %s)", label, name, type(e).__name__, e)
        out.dropped[name] = f"timing: {type(e).__name__}"

    built_s = time.perf_counter() - start
    out.times = alternating_times(list(out.built), lambda name: time_half(name, out.built[name]),
                                  on_error=failed, estimate=estimate, hopeless=HOPELESS)
    if out.times:
        out.winner = min(out.times, key=out.times.get)
        log.info("torch_mirage: %s", ", ".join(f"{label} {n}: {us:.2f} µs" for n, us in out.times.items()))
        if cache is not None and key is not None and len(out.times) == len(out.built) and not out.budget_spent:
            cache.put_json(key, {"times": out.times})
    # compile time a user pays: where it goes (builds are Triton compiles; timing is the CUDA-graph replays)
    log.info("torch_mirage: tuned %d %s candidates in %.2f s (%d built in %.2f s, %d timed)", len(names), label,
             time.perf_counter() - start, len(out.built), built_s, len(out.times))
    return out



def _build_checked(name: str, build, check, out: Tuned, label: str) -> bool:
    """Build ``name`` and check it: into ``out.built``, or into ``out.dropped`` with why; True when it is kept. A
    check that raises (its first run, where the check runs the candidate) drops it as a build error does."""
    try:
        made = build(name) if build is not None else None
        problem = check(name, made) if check is not None else None
    except Exception as e:   # a candidate Triton cannot compile (registers, shared memory) is skipped
        log.info("torch_mirage: %s %s failed to build or run (%s: %s)", label, name, type(e).__name__, e)
        out.dropped[name] = f"build: {type(e).__name__}"
        return False
    if problem is not None:
        log.warning("torch_mirage: %s %s %s; not used", label, name, problem)
        out.dropped[name] = problem
        return False
    out.built[name] = made
    return True
