"""The search driver: iterative deepening over block-op count, anytime, every result verified.

``search(target, inputs, budget_s)`` looks for one graph-defined kernel op computing ``target`` (a
reference μGraph of pre-defined kernel ops, or its output expressions plus a reference program).
Per depth d = 1, 2, ... it enumerates the skeletons of exactly d block ops whose output
expressions equal the target's (:mod:`.generate`, pruned by the abstract-subexpression oracle),
instantiates their schedules (:mod:`.schedule`), filters them with a cheap fp64 probe run and then
verifies each with :func:`~torch_mirage.superopt.verify.verify` (finite-field test to the configured
error bound, then the float test). Only a verified μGraph is ever returned. Deepening stops after the
first depth that yields a verified μGraph, or at the deadline (the best verified so far is kept).
A big target is searched on shrunk shapes first and its μGraph carried back to the real sizes
(:mod:`.shrink`); the real sizes are searched only when that finds nothing. Grouped-query attention is
searched with its query heads packed onto their KV head (:mod:`.heads`; on the shrunk problem too, packed after
shrinking); every candidate is viewed back to the region's inputs before it is probed and verified against the
region's program.

Seeds: with ``seeds`` (the search claimer passes the ``ugraph_library`` knob's), the hand-built library's
μGraphs are tried first (:mod:`.seeds`: each instantiated at the dims the target's input shapes fix, its inputs
bound by shape, probed and verified against the target like any candidate); a verified one ends the search at
once (``source`` "seed"), so the common forms cost no enumeration. It is cached like a search result.

Softmax: a target holding ``exp(s − max(s))`` (attention, however the user writes it: ``torch.softmax``,
``F.scaled_dot_product_attention``, the exponentials by hand) is searched with the online-softmax for-loop
accumulator (its expression is softmax's, see :func:`.expr.expr_of_op`) and with ``scalar_mul`` by the
constants of the scores (the temperature, which must be applied before the exponential). Such a target is
first taken apart top-down (:mod:`.decompose`, in this process, cheapest tree first); the DFS runs only when
that verifies nothing.

Workers: with ``search_workers`` (MIRAGE_SEARCH_WORKERS) > 1 the first level of the canonical DFS (the
iterators' fmap choice x the first body op, numbered in DFS order) is dealt round-robin to that many
spawned processes, each running the same generator + oracle + probe + verify over its share under the
shared deadline. Every verified μGraph carries (cost, DFS position), and the minimum is kept, so the
choice equals the one-process search's whenever every share finishes the winning depth before the
deadline. A worker that dies loses its share (logged); the others' results are still used.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import multiprocessing as mp
import os
import pickle
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from ...cache import cache_key
from ...config import load
from ...numerics import relative_error, tolerance
from ...ugraph import KernelGraph, from_dict

from ..executor import execute
from ..validate import nbytes, validate
from ..verify import verify
from . import expr as E
from . import decompose
from .generate import KIND_ORDER, GenStats, Skeleton, enumerate_skeletons
from .heads import group_heads, unpack
from .oracle import SubexprOracle
from .schedule import schedules
from .seeds import SEED_WORKLOADS, Seed, find_seed
from .shrink import MAX_VERIFY_WORK, block_steps, executor_work, shrunk_problems, transfers

log = logging.getLogger("torch_mirage")

# The oracle's policy in the search: the structural front first, Z3 on its misses (at most 3 s of Z3 per
# search), and what is not proven is pruned (Mirage's own policy: its `unknown` meant pruned). Measured on
# RMSNorm+Linear (2,4,32)x(32,24) with eps: this finds the fused μGraph in 11.8 s with a 10 s Z3 cap, while
# keeping unproven misses (strict=False) had not found it after 40 s. The verifier guards correctness either way.
DEFAULT_ORACLE = dict(use_z3=True, strict=True, z3_total_s=3.0)
# A μGraph found on the shrunk problem is re-verified at the real size when its grid blocks x for-loop steps
# (the executor's Python steps) are at most this many and its executor work at most MAX_VERIFY_WORK; above
# either the compile stage's float check runs on it.
RECHECK_STEPS = 256


@dataclass
class SearchStats:
    generated: int = 0              # block ops created by the generator
    pruned: int = 0                 # rejected by the abstract-subexpression oracle
    duplicates: int = 0             # dropped as duplicate values
    candidates: int = 0             # complete skeletons whose expressions equal the target
    schedules: int = 0              # valid schedule instantiations tried
    rejected_by_probe: int = 0      # schedules whose fp64 probe run differs from the reference
    rejected_by_verifier: int = 0   # rejected by verify() (finite-field or float test)
    verified: int = 0
    depth: int = 0                  # deepest block-op count searched
    timed_out: bool = False
    seconds: float = 0.0
    oracle: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class SearchResult:
    best: KernelGraph | None
    stats: SearchStats
    skeleton: Skeleton | None = None
    source: str = ""                # "search", "seed" or "cache"
    reason: str = ""                # the winning verdict, or why nothing was found
    seed: Seed | None = None        # where the μGraph is a library seed: its binding to the region's inputs


def _specs(inputs) -> list[tuple[tuple, str]]:
    out = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            out.append((tuple(x.shape), str(x.dtype).removeprefix("torch.")))
        else:
            s, d = x
            out.append((tuple(s), str(d).removeprefix("torch.")))
    return out


def probe_range(inputs: Sequence) -> int:
    """The probe for-loop range of skeleton search: the smallest prime dividing the most input dims."""
    dims = [d for s, _ in inputs for d in s if d > 1]
    best, count = 2, -1
    for p in (2, 3, 5, 7, 11, 13):
        c = sum(d % p == 0 for d in dims)
        if c > count:
            best, count = p, c
    return best


def _eps_values(target: KernelGraph | None) -> tuple[float, ...]:
    """The eps constants a norm in the target may use (rms_norm / acc_rms attrs, scalar_add values)."""
    found = set()
    for op in (target.ops if target is not None else ()):
        if op.attrs.get("eps") is not None:
            found.add(float(op.attrs["eps"]))
        if op.name == "scalar_add" and abs(op.attrs["value"]) < 1e-2:
            found.add(float(op.attrs["value"]))
    return tuple(sorted(found)) or (0.0,)


def _scale_values(target: KernelGraph | None, targets) -> tuple[float, ...]:
    """The constants a block ``scalar_mul`` may multiply by: those of the target's ``scalar_mul`` ops that are
    factors of a softmax's scores (outside any function: the temperature), as the target gives them."""
    consts = set()
    for s in E.softmax_scores(targets):
        stack = [s]
        while stack:
            x = stack.pop()
            if x.op == "const" and x.attr not in (0, 1):
                consts.add(x)
            elif x.op in ("add", "mul", "div", "sum"):
                stack.extend(x.args)
    found = {float(op.attrs["value"]) for op in (target.ops if target is not None else ())
             if op.name == "scalar_mul" and E.const(op.attrs["value"]) in consts}
    return tuple(sorted(found))


