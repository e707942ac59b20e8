"""Functional ATen graphs of plain PyTorch functions, as the backend sees them (for tests and the verifier)."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx


def trace_aten(fn: Callable, *inputs: Any) -> fx.GraphModule:
    """Trace ``fn`` to a functional ATen graph with Inductor's decompositions; nodes carry ``meta['val']``."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch.no_grad():
        gm = make_fx(torch.func.functionalize(fn, remove="mutations"), decomposition_table=select_decomp_table(),
                     tracing_mode="fake")(*inputs)
    return gm


def trace_ir(fn: Callable, *inputs: Any):
    """``fn`` lowered into the project IR."""
    from ..capture.lower import lower

    return lower(trace_aten(fn, *inputs))
