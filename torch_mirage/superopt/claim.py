"""The μGraph library claimer: subgraphs of a user graph that compute one of the hand-built μGraphs exactly.

For each library workload (``library.WORKLOADS``) the claimer traces its PyTorch program to ATen the way the
backend sees programs (Inductor's decompositions) and looks for the same computation in the user graph,
anchored at each free node: same ATen ops, the same wiring, and — on a second pass, with the program traced
again at the shapes the first pass bound — the same non-tensor arguments (sizes, dims, constants). A match
whose inner values nothing else reads, whose inputs have one dtype the μGraph supports and whose μGraph is valid
at those shapes (its tiles fit block memory) becomes a claim of a :class:`~.ugraph_plan.UGraphPlan`: the build
stage (:mod:`torch_mirage.build`) compiles the μGraph for those shapes. The backend then checks the kernel
against eager ATen on random inputs and, on a GPU, times it against Inductor's version of the same region, as for
every region.

This finds a μGraph only where the user wrote the program in one of the forms ``PROGRAMS`` lists (``x @ w +
(x @ a) @ b``; QK-norm attention with its softmax in fp32); the search of a later stage generalises it. A constant the
shapes do not fix (an RMS norm's eps) is read from the user's graph where the program, traced with a sentinel in
its place, has it; the exact pass then requires every occurrence to agree, since a different eps would pass a
numerics check while computing something else.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from .cut import DTYPES

from ..capture.ir import Graph, Node, Value
from ..capture.lower import trace
from ..context import CompileContext, Target
from ..failures import note
from ..numerics import rms_norm
from ..partition.region import Claim, Decline, Outcome, Reason, inputs_of, is_convex
from ..ugraph import KernelGraph
from . import library
from .ugraph_plan import Alternative, UGraphPlan, random_inputs
from .validate import InvalidMuGraph, validate

log = logging.getLogger("torch_mirage")


def attention_softmax_fp32(q, k, v):
    """Attention as half-precision models write it: softmax in fp32, the probabilities cast back."""
    s = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    return torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def rmsnorm_linear_fp32(x, g, w, eps):
    """RMSNorm + Linear as half-precision models write it: the norm in fp32, cast back, then the gain."""
    return rms_norm(x, eps, g) @ w


def qknorm_attention_fp32(q, k, v, gq, gk, eps):
    """QK-norm attention as half-precision models write it: each norm in fp32, cast back, then its gain; the
    softmax in fp32."""
    return attention_softmax_fp32(rms_norm(q, eps, gq), rms_norm(k, eps, gk), v)


def ntrans_norms_fp32(h, x, alpha, eps):
    """nTrans as half-precision models write it: each RMS norm in fp32, cast back."""
    return rms_norm(alpha * (rms_norm(h, eps) + x) + x, eps)


# workloads with one output, and the ways users write each program (see the module docstring); matched in this
# order, so a program that contains another comes first (QK-norm attention before attention: with the norms in
# its kernel it took 23.4 µs on the H100 at the b=8 bench shapes, against 27.2 for stitch-kernel norms + attention)
PROGRAMS: dict[str, tuple[Callable, ...]] = {
    "rmsnorm_linear": (library.rmsnorm_linear_ref, rmsnorm_linear_fp32),
    "lora": (library.lora_ref,),
    "gated_mlp": (library.gated_mlp_ref,),
    "qknorm_attention": (library.qknorm_attention_ref, qknorm_attention_fp32),
    "ntrans": (library.ntrans_ref, ntrans_norms_fp32),
}
# keyword constants a program and its μGraph take that the shapes do not fix: read from the user's graph where
# the program traced with a sentinel value has it, then required to match exactly like every other constant
CONSTANTS: dict[str, tuple[str, ...]] = {"ntrans": ("eps",), "rmsnorm_linear": ("eps",), "qknorm_attention": ("eps",)}
_SENTINELS = (1.2345678e-5, 2.3456789e-5)
DEFAULT_WORKLOADS = tuple(PROGRAMS)
# other μGraphs of the same program, inputs and dims: the build stage compiles each, and on a GPU the fastest runs
# (attention itself, masked or not, is claimed by analysis: superopt/attention_claim.py, with its seeds)
ALTERNATIVES: dict[str, tuple[str, ...]] = {}
# the μGraph input whose rows may come with leading dims — a (batch, seq, k) activation for an (m, k) one — and
# then the output carries the same leading dims (the matmul ``x @ w`` of a 3-D x is view → mm → view in ATen)
BATCHED_INPUT = {"lora": 0, "gated_mlp": 0, "rmsnorm_linear": 0}
_PROBE = (1009, 1013, 1019, 1021, 1031, 1033, 1039)   # distinct primes: which dim lands where in the shapes


@dataclass
class Match:
    nodes: list[Node]          # the user nodes computing the program, in graph order
    inputs: list[Value]        # user values bound to the program's inputs, in μGraph input order
    output: Value
    pairs: list[tuple[Node, Node]] = field(default_factory=list)   # (program node, user node)
    constants: dict[str, float] = field(default_factory=dict)        # CONSTANTS' values, e.g. eps
    dims: tuple = ()                                                 # the workload's dims for these shapes


def ugraph_shapes(name: str, shapes: Sequence[tuple]) -> list[tuple]:
    """The μGraph's input shapes for the user's: a batched input's leading dims folded into its rows."""
    out = [tuple(s) for s in shapes]
    i = BATCHED_INPUT.get(name)
    if i is not None and len(out[i]) > 2:
        rows = 1
        for d in out[i][:-1]:
            rows *= d
        out[i] = (rows, out[i][-1])
    return out


