"""CUDA-graph wrapping of a compiled graph's boxed callable.

:func:`cuda_graph_blocker` says why a graph must not be captured (or ``None``);
:class:`CudaGraphRunner` warms the callable up on a side stream, captures it
into static input buffers on first call and replays it afterwards. Outputs are
cloned out of the graph's static memory, so a later replay never overwrites
what an earlier call returned. Called while the stream is being captured (the
caller records its own CUDA graph), it runs the callable plainly.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..capture.host_scalars import is_symbolic
from ..timing import side_stream
from .static_sizes import SEEN_SIZES

log = logging.getLogger("torch_mirage")

_HOST_SYNC = {"aten._local_scalar_dense.default", "aten.item.default", "aten.nonzero.default",
              "aten.equal.default", "aten._assert_async.msg"}


def _arg(node: torch.fx.Node, name: str) -> Any:
    """The value of a node's schema argument ``name`` (positional, keyword, or the schema's default)."""
    for position, spec in enumerate(node.target._schema.arguments):
        if spec.name == name:
            if position < len(node.args):
                return node.args[position]
            return node.kwargs.get(name, spec.default_value)
    raise KeyError(name)


def _is_zero(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


def draws_random_numbers(node: torch.fx.Node) -> bool:
    """Whether an op really advances the RNG. Ops tagged ``nondeterministic_seeded`` count, except where their
    only randomness is a dropout that is off: attention (every ``scaled_dot_product_*attention*`` variant) at
    ``dropout_p == 0``, and ``dropout`` / ``native_dropout`` with ``train=False`` or ``p == 0`` (inference)."""
    if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    names = {spec.name for spec in node.target._schema.arguments}
    if "dropout_p" in names:
        return not _is_zero(_arg(node, "dropout_p"))
    if node.target._schema.name in ("aten::native_dropout", "aten::dropout") and {"p", "train"} <= names:
        return not (_arg(node, "train") is False or _is_zero(_arg(node, "p")))
    return True


def op_blocker(node: torch.fx.Node, device_type: str = "cuda") -> str | None:
    """Why one node of an inference ATen graph cannot be replayed from a CUDA graph, or ``None``: a host sync,
    real randomness (a replay would repeat the captured numbers), a write into a graph input that is not
    reapplied, or a tensor made on another device than ``device_type``."""
    if node.op != "call_function":
        return None
    name = str(node.target)
    if name in _HOST_SYNC:
        return (f"host sync ({name}): the graph reads a tensor's value on the host; keep such reads (.item(), "
                f"data-dependent shapes) outside the compiled region")
    if draws_random_numbers(node):
        return (f"random op ({name}): a replay would repeat the captured random numbers; model.eval() turns "
                f"dropout off, attention needs dropout_p=0")
    val = node.meta.get("val")
    for v in (val if isinstance(val, (tuple, list)) else [val]):
        if isinstance(v, torch.Tensor) and v.device.type != device_type:
            return (f"{v.device.type.upper()} tensor produced by {name}: move that input or tensor to the "
                    f"{device_type} device")
    return None


def graph_blocker(gm: torch.fx.GraphModule, device_type: str = "cuda") -> str | None:
    """The first node's :func:`op_blocker` reason, or ``None`` when every node may be captured."""
    for node in gm.graph.nodes:
        why = op_blocker(node, device_type)
        if why is not None:
            return why
    return None


