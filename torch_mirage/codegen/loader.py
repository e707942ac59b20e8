"""Generated Triton source → an imported module.

``@triton.jit`` reads its function's source through ``inspect``, so generated code
must live in a real file: :func:`load_source` writes it into the cache directory
(atomically, named by the content hash, so identical kernels share one file) and
imports it under a unique module name. Modules are memoized per process.

A file whose bytes are not the source its name hashes (random bytes, a truncated
write by an older version, an edit) is logged once, dropped and rewritten. The
module is executed from the source in memory, compiled here: no bytecode file is
written or read, so no stale or truncated ``.pyc`` can break a kernel. Its kernels' cache
keys are pinned to the source (:func:`.compile_worker.pin_kernel_keys`), as the compile
workers pin them.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
import threading
from types import ModuleType

from ..cache import write_atomic
from ..context import Target
from .compile_worker import pin_kernel_keys

log = logging.getLogger("torch_mirage")

_LOADED: dict[tuple[str, str], tuple[ModuleType, str]] = {}
_LOCK = threading.Lock()


def source_path(source: str, cache_dir: str, prefix: str = "gen") -> str:
    digest = hashlib.sha256(source.encode()).hexdigest()[:24]
    return os.path.join(cache_dir, "kernels", f"{prefix}_{digest}.py")


def _ensure_file(path: str, data: bytes) -> None:
    """``path`` holds exactly ``data`` afterwards; a file that held something else is reported and replaced."""
    try:
        with open(path, "rb") as f:
            current = f.read()
    except FileNotFoundError:
        current = None
    except OSError as e:
        log.warning("torch_mirage: cache entry %s cannot be read (%s); rewriting it", path, e)
        current = None
    if current == data:
        return
    if current is not None:
        log.warning("torch_mirage: cache entry %s is corrupt or truncated (%d bytes, expected %d); dropped and "
                    "rewritten", path, len(current), len(data))
    write_atomic(path, data)


def load_source(source: str, cache_dir: str, prefix: str = "gen") -> tuple[ModuleType, str]:
    """Import ``source`` as a module; returns (module, file path)."""
    path = source_path(source, cache_dir, prefix)
    key = (path, Target.current())   # @triton.jit reads the target when the module runs: one module per target
    with _LOCK:
        if key in _LOADED:
            return _LOADED[key]
        _ensure_file(path, source.encode("utf-8"))
        name = f"torch_mirage_generated_{os.path.basename(path)[:-3]}_{len(_LOADED)}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"torch_mirage: cannot import generated kernel source {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            exec(compile(source, path, "exec"), module.__dict__)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        pin_kernel_keys(module, source)
        _LOADED[key] = (module, path)
        return module, path
