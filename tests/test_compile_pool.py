"""The compile pool (compile_pool.py) and tune's ahead-of-time compiles: every candidate compiled in the pool before
the first build, the builds, checks, drops and winner exactly as without the pool, in the same order."""
import logging
import sys
import threading
import time
from pathlib import Path

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


# ---------------------------------------------------------------- worker processes (MIRAGE_COMPILE_PROCESSES)
KERNEL = '''import triton
import triton.language as tl


@triton.jit
def scale(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2.0, mask=offs < n)
'''
SIGNATURE = {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
ATTRS = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}


def _launch(tmp_path, name="scale", block=128, path=None):
    """A launch's compile as Triton's JIT hands it to its cache hook: the kernel file (``path``: one written
    already), the specialisation data (serialised as Triton serialises it: the parsed options' fields), the options
    object and the request."""
    import json

    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    from torch_mirage.codegen.aot import CompileRequest

    if path is None:
        path = tmp_path / "kernel.py"
        path.write_text(KERNEL)
    options = make_backend(GPUTarget("cuda", 90, 32)).parse_options({"num_warps": 4, "num_stages": 3})
    spec = json.dumps({"name": name, "signature": SIGNATURE, "constant_keys": [[3]], "constant_vals": [block],
                       "attrs_keys": [list(k) for k in ATTRS], "attrs_vals": list(ATTRS.values()),
                       "options": options.__dict__, "key": "k"})
    return path, options, CompileRequest(str(path), name, spec, ("cuda", 90, 32), str(tmp_path / "triton"))


def _module(path):
    """The kernel file imported as the loader imports a generated module: its kernels' keys pinned."""
    import importlib.util

    from torch_mirage.codegen.compile_worker import pin_kernel_keys

    spec = importlib.util.spec_from_file_location(f"kernel_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    pin_kernel_keys(module, path.read_text())
    return module


def test_generated_kernels_keys_are_pinned_to_their_source_without_tritons_dependency_walk(tmp_path, monkeypatch):
    """A generated module's @triton.jit functions get their cache keys from the module's text, its name and line:
    the same in a second load (a later process) and in the compile worker, another for other text, and Triton's
    dependency walk (about 6 ms a kernel on its first launch in each process) never runs: a worker process compiles
    the kernel for sm_90, and both loads' compiles of it are hits in Triton's cache. Under the interpreter nothing
    is pinned."""
    import triton
    import triton.runtime.jit as jit
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from torch_mirage.codegen import compile_worker, loader

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)      # @triton.jit makes JITFunctions, as on a GPU
    monkeypatch.setattr(loader, "_LOADED", {})
    first = loader.load_source(KERNEL, str(tmp_path))[0].scale
    loader._LOADED.clear()                                    # a later process: imported again
    again = loader.load_source(KERNEL, str(tmp_path))[0].scale
    other = loader.load_source(KERNEL.replace("2.0", "3.0"), str(tmp_path))[0].scale
    worker = compile_worker._module(loader.source_path(KERNEL, str(tmp_path))).scale
    assert first is not again and first.cache_key == again.cache_key == worker.cache_key != other.cache_key
    assert first.used_global_vals == {}

    def walk(*args, **kwargs):
        raise AssertionError("Triton's dependency walk ran for a pinned kernel")
    monkeypatch.setattr(jit, "DependenciesFinder", walk)
    _, options, request = _launch(tmp_path, path=Path(loader.source_path(KERNEL, str(tmp_path))))
    assert compile_pool.compile_in_workers([request], 1) == [None]
    hits = []
    monkeypatch.setattr(triton.knobs.compilation, "listener", lambda **kw: hits.append(kw["cache_hit"]))
    monkeypatch.setattr(triton.knobs.cache, "dir", request.cache_dir)
    for fn in (first, again):
        triton.compile(ASTSource(fn, SIGNATURE, {(3,): 128}, ATTRS), target=GPUTarget("cuda", 90, 32),
                       options=options.__dict__)
    assert hits == [True, True]      # a miss would compile here (under the test suite's interpreter, it raises)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    loader._LOADED.clear()
    interpreted = loader.load_source(KERNEL, str(tmp_path))[0].scale
    assert not hasattr(type(interpreted), "cache_key") and getattr(interpreted, "hash", None) is None


