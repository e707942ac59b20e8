"""End-to-end LLM benchmarks: ``transformers`` models built from configs with random weights.

Nothing is downloaded. Three decoder-only models of 4 layers each, shaped like their 7–9B
originals except for the vocabulary (32000 for all three, so that embedding and LM head stay
small next to the 4 layers): Llama-3-8B, Qwen2-7B (bias on q/k/v), Gemma-2-9B (attention-logit
and final-logit soft-capping, eager attention so that the soft-capping runs; sdpa would skip it).
Scenarios: one decode step with a static KV cache of 4096 slots (filled with random keys and
values, the new token at position 4000) at batch 1 and 8, and a 2048-token prefill at batch 1.

Every scenario gets a fresh static cache, and every call — eager's references, each mode's
checks, each CUDA-graph replay — starts from the same cache state (:class:`KVState`: position
reset inside the timed call, contents restored before each check), because a static cache is
mutated by every call and transformers 5.x writes at the cache's own counter, not at any
``cache_position``. Positions are checked against the cache size on the host before anything
runs. Each mode is checked against eager (logits and the cache slots written) on fresh random
token ids, then timed in one CUDA graph (the weights alone are larger than 3× L2, so one input
set suffices; the timed call includes the counter reset, a scalar fill per layer, in every mode);
compile time and peak GPU memory are recorded.

Written against the ``transformers`` 4.45+ and 5.x APIs (checked on 5.17: ``StaticCache(config,
max_cache_len)`` with lazily allocated ``layers[i].keys``); the import is guarded so that the rest
of the suite runs without it.
"""
from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch

from ..numerics import tolerance
from ..timing import activity_table, alternating_times, device_activity, kernel_total, plain_timing
from . import select
from .harness import COMPILERS, _free, _short, mirage_summary, rel_error, time_in_cuda_graph

CONTEXT = 4096          # static cache slots
DECODE_POSITION = 4000  # the decoded token's position (earlier slots hold random keys/values)
EARLY_POSITION = 256    # the "early" scenario's: a short chat turn in the same 4096-slot cache
PREFILL_TOKENS = 2048
# each mode is timed inside the bench's CUDA graph, where Inductor's reduce-overhead (its own CUDA graphs) would time
# as Inductor default does: default and max-autotune are Inductor's modes here
LLM_MODES = ("eager", "inductor", "inductor-max-autotune", "mirage")
QUICK_MODES = ("eager", "inductor", "mirage")   # --quick: correctness only; max-autotune's tuning is not checked

MISSING = "transformers is not installed: end-to-end LLM benchmarks skipped (pip install 'torch-mirage[bench]')"


@dataclass(frozen=True)
class LLMSpec:
    name: str
    config_cls: str
    model_cls: str
    config: dict
    attn: str                        # attention implementation
    quick: dict = field(default_factory=dict)


_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256)

MODELS: dict[str, LLMSpec] = {m.name: m for m in [
    LLMSpec("llama3-8b-4l", "LlamaConfig", "LlamaForCausalLM",
            dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=32000, max_position_embeddings=8192, rms_norm_eps=1e-5),
            "sdpa", _TINY),
    LLMSpec("qwen2-7b-4l", "Qwen2Config", "Qwen2ForCausalLM",
            dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=4, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=32000, max_position_embeddings=32768, rms_norm_eps=1e-6,
                 use_sliding_window=False),
            "sdpa", _TINY),
    LLMSpec("gemma2-9b-4l", "Gemma2Config", "Gemma2ForCausalLM",
            dict(hidden_size=3584, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=256, vocab_size=32000, max_position_embeddings=8192,
                 attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=CONTEXT,
                 query_pre_attn_scalar=256),
            "eager", dict(_TINY, head_dim=16, query_pre_attn_scalar=16)),
]}
QUICK_DEFAULT = ("llama3-8b-4l",)


ATTENTION = ("default", "sdpa", "eager")   # "default": each model's own (sdpa; eager for Gemma-2's soft-cap)


def get(names: Sequence[str] | None, attention: Sequence[str] = ("default",)) -> list[LLMSpec]:
    """The named models, each once per attention implementation in ``attention`` (``default``: its own; a model
    whose own is the one named is not run twice)."""
    out: list[LLMSpec] = []
    for spec in select(MODELS, names, "LLM(s)"):
        for attn in dict.fromkeys(spec.attn if a == "default" else a for a in attention):
            out.append(spec if attn == spec.attn else replace(spec, attn=attn))
    return out


