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
probabilities of percents; here one trial's bound is ~K²·M/q + D/p ≈ 1e-8 for
small programs. Why 31 bits and not 62: every product of two residues must fit
int64 without wrapping. For a, b < p < 2^31, a·b < 2^62 < 2^63 − 1, so
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
goes through :class:`FiniteFieldArith`. Each FieldTensor carries a :class:`Deg`
(degree / term-count bound of the function it holds) from which the verifier
computes Theorem 3's per-trial bound.

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
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Sequence

import torch
from torch.utils import _pytree as pytree

from .arith import Arith

Q_BITS = 30
Q_MASK = (1 << Q_BITS) - 1
NEG_INF = -1


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


# ------------------------------------------------------------------ degree bound
@dataclass(frozen=True)
class Deg:
    """Conservative shape of the function an element holds, written N/D with N, D exponential
    polynomials Σ f_i·exp(g_i/h_i): ``dn``/``dd`` bound the degrees of the coefficient polynomials of
    N / D, ``kn``/``kd`` their numbers of exp terms, ``m`` bounds max(deg g_i, deg h_i), ``has_exp``
    marks values downstream of an exp (an exp of such a value is not LAX). Floats so that they may
    saturate to inf (then no bound is claimed)."""
    dn: float = 0
    dd: float = 0
    kn: float = 1
    kd: float = 1
    m: float = 0
    has_exp: bool = False

    def __post_init__(self):
        if not self.has_exp:   # without exp every term has exponent 0: one term, polynomial coefficients
            object.__setattr__(self, "kn", 1)
            object.__setattr__(self, "kd", 1)
            object.__setattr__(self, "m", 0)

    @property
    def polynomial_den(self) -> bool:
        return self.dd == 0 and self.kd == 1 and not self.has_exp_den

    @property
    def has_exp_den(self) -> bool:
        return self.kd > 1

    def add(self, o: "Deg") -> "Deg":
        e = self.has_exp or o.has_exp
        if self.polynomial_den and o.polynomial_den:
            return Deg(max(self.dn, o.dn), 0, self.kn + o.kn, 1, max(self.m, o.m), e)
        return Deg(max(self.dn + o.dd, o.dn + self.dd), self.dd + o.dd, self.kn * o.kd + o.kn * self.kd,
                   self.kd * o.kd, self.m + o.m, e)

    def mul(self, o: "Deg") -> "Deg":
        return Deg(self.dn + o.dn, self.dd + o.dd, self.kn * o.kn, self.kd * o.kd, self.m + o.m,
                   self.has_exp or o.has_exp)

    def inv(self) -> "Deg":
        return Deg(self.dd, self.dn, self.kd, self.kn, self.m, self.has_exp)

    def reduce(self, n: int) -> "Deg":
        """The sum of ``n`` elements each bounded by ``self``."""
        if self.polynomial_den:
            return replace(self, kn=self.kn * n)
        return Deg(self.dn + (n - 1) * self.dd, n * self.dd, n * self.kn * self.kd ** (n - 1),
                   self.kd ** n, n * self.m, self.has_exp)

    def exp(self) -> "Deg":
        if self.has_exp:
            raise NotLAX("exp of a value that already went through exp (Mirage Definition 5.1: one exp per path)")
        return Deg(0, 0, 1, 1, max(self.dn, self.dd), True)

    def join(self, o: "Deg") -> "Deg":
        return Deg(max(self.dn, o.dn), max(self.dd, o.dd), max(self.kn, o.kn), max(self.kd, o.kd),
                   max(self.m, o.m), self.has_exp or o.has_exp)


CONST, VAR = Deg(), Deg(dn=1)


def per_trial_bound(a: Deg, b: Deg, f: FieldParams) -> float:
    """Theorem 2/3 per-trial false-accept bound for one output compared as a = N1/D1 vs b = N2/D2.
    The difference's numerator F = N1·D2 − N2·D1 has K terms, coefficient degree Dp and exponents
    of degree ≤ M. F ≢ 0 survives a trial only if (i) two distinct exponents collide at x_q
    (≤ K²·M/q, Schwartz–Zippel on g_i h_j − g_j h_i per pair) or an exponent's denominator
    vanishes (≤ K·M/q); (ii) the K-sparse sum Σ c_i ω^{e_i} vanishes at the random root of unity
    (≤ (K−1)/q: exact for K ≤ 2, beyond that the uncertainty principle for Z_p that Li & Wu
    conjecture); (iii) the surviving coefficient polynomial vanishes at x_p (≤ Dp/p), or a
    denominator vanishes (≤ (dd1 + dd2)/p)."""
    K = a.kn * b.kd + b.kn * a.kd
    Dp = max(a.dn + b.dd, b.dn + a.dd)
    M = a.m + b.m
    exp_part = ((K * K + K) * M + (K - 1)) / f.q if (a.has_exp or b.has_exp) else 0.0
    eps = exp_part + (Dp + a.dd + b.dd) / f.p
    return min(1.0, eps) if math.isfinite(eps) else 1.0


