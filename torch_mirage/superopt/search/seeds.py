"""The hand-built library's μGraphs (:mod:`..library`) as the search's seeds, each instantiated for one region.

For a region's reference program (:func:`.reference.reference_of`) each asked-for library workload is tried
before the search enumerates anything: its μGraph's inputs are bound to the region's by shape (every assignment of
region inputs to μGraph inputs whose shapes fix the workload's dims — ``Workload.input_shapes`` inverted; a
batched activation (batch, seq, k) folded into (batch·seq, k) rows; a weight the region reads transposed —
``nn.Linear``'s (n, k) — bound as its transpose), its constants (an RMS norm's eps) taken from
the reference's. Each instance is checked like any search result, against the region's own program: a cheap fp64
probe first (it drops the wrong one of two same-shaped inputs), then the verifier (finite-field test to the
configured bound, then the float test) — on the search's shrunk sizes (:mod:`.shrink`) where the region is big,
the instance drawn there with the shrunk tile so that the grid and the for-loop split as at the real size.

The first verified instance is the region's :class:`Seed`: the library's μGraph itself at the region's dims (so
its hash, and its kernel, are the library's), run on the region's inputs through :func:`seed_kernel` (input
order, rows folded, the output viewed back).
"""
from __future__ import annotations

import functools
import itertools
import logging
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ...numerics import relative_error, tolerance
from ...ugraph import KernelGraph, Ref
from .. import library
from ..builder import new_kernel_graph
from ..executor import execute
from ..validate import InvalidMuGraph, validate
from ..verify import verify
from .shrink import SMALL_TILE, shrunk_problems

log = logging.getLogger("torch_mirage")

# the library workloads tried as seeds by default (attention itself is claimed by analysis, with its own seeds:
# superopt/attention_claim.py; FlashDecoding is one of its alternatives)
SEED_WORKLOADS = ("qknorm_attention", "lora", "ntrans", "rmsnorm_linear", "gated_mlp")
# keyword constants a μGraph takes that the shapes do not fix: drawn from the reference's constants (a norm's
# eps; attention's score scale, which is the program's own and not 1/√d of the shrunk head size the verifier
# checks at, nor always 1/√d at all)
CONSTANTS: dict[str, tuple[str, ...]] = {"ntrans": ("eps",), "rmsnorm_linear": ("eps",),
                                         "qknorm_attention": ("eps", "scale")}
# the μGraph input whose rows may come with leading dims — a (batch, seq, k) activation for an (m, k) one — and
# then the output carries the same leading dims
BATCHED_INPUT = {"lora": 0, "gated_mlp": 0, "rmsnorm_linear": 0}
# the shrunk instance's schedule: split at the shrunk tile like the real one at its tile (nTrans' tile is rows
# per block, not a split of a long dim: its default)
SMALL_SCHEDULE: dict[str, dict] = {"ntrans": {}}
_PROBE = (1009, 1013, 1019, 1021, 1031, 1033, 1039)   # distinct primes: which dim lands where in the shapes


@dataclass(frozen=True)
class Seed:
    """A library μGraph verified for a region: ``graph`` takes the region reference's input ``order[j]`` as its
    input ``j`` (transposed where ``transposed[j]``), reshaped to ``shapes[j]``."""
    name: str
    graph: KernelGraph
    order: tuple[int, ...]
    transposed: tuple[bool, ...]
    shapes: tuple[tuple, ...]
    dims: tuple[int, ...]
    constants: dict = field(default_factory=dict)
    reason: str = ""

    def to_dict(self) -> dict:
        return {"name": self.name, "order": list(self.order), "transposed": list(self.transposed),
                "shapes": [list(s) for s in self.shapes], "dims": list(self.dims),
                "constants": dict(self.constants), "reason": self.reason}

    @classmethod
    def from_dict(cls, d: dict, graph: KernelGraph) -> "Seed":
        return cls(d["name"], graph, tuple(d["order"]), tuple(d["transposed"]),
                   tuple(tuple(s) for s in d["shapes"]), tuple(d["dims"]), dict(d["constants"]), d.get("reason", ""))

    def describe(self) -> str:
        consts = "".join(f", {k}={v:g}" for k, v in self.constants.items())
        return f"μGraph {self.name}{self.dims}{consts}"


