"""The binding of the search's C++ core (csrc/search_core.cpp, built as ``torch_mirage._C`` by setup.py).

The extension is optional: ``pip install`` builds it when a C++17 compiler and Python's headers are there and
goes on without it otherwise (``MIRAGE_BUILD_CSRC=0`` skips it). :func:`search_core` is the module, or None
when it is not built or does not match this version of the search (then the generator's pure-Python path
runs); which path is used is logged once at INFO when the generator first asks. After editing csrc/, rebuild with
``pip install -e .`` (or ``python setup.py build_ext --inplace``); bump :data:`ABI` and csrc's ``ABI`` together
when the calling convention changes, so that a stale build is refused instead of misread.
"""
from __future__ import annotations

import importlib
import logging

log = logging.getLogger("torch_mirage")

ABI = 3             # bumped with every change of the core's calling convention (checked against _C.ABI)
_state: dict = {}


def _load():
    try:
        mod = importlib.import_module("torch_mirage._C")
    except ImportError as e:
        return None, f"torch_mirage._C not importable: {e}"
    if getattr(mod, "ABI", None) != ABI:
        return None, f"torch_mirage._C has ABI {getattr(mod, 'ABI', None)}, this search needs {ABI}: reinstall"
    return mod, f"loaded from {mod.__file__}"


def search_core():
    """The C++ search core, or None (the pure-Python path runs)."""
    if not _state.get("enabled", True):
        return None
    if "mod" not in _state:
        _state["mod"], _state["why"] = _load()
        log.info("torch_mirage: μGraph search generator uses the %s path (%s)",
                 "C++" if _state["mod"] is not None else "pure-Python", _state["why"])
    return _state["mod"]


def set_enabled(enabled: bool) -> bool:
    """Switch the C++ core on or off for this process (benchmarks and tests compare the two paths);
    returns the previous setting."""
    old = _state.get("enabled", True)
    _state["enabled"] = bool(enabled)
    return old


def why_not() -> str:
    """Why the core is (not) loaded, for error messages and test skips."""
    if "why" not in _state:
        _state["mod"], _state["why"] = _load()
    return _state["why"]
