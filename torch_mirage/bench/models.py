"""Real Hugging Face models end to end: ``python -m torch_mirage bench --models llama,gemma2,gpt2,bert``.

Each model is built from its ``transformers`` config with random weights (nothing is downloaded): 4 layers,
hidden 1024, bf16 on a GPU (2 layers, hidden 64, fp32 with ``tiny``, the size the CPU tests use). For each
attention implementation (``default``, what transformers picks — ``sdpa`` where the model has it — and ``eager``) and each compile mode it runs

- a prefill forward (batch 4 × 256 tokens; logits checked against eager's, and their max error against an fp32
  eager reference of the same weights), and
- for causal LMs, greedy ``generate`` with a static KV cache (``cache_implementation="static"``): the tokens are
  checked against eager's; the time per generated token is the whole call's time over the new tokens, and the
  decode step's time is one call of the (compiled) forward with the last decode step's arguments that
  ``generate`` passed, the static cache put back one token first (:func:`decode_step`): the compiled graph
  without ``generate``'s own Python, which is most of a token's time at these sizes. ``--cache dynamic``:
  ``generate`` with transformers' default DynamicCache instead (``model.generate(ids)`` as most users call it),
  timed per token only; pair it with ``--dynamic default``, as a DynamicCache's growing K / V recompile every
  step under ``dynamic=False``.

Every mode of a case is compiled and checked first and kept; then the modes are timed alternately (A B … B A),
so that no mode inherits the process's state from the modes timed before it (:func:`run_case`).

Modes: eager, Inductor default, ``reduce-overhead`` (Inductor with CUDA graphs), ``max-autotune`` and mirage, all
compiled with the model's :attr:`HFModel.dynamic` (``--dynamic auto``, the default): ``dynamic=False`` — one graph
per input shape (the prefill and the decode step), the serving policy README's "CUDA graphs" section states —
except for Gemma-2, whose sliding-window cache makes a ``dynamic=False`` decode step recompile at every token
(Dynamo guards on the cache's token count) until Dynamo's recompile limit, in every mode, and which gets
``torch.compile``'s own default (``dynamic=None``) instead. ``--dynamic false`` / ``default`` compile every model
with False / None. Mirage's report (regions kept, CUDA graph or the op that
prevents it, what the first-call timing against Inductor kept) is recorded per case. Writes ``NAME.json``,
``NAME.md`` and ``NAME.png`` (speedup of mirage over reduce-overhead) like the workload bench.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import json
import logging
import math
import os
import statistics
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..backend import MirageBackend
from ..numerics import tolerance
from ..report import Report
from ..timing import alternating_times, count_device_kernels, fastest_per_half, plain_timing
from . import has_transformers, select
from .harness import _free, _short, mirage_summary, rel_error
from .report import environment, pyplot, write_json

logger = logging.getLogger("torch_mirage")

SCHEMA = "torch_mirage.bench.models/1"
MODES = ("eager", "inductor", "reduce-overhead", "max-autotune", "mirage")
DYNAMIC = {"false": False, "default": None}   # --dynamic: torch.compile's ``dynamic`` for every model
# --cache: the KV cache of ``generate``: a StaticCache allocated before the first call (as transformers' docs build
# one for torch.compile), or transformers' default DynamicCache (``model.generate(ids)`` as most users call it:
# its K / V grow a token a step, so the decode graph's sizes change every step)
CACHES = ("static", "dynamic")
AUTO = "auto"                                 # --dynamic auto: each model's own (HFModel.dynamic)
ATTN = ("default", "eager")   # default: what transformers picks (sdpa where the model supports it)
MISSING = "transformers is not installed: the model bench needs it (pip install 'torch-mirage[bench]')"


@dataclass(frozen=True)
class HFModel:
    name: str
    config_cls: str
    model_cls: str
    config: dict          # the bench size
    tiny: dict            # the CPU test size
    causal: bool = True   # has ``generate``
    dynamic: bool | None = False   # torch.compile's ``dynamic`` under ``--dynamic auto``: a static decode graph


def _llama_like(**extra: Any) -> tuple[dict, dict]:
    small = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                 num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048)
    tiny = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)
    return dict(small, **extra), dict(tiny, **extra)


def _spec(name: str, config_cls: str, model_cls: str, sizes: tuple[dict, dict], causal: bool = True) -> HFModel:
    return HFModel(name, config_cls, model_cls, sizes[0], sizes[1], causal)


MODELS: dict[str, HFModel] = {m.name: m for m in [
    _spec("llama", "LlamaConfig", "LlamaForCausalLM", _llama_like()),
    _spec("qwen2", "Qwen2Config", "Qwen2ForCausalLM", _llama_like(use_sliding_window=False)),
    _spec("mistral", "MistralConfig", "MistralForCausalLM", _llama_like(sliding_window=None)),
    HFModel("gemma2", "Gemma2Config", "Gemma2ForCausalLM",
            dict(_llama_like()[0], head_dim=64, query_pre_attn_scalar=64, sliding_window=4096,
                 attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
            dict(_llama_like()[1], head_dim=16, query_pre_attn_scalar=16, sliding_window=256,
                 attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
            dynamic=None),      # its cache's token count: under dynamic=False a recompile per decode token
    _spec("phi3", "Phi3Config", "Phi3ForCausalLM", _llama_like(pad_token_id=0)),
    # RMS norms of each head's q and k between the projections and RoPE (QK-norm attention as HF writes it)
    HFModel("qwen3", "Qwen3Config", "Qwen3ForCausalLM", dict(_llama_like()[0], head_dim=64, use_sliding_window=False),
            dict(_llama_like()[1], head_dim=16, use_sliding_window=False)),
    HFModel("gpt2", "GPT2Config", "GPT2LMHeadModel",
            dict(n_embd=1024, n_layer=4, n_head=16, n_positions=2048, vocab_size=32000),
            dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, vocab_size=256)),
    HFModel("bert", "BertConfig", "BertForMaskedLM",
            dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=16,
                 vocab_size=32000, max_position_embeddings=512),
            dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 vocab_size=256, max_position_embeddings=256), causal=False),
    HFModel("opt", "OPTConfig", "OPTForCausalLM",
            dict(hidden_size=1024, ffn_dim=4096, num_hidden_layers=4, num_attention_heads=16, vocab_size=32000,
                 word_embed_proj_dim=1024, max_position_embeddings=2048),
            dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=256,
                 word_embed_proj_dim=64, max_position_embeddings=256)),
    # eager attention only: ALiBi added by ``baddbmm`` to scores whose heads are folded into the batch
    HFModel("bloom", "BloomConfig", "BloomForCausalLM",
            dict(hidden_size=1024, n_layer=4, n_head=16, vocab_size=32000),
            dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=256)),
]}
GPU_DEFAULT = ("llama", "gemma2", "gpt2", "bert")


def get(names: Sequence[str] | None) -> list[HFModel]:
    return select(MODELS, names, "model(s)")


def build(spec: HFModel, attn: str, dtype: torch.dtype, device: torch.device | str, tiny: bool, seed: int = 0):
    """The model in eval mode, random weights from ``seed``, attention implementation ``attn`` (``"default"``:
    the one transformers picks, ``sdpa`` where the model supports it)."""
    import transformers

    config = getattr(transformers, spec.config_cls)(**(spec.tiny if tiny else spec.config))
    torch.manual_seed(seed)
    extra = {} if attn == "default" else {"attn_implementation": attn}
    model = getattr(transformers, spec.model_cls)._from_config(config, **extra)
    return model.to(device=device, dtype=dtype).eval()


def forward_logits(model, spec: HFModel) -> Callable[[torch.Tensor], torch.Tensor]:
    """The prefill call: logits of every position, no KV cache."""
    extra = {"use_cache": False} if spec.causal else {}
    return lambda ids: model(input_ids=ids, **extra).logits


def greedy_generate(model, ids: torch.Tensor, new_tokens: int, cache_kind: str = "static") -> torch.Tensor:
    """Greedy decoding of exactly ``new_tokens`` tokens with a static KV cache (``cache_kind="dynamic"``:
    transformers' default DynamicCache). ``disable_compile``: on CUDA with a static cache transformers would
    otherwise compile the forward itself, and eager would not be eager."""
    if cache_kind == "dynamic":
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, disable_compile=True)
    cache = static_cache(model, ids.shape[0], ids.shape[1] + new_tokens, ids.device)
    if cache is not None:
        cache.reset()   # the same storage for every call (zeroed in place), as a serving loop keeps it
    kwargs = {"past_key_values": cache} if cache is not None else {"cache_implementation": "static"}
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, disable_compile=True,
                          **kwargs)


def static_cache(model, batch: int, length: int, device: torch.device):
    """A ``StaticCache`` allocated before the first (compiled) forward, as transformers' docs build one for
    ``torch.compile``: allocated eagerly, its tensors are marked static addresses, so compiled graphs (Inductor's
    CUDA-graph trees, mirage's runner) update them in place. Left to generate, the cache is allocated lazily inside
    the compiled prefill, where transformers skips ``mark_static_address``; Inductor's reduce-overhead then skipped
    its CUDA graphs for "mutated inputs" and failed or crashed inside ``generate`` on the H100 (torch 2.11).
    One cache per model, batch and length, reused by every call (a new one per call would move the static
    addresses and make every CUDA graph re-record). ``None`` where this transformers has no early initialisation."""
    from transformers import StaticCache

    caches = model.__dict__.setdefault("_bench_static_caches", {})
    if (batch, length) in caches:
        return caches[batch, length]
    cfg = model.config.get_text_config(decoder=True)
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache = StaticCache(config=model.config, max_cache_len=length)
    if not hasattr(cache, "early_initialization"):
        return None
    cache.early_initialization(batch, heads, head_dim, model.dtype, device)
    caches[batch, length] = cache
    return cache


def compile_forward(model, mode: str, report: Any = None, dynamic: bool | None = False, reset: bool = True) -> None:
    """Replace ``model.forward`` by its compile under ``mode`` (``eager``: unchanged). ``generate`` calls
    ``model.forward``, so both the prefill and the decode steps run compiled. ``reset``: Dynamo's caches are
    emptied first (False keeps earlier modes' graphs, so that their forwards still run compiled)."""
    if reset:
        torch._dynamo.reset()
    if "forward" in model.__dict__:
        del model.forward   # back to the class's forward
    if mode == "eager":
        return
    if mode == "mirage":
        model.forward = torch.compile(model.forward, backend=MirageBackend(report=report), dynamic=dynamic)
    elif mode == "inductor":
        model.forward = torch.compile(model.forward, dynamic=dynamic)
    elif mode in ("reduce-overhead", "max-autotune"):
        model.forward = _step_per_call(torch.compile(model.forward, mode=mode, dynamic=dynamic))
    else:
        raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")


def _step_per_call(compiled: Callable) -> Callable:
    """Inductor's CUDA-graph modes as ``generate`` needs them: each call starts a new CUDA-graph step, and the
    logits (which ``generate`` keeps past the next call) are cloned out of the graph's memory, as PyTorch's
    documentation asks of outputs that outlive a replay. Without it the second decode step fails with
    "accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run". The wrapper keeps the
    forward's signature, which ``generate`` reads to choose its arguments (without it OPT's layers get a 4-d
    hidden state: "too many values to unpack")."""
    @functools.wraps(compiled)
    def forward(*args: Any, **kwargs: Any) -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        out = compiled(*args, **kwargs)
        if getattr(out, "logits", None) is not None:
            out["logits"] = out.logits.clone()
        return out
    return forward


def last_decode_call(model, run: Callable[[], Any]) -> tuple[tuple, dict] | None:
    """The ``(args, kwargs)`` of the last forward call that ``run`` (a ``generate``) makes with one new token per
    row — a decode step, its static cache among the arguments (transformers 5 passes no cache position: the
    cache's own length says where the token goes) —, recorded by wrapping the model's forward (compiled or not)
    while ``run`` runs; None where it makes none."""
    inner, own = model.forward, "forward" in model.__dict__
    calls: list = []

    @functools.wraps(inner)   # generate reads the forward's signature to choose its arguments (OPT: position_ids)
    def recording(*args: Any, **kwargs: Any) -> Any:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] == 1:
            calls[:] = [(args, kwargs)]
        return inner(*args, **kwargs)

    model.forward = recording
    try:
        run()
    finally:
        if own:
            model.forward = inner
        else:
            del model.forward
    return calls[0] if calls else None


def decode_step(model, call: tuple[tuple, dict]) -> Callable[[], Any] | None:
    """A recorded decode step (:func:`last_decode_call`) that can run again and again: the static cache is put
    back one token (``crop(-1)``: an in-place decrement of each layer's length, a small kernel per layer, paid
    alike in every mode) before the forward writes that token's K / V at the same position again. None where a
    cache layer cannot be put back (a sliding window that has wrapped around)."""
    args, kwargs = call
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    put_back = _put_back_one_token(cache) if cache is not None else (lambda: None)
    if put_back is None:
        return None

    def step() -> Any:
        put_back()
        return model.forward(*args, **kwargs)
    return step


def _put_back_one_token(cache) -> Callable[[], None] | None:
    """What takes ``cache`` back one token: its ``crop(-1)`` where every layer is croppable (transformers 5.24's
    static layers), else, for static layers of full attention without ``crop`` (transformers 5.17, the device's),
    the in-place decrement of each layer's ``cumulative_length`` that 5.24's ``crop`` does; None otherwise."""
    layers = list(getattr(cache, "layers", ()))
    if all(getattr(layer, "is_croppable", True) for layer in layers):
        return lambda: cache.crop(-1)
    if layers and all(isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)
                      and not getattr(layer, "is_sliding", True) for layer in layers):
        def decrement() -> None:
            for layer in layers:
                layer.cumulative_length.sub_(1)
        return decrement
    return None


TIMED = ("prefill_us", "us_per_token", "decode_step_us")   # what each mode is timed on, alternately


def run_case(spec: HFModel, attn: str, modes: Sequence[str], dtype: torch.dtype, device: torch.device,
             tiny: bool, batch: int, tokens: int, new_tokens: int, timing: dict | None,
             log: Callable[[str], None] = print, dynamic: bool | None = False,
             measure: Callable[..., dict] = plain_timing, cache_kind: str = "static") -> dict:
    """One model with one attention implementation through every mode. Returns its JSON record.

    Every mode is compiled and checked first and all of them are kept (one Dynamo cache holds each mode's graphs,
    each entry guarded on its backend); then the modes are timed alternately (:func:`_time_modes`). Timed one
    mode after another (H200, 11-28 and 11-29), mirage's µs/token over reduce-overhead's moved between 0.59 and
    1.70 on models whose decode step mirage ran faster, and for qwen2 from 1.70 with mirage timed last to 0.79
    with mirage timed first."""
    record: dict = {"model": spec.name, "attn": attn, "dtype": str(dtype).replace("torch.", ""),
                    "batch": batch, "tokens": tokens, "new_tokens": new_tokens if spec.causal else 0, "modes": {}}
    try:
        model = build(spec, attn, dtype, device, tiny)
    except ValueError as e:   # e.g. gemma2 has no sdpa path in transformers 5.x
        record["skipped"] = _short(e, 200)
        log(f"  {spec.name:8s} {attn:5s} skipped: {record['skipped']}")
        return record
    record["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (batch, tokens), generator=gen).to(device)
    prompt = ids[:, : max(4, tokens // 4)]
    with torch.no_grad():
        ref32 = forward_logits(copy.deepcopy(model).float(), spec)(ids).float()
        eager_logits = forward_logits(model, spec)(ids).float()
        eager_tokens = greedy_generate(model, prompt, new_tokens, cache_kind) if spec.causal else None
    forwards: dict[str, Any] = {}       # mode -> the compiled forward (None: the class's own)
    steps: dict[str, Callable] = {}     # mode -> its recorded decode step
    torch._dynamo.reset()
    with room_for_modes(modes):
        try:
            for mode in modes:
                record["modes"][mode] = _check_mode(model, spec, mode, dynamic, ids, prompt, new_tokens,
                                                    ref32, eager_logits, eager_tokens, dtype, device, timing,
                                                    forwards, steps, cache_kind)
            if timing is not None:
                _time_modes(model, spec, forwards, steps, ids, prompt, new_tokens, record["modes"], timing, measure,
                            cache_kind)
        finally:
            forwards.clear()
            steps.clear()
            compile_forward(model, "eager")
            _free()
    for mode in modes:
        log(_line(spec, attn, mode, record["modes"][mode]))
    record.update(_derived(record["modes"]))
    model = None   # freed before the next case (the closures above hold it only while they run)
    _free()
    return record


def forget_seen_sizes() -> None:
    """Dynamo's record of the sizes each frame was called with emptied (its compiled graphs kept): under
    ``dynamic=None`` a mode compiled after others then compiles its first size static and its second symbolic, as
    alone, rather than symbolic from its first call because earlier modes' calls on the same forward saw two sizes
    (11-29: gemma2's mirage prefill ran symbolic, without a CUDA graph, 2247 µs against reduce-overhead's 590)."""
    reset = getattr(torch._dynamo, "reset_code_state", None)
    if reset is None:
        logger.warning("torch_mirage bench: this torch has no torch._dynamo.reset_code_state; under dynamic=None "
                       "a mode compiled after others sees their sizes")
        return
    reset()


def room_for_modes(modes: Sequence[str]):
    """Dynamo's per-frame recompile limit raised for ``modes`` kept at once on one forward: every mode's prefill,
    prompt and decode graphs share it (16 a mode)."""
    return torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit, 16 * len(modes)))


def _check_mode(model, spec: HFModel, mode: str, dynamic: bool | None, ids: torch.Tensor, prompt: torch.Tensor,
                new_tokens: int, ref32: torch.Tensor, eager_logits: torch.Tensor, eager_tokens: torch.Tensor | None,
                dtype: torch.dtype, device: torch.device, timing: dict | None, forwards: dict, steps: dict,
                cache_kind: str = "static") -> dict:
    """Compile ``mode`` (Dynamo's caches kept), check its logits and tokens against eager's, count its kernels,
    and keep its forward (and, when timed with a static cache, its recorded decode step) for :func:`_time_modes`.
    A DynamicCache has no decode step to time: generate's steps each have a size of their own."""
    report = Report() if mode == "mirage" else None
    res: dict = {"status": "ok"}
    try:
        if dynamic is None:
            forget_seen_sizes()
        compile_forward(model, mode, report, dynamic, reset=False)
        fwd = forward_logits(model, spec)
        with torch.no_grad():
            start = time.perf_counter()
            logits = fwd(ids).float().clone()
            logits = fwd(ids).float().clone()   # a replay where the mode records a CUDA graph
            res["compile_s"] = round(time.perf_counter() - start, 2)
            res["rel_err_vs_eager"] = rel_error(logits, eager_logits)
            res["max_err_vs_fp32"] = float((logits - ref32).abs().max())
            if device.type == "cuda":   # kernels per layer of a prefill forward (None: hidden in a graph)
                res["prefill_kernels_per_layer"] = _kernels_per_layer(model, lambda: fwd(ids))
            if spec.causal:
                toks = greedy_generate(model, prompt, new_tokens, cache_kind)
                res["tokens_match"] = _tokens_match(toks, eager_tokens)
                # one decode step as the compiled forward runs it, without generate's own Python around it
                call = timing and cache_kind == "static" and last_decode_call(
                    model, lambda: greedy_generate(model, prompt, new_tokens))
                step = decode_step(model, call) if call else None
                if step is not None:
                    steps[mode] = step
                    if device.type == "cuda":   # the step's put-back adds a small kernel a layer in every mode
                        res["decode_kernels_per_layer"] = _kernels_per_layer(model, step)
        if not math.isfinite(res["rel_err_vs_eager"]) or res["rel_err_vs_eager"] > tolerance(dtype, "model"):
            res["status"] = "mismatch"
        if report is not None:
            res["mirage"] = dict(mirage_summary({"report": report}) or {}, cuda_graphs=[
                {"graph": g.index, "kind": g.kind, "captured": bool(g.cuda_graph), "reason": g.cuda_graph_reason}
                for g in report.graphs])
        if res["status"] == "ok":
            forwards[mode] = model.__dict__.get("forward")
    except Exception as e:   # one mode failing does not stop the others
        res = {"status": "error", "error": _short(e), "raised_at": _raised_at(e)}
        steps.pop(mode, None)
    finally:
        if "forward" in model.__dict__:
            del model.forward   # the next mode compiles the class's forward
        _free(reset_dynamo=False)     # the mode's graphs stay for the timing
    return res


def _kernels_per_layer(model, run: Callable[[], Any]) -> float | None:
    """GPU kernels of one ``run()`` per decoder layer (None where the profiler cannot see them)."""
    n = count_device_kernels(run)
    return None if n is None else round(n / model.config.num_hidden_layers, 1)


def _time_modes(model, spec: HFModel, forwards: dict, steps: dict, ids: torch.Tensor, prompt: torch.Tensor,
                new_tokens: int, results: dict, timing: dict, measure: Callable[..., dict] = plain_timing,
                cache_kind: str = "static") -> None:
    """Each checked mode's prefill, generated token and decode step, timed in the order A B … B A
    (``timing.alternating_times``), each half ``ceil(repeats / 2)`` repeats launched from Python with that mode's
    forward in place and Python's garbage collector paused (:func:`_collector_paused`). The time is
    :func:`timing.fastest_per_half` (what the host adds only ever slows a repeat down, so a half's fastest repeat
    is its least disturbed one); ``*_median`` the median of all repeats, which says how noisy the run was."""
    half_repeats = max(1, math.ceil(timing["repeats"] / 2))
    runs: dict[str, Callable[[], Any]] = {"prefill_us": lambda: forward_logits(model, spec)(ids)}
    if spec.causal:
        runs["us_per_token"] = lambda: greedy_generate(model, prompt, new_tokens, cache_kind)
    for key in TIMED:
        names = [m for m in forwards if m in steps] if key == "decode_step_us" else list(forwards) * (key in runs)
        if not names:
            continue
        samples: dict[str, list[float]] = {m: [] for m in names}

        def time_half(mode: str) -> list[float]:
            use_forward(model, forwards[mode])
            fn = steps[mode] if key == "decode_step_us" else runs[key]
            with torch.no_grad(), _collector_paused():
                got = list(measure(lambda: fn(), [], target_ms=timing["target_ms"], repeats=half_repeats)["samples"])
            samples[mode] += got
            return got

        def failed(mode: str, e: Exception) -> None:
            results[mode].update(status="error", error=f"timing {key}: {_short(e)}", raised_at=_raised_at(e))

        fastest = alternating_times(names, time_half, on_error=failed, estimate=fastest_per_half)
        per = new_tokens if key == "us_per_token" else 1
        for mode, t in fastest.items():
            results[mode][key] = t / per
            results[mode][key + "_median"] = statistics.median(samples[mode]) / per
    use_forward(model, None)


@contextlib.contextmanager
def _collector_paused():
    """Python's garbage collector collected before and paused during a timed half, as ``timeit`` does: a
    ``generate`` is milliseconds of Python, and a collection falling into one mode's repeats but not the other's
    would be timed as that mode's."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def use_forward(model, forward) -> None:
    """Put ``forward`` (a mode's compiled forward; None: the class's own) in place as ``model.forward``."""
    if forward is None:
        model.__dict__.pop("forward", None)
    else:
        model.forward = forward


def _raised_at(e: BaseException, frames: int = 4) -> list[str]:
    """The innermost ``frames`` frames of ``e``'s traceback as ``file:line in function`` (file names shortened
    to their last two parts): where an error of a mode was raised, kept in the JSON next to its message."""
    tb = traceback.extract_tb(e.__traceback__)[-frames:]
    return [f"{'/'.join(f.filename.split('/')[-2:])}:{f.lineno} in {f.name}" for f in tb]


def _tokens_match(tokens: torch.Tensor, ref: torch.Tensor) -> float:
    """The fraction of generated positions equal to eager's, up to each row's first difference (after a different
    token the rest is a different continuation, not a further error)."""
    same = (tokens == ref).int().cumprod(dim=1)
    return float(same.float().mean())


def _derived(modes: dict) -> dict:
    """Speedups of mirage over reduce-overhead and over the best Inductor mode, per forward and per token."""
    def best(key: str) -> float | None:
        times = [m.get(key) for name, m in modes.items() if name in ("inductor", "reduce-overhead", "max-autotune")
                 and m.get("status") == "ok" and m.get(key)]
        return min(times) if times else None

    out = {}
    mirage = modes.get("mirage", {})
    for key in ("prefill_us", "us_per_token", "decode_step_us"):
        ours = mirage.get(key) if mirage.get("status") == "ok" else None
        ro = modes.get("reduce-overhead", {})
        ro_t = ro.get(key) if ro.get("status") == "ok" else None
        b = best(key)
        out[f"{key}_best_inductor"] = b
        out[f"{key}_speedup_vs_reduce_overhead"] = ro_t / ours if ours and ro_t else None
        out[f"{key}_speedup_vs_best_inductor"] = b / ours if ours and b else None
    return out


def _line(spec: HFModel, attn: str, mode: str, res: dict) -> str:
    if res["status"] == "error":
        return f"  {spec.name:8s} {attn:5s} {mode:16s} error: {res['error'][:200]}"
    parts = [f"{res['status']:8s}", f"rel err {res['rel_err_vs_eager']:.1e}", f"vs fp32 {res['max_err_vs_fp32']:.2e}"]
    if res.get("prefill_us") is not None:
        parts.append(f"prefill {res['prefill_us']:.0f} µs")
    if res.get("us_per_token") is not None:
        parts.append(f"{res['us_per_token']:.0f} µs/token")
    if res.get("decode_step_us") is not None:
        parts.append(f"decode step {res['decode_step_us']:.0f} µs")
    if "tokens_match" in res:
        parts.append(f"tokens {res['tokens_match']:.0%}")
    graphs = res.get("mirage", {}).get("cuda_graphs", [])
    if graphs:
        parts.append("CUDA graph " + ", ".join("yes" if g["captured"] else f"no ({g['reason']})" for g in graphs))
    return f"  {spec.name:8s} {attn:5s} {mode:16s} " + "  ".join(parts)


def _dynamic_setting(doc: dict) -> str:
    """torch.compile's ``dynamic`` as the document's cases ran: one value, or each model's."""
    used = {m["model"]: m.get("dynamic", DYNAMIC.get(doc["settings"].get("dynamic"), False)) for m in doc["models"]}
    values = sorted(set(used.values()), key=str)
    if len(values) <= 1:
        return str(values[0] if values else DYNAMIC.get(doc["settings"].get("dynamic"), False))
    common = False if False in values else values[0]
    return f"{common}; " + ", ".join(f"{name}: {v}" for name, v in used.items() if v is not common)


def markdown(doc: dict) -> str:
    env = doc["env"]
    lines = [f"# torch-mirage on Hugging Face models — {env['device']}", "",
             f"torch {env['torch']}, transformers {env.get('transformers')}, {doc['settings']['dtype']}, "
             f"batch {doc['settings']['batch']} × {doc['settings']['tokens']} tokens prefill, "
             f"{doc['settings']['new_tokens']} greedy tokens with a {doc['settings'].get('cache', 'static')} cache, "
             f"torch.compile(dynamic={_dynamic_setting(doc)}).", ""]
    if not doc["timing"]:
        lines += ["Correctness only: no timing claims.", ""]
    else:   # the medians are in the JSON (``*_median``)
        repeats = doc['settings'].get('repeats', 5)
        if doc["settings"].get("timing_order") == "alternating":
            lines += [f"Times: the modes timed alternately, A B … B A, {math.ceil(repeats / 2)} repeats a half; each "
                      f"time is the mean of its two halves' fastest repeats (host-bound calls: what the host adds "
                      f"only slows a repeat down).", ""]
        else:   # a document written before the modes were timed alternately
            lines += [f"Times: the fastest of {repeats} timed repeats, the modes one after another (host-bound "
                      f"calls: what the host adds only slows a repeat down).", ""]
    if doc.get("not_run"):
        lines += [f"Not run (time budget): {', '.join(doc['not_run'])}.", ""]
    modes = doc["settings"]["modes"]
    head = ["model", "attn"] + [f"{m} prefill µs" for m in modes] + [f"{m} µs/tok" for m in modes] + [
        f"{m} decode step µs" for m in modes] + [
        "mirage ÷ RO prefill", "mirage ÷ best prefill", "mirage ÷ RO token", "mirage ÷ RO decode step",
        "max err vs fp32 (mirage / inductor)",
        "prefill kernels / layer (mirage / RO)", "decode step kernels / layer (mirage / RO)", "mirage CUDA graph"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in doc["models"]:
        if r.get("skipped"):
            lines.append("| " + " | ".join([r["model"], r["attn"], f"skipped: {r['skipped']}"]
                                           + [""] * (len(head) - 3)) + " |")
            continue
        ms = r["modes"]

        def cell(mode: str, key: str) -> str:
            m = ms.get(mode, {})
            if m.get("status") == "error":
                return "error"
            v = m.get(key)
            mark = "" if m.get("status") == "ok" else " ✗"
            return (f"{v:.0f}" if v is not None else "–") + mark

        def ratio(key: str) -> str:
            v = r.get(key)
            return f"{1 / v:.2f}× time ({v:.2f}× speed)" if v else "–"

        mir = ms.get("mirage", {})
        ind = ms.get("inductor", {})
        errs = f"{mir.get('max_err_vs_fp32', float('nan')):.2e} / {ind.get('max_err_vs_fp32', float('nan')):.2e}"
        kernels, decode_kernels = (" / ".join(str(ms.get(m, {}).get(key) or "–") for m in ("mirage", "reduce-overhead"))
                                   for key in ("prefill_kernels_per_layer", "decode_kernels_per_layer"))
        graphs = mir.get("mirage", {}).get("cuda_graphs", [])
        cg = "; ".join("yes" if g["captured"] else f"no: {g['reason']}" for g in graphs) or "–"
        lines.append("| " + " | ".join([r["model"], r["attn"]] + [cell(m, "prefill_us") for m in modes]
                                       + [cell(m, "us_per_token") for m in modes]
                                       + [cell(m, "decode_step_us") for m in modes]
                                       + [ratio("prefill_us_speedup_vs_reduce_overhead"),
                                          ratio("prefill_us_speedup_vs_best_inductor"),
                                          ratio("us_per_token_speedup_vs_reduce_overhead"),
                                          ratio("decode_step_us_speedup_vs_reduce_overhead"), errs, kernels,
                                          decode_kernels, cg])
                     + " |")
    speed = [r["prefill_us_speedup_vs_reduce_overhead"] for r in doc["models"]
             if r.get("prefill_us_speedup_vs_reduce_overhead")]
    if speed:
        geo = math.exp(sum(math.log(s) for s in speed) / len(speed))
        lines += ["", f"Geomean prefill speedup of mirage over reduce-overhead: {geo:.2f}× over {len(speed)} cases."]
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: str) -> str | None:
    rows = [r for r in doc["models"] if r.get("prefill_us_speedup_vs_reduce_overhead")]
    if not doc["timing"] or not rows:
        return "no plot: no case has both a mirage and a reduce-overhead time"
    plt = pyplot()
    if isinstance(plt, str):
        return plt
    labels = [f"{r['model']} {r['attn']}" for r in rows]
    fig, ax = plt.subplots(figsize=(8, max(3, 0.35 * len(rows) + 1.5)))
    y = list(range(len(rows)))
    pre = [r["prefill_us_speedup_vs_reduce_overhead"] for r in rows]
    tok = [r.get("us_per_token_speedup_vs_reduce_overhead") or 0 for r in rows]
    ax.barh([i - 0.2 for i in y], pre, height=0.4, label="prefill", color="tab:blue")
    ax.barh([i + 0.2 for i in y], tok, height=0.4, label="per generated token", color="tab:orange")
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("speedup of mirage over Inductor reduce-overhead (×)")
    ax.legend()
    fig.suptitle(f"torch-mirage on HF models, {doc['env']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def run(names: Sequence[str] | None, out: str, stem: str = "models", modes: Sequence[str] | None = None,
        attns: Sequence[str] = ATTN, tiny: bool | None = None, batch: int | None = None, tokens: int | None = None,
        new_tokens: int | None = None, repeats: int = 9, budget_s: float | None = None,
        dynamic: str = AUTO, cache_kind: str = "static") -> dict:
    """The whole bench; writes ``out/stem.{json,md,png}`` and returns the document. ``dynamic``: a key of
    :data:`DYNAMIC`, or ``auto`` for each model's own (:attr:`HFModel.dynamic`); ``cache_kind``: one of
    :data:`CACHES`, the KV cache of ``generate``."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    tiny = (not cuda) if tiny is None else tiny
    modes = list(modes or (MODES if cuda else ("eager", "inductor", "mirage")))   # CPU: correctness only
    dtype = torch.float32 if tiny else torch.bfloat16
    batch, tokens = batch or (2 if tiny else 4), tokens or (16 if tiny else 256)
    new_tokens = new_tokens or (4 if tiny else 32)
    timing = {"repeats": repeats, "target_ms": 50.0} if cuda and not tiny else None
    specs = get(names or (list(GPU_DEFAULT) if cuda else ["llama"]))
    doc = {"schema": SCHEMA, "timing": timing is not None,
           "env": environment(torch.cuda.get_device_name() if cuda else "cpu"),
           "settings": {"models": [s.name for s in specs], "modes": list(modes), "attn": list(attns),
                        "dtype": str(dtype).replace("torch.", ""), "batch": batch, "tokens": tokens,
                        "new_tokens": new_tokens, "tiny": tiny, "repeats": repeats, "dynamic": dynamic,
                        "cache": cache_kind,
                        "timing_order": "alternating"},
           "models": []}
    start = time.monotonic()
    for spec in specs:
        for attn in attns:
            if budget_s is not None and time.monotonic() - start > budget_s:
                doc.setdefault("not_run", []).append(f"{spec.name} attn={attn}")
                print(f"{spec.name} attn={attn}: not run (--budget-s {budget_s:.0f} spent)", flush=True)
                continue
            print(f"{spec.name} attn={attn}", flush=True)
            compile_dynamic = spec.dynamic if dynamic == AUTO else DYNAMIC[dynamic]
            record = run_case(spec, attn, modes, dtype, device, tiny, batch, tokens, new_tokens, timing,
                              dynamic=compile_dynamic, cache_kind=cache_kind)
            doc["models"].append(dict(record, dynamic=compile_dynamic))
            write_json(doc, os.path.join(out, f"{stem}.json"))   # partial results survive a time limit
    write_json(doc, os.path.join(out, f"{stem}.json"))
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write(markdown(doc))
    why = plot(doc, os.path.join(out, f"{stem}.png"))
    if why:
        print(why)
    print(f"wrote {os.path.join(out, stem)}.{{json,md}}")
    return doc


def merge(paths: Sequence[str], out: str, stem: str) -> dict:
    """One document from several runs (e.g. one process per model, so that a crash loses one model only):
    their ``models`` and ``not_run`` concatenated under the first run's settings and environment."""
    docs = []
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        if doc.get("schema") != SCHEMA:
            raise ValueError(f"{path}: not a {SCHEMA} document")
        docs.append(doc)
    if not docs:
        raise ValueError("nothing to merge")
    merged = dict(docs[0], models=[m for d in docs for m in d["models"]],
                  not_run=[n for d in docs for n in d.get("not_run", [])])
    merged["settings"] = dict(merged["settings"], models=[m["model"] for m in merged["models"]])
    write_json(merged, os.path.join(out, f"{stem}.json"))
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write(markdown(merged))
    plot(merged, os.path.join(out, f"{stem}.png"))
    return merged


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torch_mirage.bench.models", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=None, help=f"comma-separated (known: {','.join(MODELS)}; "
                                                  f"GPU default: {','.join(GPU_DEFAULT)})")
    p.add_argument("--modes", default=None, help=f"comma-separated (default: {','.join(MODES)}; "
                                                 "on a CPU eager,inductor,mirage)")
    p.add_argument("--attn", default=",".join(ATTN), help="attention implementations (default: default,eager; "
                                                          "'default' is what transformers picks)")
    p.add_argument("--tiny", action="store_true", help="2 layers, hidden 64, fp32: correctness only")
    p.add_argument("--batch", type=int), p.add_argument("--tokens", type=int), p.add_argument("--new-tokens", type=int)
    p.add_argument("--repeats", type=int, default=9, help="timed repeats per measure (the fastest is reported)")
    p.add_argument("--budget-s", type=float, default=None, help="start no new case after this many seconds")
    p.add_argument("--dynamic", choices=[AUTO, *DYNAMIC], default=AUTO,
                   help="torch.compile's dynamic for every mode: auto (default: each model's own — one static graph "
                        "per shape, torch.compile's own for gemma2), false (one static graph per shape for every "
                        "model) or default (torch.compile's own, dynamic=None, for every model)")
    p.add_argument("--cache", choices=CACHES, default="static",
                   help="generate's KV cache: static (default: a StaticCache allocated before the first call) or "
                        "dynamic (transformers' default DynamicCache, as model.generate(ids) uses; no decode step "
                        "is timed, its size changes every step; pair it with --dynamic default, or every step "
                        "recompiles)")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench-results")
    p.add_argument("--name", default="models")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="merge earlier runs into --out/NAME.{json,md} and exit")
    args = p.parse_args(argv)
    if args.merge:
        print(markdown(merge(args.merge, args.out, args.name)))
        return 0
    if not has_transformers():
        print(MISSING)
        return 2
    split = lambda s: [x for x in s.split(",") if x] if s else None
    run(split(args.models), args.out, args.name, split(args.modes), split(args.attn), args.tiny or None,
        args.batch, args.tokens, args.new_tokens, args.repeats, args.budget_s, args.dynamic, args.cache)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
