"""Reference executor: runs a μGraph on tensors exactly as it is partitioned.

Kernel ops run in order on whole tensors. A graph-defined (``customized``) op
runs its block graph block by block over the grid and, inside each block,
iteration by iteration over the for-loop: each iterator slices the tile that
``imap`` (block index) and ``fmap`` (iteration) select, the loop body runs on
tiles, accumulators fold the iterations, the epilogue runs once, and each
saver writes its tile where ``omap`` puts it. Every output element must be
written exactly once, else :class:`ExecutionError`. So a wrong partition
gives wrong numbers (or an error) on the CPU.

All arithmetic on tile values goes through an :class:`~.arith.Arith` (default
:class:`~.arith.TorchArith`); the executor itself only slices, indexes and
assigns. With ``FiniteFieldArith`` the same code evaluates a μGraph over
Z_p × Z_q for the verifier.
"""
from __future__ import annotations

import itertools
import logging
from typing import Sequence

import torch

from ..ugraph import (MASK_FLOOR, BlockGraph, Graph, KernelGraph, MuGraphError, Op, Ref, ThreadGraph, band_full,
                      band_geometry, band_mask_dims, band_range, grid_split)
from .arith import Arith, TorchArith
from .finite_field import FiniteFieldArith

log = logging.getLogger("torch_mirage")


class ExecutionError(MuGraphError):
    pass


def execute(graph: KernelGraph, inputs: Sequence[torch.Tensor], arith: Arith | None = None) -> list[torch.Tensor]:
    """Run ``graph`` on ``inputs`` (in input-index order); returns its outputs."""
    arith = arith or TorchArith()
    ins = graph.inputs
    if len(inputs) != len(ins):
        raise ExecutionError(f"μGraph takes {len(ins)} inputs, got {len(inputs)}")
    for op, x in zip(ins, inputs):
        if tuple(x.shape) != tuple(op.attrs["shape"]):
            raise ExecutionError(f"μGraph input {op.attrs['index']}: expected shape {tuple(op.attrs['shape'])} "
                                 f"({op.attrs['dtype']}), got {tuple(x.shape)} ({x.dtype}); build the μGraph "
                                 "for these shapes")
    env = _run_ops(graph, range(len(graph.ops)), {}, arith, lambda op: [inputs[op.attrs["index"]]])
    return [env[r] for r in graph.outputs]


def _run_ops(g: Graph, order, env: dict, arith: Arith, source) -> dict:
    """Evaluate ops ``order`` of ``g`` into ``env``; ``source(op)`` gives io ops' values."""
    for i in order:
        op = g.ops[i]
        xs = [env[Ref(*r)] for r in op.inputs]
        outs = _eval(op, xs, arith, source)
        for j, v in enumerate(outs):
            env[Ref(i, j)] = v
    return env


def _eval(op: Op, xs: list, arith: Arith, source) -> list:
    s = op.spec
    if s.kind == "io":
        return source(op)
    if op.name == "customized":
        return run_block(op.body, xs, arith)
    if op.name == "thread":
        return run_thread(op.body, xs, arith)
    if s.layout is not None:
        return [s.layout(*xs, **op.attrs)]
    fn = getattr(arith, s.arith)
    if s.arity is None:
        return [fn(xs, **op.attrs)]
    return [fn(*xs, **op.attrs)]


def run_thread(tg: ThreadGraph, xs: list, arith: Arith) -> list:
    env = _run_ops(tg, range(len(tg.ops)), {}, arith, lambda op: [xs[op.attrs["index"]]])
    return [env[r] for r in tg.outputs]


# ------------------------------------------------------------------ partitions
def tile_slices(full, imap, fmap, grid, block, forloop_range, it) -> tuple:
    """The index of the tile block ``block`` loads in iteration ``it``."""
    idx = []
    for d, size in enumerate(full):
        start, extent = 0, size
        for g, m in enumerate(imap):
            if m == d:
                group, extent = grid_split(size, grid[g])
                start += block[g] // group * extent
        if fmap == d:
            extent //= forloop_range
            start += it * extent
        idx.append(slice(start, start + extent))
    return tuple(idx)


def out_slices(tile, omap, grid, block) -> tuple:
    """Where block ``block``'s output tile goes in the kernel output."""
    idx = [slice(0, n) for n in tile]
    for g, d in enumerate(omap):
        if d is not None:
            idx[d] = slice(block[g] * tile[d], (block[g] + 1) * tile[d])
    return tuple(idx)


def _saved_shape(tile, omap, grid) -> tuple:
    out = list(tile)
    for g, d in enumerate(omap):
        if d is not None:
            out[d] *= grid[g]
    return tuple(out)


def _acc_count(bg: BlockGraph, op: Op, x_shape) -> int:
    dim = op.attrs.get("dim")
    if op.name in ("acc_mean", "acc_rms") and dim is not None:
        return x_shape[dim] * bg.forloop_range
    return bg.forloop_range


