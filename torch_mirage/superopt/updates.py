"""Indexed updates of μGraph inputs: a static KV cache's write, taken into the kernel that computes what it writes.

A decode step writes each new key and value row into the cache at the step's positions (HF's ``StaticCache``,
``k_cache.index_copy_(2, cache_position, k)``); after functionalisation the region holds ``index_copy(cache, 2,
pos, k)`` and the graph copies the result back into the cache input. Run by Inductor, each write is a kernel of its
own. Here it is the kernel op ``index_copy`` (:data:`~torch_mirage.ugraph.OPS`) at the end of a μGraph, whose
destination is a μGraph input:

* :func:`split_updates` takes the updates off a program: what remains (the *core*) computes each written value as
  an output, and is what a seed is built from and verified against. An update writes its source unchanged, so a
  seed equal to the core with the same updates put back (:func:`with_updates`) equals the program;
* :func:`store_through` finds, in a μGraph being compiled, the updates whose source a graph-defined op saves
  (through reshapes only): its kernel stores that tile into the destination at the positions itself
  (:class:`~..codegen.ugraph_triton.StoreThrough`), and the update costs no launch;
* a μGraph's ``index_copy`` of an input updates that input in place (:class:`.compile.CompiledUGraph`): the claimer
  takes an update only where nothing else reads the destination's old value (:func:`.cut.cache_writes`).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..codegen.ugraph_triton import StoreThrough
from ..ugraph import KernelGraph, Ref
from .builder import new_kernel_graph


@dataclass(frozen=True)
class Update:
    """Output ``output`` of a μGraph is ``index_copy(input dst, dim, input index, source)``."""
    output: int
    dst: int        # the destination's input index
    index: int      # the positions' input index
    dim: int
    shape: tuple    # the source's shape (the destination's, with the positions' count along ``dim``)


def updates_of(g: KernelGraph) -> list[Update]:
    """The outputs of ``g`` that are an ``index_copy`` of an input at positions an input holds."""
    found = []
    for j, r in enumerate(g.outputs):
        op = g.ops[r[0]]
        if op.name != "index_copy":
            continue
        dst, index = (g.ops[x[0]] for x in op.inputs[:2])
        if dst.name == "input" and index.name == "input":
            found.append(Update(j, dst.attrs["index"], index.attrs["index"], op.attrs["dim"],
                                tuple(g.shape(Ref(*op.inputs[2])))))
    return found


def _written(g: KernelGraph, output: Ref) -> Ref:
    """The value an update output writes, before the reshapes that view it as the destination's rows (a projection's
    (b, n) result viewed (b, heads, 1, d)): the core computes it in the shape it is computed in, which the verifier's
    shrunk sizes keep apart from the destination's."""
    r = Ref(*g.ops[output[0]].inputs[2])
    while g.ops[r.op].name == "reshape":
        r = Ref(*g.ops[r.op].inputs[0])
    return r


def _core(g: KernelGraph, updates: list[Update]) -> tuple[list[Ref], list[int]]:
    """``(outputs, inputs)`` of the core of ``g`` (:func:`split_updates`): each output, an update's replaced by the
    value it writes (:func:`_written`); the input indices those read, in order (not an update's destination or
    positions)."""
    by_output = {u.output for u in updates}
    outputs = [_written(g, r) if j in by_output else Ref(*r) for j, r in enumerate(g.outputs)]
    inputs = sorted({g.ops[i].attrs["index"] for i in g.ancestors([r.op for r in outputs]) if g.ops[i].name == "input"})
    return outputs, inputs


