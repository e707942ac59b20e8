"""Schedule instantiation for a found skeleton (SEARCH.md §6.4: skeletons first, schedules after).

A :class:`~.generate.Skeleton` fixes which tensor dim each iterator's for-loop walks; this module
chooses the numbers Mirage's ``dim_strategy`` enumerates: the for-loop range (a common divisor of
the fmapped dims, tiles near ``tile`` elements), a 1-D grid over one output dim (``blocks(size,
tile)`` blocks, the saver's omap maps the grid to it; a rank-3 output's leading batch dim gets a
second grid dim) and each iterator's imap (φ or one of its dims that is not its fmap and divides by
the grid). Every schedule yielded is a valid μGraph
(``validate.problems`` is empty) whose outputs have the target's shapes; which imaps compute the
right function is for the caller's checks (the float probe and the verifier in :mod:`.driver`).
"""
from __future__ import annotations

import itertools
from typing import Iterator, Sequence

from ...ugraph import KernelGraph, MuGraphError
from ..library import blocks
from ..validate import problems
from .generate import Skeleton, to_kernel_graph


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def forloop_ranges(skel: Skeleton, inputs: Sequence, tile: int) -> list[int]:
    """Candidate for-loop ranges: divisors of every fmapped dim, the one giving tiles closest to
    ``tile`` (at most ``tile``) first; 1 when no iterator has an fmap."""
    sizes = [inputs[i][0][f] for i, f in enumerate(skel.fmaps) if f is not None]
    if not sizes:
        return [1]
    common = [d for d in divisors(min(sizes)) if all(s % d == 0 for s in sizes)]
    best = next((d for d in common if max(sizes) // d <= tile), common[-1])
    return [best] + [d for d in (skel.probe_range,) if d != best and d in common]


def grids(out_shapes: Sequence, tile: int, rows: bool = False) -> list[tuple[int, int]]:
    """(output dim, blocks) pairs: every output dim of size > 1 (last dim first) split into tiles of
    at most ``tile``; (None, 1) = one block. ``rows`` (whole rows per block, no for-loop): then also one
    row per block along each leading dim, for rows too long for ``tile`` of them to fit a block."""
    shape = out_shapes[0]
    out, fine = [], []
    for d in reversed(range(1 if len(shape) == 3 else 0, len(shape))):   # rank 3: dim 0 is the batch grid dim
        if all(len(s) == len(shape) and s[d] == shape[d] for s in out_shapes):
            g = blocks(shape[d], tile)
            if g > 1:
                out.append((d, g))
            if rows and d < len(shape) - 1 and shape[d] > g:
                fine.append((d, shape[d]))
    return out + [(None, 1)] + fine


def _batch_dim(out_shapes, inputs, fmaps):
    """For rank-3 outputs (batch, rows, cols): (batch size, per-input imap entry: 0 for the inputs of the
    output's rank with that leading size and no for-loop over it, else φ); None otherwise."""
    shape = out_shapes[0]
    if len(shape) != 3 or shape[0] == 1 or any(len(s) != 3 or s[0] != shape[0] for s in out_shapes):
        return None
    return shape[0], [0 if len(s) == 3 and s[0] == shape[0] and f != 0 else None for (s, _), f in zip(inputs, fmaps)]


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
            batch = _batch_dim(out_shapes, inputs, skel.fmaps)
            for imaps in itertools.product(*options):
                if g > 1 and all(m == (None,) for m in imaps):
                    continue      # every block would compute the same tile
                grid, omap = (g,), (odim,)
                if batch is not None:     # a second grid dim walks the leading (batch) dim: 2-d tiles per block
                    b, maps = batch
                    grid, omap, imaps = (g, b), (odim, 0), tuple(m + (bm,) for m, bm in zip(imaps, maps))
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