def test_a_worker_process_compiles_a_recorded_launch_so_that_the_launch_finds_it_in_tritons_cache(tmp_path,
                                                                                                monkeypatch):
    """The worker compiles for sm_90 (no GPU needed) what the launch would: the parent's own compile of the same
    launch, from the JIT's objects rather than the JSON, is a cache hit. A kernel that is not in the file is an
    error answer, not a dead worker."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    path, options, request = _launch(tmp_path)
    missing = _launch(tmp_path, name="nowhere")[2]
    answers = compile_pool.compile_in_workers([request, missing], 2)
    assert answers[0] is None and "AttributeError" in answers[1] and "nowhere" in answers[1]
    hits = []
    monkeypatch.setattr(triton.knobs.compilation, "listener", lambda **kw: hits.append(kw["cache_hit"]))
    monkeypatch.setattr(triton.knobs.cache, "dir", request.cache_dir)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)     # the kernel as a GPU launch has it: compiled
    triton.compile(ASTSource(_module(path).scale, SIGNATURE, {(3,): 128}, ATTRS), target=GPUTarget("cuda", 90, 32),
                   options=options.__dict__)
    assert hits == [True]      # a miss would compile here (under the test suite's interpreter, it raises)


class _FakeJIT:
    """What the cache hook reads of Triton's JITFunction; ``warmup`` calls the hook as Triton's does before a
    compile, and 'compiles' (records the thread) where the hook does not skip it."""

    def __init__(self, fn, spec, compiled):
        from triton.backends.compiler import GPUTarget

        self.fn, self.spec, self.compiled = fn, spec, compiled
        self.device_caches = {0: (None, None, GPUTarget("cuda", 90, 32), None, None)}

    def warmup(self):
        import triton
        from triton.runtime.jit import JitFunctionInfo

        hook = triton.knobs.runtime.jit_cache_hook
        skip = hook is not None and hook(key="k", repr="scale", fn=JitFunctionInfo(None, "scale", self),
                                         compile={"device": 0, "specialization_data": self.spec},
                                         is_manual_warmup=True, already_compiled=False)
        if not skip:
            self.compiled.append(threading.current_thread().name)


def test_run_all_in_processes_records_the_jobs_compiles_and_compiles_them_in_workers(tmp_path, monkeypatch):
    import triton

    path, _, good = _launch(tmp_path)
    bad = _launch(tmp_path, name="nowhere")[2]
    compiled = []
    jits = {"a": _FakeJIT(_module(path).scale.fn, good.specialization, compiled),
            "b": _FakeJIT(_module(path).scale.fn, bad.specialization, compiled),
            "c": _FakeJIT(_module(path).scale.fn, good.specialization, compiled)}   # the same launch as a
    jits["b"].fn = type("F", (), {"__name__": "nowhere", "__code__": jits["a"].fn.__code__})()
    monkeypatch.setattr(compile_pool, "_processes_wanted", lambda: True)
    monkeypatch.setattr(triton.knobs.cache, "dir", good.cache_dir)
    run = compile_pool.run_all(list(jits), lambda name: jits[name].warmup(), 4)
    assert run.processes and run.how == "3 processes" and compiled == []    # nothing compiled in this process
    assert list(run.errors) == ["b"] and "nowhere" in str(run.errors["b"])
    assert triton.knobs.runtime.jit_cache_hook is None                      # the hook is the caller's again
    assert any(p.suffix == ".cubin" for p in (tmp_path / "triton").rglob("*"))


def test_workers_that_fail_leave_the_compiles_to_threads_with_one_warning(tmp_path, monkeypatch, caplog):
    path, _, good = _launch(tmp_path)
    compiled = []
    jits = {n: _FakeJIT(_module(path).scale.fn, good.specialization, compiled) for n in "ab"}

    def no_workers(count):
        raise compile_pool.CompileWorkersFailed("cannot start python: no such file")
    monkeypatch.setattr(compile_pool, "_processes_wanted", lambda: not compile_pool._BROKEN.is_set())
    monkeypatch.setattr(compile_pool, "_workers", no_workers)
    try:
        with caplog.at_level(logging.WARNING, logger="torch_mirage"):
            run = compile_pool.run_all(list(jits), lambda name: jits[name].warmup(), 2)
            again = compile_pool.run_all(list(jits), lambda name: jits[name].warmup(), 2)
    finally:
        compile_pool._BROKEN.clear()
    assert not run.processes and not again.processes and run.errors == {}
    assert len(compiled) == 4 and all(t.startswith("torch_mirage_compile") for t in compiled)
    assert caplog.text.count("compile worker processes failed (cannot start python") == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_launch_candidates_compile_in_worker_processes_and_load_from_the_cache_on_the_gpu(tmp_path, monkeypatch,
                                                                                          caplog):
    """A tuned μGraph kernel's candidates on the GPU: compiled in worker processes, and every compile the parent
    then makes of them is a hit in Triton's cache (a fresh one), their C launchers too (Triton 3.6 builds one per
    signature; 3.7 none); the result matches the kernel's own schedule."""
    import triton
    from triton.runtime import build as triton_build

    from torch_mirage.superopt import library
    from torch_mirage.superopt.compile import compile_ugraph

    hits, builds = [], []
    real_build = triton_build._build
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / "triton"))
    triton.runtime.driver.active.utils      # the driver's own module, built (once per process) before the count
    monkeypatch.setattr(triton.knobs.compilation, "listener", lambda **kw: hits.append(kw["cache_hit"]))
    monkeypatch.setattr(triton_build, "_build", lambda *a, **kw: builds.append(a[0]) or real_build(*a, **kw))
    g = library.rmsnorm_linear(4, 1024, 512, dtype="float16")
    xs = [torch.randn(i.attrs["shape"], device="cuda", dtype=torch.float16) for i in g.inputs]
    with caplog.at_level(logging.INFO, logger="torch_mirage"), compile_workers(4, processes=True):
        compiled = compile_ugraph(g, xs, cache=None, cache_dir=str(tmp_path / "mirage"))
    assert "processes; 0 failed" in caplog.text
    assert len(hits) >= 2 and all(hits), hits
    assert not builds, builds        # the parent ran no C compiler: the workers built the launchers
    plain = compile_ugraph(g, xs, cache=None, cache_dir=str(tmp_path / "mirage"), tune=False)
    torch.testing.assert_close(compiled(*xs)[0], plain(*xs)[0], rtol=2e-2, atol=2e-2)


