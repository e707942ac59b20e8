"""FX (functional ATen) ⇄ project IR.

:func:`lower` reads an ATen ``GraphModule`` whose nodes carry ``meta["val"]``
(FakeTensors, as AOTAutograd produces them) into a :class:`Graph`;
:func:`to_fx` writes a :class:`Graph` back as an FX graph of the same ATen calls;
:func:`trace` takes a plain PyTorch callable to a :class:`Graph` (the one trace-to-IR of the package: the μGraph
library's programs, the verifier's references; the backend's own graphs come from AOTAutograd).
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .ir import Graph, Value, map_values, subgraph
from .ops import op_for_target


class LoweringError(RuntimeError):
    pass


def trace(fn: Any, args: Any, *, tracing_mode: str = "fake") -> Graph:
    """``fn(*args)`` as a :class:`Graph`: functionalized and traced by ``make_fx`` with Inductor's
    decompositions (the ATen ops the backend sees), inputs in ``args``' order with unused ones kept (which
    Dynamo's capture does not). ``tracing_mode="real"`` traces meta tensors as they are, with no fake mode of
    its own that could pick up the symbolic shapes of a compile it runs inside."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    def positional(*xs: Any) -> Any:   # hides defaulted keyword parameters from make_fx
        return fn(*xs)

    # apart from a compile this may run inside (the partition stage verifies callables): its tracing context's shape
    # environment would give real inputs symbolic sizes
    with torch._guards.tracing(None):
        gm = make_fx(torch.func.functionalize(positional), decomposition_table=select_decomp_table(),
                     tracing_mode=tracing_mode)(*args)
    return lower(gm)


def lower(gm: fx.GraphModule, example_inputs: list | None = None) -> Graph:
    graph = Graph()
    env: dict[fx.Node, Any] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        example = node.meta.get("val")
        if example is None and example_inputs is not None:
            example = example_inputs[i]
        env[node] = graph.add_input(node.name, example)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            result = pytree.tree_map(lambda a: env[a] if isinstance(a, fx.Node) else a, node.args[0])
            graph.single_output = not isinstance(result, (list, tuple))
            graph.outputs = [result] if graph.single_output else list(result)
            continue
        if node.op == "get_attr":
            # a constant tensor of the graph module: an input-like value that no node produces
            env[node] = graph.add_input(node.name, _attr(gm, node.target))
            graph.constants[env[node].name] = node.target
            continue
        if node.op != "call_function":
            raise LoweringError(f"{node.op} {node.target!r} is not a functional ATen call")
        if "val" not in node.meta:
            raise LoweringError(f"{node.target} has no traced value (meta['val'])")
        if node.target is __import__("operator").getitem:
            # select an element of a multi-output node's result
            src, idx = node.args
            env[node] = env[src][idx]
            continue
        args, kwargs = pytree.tree_map(lambda a: env[a] if isinstance(a, fx.Node) else a, (node.args, node.kwargs))
        ir_node = graph.add_node(node.name, op_for_target(node.target), node.target, tuple(args), dict(kwargs), node.meta["val"])
        env[node] = graph.result(ir_node)
    graph.validate()
    return graph


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _in_float64(args: tuple, kwargs: dict, target: Any) -> tuple[tuple, dict]:
    """``args`` / ``kwargs`` of one call with every floating dtype it names (``dtype=``, the target dtype of
    ``prims.convert_element_type``) replaced by float64, so that a graph fed float64 inputs stays float64."""
    up = lambda d: torch.float64 if isinstance(d, torch.dtype) and d.is_floating_point else d
    if isinstance(kwargs.get("dtype"), torch.dtype):
        kwargs = {**kwargs, "dtype": up(kwargs["dtype"])}
    if target is torch.ops.prims.convert_element_type.default:
        args = (args[0], up(args[1]), *args[2:])
    return args, kwargs


# the fused scaled_dot_product_attention kernels: their float64 reference is SDPA's math path
# (:func:`_sdpa_in_float64`), not the kernel itself — cuDNN's and flash's take fp16 / bf16 only
_FUSED_SDPA = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
               "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")


def _is_fused_sdpa(target: Any) -> bool:
    parts = str(target).split(".")
    return len(parts) == 3 and parts[0] == "aten" and parts[1] in _FUSED_SDPA


