"""The arithmetic a μGraph executes, as one interface: :class:`Arith`.

The reference executor (``executor.py``) performs every arithmetic operation on
tile values through an ``Arith`` object; slicing, indexing, ``unsqueeze``,
``transpose`` and ``reshape`` move data without arithmetic and stay plain
torch indexing. Two implementations share the interface:

* :class:`TorchArith` (here): real arithmetic on floating-point torch tensors.
* ``FiniteFieldArith`` (``finite_field.py``): the same methods on integer
  tensors holding elements of Z_p × Z_q, for the probabilistic verifier.

The primitives (abstract methods) are the whole contract. The composite
methods below them (``scalar_mul``, ``rms_norm``, the for-loop accumulators
``acc_*`` ...) are written only in terms of the primitives, so every
implementation inherits them; an implementation may override one where its
algebra needs a different treatment (the online-softmax ``max`` shift, for
instance). The op table in ``ugraph.py`` names, for each op, the method here
that evaluates it.

Primitives: ``matmul, add, sub, mul, div, exp, sqrt, rsqrt, silu, neg, square,
sum, max, zeros, full, concat, where``. ``rotate_half`` (RoPE's pairing of the two halves of a head) is a composite of
``neg`` and ``concat``.
"""
from __future__ import annotations

import abc
from typing import Sequence

import torch

Tensor = torch.Tensor


