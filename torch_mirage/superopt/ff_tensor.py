"""The tensor that carries field elements through the verifier: :class:`FieldTensor` and its denominator ids.

A :class:`FieldTensor` is an int64 torch tensor (a subclass) holding packed field elements
(:mod:`.ff_field`: x_p·2^30 + x_q, :data:`~.ff_field.NEG_INF` for −∞). Because a FieldTensor *is* a tensor, the
executor's plain torch indexing / reshape / transpose / cat move field elements unchanged; torch arithmetic on it
raises (it would be real arithmetic on residues), so all math goes through
:class:`~.finite_field.FiniteFieldArith`. Each FieldTensor carries

* ``deg``, a :class:`~.ff_bound.Deg`: a bound, valid for every element, on the shape of the
  fraction N/D of exponential polynomials the element holds;
* ``den``, ``None`` (every denominator is 1) or an int64 tensor of the same shape:
  the *denominator id* of each element. Equal ids mean the same formal
  denominator expression; 0 means the denominator 1. Layout ops move ids with
  the values (the same torch op runs on ``den``), so a softmax row p = e / l
  broadcast along its columns has one id per row and ``p @ V`` — a sum over
  that row — sees a single denominator: (Σ_j e_j v_j) / l, not the product of
  kv copies of l. Ids are allocated (:class:`DenIds`) fresh for every inverted element (never
  shared by accident) and interned for products (pair (a, b) ↦ one id per
  arithmetic object), so an equality of ids is always an equality of formal
  expressions; an unknown relation gets a fresh id, which only loses sharing
  (a looser bound), never soundness.
"""
from __future__ import annotations

import math

import torch
from torch.utils import _pytree as pytree

from .ff_bound import CONST, Deg
from .ff_field import NotLAX

ID_LN2 = 1          # the denominator id of log2(e) = 1/λ (λ: the field's ln 2)
_FIRST_ID = 2
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
