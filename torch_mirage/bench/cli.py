"""``python -m torch_mirage bench``: run the suite, write JSON + markdown + PNG.

    python -m torch_mirage bench                       # everything, on a CUDA GPU
    python -m torch_mirage bench --quick               # tiny shapes, correctness only (CPU is fine)
    python -m torch_mirage bench --workloads gqa h2o_core --modes inductor mirage --batch 8 --dtype float16
    python -m torch_mirage bench --merge a/results.json b/results.json --out merged/
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Callable, Sequence

import torch

from . import harness, has_transformers, llm, models, report
from . import workloads as W

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _list(values: Sequence[list] | None) -> list | None:
    """``--x a b`` and ``--x a,b`` alike: the per-word lists the argument types return, flattened."""
    if values is None:
        return None
    return [v for item in values for v in item]


def _names(known: Sequence[str], extra: Sequence[str] = ()) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated list of names from ``known`` (or ``extra``)."""
    valid = [*known, *extra]

    def parse(text: str) -> list[str]:
        names = [n for n in text.split(",") if n]
        bad = [n for n in names if n not in valid]
        if bad:
            raise argparse.ArgumentTypeError(f"invalid choice: {bad[0]!r} (choose from "
                                             f"{', '.join(map(repr, valid))})")
        return names
    return parse


def _numbers(kind: type, what: str, low: float, strict: bool = True) -> Callable[[str], list]:
    """An argparse type: a comma-separated list of ``kind`` values above ``low`` (or at least it)."""
    def parse(text: str) -> list:
        out = []
        for word in (w for w in text.split(",") if w):
            try:
                value = kind(word)
            except ValueError:
                value = None
            if value is None or value != value or (value <= low if strict else value < low):
                raise argparse.ArgumentTypeError(f"invalid value: {word!r} ({what})")
            out.append(value)
        return out
    return parse


def _one(parse: Callable[[str], list]) -> Callable[[str], object]:
    """A single-valued argparse type from a list type."""
    def one(text: str) -> object:
        values = parse(text)
        if len(values) != 1:
            raise argparse.ArgumentTypeError(f"invalid value: {text!r} (one value)")
        return values[0]
    return one


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m torch_mirage bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", type=_names(list(W.WORKLOADS), ["none"]),
                   help=f"workloads (default: all; --quick: {' '.join(W.QUICK_DEFAULT)}); "
                   f"'none' for none. Known: {' '.join(W.WORKLOADS)}")
    p.add_argument("--modes", nargs="+", type=_names(list(harness.COMPILERS)),
                   help=f"modes (default: {' '.join(harness.MODES)})")
    p.add_argument("--batch", nargs="+", type=_numbers(int, "batch sizes are positive integers, e.g. 1,8", 0),
                   help="batch sizes (default: 1 8; --quick: 1)")
    p.add_argument("--dtype", nargs="+", type=_names(list(DTYPES)),
                   help="float16 bfloat16 float32 (default: float16 bfloat16; --quick on a CPU: float32)")
    p.add_argument("--llms", nargs="+", type=_names(list(llm.MODELS), ["none"]),
                   help=f"end-to-end LLMs (default: all; --quick: {' '.join(llm.QUICK_DEFAULT)}); "
                   f"'none' for none. Known: {' '.join(llm.MODELS)}")
    p.add_argument("--llm-modes", nargs="+", type=_names(list(llm.LLM_MODES)),
                   help=f"modes for the LLMs (default: {' '.join(llm.LLM_MODES)}; --quick: {' '.join(llm.QUICK_MODES)})")
    p.add_argument("--llm-attn", nargs="+", type=_names(list(llm.ATTENTION)),
                   help="HF attention implementations for the LLMs: 'default' (each model's own: sdpa, Gemma-2 "
                   "eager), 'sdpa', 'eager' (default: default); each model runs once per implementation")
    p.add_argument("--llm-scenarios", nargs="+", choices=list(llm.SCENARIO_KINDS),
                   help="which LLM scenarios run: decode (a step near the end of the 4096-slot static cache, one "
                   "per --batch), prefill, early (a decode step at position 256 of that cache) (default: decode "
                   "prefill)")
    p.add_argument("--llm-dtype", default="bfloat16", choices=list(DTYPES),
                   help="dtype of the LLMs (default: bfloat16; --quick on a CPU: float32)")
    p.add_argument("--models", nargs="+", type=_names(list(models.MODELS)),
                   help="Hugging Face models from configs, end to end (prefill and greedy generate; its own modes: "
                   f"eager inductor reduce-overhead max-autotune mirage). Known: {' '.join(models.MODELS)}; "
                   "writes --out/models.*")
    p.add_argument("--quick", action="store_true", help="tiny shapes, correctness only, no timing claims")
    p.add_argument("--out", default="bench-results", help="output directory (default: ./bench-results)")
    p.add_argument("--name", default="results", help="file stem of the outputs (default: results)")
    p.add_argument("--target-ms", type=_one(_numbers(float, "a positive number of milliseconds", 0)), default=10.0,
                   help="GPU time per timing repeat (default: 10)")
    p.add_argument("--repeats", type=_one(_numbers(int, "a positive integer", 0)), default=7,
                   help="timing repeats; the median is reported (default: 7)")
    p.add_argument("--budget-s", type=_one(_numbers(float, "a number of seconds >= 0", 0, strict=False)),
                   default=None, help="start no new case or model after this many seconds; the rest is listed as not run")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="merge earlier result files into --out/NAME.* and exit")
    p.add_argument("--inductor-caches", action="store_true",
                   help="keep Inductor's FX graph and AOTAutograd caches on, as a user has them (a second run on the "
                        "same machine then reports every mode's warm compile); default: off, so that no mode's "
                        "compile seconds are a hit on another mode's compile of the same graph")
    p.add_argument("-v", "--verbose", action="store_true", help="log torch_mirage at INFO")
    return p


