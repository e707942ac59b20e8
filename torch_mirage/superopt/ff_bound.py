"""The per-trial false-accept bound of the field test (Mirage §5, Theorems 2 and 3).

This module owns :class:`Deg`, a bound — valid for every element of a field value — on the shape of the fraction
N/D of exponential polynomials the element holds, its rules for each arithmetic step (the arithmetic of
:class:`~.finite_field.FiniteFieldArith` applies them as it computes), and from two outputs' ``Deg`` the
probability that one random trial accepts a wrong program: :func:`per_trial_bound` (derivation there and in
:func:`sparse_zero_bound`). Which elements share a denominator is tracked apart, in the denominator ids of
:mod:`.ff_tensor`; the bound takes the counts of distinct ids that the arithmetic reads off them.

A sqrt value U (a keyed random hash, :meth:`~.finite_field.FiniteFieldArith.sqrt`) counts as U = 1/W with W a
fresh variable per sqrt element (heuristic: a keyed hash is not a truly random function, and formally equal
arguments give one W, not two — neither changes a degree bound).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .ff_field import FieldParams, NotLAX


def bound_mul(a: float, b: float) -> float:
    """a·b for bounds (0·∞ = 0: a zero count of an unbounded thing is zero)."""
    return 0.0 if a == 0 or b == 0 else a * b


def _pow(b: float, e: float) -> float:
    if e == 0 or b == 1:
        return 1.0
    try:
        return float(b) ** e
    except OverflowError:
        return math.inf


def _prod_exps(fa: bool, a: "Deg", fb: bool, b: "Deg") -> tuple[bool, float, float]:
    """(may be nonzero, m, eh) of the exponent of a product of one term of a part of ``a`` (N or D;
    ``fa``: that part may have nonzero exponents) and one of ``b``:
    g1/h1 + g2/h2 = (g1·h2 + g2·h1)/(h1·h2); a part whose exponents are all 0 adds nothing."""
    if not fb:
        return (True, a.m, a.eh) if fa else (False, 0, 0)
    if not fa:
        return True, b.m, b.eh
    return True, max(a.m + b.eh, b.m + a.eh), a.eh + b.eh


def _fold_exps(j: float, d: "Deg") -> tuple[bool, float, float]:
    """Exponent of a product of ``j`` terms with nonzero exponents, each bounded by (d.m, d.eh)."""
    if j <= 0:
        return False, 0, 0
    return True, d.m + bound_mul(j - 1, d.eh), bound_mul(j, d.eh)


def _merge(*parts) -> tuple[bool, float, float]:
    flagged = [p for p in parts if p[0]]
    return (bool(flagged), max((p[1] for p in flagged), default=0), max((p[2] for p in flagged), default=0))


@dataclass(frozen=True)
class Deg:
    """Conservative shape of the function an element holds, written N/D with N, D exponential
    polynomials Σ_i f_i·exp(g_i/h_i) in the input elements (and the random max values, sqrt
    variables and λ): ``dn``/``dd`` bound the degrees of the coefficient polynomials f_i of N / of D,
    ``kn``/``kd`` their numbers of exp terms, ``m`` bounds deg g_i and ``eh`` deg h_i over all
    exponents of N and D (``eh`` = 0: every h_i is a constant); ``en``/``ed``: N / D may hold a
    term with a nonzero exponent (else it is one polynomial). ``has_exp`` (either) marks values
    downstream of an exp (an exp of such a value is not LAX). Floats so that they may saturate to
    inf (then no bound is claimed). Which elements share a denominator is kept apart, in the
    ``den`` ids."""
    dn: float = 0
    dd: float = 0
    kn: float = 1
    kd: float = 1
    m: float = 0
    eh: float = 0
    en: bool = False
    ed: bool = False

    def __post_init__(self):
        if not self.en:     # all exponents 0: one term, a polynomial
            object.__setattr__(self, "kn", 1)
        if not self.ed:
            object.__setattr__(self, "kd", 1)
        if not self.has_exp:
            object.__setattr__(self, "m", 0)
            object.__setattr__(self, "eh", 0)

    @property
    def has_exp(self) -> bool:
        return self.en or self.ed

    def add_shared(self, o: "Deg") -> "Deg":
        """N1/D + N2/D = (N1 + N2)/D: both operands have the same formal denominator."""
        return Deg(max(self.dn, o.dn), max(self.dd, o.dd), self.kn + o.kn, max(self.kd, o.kd),
                   max(self.m, o.m), max(self.eh, o.eh), self.en or o.en, self.ed or o.ed)

    def add(self, o: "Deg") -> "Deg":
        """N1/D1 + N2/D2 = (N1·D2 + N2·D1)/(D1·D2)."""
        en, m, eh = _merge(_prod_exps(self.en, self, o.ed, o), _prod_exps(o.en, o, self.ed, self))
        ed, md, ehd = _prod_exps(self.ed, self, o.ed, o)
        return Deg(max(self.dn + o.dd, o.dn + self.dd), self.dd + o.dd, self.kn * o.kd + o.kn * self.kd,
                   self.kd * o.kd, max(m, md), max(eh, ehd), en, ed)

    def mul(self, o: "Deg") -> "Deg":
        en, m, eh = _prod_exps(self.en, self, o.en, o)
        ed, md, ehd = _prod_exps(self.ed, self, o.ed, o)
        return Deg(self.dn + o.dn, self.dd + o.dd, self.kn * o.kn, self.kd * o.kd, max(m, md), max(eh, ehd),
                   en, ed)

    def inv(self) -> "Deg":
        return Deg(self.dd, self.dn, self.kd, self.kn, self.m, self.eh, self.ed, self.en)

    def reduce(self, n: int, g_eff: int = 1, g_nz: int = 0) -> "Deg":
        """The sum of ``n`` elements each bounded by ``self`` whose denominators take ``g_eff``
        distinct values (ids), ``g_nz`` of them not 1:
        Σ_g (Σ_{i∈g} N_i)·Π_{g'≠g} D_g' / Π_g D_g — each numerator term meets g_eff − 1 other
        denominators, the result's denominator is the product of the g_nz nontrivial ones; an
        exponent that sums j nonzero exponents has degree ≤ m + (j−1)·eh over j·eh."""
        g1 = max(g_eff - 1, 0)
        en, m, eh = _fold_exps(int(self.en) + (g1 if self.ed else 0), self)
        ed, md, ehd = _fold_exps(g_nz if self.ed else 0, self)
        return Deg(self.dn + bound_mul(g1, self.dd), bound_mul(g_nz, self.dd),
                   bound_mul(n, bound_mul(self.kn, _pow(self.kd, g1))), _pow(self.kd, g_nz), max(m, md), max(eh, ehd),
                   en, ed)

    def exp(self) -> "Deg":
        if self.has_exp:
            raise NotLAX("exp of a value that already went through exp (Mirage Definition 5.1: one exp per path)")
        return Deg(0, 0, 1, 1, self.dn, self.dd, True, False)

    def join(self, o: "Deg") -> "Deg":
        return Deg(max(self.dn, o.dn), max(self.dd, o.dd), max(self.kn, o.kn), max(self.kd, o.kd),
                   max(self.m, o.m), max(self.eh, o.eh), self.en or o.en, self.ed or o.ed)

    @property
    def constant(self) -> bool:
        return not self.has_exp and self.dn == 0 and self.dd == 0


CONST, VAR = Deg(), Deg(dn=1)


@dataclass(frozen=True)
class TrialBound:
    """One trial's false-accept bound ``eps`` for an output pair; ``terms`` = K, the exp terms of the
    cleared difference (0: no exp, a rational-function identity); ``proven`` False when ``eps`` uses
    the conjectured (K−1)/q (K ≥ 3)."""
    eps: float
    terms: float
    proven: bool


def sparse_zero_bound(dn: float, k: float, m: float, eh: float, has_exp: bool,
                      f: FieldParams) -> tuple[float, bool]:
    """Pr[F(x) = 0] for a nonzero F = Σ_{t≤k} c_t(x_p)·ω^{G_t(x_q)/H_t(x_q)} with deg c_t ≤ dn,
    deg G_t ≤ m, deg H_t ≤ eh, over uniform x ∈ Z_p^n × Z_q^n and a uniform q-th root of unity ω.
    Returns (bound, proven). Derivation (group the k terms by formal exponent; F ≢ 0 leaves some
    group with a nonzero coefficient polynomial C*; exponential polynomials with distinct exponents
    are linearly independent, so this is what "F is not the zero function" means):
      (A) some H_t(x_q) = 0:                    ≤ k·eh/q        Schwartz–Zippel (SZ), proven
      (B) two formally distinct exponents take one value: G_i H_j − G_j H_i (degree ≤ m + eh, nonzero)
          vanishes:                              ≤ C(k,2)·(m+eh)/q   SZ + union bound, proven
      (C) C*(x_p) = 0:                           ≤ dn/p          SZ, proven
      (D) else F(x) = Σ_v c_v ω^v with distinct v ∈ Z_q and some c_v ≠ 0, ω independent of x:
          zero for ≤ (k−1) of the q roots ω. k = 1: never (ω ≠ 0); k = 2: ω^{v1−v2} = −c2/c1 has one
          solution (ω ↦ ω^d permutes the q-th roots for d ≢ 0), proven; k ≥ 3: the uncertainty
          principle over Z_p that Li & Wu conjecture (Mirage Theorem 2 rests on it) — NOT proven.
    SZ needs the reduced polynomials to stay nonzero mod p and q: Theorem 2's condition that the
    coefficients' integer content stays below p, q (binary-rational constants of small size)."""
    if not has_exp:
        return dn / f.p, True
    pairs = bound_mul(k, k - 1) / 2
    eps = (bound_mul(k, eh) + bound_mul(pairs, m + eh) + (k - 1)) / f.q + dn / f.p
    return eps, k <= 2


def per_trial_bound(a: Deg, b: Deg, f: FieldParams, zero_risk: float = 0.0) -> TrialBound:
    """Theorem 2/3 per-trial false-accept bound for one output compared as a = N1/D1 vs b = N2/D2.

    A trial with no vanishing denominator accepts this output iff F = N1·D2 − N2·D1 vanishes, and
    F ≢ 0 when the programs differ. F has K ≤ kn1·kd2 + kn2·kd1 exp terms with coefficient degree
    ≤ max(dn1 + dd2, dn2 + dd1) and exponents (sums of one exponent of each side) of numerator
    degree ≤ max(m1 + eh2, m2 + eh1) over denominator degree ≤ eh1 + eh2 (just m_i, eh_i where the
    other factor has no exp): :func:`sparse_zero_bound`.
    Shared denominators (tracked by the ``den`` ids) are what keep kn, kd small for softmax(·)@V:
    each distinct denominator is counted once.

    Trials in which some inverted value vanished are redrawn (:class:`FiniteFieldArith` flags
    them), so the accepted trial is drawn conditioned on the event Z^c "no inverse of 0";
    Pr[F = 0 | Z^c] ≤ Pr[F = 0] / (1 − Pr[Z]), with Pr[Z] ≤ ``zero_risk``, the union bound over
    every inverted element of both programs (each numerator bounded by :func:`sparse_zero_bound`).
    The output bound of a multi-output, multi-element comparison is the max over elements: a wrong
    program is accepted only if a differing element's F vanishes."""
    has_exp, m, eh = _merge(_prod_exps(a.en, a, b.ed, b), _prod_exps(b.en, b, a.ed, a))
    K = a.kn * b.kd + b.kn * a.kd if has_exp else 0
    eps, proven = sparse_zero_bound(max(a.dn + b.dd, b.dn + a.dd), K, m, eh, has_exp, f)
    eps = eps / (1.0 - zero_risk) if zero_risk < 1.0 else math.inf
    if not math.isfinite(eps) or eps >= 1.0:
        return TrialBound(1.0, K, proven)
    return TrialBound(eps, K, proven)
