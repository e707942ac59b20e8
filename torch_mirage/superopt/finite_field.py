"""Finite-field arithmetic for the probabilistic equivalence verifier (Mirage §5, Table 3).

This module owns :class:`FiniteFieldArith`, the :class:`~.arith.Arith` primitives over the field Z_p × Z_q
(:mod:`.ff_field`) for one random trial, and the map of real constants to field elements (:func:`ln2_form`).
Its values are :class:`~.ff_tensor.FieldTensor`; each step also computes the result's
:class:`~.ff_bound.Deg` and denominator ids, from which :func:`~.ff_bound.per_trial_bound` bounds the
false-accept probability.

Every op except ``exp`` acts on
both components independently (modular arithmetic; division multiplies by the
inverse, Fermat's little theorem). ``exp`` maps the Z_q component x_q to
ω^{x_q} ∈ Z_p, with ω a uniformly random q-th root of unity in Z_p; since
x ↦ ω^x is a homomorphism Z_q → Z_p^*, exp(a)·exp(b) = exp(a + b) holds exactly,
which is what makes the online-softmax rescaling verifiable. After ``exp`` the
Z_q component is meaningless (a LAX program applies at most one exp per path,
see :class:`~.ff_bound.Deg`), so outputs are compared on the Z_p component only.

Constants (:meth:`FiniteFieldArith.constant`): a float64 constant c maps to its
exact binary rational a/2^k ↦ a·(2^k)⁻¹ — a deterministic function of its bits
that keeps the identities floats satisfy exactly (0.5·2 = 1, x/8 = x·0.125,
integer counts) —, except that the float of an integer's reciprocal 1/n (compared
after float32 rounding, :func:`~.ff_field.reciprocal_of`) maps to 1/n: a mean's
1/k times k is 1, so (x/3)·3 = x and mean(x − c) = mean(x) − c hold in the field
as in the reals. Division by a constant c maps to multiplication by the element
of fl(1/c), the float64 reciprocal, so x/√48 and x·(1/√48) — the same float64
constant on both sides — agree. The price: other identities that hold only up to
rounding do not hold in the field (x/√3·√3 ≠ x): such pairs are falsely
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

The bound these values feed and its derivation: :func:`~.ff_bound.per_trial_bound`.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from .arith import Arith
from .ff_bound import CONST, VAR, Deg, bound_mul, sparse_zero_bound
from .ff_field import DEFAULT_FIELD, NEG_INF, Q_BITS, Q_MASK, FieldParams, NotLAX, float32, inv_mod, matmul_mod
from .ff_tensor import ID_LN2, DenIds, FieldTensor, den_of, raw, wrap

_TANH_SALT = 0.8660254037844386   # √3/2: any constant no program adds before a sqrt


_LN2_FORMS = tuple((k, float32(math.frexp(c)[0]), math.frexp(c)[1])
                   for k, c in ((1, math.log(2)), (-1, 1 / math.log(2))))


def ln2_form(value) -> tuple[int, int, int] | None:
    """(k, j, sign) when ``value`` = sign·2^j·(ln 2)^k with k = ±1, compared after float32 rounding of
    the mantissa (so 0.125·log2 e, a folded attention scale, and Triton's 1.44269504 count); else None."""
    if not isinstance(value, float) or not math.isfinite(value) or value == 0:
        return None
    mant, e = math.frexp(abs(value))
    r = float32(mant)
    for k, ref_mant, ref_e in _LN2_FORMS:
        if r == ref_mant:
            return k, e - ref_e, 1 if value > 0 else -1
    return None


class FiniteFieldArith(Arith):
    """The :class:`Arith` primitives over Z_p × Z_q for one random trial (ω, λ = ln 2, max values,
    sqrt hash key). ``zero_division`` flags a trial in which an inverted value was 0 (the verifier
    redraws it); ``zero_risk`` bounds the probability of that event (see :func:`~.ff_bound.per_trial_bound`),
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

    def where(self, cond: torch.Tensor, a, b=None, *, value=None) -> FieldTensor:
        """Select by a boolean tensor that is program data (the same on both sides): ``a`` where it holds, else
        ``b``, or the constant ``value`` (a μGraph's ``where`` op: a bool mask's dropped scores, -inf or finite)."""
        a, b = self.lift(a), self.lift(value if b is None else b)
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
        inv_p, inv_q = inv_mod(xp, self.f.p), inv_mod(xq, self.f.q)
        d = x.deg
        if d.constant and x.den is None:          # 1/c of a computed constant is a constant
            return self.pack(inv_p, inv_q, None, CONST)
        numel = raw(x).numel()
        if d.dn == 0 and not d.en:                # x = c/D: 1/x = D/c has no new denominator
            self.zero_risk += numel / self.f.p    # (a sqrt value 1/W can only be 0 if the hash was 0)
            return self.pack(inv_p, inv_q, None, d.inv())
        risk, proven = sparse_zero_bound(d.dn, d.kn, d.m, d.eh, d.en, self.f)
        self.zero_risk += bound_mul(risk, numel)
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
        out_p, out_q = matmul_mod(ap, bp, self.f.p), matmul_mod(aq, bq, self.f.q)
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
