"""What the backend did, for people: :class:`Report` (plain data; :func:`torch_mirage.explain` fills one).

Every graph the backend compiles appends a :class:`GraphReport`: its regions
(ops, who compiled them, why: a :class:`Reason` and a detail), what each claimer
passed over and why (:class:`DeclineReport`), whether the graph runs in a CUDA
graph and why not, and the time each pipeline stage took.
"""
from __future__ import annotations

import contextlib
import enum
import time
from dataclasses import dataclass, field
from typing import Any, Iterator


class Reason(enum.StrEnum):
    """Why a region runs where it runs, or why a claimer passed over nodes (the value is the words printed)."""
    CLAIMED = "claimed by a mirage pass"
    NOT_CLAIMED = "no mirage pass claims these ops"
    OPAQUE_OP = "holds ops outside mirage's IR"
    COMPUTE_BOUND = "compute-bound: left to the library call"
    DYNAMIC_SHAPE = "dynamic shapes: mirage compiles static shapes only"
    UNSUPPORTED_DEVICE = "not on a device mirage generates kernels for"
    UNSUPPORTED_DTYPE = "dtype mirage does not generate kernels for"
    SLOWER_THAN_INDUCTOR = "mirage's kernel measured slower than Inductor's"
    COMPILE_ERROR = "mirage failed to compile it; fell back"
    # reasons a claimer gives for passing over nodes (declines)
    BELOW_MIN_REGION = "memory traffic below MIRAGE_MIN_REGION_US: too small for a kernel of its own"
    TOO_LITTLE_WORK = "too little work to save a launch (layout only, or one cheap op)"
    NOT_CONVEX = "the nodes do not form one convex region"
    NOT_LOWERED = "holds ops the μGraph search cannot lower"
    NO_KERNEL = "no kernel builds for these shapes"
    NOT_FOUND = "the μGraph search found no verified μGraph within its budget"


@dataclass
class DeclineReport:
    """Nodes a claimer passed over (each may still be claimed by a later claimer), and why."""
    claimer: str
    reason: Reason
    detail: str
    nodes: list[str]           # IR node names


@dataclass
class RegionReport:
    ops: list[str]
    compiled_by: str
    reason: Reason
    detail: str = ""
    claimer: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    declines: list[DeclineReport] = field(default_factory=list)   # fallback regions: what claimers passed over

    def row(self) -> str:
        ops = ", ".join(o.replace("aten.", "").replace(".default", "") for o in self.ops)
        if len(ops) > 70:
            ops = ops[:67] + "..."
        extra = "; ".join(f"{k}={v}" for k, v in self.info.items())
        why = self.reason + (f" ({self.detail})" if self.detail else "")
        return f"    {self.compiled_by:<9} {len(self.ops):>4} ops  {why}\n              [{ops}]" + (f"\n              {extra}" if extra else "")


def gpu_peak_mib() -> float | None:
    """The process's peak of allocated memory on the current CUDA device (MiB) since it was last reset, or None
    where CUDA is not in use (nothing here initialises it)."""
    import torch
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return torch.cuda.max_memory_allocated() / 2**20


def gpu_peak_rise_mib(peak0: float | None) -> float | None:
    """How far the peak of :func:`gpu_peak_mib` rose above ``peak0`` (its reading before; None: CUDA was not in use
    then), or None where CUDA is not in use."""
    peak = gpu_peak_mib()
    return None if peak is None else max(0.0, peak - (peak0 or 0.0))