class Arith(abc.ABC):
    """Arithmetic on tile values. Binary methods broadcast like numpy / torch."""

    # ----------------------------------------------------------------- primitives
    @abc.abstractmethod
    def matmul(self, a: Tensor, b: Tensor) -> Tensor:
        """``a[..., m, k] @ b[..., k, n]`` with broadcast batch dims."""

    @abc.abstractmethod
    def add(self, a: Tensor, b: Tensor) -> Tensor:
        """Elementwise ``a + b``."""

    @abc.abstractmethod
    def sub(self, a: Tensor, b: Tensor) -> Tensor:
        """Elementwise ``a - b``."""

    @abc.abstractmethod
    def mul(self, a: Tensor, b: Tensor) -> Tensor:
        """Elementwise ``a * b``."""

    @abc.abstractmethod
    def div(self, a: Tensor, b: Tensor) -> Tensor:
        """Elementwise ``a / b`` (finite field: multiplication by the inverse)."""

    @abc.abstractmethod
    def exp(self, x: Tensor) -> Tensor:
        """Elementwise ``e**x`` (finite field: ω**x_q)."""

    @abc.abstractmethod
    def sqrt(self, x: Tensor) -> Tensor:
        """Elementwise square root."""

    @abc.abstractmethod
    def rsqrt(self, x: Tensor) -> Tensor:
        """Elementwise ``1 / sqrt(x)``."""

    @abc.abstractmethod
    def silu(self, x: Tensor) -> Tensor:
        """Elementwise ``x * sigmoid(x)``."""

    @abc.abstractmethod
    def tanh(self, x: Tensor) -> Tensor:
        """Elementwise hyperbolic tangent (finite field: an uninterpreted function)."""

    @abc.abstractmethod
    def neg(self, x: Tensor) -> Tensor:
        """Elementwise ``-x``."""

    @abc.abstractmethod
    def square(self, x: Tensor) -> Tensor:
        """Elementwise ``x * x``."""

    @abc.abstractmethod
    def sum(self, x: Tensor, dim: int, keepdim: bool = True) -> Tensor:
        """Sum over ``dim``."""

    @abc.abstractmethod
    def max(self, x: Tensor, dim: int, keepdim: bool = True) -> Tensor:
        """Maximum over ``dim`` (values only). Not LAX: the verifier documents its treatment."""

    @abc.abstractmethod
    def zeros(self, shape: Sequence[int], like: Tensor) -> Tensor:
        """A zero tensor of ``shape`` with the kind (dtype, device, field) of ``like``."""

    @abc.abstractmethod
    def full(self, shape: Sequence[int], value: float, like: Tensor) -> Tensor:
        """A constant tensor of ``shape`` (``()`` for a broadcast scalar) of the kind of ``like``."""

    @abc.abstractmethod
    def concat(self, xs: Sequence[Tensor], dim: int) -> Tensor:
        """Concatenation along ``dim``."""

    @abc.abstractmethod
    def where(self, keep: Tensor, x: Tensor, value) -> Tensor:
        """``x`` where the bool ``keep`` (program data, the same in both programs) holds, else ``value``."""

    # ------------------------------------------------- composites (inherited)
    def const(self, value: float, like: Tensor) -> Tensor:
        """A scalar constant that broadcasts against ``like``."""
        return self.full((), value, like)

    def maximum(self, a: Tensor, b: Tensor) -> Tensor:
        """Elementwise max of two same-shape tensors, through :meth:`max`."""
        return self.max(self.concat([a.unsqueeze(0), b.unsqueeze(0)], 0), 0, keepdim=False)

    def scalar_mul(self, x: Tensor, value: float) -> Tensor:
        return self.mul(x, self.const(value, x))

    def scalar_add(self, x: Tensor, value: float) -> Tensor:
        return self.add(x, self.const(value, x))

    def reduce_sum(self, x: Tensor, dim: int) -> Tensor:
        return self.sum(x, dim, keepdim=True)

    def reduce_max(self, x: Tensor, dim: int) -> Tensor:
        return self.max(x, dim, keepdim=True)

    def reduce_mean(self, x: Tensor, dim: int) -> Tensor:
        return self.div(self.sum(x, dim, keepdim=True), self.const(x.shape[dim], x))

    def mean_square_root(self, total: Tensor, count: int, eps: float) -> Tensor:
        """``sqrt(total / count + eps)``: the root of a mean of squares."""
        ms = self.div(total, self.const(count, total))
        return self.sqrt(self.scalar_add(ms, eps) if eps else ms)

    def rotate_half(self, x: Tensor, group: int, signs: tuple = (-1, 1)) -> Tensor:
        """RoPE's rotation within each group of ``group`` columns of the last dim: the group's halves (x1, x2)
        become ``(signs[0]·x2, signs[1]·x1)`` (HF's ``rotate_half``: signs (-1, 1))."""
        halves = x.reshape(*x.shape[:-1], x.shape[-1] // group, 2, group // 2)
        x1, x2 = halves[..., 0:1, :], halves[..., 1:2, :]
        parts = [self.neg(p) if s < 0 else p for p, s in zip((x2, x1), signs)]
        return self.concat(parts, -2).reshape(x.shape)

    def rms_norm(self, x: Tensor, eps: float = 0.0) -> Tensor:
        """``x / sqrt(mean(x², last dim) + eps)`` (no weight; multiply it after)."""
        return self.div(x, self.mean_square_root(self.sum(self.square(x), -1), x.shape[-1], eps))

    # For-loop accumulators (Mirage §2). ``acc_<kind>(state, *xs, ...)`` folds one
    # iteration into ``state`` (``None`` before the first iteration) and returns
    # the new state; ``acc_<kind>_final(state, count, ...)`` turns the state
    # into the accumulator's outputs (a tuple). ``count`` is the number of
    # elements the accumulation covered (iterations × reduced tile extent).
    def _fold(self, state, x: Tensor, combine):
        return x if state is None else combine(state, x)

    def acc_sum(self, state, x: Tensor, dim: int | None = None) -> Tensor:
        return self._fold(state, x if dim is None else self.sum(x, dim), self.add)

    def acc_sum_final(self, state, count: int, dim: int | None = None) -> tuple:
        return (state,)

    def acc_mean(self, state, x: Tensor, dim: int | None = None) -> Tensor:
        return self.acc_sum(state, x, dim)

    def acc_mean_final(self, state, count: int, dim: int | None = None) -> tuple:
        return (self.div(state, self.const(count, state)),)

    def acc_rms(self, state, x: Tensor, dim: int | None = None, eps: float = 0.0) -> Tensor:
        sq = self.square(x)
        return self._fold(state, sq if dim is None else self.sum(sq, dim), self.add)

    def acc_rms_final(self, state, count: int, dim: int | None = None, eps: float = 0.0) -> tuple:
        return (self.mean_square_root(state, count, eps),)

    def acc_max(self, state, x: Tensor, dim: int | None = None) -> Tensor:
        return self._fold(state, x if dim is None else self.max(x, dim), self.maximum)

    def acc_max_final(self, state, count: int, dim: int | None = None) -> tuple:
        return (state,)

    def acc_concat(self, state, x: Tensor, dim: int) -> Tensor:
        return self._fold(state, x, lambda a, b: self.concat([a, b], dim))

    def acc_concat_final(self, state, count: int, dim: int) -> tuple:
        return (state,)

    def acc_online_softmax(self, state, s: Tensor, v: Tensor) -> tuple:
        """Online-softmax (rescaling) accumulator over score tiles ``s[..., r, c]``
        and value tiles ``v[..., c, d]``; state ``(m, l, o)``: running row max,
        running ``Σ exp(s - m)``, running ``exp(s - m) @ v``. Each new tile
        rescales the old state by ``exp(m_old - m_new)``."""
        m_tile = self.row_max(s)
        if state is None:
            p = self.exp(self.sub(s, m_tile))
            return m_tile, self.sum(p, -1), self.matmul(p, v)
        m, l, o = state
        m_new = self.maximum(m, m_tile)
        alpha = self.exp(self.sub(m, m_new))
        p = self.exp(self.sub(s, m_new))
        return (m_new, self.add(self.mul(alpha, l), self.sum(p, -1)),
                self.add(self.mul(alpha, o), self.matmul(p, v)))

    def row_max(self, s: Tensor) -> Tensor:
        """The max of each row of a score tile that the online softmax shifts its exponentials by."""
        return self.max(s, -1)

    def acc_online_softmax_final(self, state, count: int) -> tuple:
        """Outputs ``(m, l, o)``; ``o / l`` is the attention output, ``m`` and
        ``l`` let a later kernel combine KV splits (FlashDecoding)."""
        return tuple(state)


class TorchArith(Arith):
    """Real arithmetic on floating-point torch tensors (the reference executor's default)."""

    def matmul(self, a, b):
        return torch.matmul(a, b)

    def add(self, a, b):
        return a + b

    def sub(self, a, b):
        return a - b

    def mul(self, a, b):
        return a * b

    def div(self, a, b):
        return a / b

    def index_copy(self, dst, index, src, dim):
        return dst.index_copy(dim, index.long(), src.to(dst.dtype))

    def exp(self, x):
        return torch.exp(x)

    def sqrt(self, x):
        return torch.sqrt(x)

    def rsqrt(self, x):
        return torch.rsqrt(x)

    def silu(self, x):
        return torch.nn.functional.silu(x)

    def tanh(self, x):
        return torch.tanh(x)

    def where(self, keep, x, value):
        return torch.where(keep.bool(), x, torch.tensor(value, dtype=x.dtype, device=x.device))

    def row_max(self, s):
        """The max held at the dtype's lowest finite value, as the kernels' finite running-max start (codegen's
        ``M_INIT``): a tile or split whose scores are all -inf then adds ``exp(-inf) = 0``, not
        ``exp(-inf + inf) = NaN``, and a row with no key ends at l = 0, o = 0 here too."""
        return torch.clamp_min(torch.amax(s, dim=-1, keepdim=True), torch.finfo(s.dtype).min)

    def neg(self, x):
        return -x

    def square(self, x):
        return x * x

    def sum(self, x, dim, keepdim=True):
        return torch.sum(x, dim=dim, keepdim=keepdim)

    def max(self, x, dim, keepdim=True):
        return torch.amax(x, dim=dim, keepdim=keepdim)

    def zeros(self, shape, like):
        return torch.zeros(tuple(shape), dtype=like.dtype, device=like.device)

    def full(self, shape, value, like):
        return torch.full(tuple(shape), value, dtype=like.dtype, device=like.device)

    def concat(self, xs, dim):
        return torch.cat(list(xs), dim=dim)
