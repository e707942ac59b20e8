"""The partition stage of a Llama-3-8B-shaped (or another bench LLM's, ``--model``) 4-layer decode graph on the CPU (bf16-sized shapes in fp16, static
4k cache, decode at position 4000), cold disk cache: the stage's seconds, the claims (claimer and the μGraph forms
each plan builds, with counts) and, with ``--profile``, a cProfile
listing of it (``PROFILE_SORT=tottime`` sorts it by own time). The build stage is not run (it raises at once), so no kernel is compiled. Needs about 4 GB of memory.

``--compiles`` then compiles, for sm_90 (Triton's compiler on the CPU, nothing run), every launch candidate the
GPU's build stage would compile for each distinct μGraph kernel of the claimed plans (each alternative's
graph-defined ops, the candidates its plan proposes for 132 SMs), one after another, and prints the seconds per
kernel and per region: where a cold compile's build stage spends its Triton compiles (issue 15).

    python benchmarks/decode_partition_cpu.py [--profile] [--python-dispatcher] [--cache-dir DIR] [--layers N]
        [--hidden H] [--model qwen2-7b-4l] [--regions] [--candidates] [--compiles]

``--python-dispatcher`` runs the stage under AOTAutograd's Python dispatcher, as before ``pipeline.eager_dispatch``
turned it off (the before / after of that change).
"""
import argparse
import cProfile
import json
import math
import os
import pstats
import tempfile
import time

os.environ["TRITON_INTERPRET"] = "1"
os.environ["MIRAGE_STRICT"] = "1"

import torch  # noqa: E402

