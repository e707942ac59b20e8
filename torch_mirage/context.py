"""The compile context every stage of one graph's compile takes: :class:`CompileContext`, and the
:class:`Target` its kernels run on.

The context is passed, never ambient: a stage reads the configuration, the disk cache, the execution target
and the failure log from it, and records its time in the graph's report. The environment variable that picks
Triton's interpreter (``TRITON_INTERPRET``) is read here only (:meth:`Target.current`); claimers and codegen
ask the context (or this module) instead of the environment.
"""
from __future__ import annotations

import contextlib
import enum
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from .analysis.graph import GraphAnalysis, analyse
from .cache import DiskCache
from .config import Config, load
from .failures import FailureLog, stage
from .report import GraphReport

# the values Triton itself reads as true for TRITON_INTERPRET (triton.knobs' getenv_bool)
_TRUE = {"1", "true", "yes", "on"}


class Target(enum.Enum):
    """Where generated Triton kernels run."""
    CUDA = "Triton kernels on a CUDA device"
    INTERPRETER = "Triton's interpreter on CPU tensors (TRITON_INTERPRET=1)"

    @classmethod
    def current(cls) -> Target:
        """The target Triton runs kernels on in this process now: its interpreter where ``TRITON_INTERPRET`` is
        set (read as Triton reads it), else CUDA."""
        return cls.INTERPRETER if os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE else cls.CUDA

    def runs_on(self, device_type: str) -> bool:
        """Whether kernels for tensors on ``device_type`` ("cuda", "cpu", ...) run on this target."""
        return device_type == "cuda" or (self is Target.INTERPRETER and device_type == "cpu")


@dataclass
class CompileContext:
    """One graph's compile: the configuration, the disk cache (None: off), the execution target, the report the
    stages write to and the failures that changed what runs."""
    config: Config
    report: GraphReport
    cache: DiskCache | None
    static_input_indices: Sequence[int] = ()
    target: Target = field(default_factory=Target.current)
    failures: FailureLog | None = None   # failures that changed what runs, logged grouped at the end
    analysis: GraphAnalysis | None = None   # the analyse stage's facts about the graph being compiled
    # the real tensors of the call being compiled, by ATen graph input index (user inputs only, where Dynamo's and
    # the ATen graph's inputs line up): launch tuning may time on them; no kernel is specialised on them
    observed_inputs: dict[int, Any] = field(default_factory=dict)
    # the μGraphs the build stage compiled in this graph, by what they are built from (plan's μGraphs, the example
    # inputs' shapes, dtypes and strides): a region of the same gets the same compiled kernels (a model's layers)
    built_ugraphs: dict[Any, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.failures is None:
            self.failures = FailureLog(f"{self.report.kind} graph {self.report.index}")

    @classmethod
    def standalone(cls, config: Config | None = None, *, target: Target | None = None,
                   cache: DiskCache | None = None) -> CompileContext:
        """A context for running one stage on its own (a claimer in a test or a script): the configuration from
        the environment unless given, a fresh report, no disk cache unless given, the current target unless
        given."""
        return cls(config if config is not None else load(), GraphReport(0, "inference"), cache,
                   target=target if target is not None else Target.current())

    def analysis_of(self, graph) -> GraphAnalysis:
        """The analyse stage's facts about ``graph``: the pipeline's, or computed here once for a claimer run on its
        own (a test, a script)."""
        if self.analysis is None or self.analysis.graph is not graph:
            self.analysis = analyse(graph)
        return self.analysis

    @property
    def interpret(self) -> bool:
        """Whether kernels run in Triton's interpreter (CPU tensors qualify, bf16 does not)."""
        return self.target is Target.INTERPRETER

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """A pipeline stage: its time goes to the report, an exception leaving it names it."""
        with self.report.stage(name), stage(name):
            yield
