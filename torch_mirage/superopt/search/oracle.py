"""Abstract-subexpression pruning (Mirage §4.2, SEARCH.md §2 and §6.3).

A partial μGraph survives only if each of its abstract expressions is a
subexpression of some target (the region's reference expressions) under the
axioms A_eq ∪ A_sub. :class:`SubexprOracle` answers that question:

* **Front** (structural, on :mod:`.expr` normal forms, a few µs): a candidate is
  kept when it is a target subterm; a sub-multiset of a target's flattened
  ``+`` or ``·``; a ``sum(s, x)`` where the target has ``sum(n, y)`` with
  ``s | n`` and ``x`` a factor part of ``y`` (a tile sum that the for-loop
  accumulator completes, or a sum later multiplied or divided); ``x/z`` where
  the target has ``(x·y)/(z·w)``; a ``concat`` of admitted parts.
* **Countermodel** (also structural): every expression is mapped into a small
  model of the axioms (the inputs it uses, the unary / uninterpreted symbols
  applied and to what, the pairs of inputs multiplied together, the reduction
  sizes, whether a ``+`` or a ``/`` occurs, which inputs are divided by
  outside any symbol; ``+``, ``·`` and ``/`` are unions,
  ``sub`` is inclusion with sizes ordered by divisibility; every A_eq equation
  holds in it and every A_sub axiom is an inclusion), so a candidate that is
  not below a target there is refuted for certain: exp / silu of something
  when the target has none, a product with an input the target never
  multiplies with, a sum over a size that divides no target sum. (Limit: the
  denominator component is computed on normal forms, where ``x/(a/b)`` is
  already ``(x·b)/a``; a candidate that is a quotient ``a/b`` and a target
  that divides by it is the one shape where it may refute too much. T1 checks
  every library prefix against it.)
* **Z3** decides what both leave open: the paper's axioms over an
  uninterpreted sort (quantified A_sub and A_eq, the size lemma grounded on
  the concrete sizes of the query), query ``¬ ∨_O sub(E, E_O)``; ``unsat`` =
  keep, ``sat`` = prune; a per-query timeout and a total Z3-time cap.
  ``unknown``, a timeout, an error or a missing z3 keep the candidate and are
  counted (the verifier guards correctness either way).
* ``strict`` prunes every candidate that is not proven (Mirage's own policy:
  its ``unknown`` meant pruned). It defaults to ``not use_z3``: with Z3 off the
  front decides alone (deterministic, fast); with Z3 on, an unknown or a
  missing z3 keeps the candidate. ``use_z3=False, strict=False`` keeps every
  candidate the countermodel does not refute.

Every answer is cached in memory by expression; ``disk_cache`` (a
:class:`~torch_mirage.cache.DiskCache`) keeps Z3's answers across runs, keyed
by the targets and the rule-set version.
"""
from __future__ import annotations

import logging
import time
from ...cache import cache_key
from collections import Counter
from typing import Sequence

from .expr import Expr, sibling_key

log = logging.getLogger("torch_mirage")

RULES_VERSION = 1


_COUNTS: dict = {}


def _counts(e: Expr) -> dict:
    """Multiplicities of ``e``'s factors but free constants (memoised per hash-consed term)."""
    c = _COUNTS.get(e)
    if c is None:
        c = _COUNTS[e] = Counter(a for a in (e.args if e.op == "mul" else (e,)) if not _free_const(a))
    return c


def _free_const(e: Expr) -> bool:
    """A constant 1/d (d a positive integer): the unit numerator of ``rsqrt(s) = 1/sqrt(s)``
    (the normal form folds ``x·(1/z)`` to ``x/z``) or a tile mean's 1/d that an
    ``acc_mean`` completes to the target's 1/n (``sum(4, x/4)`` inside ``sum(12, x/12)``).
    Other constants (eps, a foreign ``scalar_mul``) must occur in the target."""
    return e.op == "const" and e.attr.numerator == 1 and e.attr.denominator >= 1