def _on_device(val: Any, device: torch.device) -> Any:
    """``val`` (a node's ``meta['val']``) as if made on ``device``: same shape, strides and dtype."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(val, (tuple, list)):
        return type(val)(_on_device(v, device) for v in val)
    if isinstance(val, FakeTensor):
        meta = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
        return FakeTensor(val.fake_mode, meta, device)
    if isinstance(val, torch.Tensor):
        return val.to(device)
    return val


def move_constants_to_device(gm: torch.fx.GraphModule, device: torch.device | str) -> list[str]:
    """Move trace-time constants (``_tensor_constant*`` attributes: ``torch.tensor(...)`` in a model, lifted by
    AOTAutograd with ``aten.lift_fresh_copy``) that live on another device to ``device``, once, at compile time,
    so a CUDA graph need not refuse the graph for them. What is computed from constants alone follows them (its
    ``meta['val']`` moves too); an op that names its own device keeps it. A constant that reaches a host read
    (``.item()``) stays where it is: moving it would make that read a device sync. Returns the attributes moved.
    """
    device = torch.device(device)
    derived: set[torch.fx.Node] = set()
    candidates: dict[torch.fx.Node, torch.Tensor] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = _attribute(gm, node.target)
            if (isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)
                    and value.device != device):
                candidates[node] = value
                derived.add(node)
        elif node.op == "call_function" and "device" not in node.kwargs:   # an explicit device ends the chain
            inputs = node.all_input_nodes
            if inputs and all(a in derived for a in inputs):
                derived.add(node)
    blocked = {n for n in derived if n.op == "call_function" and str(n.target) in _HOST_SYNC}
    keep = set()
    for node in blocked:   # every constant upstream of a host read stays put
        stack = [node]
        while stack:
            n = stack.pop()
            if n not in keep:
                keep.add(n)
                stack.extend(a for a in n.all_input_nodes if a in derived)
    moved = []
    for node in gm.graph.nodes:
        if node not in derived or node in keep:
            continue
        if node in candidates:
            with unset_fake_temporarily():   # AOTAutograd compiles under a fake mode: make a real tensor
                _set_attribute(gm, node.target, candidates[node].to(device))
            moved.append(node.target)
        if "val" in node.meta:
            node.meta["val"] = _on_device(node.meta["val"], device)
    if moved:
        gm.recompile()
        log.debug("torch_mirage: trace-time constants moved to %s: %s", device, ", ".join(moved))
    return moved


def _attribute(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _set_attribute(gm: torch.nn.Module, target: str, value: torch.Tensor) -> None:
    *path, name = target.split(".")
    owner: Any = gm
    for part in path:
        owner = getattr(owner, part)
    if name in getattr(owner, "_buffers", {}):
        owner._buffers[name] = value
    else:
        setattr(owner, name, value)


def input_device(example_inputs: Sequence[Any]) -> torch.device | None:
    """The one non-CPU device every tensor input lives on, or ``None``."""
    devices = {x.device for x in example_inputs if isinstance(x, torch.Tensor)}
    return next(iter(devices)) if len(devices) == 1 and next(iter(devices)).type != "cpu" else None


def symbolic_sizes(example_inputs: Sequence[Any]) -> bool:
    """Whether a graph's example inputs carry symbolic values (a SymInt input, or a tensor of symbolic size):
    Dynamo's ``dynamic=True``, ``mark_dynamic``, or its automatic dynamic shapes after a second size."""
    return any(is_symbolic(x) for x in example_inputs)


def cuda_graph_blocker(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], kind: str) -> str | None:
    """Why this ATen graph cannot be captured, or ``None`` when it can (a graph of symbolic sizes: once per
    size, :class:`SizedCudaGraphs`)."""
    if kind != "inference":
        return f"{kind} graph: capture only for inference graphs"
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    others = sorted({type(x).__name__ for x in example_inputs
                     if not isinstance(x, (torch.Tensor, int, float, bool, torch.SymInt))})
    if others:
        return f"inputs of a kind a CUDA graph cannot replay ({', '.join(others)})"
    if not tensors:
        return "inputs not all CUDA tensors (no tensor input)"
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    for i, t in enumerate(example_inputs):
        if isinstance(t, torch.Tensor) and t.device.type != "cuda":
            name = f" ({names[i]})" if i < len(names) else ""
            return (f"inputs not all CUDA tensors: input {i}{name} is a {t.device.type.upper()} "
                    f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}; create it on the GPU (e.g. a "
                    f"cache_position or mask tensor passed to the model)")
    return graph_blocker(gm, "cuda")