# ---------------------------------------------------------------------------------------------
# Building models and caches across transformers versions


def build_model(spec: LLMSpec, dtype: torch.dtype, device: torch.device, quick: bool):
    import transformers

    cfg_kwargs = dict(spec.config, **(spec.quick if quick else {}))
    config = getattr(transformers, spec.config_cls)(**cfg_kwargs)
    config.use_cache = True
    try:
        config._attn_implementation = spec.attn
    except Exception:   # very old configs: the kwarg form
        config = getattr(transformers, spec.config_cls)(**cfg_kwargs, attn_implementation=spec.attn)
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, spec.model_cls)(config)
    return model.to(dtype).eval(), config


def static_cache(config, batch: int, max_len: int, device: torch.device, dtype: torch.dtype):
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    kwargs: dict[str, Any] = {"config": config, "max_cache_len": max_len}
    batch_key = "batch_size" if "batch_size" in params else "max_batch_size" if "max_batch_size" in params else None
    if batch_key:
        kwargs[batch_key] = batch
    for key, value in (("device", device), ("dtype", dtype)):
        if key in params:
            kwargs[key] = value
    return StaticCache(**kwargs)


def cache_tensors(cache) -> list[torch.Tensor]:
    """The key and value tensors of a StaticCache (5.x: ``layers[i].keys``; 4.x: ``key_cache``)."""
    if hasattr(cache, "layers"):
        out = []
        for layer in cache.layers:
            out += [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, torch.Tensor)]
        return out
    return list(getattr(cache, "key_cache", [])) + list(getattr(cache, "value_cache", []))


