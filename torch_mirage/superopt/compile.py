"""compile_ugraph: a μGraph → a callable that runs generated Triton kernels.

Kernel ops run in Mirage's depth order. A graph-defined op (``customized``) runs the kernel(s) that
``codegen.ugraph_triton`` emits for its block graph, with launch parameters from ``superopt.launch``
(timed on CUDA, fixed on the CPU interpreter) and the μGraph optimiser's plan of each re-tiling
(``superopt.optimise``: tile layouts, op order); pre-defined kernel ops (library matmul, elementwise,
reductions, layout) run as torch calls, as Mirage's kernel-level library ops do.

Memory planning: every kernel tensor that is neither a graph output nor a view of one — the outputs of
intermediate kernel ops and the split workspaces — gets an offset in one byte arena per call, assigned
greedily by size over the tensors' lifetimes (in depth order), so tensors whose lifetimes do not overlap
share memory.
"""
from __future__ import annotations

import functools
import logging
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..codegen import dependent_launch
from ..codegen.aot import compile_ahead, run_kernel
from ..compile_pool import run_all, workers
from ..codegen.loader import load_source
from ..codegen.ugraph_triton import (BlockKernel, CodegenError, StoreThrough, emit_block_kernel, module_source,
                                     order_by_depth)
from ..config import load
from ..context import Target
from ..timing import is_dense
from ..ugraph import BlockGraph, KernelGraph, Ref
from .arith import TorchArith
from .launch import (LaunchConfig, cached_launch, candidates, choose, combine_tiling, launch_bounds, launch_key,
                     launch_tiling, proposed, untuned_config)
from .optimise import plan_block
from .siblings import SiblingLauncher, faster_apart, regroup, sibling_groups
from .updates import store_through
from .validate import SMEM_BYTES, validate

log = logging.getLogger("torch_mirage")

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64,
          "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}
ALIGN = 256
VIEW_OPS = {"reshape", "transpose"}


def _cache_dir(cache: Any) -> str:
    if cache is not None and hasattr(cache, "root"):
        return os.path.dirname(cache.root)
    return load().cache_dir


