"""On-disk cache for what later stages produce (search results, generated kernels, timings).

Keys are content hashes of everything that changes the entry: graph structure,
shapes, dtypes, device, torch / triton / project versions and the config fields
that affect output (:func:`cache_key`). Entries are written atomically (temp
file + ``os.replace``) with a SHA-256 of the payload in their header, so a
corrupted or truncated entry is detected, ignored and rewritten, and two
processes writing the same key at once each leave a whole entry.

Permissions follow the umask, as Inductor's cache does: files are created with
mode ``0o666`` and directories with ``0o777``, less the process's umask (0644 /
0755 under the usual 022; a team sharing one cache directory sets umask 002).
Generated kernel sources live under ``kernels/`` (:mod:`torch_mirage.codegen.loader`),
named by the hash of their content; one whose bytes no longer match is logged
once, dropped and rewritten the same way.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import secrets
import threading
from collections import OrderedDict
from typing import Any, Callable

import torch

from ._version import __version__

log = logging.getLogger("torch_mirage")

_MAGIC = b"MIRAGE1\n"


def versions() -> dict[str, str]:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return {"torch": torch.__version__, "triton": triton_version, "torch_mirage": __version__}


@functools.lru_cache(maxsize=None)   # read once a process: the code does not change under a running compile
def source_digest(*parts: str) -> str:
    """A digest of the Python sources of these parts of ``torch_mirage`` (subpackages, ``"superopt"``, or modules,
    ``"ugraph.py"``): for a cache entry whose meaning depends on the code that made it, not only on its inputs (a
    negative answer, "nothing found"), so that a changed claimer or library never reads an answer an older one
    gave."""
    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for part in parts:
        top = os.path.join(root, part)
        files = [top] if part.endswith(".py") else sorted(
            os.path.join(d, f) for d, _, fs in os.walk(top) for f in fs if f.endswith(".py"))
        for path in files:
            h.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


class ProcessMemo:
    """Answers kept in this process by a hashable key, the least recently used dropped beyond ``size``: for work a
    model's layers repeat within one compile (the same seed built and verified for each layer's identical cut)."""

    def __init__(self, size: int):
        self.size = size
        self.items: OrderedDict = OrderedDict()

    def get(self, key: Any, make: Callable[[], Any]) -> Any:
        """The answer kept under ``key``, else ``make()``'s, kept."""
        if key in self.items:
            self.items.move_to_end(key)
            return self.items[key]
        value = self.items[key] = make()
        while len(self.items) > self.size:
            self.items.popitem(last=False)
        return value


def cache_key(**parts: Any) -> str:
    """A stable hex key from JSON-able parts (plus the library versions)."""
    blob = json.dumps({"versions": versions(), **parts}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


class DiskCache:
    def __init__(self, root: str, namespace: str = "default"):
        self.root = os.path.join(root, namespace)

    def path(self, key: str, suffix: str = ".bin") -> str:
        return os.path.join(self.root, key[:2], key + suffix)

    def get(self, key: str) -> bytes | None:
        p = self.path(key)
        try:
            with open(p, "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("torch_mirage: cache entry %s unreadable (%s); ignoring it", p, e)
            return None
        payload = self._check(blob)
        if payload is None:
            log.warning("torch_mirage: cache entry %s is corrupt or truncated; ignoring it (it will be rewritten)", p)
        return payload

    @staticmethod
    def _check(blob: bytes) -> bytes | None:
        head = len(_MAGIC) + 64 + 1
        if len(blob) < head or not blob.startswith(_MAGIC):
            return None
        digest, payload = blob[len(_MAGIC):head - 1], blob[head:]
        return payload if hashlib.sha256(payload).hexdigest().encode() == digest else None

    def put(self, key: str, payload: bytes) -> str:
        p = self.path(key)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        blob = _MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload
        write_atomic(p, blob)
        return p

    def get_json(self, key: str) -> Any:
        payload = self.get(key)
        if payload is None:
            return None
        try:
            return json.loads(payload)
        except ValueError:
            return None

    def put_json(self, key: str, obj: Any) -> str:
        return self.put(key, json.dumps(obj, sort_keys=True).encode())


def write_atomic(path: str, data: bytes | str) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the whole new one, never a part. The file's mode
    follows the umask (the temporary file is created with ``0o666`` like any ``open(path, "w")``)."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".tmp-{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