def dims_from_shapes(workload: library.Workload, shapes: Sequence[tuple]) -> tuple | None:
    """The workload's dims for these input shapes (``input_shapes`` inverted), or None where none fit."""
    ndims = workload.build.__code__.co_argcount
    probe = workload.input_shapes(*_PROBE[:ndims])
    dims = []
    for p in _PROBE[:ndims]:
        where = next(((i, a) for i, s in enumerate(probe) for a, d in enumerate(s) if d == p), None)
        if where is None or where[0] >= len(shapes) or where[1] >= len(shapes[where[0]]):
            return None
        dims.append(shapes[where[0]][where[1]])
    dims = tuple(int(d) for d in dims)
    ok = [tuple(s) for s in workload.input_shapes(*dims)] == [tuple(s) for s in shapes]
    return dims if ok else None


@functools.lru_cache(maxsize=64)
def program_graph(name: str, form: int, shapes: tuple, dtype: torch.dtype, constants: tuple = ()) -> Graph:
    """Form ``form`` of the workload's PyTorch program as ATen IR (Inductor's decompositions), traced on meta
    tensors."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    # meta tensors traced as they are ("real" mode): no fake mode of its own that could pick up the symbolic
    # shapes of the compile this runs inside, so every size in the program is a plain int
    with unset_fake_temporarily(), torch.no_grad():
        args = [torch.empty(s, dtype=dtype, device="meta") for s in shapes]
        program = functools.partial(PROGRAMS[name][form], **dict(zip(CONSTANTS.get(name, ()), constants)))
        return trace(program, args, tracing_mode="real")


def _same_constant(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_constant(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def match_program(program: Graph, anchor: Node, exact: bool) -> Match | None:
    """The user nodes computing ``program`` with ``anchor`` as its output node; ``exact`` also compares the
    non-tensor arguments. Each program node maps to one user node and each program input to one user value."""
    (out,) = program.output_values
    nodes: dict[int, Node] = {}        # id(program node) -> user node
    bound: dict[int, Value] = {}       # id(program input) -> user value

    def value(p: Value, g: Any) -> bool:
        if not isinstance(g, Value) or (p.meta is None) != (g.meta is None):
            return False
        if p.producer is None:
            if id(p) in bound:
                return bound[id(p)] is g
            bound[id(p)] = g
            return True
        if g.producer is None or p.producer.outputs.index(p) != g.producer.outputs.index(g):
            return False
        return node(p.producer, g.producer)

    def arg(p: Any, g: Any) -> bool:
        if isinstance(p, Value):
            return value(p, g)
        if isinstance(p, (list, tuple)):
            return (isinstance(g, (list, tuple)) and len(p) == len(g)
                    and all(arg(x, y) for x, y in zip(p, g)))
        return not exact or _same_constant(p, g)

    def node(p: Node, g: Node) -> bool:
        if id(p) in nodes:
            return nodes[id(p)] is g
        if p.target != g.target or len(p.args) != len(g.args) or set(p.kwargs) != set(g.kwargs):
            return False
        nodes[id(p)] = g
        return (all(arg(a, b) for a, b in zip(p.args, g.args))
                and all(arg(p.kwargs[k], g.kwargs[k]) for k in p.kwargs))

    if out.producer is None or not node(out.producer, anchor):
        return None
    inputs = [bound.get(id(v)) for v in program.inputs if v.users]
    if any(v is None for v in inputs) or len(inputs) != len(program.inputs):
        return None
    by_id = {id(p): p for p in program.nodes}
    return Match(list(nodes.values()), inputs, anchor.outputs[out.producer.outputs.index(out)],
                 [(by_id[i], g) for i, g in nodes.items()])


def read_constants(name: str, structural: Match) -> tuple | None:
    """The user's values of the workload's ``CONSTANTS``, found where the sentinel-traced program has them."""
    names = CONSTANTS.get(name, ())
    found: dict[int, Any] = {}
    for p, g in structural.pairs:
        for a, b in zip(p.args, g.args):
            for k, sentinel in enumerate(_SENTINELS[:len(names)]):
                if isinstance(a, float) and a == sentinel:
                    if not isinstance(b, (int, float)) or found.setdefault(k, b) != b:
                        return None
    return tuple(float(found[k]) for k in range(len(names))) if len(found) == len(names) else None


class LibraryClaimer:
    """Claims subgraphs that compute a hand-built μGraph of ``library.py``, with that μGraph as their plan."""
    name = "ugraph-library"

    def __init__(self, workloads: Sequence[str] = DEFAULT_WORKLOADS):
        self.workloads = [library.WORKLOADS[w] for w in workloads]
        self._untraceable: set[str] = set()

    def claim(self, graph: Graph, free: Sequence[Node], ctx: CompileContext) -> list[Outcome]:
        free_ids = {id(n) for n in free}
        order = {id(n): i for i, n in enumerate(graph.nodes)}
        outcomes: list[Outcome] = []
        for workload in self.workloads:
            if not self._traceable(workload):
                continue
            for anchor in reversed([n for n in free if id(n) in free_ids]):
                if id(anchor) not in free_ids:
                    continue   # taken by a match found at a later anchor
                found = self._match_any_form(workload, graph, anchor, free_ids, ctx.target)
                if found is None:
                    continue
                found.nodes.sort(key=lambda n: order[id(n)])
                outcome = self._claim(workload, found, ctx)
                if isinstance(outcome, Claim):
                    free_ids -= {id(n) for n in found.nodes}
                outcomes.append(outcome)
        return outcomes

    def _traceable(self, workload: library.Workload) -> bool:
        """Whether this torch traces the workload's programs (a failure skips the workload, not the graph)."""
        probe = tuple(tuple(t) for t in workload.input_shapes(*_PROBE[:workload.build.__code__.co_argcount]))
        sentinels = _SENTINELS[:len(CONSTANTS.get(workload.name, ()))]
        try:
            for form in range(len(PROGRAMS[workload.name])):
                program_graph(workload.name, form, probe, torch.float32, sentinels)
        except Exception as e:
            if workload.name not in self._untraceable:
                self._untraceable.add(workload.name)
                log.warning("torch_mirage: the %s μGraph's program does not trace on torch %s (%s: %s); "
                            "it is not matched", workload.name, torch.__version__, type(e).__name__, e)
            return False
        return True

    def _match_any_form(self, workload: library.Workload, graph: Graph, anchor: Node, free_ids: set[int],
                        target: Target) -> Match | None:
        for form in range(len(PROGRAMS[workload.name])):
            try:
                found = self._match(workload, form, graph, anchor, free_ids, target)
            except Exception as e:   # a program that does not trace at these shapes: no match, the graph goes on
                log.debug("torch_mirage: matching %s at %s failed (%s: %s)", workload.name, anchor.name,
                          type(e).__name__, e)
                found = None
            if found is not None:
                return found
        return None

    def _match(self, workload: library.Workload, form: int, graph: Graph, anchor: Node, free_ids: set[int],
               target: Target) -> Match | None:
        """A match at ``anchor`` the μGraph can run: free nodes, a convex set, inner values read only inside,
        one dtype for every input, shapes that fix the workload's dims, the same constants."""
        out = anchor.outputs[0].meta if anchor.outputs else None
        if out is None or out.dtype not in DTYPES:
            return None
        # the wiring, at probe shapes and the anchor's dtype (half-precision programs upcast inside); a batched
        # input gets one leading dim more when the anchor's result has one
        probe = [tuple(t) for t in workload.input_shapes(*_PROBE[:workload.build.__code__.co_argcount])]
        batched = BATCHED_INPUT.get(workload.name)
        if batched is not None and len(out.shape) == 3:
            probe[batched] = (1051,) + probe[batched]
        probe = tuple(probe)
        sentinels = _SENTINELS[:len(CONSTANTS.get(workload.name, ()))]
        structural = match_program(program_graph(workload.name, form, probe, out.dtype, sentinels), anchor,
                                   exact=False)
        if structural is None:
            return None
        constants = read_constants(workload.name, structural)
        if constants is None:
            return None
        metas = [v.meta for v in structural.inputs]
        dtypes = {m.dtype for m in metas}
        if len(dtypes) != 1 or not all(m.is_static for m in metas):
            return None
        dtype = dtypes.pop()
        if dtype not in DTYPES or (target is Target.INTERPRETER and dtype == torch.bfloat16) or \
                not target.runs_on(metas[0].device.type):
            return None
        shapes = tuple(tuple(m.shape) for m in metas)
        dims = dims_from_shapes(workload, ugraph_shapes(workload.name, shapes))
        if dims is None:
            return None
        found = match_program(program_graph(workload.name, form, shapes, dtype, constants), anchor, exact=True)
        if found is None or any(id(n) not in free_ids for n in found.nodes):
            return None
        found.constants = dict(zip(CONSTANTS.get(workload.name, ()), constants))
        found.dims = dims
        inside = {id(n) for n in found.nodes}
        outputs = {id(v) for v in graph.output_values}
        for n in found.nodes:
            for v in n.outputs:
                if v is not found.output and (id(v) in outputs or any(id(u) not in inside for u in v.users)):
                    return None    # an inner value read elsewhere: the μGraph does not produce it
        return found if is_convex(graph, found.nodes) else None

    def _claim(self, workload: library.Workload, found: Match, ctx: CompileContext) -> Outcome:
        metas = [v.meta for v in found.inputs]
        shapes = ugraph_shapes(workload.name, [tuple(m.shape) for m in metas])
        dims = found.dims
        dtype = DTYPES[metas[0].dtype]
        consts = "".join(f", {k}={v:g}" for k, v in found.constants.items())
        alternatives = [Alternative(name, kgraph, f"μGraph {name}{dims}{consts}", {"ugraph": name})
                        for name in (workload.name, *ALTERNATIVES.get(workload.name, ()))
                        if (kgraph := _planned(library.WORKLOADS[name], dims, dtype, found.constants, ctx))]
        if not alternatives:
            return Decline(found.nodes, Reason.NO_KERNEL, f"μGraph {workload.name}{dims} {dtype}")
        positions = {id(v): i for i, v in enumerate(inputs_of(found.nodes))}
        order = [positions[id(v)] for v in found.inputs]
        plan = UGraphPlan(alternatives, functools.partial(random_inputs, metas, shapes),
                          functools.partial(library_kernel, order, shapes, tuple(found.output.meta.shape)),
                          what=f"μGraph {workload.name}{dims} {dtype}")
        return Claim(found.nodes, plan, detail=alternatives[0].detail,
                     info={"dims": list(dims), "dtype": dtype})


