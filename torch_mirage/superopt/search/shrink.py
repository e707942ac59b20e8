"""Searching a big region on small shapes (SEARCH.md §6.5): the shrunk problem and the schedule transfer.

At a decode layer's shapes (a 4096 x 4096 weight) one fp64 probe run of a candidate takes seconds and
one verification tens of seconds on the CPU: every block of the grid and every for-loop step is a
Python step of the executor. The algebra a skeleton computes does not depend on the sizes, so the
driver searches a *shrunk* copy of the problem: every dim longer than :data:`BIG` gets a small size
(distinct real sizes stay distinct, sizes up to :data:`KEEP` are kept, one-tile sizes get a free size up to
:data:`KEEP`), the target μGraph is rebuilt
at those sizes op by op (a reshape whose sizes do not map consistently means no shrinking), and the
schedules are drawn with tiles of :data:`SMALL_TILE`, so that a dim split over the grid or a for-loop
at the real size is split at the small size too, and one that is not is not.

A μGraph verified on the shrunk problem is carried back by :func:`transfers`: the real-size schedule
of the same skeleton with the same imaps, omap and split structure (which dims the grid and the
for-loop walk; only the counts differ). That μGraph is the verified one with longer tiles. The driver
re-verifies it at the real size when that is cheap; the compile stage's float check against eager
(``check_regions``) runs on it either way.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

from ...ugraph import KernelGraph, MuGraphError, make_op
from .generate import Skeleton
from .schedule import schedules

KEEP = 16           # dims up to this size keep their size (rows of a decode batch, heads of a group)
BIG = 64            # the real tile: dims longer than this are split over the grid or a for-loop
SMALL_TILE = 16     # the shrunk problem's tile: KEEP fits one tile, every shrunk dim at least two
SHRINK_ABOVE = 256  # shrink only problems with a dim at least this long (smaller ones search fast as they are)


@dataclass(frozen=True)
class ShrunkProblem:
    target: KernelGraph
    inputs: list            # (shape, dtype) per kernel input, at the small sizes
    out_shapes: list
    sizes: dict             # real size -> small size
    tile: int = SMALL_TILE


def size_map(sizes: Sequence[int]) -> dict[int, int] | None:
    """Real size -> small size, or None when the sizes do not shrink (all small already, or more sizes in
    (KEEP, BIG] than free sizes up to KEEP to give them). Sizes up to KEEP are kept; one in (KEEP, BIG] (one
    tile at the real size) gets a free size up to KEEP (one tile at the small size), the largest first; one
    above BIG gets 32, 48, ... (two or more small tiles, as it has two or more real ones)."""
    sizes = sorted(set(sizes))
    if not sizes or sizes[-1] < SHRINK_ABOVE:
        return None
    out = {d: d for d in sizes if d <= KEEP}
    free = [v for v in range(KEEP, 1, -1) if v not in out]
    mid = [d for d in sizes if KEEP < d <= BIG]
    if len(mid) > len(free):
        return None
    out.update(zip(mid, free))
    out.update({d: SMALL_TILE * (i + 2) for i, d in enumerate(d for d in sizes if d > BIG)})
    return out


def compact_size_map(sizes: Sequence[int], products: bool = False) -> dict[int, int] | None:
    """:func:`size_map` with the kept sizes above 2 made small too, so that the verifier's executor steps fewer
    blocks (a decode batch of 8 rows, 8 KV heads): in increasing order each gets the next free of 3, 4, ...; with
    ``products``, a size that is the product of two sizes already mapped gets the product of their images instead
    (8 x 2 heads merged into 16 by a reshape: 3 x 2 = 6). The larger sizes map as in :func:`size_map`. None where
    :func:`size_map` is, where nothing kept would shrink, or where two sizes would meet. A map that breaks a
    reshape makes :func:`shrink` return None: the driver tries the next map (:data:`SIZE_MAPS`)."""
    m = size_map(sizes)
    if m is None:
        return None
    out = {d: v for d, v in m.items() if d > KEEP or d <= 2}
    used = set(out.values())
    nxt = 3
    for d in sorted(d for d in m if 2 < d <= KEEP):
        product = next((out[a] * out[d // a] for a in sorted(out) if 1 < a <= KEEP and d % a == 0
                        and d // a in out and 1 < d // a <= KEEP), None) if products else None
        if product is None:
            while nxt in used:
                nxt += 1
            product = nxt
        if product in used or product > KEEP:
            return None
        out[d] = product
        used.add(product)
    return None if out == m else out


def product_size_map(sizes: Sequence[int]) -> dict[int, int] | None:
    """:func:`size_map` where a size above BIG that is the product of two sizes mapped before it maps to the product
    of their images (a prompt's 4 x 64 rows merged into 256 by a reshape: 4 x 16 = 64; 2 x 128 -> 2 x 32, the 128
    mapped first as the smaller size) when that is two or more small tiles
    and no other size's; the other sizes above BIG take the free multiples of SMALL_TILE from two tiles up. None
    where :func:`size_map` is or where no size is such a product (the plain map serves)."""
    m = size_map(sizes)
    if m is None:
        return None
    sizes = sorted(set(sizes))
    out = {d: v for d, v in m.items() if d <= BIG}
    used, free, changed = set(out.values()), 2 * SMALL_TILE, False
    def small_product(d):
        """The image of ``d`` as a product of two sizes already mapped: both up to BIG (at most 16 small tiles
        then), or one above (a prompt's 2 x 128: at most 6 small tiles, so that a size that only happens to be
        a multiple, 1024 = 4 x 256, is not made large)."""
        for a in sizes:
            if 1 < a < d and d % a == 0 and a in out and d // a in out and d // a > 1:
                product = out[a] * out[d // a]
                cap = 16 if max(a, d // a) <= BIG else 6
                if product % SMALL_TILE == 0 and 2 * SMALL_TILE <= product <= cap * SMALL_TILE and product not in used:
                    return product
        return None

    for d in (d for d in sizes if d > BIG):     # increasing: a product's factors are mapped before it
        product = small_product(d)
        if product is not None:
            out[d], changed = product, True
        else:
            while free in used:
                free += SMALL_TILE
            out[d] = free
        used.add(out[d])
    return out if changed else None


# the maps the search driver shrinks a problem with, the smallest first (each tried until one rebuilds the target)
SIZE_MAPS = (compact_size_map, functools.partial(compact_size_map, products=True), product_size_map, size_map)


def shrunk_problems(target: KernelGraph, inputs: Sequence, out_shapes: Sequence) -> list[ShrunkProblem]:
    """``target`` shrunk by each of :data:`SIZE_MAPS` that rebuilds it, the smallest first (none: [])."""
    out = []
    for sizes_of in SIZE_MAPS:
        small = shrink(target, inputs, out_shapes, sizes_of)
        if small is not None and all(small.sizes != o.sizes for o in out):
            out.append(small)
    return out


SMALL_HEAD = 4 * SMALL_TILE   # a shrunk head: each half two tiles, so a block's slices of a half split as at real size


def head_size_map(sizes: Sequence[int], head: int, small_head: int | None = None) -> dict[int, int] | None:
    """Real size -> small size for a problem in heads of ``head`` (RoPE's rotation pairs the halves of each): the
    head and its half become ``small_head`` and its half (default: kept), a multiple of the head two small heads at
    most, sizes up to 2 are kept and any other size becomes 2 at most (heads counted, rows), so that a size of whole
    heads maps to the small heads times the small head; None when nothing shrinks."""
    sizes = sorted(set(sizes))
    small_head = head if small_head is None else small_head
    keep = {1: 1, 2: 2, head // 2: small_head // 2, head: small_head}
    out = {d: keep[d] if d in keep else small_head * min(d // head, 2) if d % head == 0 else min(d, 2)
           for d in sizes}
    return None if all(out[d] == d for d in sizes) or not sizes or sizes[-1] < SHRINK_ABOVE else out


def shrink(target: KernelGraph, inputs: Sequence, out_shapes: Sequence, sizes_of=size_map) -> ShrunkProblem | None:
    """``target`` rebuilt at small sizes (``sizes_of``: real sizes -> their map, or None), or None when it does not
    shrink consistently."""
    sizes = {d for s, _ in inputs for d in s} | {d for s in out_shapes for d in s} | \
        {d for op in target.ops for s in op.shapes for d in s} | \
        {d for op in target.ops for d in (op.attrs.get("shape") or ())}
    m = sizes_of(sizes)
    if m is None:
        return None

    def small(shape):
        return tuple(m[d] for d in shape)

    ops = []
    try:
        for op in target.ops:
            attrs = dict(op.attrs)
            if attrs.get("shape") is not None:
                attrs["shape"] = small(attrs["shape"])
            in_shapes = [ops[r[0]].shapes[r[1]] for r in op.inputs]
            in_dtypes = [ops[r[0]].dtypes[r[1]] for r in op.inputs]
            new = make_op(op.name, op.inputs, in_shapes, in_dtypes, attrs, op.body, target.ctx(op.body))
            if new.shapes != tuple(small(s) for s in op.shapes):
                return None     # e.g. a reshape merging two shrunk dims: the map is not multiplicative
            ops.append(new)
    except (MuGraphError, KeyError, TypeError, ValueError):
        return None
    graph = KernelGraph(ops=tuple(ops), outputs=target.outputs)
    return ShrunkProblem(graph, [(small(s), d) for s, d in inputs], [small(s) for s in out_shapes], m)


def _structure(sched: dict) -> tuple:
    """What a schedule fixes besides the counts: imaps, omap, which grid dims split, whether the for-loop does."""
    return (tuple(tuple(m) for m in sched["imaps"]), tuple(sched["omap"]), tuple(g > 1 for g in sched["grid"]),
            sched["forloop_range"] > 1)


def transfers(skel: Skeleton, small_schedule: dict, inputs: Sequence, out_shapes: Sequence, *, tile: int,
              out_dtypes: Sequence | None = None, exact: bool = True):
    """Real-size ``(schedule, μGraph, True)`` of ``skel`` with ``small_schedule``'s structure; with ``exact``
    False and none of that structure, ``(schedule, μGraph, False)`` for those that only split the grid otherwise
    (same for-loop or none): the whole small problem fits one block where the real one must split its rows over the
    grid (a norm chain's 8 rows of 4096, each row's reductions whole in its block). Those are not verified by the
    small problem's verification: the caller verifies each at the real size. One walk of the schedules."""
    want = _structure(small_schedule)
    alike = []
    for sched, graph in schedules(skel, inputs, out_shapes, tile=tile, out_dtypes=out_dtypes):
        if _structure(sched) == want:
            yield sched, graph, True
            return
        if not exact and (sched["forloop_range"] > 1) == want[3]:
            alike.append((sched, graph, False))
    yield from alike


def block_steps(graph: KernelGraph) -> int:
    """Grid blocks x for-loop steps of a μGraph's block graphs, summed: the executor's work, in Python steps."""
    return sum(math.prod(op.body.grid) * op.body.forloop_range for op in graph.ops if op.name == "customized")


# Above this much :func:`executor_work` a μGraph is not verified at its own sizes (about 1.6 s on the 2-core CPU;
# on the H200's host the 9.5 s verifications below, one per cut tried, made a 4-layer prompt compile run for minutes)
MAX_VERIFY_WORK = 1 << 28


def executor_work(graph: KernelGraph) -> int:
    """The elements the verifier's executor computes in one run of a μGraph: per block step of each block graph,
    its ops' output elements, a matmul's times its inner dim (the executor runs a step's ops as tensor ops, so a
    step costs what its tiles hold; :func:`block_steps` counts the steps alone). A prompt's gate / up projections
    with their norm, 256 rows x 1024 -> 2 x 2816 in 704 steps, took 9.5 s a verification on the 2-core CPU."""
    total = 0
    for op in graph.ops:
        if op.name != "customized":
            continue
        body, step = op.body, 0
        for b in body.ops:
            inner = body.shape(b.inputs[0])[-1] if b.name == "matmul" else 1
            step += sum(math.prod(s) for s in b.shapes) * inner
        total += math.prod(body.grid) * body.forloop_range * step
    return total
