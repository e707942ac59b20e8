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

log = logging.getLogger("torch_mirage")

_HOST_SYNC = {"aten._local_scalar_dense.default", "aten.item.default", "aten.nonzero.default",
              "aten.equal.default", "aten._assert_async.msg"}


def cuda_graph_blocker(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], kind: str) -> str | None:
    """Why this ATen graph cannot be captured, or ``None`` when it can."""
    if kind != "inference":
        return f"{kind} graph: capture only for inference graphs"
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    if any(not isinstance(x, (torch.Tensor, int, float, bool)) or isinstance(x, torch.SymInt) for x in example_inputs):
        return "dynamic shapes (symbolic sizes among the inputs)"
    if not tensors or any(t.device.type != "cuda" for t in tensors):
        return "inputs not all CUDA tensors"
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = str(node.target)
        if name in _HOST_SYNC:
            return f"host sync ({name})"
        tags = getattr(node.target, "tags", ())
        if torch.Tag.nondeterministic_seeded in tags:
            return f"random op ({name})"
        if name.endswith("copy_.default") and any(a.op == "placeholder" for a in node.args if isinstance(a, torch.fx.Node)):
            return f"input mutation ({name})"
        val = node.meta.get("val")
        for v in (val if isinstance(val, (tuple, list)) else [val]):
            if isinstance(v, torch.Tensor) and v.device.type != "cuda":
                return f"CPU tensor produced by {name}"
    return None


class CudaGraphRunner:
    """Boxed callable: ``runner(list_of_args) -> list_of_outputs``."""

    def __init__(self, fn: Callable[[list], Any], static_input_indices: Sequence[int] = (), warmup: int = 2,
                 on_disable: Callable[[str], None] | None = None):
        self.fn = fn
        self.on_disable = on_disable
        self.static_idx = set(static_input_indices)  # parameters and buffers: read in place
        self.warmup = warmup
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_inputs: list[Any] = []
        self.static_outputs: Any = None
        self.disabled_reason: str | None = None

    def _capture(self, args: list) -> None:
        self.static_inputs = [a if (i in self.static_idx or not isinstance(a, torch.Tensor)) else a.clone()
                              for i, a in enumerate(args)]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):   # Triton JIT and autotuning happen here, outside capture
                self.fn(list(self.static_inputs))
        torch.cuda.current_stream().wait_stream(stream)
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