def _make_oracle(targets, prune: bool, oracle_kwargs: dict):
    if not prune:
        return (lambda e: True), None
    o = SubexprOracle(targets, **oracle_kwargs)
    return o.admits, o


def op_kinds(targets) -> tuple[str, ...]:
    """The body-op kinds to enumerate. A free ``concat`` is not enumerated (concats of admitted parts
    are admitted, so they multiply the space: LoRA at depth 5 did not finish in 60 s); Mirage's LoRA
    macro ``concat_matmul`` is, when a target adds two reductions (the concat identity
    Σa·b + Σc·d = Σ(a‖c)·(b‖d)); a block row mean and ``sub`` are, when a target centres a row (LayerNorm);
    the online-softmax accumulator is, when a target holds a softmax."""
    two_sums = any(t.op == "add" and sum(a.op == "sum" for a in t.args) >= 2
                   for e in targets for t in e.subterms())
    centred = any(_centred(t) for e in targets for t in e.subterms())
    softmax = bool(E.softmax_scores(targets))
    return tuple(k for k in KIND_ORDER if k != "concat" and (k != "concat_matmul" or two_sums)
                 and (k not in ("sub", "reduce_mean") or centred) and (k != "acc_online_softmax" or softmax))


def _centred(t) -> bool:
    """``x - mean(x)`` (LayerNorm's centring): an add of a term with a negative factor over a sum."""
    def negative(a):        # (a softmax's max subtracted is not a centring: no sum of the row under a symbol)
        return a.op == "mul" and any(f.op == "const" and f.attr < 0 for f in a.args) and \
            not any(f.op == "sym" for f in a.args)
    return t.op == "add" and any((negative(a) and any(s.op == "sum" for s in a.subterms()))
                                 or (a.op == "sum" and negative(a.args[0])) for a in t.args)


