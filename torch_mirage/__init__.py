"""torch-mirage: a ``torch.compile`` backend that stitches and superoptimizes memory-bound
regions into verified Triton kernels and leaves the rest to TorchInductor.

    model = torch.compile(model, backend="mirage")

Public API: the backend (registered by entry point), :mod:`torch_mirage.config`,
:func:`explain`.
"""
from ._version import __version__
from . import config
from .report import Report, explain

__all__ = ["__version__", "config", "explain", "Report", "MirageBackend"]


def __getattr__(name):
    if name == "MirageBackend":
        from .backend import MirageBackend
        return MirageBackend
    raise AttributeError(name)
