"""Configuration: one frozen dataclass, read once from ``MIRAGE_*`` variables and
``torch.compile(..., options={...})``.

Every knob is a field of :class:`Config`; its environment variable is
``MIRAGE_<FIELD NAME IN CAPITALS>`` and its ``options=`` key is the field name.
``print(torch_mirage.config.load())`` shows the effective values.

A field declares its allowed values in its ``_knob`` metadata (``choices``, or a
range as a :class:`Check`); a value outside them raises :class:`ConfigError`
naming the channel it came from (``MIRAGE_STITCH='x'`` or
``options={'stitch': 'x'}``). A ``MIRAGE_*`` variable that is no field's (a
typo) gets one warning naming the closest knob; ``NON_KNOB_VARIABLES`` lists the
few the build and the tests read.
"""
from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

log = logging.getLogger("torch_mirage")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}

# MIRAGE_* variables that are not knobs: read by the build and the test suite, never by the backend
NON_KNOB_VARIABLES = {
    "MIRAGE_BUILD_CSRC": "setup.py: 0 skips building the C++ extension",
    "MIRAGE_UPDATE_GOLDEN": "tests: rewrite the golden copies of generated source",
    "MIRAGE_LLM_FULL": "tests: run every LLM family, scenario and mode",
    "MIRAGE_SEARCH_TEST_CRASH_WORKER": "tests: the μGraph search worker of this index dies at start",
    "MIRAGE_CI_VENV": ".ci/run: where it makes its fresh virtual environment",
}


class ConfigError(ValueError):
    """A knob's value that cannot be used; the message names where it came from (variable or options key)."""


@dataclass(frozen=True)
class Check:
    """A knob's allowed range: ``ok(value)`` and the words for it (``must be {text}``)."""
    ok: Callable[[Any], bool]
    text: str


def at_least(low: float) -> Check:
    return Check(lambda v: v >= low, f">= {low:g}")   # NaN compares False: out of range


def strictly_between(low: float, high: float) -> Check:
    return Check(lambda v: low < v < high, f"strictly between {low:g} and {high:g}")


NON_EMPTY = Check(lambda v: bool(v.strip()), "a non-empty path")


def _knob(default: Any, doc: str, *, affects_output: bool = False, choices: tuple = (),
          check: Check | None = None) -> Any:
    return field(default=default, metadata={"doc": doc, "affects_output": affects_output, "choices": choices,
                                            "check": check})


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "torch_mirage")


