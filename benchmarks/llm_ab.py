"""Paired timing of one LLM scenario: Inductor and mirage compiled in one process, then timed in rounds
alternating their order (I M M I …), each a replay of its own CUDA graph. Separates "mirage's graph is
slower" from "the mode timed later ran on a hotter, slower-clocked GPU" — the bench times its modes one
after another. Prints mirage's regions (claimer, who compiled them) and its first-call choice.

    python benchmarks/llm_ab.py --model llama3-8b-4l --scenario prefill --rounds 4
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from torch_mirage.bench import llm
from torch_mirage.bench.harness import COMPILERS, time_in_cuda_graph
from torch_mirage.timing import alternating_times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama3-8b-4l")
    p.add_argument("--scenario", default="prefill", help="prefill | decode-b1 | decode-b8")
    p.add_argument("--modes", nargs="+", default=["inductor", "mirage"])
    p.add_argument("--rounds", type=int, default=4, help="rounds of alternating order (rounded up to even)")
    p.add_argument("--target-ms", type=float, default=200.0)
    args = p.parse_args()

    device, dtype = torch.device("cuda"), torch.bfloat16
    spec = llm.get([args.model])[0]
    model, config = llm.build_model(spec, dtype, device, quick=False)
    batches = [int(args.scenario.split("-b")[1])] if args.scenario.startswith("decode") else [1]
    s = next(x for x in llm.scenarios(batches, quick=False) if x.name.split()[0] == args.scenario.split("-")[0])
    case = llm._prepare(model, config, spec, s, llm.CONTEXT, device, dtype)
    inputs = case.inputs(0)
    steps, infos = {}, {}
    for mode in args.modes:
        infos[mode] = {}
        compiled = COMPILERS[mode](case.forward, infos[mode])

        def step(ids, pos, cpos, compiled=compiled):
            case.kv.set_position()
            return compiled(ids, pos, cpos)

        case.kv.restore()
        with torch.no_grad():
            step(*inputs)
        steps[mode] = step
    report = infos.get("mirage", {}).get("report")
    if report is not None:
        for g in report.graphs:
            print(f"graph {g.index}: choice {g.choice} {g.choice_times_us} untimed {g.untimed_reason!r}")
            for r in g.regions:
                if r.compiled_by == "mirage" or r.claimer:
                    print(f"  region {r.claimer or '-':<10} {r.compiled_by:<9} {r.reason:<28} ops {r.ops[:8]}"
                          f"{' …' if len(r.ops) > 8 else ''} {json.dumps(r.info, default=str)[:300]}")
    order = list(args.modes)
    samples: dict[str, list[float]] = {m: [] for m in order}

    def time_half(mode: str) -> list[float]:
        case.kv.restore()
        t = time_in_cuda_graph(steps[mode], [inputs], args.target_ms / 4, 4)
        samples[mode] += t["samples"]
        print(f"{mode:<22} {t['us'] / 1e3:8.3f} ms  (min {t['us_min'] / 1e3:.3f}, "
              f"max {t['us_max'] / 1e3:.3f}, replays {t['replays']})", flush=True)
        return t["samples"]

    with torch.no_grad():
        for _ in range(-(-args.rounds // 2)):     # each pass is two rounds: A B, then B A
            alternating_times(order, time_half)
    for mode in order:
        print(f"{args.model} {s.name} {mode:<22} median {statistics.median(samples[mode]) / 1e3:.3f} ms "
              f"over {len(samples[mode])} repeats")


if __name__ == "__main__":
    main()