def test_a_worker_that_does_not_answer_is_killed_and_the_round_fails(tmp_path, monkeypatch):
    """A hung worker (here one that reads nothing and sleeps) is killed after the answer timeout, and the round
    raises CompileWorkersFailed, which run_all turns into threads."""
    import subprocess
    import sys

    hung = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    monkeypatch.setattr(compile_pool, "_workers", lambda count: [hung])
    start = time.perf_counter()
    with pytest.raises(compile_pool.CompileWorkersFailed, match="no answer in 0.5 s"):
        compile_pool.compile_in_workers([_launch(tmp_path)[2]], 1, timeout_s=0.5)
    assert time.perf_counter() - start < 10 and hung.wait(timeout=10) != 0    # killed, not left sleeping


# ---------------------------------------------------------------- every op's candidates in one round
def _multi_op_graphs():
    """μGraphs of several graph-defined ops, with views between them: split-KV decode (its partial states
    reshaped for the combine) and split-KV over two row blocks (Q, K, V and the states reshaped)."""
    from torch_mirage.superopt.attention_seeds import flash_decoding
    yield flash_decoding(1, 2, 4, 32, 16, scale=0.25, mask=(1, 1), dtype="float32", splits=4, tile=4)
    yield flash_decoding(2, 2, 20, 32, 16, scale=0.25, dtype="float32", splits=2, tile=8, q_blocks=2)


@pytest.mark.parametrize("graph", list(_multi_op_graphs()), ids=["decode", "row-blocks"])
def test_op_input_placeholders_are_what_each_op_is_given(monkeypatch, tmp_path, graph):
    """The meta placeholders standing for each graph-defined op's inputs, made without running anything, have the
    shapes, strides and dtypes of the tensors compile_ugraph passes that op (what its kernels specialise on)."""
    from torch_mirage.superopt import compile as compile_module

    given: list[list] = []
    real_call = compile_module.BlockLauncher.__call__

    def call(self, *inputs, **kw):
        given.append([(tuple(x.shape), x.stride(), x.dtype) for x in inputs])
        return real_call(self, *inputs, **kw)

    monkeypatch.setattr(compile_module.BlockLauncher, "__call__", call)
    xs = [torch.randn(i.attrs["shape"]) for i in graph.inputs]
    compile_module.compile_ugraph(graph, xs, cache=None, cache_dir=str(tmp_path), tune=False)
    placeholders = compile_module.op_input_placeholders(graph, xs)
    assert len(given) == len(placeholders) >= 2
    made = [[(tuple(x.shape), x.stride(), x.dtype) for x in inputs] for inputs in placeholders.values()]
    assert made == given
    # nothing is allocated or run: each tensor is a meta placeholder or the μGraph's own input (or a view of it)
    storages = {x.untyped_storage().data_ptr() for x in xs}
    tensors = [x for inputs in placeholders.values() for x in inputs]
    assert all(x.is_meta or x.untyped_storage().data_ptr() in storages for x in tensors)
    assert any(x.is_meta for x in tensors)


