"""Shared test helpers (import as ``from helpers import ...``; tests/ is on sys.path under pytest)."""
from dataclasses import dataclass
from typing import Callable

import torch

from conftest import assert_close, rel_error  # noqa: F401
from torch_mirage.build import Built, built_regions, kernel_of


def errors_against_fp64(compiled, fn, xs) -> tuple[float, float, float]:
    """``(compiled's, eager's max abs error, the reference's max abs)`` of ``fn`` on ``xs`` against ``fn`` in fp64:
    for precision tests that compare a kernel's rounding with eager's own."""
    ref = fn(*[x.double() for x in xs])
    err, eager_err = ((y.double() - ref).abs().max().item() for y in (compiled(*xs), fn(*xs)))
    return err, eager_err, ref.abs().max().item()


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


def strict_attention_compile(fn, args, caplog):
    """``fn(*args)`` compiled by mirage with every region claimed untimed (``min_region_us`` 0, no region timing)
    and strict (a failed stage raises), its warnings captured; asserts no tuned launch disagreed with the μGraph's
    own schedule. Returns the output and the attention regions mirage compiled."""
    import logging

    import torch_mirage

    torch._dynamo.reset()
    report = torch_mirage.Report()
    backend = torch_mirage.MirageBackend(options={"min_region_us": 0, "strict": True, "measure_regions": False},
                                         report=report)
    with caplog.at_level(logging.WARNING, logger="torch_mirage"):
        out = torch.compile(fn, backend=backend)(*args)
    assert not [r.message for r in caplog.records if "disagrees" in r.message]
    regions = [r for r in report.regions if r.claimer == "attention" and r.compiled_by == "mirage"]
    return out, regions