@dataclass(frozen=True)
class Config:
    cache_dir: str = _knob(_default_cache_dir(), "Directory of the on-disk cache (search results, generated kernels, timings); the default is $XDG_CACHE_HOME/torch_mirage where XDG_CACHE_HOME is set.", check=NON_EMPTY)
    cuda_graphs: bool = _knob(True, "Wrap compiled graphs in CUDA graphs where that is safe. Turn off when the caller captures its own graph.")
    cuda_graph_sizes: int = _knob(8, "Input sizes of a graph with symbolic sizes (dynamic=True, mark_dynamic, or Dynamo's automatic dynamic shapes after a second size) that each get a CUDA graph of their own, as Inductor's CUDA-graph trees record one per size; later sizes run without one. Each holds its own memory for the graph's intermediates. 0: symbolic graphs are not captured.", check=at_least(0))
    cuda_graph_record_at: int = _knob(2, "The call of an input size of a graph with symbolic sizes at which that size's CUDA graph is recorded: 2 (default) records a size when it comes back, as Inductor's CUDA-graph trees warm a new size up uncaptured first, so a size met once (a KV cache growing a token a step, transformers' DynamicCache) runs plainly once instead of two warm-up runs, a capture and copies of its inputs, and holds no graph memory; 1 records every size at its first call.", check=at_least(1))
    static_sizes: int = _knob(4, "Input sizes at which a graph of symbolic sizes (Dynamo's automatic dynamic shapes after a second size under dynamic=None, dynamic=True, mark_dynamic) is compiled again with those sizes fixed, so that mirage's kernels run there too: a size is compiled when it comes back (its second call pays a static compile: seconds, less from a warm disk cache); a size met once (a KV cache growing a token a step), every size of a graph that met more than 16 sizes before one came back (such a cache in a second generate) and sizes past this many run the symbolic graph (Inductor's kernels for what mirage does not claim at symbolic sizes). 0: never.", check=at_least(0))
    fallback: str = _knob("inductor", "Where everything mirage does not claim goes: 'inductor' or 'eager'.", affects_output=True, choices=("inductor", "eager"))
    inductor_mode: str = _knob("default", "Inductor mode for the fallback: 'default', 'max-autotune-no-cudagraphs', or 'max-autotune-gemm' (only the matmuls autotuned: prefill's GEMMs at a fraction of max-autotune's compile time).", affects_output=True, choices=("default", "max-autotune-no-cudagraphs", "max-autotune-gemm"))
    strict: bool = _knob(False, "Raise on any internal compile error instead of falling back.")
    log_level: str = _knob("WARNING", "Level of the 'torch_mirage' logger (DEBUG, INFO, WARNING, ERROR).", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    verify_trials: int = _knob(0, "Finite-field verifier trials per candidate; 0 derives the count from verify_error_bound.", affects_output=True, check=at_least(0))
    verify_error_bound: float = _knob(1e-12, "Target probability that the verifier accepts a wrong candidate.", affects_output=True, check=strictly_between(0, 1))
    stitch: bool = _knob(True, "Claim memory-bound regions with AStitch-style stitch kernels.", affects_output=True)
    ugraph_library: bool = _knob(True, "Use the hand-built μGraph library: its μGraphs (RMSNorm + Linear, gated MLP, LoRA, QK-norm attention, nTrans) seed the μGraph search — each instantiated at a region's dims and verified against the region's program before any enumeration — and the attention and weight-streaming claimers (attention by analysis with its seeds; memory-bound matmuls with their norm and epilogue) run ahead of the search. Off: the search alone (without seeds) and stitching.", affects_output=True)
    min_region_us: float = _knob(3.0, "Stitch regions whose memory traffic takes less than this many µs on the device model are left to Inductor, which fuses them with their neighbours. Regions around a decode matmul (at most 16 rows) are not held back by it (Inductor runs the matmul as a kernel of its own too).", affects_output=True, check=at_least(0))
    measure_regions: bool = _knob(True, "On a GPU, time each claimed region against Inductor's version and keep the faster.", affects_output=True)
    check_regions: bool = _knob(True, "Run each mirage kernel once at compile time against eager ATen on random inputs; a mismatch hands the region back to the fallback.", affects_output=True)
    cache: bool = _knob(True, "Read and write the on-disk cache.")
    attention_band: bool = _knob(True, "Attention whose mask's value property is causal or a sliding window visits only the key tiles a query block can see (the block graph's forloop_band).", affects_output=True)
    search: bool = _knob(False, "Enumerate: claim regions around a matmul, and matmul-free reduction chains (nTrans, residual RMSNorm / LayerNorm), with a μGraph found by the μGraph search (verified; up to search_budget_s per region and search_graph_budget_s per graph; a region where it finds nothing is remembered in the cache), after the library's seeds (ugraph_library) and the attention and weight-streaming claimers. Off (default): the library's seeds alone, no enumeration. Since 2026-11-27 the enumeration adds at most 1 s to the first call of tiny HF models on a 2-core CPU. On the H100 the Mirage set's searched graphs compiled in at most 38.0 s, measured before that session's search speed-ups. On an HF llama (4 layers, hidden 1024) with it on, the first call took 56.4 s and the search found nothing that was kept, so it stays off (CHANGELOG).", affects_output=True)
    search_budget_s: float = _knob(30.0, "Wall-clock budget in seconds of one μGraph search (anytime: the best verified μGraph found by then is kept; 0 = no search).", affects_output=True, check=at_least(0))
    search_graph_budget_s: float = _knob(60.0, "Wall-clock seconds the μGraph search's enumeration may spend in one graph, all its regions together (each still within search_budget_s); once spent, the graph's remaining regions get the library's seeds and the weight-streaming seed only. 0 = no limit.", affects_output=True, check=at_least(0))
    tune_budget_s: float = _knob(0.0, "Seconds the build stage of one graph may spend tuning (Triton compiles and timing of launch configurations and alternative μGraphs, on a GPU); once spent, each remaining choice takes its first candidate (the μGraph's own schedule, the first alternative) untimed. 0 = no limit. The timing against Inductor (measure stage, first call) is not counted and always runs.", check=at_least(0))
    compile_workers: int = _knob(0, "Workers (processes or threads: compile_processes) that compile the Triton kernels of a tuned choice's candidates (the launch configurations of a μGraph kernel) all at once, before the candidates are checked and timed one after another; 0 = the CPU cores this process may use, 1 = no pool (each candidate compiles when it first runs). What is chosen does not depend on it.", check=at_least(0))
    prelude: str = _knob("auto", "The fallback's small ops that read only the graph's inputs (a decode step's cache positions and counters, its mask, RoPE's cos / sin, the embedding): 'inline' — with the fallback's other ops, placed between mirage's kernels as they come; 'hoist' — one Inductor graph of their own, run first (Inductor fuses those that share data); 'combo' — that graph with Inductor's combo kernels, independent kernels in one launch; 'auto' — 'combo' for a graph on a CUDA device, 'inline' elsewhere (on a CPU a launch costs nothing to save, and the extra graph costs an Inductor compile). On the H100 'combo' sped decode up (llama3-8b-4l b1 0.828 -> 0.817 ms, b8 0.995 -> 0.981 ms; 'hoist' alone changed nothing). What is computed does not depend on it.", choices=("auto", "inline", "hoist", "combo"))
    regions_in_inductor: bool = _knob(True, "With the Inductor fallback, each mirage region with static shapes that writes no input in place runs as the op mirage::region inside the Inductor partition around it (Inductor calls its kernel as an extern kernel), so the fallback's ops of a graph make one Inductor compile and one cache entry instead of one per stretch between two regions (each a compile of its own, and 60-90 ms to load in a warm process on the H200's host). Off: every region is a Python call between Inductor's partitions. Where Inductor fails on the graph with the regions inside, they go between its partitions, with one warning. What is computed does not depend on it.")
    pdl: bool = _knob(False, "Launch generated μGraph kernels with programmatic dependent launch (sm_90 and later, on CUDA): each kernel waits for its predecessor at its start and lets the next kernel launch right after (codegen.dependent_launch). Off by default: on the H100 it sped a chain of eight bf16 GEMVs up (118.9 -> 114.6 µs) but slowed llama3-8b-4l decode b1 down (0.825 -> 0.913 ms per step, same launches). What is computed does not depend on it.")
    compile_processes: bool = _knob(True, "Where kernels compile for CUDA, the compiles ahead (compile_workers of them at once) run in worker processes that compile into Triton's cache (the jobs that make the kernels run one after another first, recording each launch's compile), rather than in threads: a Triton compile holds Python's lock for much of its time. Off: threads. What is chosen does not depend on it.")
    search_workers: int = _knob(1, "Worker processes of the μGraph search (spawned; first-level DFS branches dealt round-robin; 1 = in-process). On the 2-core CPU 2 workers were slower than 1 (spawn/import and per-worker oracle caches: RMSNorm+Linear 4.0 s -> 9.1 s, gated MLP 1.5 s -> 4.9 s to the first verified μGraph, benchmarks/results/search_workers_cpu.json), so the default stays 1.", check=at_least(1))

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _validate(f, getattr(self, f.name), f"{f.name}={getattr(self, f.name)!r}")

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)

    def output_key(self) -> dict[str, Any]:
        """The fields that change what is compiled: part of every cache key."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata["affects_output"]}

    def __str__(self) -> str:
        rows = [(f.name, env_name(f.name), repr(getattr(self, f.name))) for f in dataclasses.fields(self)]
        w0 = max(len(r[0]) for r in rows)
        w1 = max(len(r[1]) for r in rows)
        return "\n".join(f"{a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows)


def env_name(field_name: str) -> str:
    return "MIRAGE_" + field_name.upper()


def _from_env(name: str, raw: Any) -> str:
    return f"{env_name(name)}={raw!r}"


def _from_options(key: str, raw: Any) -> str:
    return f"options={{{key!r}: {raw!r}}}"


def _parse(f: dataclasses.Field, raw: Any, where: str) -> Any:
    """``raw`` (a string from the environment, or an ``options=`` value) as the field's type, in range;
    ``where`` names the channel and value for the error (``MIRAGE_STITCH='x'``, ``options={'stitch': 'x'}``)."""
    kind = type(f.default)
    if not isinstance(raw, str) or kind is str:
        value = raw
    elif kind is bool:
        low = raw.strip().lower()
        if low not in _TRUE | _FALSE:
            raise ConfigError(f"torch_mirage config: {where} is not a boolean (use 1/0, true/false, yes/no, on/off)")
        value = low in _TRUE
    else:
        try:
            value = kind(raw)
        except ValueError:
            raise ConfigError(f"torch_mirage config: {where} is not a{'n' if kind is int else ''} "
                              f"{kind.__name__}") from None
    if f.name == "log_level" and isinstance(value, str):
        value = value.upper()
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ConfigError(f"torch_mirage config: {where}: {f.name} must be a{'n' if kind is int else ''} "
                          f"{kind.__name__}")
    _validate(f, value, where)
    return value


def _validate(f: dataclasses.Field, value: Any, where: str) -> None:
    choices, check = f.metadata.get("choices", ()), f.metadata.get("check")
    if choices and value not in choices:
        raise ConfigError(f"torch_mirage config: {where} is not one of {', '.join(map(repr, choices))}")
    if check is not None and not check.ok(value):
        raise ConfigError(f"torch_mirage config: {where}: {f.name} must be {check.text}")


_warned_unknown: set[str] = set()


def _warn_unknown_variables(environ: Mapping[str, str], known: set[str]) -> None:
    """One warning per process for each ``MIRAGE_*`` variable that is no knob (a typo), naming the closest."""
    for name in sorted(environ):
        if not name.startswith("MIRAGE_") or name in known or name in NON_KNOB_VARIABLES or name in _warned_unknown:
            continue
        _warned_unknown.add(name)
        close = difflib.get_close_matches(name[len("MIRAGE_"):], sorted(k[len("MIRAGE_"):] for k in known), n=1)
        hint = f"did you mean MIRAGE_{close[0]}?" if close else "`python -m torch_mirage config` lists the knobs"
        log.warning("torch_mirage config: %s is not a torch_mirage knob and is ignored; %s", name, hint)


def load(options: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> Config:
    """Effective configuration: defaults, then ``MIRAGE_*`` variables, then ``options``. A bad value raises
    :class:`ConfigError` naming its variable or ``options=`` key; an unknown ``MIRAGE_*`` variable is warned
    about once, an unknown ``options=`` key raises."""
    environ = os.environ if environ is None else environ
    fields = {f.name: f for f in dataclasses.fields(Config)}
    _warn_unknown_variables(environ, {env_name(name) for name in fields})
    values: dict[str, Any] = {}
    for name, f in fields.items():
        if env_name(name) in environ:
            values[name] = _parse(f, environ[env_name(name)], _from_env(name, environ[env_name(name)]))
    for key, raw in (options or {}).items():
        name = key[len("mirage."):] if key.startswith("mirage.") else key
        if name not in fields:
            close = difflib.get_close_matches(name, sorted(fields), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise KeyError(f"torch_mirage: unknown option {key!r}; {hint}known options: {sorted(fields)}")
        values[name] = _parse(fields[name], raw, _from_options(key, raw))
    return Config(**values)


def describe() -> str:
    """Markdown table of every knob: variable, default, meaning (README's config table)."""
    lines = ["| variable | `options=` key | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(Config):
        default = "~/.cache/torch_mirage" if f.name == "cache_dir" else repr(f.default)
        check = f.metadata.get("check")
        doc = f.metadata["doc"] + (f" Must be {check.text}." if check is not None else "")
        lines.append(f"| `{env_name(f.name)}` | `{f.name}` | `{default}` | {doc} |")
    return "\n".join(lines)
