"""µs per generated token of an HF model under each mode, with the mode alone in Dynamo's cache (as a user runs
it) and with every mode's graphs in one cache (as ``bench/models.py`` times them), in one process.

The HF bench compiles every mode on one model and then times them alternately, A B … B A, each with its forward
put back; Dynamo's cache then holds every mode's graphs. There mirage's µs/token measured 0.85x (llama) and 0.88x
(qwen2) of reduce-overhead's on the H100 (12-07) although its decode step was 1.52x / 1.35x faster, while a
profile of one generate per mode made mirage's host work per forward the lighter one. This script times the same
``generate`` both ways:

- **alone**: for each slot of the schedule A B … B A, Dynamo is reset, the mode compiled (warm disk caches after
  its first slot), ``SETTLE`` generates run to settle, then ``--repeats`` generates are timed one by one;
- **shared**: every mode compiled on the one model without a reset, then the same schedule with each mode's
  forward put in place (``bench/models.py``'s setting).

Each mode's time is :func:`torch_mirage.timing.fastest_per_half` of its two slots, per generated token (a generate
includes its prompt's forward). Python's garbage collector is paused while a slot is timed, as in the bench.

    python benchmarks/per_token_alone.py [--model llama] [--modes reduce-overhead mirage] [--new-tokens 16]
        [--batch 4] [--tokens 64] [--repeats 7] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from torch_mirage.bench import models as M  # noqa: E402
from torch_mirage.timing import fastest_per_half  # noqa: E402
from hf_decode_profile import generate_arguments  # noqa: E402  (a script beside this one)


SETTLE = 5   # generates run after a compile before a slot is timed (compile, record, settle)


def time_generates(call, repeats: int) -> list[float]:
    """µs of each of ``repeats`` calls of ``call`` (a generate), each ended by a device sync; the collector paused."""
    samples = []
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    with torch.no_grad(), M._collector_paused():
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            call()
            sync()
            samples.append((time.perf_counter() - start) * 1e6)
    return samples


def schedule(modes: list[str]) -> list[str]:
    return [*modes, *reversed(modes)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    generate_arguments(ap)
    ap.add_argument("--repeats", type=int, default=7, help="generates timed per slot")
    ap.add_argument("--out", default=None, help="directory for per-token-<model>.json")
    ap.add_argument("--tiny", action="store_true", help="the test suite's tiny config (a CPU smoke run)")
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.tiny:
        print("per_token_alone: needs a CUDA GPU (or --tiny)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    spec = M.MODELS[args.model]
    model = M.build(spec, "default", torch.bfloat16 if device.type == "cuda" else torch.float32, device,
                    tiny=args.tiny)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, model.config.vocab_size, (args.batch, args.tokens), generator=gen).to(device)

    def call():
        return M.greedy_generate(model, prompt, args.new_tokens)

    record: dict = {"model": spec.name, "batch": args.batch, "prompt": args.tokens, "new_tokens": args.new_tokens,
                    "repeats": args.repeats,
                    "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "settings": {}}
    with M.room_for_modes(args.modes):
        # alone: one mode in Dynamo's cache at a time
        halves: dict[str, list[list[float]]] = {m: [] for m in args.modes}
        compile_s: dict[str, list[float]] = {m: [] for m in args.modes}
        for mode in schedule(args.modes):
            start = time.perf_counter()
            M.compile_forward(model, mode)          # Dynamo reset first
            with torch.no_grad():
                for _ in range(SETTLE):
                    call()
            compile_s[mode].append(round(time.perf_counter() - start, 2))
            halves[mode].append(time_generates(call, args.repeats))
            print(f"alone  {mode:16s} slot: fastest {min(halves[mode][-1]) / args.new_tokens:7.0f} µs/token, "
                  f"median {statistics.median(halves[mode][-1]) / args.new_tokens:7.0f}", flush=True)
        M.compile_forward(model, "eager")
        record["settings"]["alone"] = _summary(halves, args.new_tokens, compile_s)
        # shared: every mode's graphs in one cache, each forward put back in turn
        torch._dynamo.reset()
        forwards = {}
        for mode in args.modes:
            M.compile_forward(model, mode, reset=False)
            with torch.no_grad():
                for _ in range(SETTLE):
                    call()
            forwards[mode] = model.__dict__.get("forward")
            M.use_forward(model, None)
        halves = {m: [] for m in args.modes}
        for mode in schedule(args.modes):
            M.use_forward(model, forwards[mode])
            with torch.no_grad():
                call()
            halves[mode].append(time_generates(call, args.repeats))
            print(f"shared {mode:16s} slot: fastest {min(halves[mode][-1]) / args.new_tokens:7.0f} µs/token, "
                  f"median {statistics.median(halves[mode][-1]) / args.new_tokens:7.0f}", flush=True)
        M.use_forward(model, None)
        record["settings"]["shared"] = _summary(halves, args.new_tokens)
    for setting, modes in record["settings"].items():
        print(f"{setting:6s} " + "  ".join(f"{m}: {v['us_per_token']:.0f} µs/token (median {v['median']:.0f})"
                                             for m, v in modes.items()))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"per-token-{spec.name}.json"), "w") as f:
            json.dump(record, f, indent=1)
    return 0


def _summary(halves: dict, new_tokens: int, compile_s: dict | None = None) -> dict:
    out = {}
    for mode, got in halves.items():
        out[mode] = {"us_per_token": fastest_per_half(got) / new_tokens,
                     "median": statistics.median([x for h in got for x in h]) / new_tokens,
                     "slots_fastest": [min(h) / new_tokens for h in got]}
        if compile_s is not None:
            out[mode]["compile_and_settle_s"] = compile_s[mode]
    return out


if __name__ == "__main__":
    sys.exit(main())