def _unreachable(targets) -> str:
    """Why no enumerated block graph can equal the targets ('' when one may): a target holding an
    uninterpreted symbol (a max, an op without an abstract expression), which no block op kind the
    generator enumerates computes — except a softmax's row max inside ``Σ_n exp(s − max_n s)·…`` (the sum of
    exponentials and P·V the online-softmax accumulator computes; softmax probabilities on their own are not).
    Seeds and given candidates are still verified."""
    seen: set = set()

    def walk(t) -> str:
        if t in seen:
            return ""
        seen.add(t)
        if t.op == "sym":
            return f"the target holds {t.attr[0]}, which no enumerated block op computes"
        if E.softmax_score(t) is not None:
            return "the target holds softmax probabilities outside a sum over the keys (no P·V)"
        parts = t.args
        if t.op == "sum":
            body = t.args[0]
            num, den = (body.args[0], body.args[1]) if body.op == "div" else (body, None)
            parts = [E.softmax_score(f) if E.softmax_score(f) is not None and E.softmax_row(f) == t.attr else f
                     for f in (num.args if num.op == "mul" else (num,))] + ([den] if den is not None else [])
        for a in parts:
            why = walk(a)
            if why:
                return why
        return ""

    for e in targets:
        why = walk(e)
        if why:
            return why
    return ""


def _reduction_chain(target) -> bool:
    """A reference program without a matmul (a norm chain): its skeletons may keep whole rows in a block
    (no for-loop; a norm reads its row twice). A matmul's reduced dim is walked by the for-loop."""
    return isinstance(target, KernelGraph) and not any(op.name == "matmul" for op in target.ops)


def _cost(g: KernelGraph) -> tuple:
    """Fewest block ops, then fewest shared-memory bytes per block (a stand-in for the cost model)."""
    body = next(op.body for op in g.ops if op.name == "customized")
    return (len(body.ops), sum(nbytes(s, d) for op in body.ops for s, d in zip(op.shapes, op.dtypes)))