def _sdpa_in_float64(target: Any, outputs: list) -> Any:
    """A stand-in for fused SDPA op ``target`` run on float64 inputs: the same call structure, its output from
    ``aten._scaled_dot_product_attention_math`` (a float64 GQA, mask, causal and scale as the op reads them) and
    its log-sum-exp from the scores, where the op's has the rows' shape; the other outputs (sequence offsets,
    RNG state, debug mask) are the examples' shapes filled with NaN (float) or 0, never a reference. A bool mask
    is the math op's -inf bias (called directly, it adds the bool as 1 / 0), and a row whose keys are all hidden
    gives zeros, as ``F.scaled_dot_product_attention`` does. A fused kernel is no float64 reference: it may refuse
    float64 or not compute in it (H200 11-29 y: the check of a decode GQA region put eager's own bf16 cuDNN output
    94 % off the float64 cuDNN call it made)."""
    schema = target._schema

    def run(*args: Any, **kwargs: Any) -> tuple:
        a = {arg.name: arg.default_value for arg in schema.arguments if arg.has_default_value()}
        a.update({arg.name: x for arg, x in zip(schema.arguments, args)})
        a.update(kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        mask, causal = a.get("attn_mask", a.get("attn_bias")), bool(a.get("is_causal"))
        if causal and mask is not None:   # both (cuDNN's op takes them): the math path takes one, so fold them
            keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
            mask, causal = (mask & keep if mask.dtype == torch.bool else mask.masked_fill(~keep, float("-inf"))), False
        gqa = q.shape[-3] != k.shape[-3]
        # the math op adds a bool mask as 1 / 0 (F.scaled_dot_product_attention turns it into a -inf bias first)
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        out, _ = torch.ops.aten._scaled_dot_product_attention_math(
            q, k, v, mask, dropout_p=float(a.get("dropout_p") or 0.0), is_causal=causal, scale=a.get("scale"),
            enable_gqa=gqa)
        scale = a.get("scale") or 1.0 / math.sqrt(q.shape[-1])
        if gqa:
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        s = (q @ k.transpose(-1, -2)) * scale
        if mask is not None:
            s = s + mask
        if causal:
            s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        out = out.masked_fill(torch.isneginf(lse)[..., None], 0.0)    # rows with no key: SDPA's zeros
        results = [out]
        for ex in outputs[1:]:
            shape, dtype = tuple(getattr(ex, "shape", ())), getattr(ex, "dtype", None)
            if len(results) == 1 and dtype is not None and dtype.is_floating_point and lse.numel() == math.prod(shape):
                results.append(lse.reshape(shape))
            elif isinstance(dtype, torch.dtype):
                fill = float("nan") if dtype.is_floating_point else 0
                results.append(torch.full(shape, fill, dtype=torch.float64 if dtype.is_floating_point else dtype,
                                          device=q.device))
            else:
                results.append(ex)
        return tuple(results)

    return run


def to_fx(graph: Graph, float64: bool = False) -> fx.GraphModule:
    """The graph as an FX ``GraphModule`` of ATen calls (``meta['val']`` kept).

    ``float64``: every floating dtype the calls name becomes float64 and floating constants are stored in
    float64, so the module run on float64 inputs computes the graph's exact reference (casts to fp16 / fp32
    in the graph, e.g. ``softmax(..., dtype=float32).to(q.dtype)``, would otherwise mix dtypes).
    """
    g = fx.Graph()
    root = torch.nn.Module()
    env: dict[int, fx.Node] = {}
    for v in graph.inputs:
        name = re.sub(r"\W", "_", v.name)
        if v.name in graph.constants:
            const = v.example
            if float64 and isinstance(const, torch.Tensor) and const.is_floating_point():
                const = const.double()
            root.register_buffer(name, const)
            p = g.get_attr(name)
        else:
            p = g.placeholder(name)
        p.meta["val"] = v.example
        env[id(v)] = p
    for node in graph.nodes:
        args, kwargs = map_values((node.args, node.kwargs), lambda v: env[id(v)])
        target = node.target
        if float64:
            args, kwargs = _in_float64(tuple(args), dict(kwargs), node.target)
            if _is_fused_sdpa(node.target):
                target = _sdpa_in_float64(node.target, [v.example for v in node.outputs])
        call = g.call_function(target, tuple(args), dict(kwargs))
        call.meta["val"] = pytree.tree_unflatten([v.example for v in node.outputs], node.out_structure)
        if len(node.outputs) == 1 and isinstance(graph.result(node), Value):
            env[id(node.outputs[0])] = call
        else:
            for i, v in enumerate(node.outputs):
                item = g.call_function(__import__("operator").getitem, (call, i))
                item.meta["val"] = v.example
                env[id(v)] = item
    outs = map_values(list(graph.outputs), lambda v: env[id(v)])
    g.output(outs[0] if graph.single_output else tuple(outs))
    return fx.GraphModule(root, g)


def _known(graph: Graph, v: Value, observed: dict) -> bool:
    return v.name in graph.constants or v.name in observed


def _constant_slice(graph: Graph, value: Value, observed: dict) -> list | None:
    """The nodes ``value`` is computed by back to the graph's constants (and ``observed`` inputs), or None where
    another graph input reaches it."""
    nodes, stack, seen = [], [value.producer], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)
        for v in node.inputs:
            if v.producer is not None:
                stack.append(v.producer)
            elif not _known(graph, v, observed):
                return None                     # a graph input reaches the value
    return nodes


