"""Differential test of the backend on random small transformer-like programs
(:mod:`torch_mirage.testing.random_programs`): drawn afresh each run, compiled with ``backend="mirage"`` (kernels
in the interpreter, every region kept), equal to float64 within the dtype's tolerance or no worse than eager.
``benchmarks/fuzz_backend.py`` runs many more (720 programs, fp32 and fp16, all equal on 2026-12-02)."""
import random

import pytest
import torch

from torch_mirage.backend import MirageBackend
from torch_mirage.report import Report
from torch_mirage.testing.random_programs import check, draw, draw_attention, draw_decode, make_inputs, tolerance

KINDS = {"chains": (draw, 4), "attention": (draw_attention, 3), "decode": (draw_decode, 2)}
CASES = [(kind, random.randrange(10 ** 6)) for kind, (_, n) in KINDS.items() for _ in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind,seed", CASES)
def test_a_random_program_equals_float64(kind, seed, dtype):
    """Chains of ops, attention calls and decode steps with a static cache (its writes compared too)."""
    prog = KINDS[kind][0](seed)
    report = Report()

    def compile_fn(fn):
        torch._dynamo.reset()
        return torch.compile(fn, backend=MirageBackend({"min_region_us": 0.0, "cache": False}, report=report),
                             fullgraph=True)

    got = check(prog, compile_fn, dtype)
    torch._dynamo.reset()
    tol = tolerance(prog, dtype)
    for err, eager in zip(got["errors"], got["eager_errors"]):
        assert err <= max(tol, 20 * eager), f"{kind} seed {seed}: {got}\n{prog.source()}\n{report}"


def test_drawn_programs_cover_the_op_kinds_and_keep_their_magnitude():
    """The generator draws every kind of step over a few hundred seeds, and its inputs keep a chain of matmuls
    near unit scale (a fuzz whose values blow up or vanish tests nothing)."""
    kinds = {s.kind for seed in range(300) for s in draw(seed).steps}
    assert kinds == {"unary", "binary", "norm", "rowwise", "linear", "matmul_t", "half", "linear_bias", "addmm"}
    prog = next(p for p in map(draw, range(1000)) if sum(s.kind in ("linear", "matmul_t") for s in p.steps) >= 3)
    with torch.no_grad():
        outs = prog.run(*make_inputs(prog, torch.float64))
    assert all(torch.isfinite(o).all() and 1e-3 < o.abs().mean() < 1e3 for o in outs), prog.source()
