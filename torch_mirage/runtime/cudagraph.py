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

from .choose import draws_random_numbers

log = logging.getLogger("torch_mirage")

_HOST_SYNC = {"aten._local_scalar_dense.default", "aten.item.default", "aten.nonzero.default",
              "aten.equal.default", "aten._assert_async.msg"}


def cuda_graph_blocker(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], kind: str,
                       static_input_indices: Sequence[int] = ()) -> str | None:
    """Why this ATen graph cannot be captured, or ``None`` when it can.

    What inference makes safe is allowed: an op tagged random whose randomness is switched off by its
    arguments (SDPA at ``dropout_p = 0``, ``native_dropout`` with ``train=False``), 0-dim CPU tensors that are
    trace-time constants (their value is baked into the capture, as it never changes), and writes to inputs
    whose storage is stable (parameters, buffers, a static KV cache: ``static_input_indices``), which the
    replayed graph performs in place on that same storage."""
    if kind != "inference":
        return f"{kind} graph: capture only for inference graphs"
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    if any(not isinstance(x, (torch.Tensor, int, float, bool)) or isinstance(x, torch.SymInt) for x in example_inputs):
        return "dynamic shapes (symbolic sizes among the inputs)"
    if not tensors or any(t.device.type != "cuda" for t in tensors):
        return "inputs not all CUDA tensors"
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    static = {placeholders[i] for i in static_input_indices if 0 <= i < len(placeholders)}
    constant = _constant_nodes(gm)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = str(node.target)
        if name in _HOST_SYNC:
            return f"host sync ({name})"
        if draws_random_numbers(node):
            return f"random op ({name})"
        if name.endswith("copy_.default") and isinstance(node.args[0], torch.fx.Node) \
                and node.args[0].op == "placeholder" and node.args[0] not in static:
            return f"input mutation ({name} into {node.args[0].name}, an input whose address is not stable)"
        val = node.meta.get("val")
        for v in (val if isinstance(val, (tuple, list)) else [val]):
            if isinstance(v, torch.Tensor) and v.device.type != "cuda" and not (node in constant and v.dim() == 0):
                return f"CPU tensor produced by {name}"
    return None


def _constant_nodes(gm: torch.fx.GraphModule) -> set:
    """Nodes whose value depends on no graph input: trace-time constants (``get_attr`` tensors and what is
    computed from them alone, e.g. ``lift_fresh_copy`` of a ``torch.tensor(...)`` made while tracing)."""
    constant: set = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            constant.add(node)
        elif (node.op == "call_function" and torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ())
              and all(a in constant for a in node.all_input_nodes)):
            constant.add(node)
    return constant


class CudaGraphRunner:
    """Boxed callable: ``runner(list_of_args) -> list_of_outputs``."""

    def __init__(self, fn: Callable[[list], Any], static_input_indices: Sequence[int] = (), warmup: int = 2,
                 on_disable: Callable[[str], None] | None = None, mutated_input_indices: Sequence[int] = ()):
        self.fn = fn
        self.on_disable = on_disable
        self.static_idx = set(static_input_indices)  # parameters and buffers: read in place
        self.mutated_idx = tuple(mutated_input_indices)  # inputs the graph writes (in place, on stable storage)
        self.warmup = warmup
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_inputs: list[Any] = []
        self.static_outputs: Any = None
        self.disabled_reason: str | None = None

    def _capture(self, args: list) -> None:
        self.static_inputs = [a if (i in self.static_idx or not isinstance(a, torch.Tensor)) else a.clone()
                              for i, a in enumerate(args)]
        # the warm-up runs write the inputs the graph mutates (a KV cache, a counter): save them first and put
        # them back after, so the caller's state changes once, by the replay that follows the capture
        saved = [(self.static_inputs[i], self.static_inputs[i].clone()) for i in self.mutated_idx
                 if i < len(self.static_inputs) and isinstance(self.static_inputs[i], torch.Tensor)]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):   # Triton JIT and autotuning happen here, outside capture
                self.fn(list(self.static_inputs))
            for dst, copy in saved:
                dst.copy_(copy)
        torch.cuda.current_stream().wait_stream(stream)
        del saved
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.static_outputs = self.fn(list(self.static_inputs))
        self.graph = graph

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
        for i, (src, dst) in enumerate(zip(args, self.static_inputs)):
            if not isinstance(src, torch.Tensor):
                if src != dst:
                    # a non-tensor input changed: Dynamo normally guards this, never replay stale values
                    return self.fn(args)
                continue
            if src.data_ptr() == dst.data_ptr():
                continue
            if i in self.static_idx:
                # a parameter moved (e.g. model.to / load_state_dict): re-capture on the new storage
                self.graph = None
                return self(args)
            dst.copy_(src)
        args.clear()
        self.graph.replay()
        return [o.clone() if isinstance(o, torch.Tensor) else o for o in self.static_outputs]