# ------------------------------------------------------------------ the tensor
_ARITH_NAMES = frozenset("""add sub mul div true_divide floor_divide matmul mm bmm exp sqrt rsqrt neg pow
sum mean amax amin max min maximum minimum sigmoid tanh square reciprocal remainder fmod
__add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__ __imul__ __truediv__ __rtruediv__
__itruediv__ __matmul__ __rmatmul__ __neg__ __pow__ __rpow__ __floordiv__ __mod__ add_ sub_ mul_ div_
__lt__ __le__ __gt__ __ge__ lt le gt ge softmax log_softmax""".split())


def _degs(tree) -> list[Deg]:
    return [t.deg for t in pytree.tree_leaves(tree) if isinstance(t, FieldTensor) and hasattr(t, "deg")]


class FieldTensor(torch.Tensor):
    """int64 tensor of packed Z_p × Z_q elements; layout ops keep it (and its :class:`Deg`)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "").split(".")[0]
        if name in _ARITH_NAMES:
            raise TypeError(f"FieldTensor: torch.{name} would be real arithmetic on field elements; "
                            "route it through FiniteFieldArith")
        out = super().__torch_function__(func, types, args, kwargs)
        degs = _degs((args, kwargs))
        if name == "__setitem__" and isinstance(args[0], FieldTensor) and degs:
            d = degs[0]
            for o in degs[1:]:
                d = d.join(o)
            args[0].deg = d   # writing a tile into an output: the output now holds both
            return out
        if degs:
            d = degs[0]
            for o in degs[1:]:
                d = d.join(o)
            for t in pytree.tree_leaves(out):
                if isinstance(t, FieldTensor):
                    t.deg = d
        return out


def raw(t: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return t.view(t.shape) if isinstance(t, FieldTensor) else t


def wrap(packed: torch.Tensor, deg: Deg) -> FieldTensor:
    with torch._C.DisableTorchFunctionSubclass():
        out = packed.as_subclass(FieldTensor)
    out.deg = deg
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


def _pow_mod(base: torch.Tensor, exponent: int, m: int) -> torch.Tensor:
    result = torch.ones_like(base)
    while exponent:
        if exponent & 1:
            result = result * base % m
        base = base * base % m
        exponent >>= 1
    return result


class FiniteFieldArith(Arith):
    """The :class:`Arith` primitives over Z_p × Z_q for one random trial (ω, max values, sqrt hash key)."""

    def __init__(self, field: FieldParams = DEFAULT_FIELD, rng: torch.Generator | None = None):
        self.f = field
        self.rng = rng if rng is not None else torch.Generator().manual_seed(0)
        self.omega = field.root_of_unity(self.rng)
        self._omega_pows = [pow(self.omega, 1 << i, field.p) for i in range(Q_BITS)]
        self._key = [int(torch.randint(1, 1 << 62, (), generator=self.rng)) | 1 for _ in range(4)]
        self.zero_division = False   # set when a denominator vanished in this trial

    # ------------------------------------------------------------ packing
    def split(self, x) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x_p, x_q, is_neg_inf) of a FieldTensor (or a Python / 0-d constant)."""
        if not isinstance(x, torch.Tensor):
            x = self.constant(x)
        r = raw(x)
        ninf = r == NEG_INF
        r = torch.where(ninf, 0, r)
        return r >> Q_BITS, r & Q_MASK, ninf

    def pack(self, xp, xq, ninf, deg: Deg) -> FieldTensor:
        packed = (xp << Q_BITS) | xq
        if ninf is not None:
            packed = torch.where(ninf, NEG_INF, packed)
        return wrap(packed, deg)

    def constant(self, value, shape=()) -> FieldTensor:
        enc = self.f.encode(value)
        v = NEG_INF if enc is None else (enc[0] << Q_BITS) | enc[1]
        return wrap(torch.full(tuple(shape), v, dtype=torch.int64), CONST)

    def random(self, shape, deg: Deg = VAR) -> FieldTensor:
        """Uniform elements of Z_p × Z_q (fresh variables)."""
        xp = torch.randint(0, self.f.p, tuple(shape), generator=self.rng)
        xq = torch.randint(0, self.f.q, tuple(shape), generator=self.rng)
        return self.pack(xp, xq, None, deg)

    def _deg(self, x) -> Deg:
        return x.deg if isinstance(x, FieldTensor) else CONST

    # ------------------------------------------------------------ primitives
    def add(self, a, b):
        (ap, aq, ai), (bp, bq, bi) = self.split(a), self.split(b)
        return self.pack((ap + bp) % self.f.p, (aq + bq) % self.f.q, ai | bi, self._deg(a).add(self._deg(b)))

    def neg(self, x):
        xp, xq, xi = self.split(x)
        if bool(xi.any()):
            raise NotLAX("negation of -inf (+inf has no treatment)")
        return self.pack((-xp) % self.f.p, (-xq) % self.f.q, None, self._deg(x))

    def sub(self, a, b):
        return self.add(a, self.neg(b))

    def mul(self, a, b):
        (ap, aq, ai), (bp, bq, bi) = self.split(a), self.split(b)
        if bool(ai.any() or bi.any()):
            self._check_positive_scale(a if bool(bi.any()) else b)
        return self.pack(ap * bp % self.f.p, aq * bq % self.f.q, ai | bi, self._deg(a).mul(self._deg(b)))

    def _check_positive_scale(self, c):
        """-inf times c stays -inf only for a positive real constant c."""
        if isinstance(c, torch.Tensor) and c.numel() == 1 and isinstance(getattr(c, "_real", None), float):
            if c._real > 0:
                return
        if isinstance(c, (int, float)) and c > 0:
            return
        raise NotLAX("-inf multiplied by a non-constant or non-positive value")

    def inverse(self, x) -> FieldTensor:
        xp, xq, xi = self.split(x)
        if bool(xi.any()):
            raise NotLAX("division by -inf")
        if bool((xp == 0).any()):
            self.zero_division = True
        return self.pack(_pow_mod(xp, self.f.p - 2, self.f.p), _pow_mod(xq, self.f.q - 2, self.f.q), None,
                         self._deg(x).inv())

    def div(self, a, b):
        if isinstance(b, (int, float)) and b > 0:
            return self.mul(a, self._recip_const(b))
        return self.mul(a, self.inverse(b))

    def _recip_const(self, b) -> FieldTensor:
        enc = self.f.encode(b)
        c = wrap(torch.tensor((pow(enc[0], -1, self.f.p) << Q_BITS) | pow(enc[1], -1, self.f.q)), CONST)
        c._real = 1.0 / b
        return c

    def exp(self, x):
        xp, xq, xi = self.split(x)
        deg = self._deg(x).exp()
        out = torch.ones_like(xq)
        for i, w in enumerate(self._omega_pows):
            out = torch.where((xq >> i) & 1 == 1, out * w % self.f.p, out)
        out = torch.where(xi, 0, out)            # exp(-inf) = 0
        return self.pack(out, torch.zeros_like(xq), None, deg)

    def exp2(self, x):
        """2^x = exp(x·ln 2): ln 2 is not rational, so exp2 gets its own base ω₂ = ω^c for a random c
        (programs mixing exp and exp2 of rescaled arguments are not field-comparable)."""
        if not hasattr(self, "_c2"):
            self._c2 = int(torch.randint(1, self.f.q, (), generator=self.rng))
        return self.exp(self.mul(x, wrap(torch.tensor(self._c2 % self.f.q), CONST)))

    def _hash(self, x) -> FieldTensor:
        """A keyed random function of the packed value (splitmix-style mixing, int64 wrap-around)."""
        h = raw(x) ^ self._key[0]
        for k in self._key[1:]:
            h = (h ^ (h >> 31)) * k
            h = h ^ (h >> 29)
        hp = (h >> 1) % self.f.p
        hq = ((h * self._key[0]) >> 1) % self.f.q
        return self.pack(hp, hq, None, VAR)

    def sqrt(self, x):
        if bool(self.split(x)[2].any()):
            raise NotLAX("sqrt of -inf")
        return self._hash(x)

    def rsqrt(self, x):
        return self.inverse(self.sqrt(x))

    def silu(self, x):
        one = self.constant(1)
        return self.div(x, self.add(one, self.exp(self.neg(x))))

    def sigmoid(self, x):
        one = self.constant(1)
        return self.div(one, self.add(one, self.exp(self.neg(x))))

    def square(self, x):
        return self.mul(x, x)

    def sum(self, x, dim, keepdim=True):
        xp, xq, xi = self.split(x)
        if bool(xi.any()):
            raise NotLAX("sum over -inf entries")
        n = xp.shape[dim]
        return self.pack(xp.sum(dim, keepdim=keepdim) % self.f.p, xq.sum(dim, keepdim=keepdim) % self.f.q,
                         None, self._deg(x).reduce(n))

    def max(self, x, dim, keepdim=True):
        shape = list(raw(x).shape)
        if keepdim:
            shape[dim] = 1
        else:
            shape.pop(dim)
        return self.random(shape)

    def matmul(self, a, b):
        (ap, aq, ai), (bp, bq, bi) = self.split(a), self.split(b)
        if bool(ai.any() or bi.any()):
            raise NotLAX("matmul with -inf entries")
        deg = self._deg(a).mul(self._deg(b)).reduce(ap.shape[-1])
        return self.pack(_matmul_mod(ap, bp, self.f.p), _matmul_mod(aq, bq, self.f.q), None, deg)

    def zeros(self, shape, like=None):
        return self.constant(0, shape)

    def full(self, shape, value, like=None):
        c = self.constant(value, shape)
        if isinstance(value, (int, float)):
            c._real = float(value)
        return c

    def concat(self, xs: Sequence, dim):
        return torch.cat(list(xs), dim)
