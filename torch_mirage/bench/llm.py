"""End-to-end LLM benchmarks: ``transformers`` models built from configs with random weights.

Nothing is downloaded. Three decoder-only models of 4 layers each, shaped like their 7–9B
originals except for the vocabulary (32000 for all three, so that embedding and LM head stay
small next to the 4 layers): Llama-3-8B, Qwen2-7B (bias on q/k/v), Gemma-2-9B (attention-logit
and final-logit soft-capping, eager attention so that the soft-capping runs). Scenarios: one
decode step with a static KV cache of 4096 slots (filled with random keys and values up to
position 4000) at batch 1 and 8, and a 2048-token prefill at batch 1. Each mode is checked
against eager on fresh random token ids, then timed in one CUDA graph (the weights alone are
larger than 3× L2, so one input set suffices); compile time and peak GPU memory are recorded.

Written against the ``transformers`` ≥ 4.45 and 5.x APIs (``LlamaConfig``, ``StaticCache``...);
the import is guarded so that the rest of the suite runs without it.
"""
from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .harness import COMPILERS, _free, _short, mirage_summary, rel_error, time_in_cuda_graph

CONTEXT = 4096          # static cache slots
DECODE_POSITION = 4000  # the decoded token's position (earlier slots hold random keys/values)
PREFILL_TOKENS = 2048
LLM_MODES = ("eager", "inductor", "mirage")
TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 6e-2}

MISSING = "transformers is not installed: end-to-end LLM benchmarks skipped (pip install 'transformers>=4.45')"


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


def available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def get(names: Sequence[str] | None) -> list[LLMSpec]:
    if not names:
        return list(MODELS.values())
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise KeyError(f"unknown LLM(s) {unknown}; known: {sorted(MODELS)}")
    return [MODELS[n] for n in names]


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


# ---------------------------------------------------------------------------------------------
# Scenarios


@dataclass(frozen=True)
class Scenario:
    name: str
    batch: int
    tokens: int           # new tokens per sequence in one call
    start: int            # position of the first new token


def scenarios(batches: Sequence[int], quick: bool) -> list[Scenario]:
    context = 64 if quick else CONTEXT
    pos = context - context // 40 - 1 if quick else DECODE_POSITION
    prefill = 32 if quick else PREFILL_TOKENS
    out = [Scenario(f"decode b{b} ctx{context}", b, 1, pos) for b in batches]
    return out + [Scenario(f"prefill {prefill}", 1, prefill, 0)]


def _step_inputs(s: Scenario, vocab: int, device: torch.device, seed: int) -> tuple:
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(0, vocab, (s.batch, s.tokens), device=device, generator=gen)
    cache_position = torch.arange(s.start, s.start + s.tokens, device=device)
    return ids, cache_position.unsqueeze(0).expand(s.batch, -1).contiguous(), cache_position