def library_kernel(order: Sequence[int], shapes: Sequence[tuple], out_shape: tuple, compiled: Callable) -> Callable:
    """The region's kernel from a compiled library μGraph: the region's inputs in the μGraph's order (``order``),
    each reshaped to the μGraph's ``shapes`` (batched rows folded), its one output in the graph's ``out_shape``."""
    def kernel(*ins):
        return (compiled(*[ins[i].reshape(s) for i, s in zip(order, shapes)])[0].reshape(out_shape),)
    return kernel


def _planned(workload: library.Workload, dims: tuple, dtype: str, constants: dict,
             ctx: CompileContext | None = None) -> KernelGraph | None:
    """The workload's μGraph at these dims, validated (nothing compiled: the build stage does that), or None
    when it does not fit or does not build (a warning, grouped per compile)."""
    try:
        kgraph = workload.build(*dims, dtype=dtype, **constants)
        validate(kgraph)
        return kgraph
    except InvalidMuGraph as e:
        if not all("block-level memory" in p for p in e.problems):
            return _not_built(workload, dims, dtype, ctx, e)
        # its tiles do not fit one SM's memory at these sizes: a decline, expected for large shapes, not a failure
        log.info("torch_mirage: μGraph %s%s %s does not fit block memory at these sizes; not used",
                 workload.name, dims, dtype)
        return None
    except Exception as e:   # a μGraph that does not build for these shapes: not used
        return _not_built(workload, dims, dtype, ctx, e)


def _not_built(workload: library.Workload, dims: tuple, dtype: str, ctx: CompileContext | None,
               e: Exception) -> None:
    """A μGraph that failed to build: one grouped warning (raised under strict)."""
    if ctx is not None and ctx.config.strict:
        raise e
    note(ctx, "partition", f"μGraph {workload.name}{dims} {dtype}", e,
         "that μGraph is not used (its region goes to the other claimers and Inductor)")
    return None