@pytest.mark.parametrize("graph", list(_multi_op_graphs()), ids=["decode", "row-blocks"])
def test_op_input_placeholders_under_the_build_stages_fake_mode(graph):
    """The build stage runs under AOTAutograd's fake mode, and the compiles ahead read meta examples there: the
    placeholders (views of meta tensors among them) are made outside it, the same as without one (H100 11-28:
    every weight-streaming μGraph of a decode graph raised there, and none of their candidates compiled ahead)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch_mirage.superopt.compile import op_input_placeholders

    metas = [torch.empty(i.attrs["shape"], device="meta") for i in graph.inputs]
    want = [[(tuple(x.shape), x.stride(), x.dtype) for x in xs] for xs in op_input_placeholders(graph, metas).values()]
    with FakeTensorMode():
        got = op_input_placeholders(graph, metas)
    assert [[(tuple(x.shape), x.stride(), x.dtype) for x in xs] for xs in got.values()] == want


def test_tuning_compiles_nothing_off_cuda():
    from torch_mirage.superopt.compile import tuning_compiles

    graph = next(_multi_op_graphs())
    assert tuning_compiles(graph, [torch.randn(i.attrs["shape"]) for i in graph.inputs]) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("processes", [False, True], ids=["threads", "processes"])
@pytest.mark.parametrize("meta", [False, True], ids=["examples", "meta-examples"])
def test_every_ops_candidates_compile_ahead_in_one_round_on_the_gpu(tmp_path, monkeypatch, processes, meta):
    """The launch candidates of both ops of split-KV decode attention compiled in one round (tuning_compiles):
    the tuning after it compiles no kernel Triton's (fresh) cache does not already hold, and the tuned μGraph
    matches its own schedule. ``meta``: the compiles ahead made from meta tensors of the examples and the device
    (as the build stage's one round for a whole graph makes them) are the kernels the tuning launches."""
    import triton

    from torch_mirage.compile_pool import run_all
    from torch_mirage.superopt.attention_seeds import flash_decoding
    from torch_mirage.superopt.compile import compile_ugraph, tuning_compiles

    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / "triton"))
    kernels = lambda: sorted(p.name for p in (tmp_path / "triton").rglob("*.cubin"))
    g = flash_decoding(2, 8, 4, 1024, 128, scale=0.088, dtype="float16", splits=8)
    xs = [torch.randn(i.attrs["shape"], device="cuda", dtype=getattr(torch, i.attrs["dtype"])) for i in g.inputs]
    ahead_of = [x.to("meta") for x in xs] if meta else xs
    jobs = tuning_compiles(g, ahead_of, cache=None, cache_dir=str(tmp_path / "mirage"), label="decode",
                           device=xs[0].device)
    assert len({name.split()[0] for name in jobs}) == 2, sorted(jobs)   # the split kernel's candidates, the combine's
    with compile_workers(4, processes=processes):
        done = run_all(list(jobs), lambda name: jobs[name](), 4)
    assert done is not None and done.processes == processes and not done.errors, done
    ahead = kernels()
    assert len(ahead) >= len(jobs)
    with compile_workers(4, processes=processes):
        compiled = compile_ugraph(g, xs, cache=None, cache_dir=str(tmp_path / "mirage"), label="decode")
    assert kernels() == ahead          # every kernel the tuning launched was compiled ahead
    plain = compile_ugraph(g, xs, cache=None, cache_dir=str(tmp_path / "mirage"), tune=False, label="decode")
    torch.testing.assert_close(compiled(*xs)[0], plain(*xs)[0], rtol=2e-2, atol=2e-2)