def _factors(e: Expr) -> tuple:
    return e.args if e.op == "mul" else (e,)


def _le(small: Expr, big: Expr) -> bool:
    """The factors of ``small`` are a sub-multiset of those of ``big``."""
    if small is big:
        return True
    cs, cb = _counts(small), _counts(big)
    if len(cs) > len(cb):
        return False
    return all(cb.get(k, 0) >= n for k, n in cs.items())


def _lin_part(x: Expr, y: Expr) -> bool:
    """``x`` is a multiplicative part of ``y``: y = x·u or y = (x·u)/(d·w) with x = n/d.
    Free constants (:func:`_free_const`) are a part of everything."""
    if x is y or _free_const(x):
        return True
    if y.op == "mul":
        return _le(x, y)
    if y.op == "div":
        if x.op == "div":
            return _le(x.args[1], y.args[1]) and _lin_part(x.args[0], y.args[0])
        return _lin_part(x, y.args[0])
    return False


# Z3 is not asked again in a search once this many of its answers in a row were unknown (its per-query timeout):
# the queries left would most likely time out too, and an unknown decides as a skipped query does. At the Mirage
# set's real shapes on the 2-core CPU every one of its 11-15 queries per search timed out (200 ms each: ~3 s of a
# 4-5 s search) and none was decided (benchmarks/results/NOTES.md, 11-27).
Z3_UNKNOWN_RUN = 3


