"""``model.generate(ids)`` as most users call it — transformers' default DynamicCache, ``dynamic=None`` — compiled
with mirage, called several times in one process: the wall seconds of each call and the GPU memory held after it.

Under a DynamicCache every decode step has a KV length of its own, so the decode graph is one of symbolic sizes
and each step a new size for its CUDA graphs (``SizedCudaGraphs``). Run once per ``MIRAGE_CUDA_GRAPH_RECORD_AT``
(``--record-at 1 2``: one fresh process each) to compare recording every size at its first call with recording a
size when it comes back. The calls (``--prompts``): a prompt length called twice shows a second call of the same
sizes (recorded then under 2), a new length shifts every size.

    python benchmarks/dynamic_cache_generate_gpu.py [--model llama] [--batch 4] [--new-tokens 32]
        [--prompts 64,64,64,100,64] [--record-at 1 2] [--out DIR] [--caches fresh|shared] [--profile [warm]] [--census]
        [--cache-log] [--ptxas torch triton ...]

``--census``: after each call, the live CUDA tensors Python can reach (after ``gc.collect()``), the largest with
what holds them, against ``memory_allocated`` (the rest is held outside Python: CUDA-graph pools, cuBLAS's
workspace per stream); after the last call also ``memory_allocated`` once cuBLAS's workspaces are cleared.

``--caches fresh`` (default) gives each process empty disk caches of its own, so every column is a cold compile;
``--caches shared`` uses the machine's (a process after the first then compiles warm: ``--record-at 2 2`` compares
a cold and a warm compile). Until 12-02 (twenty-ninth) the caches were shared, so the second column was warm.

``--cache-log``: each process logs Inductor's FX graph cache and AOTAutograd's cache during its first call into
``cache-log-<n>.txt`` in ``--out`` (hits, misses, bypasses with their reasons, and each key's hash details, so that
a key that misses in a warm process can be diffed against the cold process's), with mirage's INFO lines (what each
build compiled, in how long); the JSON holds the counters.

``--ptxas``: one per ``--record-at`` entry, the ptxas that process's Triton compiles with: ``torch`` (torch's
``bin/ptxas``, what mirage pins when the user set nothing) or ``triton`` (Triton's bundled one, set by hand as
``TRITON_PTXAS_PATH``, which mirage and Inductor then keep): a cold A/B of the ptxas choice.

``--profile``: each process profiles its first call (the compiles) and writes ``profile-<n>.txt`` (cumulative and
own time, top entries, the partition and assemble stages' callees, who makes FX modules and compiles Python
code) and the whole profile as ``profile-<n>.prof`` (pstats) to ``--out``; ``--record-at 2 2`` then profiles a cold
and a warm compile (the second process finds the first one's disk caches); ``--profile warm`` profiles only the
processes after the first (the cold one runs at full speed).
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import inspect
import io
import json
import logging
import pstats
import shutil
import tempfile
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
    collector = CollectorTime()
    with torch.no_grad():
        eager_tokens = {}
        for n in sorted(set(args.prompts)):   # eager's tokens first, the compiled forward not yet in place
            torch.manual_seed(n)
            ids = torch.randint(0, model.config.vocab_size, (args.batch, n), device=device)
            eager_tokens[n] = (ids, M.greedy_generate(model, ids, args.new_tokens, "dynamic"))
        M.compile_forward(model, "mirage", report=report, dynamic=None)
        gc.collect()
        base = held()
        base_census = memory_census() if args.census and cuda else None
        for i, n in enumerate(args.prompts):
            ids, want = eager_tokens[n]
            sync()
            collector.reset()
            start = time.perf_counter()
            profile = cProfile.Profile() if args.profile and i == 0 else None
            cache_log = CacheLog(os.path.join(args.out or ".", f"cache-log-{args.index}.txt")) \
                if args.cache_log and i == 0 else None
            if profile:
                profile.enable()
            got = M.greedy_generate(model, ids, args.new_tokens, "dynamic")
            sync()
            if profile:
                profile.disable()
                write_profile(profile, os.path.join(args.out or ".", f"profile-{args.index}.txt"))
            cache_counts = cache_log.close() if cache_log else None
            calls.append({"prompt": n, "s": round(time.perf_counter() - start, 4),
                          "tokens_equal": round(M._tokens_match(got, want), 4),
                          "graphs_compiled": len(report.graphs),
                          "memory_mib": round((held() - base) / 2 ** 20, 1),
                          "gc_s": round(collector.seconds, 3), "gc_collections": collector.collections,
                          "objects": len(gc.get_objects())})
            if cache_counts is not None:
                calls[-1]["cache_counts"] = cache_counts
            if args.census and cuda:
                calls[-1]["census"] = memory_census()
                calls[-1]["memory_mib_after_gc"] = round((held() - base) / 2 ** 20, 1)
                if i == len(args.prompts) - 1:   # what cuBLAS keeps per stream it ran on (a workspace each)
                    torch._C._cuda_clearCublasWorkspaces()
                    calls[-1]["memory_mib_after_cublas_clear"] = round((held() - base) / 2 ** 20, 1)
            print(f"  record_at {args.record_at[0]}  prompt {n:4d}: "
                  f"{ {k: v for k, v in calls[-1].items() if k != 'census'} }", flush=True)
            if "census" in calls[-1]:
                c = calls[-1]["census"]
                print(f"    reachable {c['reachable_mib']} MiB of {c['allocated_mib']} allocated; largest: "
                      + "; ".join(f"{x['mib']} {x['shape']} {x['held_by']}" for x in c["largest"][:5]), flush=True)
    graphs = [{"graph": g.index, "symbolic": g.symbolic_sizes, "cuda_graph": g.cuda_graph,
               "reason": g.cuda_graph_reason, "sizes_of": g.sizes_of,
               "stage_s": {k: round(v / 1e3, 2) for k, v in g.stage_times_ms.items()}} for g in report.graphs]
    collector.close()
    return {"record_at": args.record_at[0], "calls": calls, "graphs": graphs, "census_before": base_census}


class CollectorTime:
    """Seconds Python's garbage collector ran (all generations) since :meth:`reset`, by ``gc.callbacks``: a warm
    compile makes many small objects in a process that holds millions, and under the profiler of 12-07 g one
    namedtuple ``_replace`` in ``ugraph.make_op`` took 157 µs a call (1 µs on the CPU), as if collections landed
    there."""

    def __init__(self):
        self.seconds, self.collections, self._start = 0.0, 0, None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.collections += 1
            self._start = None

    def reset(self) -> None:
        self.seconds, self.collections = 0.0, 0

    def close(self) -> None:
        gc.callbacks.remove(self._callback)


def _key_of(mapping: dict, value) -> str | None:
    for k, v in mapping.items():
        if v is value:
            return str(k)[:40]
    return None


def _holder(target, ignore: set[int], depth: int = 5) -> str:
    """A chain of what refers to ``target`` (the attribute, key or function where found), innermost first;
    ``ignore``: ids of the census's own containers. (No closure here may capture the object walked: its cell
    would be the first referrer found.)"""
    chain, seen, obj = [], set(ignore) | {id(target)}, target
    for _ in range(depth):
        refs = gc.get_referrers(obj)
        seen.add(id(refs))
        found = None
        for r in refs:
            if id(r) not in seen and not inspect.isframe(r):
                found = r
                break
        del refs
        if found is None:
            break
        seen.add(id(found))
        if isinstance(found, dict):
            key = _key_of(found, obj)
            owner = None
            for o in gc.get_referrers(found):
                if getattr(o, "__dict__", None) is found:
                    owner = o
                    break
            chain.append(f"{type(owner).__qualname__}.{key}" if owner is not None else f"dict[{key!r}]")
            found = found if owner is None else owner
        elif inspect.isfunction(found):
            chain.append(f"function {found.__qualname__}")
        elif type(found).__name__ in ("cell", "tuple", "list"):
            chain.append(type(found).__name__)
        else:
            attr = _key_of(getattr(found, "__dict__", {}), obj)
            chain.append(type(found).__qualname__ + (f".{attr}" if attr else ""))
        seen.add(id(found))
        obj = found
    return " <- ".join(chain)


def memory_census(top: int = 12) -> dict:
    """Live CUDA tensors reachable from Python, storages counted once: their total and the largest ones."""
    gc.collect()
    storages: dict[int, torch.Tensor] = {}
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor) and o.is_cuda:
                storages.setdefault(o.untyped_storage().data_ptr(), o)
        except (ReferenceError, RuntimeError, NotImplementedError):
            continue   # a dead weak proxy; a tensor without a storage of its own (sparse, nested, a subclass's)
    sizes = sorted(((t.untyped_storage().nbytes(), p) for p, t in storages.items()), reverse=True)
    by_shape: collections.Counter = collections.Counter()
    for n, p in sizes:
        by_shape[(tuple(storages[p].shape), str(storages[p].dtype))] += n
    ignore = {id(storages), id(sizes)}
    largest = []
    for n, p in sizes[:top]:
        t = storages[p]
        largest.append({"mib": round(n / 2 ** 20, 2), "shape": list(t.shape), "dtype": str(t.dtype),
                        "held_by": _holder(t, ignore)})
    return {"reachable_mib": round(sum(n for n, _ in sizes) / 2 ** 20, 1),
            "allocated_mib": round(torch.cuda.memory_allocated() / 2 ** 20, 1), "largest": largest,
            "by_shape_mib": [[list(k[0]), k[1], round(v / 2 ** 20, 2)] for k, v in by_shape.most_common(top)]}


class CacheLog:
    """Inductor's FX graph cache and AOTAutograd's cache, logged at DEBUG into a file (hits, misses, bypass
    reasons, hash details), with mirage's INFO lines (what each build compiled and in how long) and the
    process's milliseconds on each line, from construction to ``close()``, which returns the counters' growth in
    between."""

    LOGGERS = {"torch._inductor.codecache": "DEBUG", "torch._functorch._aot_autograd.autograd_cache": "DEBUG",
               "torch_mirage": "INFO"}
    LEVELS = {"torch_mirage.partition.record": "DEBUG"}   # set only: its lines reach torch_mirage's handler

    def __init__(self, path: str):
        from torch._dynamo.utils import counters
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.handler = logging.FileHandler(path, mode="w")
        self.handler.setFormatter(logging.Formatter("%(relativeCreated)d %(name)s %(levelname)s %(message)s"))
        self.levels = {}
        for name, level in self.LOGGERS.items():
            logger = logging.getLogger(name)
            self.levels[name] = logger.level
            logger.setLevel(level)
            logger.addHandler(self.handler)
        for name, level in self.LEVELS.items():
            self.levels[name] = logging.getLogger(name).level
            logging.getLogger(name).setLevel(level)
        self.counters = counters
        self.before = self._counts()

    def _counts(self) -> dict:
        return {f"{group}.{k}": v for group in ("inductor", "aot_autograd")
                for k, v in self.counters[group].items() if "cache" in k}

    def close(self) -> dict:
        for name, level in self.levels.items():
            logger = logging.getLogger(name)
            logger.removeHandler(self.handler)
            logger.setLevel(level)
        self.handler.close()
        after = self._counts()
        return {k: v - self.before.get(k, 0) for k, v in after.items() if v - self.before.get(k, 0)}


def write_profile(profile: cProfile.Profile, path: str, top: int = 90) -> None:
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top // 2)
    stats.sort_stats("cumulative").print_callees("claim_regions|replay|replan|claim\\b|_example_mask")   # the partition stage's parts
    # the assemble stage's parts: Inductor's partitions loaded from its caches, and who makes FX modules / code
    stats.sort_stats("cumulative").print_callees("wrap_post_compile|try_load|regional_inductor|standalone_compile")
    stats.sort_stats("cumulative").print_callers("graph_module.py.*recompile|builtins.compile")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    profile.dump_stats(os.path.splitext(path)[0] + ".prof")    # the whole profile, for pstats where it lands
    with open(path, "w") as f:
        f.write(text.getvalue())


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
    p.add_argument("--profile", nargs="?", const="all", choices=["all", "warm"], default=None,
                   help="profile each process's first call into --out (warm: only the processes after the first)")
    p.add_argument("--caches", choices=["fresh", "shared"], default="fresh",
                   help="fresh: each process its own empty disk caches (mirage's, Inductor's, Triton's), so that every "
                        "column is a cold compile; shared: the machine's, so a process after the first compiles warm")
    p.add_argument("--census", action="store_true", help="the live CUDA tensors after each call (in the JSON)")
    p.add_argument("--cache-log", action="store_true",
                   help="log Inductor's and AOTAutograd's caches during each process's first call into --out")
    p.add_argument("--ptxas", nargs="+", choices=["torch", "triton"], default=None,
                   help="per --record-at entry: the ptxas its process compiles with (a cold A/B)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(one_process(args)), flush=True)
        return 0
    if args.ptxas is not None and len(args.ptxas) != len(args.record_at):
        p.error(f"--ptxas takes one value per --record-at entry ({len(args.record_at)}), got {len(args.ptxas)}")
    runs = []
    # a fresh process each: Dynamo, the caches in memory and the GPU start alike
    for index, record_at in enumerate(args.record_at):
        env = dict(os.environ, MIRAGE_CUDA_GRAPH_RECORD_AT=str(record_at))
        ptxas = args.ptxas[index] if args.ptxas else None
        if ptxas == "triton":
            import triton

            env["TRITON_PTXAS_PATH"] = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                                                    "ptxas")
        if args.caches == "fresh":   # every process compiles cold: empty disk caches of its own
            root = tempfile.mkdtemp(prefix=f"dyncache-{index}-")
            env.update({name: os.path.join(root, sub) for name, sub in (("MIRAGE_CACHE_DIR", "mirage"),
                        ("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton"))})
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", args.model, "--batch",
               str(args.batch), "--new-tokens", str(args.new_tokens), "--prompts",
               ",".join(map(str, args.prompts)), "--record-at", str(record_at), "--device", args.device,
               "--index", str(index)] + ["--tiny"] * args.tiny
        if args.profile == "all" or args.profile == "warm" and index > 0:
            cmd += ["--profile", "--out", args.out or "."]
        cmd += ["--census"] * args.census
        if args.cache_log:
            cmd += ["--cache-log", "--out", args.out or "."]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if args.caches == "fresh":
            shutil.rmtree(root, ignore_errors=True)
        sys.stdout.write("".join(line + "\n" for line in done.stdout.splitlines() if not line.startswith("RESULT ")))
        found = [line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not found:
            print(f"record_at {record_at} failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
            runs.append({"record_at": record_at, "error": done.stderr[-3000:]})
            continue
        runs.append(dict(json.loads(found[0]), ptxas=ptxas or "default"))
        print(f"run {index}: record_at {record_at} ptxas {ptxas or 'default'}: first call {runs[-1]['calls'][0]['s']} s, "
              f"stages {[g['stage_s'] for g in runs[-1]['graphs']]}", flush=True)
    doc = {"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device, "torch": torch.__version__,
           "triton": __import__("triton").__version__, "model": args.model, "batch": args.batch,
           "new_tokens": args.new_tokens, "prompts": args.prompts, "caches": args.caches, "runs": runs}
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
