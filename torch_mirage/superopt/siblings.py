"""Sibling launches: independent graph-defined ops of one μGraph run as one kernel.

A μGraph's kernel ops run one launch each. Where two or more of them read nothing the others write — a decode
layer's q and k / v projections, each streaming its own weight from the same normed row — one launch can run
them all: :func:`~torch_mirage.codegen.ugraph_triton.emit_sibling_kernel` lays their programs side by side and
each program runs its part's body. The fixed cost of a launch (H100, inside a CUDA graph: 2-4 µs per kernel of a
decode layer, NOTES 11-26) is then paid once, and the parts' weight streams overlap instead of draining one after
the other.

This module owns which ops may share a launch (:func:`sibling_groups`), the launcher of such a group
(:class:`SiblingLauncher`) and the measured choice between it and the separate launches (:func:`faster_apart`):
each part keeps the launch configuration tuned for it alone; the group's one launch takes one ``num_warps``, so
each part's is a candidate; the separate launches are the reference every candidate must agree with.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Sequence

import torch

from ..cache import cache_key
from ..codegen.aot import compile_ahead, run_kernel
from ..codegen.loader import load_source
from ..codegen.ugraph_triton import emit_sibling_kernel, module_source
from ..timing import rotated_input_sets
from ..tune import tune
from ..ugraph import KernelGraph
from .launch import AgreesWithFirst, time_launches

log = logging.getLogger("torch_mirage")

APART = "apart"     # the candidate that launches each part on its own


def regroup(counts: Sequence[int], flat: Sequence[Any]) -> list[list[Any]]:
    """``flat`` cut into consecutive lists of ``counts`` items: each part's tensors of a sibling launch's flat list."""
    out, k = [], 0
    for n in counts:
        out.append(list(flat[k:k + n]))
        k += n
    return out


def sibling_groups(kgraph: KernelGraph, order: Sequence[int], can_join: Callable[[int], bool]) -> list[list[int]]:
    """Groups of two or more graph-defined ops of ``kgraph`` (indices, in ``order``: the order the runner walks)
    that may run as one launch at the position of the group's last op: consecutive among the ops ``can_join``
    accepts, none reading (through any chain of ops) what an earlier one of the group writes, and no op between
    the group's first and last reading it either (the earlier parts' outputs exist only once the launch ran)."""
    below: dict[int, set[int]] = {}            # op -> the ops it reads, transitively
    for i in order:
        seen: set[int] = set()
        for r in kgraph.ops[i].inputs:
            seen |= {r[0]} | below.get(r[0], set())
        below[i] = seen
    groups: list[list[int]] = []
    group: list[int] = []
    for i in order:
        op = kgraph.ops[i]
        reads_group = any(j in below[i] for j in group)
        if op.name == "customized" and can_join(i) and not reads_group:
            group.append(i)
            continue
        if reads_group or (op.name == "customized"):   # the group ends before an op that needs it or cannot join
            if len(group) > 1:
                groups.append(group)
            group = [i] if op.name == "customized" and can_join(i) else []
    if len(group) > 1:
        groups.append(group)
    return groups


class SiblingLauncher:
    """One launch of several :class:`~.compile.BlockLauncher` parts, each emitted with ``flat_pid`` at its own
    launch configuration; ``num_warps`` is the launch's. Called with each part's inputs, it returns each part's
    outputs (``outs`` / ``workspaces``: each part's, as a part's launcher takes them)."""

    def __init__(self, parts: Sequence[Any], num_warps: int, cache_dir: str, name: str):
        self.parts, self.num_warps, self.name = list(parts), num_warps, name
        kernels = [p.kernel for p in self.parts]
        self.pdl = all(p.pdl for p in self.parts)        # the parts' launchers were made for a PDL target
        self.source = module_source(kernels) + "\n\n" + emit_sibling_kernel(name, kernels, self.pdl)
        module, self.path = load_source(self.source, cache_dir, prefix="ugraph")
        self.fn = getattr(module, name)
        self.grid = (sum(p.programs for p in self.parts), 1, 1)
        self.num_stages = max(p.config.num_stages for p in self.parts)

    def __call__(self, inputs: Sequence[Sequence[torch.Tensor]], outs: Sequence[Sequence[Any]] | None = None,
                 workspaces: Sequence[Sequence[Any]] | None = None, targets: Sequence[Sequence[tuple]] | None = None
                 ) -> list[list[torch.Tensor]]:
        outs = outs or [None] * len(self.parts)
        workspaces = workspaces or [None] * len(self.parts)
        made = [p.buffers(xs[0].device, o, w) for p, xs, o, w in zip(self.parts, inputs, outs, workspaces)]
        self._launch(inputs, [o for o, _ in made], [w for _, w in made], run_kernel, targets)
        return [o for o, _ in made]

    def warmup(self, inputs: Sequence[Sequence[torch.Tensor]], targets: Sequence[Sequence[tuple]] | None = None
               ) -> None:
        """Compile the launch's kernel for ``inputs`` (and each part's ``targets``) without running it (outputs and
        workspaces as meta tensors)."""
        made = [p.buffers("meta") for p in self.parts]
        self._launch(inputs, [o for o, _ in made], [w for _, w in made],
                     lambda fn, *a, **k: compile_ahead(fn, *a, device=inputs[0][0].device, **k), targets)

    def _launch(self, inputs, outs, ws, run: Callable[..., Any], targets=None) -> None:
        args: list[Any] = []
        for p, xs, o, w, tg in zip(self.parts, inputs, outs, ws, targets or [()] * len(self.parts)):
            own, extra = p.arguments(xs, o, w, tg)
            args += own + list(extra.values())       # a part's NUM_STAGES closes its parameters
        run(self.fn, *args, grid=self.grid, num_warps=self.num_warps, num_stages=self.num_stages,
            **({"launch_pdl": True} if self.pdl else {}))


def faster_apart(parts: Sequence[Any], build: Callable[[int], SiblingLauncher],
                 inputs: Sequence[Sequence[torch.Tensor]], cache: Any = None) -> SiblingLauncher | None:
    """The sibling launch of ``parts`` (their launchers, each alone) where one times faster than the separate
    launches on these CUDA ``inputs`` (each part's), else None. ``build(num_warps)`` makes the sibling launcher
    (its parts emitted with ``flat_pid``; called from the compile pool's threads, all candidates at once); each part's
    ``num_warps`` is a candidate. Every candidate's outputs must agree with the separate launches' to the tolerance
    of the lowest precision involved."""
    counts = [len(xs) for xs in inputs]
    flat = [t for xs in inputs for t in xs]
    split = functools.partial(regroup, counts)

    warps = sorted({p.config.num_warps for p in parts})
    names = [APART] + [f"one launch, {w} warps" for w in warps]
    runs: dict[str, Callable] = {}
    sets: list = []
    compiled: dict[str, SiblingLauncher] = {}     # what the compile pool built, by candidate

    def precompile(name: str) -> None:            # in a pool thread: codegen and Triton's compile, nothing launched
        if name != APART:                         # (the parts alone are compiled already)
            launcher = compiled[name] = build(warps[names.index(name) - 1])
            launcher.warmup(inputs)

    def make(name: str) -> Callable:
        if name == APART:
            run = lambda *ts: [o for p, xs in zip(parts, split(ts)) for o in p(*xs)]     # noqa: E731
        else:
            launcher = compiled.pop(name, None) or build(warps[names.index(name) - 1])
            run = lambda *ts: [o for outs in launcher(split(ts)) for o in outs]           # noqa: E731
            run.launcher = launcher
        runs[name] = run
        return run

    def time_half(name: str, _run: Callable) -> list[float]:
        if not sets:
            sets.extend(rotated_input_sets(flat, torch.cuda.get_device_properties(flat[0].device).L2_cache_size,
                                           max_sets=16))
        return time_launches(runs[name], flat, sets)

    key = None
    if cache is not None:
        key = cache_key(kind="ugraph-siblings", graphs=[p.kernel.source for p in parts],
                        configs=[p.config.to_json() for p in parts], strides=[list(t.stride()) for t in flat],
                        device=torch.cuda.get_device_name(flat[0].device))
    tuned = tune(names, time_half, build=make, check=AgreesWithFirst(flat, "the separate launches"), cache=cache,
                 key=key, label="sibling launch", precompile=precompile)
    if tuned.winner in (None, APART):
        return None
    launcher = getattr(runs.get(tuned.winner), "launcher", None)
    return launcher if launcher is not None else build(warps[names.index(tuned.winner) - 1])