def search(target: KernelGraph | Sequence, inputs: Sequence, budget_s: float | None = None,
           seeds: bool | Sequence[str] = False, *, seeds_only: bool = False,
           reference: Callable | KernelGraph | None = None, out_shapes: Sequence | None = None,
           out_dtypes: Sequence | None = None, max_ops: int = 8, tile: int = 64, prune: bool = True,
           extra_candidates: Sequence[KernelGraph] = (), verify_kwargs: dict | None = None,
           oracle_kwargs: dict | None = None, probe: bool = True, cache=None,
           workers: int | None = None, decompose: bool = True) -> SearchResult:
    """Search for a verified one-kernel μGraph equal to ``target``.

    ``target``: a reference :class:`KernelGraph` (pre-defined ops; its outputs give the target
    expressions, shapes and dtypes, and it is the program candidates are verified against), or a
    sequence of target :class:`~.expr.Expr` (then ``reference``, ``out_shapes`` are required).
    ``inputs``: tensors or (shape, dtype) pairs, in input-index order. ``budget_s``: wall-clock
    budget (default: the ``search_budget_s`` knob); 0 returns no graph at once. ``seeds``: first try
    these hand-built library workloads (True: :data:`.seeds.SEED_WORKLOADS`), each instantiated for the target's
    input shapes and verified against it like any candidate (:func:`.seeds.find_seed`); a verified one is the
    result (``source`` "seed", ``seed`` its binding to the inputs: the library's μGraph itself, whose inputs may
    be ordered and shaped unlike the target's). ``seeds_only``: no enumeration after them. ``prune``: abstract-
    expression pruning (off: every op is kept; the candidate set is the same, only slower).
    ``extra_candidates``: μGraphs verified before the search (tests plant wrong ones here).
    ``oracle_kwargs``: passed to :class:`~.oracle.SubexprOracle` over :data:`DEFAULT_ORACLE` (e.g.
    ``use_z3=False``: the structural front decides alone). ``probe``: run each schedule once in fp64 against the reference
    before the (slower) verifier, to drop wrong imaps cheaply. ``cache``: a
    :class:`~torch_mirage.cache.DiskCache`; a verified result is stored under the canonical hash of the
    target with the input shapes / dtypes and the search settings (and the library versions), and a
    later search for the same target returns it without searching (``source`` "cache"). A corrupted or
    unreadable entry is ignored and rewritten. ``workers`` (default: the ``search_workers`` knob): worker
    processes; above 1 the first-level DFS branches are dealt round-robin to spawned workers (see
    :func:`_search_parallel`); 1 searches in this process. ``decompose``: take a softmax target apart top-down
    (:mod:`.decompose`) before the DFS (off: the DFS alone, for measurements).
    """
    t0 = time.monotonic()
    budget_s = load().search_budget_s if budget_s is None else budget_s
    stats = SearchStats()
    inputs = _specs(inputs)
    if isinstance(target, KernelGraph):
        targets = E.graph_exprs(target)
        reference = target if reference is None else reference
        outs = [target.ops[r[0]] for r in target.outputs]
        out_shapes = out_shapes or [o.shapes[r[1]] for o, r in zip(outs, target.outputs)]
        out_dtypes = out_dtypes or [o.dtypes[r[1]] for o, r in zip(outs, target.outputs)]
        eps = _eps_values(target)
        scales = _scale_values(target, targets)
    else:
        targets = list(target)
        if reference is None or out_shapes is None:
            raise ValueError("search: with target expressions, pass reference= (a program to verify against) "
                             "and out_shapes=")
        eps = (0.0,)
        scales = tuple(float(c.attr) for s in E.softmax_scores(targets) for c in s.subterms()
                       if c.op == "const" and c.attr not in (0, 1))
    out_shapes = [tuple(s) for s in out_shapes]
    if budget_s <= 0:
        log.info("μGraph search: budget %.3g s, no search", budget_s)
        return SearchResult(None, stats, reason="budget 0")
    deadline = t0 + budget_s
    vkw = dict(verify_kwargs or {})
    names = tuple(SEED_WORKLOADS if seeds is True else (seeds or ()))
    key = _cache_key(target, targets, inputs, out_shapes, out_dtypes, names, seeds_only, max_ops, tile) \
        if cache is not None and not extra_candidates else None
    if key is not None:
        hit = _cache_get(cache, key, budget_s)
        if hit is not None:
            stats.seconds = time.monotonic() - t0
            if hit[0] is None:      # an exhaustive search of the same target found nothing
                log.info("μGraph search: cached: nothing found (%s)", hit[2])
                return SearchResult(None, stats, source="cache", reason=f"cached: {hit[2]}")
            log.info("μGraph search: cached μGraph (%.3f s)", stats.seconds)
            return SearchResult(hit[0], stats, source="cache", reason="cached verified μGraph", seed=hit[1])

    if names and isinstance(target, KernelGraph) and reference is target:
        def counts(what: str) -> None:
            if what == "candidate":
                stats.candidates += 1
            else:
                setattr(stats, what, getattr(stats, what) + 1)
        seed = find_seed(target, inputs, out_shapes, names, eps, vkw, counts, scales)
        if seed is not None:
            stats.seconds = time.monotonic() - t0
            if key is not None:
                cache.put_json(key, {"graph": seed.graph.to_dict(), "source": "seed", "seed": seed.to_dict(),
                                     "stats": stats.as_dict()})
            log.info("μGraph search: seed %s verified in %.2f s", seed.describe(), stats.seconds)
            return SearchResult(seed.graph, stats, source="seed", reason=seed.reason, seed=seed)
    if seeds_only:
        stats.seconds = time.monotonic() - t0
        return SearchResult(None, stats, reason="no seed verified")

    workers = load().search_workers if workers is None else workers
    job = dict(targets=targets, reference=reference, inputs=inputs, out_shapes=out_shapes, out_dtypes=out_dtypes,
               eps=eps, scales=scales, goal_directed=decompose and bool(E.softmax_scores(targets)), max_ops=max_ops,
               tile=tile, prune=prune, vkw=vkw, probe=probe,
               oracle_kwargs={**DEFAULT_ORACLE, **(oracle_kwargs or {})},
               extra=list(extra_candidates), whole_rows=_reduction_chain(target))
    if workers > 1:
        try:
            pickle.dumps(job)
        except Exception as e:  # noqa: BLE001 - e.g. a lambda reference: search in this process
            log.info("μGraph search: the job does not pickle (%s); searching in one process", e)
            workers = 1
    plain = isinstance(target, KernelGraph) and reference is target and not extra_candidates
    groups = group_heads(inputs, out_shapes) if plain else None
    problem = job if groups is None else _packed(job, groups)
    shrunk = next(iter(shrunk_problems(target, inputs, out_shapes)), None) if plain else None
    verified = []
    if shrunk is not None:
        small_job = dict(job, targets=E.graph_exprs(shrunk.target), reference=shrunk.target, inputs=shrunk.inputs,
                         out_shapes=shrunk.out_shapes, tile=shrunk.tile)
        small_groups = group_heads(shrunk.inputs, shrunk.out_shapes) if groups is not None else None
        if small_groups is not None:
            small_job = _packed(small_job, small_groups)
        verified = _carried_back(_run_job(small_job, workers, deadline, stats), problem, shrunk, stats)
        if not verified and time.monotonic() < deadline:
            log.info("μGraph search: nothing carried back from the shrunk shapes; searching the real sizes")
    if not verified and time.monotonic() < deadline:
        verified = _run_job(problem, workers, deadline, stats)
    stats.seconds = time.monotonic() - t0
    if not verified:
        why = "deadline" if stats.timed_out else f"no verified μGraph within {max_ops} block ops"
        log.info("μGraph search: nothing found (%s); %s", why, stats.as_dict())
        if key is not None and (stats.timed_out or stats.seconds < budget_s):
            # exhaustive: nothing, again; cut by the deadline: nothing again within as many seconds (a model's
            # repeated layers: on a tiny Gemma-2, 2-core CPU, 11-26, each layer's MLP region spent its 30 s)
            cache.put_json(key, {"nothing": why, "budget_s": budget_s if stats.timed_out else None,
                                 "stats": stats.as_dict()})
        return SearchResult(None, stats, reason=why)
    cost, _, best, skel, source, reason, _ = min(verified, key=lambda v: v[:2])
    if key is not None:
        cache.put_json(key, {"graph": best.to_dict(), "source": source, "stats": stats.as_dict()})
    log.info("μGraph search: %s μGraph (%d block-graph ops) in %.2f s (%s)", source, cost[0], stats.seconds, reason)
    return SearchResult(best, stats, skel, source, reason)