def _identity_state(op: Op, st, arith: Arith) -> tuple:
    """An accumulator state that has seen no key (a block whose for-loop band is empty): a sum 0; online
    softmax m = -inf, l = 0, o = 0."""
    if op.name == "acc_sum":
        return arith.zeros(tuple(st.shape), like=st)
    if op.name != "acc_online_softmax":
        raise ExecutionError(f"an empty for-loop band under {op.name}")
    m, l, o = st
    return (arith.full(tuple(m.shape), float("-inf"), like=m), arith.zeros(tuple(l.shape), like=l),
            arith.zeros(tuple(o.shape), like=o))


def band_mask(bg: BlockGraph, shape) -> torch.Tensor:
    """The band's own mask (``index_mask``) as a bool tensor of its input's ``shape``: True where the key along
    the walked dim is visible from the position (the other dim's index modulo ``period``)."""
    b = band_geometry(bg)
    it = next(op for op in bg.iterators if op.attrs["index"] == b["zero_input"])
    pd, kd = band_mask_dims(bg, it)
    rank = len(shape)
    pos = (torch.arange(shape[pd]) % b["period"]).reshape([-1 if d == pd else 1 for d in range(rank)])
    key = torch.arange(shape[kd]).reshape([-1 if d == kd else 1 for d in range(rank)])
    seen = key <= pos + b["offset"]
    if b["window"] is not None:
        seen = seen & (key > pos + b["offset"] - b["window"])
    return seen.expand(tuple(shape))


def _index_mask(bg: BlockGraph, x, arith: Arith):
    """The band's ``index_mask`` input as the kernel computes it (its passed tensor unread): 0 where visible,
    else the masked floor (-inf in a finite field, which has no finite floor)."""
    floor = float("-inf") if isinstance(arith, FiniteFieldArith) else MASK_FLOOR
    shape = tuple(x.shape)
    seen = band_mask(bg, shape)
    out = arith.full(shape, floor, like=x)
    out[seen] = arith.zeros(shape, like=x)[seen]
    return out


def run_block(bg: BlockGraph, kernel_inputs: list, arith: Arith) -> list:
    """Run one graph-defined kernel op: every block of the grid, every iteration."""
    body, epilogue = bg.phases()
    accs = [i for i in body if bg.ops[i].spec.kind == "accum"]
    savers = {bg.ops[i].attrs["index"]: i for i in epilogue if bg.ops[i].name == "saver"}
    outs: list = [None] * len(savers)
    written: list = [None] * len(savers)
    zero = bg.forloop_band[6] if bg.forloop_band is not None and len(bg.forloop_band) > 6 else None
    if zero is not None and band_geometry(bg)["index_mask"]:
        kernel_inputs = list(kernel_inputs)
        kernel_inputs[zero] = _index_mask(bg, kernel_inputs[zero], arith)
    for block in itertools.product(*(range(n) for n in bg.grid)):
        state: dict[int, object] = {}
        lo, hi = band_range(bg, block)
        for it in list(range(lo, hi)) or ([0] if bg.forloop_band is not None else []):
            empty = lo >= hi                # no visible key tile: iteration 0 only gives the states' shapes
            def load(op, it=it):
                x = kernel_inputs[op.attrs["index"]]
                tile = x[tile_slices(x.shape, op.attrs["imap"], op.attrs["fmap"], bg.grid, block,
                                     bg.forloop_range, it)]
                if zero is not None and op.attrs["index"] == zero and band_full(bg, block, it):
                    tile = arith.zeros(tuple(tile.shape), like=tile)      # the band says: 0, not loaded
                return [tile]
            env = _run_ops(bg, [i for i in body if i not in accs], {}, arith, load)
            for i in accs:
                op = bg.ops[i]
                xs = [env[Ref(*r)] for r in op.inputs]
                state[i] = getattr(arith, op.spec.arith)(state.get(i), *xs, **op.attrs)
                if empty:
                    state[i] = _identity_state(op, state[i], arith)
                state[(i, "n")] = _acc_count(bg, op, xs[0].shape)
        env = {}
        for i in accs:
            op = bg.ops[i]
            final = getattr(arith, op.spec.arith + "_final")(state[i], state[(i, "n")], **op.attrs)
            for j, v in enumerate(final):
                env[Ref(i, j)] = v
        env = _run_ops(bg, [i for i in epilogue if bg.ops[i].name != "saver"], env, arith, None)
        for k, i in savers.items():
            op = bg.ops[i]
            tile = env[Ref(*op.inputs[0])]
            if tuple(tile.shape) != bg.shape(op.inputs[0]):
                raise ExecutionError(f"saver {k}: tile has shape {tuple(tile.shape)}, graph says "
                                     f"{bg.shape(op.inputs[0])}")
            if outs[k] is None:
                full = _saved_shape(tile.shape, op.attrs["omap"], bg.grid)
                outs[k] = arith.zeros(full, like=tile)
                written[k] = torch.zeros(full, dtype=torch.int32)
            where = out_slices(tile.shape, op.attrs["omap"], bg.grid, block)
            outs[k][where] = tile
            written[k][where] += 1
    for k, w in enumerate(written):
        if not bool((w == 1).all()):
            raise ExecutionError(f"saver {k}: {int((w == 0).sum())} output elements never written, "
                                 f"{int((w > 1).sum())} written more than once; check omap")
    return outs
