"""The finite field of the probabilistic equivalence verifier (Mirage §5, Table 3): Z_p × Z_q with q | p − 1.

This module owns the field itself: its parameters (:class:`FieldParams`, :data:`DEFAULT_FIELD`), the packing of
one element into an int64, the exact int64 modular kernels (:func:`matmul_mod`, :func:`inv_mod`) and
:class:`NotLAX`, the error raised when a program leaves the fragment the field test covers. The arithmetic of one
trial is :class:`~.finite_field.FiniteFieldArith`, the tensor that carries elements
:class:`~.ff_tensor.FieldTensor`, the false-accept bound :mod:`.ff_bound`.

Field choice (:data:`DEFAULT_FIELD`): q = 1073741789 (prime, < 2^30) and
p = 2q + 1 = 2147483579 (prime, < 2^31). The reference implementation's
p = 167, q = 83 (:data:`TINY_FIELD`) gives per-trial false-accept
probabilities of percents. Why 31 bits and not 62: every product of two residues
must fit int64 without wrapping. For a, b < p < 2^31, a·b < 2^62 < 2^63 − 1, so
elementwise products are exact. A matmul sums many products, so
:func:`matmul_mod` splits b = b_hi·2^16 + b_lo with b_lo < 2^16, b_hi < 2^15:
one partial sum of at most 2^15 terms a·b_lo < 2^31·2^16 is < 2^62, likewise
a·b_hi < 2^46, so both int64 matmuls over contraction chunks of 2^15 are exact;
after reducing mod p, (s_hi mod p)·2^16 + (s_lo mod p) < 2^47 + 2^31. Sums
(``sum``) add < 2^31 terms of < 2^31 each: < 2^62.

Packing: one element is the int64 x_p·2^30 + x_q (< 2^61, :data:`Q_BITS`); the sentinel :data:`NEG_INF` (−1)
is the symbolic −∞ of an additive mask (x + −∞ = −∞, exp(−∞) = 0). Zero padding is the field's zero.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from fractions import Fraction

import torch

Q_BITS = 30
Q_MASK = (1 << Q_BITS) - 1
NEG_INF = -1


class NotLAX(Exception):
    """The program leaves the fragment the field test covers (e.g. comparisons of field values, nested exp)."""


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
        """A real constant as (x_p, x_q): ±1/n where it is the float of the reciprocal of an integer
        (:func:`reciprocal_of`), else its exact binary rational; a/b ↦ a·b⁻¹. None for −∞."""
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, float) and math.isinf(value) and value < 0:
            return None
        if isinstance(value, float) and not math.isfinite(value):
            raise NotLAX(f"constant {value} has no field value")
        f = reciprocal_of(value) or Fraction(value)
        return tuple(f.numerator % m * pow(f.denominator, -1, m) % m for m in (self.p, self.q))


MAX_RECIPROCAL = 1 << 24     # the largest n whose float 1/n the field reads as 1/n


def float32(v: float) -> float | None:
    """``v`` rounded to float32 (None where it overflows): how constants are compared."""
    try:
        return struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:
        return None


def reciprocal_of(value) -> Fraction | None:
    """±1/n where ``value`` is a float that rounds to float32 like ±1/n for an integer 3 ≤ n ≤
    :data:`MAX_RECIPROCAL` that is not a power of two (whose reciprocal the binary rational is already): a mean's
    1/k, a ``/ 3``. In the field ``k · fl(1/k)`` is then 1, as the real numbers the float stands for have it, so
    the identities that rest on it hold (a LayerNorm's mean of ``x − c`` is the mean of ``x`` less ``c``)."""
    if not isinstance(value, float) or not math.isfinite(value) or value == 0:
        return None
    n = round(1.0 / abs(value))
    if not 3 <= n <= MAX_RECIPROCAL or n & (n - 1) == 0:
        return None
    if float32(abs(value)) != float32(1.0 / n):
        return None
    return Fraction(1 if value > 0 else -1, n)


DEFAULT_FIELD = FieldParams(2147483579, 1073741789)
TINY_FIELD = FieldParams(167, 83)   # the reference implementation's choice: too small (see tests)


def matmul_mod(a: torch.Tensor, b: torch.Tensor, m: int) -> torch.Tensor:
    """(a @ b) mod m for residues < m < 2^31 without int64 overflow (see module docstring)."""
    k = a.shape[-1]
    b_lo, b_hi = b & 0xFFFF, b >> 16
    acc = None
    for s in range(0, k, 1 << 15):
        a_c, lo, hi = a[..., s:s + (1 << 15)], b_lo[..., s:s + (1 << 15), :], b_hi[..., s:s + (1 << 15), :]
        part = ((torch.matmul(a_c, hi) % m) * (1 << 16) + torch.matmul(a_c, lo) % m) % m
        acc = part if acc is None else (acc + part) % m
    return acc


def inv_mod(x: torch.Tensor, m: int) -> torch.Tensor:
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