def computed_from_constants(graph: Graph, value: Value) -> bool:
    """Whether the graph computes ``value`` from its constants alone, or it is one (what :func:`constant_value`
    would evaluate), without evaluating it."""
    if value.producer is None:
        return _known(graph, value, {}) and isinstance(value.example, torch.Tensor)
    return _constant_slice(graph, value, {}) is not None


def constant_value(graph: Graph, value: Value, observed: dict[str, torch.Tensor] | None = None) -> torch.Tensor | None:
    """``value``'s tensor where the graph computes it from its constants alone (no graph input reaches it: an
    attention mask built from ``arange`` comparisons, a constant table); None otherwise. A kernel specialised on
    such a value's properties (the attention band skips the tiles the mask hides) is checked and tuned on this
    tensor, not on random data. None also where the slice does not run on its own. ``observed``: real tensors of
    graph inputs (by input name) that count as known too — the call being compiled; what comes back then holds
    for that call only: fit to time kernels on, never to specialise one on."""
    observed = observed or {}

    def leaf(v: Value):
        return observed[v.name] if v.name in observed else v.example

    if value.producer is None:
        return leaf(value) if _known(graph, value, observed) and isinstance(leaf(value), torch.Tensor) else None
    # evaluated once per value and observed tensors in a graph: an HF model's mask, built once and read by every
    # layer's attention, was evaluated 16 times over a warm compile of the DynamicCache llama's graphs (H100
    # 12-07 g, 0.23 s profiled, nearly all of it making and tracing the slice's FX module); a copy each time,
    # since a caller may write it (a region check's inputs), except a broadcast, which no write can land in; a
    # large one is not kept (a long prompt's mask: 8192 x 8192 fp32 is 256 MiB) and is evaluated as before
    memo = graph.__dict__.setdefault("_constant_values", {})
    key = (id(value), frozenset((name, id(t)) for name, t in observed.items()))
    out = memo.get(key, _NOT_EVALUATED)
    if out is _NOT_EVALUATED:
        out = _evaluated(graph, value, observed, leaf)
        if out is not None and out.untyped_storage().nbytes() > CONSTANT_MEMO_BYTES:
            return out
        memo[key] = out
    return out if out is None or 0 in out.stride() else out.clone()


_NOT_EVALUATED = object()
CONSTANT_MEMO_BYTES = 16 << 20   # the largest constant value constant_value keeps for the graph's later asks


def _evaluated(graph: Graph, value: Value, observed: dict, leaf: Callable[[Value], Any]) -> torch.Tensor | None:
    """``value`` computed by running its constant slice (:func:`constant_value`'s work, not memoized)."""
    nodes = _constant_slice(graph, value, observed)
    if nodes is None:
        return None
    try:
        sub = subgraph(graph, nodes, [value])
        out = to_fx(sub)(*[leaf(v) for v in sub.inputs])
    except Exception:   # a slice that does not run on its own (symbolic sizes, a fake example): not known
        return None
    out = out[0] if isinstance(out, (list, tuple)) else out
    return out.to(value.meta.device) if value.meta is not None else out