def _run_job(job: dict, workers: int, deadline: float, stats: SearchStats) -> list:
    """One search over ``job`` in this process or in ``workers`` processes; its counts go into ``stats``. A
    goal-directed job tries :mod:`.decompose`'s skeletons in this process first."""
    if job.get("goal_directed") and workers > 1:
        verified = _run_job(dict(job, depths=False), 1, deadline, stats)
        if verified or time.monotonic() > deadline:
            return verified
        job = dict(job, goal_directed=False)
    if workers <= 1:
        verified, st, oracle_stats = _search_share(job, (0, 1), deadline)
        _merge_stats(stats, st)
        for k, v in oracle_stats.items():
            stats.oracle[k] = stats.oracle.get(k, 0) + v if isinstance(v, (int, float)) and not isinstance(v, bool) \
                else v
        return verified
    return _search_parallel(job, workers, deadline, stats)


def _carried_back(small: list, job: dict, shrunk, stats: SearchStats) -> list:
    """The first (cheapest) μGraph verified on the shrunk problem whose schedule carries back to the real
    sizes (:func:`.shrink.transfers`), re-verified there when that is cheap; [] when none does. Where no real-size
    schedule has the small one's structure, one that only splits the grid otherwise is taken
    (:func:`.shrink.transfers`), verified at the real size (when that is cheap; else none)."""
    inputs, out_shapes, out_dtypes = job["inputs"], job["out_shapes"], job["out_dtypes"]
    run_inputs = job.get("run_inputs", inputs)
    examples = [torch.zeros(s, dtype=getattr(torch, d)) for s, d in run_inputs]
    for cost, where, graph, skel, source, reason, sched in sorted(small, key=lambda v: v[:2]):
        if skel is None or sched is None:
            continue
        reals = list(transfers(skel, sched, inputs, out_shapes, tile=job["tile"], out_dtypes=out_dtypes,
                               exact=False))
        if not reals:
            log.debug("μGraph search: a μGraph verified on the shrunk shapes has no real-size schedule like its own")
            continue
        exact = reals[0][2]         # the small schedule's own structure (then the only one), or grid splits like it
        for real_sched, big, _ in reals:
            big = _viewed(job, big)
            steps = block_steps(big)
            if steps <= RECHECK_STEPS and executor_work(big) <= MAX_VERIFY_WORK:
                verdict = verify(big, job["reference"], examples, **job["vkw"])
                if not verdict:
                    stats.rejected_by_verifier += 1
                    (log.warning if exact else log.debug)(
                        "μGraph search: a μGraph verified on the shrunk shapes fails at the real sizes: %s",
                        verdict.reason)
                    continue
                why = f"{verdict.reason}; found on the shrunk shapes" + \
                    ("" if exact else ", its grid split otherwise at the real sizes")
            elif not exact:
                continue          # another grid split than the one verified, and too big to verify here
            else:
                sizes = ", ".join(f"{a}->{b}" for a, b in shrunk.sizes.items() if a != b)
                why = (f"{reason}; verified on the shrunk shapes ({sizes}), carried to the real sizes with the same "
                       f"imaps and splits ({steps} block steps: float-checked by the compile stage)")
            return [(_cost(big), where, big, skel, source, why, real_sched)]
    return []


