"""Shared test helpers (import as ``from helpers import ...``; tests/ is on sys.path under pytest)."""
from dataclasses import dataclass
from typing import Callable

from conftest import assert_close, rel_error  # noqa: F401
from torch_mirage.build import Built, built_regions, kernel_of


@dataclass
class ReadyKernel:
    """A test claimer's plan: a kernel it supplies whole, which the build stage takes as it is (production
    claimers return stitch or μGraph plans; this is the build stage's extension point, ``kernel_of.register``)."""
    kernel: Callable[..., tuple]


@kernel_of.register
def _ready_kernel(plan: ReadyKernel, region, graph, ctx) -> Built:
    return Built(plan.kernel)


def built_claims(claimer, graph, ctx):
    """``claimer``'s claims on the whole of ``graph`` as regions with their kernels: the partition and build
    stages for one claimer."""
    return built_regions(claimer.claim(graph, list(graph.nodes), ctx), graph, ctx, claimer.name)
