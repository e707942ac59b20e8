"""``torch_mirage.explain``: compile a function or module with the mirage backend, run it once and return the
report of what was done (graphs, regions, who compiled each and why, CUDA graphs, stage times)."""
from __future__ import annotations

from typing import Any, Callable

import torch

from .backend import MirageBackend
from .report import Report


def explain(fn: Callable, *inputs: Any, options: dict | None = None, **kwinputs: Any) -> Report:
    """Compile ``fn`` with ``backend="mirage"``, run it once on ``inputs`` and report what was done.

    ``fn`` may be a module or a function. ``options`` are torch_mirage config keys.
    """
    report = Report()
    compiled = torch.compile(fn, backend=MirageBackend(options=options, report=report))
    compiled(*inputs, **kwinputs)
    return report