@dataclass
class GraphReport:
    index: int
    kind: str                       # "inference" | "forward" | "backward"
    num_nodes: int = 0
    num_inputs: int = 0
    regions: list[RegionReport] = field(default_factory=list)
    cuda_graph: bool = False
    cuda_graph_reason: str = ""
    fallback_error: str | None = None
    whole_graph_to_inductor: bool = False   # no mirage region: the Dynamo graph went to Inductor's compile_fx
    mutated_inputs: tuple[int, ...] = ()    # graph inputs written in place (cloned when the graph is timed)
    timeable: bool = False                  # may be re-run on real inputs (CUDA, no random ops; symbolic: at one size)
    choice: str | None = None            # "mirage" | "inductor": the faster version of the whole graph, timed
    choice_times_us: dict[str, float] = field(default_factory=dict)
    choice_cached: bool = False          # that choice read from the disk cache (an earlier compile timed it)
    choice_against: str = "the whole graph"   # Inductor's compile timed against: of the whole graph, or the
    #                                           symbolic graph's that a static compile of one of its sizes replaces
    untimed_reason: str = ""             # why mirage's version could not be timed against Inductor's
    prelude: str = ""                    # the input-only ops run first as one Inductor graph (MIRAGE_PRELUDE)
    host_scalars: tuple[str, ...] = ()   # symbolic scalar inputs computed on the host around the graph (host_scalars)
    symbolic_sizes: bool = False         # its inputs have symbolic sizes: captured once per size (SizedCudaGraphs)
    static_sizes: int = 0                # of symbolic sizes: compiled again at its first this many sizes (StaticSizes)
    sizes_of: str = ""                   # such a compile: the symbolic graph and the sizes it fixed
    stage_times_ms: dict[str, float] = field(default_factory=dict)
    # how far each stage raised the process's peak of allocated GPU memory (MiB; only where CUDA was in use):
    # a compile whose tuning or timing holds more than the model's own memory shows here, stage by stage
    stage_peak_rise_mib: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t0, peak0 = time.perf_counter(), gpu_peak_mib()
        try:
            yield
        finally:
            self.stage_times_ms[name] = self.stage_times_ms.get(name, 0.0) + (time.perf_counter() - t0) * 1e3
            rise = gpu_peak_rise_mib(peak0)
            if rise is not None:
                self.stage_peak_rise_mib[name] = round(self.stage_peak_rise_mib.get(name, 0.0) + rise, 1)

    def __str__(self) -> str:
        cg = ("yes, one per input size" if self.symbolic_sizes else "yes") if self.cuda_graph else \
            f"no ({self.cuda_graph_reason})"
        stages = ", ".join(f"{k} {v:.0f} ms" + (f" (GPU peak +{self.stage_peak_rise_mib[k]:.0f} MiB)"
                                                 if self.stage_peak_rise_mib.get(k) else "")
                           for k, v in self.stage_times_ms.items())
        lines = [f"graph {self.index} [{self.kind}]: {self.num_nodes} ATen nodes, {len(self.regions)} regions, "
                 f"CUDA graph: {cg}", f"  stages: {stages}"]
        if self.sizes_of:
            lines.append(f"  compiled with {self.sizes_of} fixed (MIRAGE_STATIC_SIZES)")
        if self.static_sizes:
            lines.append(f"  symbolic sizes: compiled again with its sizes fixed at each input size that comes "
                         f"back, up to {self.static_sizes} (MIRAGE_STATIC_SIZES); other sizes run this graph")
        if self.whole_graph_to_inductor:
            lines.append("  no mirage region: the whole graph went to Inductor's own compile_fx")
        if self.mutated_inputs:
            lines.append(f"  writes to inputs {list(self.mutated_inputs)} in place")
        if self.prelude:
            lines.append(f"  prelude (MIRAGE_PRELUDE): {self.prelude}")
        if self.host_scalars:
            lines.append(f"  symbolic scalars computed on the host around it (static shapes): "
                         f"{', '.join(self.host_scalars)}")
        if self.choice:
            times = ", ".join(f"{k} {v:.1f} µs" for k, v in self.choice_times_us.items())
            when = "by an earlier compile (disk cache)" if self.choice_cached else "on first call"
            lines.append(f"  timed against Inductor's compile of {self.choice_against} {when}: kept {self.choice} "
                         f"({times})")
        if self.untimed_reason:
            kept = "Inductor's compile" if self.choice == "inductor" else "mirage's version"
            lines.append(f"  not timed against Inductor ({self.untimed_reason}): kept {kept}")
        if self.fallback_error:
            lines.append(f"  fell back: {self.fallback_error}")
        lines += [r.row() for r in self.regions]
        return "\n".join(lines)


@dataclass
class Report:
    graphs: list[GraphReport] = field(default_factory=list)

    def new_graph(self, kind: str) -> GraphReport:
        g = GraphReport(index=len(self.graphs), kind=kind)
        self.graphs.append(g)
        return g

    @property
    def regions(self) -> list[RegionReport]:
        return [r for g in self.graphs for r in g.regions]

    def __str__(self) -> str:
        mirage = sum(r.compiled_by == "mirage" for r in self.regions)
        head = f"torch_mirage report: {len(self.graphs)} graphs, {len(self.regions)} regions ({mirage} compiled by mirage)"
        return "\n".join([head] + [str(g) for g in self.graphs])
