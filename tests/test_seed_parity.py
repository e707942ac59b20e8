"""Claim parity after the library's exact-form matcher retired (issue 15): every bench workload the library claimed
is still claimed, by the search's library seeds or the analysis claimers (the weight-streaming claimer, which
takes the memory-bound matmuls first, set aside), eager-equal, and where the μGraph is a library seed it is the
library's own μGraph at the workload's dims (the same hash: the same kernel on the GPU).
The bench's functions (torch_mirage/bench/workloads.py) at their --quick sizes, b = 1 and 8, in the interpreter."""
import dataclasses
import os

import pytest
import torch

import torch_mirage
from helpers import assert_close
from torch_mirage.bench.workloads import WORKLOADS
from torch_mirage.config import Config, load
from torch_mirage.pipeline import default_claimers
from torch_mirage.superopt.gemv_claim import GemvClaimer
from torch_mirage.superopt import library

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU kernels run only in Triton's interpreter (TRITON_INTERPRET=1)")

EPS = 1e-6      # numerics.rms_norm's default, which the bench's functions use
# the knob's own default (conftest sets 0 for the suite)
MIN_REGION_US = next(f.default for f in dataclasses.fields(Config) if f.name == "min_region_us")


def _without_weight_streaming() -> list:
    """The default claimers less the weight-streaming one, which claims every memory-bound matmul ahead of the
    library's seeds (at the bench's sizes on the GPU as at these): what the seeds alone make of the workload."""
    return [c for c in default_claimers(load({})) if not isinstance(c, GemvClaimer)]


def _library_graph(name: str, d: dict):
    """The μGraph the library claimer ran for this bench workload at sizes ``d`` (None: attention, claimed by
    analysis)."""
    build = {
        "rmsnorm_linear": lambda: library.rmsnorm_linear(d["M"], d["D"], d["N"], dtype="float32", eps=EPS),
        "gated_mlp": lambda: library.gated_mlp(d["M"], d["D"], d["N"], dtype="float32"),
        "gated_mlp_llama8b": lambda: library.gated_mlp(d["M"], d["D"], d["N"], dtype="float32"),
        "qknorm_attention": lambda: library.qknorm_attention(d["B"], d["H"], d["M"], d["N"], d["E"],
                                                             dtype="float32", eps=EPS),
        "lora": lambda: library.lora(d["M"], d["D"], d["N"], d["R"], dtype="float32"),
        "ntrans": lambda: library.ntrans(d["M"], d["D"], dtype="float32", eps=EPS),
    }.get(name)
    return build() if build else None


@pytest.mark.parametrize("b", [1, 8])
@pytest.mark.parametrize("name", ["rmsnorm_linear", "gated_mlp", "gated_mlp_llama8b", "gqa", "qknorm_attention",
                                  "lora", "ntrans"])
def test_bench_workload_keeps_its_claim_and_ugraph(name, b):
    w = WORKLOADS[name]
    xs = w.make_inputs(b, torch.float32, "cpu", seed=b, quick=True)
    report = torch_mirage.Report()
    compiled = torch.compile(w.fn, backend=torch_mirage.MirageBackend(options={"min_region_us": MIN_REGION_US},
                                                                              report=report,
                                                                              claimers=_without_weight_streaming()))
    assert_close(compiled(*xs), w.fn(*[x.double() for x in xs]).float())
    (region,) = report.regions
    assert region.compiled_by == "mirage", str(report)
    expected = _library_graph(name, w.dims(b, quick=True))
    if expected is None:
        assert region.claimer == "attention" and region.info["ugraph"] == "flash_attention", str(report)
    else:
        assert region.claimer == "ugraph-search" and "seed" in region.info["source"], str(report)
        assert region.info["ugraph_hash"] == expected.hash()[:16], str(report)


@pytest.mark.parametrize("name", ["rmsnorm_linear", "gated_mlp"])
def test_memory_bound_bench_matmuls_stream_with_the_default_claimers(name):
    """With every claimer, the weight-streaming one takes the matmul workloads at decode rows (one here), whatever
    their size (one verified weight-streaming kernel with the norm or the gate inside), eager-equal."""
    w = WORKLOADS[name]
    xs = w.make_inputs(1, torch.float32, "cpu", seed=3, quick=True)
    report = torch_mirage.Report()
    compiled = torch.compile(w.fn, backend=torch_mirage.MirageBackend(options={"min_region_us": MIN_REGION_US},
                                                                              report=report))
    assert_close(compiled(*xs), w.fn(*[x.double() for x in xs]).float())
    (region,) = report.regions
    assert region.claimer == "ugraph-gemv" and region.info["ugraph"] == "weight_streaming", str(report)


@pytest.mark.parametrize("scale", [64 ** -0.5, 0.3])
def test_qknorm_seed_keeps_the_programs_scale_at_shrunk_sizes(scale):
    """Head size 64 is shrunk for the verifier; the seed's score scale is the program's (1/√64 or any other), not
    1/√d of the shrunk head size — with that, every binding failed the probe and the norms ran apart."""
    from torch_mirage.numerics import rms_norm

    def qknorm(q, k, v, gq, gk):
        s = (rms_norm(q, EPS, gq) @ rms_norm(k, EPS, gk).transpose(-2, -1)) * scale
        return torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v

    xs = [torch.randn(s) for s in [(1, 2, 64, 64), (1, 2, 256, 64), (1, 2, 256, 64), (64,), (64,)]]
    report = torch_mirage.Report()
    compiled = torch.compile(qknorm, backend=torch_mirage.MirageBackend(options={"min_region_us": 0}, report=report))
    assert_close(compiled(*xs), qknorm(*[x.double() for x in xs]).float())
    (region,) = report.regions
    assert region.claimer == "ugraph-search" and region.info["ugraph"] == "qknorm_attention", str(report)
    assert "shrunk" in region.info["verified"], str(report)
    assert region.info["ugraph_hash"] == library.qknorm_attention(1, 2, 64, 256, 64, dtype="float32", eps=EPS,
                                                                  scale=scale).hash()[:16], str(report)
