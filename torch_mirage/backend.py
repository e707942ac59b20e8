"""The Dynamo backend: ``torch.compile(model, backend="mirage")``.

Registered through the ``torch_dynamo_backends`` entry point as
:func:`mirage_backend`. Each Dynamo graph goes through AOTAutograd with
Inductor's decompositions to functional ATen; every resulting graph
(inference, or forward and backward when training) is compiled by
:func:`torch_mirage.pipeline.compile_graph`.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable, Sequence

import torch
from functorch.compile import min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd

from . import config as config_mod
from . import failures
from .cache import DiskCache, cache_key
from .capture.host_scalars import split_host_scalars, symbolic_positions
from .codegen.aot import pin_triton_environment
from .codegen.compile_worker import memoize_triton_key
from .compile_pool import align_ptxas_version
from .partition.region import Claimer, Reason
from .failures import Failure
from .context import CompileContext
from .pipeline import WholeGraphToInductor, compile_graph, wrap_cuda_graph
from .report import GraphReport, RegionReport, Report
from .runtime.assemble import inductor_configs
from .runtime.choose import FasterOf, writes_in_place
from .runtime.cudagraph import input_device
from .runtime.static_sizes import StaticSizes, size_key
from .tune import cached_choice

log = logging.getLogger("torch_mirage")


class _OwnHandler(logging.StreamHandler):
    """The stderr handler the backend adds when nobody configured logging."""


def _configure_logging(level: str, explicit: bool) -> None:
    """The ``torch_mirage`` logger's level: ``MIRAGE_LOG_LEVEL`` (or ``options={'log_level': ...}``) when given;
    otherwise a level already set on the logger stays (``TORCH_LOGS="+torch_mirage"``,
    ``torch._logging.set_logs(modules=...)`` or the application's own), and an unset logger gets ``level``."""
    if explicit or log.level == logging.NOTSET:
        log.setLevel(level)
    own = [h for h in log.handlers if isinstance(h, _OwnHandler)]
    if len(own) < len(log.handlers) or logging.getLogger().handlers:
        for h in own:   # someone else prints our records now (torch._logging, the application): not twice
            log.removeHandler(h)
    elif not own:
        # nobody configured logging: print ours to stderr (an application's own handlers take precedence)
        handler = _OwnHandler()
        handler.setFormatter(logging.Formatter("[%(name)s %(levelname)s] %(message)s"))
        log.addHandler(handler)


def _static_input_indices() -> Sequence[int]:
    ctx = torch._guards.TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
    return tuple(getattr(meta, "static_input_indices", None) or ())


def _lifted_tensors(gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    """The parameters and buffers AOTAutograd lifts into the ATen graph's first inputs, in that order."""
    return [*dict(gm.named_parameters(remove_duplicate=False)).values(),
            *dict(gm.named_buffers(remove_duplicate=False)).values()]


def _lifted(gm: torch.fx.GraphModule) -> int:
    """How many inputs :func:`_lifted_tensors` are."""
    return len(_lifted_tensors(gm))


def _observed(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], aten_inputs: Sequence[Any]) -> dict[int, Any]:
    """Dynamo's real example tensors by the ATen graph's input index, where the two line up (the lifted
    parameters, then the user inputs, each of the same shape and dtype; a symbolic size is not compared, which would
    specialise it); empty where they do not."""
    lifted = _lifted(gm)
    if len(aten_inputs) != lifted + len(example_inputs):
        return {}
    out = {}
    for j, real in enumerate(example_inputs):
        fake = aten_inputs[lifted + j]
        if isinstance(real, torch.Tensor) and isinstance(fake, torch.Tensor) \
                and all(type(n) is int for n in fake.shape) and tuple(real.shape) == tuple(fake.shape) \
                and real.dtype == fake.dtype and not isinstance(real, torch._subclasses.FakeTensor):
            out[lifted + j] = real
    return out


class MirageBackend:
    """A configured backend instance. ``torch.compile(m, backend=MirageBackend(options={...}))``
    is the same as ``backend="mirage", options={...}``; ``report`` collects what was done."""

    def __init__(self, options: dict | None = None, report: Report | None = None,
                 claimers: Sequence[Claimer] | None = None):
        self.options = dict(options or {})
        self.report = report if report is not None else Report()
        self.claimers = claimers
        self._cache: DiskCache | None = None    # the disk cache of the graph being compiled (MIRAGE_CACHE)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
        host = split_host_scalars(gm, example_inputs)
        if host is None:
            return self._compile_sized(gm, example_inputs, **kwargs)
        first_graph = len(self.report.graphs)
        compiled = self._compile(host.static_graph, host.static_inputs(example_inputs), **kwargs)
        for graph in self.report.graphs[first_graph:]:
            graph.host_scalars = host.names
        log.info("torch_mirage: symbolic scalar input(s) %s only feed host arithmetic: computed in Python on each "
                 "call around the graph, which compiled with static shapes", ", ".join(host.names))
        return host.around(compiled)

    def _options(self, kwargs: dict) -> dict:
        """A compile's options: this backend's, then torch.compile's ``options=``."""
        return {**self.options, **(kwargs.get("options") or {})}

    def _config(self, kwargs: dict) -> config_mod.Config:
        """The configuration of a compile: the environment, then :meth:`_options`."""
        options = self._options(kwargs)
        if kwargs.get("mode") not in (None, "default"):
            raise ValueError(f"torch_mirage: mode={kwargs['mode']!r} is not supported; use options={{...}} "
                             f"(known keys: {[f for f in config_mod.Config.__dataclass_fields__]})")
        return config_mod.load(options)

    def _compile_sized(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
        """:meth:`_compile`; an inference graph of symbolic sizes is then compiled again with its sizes fixed at each
        size that comes back, up to ``static_sizes`` of them
        (:class:`~torch_mirage.runtime.static_sizes.StaticSizes`)."""
        positions = symbolic_positions(gm, example_inputs)
        first = len(self.report.graphs)
        compiled = self._compile(gm, example_inputs, **kwargs)
        cfg, graphs = self._config(kwargs), self.report.graphs[first:]
        if not positions or cfg.static_sizes == 0 or not graphs or any(g.kind != "inference" for g in graphs):
            return compiled
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        index = graphs[0].index
        for g in graphs:
            g.static_sizes = cfg.static_sizes
        # what the user runs at a size without a static compile: Inductor's compile of this graph at symbolic
        # sizes (in its per-size CUDA graphs). Each static compile is timed against it rather than against a
        # fresh Inductor compile at that size, which would cost seconds a size (llama prefill, H200: 3.5-4.5 s
        # of a 14-18 s static compile) to beat a version nobody runs.
        symbolic_inductor = compiled if all(g.whole_graph_to_inductor for g in graphs) else None

        def describe(key: tuple) -> str:
            return f"graph {index}'s " + ", ".join(
                f"{names[i] if i < len(names) else i}={list(v[:len(v) // 2]) if isinstance(v, tuple) else v}"
                for i, v in zip(positions, key))

        def compile_at(args: list) -> Any:
            from torch._guards import TracingContext, tracing
            from torch._subclasses.fake_tensor import FakeTensorMode

            start = len(self.report.graphs)
            # a context of its own, as Dynamo gives each compile (Inductor's compiles and AOTAutograd's static
            # inputs read it); the call's tensors have concrete sizes, so the compile is static
            with tracing(TracingContext(FakeTensorMode())):
                fn = self._compile(gm, args, inductor_version=symbolic_inductor, **kwargs)
            for g in self.report.graphs[start:]:
                g.sizes_of = describe(size_key(args, positions))
            return fn
        return StaticSizes(compile_at, compiled, positions, cfg.static_sizes, describe, cfg.strict)

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *,
                 inductor_version: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
        """The Dynamo graph (static, or symbolic where Dynamo made it so) through AOTAutograd and the pipeline.
        ``inductor_version``: Inductor's compile of this graph already made (at symbolic sizes, in its CUDA-graph
        wrapper), which mirage's version is timed against instead of a compile of its own."""
        cfg = self._config(kwargs)
        _configure_logging(cfg.log_level, explicit=bool({"log_level", "mirage.log_level"} & set(self._options(kwargs)))
                           or config_mod.env_name("log_level") in os.environ)
        cache = self._cache = DiskCache(cfg.cache_dir) if cfg.cache else None

        def inner(kind: str, graph: torch.fx.GraphModule, inputs: Sequence[Any]) -> Any:
            ctx = CompileContext(cfg, self.report.new_graph(kind), cache, _static_input_indices(),
                                 observed_inputs=_observed(gm, example_inputs, inputs) if kind != "backward" else {})
            return compile_graph(graph, inputs, ctx, self.claimers)

        from torch._inductor.decomposition import select_decomp_table

        compiler = aot_autograd(
            fw_compiler=functools.partial(inner, "forward"),
            bw_compiler=functools.partial(inner, "backward"),
            inference_compiler=functools.partial(inner, "inference"),
            partition_fn=min_cut_rematerialization_partition,
            decompositions=select_decomp_table(),
            keep_inference_input_mutations=True,
        )
        first_graph = len(self.report.graphs)
        ptxas = os.environ.get("TRITON_PTXAS_PATH")
        if cache is not None:   # before Inductor or mirage compiles or loads a kernel (codegen.compile_worker)
            memoize_triton_key(cfg.cache_dir)
        pinned = pin_triton_environment(input_device(example_inputs))  # before any kernel of mirage's or Inductor's
        if pinned and pinned["TRITON_PTXAS_PATH"] != ptxas:             # compiles
            align_ptxas_version()   # a Triton that compiled before this keys its kernels by the ptxas set now
        try:
            with failures.stage("capture"):
                compiled = compiler(gm, example_inputs)
        except WholeGraphToInductor as whole:
            if inductor_version is not None and whole.failure is None:
                # nothing of mirage's at this size: Inductor's compile already made serves it, no compile of its own
                return _served_by(inductor_version, self.report.graphs[-1])
            return self._inductor_whole_graph(gm, example_inputs, cfg, self.report.graphs[-1], whole)
        except Exception as e:
            if cfg.strict:
                raise
            # AOTAutograd itself failed (our inner compilers never raise outside strict mode): the Dynamo graph
            # replaces whatever this call reported
            del self.report.graphs[first_graph:]
            report = self.report.new_graph("dynamo")
            failure = Failure(failures.stage_of(e, "capture"), _dynamo_summary(gm), failures.describe_error(e), "")
            report.fallback_error = f"{failure.stage} stage: {failure.error}"
            report.regions = [RegionReport(_dynamo_ops(gm), cfg.fallback, Reason.COMPILE_ERROR,
                                           report.fallback_error)]
            whole = WholeGraphToInductor(f"the {failure.stage} stage failed", (), failure=failure)
            if cfg.fallback == "inductor":
                return self._inductor_whole_graph(gm, example_inputs, cfg, report, whole)
            failure.outcome = "the graph runs eagerly (MIRAGE_FALLBACK=eager)"
            log.warning("%s", failures.format_failure(failure, f"Dynamo graph {report.index}"))
            return gm.forward
        graphs = self.report.graphs[first_graph:]
        if len(graphs) == 1:
            graph = graphs[0]
            # timed against Inductor's compile on the first call, or (when it cannot be timed) Inductor's kept
            step = (("whole-graph timing", self._faster_of_mirage_and_inductor) if _timed_against_inductor(graph, cfg)
                    else ("untimed graph to Inductor", self._untimed_to_inductor) if graph.untimed_reason else None)
            if step is not None:
                name, decide = step
                try:
                    with failures.stage(name):
                        return decide(gm, example_inputs, cfg, compiled, graph, inductor_version)
                except Exception as e:
                    if cfg.strict:
                        raise
                    failure = Failure(name, _dynamo_summary(gm), failures.describe_error(e),
                                      "mirage's compile runs without being timed against Inductor's")
                    log.warning("%s", failures.format_failure(failure, f"{graph.kind} graph {graph.index}"))
        return compiled

    def _untimed_to_inductor(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], cfg: config_mod.Config,
                             mirage: Any, report: GraphReport, inductor_version: Callable[..., Any] | None = None
                             ) -> Any:
        """Mirage's version could not be timed against Inductor's: never keep a version not shown to be no
        slower, so the graph runs as ``backend="inductor"`` would run it (in our CUDA graph where allowed;
        ``inductor_version``: that compile, already made, in its own wrapper)."""
        if inductor_version is not None:
            _inductor_kept(report, f"not timed ({report.untimed_reason}): Inductor's compile at symbolic sizes kept")
            return _served_by(inductor_version, report)
        lifted = _lifted(gm)
        aligned = report.num_inputs == lifted + len(example_inputs)
        static = tuple(i - lifted for i in _static_input_indices() if i >= lifted) if aligned else ()
        mutated = tuple(i - lifted for i in report.mutated_inputs if i >= lifted) if aligned else ()
        blocker = (None if report.cuda_graph else (report.cuda_graph_reason or "not captured")) if aligned else \
            "inputs not aligned with the ATen graph's"
        try:
            inductor = self._inductor_compile(gm, example_inputs, cfg, report)
        except Exception as e:
            if cfg.strict:
                raise
            log.info("torch_mirage: graph %d: Inductor could not compile it (%s: %s); mirage's version kept untimed",
                     report.index, type(e).__name__, e)
            return mirage
        _inductor_kept(report, f"not timed ({report.untimed_reason}): Inductor's compile kept")
        report.cuda_graph, report.cuda_graph_reason = False, ""
        return _in_cuda_graph(inductor, blocker, static, cfg, report, mutated)

    def _inductor_compile(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], cfg: config_mod.Config,
                          report: GraphReport) -> Any:
        """Inductor's own ``compile_fx`` of the Dynamo graph (the user's ``backend="inductor"``)."""
        from torch._inductor.compile_fx import compile_fx

        patches = inductor_configs(cfg.inductor_mode)
        with report.stage("inductor"):
            return compile_fx(gm, example_inputs, config_patches=patches)

    def _inductor_whole_graph(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], cfg: config_mod.Config,
                              report: GraphReport, whole: WholeGraphToInductor) -> Any:
        """Inductor's own compile of the Dynamo graph, in our CUDA-graph wrapper where capture is safe; eager
        only when Inductor fails too. A mirage failure that sent the graph here (``whole.failure``) is logged
        once, with where the graph went."""
        context = f"{report.kind} graph {report.index}"
        try:
            compiled = self._inductor_compile(gm, example_inputs, cfg, report)
        except Exception as e:
            if cfg.strict:
                raise
            error = failures.describe_error(e)
            if whole.failure is not None:
                whole.failure.outcome = f"Inductor could not compile the graph either ({error}), so it runs eagerly"
                log.warning("%s", failures.format_failure(whole.failure, context))
            else:
                log.warning("torch_mirage: Inductor could not compile %s (%s), so it runs eagerly. %s", context,
                            error, failures.STRICT_HINT)
            report.fallback_error = report.fallback_error or error
            for region in report.regions:
                region.compiled_by = "eager"
            return gm.forward
        if whole.failure is not None:
            whole.failure.outcome = "the whole graph runs through Inductor's compile_fx instead"
            log.warning("%s", failures.format_failure(whole.failure, context))
        try:
            with failures.stage("cuda graph"):
                blocker = whole.cuda_graph_blocker
                if blocker is None and whole.mutated_input_indices and len(example_inputs) != report.num_inputs:
                    # the writes are known by the ATen graph's input positions, which differ from this graph's here
                    blocker = "input mutation (the written inputs cannot be matched to the graph's own inputs)"
                return _in_cuda_graph(compiled, blocker, whole.static_input_indices, cfg, report,
                                      whole.mutated_input_indices)
        except Exception as e:
            if cfg.strict:
                raise
            report.cuda_graph, report.cuda_graph_reason = False, f"cuda graph stage failed: {failures.describe_error(e)}"
            log.warning("%s", failures.format_failure(Failure(
                "cuda graph", _dynamo_summary(gm), failures.describe_error(e),
                "Inductor's compile runs without our CUDA graph"), context))
            return compiled

    def _faster_of_mirage_and_inductor(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                                       cfg: config_mod.Config, mirage: Any, report: GraphReport,
                                       inductor_version: Callable[..., Any] | None = None) -> Any:
        """Mirage's compile and Inductor's, the faster one chosen by timing on the first call.
        ``inductor_version``: Inductor's compile already made, in its own CUDA-graph wrapper (not compiled here)."""
        # AOTAutograd's inputs are the Dynamo graph's own parameters and buffers, then the Dynamo inputs
        lifted = _lifted_tensors(gm)
        aligned = report.num_inputs == len(lifted) + len(example_inputs)
        positions = report.mutated_inputs
        if (positions and not aligned) or (writes_in_place(gm) and not positions):
            # writes we cannot name (inputs deduplicated by AOTAutograd, or a write the ATen graph does not show):
            # re-running the graph for timing could change the caller's state, so mirage's version is kept
            report.untimed_reason = "it writes state the timing could not save and restore"
            return self._untimed_to_inductor(gm, example_inputs, cfg, mirage, report, inductor_version)
        static = tuple(i - len(lifted) for i in _static_input_indices() if i >= len(lifted)) if aligned else ()
        written = lambda args: [[*lifted, *args][i] for i in positions]
        if inductor_version is not None:
            report.choice_against = "the graph at symbolic sizes (what runs this size otherwise)"
        key = whole_graph_key(gm, example_inputs, cfg, report) if self._cache is not None else None
        verdict = cached_choice(self._cache, key, ["mirage", "inductor"])
        if verdict is not None and verdict.winner == "mirage":   # a warm compile: Inductor's is neither built nor timed
            _choice_recorder(report, cached=True)("mirage", verdict.times)
            return mirage
        if inductor_version is not None:
            inductor = inductor_version
        else:
            try:
                inductor = self._inductor_compile(gm, example_inputs, cfg, report)
            except Exception as e:
                if cfg.strict:
                    raise
                report.untimed_reason = f"Inductor could not compile the graph ({type(e).__name__}: {e})"
                log.info("torch_mirage: graph %d: %s", report.index, report.untimed_reason)
                return mirage
            blocker = None if report.cuda_graph else (report.cuda_graph_reason or "not captured")
            mutated = tuple(i - len(lifted) for i in positions if i >= len(lifted))
            # the wrapper's own report (what it records is not this graph's), symbolic where the graph is: a CUDA
            # graph per input size, as mirage's version has
            own = GraphReport(report.index, report.kind, symbolic_sizes=report.symbolic_sizes)
            inductor = _in_cuda_graph(inductor, blocker, static, cfg, own, mutated, log_symbolic=False)
        if verdict is not None:                                   # Inductor's won when this graph was timed
            _choice_recorder(report, cached=True)("inductor", verdict.times)
            return inductor
        return FasterOf({"mirage": mirage, "inductor": inductor}, _choice_recorder(report), written,
                        in_callers_graph=not cfg.cuda_graphs, cache=self._cache, key=key, stage=report.stage)


