"""Functional ATen graphs of plain PyTorch functions, exactly as the backend sees them (for tests and the verifier)."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

from ..capture.lower import lower


def trace_aten(fn: Callable, *inputs: Any) -> fx.GraphModule:
    """The single inference ATen graph AOTAutograd hands the backend for ``fn(*inputs)`` (Inductor decompositions,
    functionalized, ``meta['val']`` on every node). Raises if Dynamo splits ``fn`` into several graphs."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    graphs: list[fx.GraphModule] = []

    def keep(gm: fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return make_boxed_func(gm)

    backend = aot_autograd(fw_compiler=keep, inference_compiler=keep, decompositions=select_decomp_table(),
                           keep_inference_input_mutations=True)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*inputs)
    torch._dynamo.reset()
    if len(graphs) != 1:
        raise RuntimeError(f"trace_aten: expected one graph, Dynamo produced {len(graphs)}")
    return graphs[0]


def trace_ir(fn: Callable, *inputs: Any):
    """``fn`` lowered into the project IR."""

    return lower(trace_aten(fn, *inputs))