def _load_merged(p: argparse.ArgumentParser, paths: Sequence[str]) -> list[dict]:
    docs = []
    for path in paths:
        try:
            docs.append(report.load(path))
        except (OSError, ValueError) as e:   # missing, unreadable, not JSON, not a benchmark document
            p.error(f"argument --merge: cannot read {path!r} ({getattr(e, 'strerror', None) or e}); "
                    f"give result JSON files written by {p.prog}")
    return docs


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.INFO)
        os.environ["MIRAGE_LOG_LEVEL"] = "INFO"   # the backend sets its logger's level from this knob
    if args.merge:
        doc = report.merge(_load_merged(p, args.merge))
        for msg in report.write_all(doc, args.out, args.name):
            print(msg)
        print(report.markdown(doc))
        return 0
    if args.models:
        if not has_transformers():
            print(f"bench: {models.MISSING}", file=sys.stderr)
            return 2
        models.run(_list(args.models), args.out, "models" if args.name == "results" else args.name,
                   tiny=True if args.quick else None)
        return 0
    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        print("bench: timing needs a CUDA GPU; without one, run with --quick (tiny shapes, correctness only)",
              file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    quick, timing = args.quick, not args.quick
    wl_names = _list(args.workloads) or (list(W.QUICK_DEFAULT) if quick else None)
    workloads = [] if wl_names == ["none"] else W.get(wl_names)
    modes = _list(args.modes) or list(harness.MODES)
    batches = _list(args.batch) or ([1] if quick else [1, 8])
    dtypes = [DTYPES[d] for d in (_list(args.dtype) or (["float32"] if not cuda else ["float16", "bfloat16"]))]
    llm_names = _list(args.llms) or (list(llm.QUICK_DEFAULT) if quick else None)
    llm_specs = [] if llm_names == ["none"] else llm.get(llm_names, _list(args.llm_attn) or ["default"])
    llm_modes = _list(args.llm_modes) or list(llm.QUICK_MODES if quick else llm.LLM_MODES)
    llm_dtype = torch.float32 if not cuda else DTYPES[args.llm_dtype]
    timing_cfg = {"target_ms": args.target_ms, "repeats": args.repeats} if timing else None

    caches = "FX graph, AOTAutograd and Triton kernel caches on" if args.inductor_caches else \
        "FX graph and AOTAutograd caches off; Triton kernel caches on"
    if not args.inductor_caches:
        _cold_graph_caches()
    t_start = time.perf_counter()
    ceilings = None
    if timing:
        c = harness.measure_ceilings()
        ceilings = vars(c)
        print(f"ceilings: copy {c.copy_bytes_per_s / 1e12:.2f} TB/s, fp16 matmul {c.matmul_flops_per_s / 1e12:.0f} "
              f"TFLOP/s, L2 {c.l2_bytes / 2 ** 20:.0f} MiB", flush=True)
    device_name = torch.cuda.get_device_name(0) if cuda else f"CPU ({os.cpu_count()} cores)"
    settings = {"quick": quick, "modes": modes, "batches": batches, "dtypes": [str(d).replace("torch.", "") for d in dtypes],
                "workloads": [w.name for w in workloads], "llms": [s.name for s in llm_specs], "llm_modes": llm_modes,
                "llm_scenarios": args.llm_scenarios or list(llm.DEFAULT_SCENARIOS),
                "llm_dtype": str(llm_dtype).replace("torch.", ""), "timing": timing_cfg,
                "compile_caches": caches, "argv": list(argv or sys.argv[1:])}
    doc = report.new_document(report.environment(device_name), ceilings, settings, timing)
    if not timing:
        print(f"bench: {report.QUICK_NOTE} ({device_name})")

    def over_budget(what: str) -> bool:
        if args.budget_s is None or time.perf_counter() - t_start < args.budget_s:
            return False
        doc.setdefault("not_run", []).append(what)
        print(f"bench: budget of {args.budget_s:.0f} s spent; not run: {what}", flush=True)
        return True

    for dtype in dtypes:
        for w in workloads:
            for b in batches:
                if over_budget(f"{w.name} b{b} {str(dtype).replace('torch.', '')}"):
                    continue
                doc["cases"].append(_run_workload(w, b, dtype, modes, device, quick, timing_cfg, ceilings))
                report.write_json(doc, os.path.join(args.out, f"{args.name}.json"))   # partial results survive a kill

    if llm_specs and not has_transformers():
        print(f"bench: {llm.MISSING}")
        doc.setdefault("notes", []).append(llm.MISSING)
    elif llm_specs:
        for spec in llm_specs:
            if over_budget(spec.name):
                continue
            print(f"{spec.name} ({str(llm_dtype).replace('torch.', '')}, attention {spec.attn})", flush=True)
            def keep(record: dict) -> None:
                doc["llm"].append(record)
                report.write_json(doc, os.path.join(args.out, f"{args.name}.json"))

            try:
                llm.run_model(spec, batches, llm_dtype, llm_modes, device, quick, timing_cfg,
                              echo=lambda s: print(s, flush=True), on_record=keep,
                              kinds=args.llm_scenarios or llm.DEFAULT_SCENARIOS)
            except Exception as e:   # building the model failed (API drift across versions): record and go on
                msg = f"{spec.name}: could not build or run ({harness._short(e)})"
                print(f"bench: {msg}")
                doc.setdefault("notes", []).append(msg)
            report.write_json(doc, os.path.join(args.out, f"{args.name}.json"))

    doc["wall_s"] = time.perf_counter() - t_start
    for msg in report.write_all(doc, args.out, args.name):
        print(msg)
    print(report.markdown(doc))
    print(f"bench: wrote {os.path.join(args.out, args.name)}.{{json,md" + (",png" if timing else "") +
          f"}} in {doc['wall_s']:.0f} s")
    return 0


def _cold_graph_caches() -> None:
    """Turn off Inductor's whole-graph caches (FX graph, AOTAutograd) for this process, so that a mode's
    compile time is not a cache hit on another mode's (or an earlier run's) compile of the same graph.
    Per-kernel Triton caches stay on."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = False
    if hasattr(functorch_config, "enable_autograd_cache"):
        functorch_config.enable_autograd_cache = False


def _run_workload(w: W.Workload, batch: int, dtype: torch.dtype, modes: Sequence[str], device: torch.device,
                  quick: bool, timing: dict | None, ceilings: dict | None) -> dict:
    spec = harness.workload_spec(w, batch, dtype, device, quick)
    floor = W.floor_us(W.Cost(spec.info["bytes"], spec.info["flops"]), ceilings["copy_bytes_per_s"],
                       ceilings["matmul_flops_per_s"]) if ceilings else None
    sets = harness.rotation_count(spec.set_bytes, ceilings["l2_bytes"]) if ceilings else None
    print(f"{spec.name}: {w.shapes}" + (f"; floor {floor:.1f} us, {sets} input sets" if floor else ""), flush=True)
    timing_case = dict(timing, sets=sets) if timing else None
    results = harness.run_case(spec, modes, dtype, device, timing_case, echo=lambda s: print(s, flush=True))
    return report.case_record(w.name, w.shapes, batch, str(dtype).replace("torch.", ""), spec.info["bytes"],
                              spec.info["flops"], floor, sets, {m: harness.result_dict(r) for m, r in results.items()})


if __name__ == "__main__":
    sys.exit(main())