def _logits_kwarg(model) -> dict:
    params = inspect.signature(model.forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            return {name: 1}
    return {}


class KVState:
    """A static KV cache held at one scenario's position, so that every checked or timed call starts alike.

    Where a call writes is the cache's business, and it differs across ``transformers`` versions: 5.x
    layers write at their own counter (``cumulative_length``, a tensor, plus ``cumulative_length_int``
    on sliding-window layers) and advance it on every call, ignoring any ``cache_position``; 4.x caches
    write at the ``cache_position`` argument. :meth:`set_position` puts every counter back to the
    scenario's first position (one multi-tensor copy, so it also runs inside each timed call and each
    CUDA-graph replay writes the same slots); :meth:`restore` also puts back the contents saved by
    :meth:`save` (kept on the host, so that the snapshot is no part of the peak GPU memory).
    Positions are checked on the host before anything runs: a device-side index assert would leave
    the CUDA context unusable for every case after it.
    """

    def __init__(self, cache, start: int, tokens: int, passes_cache_position: bool, where: str):
        self.cache, self.start, self.tokens, self.where = cache, start, tokens, where
        self.layers = list(getattr(cache, "layers", []))
        self.counters = [layer for layer in self.layers
                         if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]
        self.saved: list[torch.Tensor] | None = None
        self._start: torch.Tensor | None = None     # the start position as a tensor on the counters' device
        for i, size in enumerate(self._slots()):
            if start < 0 or start + tokens > size:
                raise ValueError(f"{where}: tokens at positions {start}..{start + tokens - 1} do not fit layer {i}'s "
                                 f"static cache of {size} slots; use a larger context or fewer tokens")
        if not passes_cache_position and len(self.counters) != len(self.layers):
            kinds = sorted({type(layer).__name__ for layer in self.layers if layer not in self.counters})
            raise TypeError(f"{where}: cache layers {kinds} keep no write counter (cumulative_length) and the model "
                            f"takes no cache_position, so the benchmark cannot hold the cache at position {start}; "
                            f"this transformers version ({_version()}) is not supported")

    def _slots(self) -> list[int]:
        if self.layers:
            sizes = [getattr(layer, "max_cache_len", None) for layer in self.layers]
        else:   # 4.x: one size for the whole cache
            sizes = [getattr(self.cache, "max_cache_len", None)]
        if any(not isinstance(n, int) for n in sizes):
            raise TypeError(f"{self.where}: {type(self.cache).__name__} is not a static cache "
                            f"(no max_cache_len per layer)")
        return sizes

    def set_position(self) -> None:
        counters = [layer.cumulative_length for layer in self.counters]
        if counters:    # one multi-tensor launch inside a timed step, not one fill per layer (4 kernels at 4 layers)
            if self._start is None or self._start.device != counters[0].device:
                self._start = torch.tensor(self.start, dtype=counters[0].dtype, device=counters[0].device)
            try:
                torch._foreach_copy_(counters, [self._start] * len(counters))
            except (AttributeError, RuntimeError, TypeError):    # a torch without it, or counters it cannot fuse
                for c in counters:
                    c.fill_(self.start)
        for layer in self.layers:
            if hasattr(layer, "cumulative_length_int"):
                layer.cumulative_length_int = self.start

    def save(self) -> None:
        self.saved = [t.detach().to("cpu", copy=True) for t in cache_tensors(self.cache)]

    def restore(self) -> None:
        for t, saved in zip(cache_tensors(self.cache), self.saved or []):
            t.copy_(saved)
        self.set_position()

    def written(self) -> list[torch.Tensor]:
        """The slots the scenario's tokens write, in every key and value tensor."""
        return [t[:, :, self.start:self.start + self.tokens].clone() for t in cache_tensors(self.cache)]

    def check_advanced(self) -> None:
        """After a call (host read, outside any graph): every counter moved from start to start + tokens."""
        for i, layer in enumerate(self.counters):
            got = int(layer.cumulative_length)
            if got != self.start + self.tokens:
                raise RuntimeError(f"{self.where}: cache layer {i} ended at position {got}, expected "
                                   f"{self.start + self.tokens}: the cache does not write where the benchmark put it")


def _version() -> str:
    import transformers

    return getattr(transformers, "__version__", "?")


# ---------------------------------------------------------------------------------------------
# Scenarios


@dataclass(frozen=True)
class Scenario:
    name: str
    batch: int
    tokens: int           # new tokens per sequence in one call
    start: int            # position of the first new token


SCENARIO_KINDS = ("decode", "prefill", "early")
DEFAULT_SCENARIOS = ("decode", "prefill")


def scenarios(batches: Sequence[int], quick: bool, kinds: Sequence[str] = DEFAULT_SCENARIOS) -> list[Scenario]:
    """Those of ``kinds`` (:data:`SCENARIO_KINDS`): ``decode``, a step near the end of the static cache, one per
    batch size; ``prefill``; ``early``, a decode step at ``EARLY_POSITION`` of the same cache (most of its slots
    not written yet: what a kernel that reads only the written slots saves)."""
    context = 64 if quick else CONTEXT
    pos = context - context // 40 - 1 if quick else DECODE_POSITION
    early = context // 16 if quick else EARLY_POSITION
    prefill = 32 if quick else PREFILL_TOKENS
    out = [Scenario(f"decode b{b} ctx{context}", b, 1, pos) for b in batches] if "decode" in kinds else []
    out += [Scenario(f"decode b{b} pos{early} ctx{context}", b, 1, early) for b in batches] if "early" in kinds else []
    return out + ([Scenario(f"prefill {prefill}", 1, prefill, 0)] if "prefill" in kinds else [])


def _step_inputs(s: Scenario, vocab: int, device: torch.device, seed: int) -> tuple:
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(0, vocab, (s.batch, s.tokens), device=device, generator=gen)
    cache_position = torch.arange(s.start, s.start + s.tokens, device=device)
    return ids, cache_position.unsqueeze(0).expand(s.batch, -1).contiguous(), cache_position


@dataclass
class _Case:
    """One model × scenario: the function every mode compiles, its cache state, eager's results."""
    s: Scenario
    vocab: int
    device: torch.device
    forward: Callable          # (ids, position_ids, cache_position) -> logits
    kv: KVState
    refs: dict = field(default_factory=dict)   # seed -> (logits, written cache slots), from eager

    def inputs(self, seed: int) -> tuple:
        return _step_inputs(self.s, self.vocab, self.device, seed)


def run_model(spec: LLMSpec, batches: Sequence[int], dtype: torch.dtype, modes: Sequence[str],
              device: torch.device, quick: bool, timing: dict | None,
              echo: Callable[[str], None] = print,
              on_record: Callable[[dict], None] = lambda record: None,
              kinds: Sequence[str] = DEFAULT_SCENARIOS) -> list[dict]:
    """Every scenario of one model (of ``kinds``); one record per scenario with a result per mode (each also handed to
    ``on_record`` as soon as it is measured, so a run cut short keeps what it finished)."""
    model, config = build_model(spec, dtype, device, quick)
    records = []
    for s in scenarios(batches, quick, kinds):
        records.append(run_scenario(spec, model, config, s, quick, dtype, modes, device, timing, echo))
        on_record(records[-1])
    del model
    _free()
    return records


def run_scenario(spec: LLMSpec, model, config, s: Scenario, quick: bool, dtype: torch.dtype, modes: Sequence[str],
                 device: torch.device, timing: dict | None, echo: Callable[[str], None] = print) -> dict:
    """One scenario of a built model through every mode, on a fresh static cache: the record of it.

    Every mode is compiled and checked first and kept; then the modes are timed in two rounds of alternating
    order (A B C, C B A: ``timing.alternating_times``), each a fresh CUDA-graph capture, and the median over
    both rounds' repeats is reported. A multi-millisecond prefill drifts with the GPU's clocks and temperature by a few per
    cent over a minute; timing the modes one after another would hand that drift to whichever ran last."""
    context = 64 if quick else CONTEXT
    case = _prepare(model, config, spec, s, context, device, dtype)
    results, steps = {}, {}
    peak = _PeakMemory(device)
    try:
        layers = dict(spec.config, **(spec.quick if quick else {}))["num_hidden_layers"]
        for mode in modes:
            results[mode], step = _check_mode(case, mode, dtype, peak)
            if step is not None and device.type == "cuda":
                results[mode].update(_kernel_count(case, step, layers))
            if step is not None and timing is not None:
                steps[mode] = step
        if steps:
            _time_modes(case, steps, results, timing, peak)
    finally:
        steps.clear()
        results = {mode: _finite(r) for mode, r in results.items()}
        for mode, r in results.items():
            t = f"{r['ms']:8.3f} ms/step {r['tokens_per_s']:10,.0f} tok/s" if r.get("ms") else ""
            c = f"compile {r['compile_s']:.1f} s" if r.get("compile_s") is not None else ""
            echo(f"  {spec.name:<14} {s.name:<18} {mode:<22} {r['status']:<6} {t} {c} "
                 f"{('err %.2e' % r['rel_err']) if r.get('rel_err') is not None else ''} {r.get('error') or ''}")
        del case
        _free()
    return {"model": spec.name, "scenario": s.name, "batch": s.batch, "tokens": s.tokens,
            "dtype": str(dtype).replace("torch.", ""), "config": dict(spec.config, **(spec.quick if quick else {})),
            "attn_implementation": spec.attn, "context": context, "start": s.start, "sets": 1, "modes": results}


TIMING_ROUNDS = 2   # the A B … B A of ``alternating_times``


def _prepare(model, config, spec: LLMSpec, s: Scenario, context: int, device: torch.device,
             dtype: torch.dtype) -> _Case:
    """A fresh static cache for the scenario, filled with random keys and values; eager's reference results."""
    cache = static_cache(config, s.batch, context, device, dtype)
    params = inspect.signature(model.forward).parameters
    passes_cache_position = "cache_position" in params
    extra = _logits_kwarg(model)

    def forward(ids, position_ids, cache_position):
        kw = {"cache_position": cache_position} if passes_cache_position else {}
        out = model(input_ids=ids, position_ids=position_ids, past_key_values=cache, use_cache=True, **kw, **extra)
        return out.logits

    kv = KVState(cache, s.start, s.tokens, passes_cache_position, f"{spec.name} {s.name}")
    case = _Case(s, config.vocab_size, device, forward, kv)
    with torch.no_grad():
        kv.set_position()
        forward(*case.inputs(0))                    # allocates the lazily built cache tensors
        gen = torch.Generator(device=device).manual_seed(1)
        for t in cache_tensors(cache):
            t.copy_(torch.randn(t.shape, device=device, generator=gen, dtype=torch.float32))
        kv.save()
        for seed in (11, 12):
            kv.restore()
            logits = forward(*case.inputs(seed)).float()
            kv.check_advanced()
            case.refs[seed] = (logits, [t.float() for t in kv.written()])
    return case


class _PeakMemory:
    """Peak GPU memory of one mode as if it were alone: :meth:`reset` before the mode's work, :meth:`gib` after;
    what earlier modes still hold when it starts (allocated above the scenario's ``base``) is not counted."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.base = self.held = torch.cuda.memory_allocated() if self.cuda else 0

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self.held = torch.cuda.memory_allocated()

    def gib(self) -> float | None:
        return (torch.cuda.max_memory_allocated() - (self.held - self.base)) / 2 ** 30 if self.cuda else None


def _check_mode(case: _Case, mode: str, dtype: torch.dtype, peak: _PeakMemory) -> tuple[dict, Callable | None]:
    """Compile, check logits and the cache slots written against eager on every seed: the mode's result so far,
    and its ``step`` to time (None where it failed)."""
    res: dict[str, Any] = {"status": "failed", "ms": None, "tokens_per_s": None, "compile_s": None,
                           "peak_gib": None, "rel_err": None, "error": None, "timing_method": None}
    info: dict = {}
    kv, tol = case.kv, tolerance(dtype, "model")
    try:
        peak.reset()
        compiled = COMPILERS[mode](case.forward, info)

        def step(ids, position_ids, cache_position):
            kv.set_position()
            return compiled(ids, position_ids, cache_position)

        worst = 0.0
        for i, (seed, (ref_logits, ref_slots)) in enumerate(case.refs.items()):
            inputs = case.inputs(seed)
            kv.restore()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = step(*inputs)
            if case.device.type == "cuda":
                torch.cuda.synchronize()
            if i == 0 and mode != "eager":
                res["compile_s"] = time.perf_counter() - t0
            kv.check_advanced()
            checks = [("logits", out, ref_logits)] + [(f"cache slots of tensor {j}", got, ref)
                                                     for j, (got, ref) in enumerate(zip(kv.written(), ref_slots))]
            for what, got, ref in checks:
                err = rel_error(got.float(), ref)
                worst = err if math.isnan(err) else max(worst, err)
                if math.isnan(err) or err > tol:
                    res["rel_err"] = worst
                    res["error"] = f"wrong {what} (seed {seed}): relative error {err:.3g} > {tol:g} vs eager"
                    return res, None
        res["rel_err"] = worst
        res["peak_gib"] = peak.gib()
        res["status"] = "ok"
        return res, step
    except Exception as e:
        res["error"] = _short(e)
        return res, None
    finally:
        res["mirage"] = mirage_summary(info)
        info.clear()


def _kernel_count(case: _Case, step: Callable, layers: int) -> dict:
    """GPU kernels one step launches (issue: few kernels per decoder layer), and per layer: the whole step's count
    over the model's layers (embedding, final norm and LM head included, so a layer's own share is a little
    less). None where the profiler could not see inside a CUDA graph."""
    case.kv.restore()
    with torch.no_grad():
        found = device_activity(step, *case.inputs(0))
    n = kernel_total(found)
    return {"kernels": n, "kernels_per_layer": None if n is None else round(n / layers, 1),
            "device_activity": activity_table(found)}


def _time_modes(case: _Case, steps: dict[str, Callable], results: dict[str, dict], timing: dict,
                peak: _PeakMemory) -> None:
    """Median ms per step of every checked mode, timed in the order A B … B A (``alternating_times``)."""
    inputs = case.inputs(0)

    def time_half(mode: str) -> list[float]:
        res = results[mode]
        case.kv.restore()
        peak.reset()
        with torch.no_grad():
            try:
                t = time_in_cuda_graph(steps[mode], [inputs], timing["target_ms"], timing["repeats"])
                res["timing_method"] = "cuda graph"
            except Exception as e:   # e.g. a host sync inside the model: time it outside a graph, say so
                torch.cuda.synchronize()
                t = plain_timing(steps[mode], inputs, target_ms=timing["target_ms"], repeats=timing["repeats"])
                res["timing_method"] = f"no graph (capture failed: {_short(e, 200)})"
        if peak.cuda:
            res["peak_gib"] = max(res["peak_gib"] or 0.0, peak.gib())
        return t["samples"]

    def failed(mode: str, e: Exception) -> None:
        results[mode].update(status="failed", error=f"timing: {_short(e)}")

    medians = alternating_times(list(steps), time_half, on_error=failed)
    for mode in steps:
        res = results[mode]
        if mode in medians and res["status"] == "ok":
            res["ms"] = medians[mode] / 1e3
            res["tokens_per_s"] = case.s.batch * case.s.tokens / (res["ms"] * 1e-3)
            res["timing_rounds"] = TIMING_ROUNDS


def _finite(res: dict) -> dict:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in res.items()}
