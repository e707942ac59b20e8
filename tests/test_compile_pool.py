"""The compile pool (compile_pool.py) and tune's ahead-of-time compiles: every candidate compiled in the pool before
the first build, the builds, checks, drops and winner exactly as without the pool, in the same order."""
import logging
import threading
import time

import pytest
import torch

from torch_mirage import compile_pool
from torch_mirage.codegen.aot import compile_ahead
from torch_mirage.compile_pool import compile_workers
from torch_mirage.tune import budget, tune

SPEED = {"a": 3.0, "b": 1.0, "c": 2.0, "d": 4.0}


def _time_half(name, made):
    return [SPEED[name], SPEED[name] + 0.1]


def test_run_all_runs_every_job_once_in_threads_and_keeps_each_error():
    seen, lock = [], threading.Lock()

    def job(name):
        time.sleep(0.01 * (4 - int(name)))   # the first submitted finishes last
        with lock:
            seen.append((name, threading.current_thread().name))
        if name in ("1", "3"):
            raise ValueError(f"no kernel {name}")

    run = compile_pool.run_all(["0", "1", "2", "3"], job, 3)
    assert run.workers == 3 and sorted(n for n, _ in seen) == ["0", "1", "2", "3"]
    assert all(t.startswith("torch_mirage_compile") for _, t in seen)
    assert list(run.errors) == ["1", "3"] and str(run.errors["3"]) == "no kernel 3"   # in the names' order


def test_run_all_with_one_thread_or_one_name_runs_nothing():
    calls = []
    assert compile_pool.run_all(["a", "b"], calls.append, 1) is None
    assert compile_pool.run_all(["a"], calls.append, 8) is None
    assert calls == []
    assert compile_pool.resolve_workers(0) == compile_pool.usable_cores() >= 1
    assert compile_pool.resolve_workers(3) == 3


def _recording(events, lock, fail=()):
    def precompile(name):
        time.sleep(0.01 * (len(SPEED) - "abcd".index(name)))   # finish in the reverse order
        with lock:
            events.append(("compile", name, threading.current_thread().name))
        if name in fail:
            raise RuntimeError(f"ptxas: {name} needs too many registers")

    def build(name):
        events.append(("build", name, threading.current_thread().name))
        if name in fail:   # the compile fails again when the build first runs the kernel
            raise RuntimeError(f"ptxas: {name} needs too many registers")
        return name.upper()

    return precompile, build


def test_candidates_compile_in_the_pool_before_the_first_build_and_build_in_order(caplog):
    events, lock = [], threading.Lock()
    precompile, build = _recording(events, lock)
    with caplog.at_level(logging.INFO, logger="torch_mirage"), compile_workers(4):
        t = tune(list("abcd"), _time_half, build=build, precompile=precompile, label="launch config")
    kinds = [e[0] for e in events]
    assert kinds == ["compile"] * 4 + ["build"] * 4           # every compile done before the first build
    compiles, builds = events[:4], events[4:]
    assert {e[1] for e in compiles} == set("abcd") and all(e[2].startswith("torch_mirage_compile") for e in compiles)
    assert [e[1] for e in builds] == list("abcd") and all(e[2] == threading.current_thread().name for e in builds)
    assert t.winner == "b" and list(t.built) == list("abcd") and list(t.times) == list("abcd")
    assert "compiled 4 launch config candidates" in caplog.text and "4 threads; 0 failed" in caplog.text


@pytest.mark.parametrize("workers", [1, 2, 0])
def test_a_candidate_that_fails_to_compile_is_dropped_as_without_the_pool(workers):
    events, lock = [], threading.Lock()
    precompile, build = _recording(events, lock, fail=("b",))
    with compile_workers(workers):
        t = tune(list("abcd"), _time_half, build=build, precompile=precompile)
    assert t.winner == "c" and list(t.built) == ["a", "c", "d"] and t.dropped == {"b": "build: RuntimeError"}
    assert list(t.times) == ["a", "c", "d"]
    compiled = [e[1] for e in events if e[0] == "compile"]
    assert sorted(compiled) == ([] if workers == 1 else list("abcd"))   # 1: no pool, each compiles in its build
    assert [e[1] for e in events if e[0] == "build"] == list("abcd")


