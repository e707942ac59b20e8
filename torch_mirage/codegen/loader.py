"""Generated Triton source → an imported module.

``@triton.jit`` reads its function's source through ``inspect``, so generated code
must live in a real file: :func:`load_source` writes it into the cache directory
(atomically, named by the content hash, so identical kernels share one file) and
imports it under a unique module name. Modules are memoized per process.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import threading
from types import ModuleType

from ..cache import write_atomic

_LOADED: dict[tuple[str, str], tuple[ModuleType, str]] = {}
_LOCK = threading.Lock()


def source_path(source: str, cache_dir: str, prefix: str = "gen") -> str:
    digest = hashlib.sha256(source.encode()).hexdigest()[:24]
    return os.path.join(cache_dir, "kernels", f"{prefix}_{digest}.py")


def load_source(source: str, cache_dir: str, prefix: str = "gen") -> tuple[ModuleType, str]:
    """Import ``source`` as a module; returns (module, file path)."""
    path = source_path(source, cache_dir, prefix)
    key = (path, os.environ.get("TRITON_INTERPRET", ""))
    with _LOCK:
        if key in _LOADED:
            return _LOADED[key]
        try:
            with open(path, encoding="utf-8") as f:
                current = f.read()
        except OSError:
            current = None
        if current != source:
            write_atomic(path, source)
        name = f"torch_mirage_generated_{os.path.basename(path)[:-3]}_{len(_LOADED)}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"torch_mirage: cannot import generated kernel source {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        _LOADED[key] = (module, path)
        return module, path
