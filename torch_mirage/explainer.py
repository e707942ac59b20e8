"""``explain(fn, *inputs)``: compile with the mirage backend, run once, return the :class:`Report` (public as ``torch_mirage.explain``)."""
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