def test_tritons_cached_ptxas_version_follows_the_ptxas_the_environment_names(monkeypatch, caplog):
    """Inductor sets TRITON_PTXAS_PATH after Triton cached its ptxas's version (a part of every cache key); worker
    processes started after that key their compiles by the new one, so this process drops its cached version."""
    import functools

    nvidia = pytest.importorskip("triton.backends.nvidia.compiler")
    tool = {"version": "ptxas 12.8"}

    @functools.lru_cache()
    def version(arch: int = 80):
        return f"Cuda compilation tools\n{tool['version']} (sm_{arch})"
    monkeypatch.setattr(nvidia, "get_ptxas_version", version)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    assert not compile_pool.align_ptxas_version()          # nothing cached yet: nothing to align
    assert version(90).endswith("12.8 (sm_90)")
    tool["version"] = "ptxas 13.0"
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/torch/bin/ptxas")
    with caplog.at_level(logging.INFO, logger="torch_mirage"):
        assert compile_pool.align_ptxas_version()
    assert version(90).endswith("13.0 (sm_90)")
    assert "ptxas changed" in caplog.text
    assert not compile_pool.align_ptxas_version()          # aligned now: nothing more to do
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/other/ptxas")
    assert not compile_pool.align_ptxas_version()          # checked again: the same version, nothing to do


def test_workers_started_under_another_ptxas_are_replaced(monkeypatch):
    """Workers key their kernels by the ptxas TRITON_PTXAS_PATH named when they started; where it changed since
    (Inductor sets it), they are stopped and new ones started with the current environment."""
    started: list = []

    class Worker:
        def __init__(self, cmd, env, **kwargs):
            self.env, self.stopped = env, False
            self.stdin = self
            started.append(self)

        def poll(self):
            return 0 if self.stopped else None

        def close(self):
            self.stopped = True

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(compile_pool.subprocess, "Popen", Worker)
    monkeypatch.setattr(compile_pool, "_WORKERS", [])
    monkeypatch.setattr(compile_pool, "_WORKER_PTXAS", [])
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    first = compile_pool._workers(2)
    assert compile_pool._workers(2) == first and len(started) == 2      # kept while the variable stays
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/torch/bin/ptxas")
    second = compile_pool._workers(2)
    assert all(w.stopped for w in first) and len(started) == 4
    assert all(w.env["TRITON_PTXAS_PATH"] == "/torch/bin/ptxas" for w in second)
    compile_pool._stop_workers()


def test_triton_cache_dir_and_ptxas_are_pinned_where_inductor_puts_them(monkeypatch, tmp_path):
    """Before mirage's first CUDA compile the process's ``TRITON_CACHE_DIR`` and ``TRITON_PTXAS_PATH`` are
    Inductor's (which Inductor would set only at its first kernel, after some of mirage's compiled under Triton's
    own directory and ptxas, so that a later process keyed them otherwise); values the user set stay; off CUDA
    nothing is set; a torch without a ptxas of its own leaves Triton's."""
    import os

    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir
    from torch_mirage.codegen import aot

    ptxas = tmp_path / "ptxas"
    ptxas.write_text("#!/bin/sh\n")
    ptxas.chmod(0o755)
    monkeypatch.setattr(aot, "inductor_ptxas", lambda: str(ptxas))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    assert aot.pin_triton_environment(torch.device("cpu")) is None and "TRITON_CACHE_DIR" not in os.environ
    assert aot.pin_triton_environment(None) is None and "TRITON_PTXAS_PATH" not in os.environ
    want = triton_cache_dir(1)
    assert aot.pin_triton_environment(torch.device("cuda", 1)) == {
        "TRITON_CACHE_DIR": want, "TRITON_PTXAS_PATH": str(ptxas)} and os.environ["TRITON_CACHE_DIR"] == want
    assert want.endswith(os.path.join("triton", "1"))
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/of/mine")
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/my/ptxas")
    assert aot.pin_triton_environment(torch.device("cuda")) == {
        "TRITON_CACHE_DIR": "/somewhere/of/mine", "TRITON_PTXAS_PATH": "/my/ptxas"}
    monkeypatch.delenv("TRITON_PTXAS_PATH")
    monkeypatch.setattr(aot, "inductor_ptxas", lambda: None)
    assert aot.pin_triton_environment(torch.device("cuda"))["TRITON_PTXAS_PATH"] is None
    assert "TRITON_PTXAS_PATH" not in os.environ


def _counting_key(value, calls):
    """A stand-in for Triton's lru-cached ``triton_key`` that counts its computations."""
    import functools

    @functools.lru_cache()
    def triton_key():
        calls.append(value)
        return value
    return triton_key


