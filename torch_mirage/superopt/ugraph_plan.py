"""The μGraph plan: what a μGraph claimer hands the build stage (:mod:`torch_mirage.build`) for one region.

A claimer matches, analyses and validates (a μGraph's tiles fit block memory, a seed the verifier proves equal to
the region's reference); it compiles nothing. Its :class:`UGraphPlan` holds the μGraph(s) of the region's program
— several :class:`Alternative` s where more than one may be fastest (FlashAttention and split-KV FlashDecoding), of
which the build stage compiles each and on a GPU runs the fastest (:func:`~torch_mirage.tune.tune`) — the launch
candidate space for their kernels, the recipe for example inputs in the μGraphs' input order, and the binding of a
compiled μGraph to the region's inputs and outputs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..timing import random_like
from ..ugraph import KernelGraph


@dataclass(eq=False)
class Alternative:
    """One μGraph of the region's program: its name (the tuning candidate's), the μGraph, and what the report says
    when it is the one that runs."""
    name: str
    graph: KernelGraph
    detail: str                                            # the region's detail, e.g. "μGraph lora(64, 128, 16, 128)"
    info: dict[str, Any] = field(default_factory=dict)     # its facts for the report (the μGraph's name, its band)


@dataclass(eq=False)
class UGraphPlan:
    """A region's μGraph(s), and what the build stage needs to compile one into the region's kernel."""
    alternatives: list[Alternative]                # one or more; each compiled, on a GPU the fastest runs
    examples: Callable[[], list[torch.Tensor]]     # example inputs in the μGraphs' input order, made when compiling
    bind: Callable[[Callable], Callable[..., tuple]]   # compiled μGraph -> (*region inputs) -> tuple(region outputs)
    what: str                                      # for a failure's warning: "μGraph gated_mlp(4, 8, 16) float32"
    propose: Callable[..., list] | None = None     # the launch candidates (None: superopt.launch.candidates)
    # set by the build stage where one round for the whole graph compiled these candidates (build.compile_candidates_ahead)
    candidates_compiled: bool = False


def random_inputs(metas: Sequence[Any], shapes: Sequence[tuple] | None = None) -> list[torch.Tensor]:
    """Random tensors for ``metas`` (each reshaped to ``shapes`` where given): a μGraph's example inputs."""
    tensors = [random_like(m) for m in metas]
    return tensors if shapes is None else [t.reshape(s) for t, s in zip(tensors, shapes)]
