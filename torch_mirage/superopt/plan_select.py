"""Kernel-plan selection as a binary linear program (FlashTensor §kernel mapping, after Korch).

A region that several kernel plans can compute offers :class:`Candidate` kernels, each with a cost (µs, from the
cost model), the values it produces and the values it needs from other kernels. :func:`select_plan` picks the
cheapest set by a BLP solved by PuLP (its bundled CBC, quietly):

    minimise   Σ_k cost_k · x_k,   x_k ∈ {0, 1}
    subject to Σ_{k produces o} x_k = 1          for every output o of the region (each produced exactly once)
               Σ_{k produces t} x_k ≤ 1          for every intermediate t (a shared one is produced, and paid, once)
               x_k ≤ Σ_{j produces t} x_j        for every kernel k and value t it needs

(plus :data:`TIE_US` per kernel: of plans whose costs tie, the one of fewer kernels) and returns the chosen
kernels in an order where each runs after the kernels whose values it needs. A greedy
choice per output cannot see that a kernel producing one output's intermediate also produces another output
(FlashAttention that also saves the row statistics a column-sum pass needs); the program does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import warnings

import pulp

TIE_US = 1e-3        # per chosen kernel: far below the cost model's resolution, it only breaks ties


class PlanError(ValueError):
    """No set of candidate kernels computes the region's outputs."""


@dataclass(frozen=True)
class Candidate:
    name: str
    cost_us: float
    produces: frozenset
    needs: frozenset = frozenset()


def select_plan(candidates: Sequence[Candidate], outputs: Iterable[str]) -> list[Candidate]:
    """The cheapest set of ``candidates`` producing each of ``outputs`` exactly once, in dependency order;
    raises :class:`PlanError` when none exists."""
    outputs = set(outputs)
    names = [c.name for c in candidates]
    if len(set(names)) != len(names):
        raise PlanError(f"plan selection: candidate names repeat: {names}")
    unmade = outputs - set().union(*(c.produces for c in candidates))
    if unmade:
        raise PlanError(f"plan selection: no candidate kernel produces {sorted(unmade)} (candidates: {names})")
    prob = pulp.LpProblem("kernel_plan", pulp.LpMinimize)
    x = {c.name: pulp.LpVariable(f"x{i}", cat=pulp.LpBinary) for i, c in enumerate(candidates)}
    prob += pulp.lpSum((c.cost_us + TIE_US) * x[c.name] for c in candidates)
    values = set(outputs).union(*(c.produces | c.needs for c in candidates))
    for i, t in enumerate(sorted(values)):
        made = pulp.lpSum(x[c.name] for c in candidates if t in c.produces)
        prob += (made == 1) if t in outputs else (made <= 1), f"produce_{i}"
        for j, c in enumerate(candidates):
            if t in c.needs:
                prob += x[c.name] <= made, f"need_{i}_{j}"
    with warnings.catch_warnings():     # PuLP 3.3 deprecates its bundled CBC in favour of a separate install
        warnings.simplefilter("ignore", DeprecationWarning)
        status = prob.solve(pulp.PULP_CBC_CMD(msg=False))
    if pulp.LpStatus[status] != "Optimal":
        raise PlanError(f"plan selection: no plan produces {sorted(outputs)} exactly once from {names} "
                        f"(solver: {pulp.LpStatus[status]})")
    chosen = [c for c in candidates if x[c.name].value() > 0.5]
    return _dependency_order(chosen)


def _dependency_order(chosen: list[Candidate]) -> list[Candidate]:
    """``chosen`` with every kernel after the producers of what it needs; raises on a cycle."""
    done: set = set()
    order: list[Candidate] = []
    left = list(chosen)
    while left:
        ready = [c for c in left if c.needs <= done]
        if not ready:
            raise PlanError(f"plan selection: kernels {[c.name for c in left]} need each other's values (a cycle)")
        for c in ready:
            order.append(c)
            done |= c.produces
            left.remove(c)
    return order


def plan_cost(plan: Sequence[Candidate]) -> float:
    return sum(c.cost_us for c in plan)
