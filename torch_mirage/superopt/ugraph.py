"""The μGraph IR lives in :mod:`torch_mirage.ugraph`, below codegen (which emits it) and superopt (which builds,
checks and searches it); this module re-exports it so that ``from .ugraph import ...`` inside superopt still works."""
from ..ugraph import *  # noqa: F401,F403
