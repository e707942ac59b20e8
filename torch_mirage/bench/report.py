"""Benchmark results as JSON, a markdown table and a PNG plot.

One document (``new_document``) holds the environment, the device ceilings, one record per
workload × batch × dtype (``case_record``, with the derived ratios) and one per LLM scenario.
``markdown`` renders the tables, ``plot`` the speedup over the best Inductor mode and the
fraction of the floor reached (skipped with a message when matplotlib is missing), ``merge``
joins the documents of several runs (e.g. the parts of ``benchmarks/run_h100.sh``).
"""
from __future__ import annotations

import json
import math
import os
import platform
from typing import Any, Sequence

import torch

from .._version import __version__
from .harness import MODES

SCHEMA = "torch_mirage.bench/1"
QUICK_NOTE = "quick mode: tiny shapes, correctness only; no timing claims"


def environment(device: str) -> dict:
    env = {"device": device, "torch": torch.__version__, "torch_mirage": __version__,
           "python": platform.python_version(), "cuda": torch.version.cuda}
    for name in ("triton", "transformers"):
        try:
            env[name] = __import__(name).__version__
        except Exception:   # absent or broken: say so, do not fail the run
            env[name] = None
    return env


def new_document(env: dict, ceilings: dict | None, settings: dict, timing: bool) -> dict:
    return {"schema": SCHEMA, "timing": timing, "note": "" if timing else QUICK_NOTE, "env": env,
            "ceilings": ceilings, "settings": settings, "cases": [], "llm": []}


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def case_record(workload: str, shapes: str, batch: int, dtype: str, nbytes: int, flops: int,
                floor_us: float | None, sets: int | None, modes: dict[str, dict]) -> dict:
    """One case with its derived figures: best Inductor (the faster timed Inductor mode),
    speedup = best Inductor µs ÷ mirage µs, fraction of floor = floor µs ÷ mirage µs."""
    inductor = [m["us"] for name, m in modes.items()
                if name.startswith("inductor") and m["status"] == "ok" and m["us"] is not None]
    best = min(inductor) if inductor else None
    mirage = modes.get("mirage", {})
    mirage_us = mirage.get("us") if mirage.get("status") == "ok" else None
    return {"workload": workload, "shapes": shapes, "batch": batch, "dtype": dtype, "bytes": nbytes,
            "flops": flops, "floor_us": floor_us, "sets": sets, "modes": modes, "best_inductor_us": best,
            "speedup_vs_best_inductor": _ratio(best, mirage_us), "fraction_of_floor": _ratio(floor_us, mirage_us)}


def write_json(doc: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=_jsonable)
    os.replace(tmp, path)


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and math.isnan(x):
        return None
    return str(x)


def load(path: str) -> dict:
    with open(path) as f:
        doc = json.load(f)
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a torch_mirage benchmark document (schema {doc.get('schema')!r})")
    return doc


def merge(docs: Sequence[dict]) -> dict:
    """One document from several runs. Records of the same case (or LLM scenario) are combined mode by mode: a
    later run's result for a mode replaces an earlier one, modes only an earlier run measured are kept (so a part
    that runs one more mode adds a column)."""
    if not docs:
        raise ValueError("merge: no documents")
    out = dict(docs[-1])
    cases: dict[tuple, dict] = {}
    llm: dict[tuple, dict] = {}

    def add(into: dict[tuple, dict], key: tuple, record: dict) -> dict:
        earlier = into.get(key)
        into[key] = dict(record, modes={**(earlier["modes"] if earlier else {}), **record["modes"]})
        return into[key]

    for d in docs:
        for c in d["cases"]:
            m = add(cases, (c["workload"], c["batch"], c["dtype"]), c)
            cases[(c["workload"], c["batch"], c["dtype"])] = case_record(
                m["workload"], m["shapes"], m["batch"], m["dtype"], m["bytes"], m["flops"], m["floor_us"],
                m["sets"], m["modes"])   # best Inductor, speedup and floor fraction over the combined modes
        for r in d.get("llm", []):
            add(llm, (r["model"], r["scenario"], r["dtype"], r.get("attn_implementation")), r)
    out["cases"], out["llm"] = list(cases.values()), list(llm.values())
    done = {f"{c['workload']} b{c['batch']} {c['dtype']}" for c in out["cases"]} | {r["model"] for r in out["llm"]}
    out["not_run"] = sorted({w for d in docs for w in d.get("not_run", [])} - done)
    out["notes"] = list(dict.fromkeys(n for d in docs for n in d.get("notes", [])))
    out["timing"] = all(d["timing"] for d in docs)
    out["note"] = "" if out["timing"] else QUICK_NOTE
    # a merged document brings the parts it was merged from (re-merging a results file keeps its history)
    out["parts"] = [p for d in docs
                    for p in d.get("parts") or [{"env": d["env"], "ceilings": d["ceilings"], "settings": d["settings"]}]]
    return out