def _packed(job: dict, groups) -> dict:
    """``job`` with GQA's query heads packed (:mod:`.heads`): skeletons and schedules on the packed shapes, every
    candidate viewed back (``unpack``) to ``run_inputs`` and checked against the region's own program."""
    return dict(job, inputs=groups.inputs, out_shapes=groups.out_shapes, groups=groups, run_inputs=job["inputs"])


def _viewed(job: dict, graph: KernelGraph) -> KernelGraph:
    """A μGraph of ``job``'s (maybe packed) problem on the region's inputs and outputs."""
    return graph if job.get("groups") is None else unpack(graph, job["groups"], job["run_inputs"])


@functools.cache
def _code_digest() -> str:
    """A digest of the search's own source (this package and the library its seeds come from): a cached answer,
    above all "nothing found", belongs to the code that gave it — the package version alone does not change
    between commits."""
    h = hashlib.sha256()
    here = os.path.dirname(os.path.abspath(__file__))
    files = [os.path.join(here, f) for f in sorted(os.listdir(here)) if f.endswith(".py")]
    for path in files + [os.path.join(os.path.dirname(here), "library.py")]:
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def _cache_key(target, targets, inputs, out_shapes, out_dtypes, seeds, seeds_only, max_ops, tile) -> str:
    tgt = target.hash() if isinstance(target, KernelGraph) else [str(e) for e in targets]
    return cache_key(kind="ugraph-search/2", code=_code_digest(), target=tgt,
                     inputs=[[list(s), d] for s, d in inputs], out_shapes=[list(s) for s in out_shapes],
                     out_dtypes=list(out_dtypes or []), seeds=list(seeds), seeds_only=seeds_only, max_ops=max_ops,
                     tile=tile)


def _cache_get(cache, key: str, budget_s: float) -> tuple[KernelGraph | None, Seed | None, str] | None:
    """``(μGraph, its seed binding for a seed, "")``, or ``(None, None, why)`` where an exhaustive search of the
    same target found nothing, or one of at least ``budget_s`` seconds ran out of time (a model's repeated layers
    search each distinct region once: on a tiny Qwen2, 2-core CPU, 11-26, the second layer's 9-node region cost the
    same 6 s again); None when absent, unusable, or a miss of a shorter budget (then the search runs and rewrites
    it)."""
    entry = cache.get_json(key)
    if entry is None:
        return None
    try:
        if "nothing" in entry:
            cut = entry.get("budget_s")
            return None if cut is not None and float(cut) < budget_s else (None, None, str(entry["nothing"]))
        g = from_dict(entry["graph"])
        validate(g)
        return g, (Seed.from_dict(entry["seed"], g) if entry.get("seed") is not None else None), ""
    except Exception as e:  # noqa: BLE001 - a bad entry is a miss, never an error
        log.warning("μGraph search: cache entry %s unusable (%s: %s); searching again", key[:16],
                    type(e).__name__, e)
        return None


def _run(program, xs) -> list[torch.Tensor]:
    if isinstance(program, KernelGraph):
        return list(execute(program, xs))
    with torch.no_grad():
        out = program(*xs)
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _close(got, ref) -> bool:
    if len(got) != len(ref):
        return False
    for a, b in zip(got, ref):
        if tuple(a.shape) != tuple(b.shape):
            return False
        # the max norm: one wrong element fails; NaN or inf in the reference fails too
        if not relative_error(a, b, norm="max") <= tolerance(torch.float64, "probe"):
            return False
    return True


