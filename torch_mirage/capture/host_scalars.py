"""Dynamo graphs whose symbolic scalars never reach a tensor: their host arithmetic split off the graph.

Under ``torch.compile``'s default ``dynamic=None`` Dynamo turns a Python int that changes between calls into a
SymInt input of the graph. transformers' sliding-window cache layers (Gemma-2, and any model with such layers)
count the tokens they hold in ``cumulative_length_int``: every decode step's graph takes that count and returns it
plus one, and no tensor op reads it. Such a graph is static in everything that runs on the device, but its symbolic
input kept it from a CUDA graph, from the timing against Inductor and from every claimer that needs static sizes.

:func:`split_host_scalars` finds the symbolic scalar inputs whose every use is pure host arithmetic (``operator``
and ``math`` functions, ``torch.sym_*``) ending in the graph's outputs, and makes a copy of the graph without them and
that arithmetic (the graph itself stays as it was: Dynamo calls the compile with its inputs).
:meth:`HostScalars.around` then wraps the compile of that static graph: each call
computes those outputs in Python from the call's own scalars and puts them back where the graph returned them.
A graph where a symbolic scalar reaches a tensor op, or a tensor has a symbolic size, is left as it is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


@dataclass
class HostScalars:
    """The host part of a graph split by :func:`split_host_scalars`."""
    scalar_positions: tuple[int, ...]     # the original inputs that were symbolic scalars
    names: tuple[str, ...]                # their placeholders' names (for the report and the log)
    host_outputs: Callable[..., tuple]    # those scalars -> the outputs computed from them, in output order
    outputs: tuple[tuple[bool, int], ...]  # each original output: (computed on the host, index into its part)
    static_graph: fx.GraphModule          # the graph without them: static shapes, the device's whole work

    def static_inputs(self, inputs: Sequence[Any]) -> list[Any]:
        """The inputs the static graph takes: ``inputs`` without the symbolic scalars."""
        return [x for i, x in enumerate(inputs) if i not in self.scalar_positions]   # a few positions: a tuple

    def around(self, compiled: Callable[..., Any]) -> Callable[..., tuple]:
        """A callable with the original graph's inputs and outputs around ``compiled``, the static graph's."""
        positions, outputs, host_outputs = self.scalar_positions, self.outputs, self.host_outputs

        def run(*args: Any) -> tuple:
            host = host_outputs(*(args[i] for i in positions))
            device = compiled(*self.static_inputs(args))
            return tuple(host[j] if on_host else device[j] for on_host, j in outputs)
        return run


def _pure(node: fx.Node) -> bool:
    """A call computing a host value from host values only, with no effect: operator / math functions, torch.sym_*."""
    if node.op != "call_function":
        return False
    module, name = getattr(node.target, "__module__", None) or "", getattr(node.target, "__name__", "")
    return module in ("_operator", "operator", "math") or (module.startswith("torch") and name.startswith("sym_"))


def has_symbolic_size(value: Any) -> bool:
    """Whether ``value`` is a tensor with a symbolic size or stride."""
    return isinstance(value, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in (*value.shape, *value.stride()))


def is_symbolic(value: Any) -> bool:
    """Whether ``value`` is a symbolic scalar or a tensor of symbolic size or stride."""
    return isinstance(value, SYMBOLIC) or has_symbolic_size(value)


def symbolic_positions(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[int, ...]:
    """The inputs of Dynamo graph ``gm`` that carry its symbolic sizes: SymInt (and other symbolic scalar) inputs,
    and tensors whose placeholder's example value has a symbolic size or stride (Dynamo's example inputs are real
    tensors)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        placeholders = [None] * len(example_inputs)
    return tuple(i for i, (x, n) in enumerate(zip(example_inputs, placeholders))
                 if is_symbolic(x) or (n is not None and has_symbolic_size(n.meta.get("example_value"))))


def split_host_scalars(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> HostScalars | None:
    """The host-only symbolic scalars of ``gm`` split off (``gm`` itself unchanged), or None where there are none
    or a symbolic value reaches the device."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return None
    positions = tuple(i for i, x in enumerate(example_inputs) if isinstance(x, SYMBOLIC))
    if not positions:
        return None
    if any(has_symbolic_size(n.meta.get("example_value")) for n in placeholders):
        return None      # a symbolic size (Dynamo's example inputs are real tensors; its fake ones carry the symbols)
    scalars = {placeholders[i] for i in positions}
    closure: list[fx.Node] = []                  # the arithmetic on them, in graph order
    inside = set(scalars)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for node in gm.graph.nodes:
        if node.op == "placeholder" or node is output:
            continue
        reads = set(node.all_input_nodes)
        if reads & inside:
            if not _pure(node) or not reads <= inside:
                return None          # a scalar reaches a tensor op, or mixes with a value computed on the device
            closure.append(node)
            inside.add(node)
        elif is_symbolic(node.meta.get("example_value")):
            return None              # another symbolic value (a size read off a tensor): not this case
    results = output.args[0]
    if not isinstance(results, (tuple, list)):
        return None
    on_host = [isinstance(r, fx.Node) and r in inside for r in results]
    host_nodes = [r for r, h in zip(results, on_host) if h]
    names = tuple(placeholders[i].name for i in positions)
    # the host part: a graph of its own over the scalar placeholders
    host = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i in positions:
        env[placeholders[i]] = host.placeholder(placeholders[i].name)
    for node in closure:
        env[node] = host.node_copy(node, env.__getitem__)
    host.output(tuple(env[n] for n in host_nodes))
    host_outputs = fx.GraphModule(torch.nn.Module(), host)
    # the device part: a copy of the graph without them (Dynamo calls the compile with the original graph's inputs)
    layout = tuple((h, sum(x == h for x in on_host[:k])) for k, h in enumerate(on_host))   # index in its part
    copied: dict[fx.Node, fx.Node] = {}
    graph = fx.Graph()
    graph.graph_copy(gm.graph, copied)
    graph.output(tuple(copied[r] if isinstance(r, fx.Node) else r for r, h in zip(results, on_host) if not h))
    for node in reversed(closure):
        graph.erase_node(copied[node])
    for i in positions:
        graph.erase_node(copied[placeholders[i]])
    static = fx.GraphModule(gm, graph)
    static.meta = dict(gm.meta)
    for attr in ("_param_name_to_source",):     # what AOTAutograd reads off a Dynamo graph
        if hasattr(gm, attr):
            setattr(static, attr, getattr(gm, attr))
    for node in placeholders:
        if node in copied and hasattr(node, "_dynamo_source"):
            copied[node]._dynamo_source = node._dynamo_source
    static.graph.lint()
    return HostScalars(positions, names, host_outputs, layout, static)