class SubexprOracle:
    """Is a candidate expression an abstract subexpression of one of ``targets``?"""

    def __init__(self, targets: Sequence[Expr], *, use_z3: bool = True, z3_timeout_ms: int = 200,
                 z3_total_s: float = 10.0, strict: bool | None = None, disk_cache=None,
                 z3_unknown_run: int = Z3_UNKNOWN_RUN):
        self.targets = list(targets)
        self.use_z3 = use_z3
        self.z3_unknown_run = int(z3_unknown_run)
        self._unknown_run = 0           # Z3's unknowns (timeouts) in a row, this search
        self.strict = (not use_z3) if strict is None else bool(strict)
        self.z3_timeout_ms = int(z3_timeout_ms)
        self.z3_total_s = float(z3_total_s)
        self.z3_seconds = 0.0
        self.stats: dict[str, int] = dict.fromkeys(
            ("queries", "cache_hits", "front", "front_misses", "z3", "z3_unsat", "z3_sat", "z3_unknown",
             "z3_skipped", "refuted", "rejected"), 0)
        self._model: dict[Expr, tuple] = {}
        self._target_models = [self.model(t) for t in self.targets]
        self._cache: dict[Expr, bool] = {}
        self._terms: set[Expr] = set()
        for t in self.targets:
            self._terms.update(t.subterms())
        by_op: dict[str, list[Expr]] = {}
        for t in self._terms:
            by_op.setdefault(t.op, []).append(t)
        self._muls = by_op.get("mul", [])
        self._adds = by_op.get("add", [])
        self._divs = by_op.get("div", [])
        self._sums = by_op.get("sum", [])
        self._siblings = {sibling_key(t) for t in by_op.get("sym", [])} - {None}
        self._disk, self._disk_key, self._disk_answers = disk_cache, None, {}
        if disk_cache is not None:
            self._disk_key = cache_key(kind="subexpr-oracle", rules=RULES_VERSION,
                                       targets=[str(t) for t in self.targets])
            got = disk_cache.get_json(self._disk_key)
            if isinstance(got, dict):
                self._disk_answers = {k: bool(v) for k, v in got.items()}
        self._z3 = None

    # ------------------------------------------------------------ queries
    def admits(self, e: Expr) -> bool:
        """Keep ``e``: it is (or may be) an abstract subexpression of a target."""
        self.stats["queries"] += 1
        hit = self._cache.get(e)
        if hit is not None:
            self.stats["cache_hits"] += 1
            return hit
        if self.front(e):
            self.stats["front"] += 1
            ans = True
        else:
            self.stats["front_misses"] += 1
            ans = self._decide(e)
        if not ans:
            self.stats["rejected"] += 1
        self._cache[e] = ans
        return ans

    def equivalent(self, e: Expr) -> int | None:
        """Index of the target that ``e`` equals (normal forms decide A_eq here), else None."""
        for i, t in enumerate(self.targets):
            if e is t:
                return i
        return None

    # ------------------------------------------------------------ front
    def front(self, e: Expr) -> bool:
        """The structural answer: True means an abstract subexpression for sure."""
        if e in self._terms:
            return True
        op = e.op
        if op == "sum":
            s, x = e.attr, e.args[0]
            return any(t.attr % s == 0 and _lin_part(x, t.args[0]) for t in self._sums)
        if op == "mul":
            return any(_le(e, t) for t in self._muls)
        if op == "div":
            return any(_lin_part(e, t) for t in self._divs)
        if op == "add":
            return any(self._add_part(e.args, t.args) for t in self._adds)
        if op == "concat":
            return all(self.admits(a) for a in e.args)
        if op == "sym":      # another output of an op whose output the target uses (online softmax's max)
            return sibling_key(e) in self._siblings
        return False

    def _add_part(self, parts: Sequence[Expr], whole: Sequence[Expr]) -> bool:
        free = list(whole)
        for p in parts:
            for i, w in enumerate(free):
                if p is w or (p.op == "sum" and w.op == "sum" and w.attr % p.attr == 0
                              and _lin_part(p.args[0], w.args[0])):
                    del free[i]
                    break
            else:
                return False
        return True

    # ------------------------------------------------------------ Z3
    def refutes(self, e: Expr) -> bool:
        """True when the countermodel shows ``e`` is below no target (so no derivation exists)."""
        if e.op == "concat":
            return any(self.refutes(a) for a in e.args)
        m = self.model(e)
        return not any(_model_le(m, t) for t in self._target_models)

    def model(self, e: Expr) -> tuple:
        """``e`` in the countermodel: (inputs, symbols applied (each with its
        argument's model value), multiplied input pairs, reduction sizes, inputs
        still exposed to a product, whether a ``+`` / a ``/`` occurs, inputs
        exposed in a denominator). A unary or
        uninterpreted symbol hides its inputs from later products (no A_eq
        axiom looks inside it); sums pass them through (``sum(a, x)·y = sum(a, x·y)``)."""
        got = self._model.get(e)
        if got is not None:
            return got
        op = e.op
        empty = frozenset()
        if op == "var":
            m = (frozenset({e.attr}), empty, empty, empty, frozenset({e.attr}), empty, empty)
        elif op == "const":
            m = (empty,) * 7
        else:
            parts = [self.model(a) for a in e.args]
            S, T, M, D, P, F, Q = (frozenset().union(*(p[i] for p in parts)) for i in range(7))
            if op == "div":
                Q |= parts[1][4]
            if op in ("mul", "div"):
                for i, p in enumerate(parts):
                    for q in parts[i + 1:]:
                        M |= {(min(a, b), max(a, b)) for a in p[4] for b in q[4]}
            if op in ("add", "div"):
                F |= {op}
            elif op == "sum":
                D |= {e.attr}
            elif op in ("fn", "sym"):       # the symbol, with its argument's whole model value
                T |= {(e.attr if op == "fn" else e.attr[0], tuple(parts))}
                P = empty
            m = (S, T, M, D, P, F, Q)
        self._model[e] = m
        return m

    def _decide(self, e: Expr) -> bool:
        if self.refutes(e):
            self.stats["refuted"] += 1
            return False
        if self.strict and not self.use_z3:
            return False
        if not self.use_z3:
            self.stats["z3_skipped"] += 1
            return True
        key = str(e)
        if key in self._disk_answers:
            return self._disk_answers[key]
        if self.z3_seconds >= self.z3_total_s or self._unknown_run >= self.z3_unknown_run:
            self.stats["z3_skipped"] += 1
            return not self.strict
        t0 = time.perf_counter()
        try:
            verdict = self._z3_query(e)
        except ImportError:
            self.stats["z3_skipped"] += 1
            log.debug("torch_mirage: z3 is not installed; keeping %s unpruned", e)
            return not self.strict
        except Exception as exc:     # a solver error keeps the candidate; the verifier still guards it
            self.stats["z3_unknown"] += 1
            log.debug("torch_mirage: z3 failed on %s (%s); keeping it", e, exc)
            return not self.strict
        finally:
            self.z3_seconds += time.perf_counter() - t0
        self.stats["z3"] += 1
        if verdict is None:
            self.stats["z3_unknown"] += 1
            self._unknown_run += 1
            return not self.strict
        self._unknown_run = 0
        self.stats["z3_unsat" if verdict else "z3_sat"] += 1
        self._disk_answers[key] = verdict
        return verdict

    def z3_admits(self, e: Expr) -> bool | None:
        """Z3 alone: True (derivable), False (refuted), None (unknown / timeout)."""
        return self._z3_query(e)

    def _z3_query(self, e: Expr) -> bool | None:
        if self._z3 is None:
            self._z3 = _Z3Axioms()
        return self._z3.subexpr(e, self.targets, self.z3_timeout_ms)

    def save(self) -> None:
        """Write Z3's answers to the disk cache (if one was given)."""
        if self._disk is not None and self._disk_answers:
            self._disk.put_json(self._disk_key, self._disk_answers)


