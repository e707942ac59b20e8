"""StitchPlan: what the stitch partitioner decided for one region (AStitch §4).

A stitch region is a convex set of memory-intensive IR nodes that runs as one
kernel. Its plan records

* the nodes by role: ``prologue`` layout ops applied to the region's inputs
  (views, free on real tensors), ``compute`` ops the kernel evaluates, and
  ``epilogue`` layout ops applied to what the kernel stored;
* the iteration ``space``: every computed value broadcasts into it; its last
  dimension is the *row* (reductions run over it), the others are *rows*;
* the :class:`DominantOp` s (reductions; heavy elementwise ops feeding a
  broadcast) whose needs fix the thread mapping of the whole region;
* one :class:`Scheme` per data edge inside the region (independent, local,
  regional, global);
* the :class:`ThreadMapping` (horizontal packing of short rows, one row per
  program, a chunked loop over long rows, a long row split over several
  programs — AStitch's task splitting), chosen within :class:`StitchLimits`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from ..capture.ir import Node, Value


class Scheme(enum.Enum):
    """How a value travels from its producer to a consumer (AStitch's operator-stitching schemes)."""
    INDEPENDENT = "independent"   # no data edge: independent sub-graphs stitched into one kernel
    LOCAL = "local"               # element to element, in registers of the same thread
    REGIONAL = "regional"         # one row shared by the block: on-chip (registers / shared memory)
    GLOBAL = "global"             # through device memory: re-read (looped rows) or a kernel boundary


class Strategy(enum.Enum):
    """Thread-mapping strategies (AStitch's task packing / splitting, expressed as Triton programs)."""
    ELEMENTWISE = "elementwise"   # 2-D tiles, no reduction
    PACKED = "packed"             # horizontal packing: BLOCK_M short rows per program, row in registers
    ROW = "row"                   # one row per program, row in registers
    LOOPED = "looped"             # one row per program, looped over in BLOCK_N chunks (row does not fit)
    SPLIT = "split"               # task splitting: a long row over several programs, partials combined after


@dataclass(frozen=True)
class StitchLimits:
    """The knobs of the thread-mapping choice (defaults fit an H100; tests force the long-row paths with them).

    ``split``: None chooses task splitting from rows, row length and the SM count; 1 never splits; k > 1 splits
    every looped row over (about) k programs when its reductions take one pass.
    """
    max_row_on_chip: int = 8192     # longest row (elements, power of two) a program keeps in registers
    # longest row one program holds whole (in registers) when the rows alone fill the SMs; H100 sweep of
    # 4096 x 32768 fp16 at 32 warps: softmax 0.90 of copy bandwidth, layer norm 0.95, against 0.82 / 0.93
    # looped (benchmarks/results/stitch_sweep_h100.json)
    max_row_whole: int = 32768
    tile_elems: int = 2048          # elements per program that horizontal packing aims at
    loop_chunk: int = 4096          # chunk of a looped row
    loop_warps: int | None = None   # warps of a looped / split program (None: from the chunk size)
    row_warps: int | None = None    # warps of a program holding whole rows (None: from the tile size)
    on_chip_bytes: int | None = None   # bytes of fp32 row tiles a program may hold (None: from the device)
    split: int | None = None
    min_split_len: int = 1024       # shortest piece of a row one split program takes


@dataclass(frozen=True)
class ThreadMapping:
    strategy: Strategy
    rows: int          # product of the non-reduced dims of the space
    row_len: int       # the last dim of the space
    block_m: int
    block_n: int
    num_warps: int
    split: int = 1            # programs per row (SPLIT)
    split_len: int = 0        # elements of the row each split program covers (a multiple of block_n)
    passes: int = 1           # reads of the row (LOOPED / SPLIT): reduction passes + the store pass
    fusions: tuple[str, ...] = ()   # reductions accumulated together in one pass ("online softmax", "Welford")

    @property
    def grid(self) -> tuple[int, ...]:
        gm = -(-self.rows // self.block_m)
        if self.strategy is Strategy.ELEMENTWISE:
            return (gm, -(-self.row_len // self.block_n))
        if self.strategy is Strategy.SPLIT:
            return (gm, self.split)
        return (gm,)

    @property
    def single_pass(self) -> bool:
        return self.strategy not in (Strategy.LOOPED, Strategy.SPLIT)

    def describe(self) -> str:
        how = "".join(f", {f}" for f in self.fusions)
        per = {Strategy.ELEMENTWISE: f"{self.block_m}x{self.block_n} tiles/program",
               Strategy.PACKED: f"{self.block_m} rows/program (horizontal packing)",
               Strategy.ROW: "1 row/program",
               Strategy.LOOPED: f"1 row/program looped in chunks{how}, {self.passes} passes",
               Strategy.SPLIT: f"row split over {self.split} programs of {self.split_len}{how}, "
                               f"{self.passes} passes in 2 kernels (partials, combine + store)"}[self.strategy]
        grid = "x".join(map(str, self.grid))
        return (f"rows={self.rows} x {self.row_len}, {per}, BLOCK_M={self.block_m}, BLOCK_N={self.block_n}, "
                f"grid={grid}, num_warps={self.num_warps}")


@dataclass(frozen=True)
class DominantOp:
    node: Node
    role: str     # "dominant" | "sub-dominant"
    why: str

    def describe(self) -> str:
        return f"{self.node.name}={self.node.op.name} ({self.role}: {self.why})"


@dataclass(eq=False)
class StitchPlan:
    prologue: list[Node]
    compute: list[Node]
    epilogue: list[Node]
    space: tuple[int, ...]
    loads: list[Value]                 # tensors the kernel reads (region inputs or prologue results)
    stored: list[Value]                # compute values the kernel writes
    outputs: list[Value]               # the region's outputs, in Region.outputs order
    row_values: frozenset[int]         # ids of values constant along the row
    dominants: list[DominantOp]
    schemes: dict[tuple[str, str], Scheme]   # (producer value, consumer node) -> scheme
    mapping: ThreadMapping
    groups: int = 1                    # independent sub-graphs stitched together
    smem_bytes: int = 0                # on-chip bytes the regional scheme keeps per program
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return self.mapping.rows

    @property
    def row_len(self) -> int:
        return self.mapping.row_len

    def scheme_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for s in self.schemes.values():
            counts[s.value] = counts.get(s.value, 0) + 1
        if self.groups > 1:
            counts[Scheme.INDEPENDENT.value] = self.groups - 1
        return counts

    def summary(self) -> dict[str, Any]:
        """Facts for the explain report."""
        dom = [d.describe() for d in self.dominants]
        return {
            "dominant": dom[0] if dom else "none (elementwise only)",
            "sub_dominant": dom[1:],
            "schemes": self.scheme_counts(),
            "thread_mapping": self.mapping.describe(),
            "space": list(self.space),
            "smem_bytes": self.smem_bytes,
        }
