"""Configuration: one frozen dataclass, read once from ``MIRAGE_*`` variables and
``torch.compile(..., options={...})``.

Every knob is a field of :class:`Config`; its environment variable is
``MIRAGE_<FIELD NAME IN CAPITALS>`` and its ``options=`` key is the field name.
``print(torch_mirage.config.load())`` shows the effective values.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _knob(default: Any, doc: str, *, affects_output: bool = False, choices: tuple = ()) -> Any:
    return field(default=default, metadata={"doc": doc, "affects_output": affects_output, "choices": choices})


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "torch_mirage")


@dataclass(frozen=True)
class Config:
    cache_dir: str = _knob(_default_cache_dir(), "Directory of the on-disk cache (search results, generated kernels).")
    cuda_graphs: bool = _knob(True, "Wrap compiled graphs in CUDA graphs where that is safe. Turn off when the caller captures its own graph.")
    fallback: str = _knob("inductor", "Where everything mirage does not claim goes: 'inductor' or 'eager'.", affects_output=True, choices=("inductor", "eager"))
    inductor_mode: str = _knob("default", "Inductor mode for the fallback: 'default' or 'max-autotune-no-cudagraphs'.", affects_output=True, choices=("default", "max-autotune-no-cudagraphs"))
    strict: bool = _knob(False, "Raise on any internal compile error instead of falling back.")
    log_level: str = _knob("WARNING", "Level of the 'torch_mirage' logger (DEBUG, INFO, WARNING, ERROR).", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    verify_trials: int = _knob(0, "Finite-field verifier trials per candidate; 0 derives the count from verify_error_bound.", affects_output=True)
    verify_error_bound: float = _knob(1e-12, "Target probability that the verifier accepts a wrong candidate.", affects_output=True)
    stitch: bool = _knob(True, "Claim memory-bound regions with AStitch-style stitch kernels.", affects_output=True)
    ugraph_library: bool = _knob(True, "Claim subgraphs that compute a hand-built μGraph (RMSNorm + Linear: (rms(x)·g)@w; LoRA: x@w + (x@a)@b; gated MLP: silu(x@w1) * (x@w3); unmasked attention, with or without RMS-normed q and k; nTrans) and run the μGraph.", affects_output=True)
    min_region_us: float = _knob(3.0, "Stitch regions whose memory traffic takes less than this many µs on the device model are left to Inductor, which fuses them with their neighbours.", affects_output=True)
    measure_regions: bool = _knob(True, "On a GPU, time each claimed region against Inductor's version and keep the faster.", affects_output=True)
    check_regions: bool = _knob(True, "Run each mirage kernel once at compile time against eager ATen on random inputs; a mismatch hands the region back to the fallback.", affects_output=True)
    cache: bool = _knob(True, "Read and write the on-disk cache.")
    search: bool = _knob(False, "Claim regions around a matmul with a μGraph found by the μGraph search (seeds off, verified; up to search_budget_s per region), after the μGraph library claimer.", affects_output=True)
    search_budget_s: float = _knob(30.0, "Wall-clock budget in seconds of one μGraph search (anytime: the best verified μGraph found by then is kept; 0 = no search).", affects_output=True)
    search_workers: int = _knob(1, "Worker processes of the μGraph search; the search runs in one process today, so values above 1 are not used yet.")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            choices = f.metadata["choices"]
            value = getattr(self, f.name)
            if choices and value not in choices:
                raise ValueError(f"torch_mirage config: {f.name}={value!r} is not one of {choices} "
                                 f"(set {env_name(f.name)} or options={{'{f.name}': ...}})")

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


def _parse(f: dataclasses.Field, raw: Any) -> Any:
    kind = type(f.default)
    if not isinstance(raw, str) or kind is str:
        value = raw
    elif kind is bool:
        low = raw.strip().lower()
        if low not in _TRUE | _FALSE:
            raise ValueError(f"torch_mirage config: {env_name(f.name)}={raw!r} is not a boolean (use 1/0)")
        value = low in _TRUE
    else:
        try:
            value = kind(raw)
        except ValueError:
            raise ValueError(f"torch_mirage config: {env_name(f.name)}={raw!r} is not a {kind.__name__}") from None
    if f.name == "log_level":
        value = str(value).upper()
    if kind is float and isinstance(value, int):
        value = float(value)
    if not isinstance(value, kind):
        raise TypeError(f"torch_mirage config: {f.name} wants a {kind.__name__}, got {value!r}")
    return value


def load(options: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> Config:
    """Effective configuration: defaults, then ``MIRAGE_*`` variables, then ``options``."""
    environ = os.environ if environ is None else environ
    fields = {f.name: f for f in dataclasses.fields(Config)}
    values: dict[str, Any] = {}
    for name, f in fields.items():
        if env_name(name) in environ:
            values[name] = _parse(f, environ[env_name(name)])
    for key, raw in (options or {}).items():
        name = key[len("mirage."):] if key.startswith("mirage.") else key
        if name not in fields:
            raise KeyError(f"torch_mirage: unknown option {key!r}; known options: {sorted(fields)}")
        values[name] = _parse(fields[name], raw)
    return Config(**values)


def describe() -> str:
    """Markdown table of every knob: variable, default, meaning (README's config table)."""
    lines = ["| variable | `options=` key | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(Config):
        default = "~/.cache/torch_mirage" if f.name == "cache_dir" else repr(f.default)
        lines.append(f"| `{env_name(f.name)}` | `{f.name}` | `{default}` | {f.metadata['doc']} |")
    return "\n".join(lines)