# ---------------------------------------------------------------------------------------------
# Markdown


def _cell(m: dict | None, timing: bool) -> str:
    if m is None:
        return ""
    if m["status"] == "failed":
        return "FAIL"
    if m["status"] != "ok":
        return m["status"]
    return f"{m['us']:.1f}" if timing and m.get("us") is not None else "ok"


def _compile_cell(m: dict | None) -> str:
    """Mirage's cold compile (first call) and its warm one per graph, in seconds."""
    if not m or m.get("compile_s") is None:
        return "—"
    warm, graphs = m.get("warm_compile_s"), m.get("graphs") or 1
    return f"{m['compile_s']:.1f}" + (f" / {warm / graphs:.2f}" if warm is not None else "")


def _num(x: float | None, fmt: str) -> str:
    return format(x, fmt) if x is not None else "—"


def markdown(doc: dict) -> str:
    env, ceil, timing = doc["env"], doc.get("ceilings"), doc["timing"]
    lines = ["# torch-mirage benchmarks", "",
             f"Device: {env['device']} · torch {env['torch']} · triton {env.get('triton')} · "
             f"torch_mirage {env['torch_mirage']}" + (f" · transformers {env['transformers']}" if env.get("transformers") else "")]
    if ceil:
        lines.append(f"Ceilings measured in this run: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s "
                     f"(read + write), fp16 matmul {ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s, "
                     f"L2 {ceil['l2_bytes'] / 2 ** 20:.0f} MiB.")
    if not timing:
        lines.append(f"**{QUICK_NOTE}**")
    modes = _modes(doc["cases"])
    # GPU kernels one call launches, per mode (profiler; issue 17: kernels per decoder layer), where any was counted
    counted = any(r.get("kernels") is not None for c in doc["cases"] for r in c["modes"].values())
    if doc["cases"]:
        lines += ["", ("µs per call (median, inside one CUDA graph, inputs rotated past 3× L2); "
                       "speedup = best Inductor µs ÷ mirage µs; floor ÷ mirage = fraction of the floor reached; "
                       "mirage compile: the first call's seconds (cold on a fresh machine) / the same call again "
                       "after a Dynamo reset, with the caches the first filled, per graph compiled."
                       if timing else "ok = matches the higher-precision reference on fresh random inputs; "
                       "FAIL = wrong result or error (listed below). Tiny shapes (every dimension scaled down)."), "",
                  "| workload | b | dtype | floor µs | " + " | ".join(modes) + " | speedup | floor ÷ mirage | mirage compile s |"
                  + (f" kernels / call ({' / '.join(modes)}) |" if counted else ""),
                  "|---|---:|---|---:|" + "---:|" * len(modes) + "---:|---:|---:|" + ("---:|" if counted else "")]
        for c in doc["cases"]:
            cells = [_cell(c["modes"].get(m), timing) for m in modes]
            kernels = " / ".join(_num((c["modes"].get(m) or {}).get("kernels"), "d") for m in modes)
            lines.append(f"| {c['workload']} | {c['batch']} | {c['dtype']} | {_num(c['floor_us'], '.1f')} | "
                         + " | ".join(cells) + f" | {_num(c['speedup_vs_best_inductor'], '.2f')} | "
                         f"{_num(c['fraction_of_floor'], '.2f')} | {_compile_cell(c['modes'].get('mirage'))} |"
                         + (f" {kernels} |" if counted else ""))
        failures = [(c, m, r) for c in doc["cases"] for m, r in c["modes"].items() if r["status"] == "failed"]
        if failures:
            lines += ["", "Failures:", ""]
            lines += [f"- {c['workload']} b{c['batch']} {c['dtype']} {m}: {r['error']}" for c, m, r in failures]
    if doc.get("llm"):
        lines += ["", "## End-to-end LLMs (random weights)", "",
                  "kernels / layer: GPU kernels one step launches (profiler), over the model's layers.", "",
                  "| model | attention | scenario | dtype | mode | ms / step | tokens / s | compile s | peak GiB "
                  "| kernels / layer | status |",
                  "|---|---|---|---|---|---:|---:|---:|---:|---:|---|"]
        for r in doc["llm"]:
            for m, x in r["modes"].items():
                status = "ok" if x["status"] == "ok" else f"{x['status']}: {(x.get('error') or '')[:80]}"
                lines.append(f"| {r['model']} | {r.get('attn_implementation') or '—'} | {r['scenario']} | {r['dtype']} "
                             f"| {m} | {_num(x.get('ms'), '.3f')} | "
                             f"{_num(x.get('tokens_per_s'), ',.0f')} | {_num(x.get('compile_s'), '.1f')} | "
                             f"{_num(x.get('peak_gib'), '.2f')} | {_num(x.get('kernels_per_layer'), '.1f')} | "
                             f"{status} |")
    if doc.get("not_run"):
        lines += ["", "Not run (time budget spent): " + ", ".join(doc["not_run"])]
    for note in doc.get("notes", []):
        lines += ["", note]
    return "\n".join(lines) + "\n"


