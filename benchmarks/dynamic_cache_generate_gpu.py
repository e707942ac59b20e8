"""``model.generate(ids)`` as most users call it — transformers' default DynamicCache, ``dynamic=None`` — compiled
with mirage, called several times in one process: the wall seconds of each call and the GPU memory held after it.

Under a DynamicCache every decode step has a KV length of its own, so the decode graph is one of symbolic sizes
and each step a new size for its CUDA graphs (``SizedCudaGraphs``). Run once per ``MIRAGE_CUDA_GRAPH_RECORD_AT``
(``--record-at 1 2``: one fresh process each) to compare recording every size at its first call with recording a
size when it comes back. The calls (``--prompts``): a prompt length called twice shows a second call of the same
sizes (recorded then under 2), a new length shifts every size.

    python benchmarks/dynamic_cache_generate_gpu.py [--model llama] [--batch 4] [--new-tokens 32]
        [--prompts 64,64,64,100,64] [--record-at 1 2] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def one_process(args) -> dict:
    from torch_mirage.bench import models as M
    from torch_mirage.report import Report

    spec = M.get([args.model])[0]
    device = torch.device(args.device)
    model = M.build(spec, "default", torch.bfloat16 if device.type == "cuda" else torch.float32, device,
                    tiny=args.tiny)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    held = (lambda: torch.cuda.memory_allocated()) if cuda else (lambda: 0)
    report = Report()
    calls = []
    with torch.no_grad():
        eager_tokens = {}
        for n in sorted(set(args.prompts)):   # eager's tokens first, the compiled forward not yet in place
            torch.manual_seed(n)
            ids = torch.randint(0, model.config.vocab_size, (args.batch, n), device=device)
            eager_tokens[n] = (ids, M.greedy_generate(model, ids, args.new_tokens, "dynamic"))
        M.compile_forward(model, "mirage", report=report, dynamic=None)
        base = held()
        for n in args.prompts:
            ids, want = eager_tokens[n]
            sync()
            start = time.perf_counter()
            got = M.greedy_generate(model, ids, args.new_tokens, "dynamic")
            sync()
            calls.append({"prompt": n, "s": round(time.perf_counter() - start, 4),
                          "tokens_equal": round(M._tokens_match(got, want), 4),
                          "graphs_compiled": len(report.graphs),
                          "memory_mib": round((held() - base) / 2 ** 20, 1)})
            print(f"  record_at {args.record_at[0]}  prompt {n:4d}: {calls[-1]}", flush=True)
    graphs = [{"graph": g.index, "symbolic": g.symbolic_sizes, "cuda_graph": g.cuda_graph,
               "reason": g.cuda_graph_reason, "sizes_of": g.sizes_of,
               "stage_s": {k: round(v / 1e3, 2) for k, v in g.stage_times_ms.items()}} for g in report.graphs]
    return {"record_at": args.record_at[0], "calls": calls, "graphs": graphs}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompts", type=lambda s: [int(x) for x in s.split(",")], default=[64, 64, 64, 100, 64])
    p.add_argument("--record-at", type=int, nargs="+", default=[1, 2])
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="the model at its test sizes (a CPU smoke run)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(one_process(args)), flush=True)
        return 0
    runs = []
    for record_at in args.record_at:   # a fresh process each: Dynamo, the caches in memory and the GPU start alike
        env = dict(os.environ, MIRAGE_CUDA_GRAPH_RECORD_AT=str(record_at))
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", args.model, "--batch",
               str(args.batch), "--new-tokens", str(args.new_tokens), "--prompts",
               ",".join(map(str, args.prompts)), "--record-at", str(record_at), "--device", args.device] + ["--tiny"] * args.tiny
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        sys.stdout.write("".join(line + "\n" for line in done.stdout.splitlines() if not line.startswith("RESULT ")))
        found = [line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not found:
            print(f"record_at {record_at} failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
            runs.append({"record_at": record_at, "error": done.stderr[-3000:]})
            continue
        runs.append(json.loads(found[0]))
    doc = {"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device, "torch": torch.__version__,
           "triton": __import__("triton").__version__, "model": args.model, "batch": args.batch,
           "new_tokens": args.new_tokens, "prompts": args.prompts, "runs": runs}
    lines = ["| call | prompt | " + " | ".join(f"record_at {r['record_at']} s (MiB held)" for r in runs) + " |",
             "|---|---|" + "---|" * len(runs)]
    for i, n in enumerate(args.prompts):
        cells = [f"{r['calls'][i]['s']:.3f} ({r['calls'][i]['memory_mib']:.0f})" if "calls" in r else "error"
                 for r in runs]
        lines.append(f"| {i + 1} | {n} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"dynamic-cache-{args.model}.json"), "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