def run_model(spec: LLMSpec, batches: Sequence[int], dtype: torch.dtype, modes: Sequence[str],
              device: torch.device, quick: bool, timing: dict | None,
              echo: Callable[[str], None] = print) -> list[dict]:
    """Every scenario of one model; one record per scenario with a result per mode."""
    model, config = build_model(spec, dtype, device, quick)
    context = 64 if quick else CONTEXT
    extra = _logits_kwarg(model)
    records = []
    for s in scenarios(batches, quick):
        cache = static_cache(config, s.batch, context, device, dtype)

        def step(ids, position_ids, cache_position, _model=model, _cache=cache):
            out = _model(input_ids=ids, position_ids=position_ids, cache_position=cache_position,
                         past_key_values=_cache, use_cache=True, **extra)
            return out.logits

        with torch.no_grad():
            step(*_step_inputs(s, config.vocab_size, device, 0))     # eager call: allocates lazy caches
            gen = torch.Generator(device=device).manual_seed(1)
            for t in cache_tensors(cache):
                t.copy_(torch.randn(t.shape, device=device, generator=gen, dtype=torch.float32))
            refs = {seed: step(*_step_inputs(s, config.vocab_size, device, seed)).float() for seed in (11, 12)}
        results = {}
        for mode in modes:
            results[mode] = _run_mode(model, step, s, mode, refs, config.vocab_size, dtype, device, timing)
            r = results[mode]
            t = f"{r['ms']:8.3f} ms/step {r['tokens_per_s']:10,.0f} tok/s" if r.get("ms") else ""
            c = f"compile {r['compile_s']:.1f} s" if r.get("compile_s") is not None else ""
            echo(f"  {spec.name:<14} {s.name:<18} {mode:<22} {r['status']:<6} {t} {c} "
                 f"{('err %.2e' % r['rel_err']) if r.get('rel_err') is not None else ''} {r.get('error') or ''}")
        records.append({"model": spec.name, "scenario": s.name, "batch": s.batch, "tokens": s.tokens,
                        "dtype": str(dtype).replace("torch.", ""), "config": dict(spec.config, **(spec.quick if quick else {})),
                        "attn_implementation": spec.attn, "sets": 1, "modes": results})
        del cache, refs, step
        _free()
    del model
    _free()
    return records


def _run_mode(model, step, s: Scenario, mode: str, refs: dict, vocab: int, dtype: torch.dtype,
              device: torch.device, timing: dict | None) -> dict:
    res: dict[str, Any] = {"status": "failed", "ms": None, "tokens_per_s": None, "compile_s": None,
                           "peak_gib": None, "rel_err": None, "error": None, "timing_method": None}
    info: dict = {}
    try:
        _free()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        fn = COMPILERS[mode](step, info)
        worst = 0.0
        for i, (seed, ref) in enumerate(refs.items()):
            inputs = _step_inputs(s, vocab, device, seed)
            t0 = time.perf_counter()
            with torch.no_grad():
                out = fn(*inputs)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i == 0 and mode != "eager":
                res["compile_s"] = time.perf_counter() - t0
            err = rel_error(out.float(), ref)
            worst = err if math.isnan(err) else max(worst, err)
            if math.isnan(err) or err > TOLERANCE[dtype]:
                res["rel_err"] = worst
                res["error"] = f"wrong logits (seed {seed}): relative error {err:.3g} > {TOLERANCE[dtype]:g} vs eager"
                return res
        res["rel_err"] = worst
        if timing is not None:
            inputs = _step_inputs(s, vocab, device, 0)
            with torch.no_grad():
                try:
                    t = time_in_cuda_graph(fn, [inputs], timing["target_ms"], timing["repeats"])
                    res["timing_method"] = "cuda graph"
                except Exception as e:   # e.g. a host sync inside the model: time it outside a graph, and say so
                    torch.cuda.synchronize()
                    t = _time_plain(fn, inputs, timing["target_ms"], timing["repeats"])
                    res["timing_method"] = f"no graph (capture failed: {_short(e, 200)})"
            res["ms"] = t["us"] / 1e3
            res["tokens_per_s"] = s.batch * s.tokens / (res["ms"] * 1e-3)
            res["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        res["status"] = "ok"
    except Exception as e:
        res["error"] = _short(e)
    finally:
        res["mirage"] = mirage_summary(info)
        info.clear()
        _free()
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in res.items()}


def _time_plain(fn, inputs, target_ms: float, repeats: int) -> dict:
    import statistics

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn(*inputs)
    start.record()
    fn(*inputs)
    end.record()
    end.synchronize()
    n = max(1, math.ceil(target_ms / max(start.elapsed_time(end), 1e-3)))
    per = []
    for _ in range(repeats):
        start.record()
        for _ in range(n):
            fn(*inputs)
        end.record()
        end.synchronize()
        per.append(start.elapsed_time(end) * 1e3 / n)
    return {"us": statistics.median(per)}