class BlockLauncher:
    """One graph-defined op at one launch config: generated module, launch grid, output / workspace specs."""

    def __init__(self, bg: BlockGraph, config: LaunchConfig, in_ranks: Sequence[int], cache_dir: str,
                 name: str = "ugraph_kernel", target: Target | None = None, flat_pid: bool = False,
                 through: Sequence[StoreThrough] = ()):
        tiled = launch_tiling(bg, config)
        if tiled is None:
            raise CodegenError(f"launch config {config} does not re-tile the block graph (grid {bg.grid}, "
                               f"forloop_range {bg.forloop_range})")
        self.config = config
        target = Target.current() if target is None else target
        self.pdl = dependent_launch.enabled(target)     # a sibling launch of flat-pid parts waits in its own body
        self.plan = plan_block(tiled, SMEM_BYTES)
        # the combine kernel's grid: none to find where there is no combine kernel (no split, or folded in-kernel)
        combine = combine_tiling(tiled, config.split) if config.split > 1 and not config.combine_in_kernel else None
        self.kernel: BlockKernel = emit_block_kernel(tiled, list(in_ranks), name, config.split,
                                                     combine, config.prologue,
                                                     self.plan.order, self.plan.transposed, target,
                                                     sums_after=config.sums_after,
                                                     combine_in_kernel=config.combine_in_kernel,
                                                     flat_pid=flat_pid, through=through,
                                                     mask_scan=config.mask_scan, pdl=self.pdl,
                                                     **launch_bounds(bg, config))
        self.through = tuple(through)
        self.source = module_source([self.kernel])
        module, self.path = load_source(self.source, cache_dir, prefix="ugraph")
        self.fn = getattr(module, self.kernel.name)
        self.combine_fn = getattr(module, self.kernel.combine) if self.kernel.combine else None
        grid = _grid3(self.kernel.grid)
        self.launch_grid = (grid[0] * config.split, grid[1], grid[2])
        self.programs = math.prod(self.launch_grid)
        self.combine_grid = _grid3(self.kernel.combine_grid)
        self.out_specs = [(tuple(s), DTYPES[d]) for s, d in self.kernel.outputs]
        self.ws_specs = [((n * self.programs,), torch.float32) for n in self.kernel.workspaces]
        self._counters: dict[torch.device, torch.Tensor] = {}

    def counters(self, device: torch.device) -> list[torch.Tensor]:
        """The in-kernel combine's arrival counters on ``device`` (zeroed once; the kernel leaves them zero), or
        none. Kept per launcher: two launches of one launcher must not overlap in time (one stream)."""
        if not self.kernel.counters:
            return []
        if device.type == "meta":
            return [torch.empty(self.kernel.counters, dtype=torch.int32, device=device)]
        if device not in self._counters:
            self._counters[device] = torch.zeros(self.kernel.counters, dtype=torch.int32, device=device)
        return [self._counters[device]]

    def __call__(self, *inputs: torch.Tensor, outs: Sequence[torch.Tensor] | None = None,
                 workspaces: Sequence[torch.Tensor] | None = None, targets: Sequence[tuple] = ()) -> list[torch.Tensor]:
        """Run the kernel(s); ``targets``: the (destination, positions) tensors of its :class:`StoreThrough` s."""
        outs, ws = self.buffers(inputs[0].device, outs, workspaces)
        self._launch(inputs, outs, ws, run_kernel, targets)
        return outs

    def buffers(self, device: Any, outs: Sequence[Any] | None = None, workspaces: Sequence[Any] | None = None
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The launch's outputs and split workspaces: those given (an arena's views), the rest fresh on ``device``
        ("meta" for a warmup: Triton takes a fresh buffer's address as aligned)."""
        made = [[t if t is not None else torch.empty(s, dtype=d, device=device)
                 for t, (s, d) in zip(given or [None] * len(specs), specs)]
                for given, specs in ((outs, self.out_specs), (workspaces, self.ws_specs))]
        return made[0], made[1]

    def warmup(self, *inputs: torch.Tensor, targets: Sequence[tuple] = (), device: torch.device | None = None
               ) -> None:
        """Compile this launch's kernel(s) for ``inputs`` (and ``targets``, see :meth:`__call__`) without running
        them (:func:`.codegen.aot.compile_ahead`; any thread): the outputs and workspaces as meta tensors, aligned as
        the fresh or arena buffers of a call. ``device``: where it will run (default: the first input's; given
        where that is a meta tensor too)."""
        outs, ws = self.buffers("meta")
        device = inputs[0].device if device is None else device
        self._launch(inputs, outs, ws, functools.partial(compile_ahead, device=device), targets)

    def _launch(self, inputs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], ws: Sequence[torch.Tensor],
                run: Callable[..., Any], targets: Sequence[tuple] = ()) -> None:
        """``run(fn, *args, grid=, **meta)`` for the kernel (and the combine kernel after a split)."""
        pdl = {"launch_pdl": True} if self.kernel.pdl else {}
        opts = {"num_warps": self.config.num_warps, "num_stages": self.config.num_stages, **pdl}
        args, extra = self.arguments(inputs, outs, ws, targets)
        run(self.fn, *args, grid=self.launch_grid, **extra, **opts)
        if self.combine_fn is not None:
            run(self.combine_fn, *_tensor_args(outs), *self._target_args(targets), *ws, grid=self.combine_grid,
                num_warps=self.config.num_warps, **pdl)

    def _target_args(self, targets: Sequence[tuple]) -> list[Any]:
        if len(targets) != len(self.through):
            raise ValueError(f"{self.kernel.name} stores through {len(self.through)} destination(s), "
                             f"given {len(targets)}")
        return [a for dst, pos in targets for a in (dst, *dst.stride(), pos)]

    def arguments(self, inputs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], ws: Sequence[torch.Tensor],
                  targets: Sequence[tuple] = ()) -> tuple[list[Any], dict[str, int]]:
        """The kernel's positional arguments (in its parameters' order; a flat-pid part's ``lin`` left out: its
        sibling launch passes it) and its constexpr ``NUM_STAGES`` (where it loops)."""
        args = _tensor_args(inputs)
        if self.combine_fn is None:
            args += _tensor_args(outs) + self._target_args(targets)
        args += list(ws)
        if self.kernel.counters:
            args += self.counters(outs[0].device if outs else inputs[0].device)
        return args, ({"NUM_STAGES": self.config.num_stages} if self.kernel.pipelined else {})


