"""Schedule instantiation for a found skeleton (SEARCH.md §6.4: skeletons first, schedules after).

A :class:`~.generate.Skeleton` fixes which tensor dim each iterator's for-loop walks; this module
chooses the numbers Mirage's ``dim_strategy`` enumerates: the for-loop range (a common divisor of
the fmapped dims, tiles near ``tile`` elements), a 1-D grid over one output dim (``blocks(size,
tile)`` blocks, the saver's omap maps the grid to it; each leading dim of a rank ≥ 3 output (all but its
last two: a batch dim, attention's heads) gets a grid dim of its own, one index per block) and each iterator's imap (φ or one of its dims that is not its fmap and divides by
the grid). Every schedule yielded is a valid μGraph
(``validate.problems`` is empty) whose outputs have the target's shapes; which imaps compute the
right function is for the caller's checks (the float probe and the verifier in :mod:`.driver`).
"""
from __future__ import annotations

import itertools
from typing import Iterator, Sequence

from ...ugraph import KernelGraph, MuGraphError
from ..library import DOT_MIN, blocks
from ..validate import problems
from .generate import Skeleton, to_kernel_graph


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def forloop_ranges(skel: Skeleton, inputs: Sequence, tile: int) -> list[int]:
    """Candidate for-loop ranges: divisors of every fmapped dim, the one giving tiles closest to
    ``tile`` (at most ``tile``) first — as :func:`~..library.tiles` chooses, tiles of up to 2 ``tile``
    where those at most ``tile`` would be shorter than ``DOT_MIN`` (a prime length) —; 1 when no iterator
    has an fmap."""
    sizes = [inputs[i][0][f] for i, f in enumerate(skel.fmaps) if f is not None]
    if not sizes:
        return [1]
    common = [d for d in divisors(min(sizes)) if all(s % d == 0 for s in sizes)]

    def fewest(cap: int) -> int:
        return next((d for d in common if max(sizes) // d <= cap), common[-1])
    best = fewest(tile)
    if min(sizes) // best < DOT_MIN <= min(sizes) and tile >= DOT_MIN:
        best = wide if min(sizes) // (wide := fewest(2 * tile)) >= DOT_MIN else best
    return [best] + [d for d in (skel.probe_range,) if d != best and d in common]


def grids(out_shapes: Sequence, tile: int, rows: bool = False) -> list[tuple[int, int]]:
    """(output dim, blocks) pairs: every output dim of size > 1 (last dim first) split into tiles of
    at most ``tile``; (None, 1) = one block. ``rows`` (whole rows per block, no for-loop): then also one
    row per block along each leading dim, for rows too long for ``tile`` of them to fit a block."""
    shape = out_shapes[0]
    out, fine = [], []
    for d in reversed(range(len(shape) - 2 if len(shape) >= 3 else 0, len(shape))):   # the rest: lead_dims
        if all(len(s) == len(shape) and s[d] == shape[d] for s in out_shapes):
            g = blocks(shape[d], tile)
            if g > 1:
                out.append((d, g))
            if rows and d < len(shape) - 1 and shape[d] > g:
                fine.append((d, shape[d]))
    return out + [(None, 1)] + fine


MAX_GRID_DIMS = 3


def lead_dims(out_shapes, inputs, fmaps) -> list[tuple[int, int, list]]:
    """For outputs of rank ≥ 3 (…, rows, cols): each leading dim of size > 1 that all outputs share, as (dim,
    size, per-input imap entry: that dim for the inputs of the output's rank with that size there and no for-loop
    over it, else φ); at most two (the grid has three dims)."""
    shape = out_shapes[0]
    if len(shape) < 3 or any(len(s) != len(shape) or s[:-2] != shape[:-2] for s in out_shapes):
        return []
    out = []
    for d in range(len(shape) - 2):
        if shape[d] > 1 and len(out) < MAX_GRID_DIMS - 1:
            out.append((d, shape[d], [d if len(s) == len(shape) and s[d] == shape[d] and f != d else None
                                      for (s, _), f in zip(inputs, fmaps)]))
    return out


def schedules(skel: Skeleton, inputs: Sequence, out_shapes: Sequence, *, tile: int = 64,
              out_dtypes: Sequence | None = None, limit: int = 64) -> Iterator[tuple[dict, KernelGraph]]:
    """Yield ``(schedule, μGraph)`` for valid instantiations of ``skel``: schedule is the keyword
    arguments of :func:`~.generate.to_kernel_graph` (grid, forloop_range, imaps, omap)."""
    inputs = [(tuple(s), d) for s, d in inputs]
    out_shapes = [tuple(s) for s in out_shapes]
    n = 0
    for frange in forloop_ranges(skel, inputs, tile):
        for odim, g in grids(out_shapes, tile, rows=frange == 1 and all(f is None for f in skel.fmaps)):
            options = []
            for (shape, _), f in zip(inputs, skel.fmaps):
                opts = [None] if g == 1 else \
                    [d for d in range(len(shape)) if d != f and shape[d] % g == 0 and shape[d] > 1] + [None]
                options.append([(d,) for d in opts])
            lead = lead_dims(out_shapes, inputs, skel.fmaps)
            for imaps in itertools.product(*options):
                if g > 1 and all(m == (None,) for m in imaps):
                    continue      # every block would compute the same tile
                grid, omap = (g,), (odim,)
                for d, size, maps in lead:     # a grid dim per leading dim (batch, heads): 2-d tiles per block
                    grid, omap, imaps = grid + (size,), omap + (d,), tuple(m + (bm,) for m, bm in zip(imaps, maps))
                sched = dict(grid=grid, forloop_range=frange, imaps=list(imaps), omap=omap,
                             out_dtypes=list(out_dtypes) if out_dtypes else None)
                try:
                    graph = to_kernel_graph(skel, inputs, **sched)
                except MuGraphError:
                    continue
                if [tuple(s) for op in graph.ops if op.name == "customized" for s in op.shapes] != out_shapes:
                    continue
                if problems(graph):
                    continue
                yield sched, graph
                n += 1
                if n >= limit:
                    return