def _merge_stats(stats: SearchStats, st: dict) -> None:
    for k in ("generated", "pruned", "duplicates", "candidates", "schedules", "rejected_by_probe",
              "rejected_by_verifier", "verified"):
        setattr(stats, k, getattr(stats, k) + st.get(k, 0))
    stats.depth = max(stats.depth, st.get("depth", 0))
    stats.timed_out |= bool(st.get("timed_out"))


def _search_share(job: dict, share: tuple[int, int], deadline: float, found_depth=None):
    """Iterative deepening over one share of the first-level branches. Returns (verified, stats dict,
    oracle stats); each verified entry is (cost, DFS position, graph, skeleton, source, reason)."""
    stats = SearchStats()
    inputs, out_shapes, out_dtypes = job["inputs"], job["out_shapes"], job["out_dtypes"]
    reference, vkw, targets = job["reference"], job["vkw"], job["targets"]
    run_inputs = job.get("run_inputs", inputs)      # the region's inputs (the search's, unless heads are packed)
    gen = torch.Generator().manual_seed(0)
    probe_in = [torch.randn(s, generator=gen, dtype=torch.float64) for s, _ in run_inputs]
    ref_out = _run(reference, probe_in)
    examples = [torch.zeros(s, dtype=getattr(torch, d)) for s, d in run_inputs]
    verified: list = []
    pos = [0]

    def check(graph: KernelGraph, skel, source, where, sched=None) -> bool:
        graph = _viewed(job, graph)
        if job["probe"] and not probe_ok(graph):
            stats.rejected_by_probe += 1
            return False
        verdict = verify(graph, reference, examples, **vkw)
        if not verdict:
            stats.rejected_by_verifier += 1
            log.debug("μGraph search: verifier rejects a candidate: %s", verdict.reason)
            return False
        stats.verified += 1
        why = verdict.reason + (f"; query heads packed {job['groups'].group} per KV head" if job.get("groups") else "")
        verified.append((_cost(graph), where, graph, skel, source, why, sched))
        return True

    def probe_ok(graph: KernelGraph) -> bool:
        try:
            got = execute(graph, probe_in)
        except Exception as e:  # noqa: BLE001 - a candidate that cannot run is rejected
            log.debug("μGraph search: candidate does not run: %s", e)
            return False
        return _close(got, ref_out)

    if share[0] == 0:       # given μGraphs: checked once, by the first share, ahead of the search
        for i, g in enumerate(job["extra"]):
            check(g, None, "given", (-1, i))

    if job.get("goal_directed") and share[0] == 0:      # the target taken apart top-down, cheapest tree first
        for skel in decompose.skeletons(targets, inputs, out_shapes, kinds=op_kinds(targets),
                                        probe_range=probe_range(inputs), scale_values=job.get("scales", ()),
                                        eps_values=job["eps"], max_ops=job["max_ops"]):
            stats.candidates += 1
            pos[0] += 1
            for sched, graph in schedules(skel, inputs, out_shapes, tile=job["tile"], out_dtypes=out_dtypes):
                stats.schedules += 1
                if check(graph, skel, "search", (len(skel.ops), -1, pos[0]), sched) or time.monotonic() > deadline:
                    break
            if verified or time.monotonic() > deadline:
                break
        stats.depth = max((len(v[3].ops) for v in verified), default=0)
    if not job.get("depths", True):
        return verified, stats.as_dict(), {}

    admits, oracle = _make_oracle(targets, job["prune"], job["oracle_kwargs"])
    if oracle is not None:
        is_target = lambda es: [oracle.equivalent(e) for e in es] == list(range(len(targets)))  # noqa: E731
    else:
        is_target = lambda es: list(es) == list(targets)  # noqa: E731 - hash-consed normal forms

    unreachable = _unreachable(targets)
    if unreachable:
        log.info("μGraph search: no enumeration (%s)", unreachable)
    for depth in range(1, 0 if unreachable or verified else job["max_ops"] + 1):
        if verified or time.monotonic() > deadline:
            break
        if found_depth is not None and 0 < found_depth.value < depth:
            break       # another worker found a μGraph at a shallower depth: deeper ones cost more
        stats.depth = depth
        gs = GenStats()
        for skel, _ in enumerate_skeletons(inputs, out_shapes, max_ops=depth, exact_ops=True,
                                           probe_range=probe_range(inputs), eps_values=job["eps"],
                                           scale_values=job.get("scales", ()), admits=admits,
                                           is_target=is_target, stats=gs, deadline=deadline,
                                           kinds=op_kinds(targets), whole_rows=job.get("whole_rows", False),
                                           share=share):
            pos[0] += 1
            for sched, graph in schedules(skel, inputs, out_shapes, tile=job["tile"], out_dtypes=out_dtypes):
                stats.schedules += 1
                if check(graph, skel, "search", (depth, gs.branch, pos[0]), sched):
                    break
                if time.monotonic() > deadline:
                    break
        for k in ("generated", "pruned", "duplicates", "candidates"):
            setattr(stats, k, getattr(stats, k) + getattr(gs, k))
        stats.timed_out |= gs.timed_out or time.monotonic() > deadline
        if verified and found_depth is not None:
            with found_depth.get_lock():
                if found_depth.value == 0 or depth < found_depth.value:
                    found_depth.value = depth
    return verified, stats.as_dict(), (dict(oracle.stats) if oracle is not None else {})