def _tensor_args(tensors: Sequence[torch.Tensor]) -> list[Any]:
    """Each tensor followed by its strides, as a block kernel takes its inputs and outputs."""
    args: list[Any] = []
    for t in tensors:
        args += [t, *t.stride()]
    return args


def _grid3(grid: Sequence[int]) -> tuple:
    """A Triton launch grid: ``grid`` padded with 1s to three dims."""
    return tuple(grid) + (1,) * (3 - len(grid))


@dataclass
class _Step:
    index: int            # kernel op index
    launcher: BlockLauncher | None
    siblings: Any = None  # a SiblingLauncher run at this step for ``group`` (this op the group's last)
    group: tuple = ()     # the kernel ops (indices) of that sibling launch
    deferred: bool = False   # a sibling launch's earlier part: it runs with the group at the group's last step
    targets: tuple = ()      # (destination, positions) Refs of the launcher's StoreThroughs (superopt.updates)
    stored: bool = False     # an index_copy whose rows the producing kernel stored itself


@dataclass
class StepRun:
    """One kernel-level op as :meth:`CompiledUGraph.run_steps` ran it: ``fn(*inputs)`` re-runs it."""
    index: int
    op: str
    config: LaunchConfig | None
    fn: Callable[..., list]
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]


class CompiledUGraph:
    """``(*inputs) -> tuple(outputs)`` for a μGraph; ``sources`` holds the generated Triton per kernel op."""

    def __init__(self, graph: KernelGraph, steps: list[_Step], plan: dict, arena_bytes: int):
        self.graph, self.steps, self.plan, self.arena_bytes = graph, steps, plan, arena_bytes
        self.sources = [s.launcher.source for s in steps if s.launcher is not None] + \
            [s.siblings.source for s in steps if s.siblings is not None]
        self.configs = [s.launcher.config for s in steps if s.launcher is not None]
        self.sibling_launches = [list(s.group) for s in steps if s.siblings is not None]   # kernel ops per launch
        self.stored_updates = sum(s.stored for s in steps)    # index_copy ops a kernel did (superopt.updates)
        self._by_index = {s.index: s for s in steps}
        self._arith = TorchArith()

    def __call__(self, *inputs: torch.Tensor, outs: dict[int, torch.Tensor] | None = None) -> tuple:
        """The μGraph's outputs. ``outs``: tensors to write outputs into, by output index (the output's shape and
        dtype, any dense strides: the kernels store through them) — the region's own layout, where a fresh output
        would be copied into it. An output that a kernel launch does not write itself (a layout op's) is returned
        fresh: callers take the returned tensors either way."""
        env: dict[Ref, torch.Tensor] = {}
        given = {self.graph.outputs[i]: t for i, t in (outs or {}).items()}
        for step in self.run_steps(inputs, env, given):
            pass
        return tuple(env[r] for r in self.graph.outputs)

    def run_steps(self, inputs: Sequence[torch.Tensor], env: dict | None = None,
                  given: dict | None = None) -> Iterator[StepRun]:
        """Run the μGraph one kernel-level op at a time, yielding each op's run (for profiling); ``env`` receives
        every op's outputs by :class:`Ref`; ``given``: the tensors some of them are written into (by Ref)."""
        g = self.graph
        env = {} if env is None else env
        arena = torch.empty(self.arena_bytes, dtype=torch.uint8, device=inputs[0].device) if self.arena_bytes else None
        for step in self.steps:
            op = g.ops[step.index]
            if op.name == "input":
                env[Ref(step.index, 0)] = inputs[op.attrs["index"]]
                continue
            if step.deferred:
                continue
            if step.siblings is not None:
                yield self._run_siblings(step, env, arena)
                continue
            xs = [env[Ref(*r)] for r in op.inputs]
            fn = self._step_fn(step, op, arena, [(env[d], env[p]) for d, p in step.targets], given)
            res = fn(*xs)
            for j, t in enumerate(res):
                env[Ref(step.index, j)] = t
            yield StepRun(step.index, op.name, step.launcher.config if step.launcher else None, fn, xs, list(res))

    def _run_siblings(self, step: _Step, env: dict, arena: torch.Tensor | None) -> StepRun:
        """One launch for the graph-defined ops of ``step.group``: every part's outputs into ``env``."""
        g, launcher = self.graph, step.siblings
        xs = [[env[Ref(*r)] for r in g.ops[i].inputs] for i in step.group]
        outs = [[self._buffer(arena, ("out", i, j), s, d) for j, (s, d) in enumerate(p.out_specs)]
                for i, p in zip(step.group, launcher.parts)]
        ws = [[self._buffer(arena, ("ws", i, j), s, d) for j, (s, d) in enumerate(p.ws_specs)]
              for i, p in zip(step.group, launcher.parts)]
        counts = [len(x) for x in xs]
        targets = [[(env[d], env[p]) for d, p in self._by_index[i].targets] for i in step.group]

        def fn(*flat: torch.Tensor) -> list:
            return [o for res in launcher(regroup(counts, flat), outs=outs, workspaces=ws, targets=targets)
                    for o in res]
        res = fn(*[t for x in xs for t in x])
        k = 0
        for i, p in zip(step.group, launcher.parts):
            for j in range(len(p.out_specs)):
                env[Ref(i, j)] = res[k]
                k += 1
        return StepRun(step.index, "siblings", step.launcher.config, fn, [t for x in xs for t in x], res)

    def _step_fn(self, step: _Step, op: Any, arena: torch.Tensor | None, targets: list,
                 given: dict | None = None) -> Callable[..., list]:
        if step.launcher is not None:
            outs = [self._output(given, arena, step.index, j, s, d) for j, (s, d) in enumerate(step.launcher.out_specs)]
            ws = [self._buffer(arena, ("ws", step.index, j), s, d) for j, (s, d) in enumerate(step.launcher.ws_specs)]
            return lambda *xs: step.launcher(*xs, outs=outs, workspaces=ws, targets=targets)
        if op.name == "index_copy" and self.graph.ops[op.inputs[0][0]].name == "input":
            if step.stored:     # the producing kernel wrote the rows: the destination is the result
                return lambda dst, positions, src: [dst]
            return lambda dst, positions, src: [dst.index_copy_(op.attrs["dim"], positions, src.to(dst.dtype))]
        if op.spec.layout is not None:
            return lambda *xs: [op.spec.layout(*xs, **op.attrs)]
        fn = getattr(self._arith, op.spec.arith)
        return lambda *xs: [fn(xs, **op.attrs) if op.spec.arity is None else fn(*xs, **op.attrs)]

    def _output(self, given: dict | None, arena, index: int, j: int, shape, dtype) -> torch.Tensor | None:
        """Where op ``index`` writes its output ``j``: the tensor ``given`` holds for it where that fits (the shape
        and dtype, dense strides), else the arena's view (:meth:`_buffer`)."""
        t = (given or {}).get(Ref(index, j))
        if t is not None and tuple(t.shape) == tuple(shape) and t.dtype == dtype and is_dense(t):
            return t
        return self._buffer(arena, ("out", index, j), shape, dtype)

    def _buffer(self, arena, key, shape, dtype) -> torch.Tensor | None:
        """The planned arena view for ``key``; None (the launcher allocates) for outputs."""
        off = self.plan.get(key)
        if off is None or arena is None:
            return None
        n = _nbytes(shape, dtype)
        return arena[off:off + n].view(dtype).view(shape)