def folded(name: str, shapes: Sequence[tuple]) -> list[tuple]:
    """The μGraph's input shapes for the region's: a batched input's leading dims folded into its rows."""
    out = [tuple(s) for s in shapes]
    i = BATCHED_INPUT.get(name)
    if i is not None and i < len(out) and len(out[i]) > 2:
        rows = 1
        for d in out[i][:-1]:
            rows *= d
        out[i] = (rows, out[i][-1])
    return out


@functools.lru_cache(maxsize=None)
def _probe_layout(workload: library.Workload) -> tuple[tuple[tuple, ...], tuple]:
    """The workload's μGraph input shapes at the probe dims, and where each dim first appears in them
    ((input, axis), or None where it appears nowhere)."""
    ndims = workload.build.__code__.co_argcount
    probe = tuple(tuple(s) for s in workload.input_shapes(*_PROBE[:ndims]))
    where = tuple(next(((i, a) for i, s in enumerate(probe) for a, d in enumerate(s) if d == p), None)
                  for p in _PROBE[:ndims])
    return probe, where


def dims_from_shapes(workload: library.Workload, shapes: Sequence[tuple]) -> tuple | None:
    """The workload's dims for these μGraph input shapes (``input_shapes`` inverted), or None where none fit."""
    probe, where = _probe_layout(workload)
    if len(probe) != len(shapes):
        return None
    dims = []
    for w in where:
        if w is None or w[1] >= len(shapes[w[0]]):
            return None
        dims.append(shapes[w[0]][w[1]])
    dims = tuple(int(d) for d in dims)
    ok = [tuple(s) for s in workload.input_shapes(*dims)] == [tuple(s) for s in shapes]
    return dims if ok else None


def arity(name: str) -> int:
    """How many inputs the workload's μGraph takes."""
    return len(_probe_layout(library.WORKLOADS[name])[0])


def _rank_fits(rank: int, wanted: int, folds: bool) -> bool:
    """Whether a region input of ``rank`` can stand at a μGraph position whose input has rank ``wanted``
    (``folds``: the batched position, whose leading dims :func:`folded` folds into rows). One that cannot fails
    :func:`dims_from_shapes` (``input_shapes`` gives each input one rank), so it is not tried."""
    return rank == wanted or (folds and wanted == 2 and rank > 2)


def bindings(workload: library.Workload, in_shapes: Sequence[tuple], transposable: frozenset = frozenset()
             ) -> list[tuple[tuple, tuple, tuple]]:
    """Every (order, transposed, dims): region input ``order[j]`` as μGraph input ``j`` — transposed where
    ``transposed[j]`` (only inputs of ``transposable``, 2-D ones the region reads transposed) — the shapes
    fixing the dims. Untransposed bindings first."""
    n = len(in_shapes)
    probe, _ = _probe_layout(workload)
    if n != len(probe):
        return []
    flips = [k for k in sorted(transposable) if len(in_shapes[k]) == 2]
    wanted = [len(s) for s in probe]
    folds = BATCHED_INPUT.get(workload.name)
    # a transpose keeps the rank: one filter for every choice of flips
    orders = [order for order in itertools.permutations(range(n))
              if all(_rank_fits(len(in_shapes[k]), wanted[j], j == folds) for j, k in enumerate(order))]
    out = []
    for chosen in sorted((c for r in range(len(flips) + 1) for c in itertools.combinations(flips, r)), key=len):
        shapes = [tuple(reversed(s)) if k in chosen else tuple(s) for k, s in enumerate(in_shapes)]
        for order in orders:
            dims = dims_from_shapes(workload, folded(workload.name, [shapes[i] for i in order]))
            if dims is not None:
                out.append((order, tuple(i in chosen for i in order), dims))
    return out


def transposed_inputs(ref: KernelGraph) -> frozenset:
    """The reference's inputs that a ``transpose`` op reads (a weight used as ``x @ w.T``)."""
    index = {i: op.attrs["index"] for i, op in enumerate(ref.ops) if op.name == "input"}
    return frozenset(index[r[0]] for op in ref.ops if op.name == "transpose" for r in op.inputs if r[0] in index)


