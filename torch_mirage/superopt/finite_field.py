"""Finite-field arithmetic for the probabilistic equivalence verifier (Mirage §5, Table 3).

Values are elements of Z_p × Z_q with q | p − 1. Every op except ``exp`` acts on
both components independently (modular arithmetic; division multiplies by the
inverse, Fermat's little theorem). ``exp`` maps the Z_q component x_q to
ω^{x_q} ∈ Z_p, with ω a uniformly random q-th root of unity in Z_p; since
x ↦ ω^x is a homomorphism Z_q → Z_p^*, exp(a)·exp(b) = exp(a + b) holds exactly,
which is what makes the online-softmax rescaling verifiable. After ``exp`` the
Z_q component is meaningless (a LAX program applies at most one exp per path,
see :class:`Deg`), so outputs are compared on the Z_p component only.

Field choice (:data:`DEFAULT_FIELD`): q = 1073741789 (prime, < 2^30) and
p = 2q + 1 = 2147483579 (prime, < 2^31). The reference implementation's
p = 167, q = 83 (:data:`TINY_FIELD`) gives per-trial false-accept
probabilities of percents. Why 31 bits and not 62: every product of two residues
must fit int64 without wrapping. For a, b < p < 2^31, a·b < 2^62 < 2^63 − 1, so
elementwise products are exact. A matmul sums many products, so
:func:`_matmul_mod` splits b = b_hi·2^16 + b_lo with b_lo < 2^16, b_hi < 2^15:
one partial sum of at most 2^15 terms a·b_lo < 2^31·2^16 is < 2^62, likewise
a·b_hi < 2^46, so both int64 matmuls over contraction chunks of 2^15 are exact;
after reducing mod p, (s_hi mod p)·2^16 + (s_lo mod p) < 2^47 + 2^31. Sums
(``sum``) add < 2^31 terms of < 2^31 each: < 2^62.

Representation: a :class:`FieldTensor` is an int64 torch tensor (a subclass)
holding x_p·2^30 + x_q (< 2^61); the sentinel :data:`NEG_INF` (−1) is the
symbolic −∞ of an additive mask (x + −∞ = −∞, exp(−∞) = 0). Zero padding is the
field's zero. Because a FieldTensor *is* a tensor, the executor's plain torch
indexing / reshape / transpose / cat move field elements unchanged; torch
arithmetic on it raises (it would be real arithmetic on residues), so all math
goes through :class:`FiniteFieldArith`. Each FieldTensor carries

* ``deg``, a :class:`Deg`: a bound, valid for every element, on the shape of the
  fraction N/D of exponential polynomials the element holds;
* ``den``, ``None`` (every denominator is 1) or an int64 tensor of the same shape:
  the *denominator id* of each element. Equal ids mean the same formal
  denominator expression; 0 means the denominator 1. Layout ops move ids with
  the values (the same torch op runs on ``den``), so a softmax row p = e / l
  broadcast along its columns has one id per row and ``p @ V`` — a sum over
  that row — sees a single denominator: (Σ_j e_j v_j) / l, not the product of
  kv copies of l. Ids are allocated fresh for every inverted element (never
  shared by accident) and interned for products (pair (a, b) ↦ one id per
  arithmetic object), so an equality of ids is always an equality of formal
  expressions; an unknown relation gets a fresh id, which only loses sharing
  (a looser bound), never soundness.

Constants (:meth:`FiniteFieldArith.constant`): a float64 constant c maps to its
exact binary rational a/2^k ↦ a·(2^k)⁻¹ — a deterministic function of its bits
that keeps the identities floats satisfy exactly (0.5·2 = 1, x/8 = x·0.125,
integer counts). Division by a constant c maps to multiplication by the element
of fl(1/c), the float64 reciprocal, so x/√48 and x·(1/√48) — the same float64
constant on both sides — agree. The price: identities that hold only up to
rounding do not hold in the field ((x/3)·3 ≠ x): such pairs are falsely
*rejected*. The map is sound in the sense that the field test then decides the
equivalence of the two programs whose constants are exactly the float64 values
they use (with division by c read as multiplication by fl(1/c)); programs that
differ by one rounding of a constant are identified, which is the intent, and
anything larger is a different constant and a different field element.
ln 2 is transcendental, so it is an indeterminate λ drawn at random per trial
(both components, nonzero): ``exp2(x)`` is exp(x·λ) — one random base ω^λ —, a
constant ±2^j·ln 2 maps to ±2^j·λ and ±2^j·log2(e) = ±2^j/ln 2 to ±2^j·λ⁻¹
(:func:`ln2_form`; mantissas compared after float32 rounding, so Triton's
1.44269504 and a folded power-of-two attention scale 0.125·log2 e count). Thus
exp2(x·log2 e) = exp(x) in the field, and programs mixing exp and exp2 compare. A
scale folded with log2 e that is not a power of two (1/√48·log2 e) is one float
the map cannot split: such a pair is falsely rejected. Replacing ln 2 by an
indeterminate is exact for LAX functions (a nonzero exponential polynomial over
Q(t) cannot vanish identically at the transcendental t = ln 2); the cost is that
a float whose mantissa rounds like that of ln 2 (or 1/ln 2) but means something
else is treated as 2^j·ln 2 — the two programs still see the same field value,
and a real difference below float32 rounding of that constant goes unseen by the
field test.

Non-LAX ops, treatment (the verifier documents the consequences):
* ``max``: a fresh uniformly random field value per output element. Softmax is
  invariant under any per-row shift c (softmax(x − c) = softmax(x)), so programs
  that use max only as a cancelling shift agree for every c, hence for the
  random one; a program whose result depends on the max value itself fails the
  field test (a false reject, never a false accept).
* ``sqrt`` / ``rsqrt``: an uninterpreted function U — a keyed random hash of
  the argument's field value (rsqrt = 1/U), so equal arguments give equal
  results on both sides. Sound for programs applying sqrt to equal arguments;
  rewrites such as sqrt(a)·sqrt(b) = sqrt(ab) are not recognised (false reject).
  For the bound, U = 1/W with W counted as a fresh variable per sqrt element
  (heuristic: a keyed hash is not a truly random function, and formally equal
  arguments give one W, not two — neither changes a degree bound).

The per-trial bound and its derivation: :func:`per_trial_bound`.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

import torch
from torch.utils import _pytree as pytree

from .arith import Arith

Q_BITS = 30
Q_MASK = (1 << Q_BITS) - 1
NEG_INF = -1
ID_LN2 = 1          # the denominator id of log2(e) = 1/λ (λ: the field's ln 2)
_FIRST_ID = 2


class NotLAX(Exception):
    """The program leaves the fragment the field test covers (e.g. tanh, comparisons, nested exp)."""


def is_prime(n: int) -> bool:
    """Deterministic Miller–Rabin for n < 3.3e24 (bases 2..41)."""
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for b in bases:
        if n % b == 0:
            return n == b
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@dataclass(frozen=True)
class FieldParams:
    p: int
    q: int

    def __post_init__(self):
        if not (is_prime(self.p) and is_prime(self.q) and (self.p - 1) % self.q == 0):
            raise ValueError(f"field: need primes with q | p - 1, got p={self.p}, q={self.q}")
        if self.p >= 1 << 31 or self.q > Q_MASK:
            raise ValueError(f"field: p must be < 2^31 and q < 2^30 (int64 products, packing); got p={self.p}, q={self.q}")

    def root_of_unity(self, rng: torch.Generator) -> int:
        """A uniformly random q-th root of unity: g^((p-1)/q) for uniform g ∈ Z_p^* (the map is onto, equal fibres)."""
        g = int(torch.randint(1, self.p, (), generator=rng))
        return pow(g, (self.p - 1) // self.q, self.p)

    def encode(self, value) -> tuple[int, int] | None:
        """A real constant as (x_p, x_q): its exact binary rational a/b ↦ a·b⁻¹. None for −∞."""
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, float) and math.isinf(value) and value < 0:
            return None
        if isinstance(value, float) and not math.isfinite(value):
            raise NotLAX(f"constant {value} has no field value")
        f = Fraction(value)
        return tuple(f.numerator % m * pow(f.denominator, -1, m) % m for m in (self.p, self.q))


DEFAULT_FIELD = FieldParams(2147483579, 1073741789)
TINY_FIELD = FieldParams(167, 83)   # the reference implementation's choice: too small (see tests)


def _f32(v: float) -> float | None:
    try:
        return struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:
        return None


_LN2_FORMS = tuple((k, _f32(math.frexp(c)[0]), math.frexp(c)[1]) for k, c in ((1, math.log(2)), (-1, 1 / math.log(2))))


def ln2_form(value) -> tuple[int, int, int] | None:
    """(k, j, sign) when ``value`` = sign·2^j·(ln 2)^k with k = ±1, compared after float32 rounding of
    the mantissa (so 0.125·log2 e, a folded attention scale, and Triton's 1.44269504 count); else None."""
    if not isinstance(value, float) or not math.isfinite(value) or value == 0:
        return None
    mant, e = math.frexp(abs(value))
    r = _f32(mant)
    for k, ref_mant, ref_e in _LN2_FORMS:
        if r == ref_mant:
            return k, e - ref_e, 1 if value > 0 else -1
    return None


# ------------------------------------------------------------------ degree bound
def _mul(a: float, b: float) -> float:
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
    return True, d.m + _mul(j - 1, d.eh), _mul(j, d.eh)


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
        return Deg(self.dn + _mul(g1, self.dd), _mul(g_nz, self.dd),
                   _mul(n, _mul(self.kn, _pow(self.kd, g1))), _pow(self.kd, g_nz), max(m, md), max(eh, ehd),
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
    pairs = _mul(k, k - 1) / 2
    eps = (_mul(k, eh) + _mul(pairs, m + eh) + (k - 1)) / f.q + dn / f.p
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


# ------------------------------------------------------------------ the tensor
_TANH_SALT = 0.8660254037844386   # √3/2: any constant no program adds before a sqrt
_ARITH_NAMES = frozenset("""add sub mul div true_divide floor_divide matmul mm bmm exp sqrt rsqrt neg pow
sum mean amax amin max min maximum minimum sigmoid tanh square reciprocal remainder fmod
__add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__ __imul__ __truediv__ __rtruediv__
__itruediv__ __matmul__ __rmatmul__ __neg__ __pow__ __rpow__ __floordiv__ __mod__ add_ sub_ mul_ div_
__lt__ __le__ __gt__ __ge__ lt le gt ge softmax log_softmax""".split())


def _field_leaves(args, kwargs) -> list:
    """FieldTensors among the arguments (top level and inside lists / tuples, as torch ops take them)."""
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, FieldTensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(t for t in a if isinstance(t, FieldTensor))
    return out


def den_of(t: "FieldTensor") -> torch.Tensor:
    """The denominator ids of ``t`` as a plain int64 tensor of its shape (zeros when all are 1)."""
    d = getattr(t, "den", None)
    return torch.zeros(raw(t).shape, dtype=torch.int64) if d is None else d


class FieldTensor(torch.Tensor):
    """int64 tensor of packed Z_p × Z_q elements; layout ops keep it, its :class:`Deg` and its
    denominator ids (the same torch op runs on ``den``)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "").split(".")[0]
        if name in _ARITH_NAMES:
            raise TypeError(f"FieldTensor: torch.{name} would be real arithmetic on field elements; "
                            "route it through FiniteFieldArith")
        out = super().__torch_function__(func, types, args, kwargs)
        ins = _field_leaves(args, kwargs)
        if not ins:
            return out
        deg = getattr(ins[0], "deg", CONST)
        for o in ins[1:]:
            deg = deg.join(getattr(o, "deg", CONST))
        with_den = any(getattr(o, "den", None) is not None for o in ins)
        if name == "__setitem__" and isinstance(args[0], FieldTensor):
            # the executor writes tiles into the output tensor itself; a write through a *view*
            # would update the base's data but not the base's deg / den (not done anywhere)
            target = args[0]
            target.deg = deg   # writing a tile into an output: the output now holds both
            if with_den:
                tden = den_of(target)
                if not tden.is_contiguous():
                    tden = tden.contiguous()
                value = args[2]
                tden[args[1]] = den_of(value) if isinstance(value, FieldTensor) else 0
                target.den = tden
            return out
        if isinstance(out, FieldTensor):
            leaves = [out]
        elif isinstance(out, (list, tuple)) and any(isinstance(t, FieldTensor) for t in out):
            leaves = pytree.tree_leaves(out)
        else:
            return out
        dens = [None] * len(leaves)
        if with_den:
            a2, k2 = pytree.tree_map(lambda t: den_of(t) if isinstance(t, FieldTensor) else t, (args, kwargs))
            d = func(*a2, **k2)
            dens = [d] if isinstance(out, FieldTensor) else pytree.tree_leaves(d)
        for t, d in zip(leaves, dens):
            if isinstance(t, FieldTensor):
                t.deg, t.den = deg, d
        return out


def raw(t: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return t.view(t.shape) if isinstance(t, FieldTensor) else t


def wrap(packed: torch.Tensor, deg: Deg, den: torch.Tensor | None = None) -> FieldTensor:
    with torch._C.DisableTorchFunctionSubclass():
        out = packed.as_subclass(FieldTensor)
    out.deg = deg
    out.den = None if den is None else den.expand(packed.shape)
    return out


def _matmul_mod(a: torch.Tensor, b: torch.Tensor, m: int) -> torch.Tensor:
    """(a @ b) mod m for residues < m < 2^31 without int64 overflow (see module docstring)."""
    k = a.shape[-1]
    b_lo, b_hi = b & 0xFFFF, b >> 16
    acc = None
    for s in range(0, k, 1 << 15):
        a_c, lo, hi = a[..., s:s + (1 << 15)], b_lo[..., s:s + (1 << 15), :], b_hi[..., s:s + (1 << 15), :]
        part = ((torch.matmul(a_c, hi) % m) * (1 << 16) + torch.matmul(a_c, lo) % m) % m
        acc = part if acc is None else (acc + part) % m
    return acc


def _inv_mod(x: torch.Tensor, m: int) -> torch.Tensor:
    """Elementwise x^(m−2) mod m (the inverse for x ≠ 0, 0 for x = 0); Python ints for small tensors."""
    if x.numel() <= 256:
        return torch.tensor([pow(v, m - 2, m) for v in x.reshape(-1).tolist()], dtype=torch.int64).reshape(x.shape)
    return _pow_mod(x, m - 2, m)


def _pow_mod(base: torch.Tensor, exponent: int, m: int) -> torch.Tensor:
    result = torch.ones_like(base)
    while exponent:
        if exponent & 1:
            result = result * base % m
        base = base * base % m
        exponent >>= 1
    return result


# ------------------------------------------------------------------ denominator ids
class DenIds:
    """Allocates denominator ids: fresh ones for inverted elements, interned ones for products."""

    def __init__(self):
        self.next = _FIRST_ID
        self.pairs: dict[int, int] = {}   # lo·2^31 + hi ↦ id of D_lo·D_hi

    def fresh(self, shape) -> torch.Tensor:
        n = math.prod(shape)
        out = torch.arange(self.next, self.next + n, dtype=torch.int64).reshape(tuple(shape))
        self.next += n
        return out

    def fresh_like(self, t: torch.Tensor) -> torch.Tensor:
        """Fresh ids for ``t``'s distinct storage elements (a broadcast view shares them)."""
        base = [1 if st == 0 else s for s, st in zip(t.shape, t.stride())]
        return self.fresh(base).expand(t.shape)

    def product(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The id of D_a·D_b for nonzero ids (one id per unordered pair)."""
        lo, hi = torch.minimum(a, b).reshape(-1), torch.maximum(a, b).reshape(-1)
        if self.next >= 1 << 31:
            raise NotLAX("more than 2^31 denominator ids (program too large for the field test)")
        uniq, inv = torch.unique(lo * (1 << 31) + hi, return_inverse=True)   # ids < 2^31: exact keys
        ids = []
        for key in uniq.tolist():
            if key not in self.pairs:
                self.pairs[key] = self.next
                self.next += 1
            ids.append(self.pairs[key])
        return torch.tensor(ids, dtype=torch.int64)[inv].reshape(a.shape)

    def combine(self, da, db, shape, shared_if_equal: bool) -> tuple[torch.Tensor | None, bool]:
        """Ids of a binary op's result (product of denominators; with ``shared_if_equal`` — an add —
        equal ids stay one denominator) and whether every element had equal ids."""
        if da is None and db is None:
            return None, True
        a = torch.zeros((), dtype=torch.int64).expand(shape) if da is None else da.expand(shape)
        b = torch.zeros((), dtype=torch.int64).expand(shape) if db is None else db.expand(shape)
        same = a == b
        if shared_if_equal and bool(same.all()):
            return a, True
        both = (a != 0) & (b != 0)
        if shared_if_equal:
            both &= ~same
        out = torch.where(a == 0, b, a)
        if bool(both.any()):
            out = out.clone()
            out[both] = self.product(a[both], b[both])
        return out, bool(same.all())

    def reduce(self, ids: torch.Tensor | None, dim: int) -> tuple[torch.Tensor | None, int, int]:
        """(ids of the sum along ``dim`` (kept as size 1), max distinct ids, max distinct ids ≠ 0)."""
        if ids is None or ids.numel() == 0:
            return None, 1, 0
        s = ids.sort(dim).values
        n = s.shape[dim]
        g_eff = 1 + (s.narrow(dim, 1, n - 1) != s.narrow(dim, 0, n - 1)).sum(dim, keepdim=True)
        g_nz = g_eff - (s.narrow(dim, 0, 1) == 0).long()        # ids ≥ 0: a 0 sorts first
        out = torch.where(g_nz == 0, 0, s.narrow(dim, n - 1, 1))
        if bool((g_nz >= 2).any()):
            out = torch.where(g_nz >= 2, self.fresh(out.shape), out)
        return out, int(g_eff.max()), int(g_nz.max())


class FiniteFieldArith(Arith):
    """The :class:`Arith` primitives over Z_p × Z_q for one random trial (ω, λ = ln 2, max values,
    sqrt hash key). ``zero_division`` flags a trial in which an inverted value was 0 (the verifier
    redraws it); ``zero_risk`` bounds the probability of that event (see :func:`per_trial_bound`),
    ``zero_risk_proven`` is False when that bound uses the conjecture."""

    def __init__(self, field: FieldParams = DEFAULT_FIELD, rng: torch.Generator | None = None):
        self.f = field
        self.rng = rng if rng is not None else torch.Generator().manual_seed(0)
        self.omega = field.root_of_unity(self.rng)
        self._key = [int(torch.randint(1, 1 << 62, (), generator=self.rng)) | 1 for _ in range(4)]
        self.ln2 = (int(torch.randint(1, field.p, (), generator=self.rng)),
                    int(torch.randint(1, field.q, (), generator=self.rng)))
        self.ids = DenIds()
        self.zero_division = False
        self.zero_risk = 0.0
        self.zero_risk_proven = True

    # ------------------------------------------------------------ packing
    def split(self, x) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x_p, x_q, is_neg_inf) of a FieldTensor (or a Python / 0-d constant)."""
        r = raw(self.lift(x))
        ninf = r == NEG_INF
        r = torch.where(ninf, 0, r)
        return r >> Q_BITS, r & Q_MASK, ninf

    def pack(self, xp, xq, ninf, deg: Deg, den=None) -> FieldTensor:
        packed = (xp << Q_BITS) | xq
        if ninf is not None:
            packed = torch.where(ninf, NEG_INF, packed)
        return wrap(packed, deg, den)

    def lift(self, x) -> FieldTensor:
        return x if isinstance(x, FieldTensor) else self.constant(x)

    def constant(self, value, shape=()) -> FieldTensor:
        """A constant (module docstring: its exact binary rational; ±2^j·ln 2 ↦ ±2^j·λ, ±2^j·log2 e ↦ ±2^j/λ)."""
        if isinstance(value, torch.Tensor):
            value = value.item()
        form = ln2_form(value)
        if form is not None:
            k, j, sign = form
            vals = []
            for lam, mod in zip(self.ln2, (self.f.p, self.f.q)):
                v = pow(lam, k, mod) * pow(2, j, mod) % mod      # negative powers: modular inverses
                vals.append(v if sign > 0 else (-v) % mod)
            out = wrap(torch.full(tuple(shape), (vals[0] << Q_BITS) | vals[1], dtype=torch.int64),
                       VAR if k > 0 else Deg(dd=1), None if k > 0 else torch.tensor(ID_LN2))
        else:
            enc = self.f.encode(value)
            v = NEG_INF if enc is None else (enc[0] << Q_BITS) | enc[1]
            out = wrap(torch.full(tuple(shape), v, dtype=torch.int64), CONST)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out._real = float(value)
        return out

    def random(self, shape, deg: Deg = VAR) -> FieldTensor:
        """Uniform elements of Z_p × Z_q (fresh variables)."""
        xp = torch.randint(0, self.f.p, tuple(shape), generator=self.rng)
        xq = torch.randint(0, self.f.q, tuple(shape), generator=self.rng)
        return self.pack(xp, xq, None, deg)

    def where(self, cond: torch.Tensor, a, b) -> FieldTensor:
        """Select by a boolean tensor that is program data (the same on both sides)."""
        a, b = self.lift(a), self.lift(b)
        shape = torch.broadcast_shapes(cond.shape, raw(a).shape, raw(b).shape)
        den = None
        if a.den is not None or b.den is not None:
            den = torch.where(cond, den_of(a), den_of(b))
        return wrap(torch.where(cond, raw(a), raw(b)).expand(shape), a.deg.join(b.deg), den)

    @staticmethod
    def _real_of(x) -> float | None:
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            return float(x)
        r = getattr(x, "_real", None)          # set by constant(): every element is this real
        return r if isinstance(r, float) else None

    # ------------------------------------------------------------ primitives
    def add(self, a, b):
        a, b = self.lift(a), self.lift(b)
        (ap, aq, ai), (bp, bq, bi) = self.split(a), self.split(b)
        op, oq = (ap + bp) % self.f.p, (aq + bq) % self.f.q
        den, shared = self.ids.combine(a.den, b.den, op.shape, shared_if_equal=True)
        deg = a.deg.add_shared(b.deg) if shared else a.deg.add(b.deg)
        return self.pack(op, oq, ai | bi, deg, den)

    def neg(self, x):
        x = self.lift(x)
        xp, xq, xi = self.split(x)
        if bool(xi.any()):
            raise NotLAX("negation of -inf (+inf has no treatment)")
        return self.pack((-xp) % self.f.p, (-xq) % self.f.q, None, x.deg, x.den)

    def sub(self, a, b):
        return self.add(a, self.neg(b))

    def mul(self, a, b):
        a, b = self.lift(a), self.lift(b)
        (ap, aq, ai), (bp, bq, bi) = self.split(a), self.split(b)
        if bool(ai.any() or bi.any()):
            self._check_positive_scale(a if bool(bi.any()) else b)
        op, oq = ap * bp % self.f.p, aq * bq % self.f.q
        den, _ = self.ids.combine(a.den, b.den, op.shape, shared_if_equal=False)
        return self.pack(op, oq, ai | bi, a.deg.mul(b.deg), den)

    def _check_positive_scale(self, c):
        """-inf times c stays -inf only for a positive real constant c."""
        r = self._real_of(c)
        if r is not None and r > 0:
            return
        raise NotLAX("-inf multiplied by a non-constant or non-positive value")

    def inverse(self, x) -> FieldTensor:
        r = self._real_of(x)
        x = self.lift(x)
        if r is not None and r != 0:
            return self._recip_const(r, raw(x).shape)   # 1/c ↦ fl(1/c) (module docstring)
        xp, xq, xi = self.split(x)
        if bool(xi.any()):
            raise NotLAX("division by -inf")
        if bool((xp == 0).any()):
            self.zero_division = True
        inv_p, inv_q = _inv_mod(xp, self.f.p), _inv_mod(xq, self.f.q)
        d = x.deg
        if d.constant and x.den is None:          # 1/c of a computed constant is a constant
            return self.pack(inv_p, inv_q, None, CONST)
        numel = raw(x).numel()
        if d.dn == 0 and not d.en:                # x = c/D: 1/x = D/c has no new denominator
            self.zero_risk += numel / self.f.p    # (a sqrt value 1/W can only be 0 if the hash was 0)
            return self.pack(inv_p, inv_q, None, d.inv())
        risk, proven = sparse_zero_bound(d.dn, d.kn, d.m, d.eh, d.en, self.f)
        self.zero_risk += _mul(risk, numel)
        self.zero_risk_proven &= proven
        return self.pack(inv_p, inv_q, None, d.inv(), self.ids.fresh_like(raw(x)))

    def div(self, a, b):
        r = self._real_of(b)
        if r is not None and r != 0:
            return self.mul(a, self._recip_const(r))
        return self.mul(a, self.inverse(b))

    def _recip_const(self, b: float, shape=()) -> FieldTensor:
        """Division by the constant b is multiplication by fl(1/b) (for b = 2^j·ln 2: 2^−j·λ⁻¹)."""
        return self.constant(1.0 / b, shape)

    def exp(self, x):
        x = self.lift(x)
        xp, xq, xi = self.split(x)
        deg = x.deg.exp()
        t0, t1, t2 = self._exp_tables()          # ω^x = ω^{x mod 2^10}·ω^{2^10·(…)}·ω^{2^20·(…)}
        out = t0[xq & 1023] * t1[(xq >> 10) & 1023] % self.f.p * t2[xq >> 20] % self.f.p
        out = torch.where(xi, 0, out)            # exp(-inf) = 0
        return self.pack(out, torch.zeros_like(xq), None, deg)

    def _exp_tables(self) -> tuple:
        """ω^{j·2^{10i}} for j < 2^10, i = 0, 1, 2 (x_q < 2^30), built on first use in a trial."""
        if getattr(self, "_tables", None) is None:
            tables = []
            for i in range(3):
                base, v, row = pow(self.omega, 1 << (10 * i), self.f.p), 1, []
                for _ in range(1 << 10):
                    row.append(v)
                    v = v * base % self.f.p
                tables.append(torch.tensor(row, dtype=torch.int64))
            self._tables = tuple(tables)
        return self._tables

    def exp2(self, x):
        """2^x = exp(x·ln 2) with ln 2 ↦ λ: the same random base ω as exp, raised to λ."""
        return self.exp(self.mul(x, self.constant(math.log(2))))

    def _hash(self, x) -> FieldTensor:
        """A keyed random function of the packed value (splitmix-style mixing, int64 wrap-around),
        read as 1/W for a fresh variable W (uniform h ≠ 0 is 1/W for uniform W ≠ 0): a norm's
        x·rsqrt(·) = x·W then stays a polynomial, and x / sqrt(·) is the same x·W."""
        h = raw(x) ^ self._key[0]
        for k in self._key[1:]:
            h = (h ^ (h >> 31)) * k
            h = h ^ (h >> 29)
        hp = (h >> 1) % self.f.p
        hq = ((h * self._key[0]) >> 1) % self.f.q
        return self.pack(hp, hq, None, Deg(dd=1), self.ids.fresh(hp.shape))

    def sqrt(self, x):
        x = self.lift(x)
        if bool(self.split(x)[2].any()):
            raise NotLAX("sqrt of -inf")
        return self._hash(x)

    def rsqrt(self, x):
        return self.inverse(self.sqrt(x))

    def tanh(self, x):
        """An uninterpreted function: the keyed hash of ``x`` shifted by a fixed odd constant, so that it is
        not sqrt's hash of the same value; both programs must apply it to equal values to compare equal."""
        x = self.lift(x)
        if bool(self.split(x)[2].any()):
            raise NotLAX("tanh of -inf")
        return self._hash(self.add(x, self.constant(_TANH_SALT)))

    def silu(self, x):
        return self.div(x, self.add(1, self.exp(self.neg(x))))

    def sigmoid(self, x):
        return self.div(1, self.add(1, self.exp(self.neg(x))))

    def square(self, x):
        return self.mul(x, x)

    def sum(self, x, dim, keepdim=True):
        x = self.lift(x)
        xp, xq, xi = self.split(x)
        if bool(xi.any()):
            raise NotLAX("sum over -inf entries")
        n = xp.shape[dim]
        den, g_eff, g_nz = self.ids.reduce(x.den, dim)
        if den is not None and not keepdim:
            den = den.squeeze(dim)
        return self.pack(xp.sum(dim, keepdim=keepdim) % self.f.p, xq.sum(dim, keepdim=keepdim) % self.f.q,
                         None, x.deg.reduce(n, g_eff, g_nz), den)

    def max(self, x, dim, keepdim=True):
        shape = list(raw(x).shape)
        if keepdim:
            shape[dim] = 1
        else:
            shape.pop(dim)
        return self.random(shape)

    def matmul(self, a, b):
        a, b = self.lift(a), self.lift(b)
        (ap, aq, ai), (bp, bq, bi) = self.split(a), self.split(b)
        if bool(ai.any() or bi.any()):
            raise NotLAX("matmul with -inf entries")
        out_p, out_q = _matmul_mod(ap, bp, self.f.p), _matmul_mod(aq, bq, self.f.q)
        den, g_eff, g_nz = self._matmul_ids(a.den, b.den, out_p.shape)
        deg = a.deg.mul(b.deg).reduce(ap.shape[-1], g_eff, g_nz)
        return self.pack(out_p, out_q, None, deg, den)

    def _matmul_ids(self, da, db, shape):
        """Ids of a @ b: the products a[i,k]·b[k,j] summed over k. Rows of a (columns of b) with one
        id each give one denominator per output; otherwise count ≤ (ids of a's row)·(ids of b's
        column) distinct denominators and give each output a fresh id."""
        if da is None and db is None:
            return None, 1, 0
        if len(shape) < 2 or (da is not None and da.dim() < 2) or (db is not None and db.dim() < 2):
            k = (da if da is not None else db).shape[-1 if da is not None else 0]
            return self.ids.fresh(shape), k, k          # vector operands: no sharing assumed
        ra, ga, gna = self.ids.reduce(da, -1)     # (..., m, 1)
        rb, gb, gnb = self.ids.reduce(db, -2)     # (..., 1, n)
        if db is None:
            return ra.expand(shape), ga, gna
        if da is None:
            return rb.expand(shape), gb, gnb
        if ga == 1 and gb == 1:
            den, _ = self.ids.combine(ra, rb, shape, shared_if_equal=False)
            return den, 1, int(bool((den != 0).any()))
        return self.ids.fresh(shape), ga * gb, ga * gb

    def zeros(self, shape, like=None):
        return self.constant(0, shape)

    def full(self, shape, value, like=None):
        return self.constant(value, shape)

    def concat(self, xs: Sequence, dim):
        return torch.cat(list(xs), dim)