CRASH_ENV = "MIRAGE_SEARCH_TEST_CRASH_WORKER"   # tests: the worker of this index dies (os._exit) at start (config.NON_KNOB_VARIABLES)


def _worker_main(conn, job, share, deadline, found_depth) -> None:
    try:
        if os.environ.get(CRASH_ENV, "") == str(share[0]):
            os._exit(3)
        verified, st, ostats = _search_share(job, share, deadline, found_depth)
        conn.send(("ok", [(c, w, g.to_dict(), sk, src, r, sc) for c, w, g, sk, src, r, sc in verified], st, ostats))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which logs and drops the share
        try:
            conn.send(("error", f"{type(e).__name__}: {e}", {}, {}))
        except Exception:  # noqa: BLE001
            pass
    finally:
        conn.close()


GRACE_S = 10.0      # past the deadline, a worker gets this long to finish the verify it is in


def _search_parallel(job: dict, workers: int, deadline: float, stats: SearchStats) -> list:
    """Deal the first-level branches round-robin to ``workers`` spawned processes (fork is unsafe
    with torch's threads) and merge their verified μGraphs. A worker that dies or raises loses its
    share (logged); one still running at deadline + GRACE_S is terminated."""
    from multiprocessing.connection import wait
    ctx = mp.get_context("spawn")
    found_depth = ctx.Value("i", 0)
    # spawned children import torch_mirage: make sure they import this same package
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    old_pp = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = pkg_root + (os.pathsep + old_pp if old_pp else "")
    procs = {}
    try:
        for k in range(workers):
            r, w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker_main, args=(w, job, (k, workers), deadline, found_depth), daemon=True)
            p.start()
            w.close()
            procs[r] = (k, p)
    finally:
        if old_pp is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_pp
    verified: list = []
    oracle_stats: dict = {}
    lost = []
    while procs:
        left = deadline + GRACE_S - time.monotonic()
        ready = wait(list(procs), timeout=max(0.0, left))
        if not ready:
            for r, (k, p) in procs.items():
                log.warning("μGraph search: worker %d/%d still running past the deadline; terminated, its share "
                            "is lost", k, workers)
                p.terminate()
                lost.append(k)
                r.close()
            stats.timed_out = True
            break
        for r in ready:
            k, p = procs.pop(r)
            try:
                msg = r.recv()
            except (EOFError, OSError):
                p.join(1.0)
                log.warning("μGraph search: worker %d/%d died (exit code %s); its share is lost", k, workers,
                            p.exitcode)
                lost.append(k)
                continue
            finally:
                r.close()
            p.join(1.0)
            kind, payload, st, ostats = msg
            if kind != "ok":
                log.warning("μGraph search: worker %d/%d failed (%s); its share is lost", k, workers, payload)
                lost.append(k)
                continue
            _merge_stats(stats, st)
            for key, v in ostats.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    oracle_stats[key] = oracle_stats.get(key, 0) + v
            verified.extend((c, w, from_dict(g), sk, src, why, sc) for c, w, g, sk, src, why, sc in payload)
    stats.oracle.update(oracle_stats, workers=workers, lost_workers=sorted(lost))
    return verified