def test_tritons_own_key_is_read_from_the_cache_directory_in_a_later_process(tmp_path, monkeypatch):
    """``memoize_triton_key``: the first process computes Triton's key once and writes it; a later process (a fresh
    ``triton_key``) reads it from the file without computing; another stamp of Triton's files (an upgrade)
    computes and writes its own, as does a file that holds no key; a key computed already in this process is left
    alone; Inductor's shim, which bound Triton's function when it was imported, gets the memo too. On the real
    Triton the memo gives Triton's own key."""
    import types

    import triton
    from triton.runtime import cache as triton_cache

    from torch_mirage.codegen import compile_worker

    a, b, c, d = (f"{triton.__version__}-key-{x}" for x in "abcd")   # Triton's keys start with its version
    calls: list[str] = []
    monkeypatch.setattr(triton_cache, "triton_key", _counting_key(a, calls))
    shim = types.ModuleType("torch._inductor.runtime.triton_compat")   # Inductor's import of Triton's function
    shim.triton_key = triton_cache.triton_key
    monkeypatch.setitem(sys.modules, "torch._inductor.runtime.triton_compat", shim)
    assert compile_worker.memoize_triton_key(str(tmp_path))
    assert shim.triton_key is triton_cache.triton_key and shim.triton_key.torch_mirage_memo
    assert triton_cache.triton_key() == triton_cache.triton_key() == a and calls == [a]
    assert compile_worker.memoize_triton_key(str(tmp_path))          # installed once: a no-op
    monkeypatch.setattr(triton_cache, "triton_key", _counting_key(b, calls))   # a later process
    assert compile_worker.memoize_triton_key(str(tmp_path))
    assert triton_cache.triton_key() == a and calls == [a]
    monkeypatch.setattr(compile_worker, "_triton_files_stamp", lambda triton_dir: "f" * 64)   # Triton changed
    monkeypatch.setattr(triton_cache, "triton_key", _counting_key(c, calls))
    assert compile_worker.memoize_triton_key(str(tmp_path))
    assert triton_cache.triton_key() == c and calls == [a, c]
    (tmp_path / compile_worker.TRITON_KEY_FILE.format("f" * 32)).write_text("")   # a file that holds no key
    monkeypatch.setattr(triton_cache, "triton_key", _counting_key(d, calls))
    assert compile_worker.memoize_triton_key(str(tmp_path))
    assert triton_cache.triton_key() == d and calls == [a, c, d]
    computed = _counting_key(d, calls)
    computed()
    monkeypatch.setattr(triton_cache, "triton_key", computed)
    assert not compile_worker.memoize_triton_key(str(tmp_path)) and triton_cache.triton_key is computed
    monkeypatch.undo()

    real = triton_cache.triton_key
    own = real.__wrapped__() if hasattr(real, "__wrapped__") else real()
    monkeypatch.setattr(triton_cache, "triton_key", _counting_key(own, calls))
    assert compile_worker.memoize_triton_key(str(tmp_path / "real"))
    assert triton_cache.triton_key() == own
    monkeypatch.setattr(triton_cache, "triton_key", _counting_key(f"{triton.__version__}-stale", calls))
    assert compile_worker.memoize_triton_key(str(tmp_path / "real")) and triton_cache.triton_key() == own


@pytest.mark.parametrize("cache", [True, False])
def test_the_backend_memoizes_tritons_key_only_with_the_disk_cache_on(tmp_path, monkeypatch, cache):
    """A compile installs the memo in its cache directory before anything compiles; with ``cache=False`` (the
    disk cache off) it writes nothing there and leaves Triton's function alone."""
    from triton.runtime import cache as triton_cache

    calls: list[str] = []
    import triton
    fake = _counting_key(f"{triton.__version__}-key", calls)
    monkeypatch.setattr(triton_cache, "triton_key", fake)
    torch._dynamo.reset()
    fn = torch.compile(lambda x: torch.relu(x) * 2, backend="mirage",
                       options={"cache": cache, "cache_dir": str(tmp_path)})
    x = torch.randn(8)
    assert torch.equal(fn(x), torch.relu(x) * 2)
    torch._dynamo.reset()
    assert (triton_cache.triton_key is not fake) == cache
    if cache:
        assert triton_cache.triton_key() == f"{triton.__version__}-key" and calls
        assert list(tmp_path.glob("torch_mirage-triton-key-*.txt"))
    else:
        assert not list(tmp_path.glob("torch_mirage-triton-key-*.txt"))
