"""Which element of a base tensor each element of a value holds, when the value is reached from the base through
layout ops only (view / reshape, permute, unsqueeze, squeeze, expand, and copies that keep values).

A :class:`Layout` maps a value's index to a linear index into its base (the base read as contiguous in its own
logical order). Each dim of the value is the row-major flattening of one or more *modes* ``(size, stride)``, so a
view that merges dims no single stride can merge (the query-head groups of a ``repeat_kv``: a KV-head dim and an
expanded dim of stride 0) stays exact. Two spellings of the same data movement — an einsum's unsqueeze / permute /
5-D view chain, a ``q.reshape(b·h, s, d)``, ``k.transpose(-1, -2)``, HF's ``repeat_kv`` — give equal layouts
(:meth:`Layout.canonical`), which is how the attention analysis reads a region's operands by what they hold rather
than by how they were written.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

Mode = tuple[int, int]          # (size, stride) over the base's linear index


def _contiguous(shape: Sequence[int]) -> list[int]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return strides[::-1]


@dataclass(frozen=True)
class Layout:
    """Dim ``i`` of the value indexes the row-major product of ``modes[i]``; the element it names is the base's
    element at linear index ``sum(index_of_mode * stride)``."""
    modes: tuple[tuple[Mode, ...], ...]

    @classmethod
    def of_base(cls, shape: Sequence[int]) -> "Layout":
        """The base itself."""
        return cls(tuple(((int(s), st),) for s, st in zip(shape, _contiguous(shape))))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(math.prod(s for s, _ in dim) for dim in self.modes)

    # --- the layout ops
    def permute(self, dims: Sequence[int]) -> "Layout":
        n = len(self.modes)
        return Layout(tuple(self.modes[d % n] for d in dims))

    def unsqueeze(self, dim: int) -> "Layout":
        n = len(self.modes) + 1
        d = dim % n
        return Layout(self.modes[:d] + (((1, 0),),) + self.modes[d:])

    def squeeze(self, dims: Sequence[int] | None = None) -> "Layout":
        n = len(self.modes)
        drop = {d % n for d in dims} if dims is not None else set(range(n))
        return Layout(tuple(m for i, m in enumerate(self.modes)
                            if not (i in drop and math.prod(s for s, _ in m) == 1)))

    def expand(self, sizes: Sequence[int]) -> "Layout | None":
        lead = len(sizes) - len(self.modes)
        if lead < 0:
            return None
        out = [((int(s), 0),) for s in sizes[:lead]]
        for dim, size in zip(self.modes, sizes[lead:]):
            have = math.prod(s for s, _ in dim)
            if size == -1 or size == have:
                out.append(dim)
            elif have == 1:
                out.append(((int(size), 0),))
            else:
                return None
        return Layout(tuple(out))

    def view(self, shape: Sequence[int]) -> "Layout | None":
        """Row-major regrouping into ``shape`` (one ``-1`` allowed); None where a mode would have to split at a
        size that does not divide it."""
        shape = list(shape)
        total = math.prod(self.shape)
        if shape.count(-1) == 1:
            known = math.prod(s for s in shape if s != -1)
            shape[shape.index(-1)] = total // known if known else 0
        if math.prod(shape) != total:
            return None
        flat = [m for dim in self.modes for m in dim if m[0] != 1]
        out: list[tuple[Mode, ...]] = []
        for size in shape:
            dim: list[Mode] = []
            left = int(size)
            while left > 1:
                if not flat:
                    return None
                n, st = flat[0]
                if n <= left:
                    if left % n:
                        return None
                    dim.append(flat.pop(0))
                    left //= n
                elif n % left == 0:      # the mode's outer part joins this dim, its inner part the next
                    dim.append((left, st * (n // left)))
                    flat[0] = (n // left, st)
                    left = 1
                else:
                    return None
            out.append(tuple(dim) or ((1, 0),))
        return Layout(tuple(out))

    # --- comparison
    def canonical(self) -> tuple[tuple[Mode, ...], ...]:
        """The modes with size-1 modes dropped and neighbours that one stride covers merged: equal for layouts
        that name the same elements in the same order."""
        out = []
        for dim in self.modes:
            merged: list[Mode] = []
            for n, st in dim:
                if n == 1:
                    continue
                if merged and merged[-1][1] == n * st:
                    merged[-1] = (merged[-1][0] * n, st)
                else:
                    merged.append((n, st))
            out.append(tuple(merged))
        return tuple(out)

    def same_as(self, other: "Layout | None") -> bool:
        return other is not None and self.shape == other.shape and self.canonical() == other.canonical()


def apply(layout: Layout | None, op: str, args: Sequence) -> Layout | None:
    """``layout`` after the project IR's layout op ``op`` with its ATen arguments ``args`` (the input first);
    value-keeping ops (``copy``, ``to_dtype``) leave it; None for anything this map cannot follow."""
    if layout is None:
        return None
    if op in ("copy", "to_dtype"):
        return layout
    if op == "view":
        return layout.view(args[1])
    if op == "permute":
        dims = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else None
        if dims is None:                       # t() / transpose(a, b)
            n = len(layout.modes)
            a, b = (0, 1) if len(args) == 1 else (args[1] % n, args[2] % n)
            dims = list(range(n))
            dims[a], dims[b] = dims[b], dims[a]
        return layout.permute(dims)
    if op == "unsqueeze":
        return layout.unsqueeze(args[1])
    if op == "squeeze":
        dims = None if len(args) < 2 else (args[1] if isinstance(args[1], (list, tuple)) else [args[1]])
        return layout.squeeze(dims)
    if op == "expand":
        return layout.expand(args[1])
    return None