def _both(fa, xs, lhs, rhs) -> list:
    """``lhs == rhs`` for all ``xs``, instantiated whenever either side appears."""
    return [fa(xs, lhs == rhs, patterns=[lhs]), fa(xs, lhs == rhs, patterns=[rhs])]


def _model_le(a: tuple, b: tuple) -> bool:
    return (a[0] <= b[0] and a[1] <= b[1] and a[2] <= b[2] and a[5] <= b[5] and a[6] <= b[6]
            and all(any(n % m == 0 for n in b[3]) for m in a[3]))


class _Z3Axioms:
    """The paper's A_eq / A_sub axioms over an uninterpreted sort P (SEARCH.md §2)."""

    def __init__(self):
        import z3
        self.z3 = z3
        self.P = z3.DeclareSort("P")
        P, I, B = self.P, z3.IntSort(), z3.BoolSort()
        self.add = z3.Function("add", P, P, P)
        self.mul = z3.Function("mul", P, P, P)
        self.div = z3.Function("div", P, P, P)
        self.red = z3.Function("red", I, P, P)
        self.sub = z3.Function("sub", P, P, B)
        self.fns: dict[str, object] = {}
        self.leaves: dict[str, object] = {}

    def _fn(self, name: str, arity: int):
        key = f"{name}/{arity}"
        f = self.fns.get(key)
        if f is None:
            f = self.z3.Function(f"f_{len(self.fns)}", *([self.P] * (arity + 1)))
            self.fns[key] = f
        return f

    def _leaf(self, name: str):
        c = self.leaves.get(name)
        if c is None:
            c = self.z3.Const(name, self.P)
            self.leaves[name] = c
        return c

    def term(self, e: Expr, sizes: set, memo: dict):
        got = memo.get(e)
        if got is not None:
            return got
        z3 = self.z3
        op = e.op
        if op == "var":
            t = self._leaf(f"v{e.attr}")
        elif op == "const":
            t = self._leaf(f"c[{e.attr}]")
        elif op in ("add", "mul"):
            f = self.add if op == "add" else self.mul
            args = [self.term(a, sizes, memo) for a in e.args]
            t = args[0]
            for a in args[1:]:
                t = f(t, a)
        elif op == "div":
            t = self.div(self.term(e.args[0], sizes, memo), self.term(e.args[1], sizes, memo))
        elif op == "sum":
            sizes.add(e.attr)
            t = self.red(z3.IntVal(e.attr), self.term(e.args[0], sizes, memo))
        else:
            name = e.attr if op == "fn" else f"{op}:{e.attr}"
            t = self._fn(str(name), len(e.args))(*(self.term(a, sizes, memo) for a in e.args))
        memo[e] = t
        return t

    def subexpr(self, e: Expr, targets: Sequence[Expr], timeout_ms: int) -> bool | None:
        z3 = self.z3
        P, add, mul, div, red, sub = self.P, self.add, self.mul, self.div, self.red, self.sub
        x, y, z = z3.Consts("x y z", P)
        a = z3.Int("a")
        fa = z3.ForAll
        s = z3.Solver()
        s.set("timeout", int(timeout_ms))
        ax = [
            # A_eq
            fa([x, y], add(x, y) == add(y, x), patterns=[add(x, y)]),
            fa([x, y], mul(x, y) == mul(y, x), patterns=[mul(x, y)]),
            fa([x, y, z], add(add(x, y), z) == add(x, add(y, z)), patterns=[add(add(x, y), z)]),
            fa([x, y, z], mul(mul(x, y), z) == mul(x, mul(y, z)), patterns=[mul(mul(x, y), z)]),
            # the equations below fire on either side (a candidate may hold the factored or the expanded form)
            *_both(fa, [x, y, z], add(mul(x, z), mul(y, z)), mul(add(x, y), z)),
            *_both(fa, [x, y, z], add(div(x, z), div(y, z)), div(add(x, y), z)),
            *_both(fa, [x, y, z], mul(x, div(y, z)), div(mul(x, y), z)),
            *_both(fa, [a, x, y], red(a, mul(x, y)), mul(red(a, x), y)),
            *_both(fa, [a, x, y], red(a, div(x, y)), div(red(a, x), y)),
            *_both(fa, [a, x, y], red(a, add(x, y)), add(red(a, x), red(a, y))),
            # A_sub
            fa([x], sub(x, x)),
            fa([x, y, z], z3.Implies(z3.And(sub(x, y), sub(y, z)), sub(x, z)),
               patterns=[z3.MultiPattern(sub(x, y), sub(y, z))]),
            fa([x, y], sub(x, add(x, y)), patterns=[add(x, y)]),
            fa([x, y], sub(x, mul(x, y)), patterns=[mul(x, y)]),
            fa([x, y], z3.And(sub(x, div(x, y)), sub(y, div(x, y))), patterns=[div(x, y)]),
            fa([a, x], sub(x, red(a, x)), patterns=[red(a, x)]),
        ]
        memo: dict = {}
        sizes: set = set()
        te = self.term(e, sizes, memo)
        tts = [self.term(t, sizes, memo) for t in targets]
        for f in self.fns.values():      # x_i ⊑ f(x_1, ..., x_k) for each unary / uninterpreted symbol
            xs = z3.Consts(" ".join(f"a{i}" for i in range(f.arity())), P)
            app = f(*xs)
            ax.append(fa(list(xs), z3.And(*[sub(v, app) for v in xs]), patterns=[app]))
        for m in sizes:                  # the size lemma, grounded: m | n  ⇒  red(m, x) ⊑ red(n, x)
            for n in sizes:
                if m != n and n % m == 0:
                    ax.append(fa([x], sub(red(m, x), red(n, x)), patterns=[red(n, x)]))
        vs = [c for k, c in self.leaves.items() if k.startswith("v")]
        if len(vs) > 1:
            ax.append(z3.Distinct(*vs))
        for v in vs:                     # inputs are atoms: no input is part of another
            for w in vs:
                if v is not w:
                    ax.append(z3.Not(sub(v, w)))
        s.add(*ax)
        s.add(z3.Not(z3.Or(*[sub(te, t) for t in tts])))
        r = s.check()
        if r == z3.unsat:
            return True
        if r == z3.sat:
            return False
        return None