def _timed_against_inductor(report: GraphReport, cfg: config_mod.Config) -> bool:
    applies = (cfg.measure_regions and cfg.fallback == "inductor" and report.kind == "inference"
               and report.fallback_error is None and any(r.compiled_by == "mirage" for r in report.regions)
               and torch.cuda.is_available())
    if applies and not report.timeable:
        report.untimed_reason = ("random ops, inputs not all CUDA tensors, or writes beyond what the graph shows "
                                 "(re-running it could change the caller's state)")
    return applies and report.timeable


def _in_cuda_graph(compiled: Any, blocker: str | None, static_input_indices: Sequence[int], cfg: config_mod.Config,
                   report: GraphReport, mutated_input_indices: Sequence[int] = (), log_symbolic: bool = True) -> Any:
    """An unboxed ``compiled(*args)`` in our CUDA-graph wrapper where capture is allowed (``log_symbolic``: see
    :func:`~torch_mirage.pipeline.wrap_cuda_graph`)."""
    if blocker is not None or not cfg.cuda_graphs:
        wrap_cuda_graph(None, blocker, (), cfg, report, log_symbolic=log_symbolic)   # records the reason only
        return compiled
    boxed = wrap_cuda_graph(lambda args: compiled(*args), None, static_input_indices, cfg, report,
                            mutated_input_indices, log_symbolic=log_symbolic)
    return lambda *args: boxed(list(args))