def reordered(ref: KernelGraph, order: Sequence[int], transposed: Sequence[bool], shapes: Sequence[tuple],
              out_shape: tuple) -> KernelGraph:
    """``ref`` with its input ``order[j]`` taken as input ``j`` of shape ``shapes[j]`` (transposed back where
    ``transposed[j]``, viewed to its own shape) and its one output viewed as ``out_shape``: the region's program on
    the μGraph's inputs."""
    g = new_kernel_graph()
    inputs = {op.attrs["index"]: i for i, op in enumerate(ref.ops) if op.name == "input"}
    env: dict[Ref, object] = {}
    for j, k in enumerate(order):
        op = ref.ops[inputs[k]]
        t = g.new_input(shapes[j], op.attrs["dtype"])
        if transposed[j]:
            (t,) = g.add_op("transpose", [t])
        env[Ref(inputs[k], 0)] = t if tuple(shapes[j]) == tuple(op.attrs["shape"]) else \
            g.reshape(t, shape=tuple(op.attrs["shape"]))
    for i, op in enumerate(ref.ops):
        if op.name == "input":
            continue
        for j, t in enumerate(g.add_op(op.name, [env[Ref(*r)] for r in op.inputs], body=op.body, **dict(op.attrs))):
            env[Ref(i, j)] = t
    (r,) = ref.outputs
    out = env[Ref(*r)]
    g.mark_output(out if tuple(ref.ops[r[0]].shapes[r[1]]) == tuple(out_shape) else g.reshape(out, shape=out_shape))
    return g.build()


def _instance(workload: library.Workload, dims: tuple, dtype: str, constants: dict,
              schedule: dict | None = None) -> KernelGraph | None:
    """The workload's μGraph at ``dims``, validated; None where it does not build or its tiles do not fit block
    memory at these sizes (expected for large shapes: logged, not a failure)."""
    try:
        graph = workload.build(*dims, dtype=dtype, **constants, **(schedule or {}))
        validate(graph)
        return graph
    except InvalidMuGraph as e:
        log.info("torch_mirage: seed μGraph %s%s %s not valid at these sizes (%s)", workload.name, dims, dtype,
                 "; ".join(e.problems))
    except Exception as e:  # noqa: BLE001 - a seed that does not build for these shapes is no seed
        log.info("torch_mirage: seed μGraph %s%s %s does not build (%s: %s)", workload.name, dims, dtype,
                 type(e).__name__, e)
    return None


def _out_shape(graph: KernelGraph) -> tuple:
    (r,) = graph.outputs
    return tuple(graph.ops[r[0]].shapes[r[1]])