import torch_mirage  # noqa: E402
import torch_mirage.pipeline as pipeline  # noqa: E402
from torch_mirage.bench import llm  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profile", action="store_true")
    p.add_argument("--python-dispatcher", action="store_true")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (the partition's cost per layer)")
    p.add_argument("--hidden", type=int, help="hidden size (heads of 128; MLP 3.5x; default: the model's)")
    p.add_argument("--model", default="llama3-8b-4l", choices=list(llm.MODELS), help="the bench's LLM whose shapes "
                                                                                    "the graph has")
    p.add_argument("--cache-dir", help="the disk cache to use (default: a fresh one); a second run on the same "
                                       "directory measures the warm partition")
    p.add_argument("--regions", action="store_true", help="also print every region: who runs it and its ops")
    p.add_argument("--candidates", action="store_true", help="print each distinct μGraph kernel's launch candidates "
                                                             "for 132 SMs (grid, loop, split, warps, stages, estimate)")
    p.add_argument("--compiles", action="store_true", help="then compile every launch candidate of the plans' "
                                                           "μGraph kernels for sm_90 and print the seconds")
    args = p.parse_args()
    prof, seconds, claims, plans = cProfile.Profile(), [], {}, []
    claim = pipeline.claim_regions

    def timed(*a, **k):
        from torch._dispatch.python import enable_python_dispatcher
        import contextlib
        t = time.perf_counter()
        with enable_python_dispatcher() if args.python_dispatcher else contextlib.nullcontext():
            prof.enable()
            try:
                regions = claim(*a, **k)
            finally:
                prof.disable()
                seconds.append(time.perf_counter() - t)
            if args.regions:
                from torch_mirage.failures import nodes_summary
                for i, r in enumerate(regions):
                    print(f"region {i}: {r.compiled_by} ({r.claimer or r.reason}): {nodes_summary(r.nodes)}")
            for r in regions:      # what was claimed: claimer and, for μGraph plans, the forms built
                if r.compiled_by == "mirage" and hasattr(r.plan, "alternatives"):
                    plans.append((r.claimer, r.plan))
                if r.compiled_by == "mirage":
                    forms = "/".join(a.name for a in getattr(r.plan, "alternatives", ()))
                    key = f"{r.claimer} {forms}".strip()
                    claims[key] = claims.get(key, 0) + 1
            return regions

    class BuildSkipped(RuntimeError):
        pass

    def stop(*a, **k):
        raise BuildSkipped("partition measured; build not run")
    pipeline.claim_regions, pipeline.build_regions = timed, stop
    from dataclasses import replace
    base = llm.MODELS[args.model]
    sizes = {} if args.hidden is None else {
        "hidden_size": args.hidden, "intermediate_size": args.hidden * 7 // 2, "num_attention_heads": args.hidden // 128,
        "num_key_value_heads": max(1, args.hidden // 512)}
    spec = replace(base, config={**base.config, "num_hidden_layers": args.layers, **sizes})
    model, config = llm.build_model(spec, torch.float16, torch.device("cpu"), quick=False)
    cache = llm.static_cache(config, 1, 4096, torch.device("cpu"), torch.float16)

    def step(ids, position_ids, cache_position):
        return model(input_ids=ids, position_ids=position_ids, cache_position=cache_position, past_key_values=cache,
                     use_cache=True).logits
    backend = torch_mirage.MirageBackend(options=dict(min_region_us=0, measure_regions=False,
                                                      cache_dir=args.cache_dir or tempfile.mkdtemp()))
    try:
        with torch.no_grad():
            torch.compile(step, backend=backend)(torch.randint(0, 1000, (1, 1)), torch.tensor([[4000]]),
                                                 torch.tensor([4000]))
    except Exception as e:      # MIRAGE_STRICT: Dynamo wraps the stop as BackendCompilerFailed; anything else raises
        cause = e
        while cause is not None and not isinstance(cause, BuildSkipped):
            cause = cause.__cause__ or cause.__context__
        if cause is None or not seconds:
            raise
    print(json.dumps({"partition_s": [round(s, 2) for s in seconds], "model": args.model, "layers": args.layers,
                      "hidden": spec.config["hidden_size"], "claims": claims,
                      "python_dispatcher": args.python_dispatcher,
                      "cpus": os.cpu_count(), "torch": torch.__version__}))
    if args.candidates or args.compiles:
        jobs = candidate_jobs(plans)
    if args.candidates:
        from torch_mirage.superopt.launch import estimate_us, retile, streamed_bytes
        for job in jobs:
            body = job["body"]
            print(f"{job['what']}: grid {list(body.grid)} loop {body.forloop_range}")
            for c in job["configs"]:
                tiled = retile(body, c.grid, c.forloop_range)
                est = estimate_us(tiled, c.split, 132) if tiled is not None else None
                stage = streamed_bytes(tiled) if tiled is not None else None
                print(f"    grid {list(c.grid)} loop {c.forloop_range} split {c.split} warps {c.num_warps} "
                      f"stages {c.num_stages}{' prologue' if c.prologue else ''}"
                      f"{' in-kernel fold' if c.combine_in_kernel else ''}: {math.prod(c.grid) * c.split} programs, "
                      f"{stage} B a step, estimate {est if est is None else round(est, 1)} µs")
    if args.compiles:
        candidate_compiles(jobs)
    if args.profile:
        stats = pstats.Stats(prof).sort_stats(os.environ.get("PROFILE_SORT", "cumulative"))
        stats.print_stats(30)
        if os.environ.get("PROFILE_CALLEES"):      # e.g. _seeded: where one function's time goes
            stats.print_callees(os.environ["PROFILE_CALLEES"])


def candidate_jobs(plans, n_sm: int = 132) -> list[dict]:
    """Every distinct graph-defined op of ``plans`` (claimer, UGraphPlan) with the launch candidates its plan
    proposes for ``n_sm`` SMs."""
    from torch_mirage.superopt.launch import candidates

    seen, jobs = set(), []
    for claimer, plan in plans:
        for alt in plan.alternatives:
            kg = alt.graph
            for i, op in enumerate(kg.ops):
                if op.name != "customized":
                    continue
                ranks = [len(kg.ops[r[0]].shapes[r[1]]) for r in op.inputs]
                in_dtypes = [kg.ops[r[0]].dtypes[r[1]] for r in op.inputs]
                key = (op.body.hash(), tuple(ranks), tuple(in_dtypes))
                if key not in seen:
                    seen.add(key)
                    jobs.append(dict(what=f"{claimer} {alt.name} op{i}", body=op.body, ranks=ranks,
                                     in_dtypes=in_dtypes, out_dtypes=list(op.dtypes),
                                     configs=(plan.propose or candidates)(op.body, n_sm, 4)))
    return jobs


def candidate_compiles(jobs: list[dict]) -> None:
    """Each of ``jobs`` (:func:`candidate_jobs`) compiled for sm_90 by ``compile_time_cpu.py --jobs`` in a child
    process (this one imported Triton under the interpreter, which compiles nothing): one line per kernel and the
    total."""
    import pickle
    import subprocess
    import sys

    with tempfile.NamedTemporaryFile(suffix=".pkl", delete=False) as f:
        pickle.dump(jobs, f)
    here = os.path.dirname(os.path.abspath(__file__))
    subprocess.run([sys.executable, os.path.join(here, "compile_time_cpu.py"), "--jobs", f.name], check=True,
                   env={**os.environ, "TRITON_INTERPRET": "0"})
    os.unlink(f.name)


if __name__ == "__main__":
    main()