def test_a_spent_budget_compiles_nothing_ahead():
    events, lock = [], threading.Lock()
    precompile, build = _recording(events, lock)
    with budget(1e-9), compile_workers(4):
        t = tune(list("abcd"), _time_half, build=build, precompile=precompile)
    assert t.winner == "a" and [e[0] for e in events] == ["build"]


def test_the_knob_sets_the_threads_outside_a_compile(monkeypatch):
    """A choice made outside a graph's compile (a script calling compile_ugraph) reads MIRAGE_COMPILE_WORKERS."""
    events, lock = [], threading.Lock()
    precompile, build = _recording(events, lock)
    monkeypatch.setenv("MIRAGE_COMPILE_WORKERS", "1")
    tune(list("abcd"), _time_half, build=build, precompile=precompile)
    assert [e[0] for e in events] == ["build"] * 4
    monkeypatch.setenv("MIRAGE_COMPILE_WORKERS", "2")
    events.clear()
    tune(list("abcd"), _time_half, build=build, precompile=precompile)
    assert [e[0] for e in events] == ["compile"] * 4 + ["build"] * 4


def test_compile_ahead_compiles_nothing_under_the_interpreter(monkeypatch):
    """TRITON_INTERPRET=1 (the CPU tests): there is nothing to compile; the kernel is not touched."""
    class Kernel:
        def warmup(self, *args, **kwargs):
            raise AssertionError("warmup under the interpreter")

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    compile_ahead(Kernel(), torch.empty(2, device="meta"), 2, grid=(1,), device=torch.device("cpu"), num_warps=4)


# ---------------------------------------------------------------- a warmup compiles what the call will launch
def _key(args):
    """What Triton's cache key reads of a launch's arguments: a tensor's dtype and 16-byte alignment (a meta
    tensor, as compile_ahead passes it on, has address 0), every other argument's value."""
    return [(a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else a for a in args]


def _recorders(monkeypatch, module):
    calls, warmups = [], []

    def run_kernel(fn, *args, grid, **meta):
        calls.append((fn, tuple(grid), _key(args), meta))
        return real(fn, *args, grid=grid, **meta)

    def compile_ahead(fn, *args, grid, device, **meta):
        # nothing real but the caller's inputs: outputs and workspaces are meta tensors
        assert all(a.is_meta or any(a is x for x in inputs) for a in args if isinstance(a, torch.Tensor))
        warmups.append((fn, tuple(grid), _key(args), meta))

    real, inputs = module.run_kernel, []
    monkeypatch.setattr(module, "run_kernel", run_kernel)
    monkeypatch.setattr(module, "compile_ahead", compile_ahead)
    return calls, warmups, inputs


@pytest.mark.parametrize("shape", [(3, 17), (1, 65536)], ids=["row", "split-row"])
def test_a_stitch_warmup_compiles_the_launches_its_call_makes(monkeypatch, shape):
    from torch_mirage.codegen import stitch_launch
    from test_stitch_codegen import _rows, _vec, rmsnorm, stitched

    calls, warmups, _ = _recorders(monkeypatch, stitch_launch)
    x, g = _rows(shape, torch.float32), _vec(shape[-1], torch.float32)
    region, _ = stitched(rmsnorm, x, g)
    region.kernel.warmup()
    assert calls and warmups == calls     # same kernels, grids, options and argument specialisation
    if shape == (1, 65536):
        assert len(calls) == 2            # the partial statistics, then the combining kernel


def test_a_block_launcher_warmup_compiles_the_launches_its_call_makes(monkeypatch, tmp_path):
    from torch_mirage.superopt import compile as compile_module, library
    from torch_mirage.superopt.launch import LaunchConfig

    calls, warmups, inputs = _recorders(monkeypatch, compile_module)
    g = library.rmsnorm_linear(3, 256, 96, dtype="float32")
    op = next(o for o in g.ops if o.name == "customized")
    config = LaunchConfig(tuple(op.body.grid), op.body.forloop_range, split=2)
    xs = [torch.randn(i.attrs["shape"]) for i in g.inputs]
    inputs.extend(xs)
    launcher = compile_module.BlockLauncher(op.body, config, [x.dim() for x in xs], str(tmp_path))
    launcher(*xs)
    launcher.warmup(*xs)
    assert len(calls) == 2 and warmups == calls   # the split kernel and its combine kernel, as the call runs them