def copy_all(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for every ``(dst, src)`` pair, in one fused launch where torch can (``_foreach_copy_``):
    a decode step copies its few small user inputs (ids, positions, cache positions) into the graph's buffers,
    one launch each before (H100 profile, 11-25: 5 extra launches per HF llama decode step)."""
    if len(pairs) > 1:
        dsts, srcs = zip(*pairs)
        try:
            torch._foreach_copy_(list(dsts), list(srcs))
            return
        except (AttributeError, RuntimeError, TypeError):   # an older torch, or pairs it cannot fuse
            pass
    for dst, src in pairs:
        dst.copy_(src)


class ReplayInputs:
    """What one replay of a captured graph does with a call's inputs, decided per call from indices fixed at
    capture: the inputs captured in place (``static``) must be where they were at capture — checked in one C++
    call where torch has it (``_tensors_data_ptrs_at_indices_equal``, as Inductor's CUDA-graph trees do), else in
    Python over those inputs only —, the non-tensor inputs equal, and the other tensors are copied in (and those
    written, back out). An HF decode step passes about 300 tensors, nearly all parameters and caches: a Python loop
    over every input cost about 75 µs a call on a 2-core CPU."""

    def __init__(self, static_inputs: Sequence[Any], static_idx: set[int], mutated_idx: set[int]):
        self.static_inputs = list(static_inputs)
        tensor = [isinstance(a, torch.Tensor) for a in static_inputs]
        self.in_place = [i for i, t in enumerate(tensor) if t and i in static_idx]
        self.copied = [i for i, t in enumerate(tensor) if t and i not in static_idx]
        self.copied_back = [i for i in self.copied if i in mutated_idx]
        self.scalars = [i for i, t in enumerate(tensor) if not t]
        self.ptrs = [a.data_ptr() if t else None for a, t in zip(static_inputs, tensor)]
        self._native = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)

    def scalars_equal(self, args: Sequence[Any]) -> bool:
        """Every non-tensor input as at capture (Dynamo normally guards these: never replay stale values)."""
        return all(args[i] == self.static_inputs[i] for i in self.scalars)

    def in_place_unmoved(self, args: Sequence[Any]) -> bool:
        """Every input captured in place is still at its captured address."""
        if self._native is not None:
            try:
                if self._native(list(args), self.ptrs, self.in_place):
                    return True
            except (RuntimeError, TypeError):     # a signature this torch does not have: the Python check
                self._native = None
        unmoved = all(args[i].data_ptr() == self.ptrs[i] for i in self.in_place)
        if unmoved and self._native is not None:  # it disagrees with data_ptr(): never re-record forever on it
            log.debug("torch_mirage: torch's data-pointer check disagrees with data_ptr(); checking in Python")
            self._native = None
        return unmoved

    def moved(self, args: Sequence[Any]) -> list[int]:
        """The inputs captured in place that are no longer at their captured address."""
        return [i for i in self.in_place if args[i].data_ptr() != self.ptrs[i]]

    def copies(self, args: Sequence[Any]) -> tuple[list[tuple], list[tuple]]:
        """``(copy_in, copy_back)`` pairs ``(dst, src)``: each copied input not already the static buffer itself."""
        copy_in = [(self.static_inputs[i], args[i]) for i in self.copied
                   if args[i].data_ptr() != self.ptrs[i]]
        copy_back = [(args[i], self.static_inputs[i]) for i in self.copied_back
                     if args[i].data_ptr() != self.ptrs[i]]
        return copy_in, copy_back


class CudaGraphRunner:
    """Boxed callable: ``runner(list_of_args) -> list_of_outputs``.

    Inputs at ``static_input_indices`` (parameters, buffers, persistent KV caches: AOTAutograd's static inputs)
    are captured in place, as Inductor's CUDA-graph trees do: no copy per call, and a graph that writes one (a KV
    cache update) writes the caller's tensor itself. Should such an input's storage move (``model.to``,
    ``load_state_dict``), the graph is recorded again on the new storage rather than replayed on stale memory; one
    that moves again is copied like a user input from then on (recorded once more).
    Every other tensor input is copied into a static buffer before each replay, and those among
    ``mutated_input_indices`` are copied back after it, so the caller sees the write. Warm-up runs happen on the
    real in-place inputs: what they write is saved first and put back after each, so the caller's state changes
    once per call.
    """

    def __init__(self, fn: Callable[[list], Any], static_input_indices: Sequence[int] = (), warmup: int = 2,
                 on_disable: Callable[[str], None] | None = None, mutated_input_indices: Sequence[int] = ()):
        self.fn = fn
        self.on_disable = on_disable
        self.static_idx = set(static_input_indices)
        self.mutated_idx = set(mutated_input_indices)
        self.warmup = warmup
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_inputs: list[Any] = []
        self.replay_inputs: ReplayInputs | None = None
        self.static_outputs: Any = None
        self.disabled_reason: str | None = None
        self.recordings = 0
        self.moved: set[int] = set()   # static inputs seen at a second address

    def copied_inputs(self, args: Sequence[Any]) -> list[int]:
        """Positions of the inputs copied into static buffers on each replay (tensors not captured in place)."""
        return [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and i not in self.static_idx]

    def _capture(self, args: list) -> None:
        copied = set(self.copied_inputs(args))
        self.static_inputs = [a.clone() if i in copied else a for i, a in enumerate(args)]
        in_place_writes = [(a, a.clone()) for i, a in enumerate(args) if i in self.mutated_idx and i not in copied]

        def restore() -> None:
            for t, saved in in_place_writes:
                t.copy_(saved)

        stream = side_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):   # Triton JIT and autotuning happen here, outside capture
                self.fn(list(self.static_inputs))
                restore()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.static_outputs = self.fn(list(self.static_inputs))
        self.graph = graph
        self.replay_inputs = ReplayInputs(self.static_inputs, self.static_idx, self.mutated_idx)
        self.recordings += 1

    def __call__(self, args: list) -> Any:
        if self.disabled_reason is not None or torch.cuda.is_current_stream_capturing():
            # inside someone else's capture (a caller's CUDA graph, or our own timing): be captured as plain
            # kernels there rather than nest a graph of our own
            return self.fn(args)
        if self.graph is None:
            try:
                self._capture(args)
            except Exception as e:  # capture failed: run uncaptured from now on, say why
                self.disabled_reason = f"capture failed: {type(e).__name__}: {e}"
                log.debug("torch_mirage: CUDA graph disabled for this graph: %s", self.disabled_reason)
                if self.on_disable is not None:
                    self.on_disable(self.disabled_reason)
                self.graph = None
                return self.fn(args)
        plan = self.replay_inputs
        if not plan.scalars_equal(args):
            return self.fn(args)
        if not plan.in_place_unmoved(args):
            # an input captured in place moved: record again on the new storage, never replay stale memory; one
            # that moves a second time is not stable after all, and is copied like a user input from then on
            for i in plan.moved(args):
                if i in self.moved:
                    self.static_idx.discard(i)
                    log.debug("torch_mirage: input %d moved twice; copied into the CUDA graph from now on", i)
                self.moved.add(i)
            self.graph = None
            return self(args)
        copy_in, copy_back = plan.copies(args)
        copy_all(copy_in)
        self.graph.replay()
        copy_all(copy_back)
        args.clear()
        return [o.clone() if isinstance(o, torch.Tensor) else o for o in self.static_outputs]


class SizedCudaGraphs:
    """Boxed callable for a graph of symbolic sizes: one :class:`CudaGraphRunner` per input size, as Inductor's
    CUDA-graph trees record one graph per size. A call's size is its non-tensor inputs (Dynamo passes every size
    symbol as one) and the shapes and strides of the tensors copied into the graph (the tensors captured in place,
    parameters and caches, are checked by their runner). A size is recorded at its ``record_at``-th call (2 by
    default: when it comes back, as Inductor's trees warm a new size up uncaptured first) and runs uncaptured
    before that: a size met once — a KV cache that grows by a token a step, as transformers' DynamicCache does —
    costs one plain run instead of two warm-up runs, a capture and copies of its inputs, and holds no memory of
    its own. Up to ``limit`` sizes are recorded (each has its own memory for the graph's intermediates); a later
    size runs uncaptured, said once in the log."""

    def __init__(self, fn: Callable[[list], Any], static_input_indices: Sequence[int] = (), limit: int = 8,
                 on_disable: Callable[[str], None] | None = None, mutated_input_indices: Sequence[int] = (),
                 runner: Callable[..., Callable[[list], Any]] | None = None, record_at: int = 2):
        self.fn = fn
        self.static_idx = set(static_input_indices)
        self.mutated_idx = tuple(mutated_input_indices)
        self.limit = limit
        self.record_at = max(1, record_at)
        self.on_disable = on_disable
        self.make_runner = runner or CudaGraphRunner
        self.runners: dict[tuple, Callable[[list], Any]] = {}
        self.calls: dict[tuple, int] = {}        # calls of each size not recorded yet
        self.sized: list[int] | None = None      # positions whose value or shape make the size
        self.full_logged = False

    def size_of(self, args: Sequence[Any]) -> tuple:
        if self.sized is None:
            self.sized = [i for i, a in enumerate(args) if not isinstance(a, torch.Tensor) or i not in self.static_idx]
        return tuple((tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a
                     for a in (args[i] for i in self.sized))

    def __call__(self, args: list) -> Any:
        key = self.size_of(args)
        runner = self.runners.get(key)
        if runner is None:
            if len(self.runners) >= self.limit:
                if not self.full_logged:
                    self.full_logged = True
                    log.info("torch_mirage: a graph of symbolic sizes has CUDA graphs for %d sizes "
                             "(MIRAGE_CUDA_GRAPH_SIZES); later sizes run without one", self.limit)
                return self.fn(args)
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                return self.fn(args)   # in the caller's CUDA graph: plain kernels there, no call counted
            if len(self.calls) >= SEEN_SIZES:   # a long history of one-shot sizes is forgotten, as StaticSizes does
                self.calls.clear()
            seen = self.calls[key] = self.calls.get(key, 0) + 1
            if seen < self.record_at:
                return self.fn(args)   # not come back yet (MIRAGE_CUDA_GRAPH_RECORD_AT)
            del self.calls[key]
            runner = self.runners[key] = self.make_runner(self.fn, tuple(self.static_idx), on_disable=self.on_disable,
                                                          mutated_input_indices=self.mutated_idx)
        return runner(args)
