"""torch-mirage: a ``torch.compile`` backend that stitches and superoptimizes memory-bound
regions into verified Triton kernels and leaves the rest to TorchInductor.

    model = torch.compile(model, backend="mirage")

Public API: the backend (registered by entry point), :mod:`torch_mirage.config`,
:func:`explain`.
"""
from ._version import __version__
from . import config
from .report import Report

__all__ = ["__version__", "config", "explain", "Report", "MirageBackend"]


def _register_with_torch_logging() -> None:
    """Make the ``torch_mirage`` logger one of torch's registered logs: ``TORCH_LOGS="+torch_mirage"`` (DEBUG),
    ``TORCH_LOGS="torch_mirage"`` (INFO) and ``torch._logging.set_logs(modules={"torch_mirage": level})`` set its
    level and give it torch's handler. ``MIRAGE_LOG_LEVEL``, when set, still wins (see ``backend``)."""
    try:
        from torch._logging._internal import register_log   # private; present in torch 2.11 - 2.14
    except ImportError:
        return
    register_log("torch_mirage", "torch_mirage")


_register_with_torch_logging()


def __getattr__(name):
    # the backend (and explain, which needs it) import torch._dynamo / Inductor: loaded on first use, so
    # ``import torch_mirage`` (the entry point, the CLI, config) stays light
    if name == "MirageBackend":
        from .backend import MirageBackend
        return MirageBackend
    if name == "explain":
        from .explainer import explain   # not a submodule named explain: importing it would shadow the function
        return explain
    raise AttributeError(name)
