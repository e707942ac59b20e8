"""The μGraph optimiser (Mirage §5, "μGraph optimizer"): tile layouts, operator order and the shared-memory plan of
one block graph, each an integer linear program solved by PuLP's bundled CBC.

**Layout.** Every rank-2 tile the Triton emitter can hold either way (``ugraph_triton.layout_rules``: iterator
tiles, elementwise ops over them, transposes) is row-major (as computed) or held transposed (column-major): an
iterator loads its tile transposed (nn.Linear's ``W[N, K]`` read as ``K × N``), an elementwise op runs on
transposed operands alike, a transpose between the two orientations is a relabel. A reader that wants the other
orientation gets a ``tl.trans`` conversion. Binary ``o[t]`` per flexible tile; the cost model, in bytes through
shared memory per block and iteration (a model with Mirage's ordering of costs — matched load < mismatched load <
explicit conversion — not a measurement):

* ``TRANSPOSED_LOAD`` per byte of an iterator tile loaded against its (row-major) memory order;
* ``CONVERT`` per byte of a ``tl.trans`` with a reader other than ``tl.dot`` (a layout conversion through shared
  memory: the tile written and read once);
* ``DOT_CONVERT`` per byte of a ``tl.trans`` read only by ``tl.dot`` (Triton folds it into the dot operand's
  shared-memory layout, as the emitter's ``tl.dot(q, tl.trans(k))`` relies on).

Ties go to the emitter's own layout (a term below one byte), so the generated source changes only where the model
sees a gain. Greedy (:func:`greedy_layout`) fixes each tile in op order from its inputs alone; it is wrong where a
tile's readers need the other orientation (a transposed weight scaled by a vector before the matmul: greedy loads
it upright and converts it, the ILP loads it transposed and converts nothing). A greedy layout that costs nothing
is optimal and needs no solve.

**Operator order and shared-memory plan.** The emitter writes a block graph in four phases (loop-invariant ops,
the for-loop's ops, its accumulator updates, the epilogue; ``ugraph_triton.phases``); within each it follows the
plan's order. A tile lives from the op that makes it to its last reader (a tile made before the loop and read in
it: to the loop's end; an accumulator state: from the loop's start); the peak of the live tiles' bytes (recorded
shapes and dtypes, as Mirage counts its stensors) is what the shared-memory plan must keep under the device's
shared memory. The ILP (per phase: ``x[i, p]`` op ``i`` at step ``p``) minimises that peak. Greedy is Mirage's
depth order (:func:`depth_order`, the emitter's default: fewest barriers between dependent ops), which loads every
independent input before reducing any. The plan keeps the depth order where its peak fits the device and takes
the ILP's where only that fits. :func:`memory_problem` is how ``validate`` decides Definition 2.1 (2) for block
graphs: the planned peak against the capacity (not the sum of all tiles), declining with the tiles live at the
peak.

A missing or failing solver gives the greedy plan with one log line. Plans are cached in memory by the block
graph's JSON (op indices matter) — a solve takes milliseconds, a cached plan microseconds — and, inside
:func:`plans_kept_in` (the pipeline's compile of a graph), the solved ones in the compile's disk cache: a warm
process spawns no CBC for a plan an earlier compile solved (H200 12-03: nine validations of the HF llama's decode
seeds, whose tiles exceed the depth order's capacity, took 0.48 s of a warm partition stage, most of it, by the
profile, waiting on subprocesses: CBC's).
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterator

try:
    import pulp
except ImportError:      # the greedy plan then (pulp is a declared dependency; a broken install still compiles)
    pulp = None

from ..codegen.ugraph_triton import layout_rules, order_by_depth, phases
from ..cache import cache_key, source_digest
from ..ugraph import BlockGraph, Ref, from_json, nbytes

log = logging.getLogger("torch_mirage")

# layout costs per byte of the tile (module docstring: a model, not a measurement)
TRANSPOSED_LOAD = 1     # an iterator tile loaded transposed
CONVERT = 2             # a tl.trans read by anything but tl.dot
DOT_CONVERT = 0         # a tl.trans read only by tl.dot
TIME_LIMIT_S = 2.0      # CBC's limit per solve (measured solves: 10-40 ms; a 13-op epilogue ordered: ~0.2-0.4 s)


class SolverFailed(RuntimeError):
    """CBC is missing, failed, or found no solution in its time limit."""


@dataclass(frozen=True)
class BlockPlan:
    """What the optimiser decided for one block graph: the order the emitter writes its ops in (within its
    phases), the ops whose tiles are held transposed, the layout's modelled cost, the planned peak of live tile
    bytes, and ``solver``: "cbc" (an ILP decided), "greedy" (the greedy plan is optimal: a free layout, a
    depth order that fits) or "fallback" (the solver failed; the greedy plan)."""
    order: tuple
    transposed: frozenset
    layout_cost: int
    peak_bytes: int
    solver: str


# ------------------------------------------------------------------ layout
def _tile_bytes(bg: BlockGraph, r) -> int:
    return nbytes(bg.shape(r), bg.dtype(r))


def layout_cost(bg: BlockGraph, transposed) -> int:
    """The modelled cost of holding the tiles of ``transposed`` (flexible ops) transposed and the rest upright."""
    rules = layout_rules(bg)
    t = frozenset(transposed) & rules.flexible
    need = rules.needs(t)
    cost = sum(TRANSPOSED_LOAD * _tile_bytes(bg, Ref(i, 0)) for i in t if bg.ops[i].name == "iterator")
    for r, readers in rules.readers.items():
        held = r[1] == 0 and r[0] in t
        wrong = [u for u, k in readers if need.get((u, k), False) != held]
        if wrong:
            dot = all(bg.ops[u].name == "matmul" for u in wrong)
            cost += (DOT_CONVERT if dot else CONVERT) * _tile_bytes(bg, r)
    return cost


def greedy_layout(bg: BlockGraph) -> frozenset:
    """Each flexible tile, in op order, takes the orientation that is cheapest for its own op given its inputs'
    (a load's cost, the conversions of its inputs); ties keep the emitter's default."""
    rules = layout_rules(bg)
    chosen: set[int] = set()
    for i in sorted(rules.flexible):
        op = bg.ops[i]

        def local(o: bool) -> int:
            if op.name == "iterator":
                return TRANSPOSED_LOAD * _tile_bytes(bg, Ref(i, 0)) if o else 0
            cost = 0
            for k, r in enumerate(op.inputs):
                want = o if rules.rules[i, k] == "same" else not o
                held = r[1] == 0 and r[0] in chosen
                cost += CONVERT * _tile_bytes(bg, r) if want != held else 0
            return cost
        default = i in rules.default
        if (not default if local(not default) < local(default) else default):
            chosen.add(i)
    return frozenset(chosen)


def ilp_layout(bg: BlockGraph) -> frozenset:
    """The layout of least :func:`layout_cost`, as a 0-1 ILP (module docstring); raises :class:`SolverFailed`."""
    rules = layout_rules(bg)
    flex = sorted(rules.flexible)
    if not flex:
        return frozenset()
    prob = _problem("layout")
    o = {i: _var(prob, f"o{i}", cat="Binary") for i in flex}

    def held(r):
        return o[r[0]] if r[1] == 0 and r[0] in o else 0

    def want(u, k):
        rule = rules.rules[u, k]
        return 0 if rule == "row" else o[u] if rule == "same" else 1 - o[u]

    terms = [TRANSPOSED_LOAD * _tile_bytes(bg, Ref(i, 0)) * o[i] for i in flex if bg.ops[i].name == "iterator"]
    for n, (r, readers) in enumerate(sorted(rules.readers.items())):
        conv = _var(prob, f"conv{n}")           # any conversion of r
        other = _var(prob, f"convx{n}")         # one read by something other than tl.dot
        for u, k in readers:
            diff = held(r) - want(u, k)
            for v in (conv,) + ((other,) if bg.ops[u].name != "matmul" else ()):
                prob += v >= diff
                prob += v >= -diff
        size = _tile_bytes(bg, r)
        terms += [DOT_CONVERT * size * conv, (CONVERT - DOT_CONVERT) * size * other]
    eps = 1.0 / (2 * (len(flex) + 1))          # ties: the emitter's default layout (costs are whole bytes)
    terms += [eps * (1 - o[i]) if i in rules.default else eps * o[i] for i in flex]
    prob += pulp.lpSum(terms)
    _solve(prob)
    return frozenset(i for i in flex if o[i].varValue > 0.5)


# ------------------------------------------------------------------ order and memory
def depth_order(bg: BlockGraph) -> tuple:
    return tuple(order_by_depth(bg, range(len(bg.ops))))


@dataclass(frozen=True)
class _Tile:
    ref: Ref
    size: int
    op: int | None           # the op that makes it in the timeline; None: an accumulator state (from the loop start)
    start: int               # its first step
    readers: frozenset       # the ops reading it (a fused matmul's reads are its accumulator's)
    hold: int                # the step it lives to whatever its readers' steps (-1: none)


def _timeline(bg: BlockGraph, order) -> tuple[list[list[int]], dict[int, int], list[_Tile]]:
    """The emitter's phases, each in ``order``; every op's step on one timeline; the tiles that take memory. A
    fused matmul runs at its accumulator's step and has no tile of its own (``tl.dot`` accumulates into the state);
    a tile made before the loop and read in it, and an accumulator state, live to the loop's end."""
    rank = {i: k for k, i in enumerate(order)}
    ph = phases(bg)
    segs = [sorted(s, key=rank.__getitem__) for s in (ph.invariant, ph.variant, ph.accumulators, ph.epilogue)]
    step = {i: k for k, i in enumerate(i for s in segs for i in s)}
    step.update({mm: step[acc] for mm, acc in ph.fused.items()})
    lo, hi = len(segs[0]), len(segs[0]) + len(segs[1]) + len(segs[2]) - 1     # the loop's first and last step
    in_loop = set(ph.variant) | set(ph.accumulators) | set(ph.fused)
    readers: dict[Ref, set[int]] = {}
    for u, op in enumerate(bg.ops):
        for r in op.inputs:
            readers.setdefault(Ref(*r), set()).add(ph.fused.get(u, u))
    tiles = []
    for i, op in enumerate(bg.ops):
        if i in ph.fused:
            continue
        acc = i in ph.accumulators
        for j in range(len(op.shapes)):
            rs = frozenset(readers.get(Ref(i, j), ()))
            hold = hi if acc or (i in ph.invariant and rs & in_loop) else -1
            tiles.append(_Tile(Ref(i, j), _tile_bytes(bg, Ref(i, j)), None if acc else i, lo if acc else step[i], rs,
                               hold))
    return segs, step, tiles


def _live(bg: BlockGraph, order) -> tuple[list[list[int]], list[list[tuple]]]:
    """The phases in ``order`` and, per step, the (bytes, ref) of the tiles live at it."""
    segs, step, tiles = _timeline(bg, order)
    live: list[list[tuple]] = [[] for _ in range(max(1, sum(map(len, segs))))]
    for t in tiles:
        end = max([step[u] for u in t.readers] + [t.start, t.hold])
        for p in range(t.start, end + 1):
            live[p].append((t.size, t.ref))
    return segs, live


def peak(bg: BlockGraph, order=None) -> tuple[int, list]:
    """(peak bytes, the tiles live at the peak, largest first) of the emitter's timeline in ``order`` (default:
    depth order)."""
    _, live = _live(bg, depth_order(bg) if order is None else order)
    at = max(live, key=lambda ts: sum(x for x, _ in ts))
    return sum(x for x, _ in at), sorted(at, reverse=True)


def _phase_peak(bg: BlockGraph, order, k: int) -> int:
    segs, live = _live(bg, order)
    lo = sum(map(len, segs[:k]))
    return max((sum(x for x, _ in ts) for ts in live[lo:lo + len(segs[k])]), default=0)


def ilp_order(bg: BlockGraph) -> tuple:
    """A topological order of least :func:`peak`, phase by phase (a phase keeps depth order unless the ILP's
    order has a strictly lower peak there); raises :class:`SolverFailed`."""
    order = list(depth_order(bg))
    segs, step, tiles = _timeline(bg, order)
    for k, seg in enumerate(segs):
        if len(seg) < 3:
            continue
        lo = sum(map(len, segs[:k]))
        best = _order_phase(bg, seg, lo, lo + len(seg), step, tiles)
        trial = [i for j, s in enumerate(segs) for i in (best if j == k else s)]
        if _phase_peak(bg, trial, k) < _phase_peak(bg, order, k):
            segs[k] = best
            order = trial
    fused = phases(bg).fused
    out = []
    for i in (i for s in segs for i in s):
        out += [m for m, a in fused.items() if a == i] + [i]
    return tuple(out)


def _order_phase(bg: BlockGraph, seg: list, lo: int, hi: int, step: dict, tiles: list[_Tile]) -> list:
    """The order of phase ``seg`` (steps ``lo``..``hi``-1) of least peak: ``x[i, p]`` = op i at step p."""
    n, members = len(seg), set(seg)
    prob = _problem("order")
    x = {(i, p): _var(prob, f"x{i}_{p}", cat="Binary") for i in seg for p in range(n)}
    done = {(i, p): pulp.lpSum(x[i, q] for q in range(p + 1)) for i in seg for p in range(n)}   # at step <= p
    for i in seg:
        prob += pulp.lpSum(x[i, p] for p in range(n)) == 1
    for p in range(n):
        prob += pulp.lpSum(x[i, p] for i in seg) == 1
    fused = phases(bg).fused
    for u in seg:
        srcs = {r[0] for m in [u] + [m for m, a in fused.items() if a == u] for r in bg.ops[m].inputs}
        for src in srcs & members:
            prob += x[u, 0] == 0
            for p in range(1, n):
                prob += done[u, p] <= done[src, p - 1]
    fixed = [0] * n
    rows: list[list] = [[] for _ in range(n)]
    for t in tiles:
        inside = t.readers & members
        outside = max([step[u] for u in t.readers - members] + [t.hold, -1])
        mine = t.op in members
        if not t.size or (not mine and (t.start >= hi or (outside < lo and not inside))):
            continue
        if not mine and outside >= hi:
            fixed = [v + t.size for v in fixed]          # live over the whole phase
            continue
        live = [_var(prob, f"l{t.ref[0]}_{t.ref[1]}_{p}") for p in range(n)]
        for p in range(n):
            made = done[t.op, p] if mine else 1
            if lo + p <= outside:     # read or held at a fixed step at or past this one (held to the loop's end)
                prob += live[p] >= made
            for u in inside or ({t.op} if mine else ()):
                prob += live[p] >= made - (done[u, p - 1] if p else 0)
            rows[p].append(t.size * live[p])
    top = _var(prob, "peak")
    for p in range(n):
        prob += top >= fixed[p] + pulp.lpSum(rows[p])
    prob += top
    _solve(prob)
    return sorted(seg, key=lambda i: next(p for p in range(n) if x[i, p].varValue > 0.5))


# ------------------------------------------------------------------ the plan
def _problem(name: str):
    if pulp is None:
        raise SolverFailed("pulp is not installed")
    return pulp.LpProblem(name, pulp.LpMinimize)


def _var(prob, name: str, cat: str = "Continuous"):
    """A variable of ``prob`` (>= 0; 0/1 when binary), by PuLP 3's API where it has it."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, lowBound=0, upBound=1 if cat == "Binary" else None, cat=cat)
    return pulp.LpVariable(name, lowBound=0, cat=cat)


def _solve(prob) -> None:
    """Solve ``prob`` with the CBC binary bundled with PuLP (quiet, ``TIME_LIMIT_S``); raises
    :class:`SolverFailed` without an optimum."""
    try:
        cbc = pulp.COIN_CMD(path=pulp.PULP_CBC_CMD.pulp_cbc_path, msg=False, timeLimit=TIME_LIMIT_S)
        status = prob.solve(cbc)
    except Exception as e:  # noqa: BLE001 - a missing binary, a crash: the caller falls back
        raise SolverFailed(f"{type(e).__name__}: {e}") from None
    if pulp.LpStatus[status] != "Optimal":
        raise SolverFailed(f"CBC status {pulp.LpStatus[status]}")


_PLAN_STORE: contextvars.ContextVar = contextvars.ContextVar("torch_mirage_block_plans", default=None)


@contextlib.contextmanager
def plans_kept_in(cache: Any) -> Iterator[None]:
    """Block plans the solver decides inside this context are read from and kept in ``cache`` (a
    :class:`~torch_mirage.cache.DiskCache`; None: in memory only)."""
    token = _PLAN_STORE.set(cache)
    try:
        yield
    finally:
        _PLAN_STORE.reset(token)


def _plan_code() -> str:
    return source_digest("superopt/optimise.py", "codegen/ugraph_triton.py", "ugraph.py")


def plan_block(bg: BlockGraph, capacity: int) -> BlockPlan:
    """The optimiser's plan for ``bg`` on a device with ``capacity`` bytes of shared memory per block (cached by
    the block graph's JSON). Layout: the ILP's, where the greedy layout pays anything (a free one is optimal).
    Order: Mirage's depth order (fewest barriers between dependent ops), the ILP's least-peak order where that
    fits ``capacity`` and the depth order does not."""
    return _plan(json.dumps(bg.to_dict(), sort_keys=True), capacity, _PLAN_STORE.get())


@lru_cache(maxsize=1024)
def _plan(key: str, capacity: int, store: Any) -> BlockPlan:
    disk = cache_key(kind="block-plan", graph=key, capacity=capacity, code=_plan_code()) if store is not None \
        else None
    kept = store.get_json(disk) if disk is not None else None
    if isinstance(kept, dict):
        try:
            return BlockPlan(tuple(kept["order"]), frozenset(kept["transposed"]), int(kept["layout_cost"]),
                             int(kept["peak_bytes"]), str(kept["solver"]))
        except (KeyError, TypeError, ValueError):
            pass      # not of this form: solved again, and kept anew
    plan = _solved(key, capacity)
    if disk is not None and plan.solver == "cbc":     # greedy plans cost nothing; a failed solve is not kept
        store.put_json(disk, {"order": list(plan.order), "transposed": sorted(plan.transposed),
                              "layout_cost": plan.layout_cost, "peak_bytes": plan.peak_bytes,
                              "solver": plan.solver})
    return plan


def _solved(key: str, capacity: int) -> BlockPlan:
    bg = from_json(key)
    transposed, order, solver = greedy_layout(bg), depth_order(bg), "greedy"
    try:
        if layout_cost(bg, transposed) > 0:
            transposed, solver = ilp_layout(bg), "cbc"
        if peak(bg, order)[0] > capacity:
            least = ilp_order(bg)
            solver = "cbc"
            if peak(bg, least)[0] <= capacity:       # else neither fits: the order changes nothing
                order = least
    except SolverFailed as e:
        log.info("torch_mirage: μGraph optimiser: the ILP solver failed (%s); using the greedy plan "
                 "(depth order, greedy layout)", e)
        transposed, order, solver = greedy_layout(bg), depth_order(bg), "fallback"
    return BlockPlan(order, transposed, layout_cost(bg, transposed), peak(bg, order)[0], solver)


def memory_problem(bg: BlockGraph, capacity: int) -> str | None:
    """None where the block graph's planned peak of live tile bytes fits ``capacity``, else why not (the tiles
    live at the peak and what to do). The depth order is tried first; the optimiser's only when it does not fit."""
    if peak(bg)[0] <= capacity:
        return None
    top, live = peak(bg, plan_block(bg, capacity).order)
    if top <= capacity:
        return None
    tiles = ", ".join(f"{bg.ops[r[0]].name} (op {r[0]}) {bg.dtype(r)}{list(bg.shape(r))} {size} B"
                      for size, r in live[:3])
    return (f"its tensors need {top} bytes of block-level memory at the peak of the planned op order "
            f"(live there: {tiles}{', ...' if len(live) > 3 else ''}), capacity {capacity}; "
            "use smaller tiles (a larger grid or forloop_range)")
