"""The ``mirage::region`` operator: a built region's kernel as an ATen op that Inductor calls inside its partitions.

Placed between the fallback's ops as a plain Python call, each mirage region cuts the graph: regional Inductor
compiles every stretch between two regions as a partition of its own, and each partition is an AOTAutograd and
Inductor compile, cached apart and loaded apart — 60-90 ms a partition in a warm process on the H200's host (its
cache key, its guards, its module), 1.1 s of an HF llama prefill graph's warm compile over about ten partitions
(12-03). As ``torch.ops.mirage.region.default(key, [inputs])`` a region joins the partition around it: Inductor
runs it as an extern kernel call, and a graph's fallback is one compile (and one cache entry) instead of one per
stretch.

``key`` names the kernel in this process's registry (:func:`register`): a digest of the graph the region was
claimed in, the region's place in it and its program (ops, constants, shapes, strides, dtypes, devices), so that it
is the same in every process — Inductor's caches key the partition by it — and two regions share a key only where
their kernels are interchangeable (the graph is part of it: a kernel may rely on what analysis read off the
region's surroundings, a mask's structure). The fake implementation gives each output's recorded shape, stride,
dtype and device; the op is tagged ``needs_exact_strides``, so Inductor hands the kernel its inputs in the layout
the kernel was built and verified for.

Inductor may write into a buffer an op returned once nothing reads it any more; an output that shares memory with
an input or another output would then be overwritten behind the graph's back. The op returns such an output as a
copy (a region's layout op may give a view of its input), and regions that update an input in place (a static
KV cache's write) are never made this op (:func:`eligible`).
"""
from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..capture.ir import Graph, Value, fingerprint, subgraph

__all__ = ["OP_NAME", "eligible", "region_key", "register", "region_op"]

OP_NAME = "mirage::region"

# ops that write their first argument: a region holding one updates an input in place
_UPDATES = ("index_copy", "index_put", "scatter", "copy_")


@dataclass(frozen=True)
class _OutMeta:
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class _Entry:
    kernel: Callable[..., Sequence[torch.Tensor]]
    outputs: tuple[_OutMeta, ...]


_REGISTRY: dict[str, _Entry] = {}
_LIB: list[Any] = []          # the torch.library.Library, made at the first use
_LOCK = threading.Lock()


def eligible(region: Any, outs: Sequence[Value]) -> bool:
    """Whether ``region`` (its outputs ``outs``) can run as the op: every input and output a tensor of static shape
    and strides (the fake implementation gives recorded sizes), and no op of it writes an input in place."""
    if region.kernel is None:
        return False
    values = list(region.inputs) + list(outs)
    if not values or not all(isinstance(v, Value) and v.meta is not None and v.meta.is_static for v in values):
        return False
    return not any(u in n.target_name for n in region.nodes for u in _UPDATES)


def graph_digest(graph: Graph) -> str:
    """The digest of ``graph``'s text (:func:`~..capture.ir.fingerprint`) that each region key starts from."""
    return hashlib.sha256(fingerprint(graph).encode()).hexdigest()


def region_key(graph_key: str, index: int, region: Any, graph: Graph, outs: Sequence[Value]) -> str:
    """The registry key of the ``index``-th region (its outputs ``outs``) of ``graph``, whose digest is
    ``graph_key``."""
    sub = subgraph(graph, region.nodes, outs)
    devices = ",".join(str(v.meta.device) for v in list(region.inputs) + list(outs))
    text = f"{graph_key}|{index}|{devices}|{fingerprint(sub)}"
    return "r" + hashlib.sha256(text.encode()).hexdigest()[:32]


def register(key: str, kernel: Callable[..., Sequence[torch.Tensor]], outputs: Sequence[Value]) -> None:
    """Make ``key`` run ``kernel``; ``outputs`` (IR values) give its outputs' metadata to the fake implementation.
    Registering a key again replaces its kernel (an interchangeable one: see the module's docstring)."""
    metas = tuple(_OutMeta(tuple(v.meta.shape), tuple(v.meta.stride), v.meta.dtype, v.meta.device) for v in outputs)
    _define()
    with _LOCK:
        _REGISTRY[key] = _Entry(kernel, metas)


def region_op() -> Any:
    """``torch.ops.mirage.region.default``, defined on first use."""
    _define()
    return torch.ops.mirage.region.default


def _define() -> None:
    with _LOCK:
        if _LIB:
            return
        lib = torch.library.Library("mirage", "DEF")
        tags = (torch.Tag.needs_exact_strides,) if hasattr(torch.Tag, "needs_exact_strides") else ()
        lib.define("region(str key, Tensor[] args) -> Tensor[]", tags=tags)
        lib.impl("region", _run, "CompositeExplicitAutograd")
        torch.library.register_fake(OP_NAME, _fake, lib=lib)
        _LIB.append(lib)


def _entry(key: str) -> _Entry:
    entry = _REGISTRY.get(key)
    if entry is None:
        raise RuntimeError(f"torch_mirage: no kernel is registered for region {key} in this process: the graph "
                           "that calls it was compiled elsewhere or its kernels were freed; compile the model again "
                           "in this process (or set MIRAGE_REGIONS_IN_INDUCTOR=0)")
    return entry


def _run(key: str, args: list[torch.Tensor]) -> list[torch.Tensor]:
    entry = _entry(key)
    outs = list(entry.kernel(*args))
    if len(outs) != len(entry.outputs):
        raise RuntimeError(f"torch_mirage: region {key} returned {len(outs)} outputs, expected {len(entry.outputs)}")
    taken: list[tuple[int, int]] = [_span(a) for a in args if isinstance(a, torch.Tensor)]
    for i, o in enumerate(outs):
        span = _span(o)
        if any(_overlap(span, s) for s in taken):
            o = outs[i] = _copy(o)
            span = _span(o)
        taken.append(span)
    return outs


def _copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` in memory of its own, with its sizes and strides (gaps and broadcast strides included)."""
    extent = _extent(t)
    buf = torch.empty(extent, dtype=t.dtype, device=t.device)
    buf.copy_(t.as_strided((extent,), (1,), t.storage_offset()))
    return buf.as_strided(t.shape, t.stride(), 0)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range ``t`` can touch (start, end), from its data pointer, sizes and strides."""
    if t.numel() == 0:
        return (0, 0)
    start = t.data_ptr()
    return (start, start + _extent(t) * t.element_size())


def _extent(t: torch.Tensor) -> int:
    """Elements from ``t``'s first to its last one in memory (a non-empty tensor; gaps and broadcasts counted)."""
    return sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _fake(key: str, args: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=m.device) for m in _entry(key).outputs]