def _modes(cases: Sequence[dict]) -> list[str]:
    seen = {m for c in cases for m in c["modes"]}
    return [m for m in MODES if m in seen] + sorted(seen - set(MODES))


# ---------------------------------------------------------------------------------------------
# Plot


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend, or why there is no plot."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib)"
    return plt


def plot(doc: dict, path: str) -> str | None:
    """Speedup over best Inductor and fraction of floor, per case. Returns why not, or None."""
    if not doc["timing"]:
        return "no plot: the run made no timing claims"
    rows = [c for c in doc["cases"] if c["speedup_vs_best_inductor"] is not None]
    if not rows:
        return "no plot: no case has both a mirage and an Inductor time"
    plt = pyplot()
    if isinstance(plt, str):
        return plt
    labels = [f"{c['workload']} b{c['batch']} {c['dtype'].replace('float', 'f').replace('bfloat', 'bf')}" for c in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, max(4, 0.28 * len(rows) + 1.5)), sharey=True)
    y = list(range(len(rows)))
    speed = [c["speedup_vs_best_inductor"] for c in rows]
    ax1.barh(y, speed, color=["tab:green" if s >= 1 else "tab:red" for s in speed])
    ax1.axvline(1.0, color="black", lw=0.8)
    ax1.set_xscale("log")
    ax1.set_xlabel("speedup of mirage over best Inductor (×, log)")
    ax1.set_yticks(y, labels, fontsize=7)
    ax1.invert_yaxis()
    ax2.barh(y, [c["fraction_of_floor"] or 0 for c in rows], color="tab:blue")
    ax2.axvline(1.0, color="black", lw=0.8)
    ax2.set_xlabel("floor ÷ mirage time (1 = at the floor)")
    fig.suptitle(f"torch-mirage on {doc['env']['device']} (torch {doc['env']['torch']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def write_all(doc: dict, out_dir: str, stem: str = "results") -> list[str]:
    """JSON, markdown and (when possible) PNG under ``out_dir``; returns messages for the user."""
    os.makedirs(out_dir, exist_ok=True)
    write_json(doc, os.path.join(out_dir, f"{stem}.json"))
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(markdown(doc))
    why = plot(doc, os.path.join(out_dir, f"{stem}.png"))
    return [why] if why else []