def split_updates(g: KernelGraph) -> tuple[KernelGraph, list[Update]]:
    """``(core, updates)``: ``g`` with each update's output replaced by the value it writes and the inputs that only
    updates read (destinations, positions) dropped; ``(g, [])`` where ``g`` has no update."""
    updates = updates_of(g)
    if not updates:
        return g, []
    outputs, inputs = _core(g, updates)
    needed = g.ancestors([r.op for r in outputs])
    kept = set(inputs)
    b = new_kernel_graph()
    env: dict[Ref, object] = {}
    for i in sorted((i for i, op in enumerate(g.ops) if op.name == "input"), key=lambda i: g.ops[i].attrs["index"]):
        op = g.ops[i]
        if op.attrs["index"] in kept:
            env[Ref(i, 0)] = b.new_input(op.attrs["shape"], op.attrs["dtype"])
    for i, op in enumerate(g.ops):
        if op.name != "input" and i in needed:       # the updates, and what only they read, are left out
            outs = b.add_op(op.name, [env[Ref(*x)] for x in op.inputs], body=op.body, **op.attrs)
            env.update((Ref(i, k), t) for k, t in enumerate(outs))
    for r in outputs:
        b.mark_output(env[r])
    return b.build(), updates


def with_updates(core: KernelGraph, updates: list[Update], program: KernelGraph) -> KernelGraph:
    """``core`` (a μGraph equal to :func:`split_updates`' core of ``program``) on ``program``'s inputs, with
    ``updates`` put back: each update's output the ``index_copy`` of ``core``'s output there."""
    if not updates:
        return core
    b = new_kernel_graph()
    ins = {op.attrs["index"]: b.new_input(op.attrs["shape"], op.attrs["dtype"])
           for op in sorted(program.inputs, key=lambda op: op.attrs["index"])}
    kept = _core(program, updates)[1]
    env: dict[Ref, object] = {}
    for i, op in enumerate(core.ops):
        if op.name == "input":
            env[Ref(i, 0)] = ins[kept[op.attrs["index"]]]
            continue
        outs = b.add_op(op.name, [env[Ref(*x)] for x in op.inputs], body=op.body, **op.attrs)
        env.update((Ref(i, k), t) for k, t in enumerate(outs))
    by_output = {u.output: u for u in updates}
    for j, r in enumerate(core.outputs):
        t = env[Ref(*r)]
        if (u := by_output.get(j)) is not None:
            if tuple(t.shape) != u.shape:
                t = b.reshape(t, shape=u.shape)
            t = b.index_copy(ins[u.dst], ins[u.index], t, dim=u.dim)
        b.mark_output(t)
    return b.build()


@dataclass(frozen=True)
class ThroughStore:
    """An update that graph-defined op ``op``'s kernel does itself: ``through`` says which of its savers and how
    (:class:`~..codegen.ugraph_triton.StoreThrough`); ``dst`` and ``positions`` are the tensors it writes into and
    at; ``update`` is the ``index_copy`` op, which then has nothing left to do."""
    op: int
    through: StoreThrough
    dst: Ref
    positions: Ref
    update: int


def store_through(g: KernelGraph) -> list[ThroughStore]:
    """The updates of ``g`` whose source a graph-defined op saves through reshapes only, into an input nothing
    else in ``g`` reads."""
    users = g.consumers()
    outputs = {Ref(*r) for r in g.outputs}
    found = []
    for u, op in enumerate(g.ops):
        if op.name != "index_copy":
            continue
        dst, positions, src = (Ref(*r) for r in op.inputs)
        if g.ops[dst.op].name != "input" or g.ops[positions.op].name != "input" or users.get(dst) != [u]:
            continue
        r, only = src, True
        while g.ops[r.op].name == "reshape":
            only = only and len(users.get(r, [])) == 1 and r not in outputs
            r = Ref(*g.ops[r.op].inputs[0])
        if g.ops[r.op].name != "customized":
            continue
        only = only and len(users.get(r, [])) == 1 and r not in outputs
        found.append(ThroughStore(r.op, StoreThrough(r.out, tuple(g.shape(src)), op.attrs["dim"],
                                                      g.dtype(dst), only), dst, positions, u))
    return found
