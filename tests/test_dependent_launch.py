"""Programmatic dependent launch of generated μGraph kernels (codegen/dependent_launch.py): where it is on, what a
kernel's source starts with (the wait before anything is read, then the trigger; a combine kernel and a sibling
launch the same, a sibling launch's parts not), and on an sm_90 GPU the QKV + RoPE μGraph's kernels launched with it,
replayed in a CUDA graph, equal to eager and to the same kernels launched without it."""
import os
import sys

import pytest
import torch

from torch_mirage.capture.lower import trace
from torch_mirage.codegen import dependent_launch
from torch_mirage.codegen.dependent_launch import WAIT_LINES, dependent_launches
from torch_mirage.codegen.ugraph_triton import emit_block_kernel, emit_sibling_kernel
from torch_mirage.config import Config
from torch_mirage.context import Target
from torch_mirage.superopt.gemv_claim import verified_halves
from torch_mirage.superopt.launch import retile
from torch_mirage.superopt.search.reference import reference_of

sys.path.insert(0, os.path.dirname(__file__))
from test_gemv_rope import HD, _inputs, qkv_rope, rotate_cat  # noqa: E402


def _halves(rows=1, dtype=torch.float32, device="cpu", **dims):
    fn = qkv_rope(rotate_cat, hd=dims.get("hd", HD))
    xs = _inputs(rows, dtype, device=device, **dims)
    graph = trace(fn, xs)
    ref = reference_of(graph.nodes, graph)
    pos = {id(v): i for i, v in enumerate(graph.inputs)}
    return fn, xs, verified_halves(ref.graph, Config()), [xs[pos[id(v)]] for v in ref.inputs]


def _body_lines(source: str, kernel: str) -> list[str]:
    """The statements of function ``kernel`` in ``source``, stripped, in order."""
    lines = source.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"def {kernel}("))
    body = []
    for line in lines[start + 1:]:
        if line and not line.startswith(" "):
            break
        if line.strip():
            body.append(line.strip())
    return body


def test_on_only_for_cuda_kernels_and_as_the_compile_says(monkeypatch):
    monkeypatch.setattr(dependent_launch, "_supported", lambda: True)
    assert not dependent_launch.enabled(Target.INTERPRETER)
    monkeypatch.delenv("MIRAGE_PDL", raising=False)
    assert not dependent_launch.enabled(Target.CUDA)     # off by default (slower on a decode step: the module says)
    monkeypatch.setenv("MIRAGE_PDL", "1")
    assert dependent_launch.enabled(Target.CUDA)
    with dependent_launches(False):
        assert not dependent_launch.enabled(Target.CUDA)
    monkeypatch.setenv("MIRAGE_PDL", "0")
    assert not dependent_launch.enabled(Target.CUDA)
    with dependent_launches(True):      # a compile's options= win over the environment
        assert dependent_launch.enabled(Target.CUDA)
    monkeypatch.setattr(dependent_launch, "_supported", lambda: False)
    with dependent_launches(True):      # before sm_90, or a Triton without the ops: never
        assert not dependent_launch.enabled(Target.CUDA)


@pytest.mark.parametrize("split,in_kernel", [(1, False), (2, True), (2, False)])
def test_a_kernel_waits_before_it_reads_anything(split, in_kernel):
    _, _, halves, _ = _halves()
    body = next(op.body for op in halves.ops if op.name == "customized")
    body = retile(body, body.grid, 4)      # four for-loop steps: a split of 2 divides them
    ranks = [2] * len(body.iterators)
    plain = emit_block_kernel(body, ranks, "k", split=split, combine_in_kernel=in_kernel, target=Target.CUDA)
    waiting = emit_block_kernel(body, ranks, "k", split=split, combine_in_kernel=in_kernel, target=Target.CUDA,
                                pdl=True)
    assert waiting.pdl and not plain.pdl
    assert not any(w in plain.source for w in WAIT_LINES)
    kernels = ["k"] + ([waiting.combine] if waiting.combine else [])
    for name in kernels:
        lines = _body_lines(waiting.source, name)
        first_read = next(i for i, line in enumerate(lines) if "tl.load(" in line)
        wait = lines.index(WAIT_LINES[0])
        assert lines[wait + 1] == WAIT_LINES[1]         # the trigger right after the wait: one kernel runs ahead
        assert wait < first_read
        assert all(line.startswith(("pid_", "split =", "chunk =")) for line in lines[:wait])
        assert sum(WAIT_LINES[0] in line for line in lines) == 1


def test_a_sibling_launch_waits_once_its_parts_not():
    _, _, halves, _ = _halves()
    bodies = [op.body for op in halves.ops if op.name == "customized"]
    parts = [emit_block_kernel(b, [2] * len(b.iterators), f"p{j}", target=Target.CUDA, flat_pid=True, pdl=True)
             for j, b in enumerate(bodies)]
    assert not any(p.pdl or WAIT_LINES[0] in p.source for p in parts)
    lines = _body_lines(emit_sibling_kernel("joined", parts, pdl=True), "joined")
    assert lines[:3] == ["lin = tl.program_id(0)", *WAIT_LINES]
    assert not any(WAIT_LINES[0] in line for line in _body_lines(emit_sibling_kernel("joined", parts), "joined"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs an sm_90 GPU")
@pytest.mark.parametrize("rows", [1, 8])
def test_gpu_dependent_launches_in_a_cuda_graph_equal_eager(rows, tmp_path):
    """bf16 QKV + RoPE in paired halves at Llama widths (2048 wide, 16 heads of 128, 4 KV heads), tuned with PDL on:
    its kernels wait and are launched with PDL; replayed three times in one CUDA graph after the kernels that
    produce its input (a torch op), the outputs equal eager's and the same μGraph's with PDL off."""
    from helpers import rel_error
    from torch_mirage.numerics import tolerance
    from torch_mirage.superopt.compile import compile_ugraph

    bf = torch.bfloat16
    fn, xs, halves, ins = _halves(rows, bf, device="cuda", d=2048, hd=128, heads=16, kv_heads=4)
    eager = fn(*[x.double() for x in xs])
    compiled = {}
    for on in (True, False):
        with dependent_launches(on):
            compiled[on] = compile_ugraph(halves, ins, cache_dir=str(tmp_path / str(on)))
    launchers = [s.launcher for s in compiled[True].steps if s.launcher is not None]
    assert launchers and all(ln.pdl and WAIT_LINES[0] in ln.source for ln in launchers)
    assert not any(s.launcher.pdl for s in compiled[False].steps if s.launcher is not None)
    first = ins[0]
    source = first.clone()
    static = [first] + list(ins[1:])

    def step(run):
        static[0].copy_(source * 1.0)      # a producer kernel right before the μGraph's first kernel
        return run(*static)
    for on in (True, False):
        step(compiled[on])
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step(compiled[on])
        for _ in range(3):
            for o in outs:
                o.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert sorted(o.shape for o in outs) == sorted(e.shape for e in eager)
            for o in outs:
                assert any(o.shape == e.shape and rel_error(o, e.to(bf)) <= tolerance(bf) for e in eager)