def whole_graph_key(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], cfg: config_mod.Config,
                    report: GraphReport) -> str:
    """The cache key of the whole-graph verdict (mirage's version against Inductor's compile) of this Dynamo
    graph: its code, its inputs' and lifted parameters' shapes, strides and dtypes, what mirage built for each
    region (claimer, who compiles it, its μGraph and launches; not the region timings), the knobs that change
    what runs, which Inductor compile it is timed against (``report.choice_against``), the device and the library
    versions (:func:`~torch_mirage.cache.cache_key`). A graph whose
    regions came out otherwise (another region timing verdict, another tuned launch) gets a key of its own."""
    def meta(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return [list(x.shape), list(x.stride()), str(x.dtype), x.device.type]
        return repr(x)
    regions = [[r.claimer, r.compiled_by, len(r.ops), r.info.get("ugraph_hash"), r.info.get("launch"),
                r.info.get("sibling_launches")] for r in report.regions]
    timed = ("cuda_graphs", "inductor_mode", "pdl", "prelude")     # knobs that change how fast mirage's or Inductor's version runs
    knobs = {f: getattr(cfg, f) for f in cfg.__dataclass_fields__
             if cfg.__dataclass_fields__[f].metadata.get("affects_output") or f in timed}
    return cache_key(kind="whole-graph-verdict", code=gm.code,
                     inputs=[meta(x) for x in [*_lifted_tensors(gm), *example_inputs]],
                     regions=regions, knobs=knobs, against=report.choice_against,
                     device=torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
                     timing="first call, fastest per half" if cfg.cuda_graphs else "in the caller's CUDA graph")


def _served_by(inductor_version: Callable[..., Any], report: GraphReport) -> Callable[..., Any]:
    """``inductor_version`` (Inductor's compile at symbolic sizes, in its own per-size CUDA graphs) serving the
    graph of ``report``, which says so."""
    report.cuda_graph, report.cuda_graph_reason = False, "runs Inductor's compile at symbolic sizes, captured per " \
        "size there"
    return inductor_version


def _inductor_kept(report: GraphReport, detail: str) -> None:
    """Inductor's version of the graph kept untimed: its mirage regions say so."""
    report.choice = "inductor"
    for r in report.regions:
        if r.compiled_by == "mirage":
            r.compiled_by, r.reason, r.detail = "inductor", Reason.SLOWER_THAN_INDUCTOR, detail
    log.info("torch_mirage: graph %d %s", report.index, detail)


def _choice_recorder(report: GraphReport, cached: bool = False):
    def record(choice: str, times: dict) -> None:
        report.choice = choice
        report.choice_times_us = {k: round(v, 2) for k, v in times.items()}
        report.choice_cached = cached
        log.info("torch_mirage: graph %d %s: %s; keeping %s", report.index,
                 "as timed by an earlier compile (disk cache)" if cached else "timed on first call",
                 ", ".join(f"{k} {v:.1f} µs" for k, v in times.items()), choice)
        if choice != "mirage":
            detail = (f"whole graph: mirage {times.get('mirage', float('nan')):.1f} µs vs "
                      f"Inductor {times.get('inductor', float('nan')):.1f} µs")
            for r in report.regions:
                if r.compiled_by == "mirage":
                    r.compiled_by, r.reason, r.detail = "inductor", Reason.SLOWER_THAN_INDUCTOR, detail
    return record


def _dynamo_ops(gm: torch.fx.GraphModule) -> list[str]:
    return [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes
            if n.op in ("call_function", "call_method", "call_module")]


def _dynamo_summary(gm: torch.fx.GraphModule) -> str:
    """The Dynamo graph's first ops and its inputs, typed, for a warning."""
    return failures.fx_graph_summary(gm, "example_value")


def mirage_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
    """The ``backend="mirage"`` entry point."""
    return MirageBackend()(gm, example_inputs, **kwargs)