def _nbytes(shape, dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


def plan_memory(graph: KernelGraph, steps: list[_Step]) -> tuple[dict, int]:
    """Arena offsets for intermediate kernel tensors and workspaces: greedy by size over lifetimes."""
    order = [s.index for s in steps]
    pos = {i: k for k, i in enumerate(order)}
    for s in steps:             # a sibling launch's parts run (read, write) at the group's last step
        for i in s.group:
            pos[i] = pos[s.index]
    root: dict[Ref, Any] = {}
    last: dict[Any, int] = {}
    buffers: dict[Any, tuple[int, int]] = {}     # key -> (bytes, first position)
    for s in steps:
        op = graph.ops[s.index]
        if s.launcher is not None:
            for j, (shape, dt) in enumerate(s.launcher.out_specs):
                key = ("out", s.index, j)
                root[Ref(s.index, j)] = key
                buffers[key] = (_nbytes(shape, dt), pos[s.index])
                last[key] = pos[s.index]
            for j, (shape, dt) in enumerate(s.launcher.ws_specs):
                key = ("ws", s.index, j)
                buffers[key] = (_nbytes(shape, dt), pos[s.index])
                last[key] = pos[s.index]
        elif op.name in VIEW_OPS and Ref(*op.inputs[0]) in root:
            root[Ref(s.index, 0)] = root[Ref(*op.inputs[0])]
        for r in op.inputs:
            if Ref(*r) in root:
                last[root[Ref(*r)]] = max(last[root[Ref(*r)]], pos[s.index])
    for r in graph.outputs:            # outputs (and what they view) are fresh tensors, never arena memory
        key = root.get(Ref(*r))
        if key is not None:
            buffers.pop(key, None)
    placed: list[tuple[int, int, int, int]] = []    # (offset, bytes, first, last)
    plan: dict = {}
    for key, (n, first) in sorted(buffers.items(), key=lambda kv: -kv[1][0]):
        off = 0
        for o, m, f, l in sorted(placed):
            if f <= last[key] and first <= l and off < o + m and o < off + n:
                off = _align(o + m)
        # a second pass: moving past one block may collide with an earlier one
        while any(f <= last[key] and first <= l and off < o + m and o < off + n for o, m, f, l in placed):
            off = _align(max(o + m for o, m, f, l in placed
                             if f <= last[key] and first <= l and off < o + m and o < off + n))
        placed.append((off, n, first, last[key]))
        plan[key] = off
    return plan, _align(max((o + m for o, m, _, _ in placed), default=0))


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def op_arguments(kgraph: KernelGraph, op: Any, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors kernel op ``op`` of ``kgraph`` reads, given the μGraph's ``inputs``: each an input or a chain of
    layout ops over one (reshape, slice, transpose), evaluated as ``compile_ugraph`` does (views, no copy). For
    timing or testing one graph-defined op alone (``BlockLauncher(op.body, ...)(*op_arguments(...))``)."""
    def value(r) -> torch.Tensor:
        src = kgraph.ops[r[0]]
        if src.name == "input":
            return inputs[src.attrs["index"]]
        if src.spec.layout is None:
            raise ValueError(f"op_arguments: {src.name} is not a view of an input; run the whole μGraph instead")
        return src.spec.layout(value(src.inputs[0]), **src.attrs)
    return [value(r) for r in op.inputs]


def compile_ugraph(kgraph: KernelGraph, example_inputs: Sequence[torch.Tensor], *, cache: Any = None,
                   cache_dir: str | None = None, tune: bool | None = None, limit: int = 4,
                   target: Target | None = None, propose: Callable[..., list] = candidates,
                   siblings: bool | None = None, label: str = "ugraph",
                   warmups: dict[str, Callable[[], None]] | None = None) -> CompiledUGraph:
    """Generated Triton for every graph-defined op of ``kgraph``; launch configs tuned on ``example_inputs``
    when they are CUDA tensors (``tune=False``: the μGraph's own schedule), among those ``propose`` lists
    (:func:`.launch.candidates`, or :func:`.launch.streaming_candidates` for a weight-streaming kernel). Returns
    ``callable(*tensors)``. Sources go under ``cache_dir``'s ``kernels/`` (a claimer passes its configuration's;
    default: the disk cache's directory, else the configuration read from the environment). ``target``: where the
    kernels run (the compile context's; default: :meth:`Target.current`), which picks CUDA-only instruction forms.
    ``siblings``: graph-defined ops that read nothing the others write run as one launch
    (:mod:`.siblings`) — where tuned, only where that times faster than their separate launches (``None``); always
    (``True``, each part's launch as tuned alone); never (``False``). ``label``: what the kernels' names start
    with (``<label>_op<i>``, ``<label>_siblings_<i>_<j>``: a profile names the μGraph, e.g. ``weight_streaming``).
    ``warmups``: where given, the compiles ahead of the kernels rebuilt last (those that store a cache write's rows,
    :func:`_store_through`) are added to it by name for the caller to run with others (the alternatives of one
    program, in one round of the compile pool) rather than run here."""
    target = Target.current() if target is None else target
    label = _kernel_label(label)
    _check_inputs(kgraph, example_inputs)
    cache_dir = cache_dir or _cache_dir(cache)
    tune = example_inputs[0].is_cuda if tune is None else tune
    steps: list[_Step] = []
    env: dict[Ref, torch.Tensor] = {}
    arith = TorchArith()
    for i in order_by_depth(kgraph, range(len(kgraph.ops))):
        op = kgraph.ops[i]
        if op.name == "input":
            env[Ref(i, 0)] = example_inputs[op.attrs["index"]]
            steps.append(_Step(i, None))
            continue
        xs = [env[Ref(*r)] for r in op.inputs]
        launcher = None
        if op.name == "customized":
            ranks = [x.dim() for x in xs]
            name = f"{label}_op{i}"

            def build(cfg: LaunchConfig, bg=op.body, ranks=ranks, name=name) -> BlockLauncher:
                return BlockLauncher(bg, cfg, ranks, cache_dir, name, target)
            cfg = choose(op.body, build, xs, cache=cache, limit=limit, propose=propose) if tune \
                else untuned_config(op.body)
            launcher = build(cfg)
            log.info("torch_mirage: μGraph op %d uses %s (%s)", i, cfg, launcher.path)
            res = launcher(*xs)
        elif op.spec.layout is not None:
            res = [op.spec.layout(*xs, **op.attrs)]
        else:
            fn = getattr(arith, op.spec.arith)
            res = [fn(xs, **op.attrs) if op.spec.arity is None else fn(*xs, **op.attrs)]
        for j, t in enumerate(res):
            env[Ref(i, j)] = t
        steps.append(_Step(i, launcher))
    if siblings is not False and (siblings or tune):
        _join_siblings(kgraph, steps, env, cache, cache_dir, target, timed=not siblings, label=label)
    _store_through(kgraph, steps, env, cache_dir, target, label, warmups)
    plan, size = plan_memory(kgraph, steps)
    return CompiledUGraph(kgraph, steps, plan, size)


def _kernel_label(label: str) -> str:
    """What a μGraph's kernel names start with: ``label`` as a Python identifier."""
    label = re.sub(r"\W", "_", label) or "ugraph"
    return label if label[0].isalpha() else "ugraph_" + label


def _check_inputs(kgraph: KernelGraph, example_inputs: Sequence[torch.Tensor]) -> None:
    """``kgraph`` is valid and ``example_inputs`` are of its inputs' shapes and dtypes, else an error saying which."""
    validate(kgraph)
    ins = kgraph.inputs
    if len(example_inputs) != len(ins):
        raise ValueError(f"compile_ugraph: μGraph takes {len(ins)} inputs, got {len(example_inputs)}")
    for op, x in zip(ins, example_inputs):
        if tuple(x.shape) != tuple(op.attrs["shape"]) or DTYPES.get(op.attrs["dtype"]) != x.dtype:
            raise ValueError(f"compile_ugraph: input {op.attrs['index']} is {tuple(x.shape)} {x.dtype}, the μGraph "
                             f"was built for {tuple(op.attrs['shape'])} {op.attrs['dtype']}; rebuild it for these")


def tuning_compiles(kgraph: KernelGraph, example_inputs: Sequence[torch.Tensor], *, cache: Any = None,
                    cache_dir: str | None = None, limit: int = 4, target: Target | None = None,
                    propose: Callable[..., list] = candidates, label: str = "ugraph",
                    device: torch.device | None = None) -> dict[str, Callable[[], None]]:
    """Jobs compiling, without running, every launch candidate that :func:`compile_ugraph` will time for
    ``kgraph`` on ``example_inputs`` (ops whose choice ``cache`` holds left out), by name. A caller runs those of
    all its ops — and of several μGraphs — in one round of the compile pool (:func:`~..compile_pool.run_all`),
    where each op's tuning would otherwise wait for a round of its own (its inputs are the op before it's
    outputs); the tuning rounds after it then find their kernels compiled. ``device``: the CUDA device the kernels
    are for, where the examples are meta tensors (of the real ones' shapes, dtypes and strides: a kernel compiled
    for them takes their addresses as aligned, as a fresh buffer's are); default: the examples'. Empty off CUDA,
    and for a μGraph :func:`compile_ugraph` would reject (it says why)."""
    device = device or (example_inputs[0].device if example_inputs else None)
    if device is None or device.type != "cuda":
        return {}
    try:
        placeholders = op_input_placeholders(kgraph, example_inputs)
    except ValueError:
        return {}
    label, cache_dir = _kernel_label(label), cache_dir or _cache_dir(cache)
    jobs: dict[str, Callable[[], None]] = {}
    for i, xs in placeholders.items():
        body = kgraph.ops[i].body
        if cached_launch(body, cache, launch_key(body, xs, device, limit, propose)) is not None:
            continue
        configs = proposed(body, device, limit, propose)
        name, ranks = f"{label}_op{i}", [x.dim() for x in xs]
        for config_name, config in configs.items():
            jobs[f"{name} {config_name}"] = functools.partial(_compile_launch, body, config, ranks, cache_dir, name,
                                                              target, xs, device)
    return jobs


def op_input_placeholders(kgraph: KernelGraph, example_inputs: Sequence[torch.Tensor]) -> dict[int, list]:
    """Each graph-defined op's inputs (by op index) as :func:`compile_ugraph` passes them, without running
    anything: the μGraph's own inputs are ``example_inputs``, every other tensor a meta tensor of the shape, dtype
    and strides its producer gives it (views of them are views) — what Triton specialises a kernel on, besides
    alignment, which a fresh buffer has. Outside any fake mode the caller is in (the build stage runs under
    AOTAutograd's: a kernel-level reshape of a meta tensor there raised, and the weight-streaming μGraphs of a
    decode graph compiled none of their candidates ahead, H100 11-28)."""
    _check_inputs(kgraph, example_inputs)
    env: dict[Ref, torch.Tensor] = {}
    out: dict[int, list] = {}
    with unset_fake_temporarily():
        for i in order_by_depth(kgraph, range(len(kgraph.ops))):
            op = kgraph.ops[i]
            if op.name == "input":
                env[Ref(i, 0)] = example_inputs[op.attrs["index"]]
                continue
            xs = [env[Ref(*r)] for r in op.inputs]
            if op.name == "customized":
                out[i] = xs
            if op.name != "customized" and op.spec.layout is not None:
                res = [op.spec.layout(*xs, **op.attrs)]
            else:
                res = [torch.empty(shape, dtype=DTYPES[dtype], device="meta")
                       for shape, dtype in zip(op.shapes, op.dtypes)]
            for j, t in enumerate(res):
                env[Ref(i, j)] = t
    return out


def _compile_launch(bg: BlockGraph, config: LaunchConfig, ranks: list[int], cache_dir: str, name: str,
                    target: Target | None, xs: list[torch.Tensor], device: torch.device) -> None:
    BlockLauncher(bg, config, ranks, cache_dir, name, target).warmup(*xs, device=device)


def _store_through(kgraph: KernelGraph, steps: list[_Step], env: dict, cache_dir: str, target: Target,
                   label: str = "ugraph", warmups: dict[str, Callable[[], None]] | None = None) -> None:
    """The kernels that store a cache write's rows themselves (:func:`.updates.store_through`), rebuilt at the launch
    configuration tuned without it (a sibling launch with its parts): each such ``index_copy`` launches nothing.
    Their compiles ahead run here in the compile pool, or go to ``warmups`` (named after ``label``) where given."""
    found = store_through(kgraph)
    if not found:
        return
    by_index = {s.index: s for s in steps}
    per_op: dict[int, list] = {}
    for ts in found:
        if by_index[ts.op].launcher is not None:
            per_op.setdefault(ts.op, []).append(ts)

    def launcher(i: int, flat_pid: bool = False) -> BlockLauncher:
        old = by_index[i].launcher
        ranks = [env[Ref(*r)].dim() for r in kgraph.ops[i].inputs]
        return BlockLauncher(kgraph.ops[i].body, old.config, ranks, cache_dir, old.kernel.name, target, flat_pid,
                             [ts.through for ts in per_op.get(i, [])])

    def ins(i: int) -> list:                      # op i's example inputs
        return [env[Ref(*r)] for r in kgraph.ops[i].inputs]

    def targets(i: int) -> list:                  # and its (destination, positions) examples
        return [(env[ts.dst], env[ts.positions]) for ts in per_op.get(i, [])]
    jobs: dict[str, Callable[[], None]] = {}      # the rebuilt kernels, compiled ahead in the pool at once
    for s in steps:                               # a sibling launch: its parts rebuilt with their stores
        if s.siblings is not None and any(i in per_op for i in s.group):
            s.siblings = SiblingLauncher([launcher(i, flat_pid=True) for i in s.group], s.siblings.num_warps,
                                         cache_dir, s.siblings.name)
            jobs[s.siblings.name] = functools.partial(s.siblings.warmup, [ins(i) for i in s.group],
                                                      [targets(i) for i in s.group])
            log.info("torch_mirage: μGraph ops %s store their updates in one launch (%s)", s.group, s.siblings.path)
    for i, items in per_op.items():
        step = by_index[i]
        step.targets = tuple((ts.dst, ts.positions) for ts in items)
        for ts in items:
            by_index[ts.update].stored = True
        if not step.deferred and step.siblings is None:     # a launch of its own
            step.launcher = launcher(i)
            jobs[f"op{i}"] = functools.partial(step.launcher.warmup, *ins(i), targets=targets(i))
            log.info("torch_mirage: μGraph op %d stores %d update(s) itself (%s)", i, len(items), step.launcher.path)
    if warmups is not None:
        warmups.update({f"{label} {name}": job for name, job in jobs.items()})
    elif env and next(iter(env.values())).is_cuda:
        run_all(list(jobs), lambda name: jobs[name](), workers())


def _join_siblings(kgraph: KernelGraph, steps: list[_Step], env: dict, cache: Any, cache_dir: str,
                   target: Target, timed: bool, label: str = "ugraph") -> None:
    """Each group of :func:`.siblings.sibling_groups` made one launch at its last step (``timed``: only where the
    launch times faster than the parts apart on ``env``'s example tensors; else at the first part's ``num_warps``).
    A part whose split folds in a combine kernel (two launches) does not join."""
    by_index = {s.index: s for s in steps}

    def can_join(i: int) -> bool:
        launcher = by_index[i].launcher
        return launcher is not None and launcher.combine_fn is None
    for group in sibling_groups(kgraph, [s.index for s in steps], can_join):
        parts = [by_index[i].launcher for i in group]
        xs = [[env[Ref(*r)] for r in kgraph.ops[i].inputs] for i in group]
        name = f"{label}_siblings_" + "_".join(map(str, group))

        def build(num_warps: int, group=group, parts=parts, xs=xs, name=name) -> SiblingLauncher:
            flat = [BlockLauncher(kgraph.ops[i].body, p.config, [x.dim() for x in xx], cache_dir, p.kernel.name,
                                  target, flat_pid=True) for i, p, xx in zip(group, parts, xs)]
            return SiblingLauncher(flat, num_warps, cache_dir, name)
        try:
            joined = faster_apart(parts, build, xs, cache) if timed else build(parts[0].config.num_warps)
        except Exception as e:    # the parts still run apart: nothing is lost
            if not timed:
                raise
            log.info("torch_mirage: sibling launch of μGraph ops %s failed (%s: %s); launched apart", group,
                     type(e).__name__, e)
            continue
        if joined is None:
            continue
        log.info("torch_mirage: μGraph ops %s run as one launch (%s)", group, joined.path)
        for i in group[:-1]:
            by_index[i].deferred = True
        by_index[group[-1]].siblings, by_index[group[-1]].group = joined, tuple(group)