def _probe_ok(candidate: KernelGraph, reference: KernelGraph, shapes: Sequence[tuple]) -> bool:
    """One fp64 run of both on the same random inputs, equal to the probe tolerance (drops wrong bindings
    cheaply, before the verifier)."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    try:
        (got,), (want,) = execute(candidate, xs), execute(reference, xs)
    except Exception as e:  # noqa: BLE001 - a candidate that cannot run is rejected
        log.debug("torch_mirage: seed probe failed to run: %s", e)
        return False
    return tuple(got.shape) == tuple(want.shape) and \
        relative_error(got, want, norm="max") <= tolerance(torch.float64, "probe")


def find_seed(ref: KernelGraph, inputs: Sequence[tuple[tuple, str]], out_shapes: Sequence[tuple],
              workloads: Sequence[str], eps_values: Sequence[float], verify_kwargs: dict,
              counts: Callable[[str], None] = lambda what: None, scale_values: Sequence[float] = ()
              ) -> Seed | None:
    """The first library workload of ``workloads`` whose μGraph, bound to the region's inputs by shape, the
    verifier proves equal to ``ref`` (the region's reference, inputs ``inputs`` as (shape, dtype)); None when none
    is. Constants (:data:`CONSTANTS`) are drawn from ``eps_values`` and ``scale_values`` (the reference's softmax
    temperatures; none: ``1/√d`` at the real dims, kept at the shrunk ones). ``counts(what)`` is told of each
    "candidate", "rejected_by_probe", "rejected_by_verifier", "verified"."""
    if len(out_shapes) != 1 or len({d for _, d in inputs}) != 1:
        return None
    dtype = inputs[0][1]
    in_shapes = [tuple(s) for s, _ in inputs]
    out_shape = tuple(out_shapes[0])
    smalls = None
    transposable = transposed_inputs(ref)
    for name in workloads:
        workload = library.WORKLOADS[name]
        for order, transposed, dims in bindings(workload, in_shapes, transposable):
            for constants in _constant_choices(CONSTANTS.get(name, ()), dims, eps_values, scale_values):
                graph = _instance(workload, dims, dtype, constants)
                if graph is None or not _views(out_shape, _out_shape(graph)):
                    continue
                counts("candidate")
                shapes = tuple(tuple(s) for s in workload.input_shapes(*dims))
                if smalls is None:      # the region at small sizes, the smallest map first (none: its own sizes)
                    smalls = shrunk_problems(ref, inputs, out_shapes) or [False]
                check = next((c for small in smalls if (c := _checked(workload, order, transposed, dims, dtype,
                                                                       constants, graph, shapes, ref, small))
                              is not None), None)
                if check is None:
                    continue
                candidate, program, example_shapes = check
                if not _probe_ok(candidate, program, example_shapes):
                    counts("rejected_by_probe")
                    continue
                examples = [torch.zeros(s, dtype=getattr(torch, dtype)) for s in example_shapes]
                verdict = verify(candidate, program, examples, **verify_kwargs)
                if not verdict:
                    counts("rejected_by_verifier")
                    log.debug("torch_mirage: seed %s%s rejected: %s", name, dims, verdict.reason)
                    continue
                counts("verified")
                where = "" if candidate is graph else "; verified on the shrunk shapes"
                return Seed(name, graph, tuple(order), transposed, shapes, dims, constants, verdict.reason + where)
    return None


def _constant_choices(names: Sequence[str], dims: tuple, eps_values: Sequence[float],
                      scale_values: Sequence[float]) -> list[dict]:
    """Every assignment of the μGraph's keyword constants ``names``: eps from ``eps_values``; the score scale
    from ``scale_values``, else ``1/√d`` of the real head size (the last dim), fixed so that the shrunk instance
    scales as the program does."""
    pools = {"eps": [float(e) for e in eps_values],
             "scale": [float(s) for s in scale_values] or [float(dims[-1]) ** -0.5]}
    return [dict(zip(names, values)) for values in itertools.product(*(pools[n] for n in names))]


def _views(out_shape: tuple, graph_out: tuple) -> bool:
    """Whether the region's output is a view of the μGraph's: the same elements, the same last dim."""
    return torch.Size(out_shape).numel() == torch.Size(graph_out).numel() and out_shape[-1:] == graph_out[-1:]


def _checked(workload, order, transposed, dims, dtype, constants, graph, shapes, ref, small):
    """(candidate, reference program, input shapes) the verifier checks: the instance and the region's program on
    its inputs; for a big region both at the search's shrunk sizes (None where the binding does not carry)."""
    if not small:
        return graph, reordered(ref, order, transposed, shapes, _out_shape(graph)), shapes
    small_in = [tuple(s) for s, _ in small.inputs]
    small_dims = dims_from_shapes(workload, folded(workload.name, [tuple(reversed(small_in[i])) if t else small_in[i]
                                                                   for i, t in zip(order, transposed)]))
    if small_dims is None:
        return None
    schedule = SMALL_SCHEDULE.get(workload.name, {"tile": SMALL_TILE})
    small_graph = _instance(workload, small_dims, dtype, constants, schedule)
    if small_graph is None:
        return None
    small_shapes = tuple(tuple(s) for s in workload.input_shapes(*small_dims))
    if not _views(tuple(small.out_shapes[0]), _out_shape(small_graph)):
        return None
    return (small_graph, reordered(small.target, order, transposed, small_shapes, _out_shape(small_graph)),
            small_shapes)


def seed_kernel(order: Sequence[int], transposed: Sequence[bool], shapes: Sequence[tuple], out_shape: tuple,
                compiled: Callable) -> Callable:
    """The region's kernel from a compiled seed μGraph: the region's inputs in the μGraph's order (``order``, as
    positions among the region's inputs), each transposed where ``transposed`` says (a view, as the permute of
    ``x @ w.T`` gives it) and reshaped to the μGraph's ``shapes``, its one output in the region's ``out_shape``."""
    def kernel(*ins):
        xs = [(ins[i].transpose(-1, -2) if t else ins[i]).reshape(s) for i, t, s in zip(order, transposed, shapes)]
        return (compiled(*xs)[0].reshape(out_shape),)
    return kernel
