"""The reference program of a captured region (SEARCH.md §6.1): capture IR → plain μGraph.

:func:`reference_of` lowers a region's nodes (functional ATen after Inductor's
decompositions, as :mod:`torch_mirage.capture` produces it) into a
:class:`~torch_mirage.ugraph.KernelGraph` of pre-defined kernel ops only (matmul,
elementwise, reductions, layout) and computes the target expressions of its
outputs (:mod:`.expr`), which the generator searches for and the oracle prunes
against. What cannot be lowered gives a :class:`Decline` naming the node, its
shapes and dtypes and why.

Mapping: mm / bmm / addmm → matmul (+ bias); ``permute`` / ``t`` of the last
two dims (``nn.Linear``'s weight) → transpose; view / reshape / squeeze /
unsqueeze → reshape; expand → broadcasting, made explicit by concatenated
copies only where a reshape needs it (GQA's ``repeat_kv``); clone → nothing; add / sub / mul / div with tensors or scalars → add / sub / mul /
div / scalar_add / scalar_mul; pow 2 / 3 / 0.5 / -0.5 → square / square·x / sqrt / rsqrt;
rsqrt / sqrt / exp / silu / neg; split / slice (unit step) → slice ops of whole chunks, cat → concat; a permute
that moves only dims of size 1 → reshape; Inductor's decomposed SiLU
``a / (1 + exp(-a))`` and ``a · sigmoid(a)`` → silu; sum / mean / amax over dims → reduce ops;
var_mean (LayerNorm's decomposition) → a mean and the centred mean of squares with its correction
(then a reshape when ``keepdim`` is false); scaled_dot_product_attention (CPU / flash /
efficient / cuDNN ATen ops, GQA heads included; no mask, causal or dropout) → its softmax decomposition;
``index_copy`` (or the ``index_put`` Inductor decomposes it into) of a graph input at positions the region reads
→ ``index_copy`` (a KV cache's write). Only nodes that an output needs are lowered. dtype casts are not ops: the
computation is tracked in its float dtype and an fp32 upcast is recorded in
``Reference.upcast``. In-place ATen forms (``add_``) lower like their
functional forms.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ...analysis.cost import region_io as cost_region_io
from ...ugraph import KernelGraph, MuGraphError
from ..builder import KernelBuilder, Tensor, new_kernel_graph
from .expr import Expr, graph_exprs


@dataclass
class Reference:
    graph: KernelGraph          # pre-defined kernel ops only; input i = inputs[i]
    inputs: list                # capture.ir.Value, bound to graph inputs in order
    outputs: list               # capture.ir.Value, in graph output order
    dtype: str                  # the region's float dtype (its first float input's)
    upcast: bool = False        # the region computes (part of) itself in fp32
    casts: list = field(default_factory=list)   # the cast nodes folded away

    @functools.cached_property
    def exprs(self) -> list[Expr]:
        """The target expressions of the outputs, computed when first asked for: most lowered cuts are only
        looked up against the seeds (HF gemma2's partition computed them for 650 cuts and read none)."""
        return graph_exprs(self.graph)


@dataclass
class Decline:
    node: object                # the capture.ir.Node that could not be lowered (None: the region itself)
    reason: str
    detail: str = ""

    def __str__(self) -> str:
        where = self.node.describe() if self.node is not None and hasattr(self.node, "describe") else "region"
        return f"{where}: {self.reason}" + (f" ({self.detail})" if self.detail else "")


class _Decline(Exception):
    def __init__(self, node, reason, detail=""):
        super().__init__(reason)
        self.decline = Decline(node, reason, detail)


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _is_value(a) -> bool:
    return hasattr(a, "meta") and hasattr(a, "producer")


_INPLACE = re.compile(r"^aten\.(\w+?)_\.(\w+)$")
_UNARY = {"exp": "exp", "sqrt": "sqrt", "rsqrt": "rsqrt", "silu": "silu", "neg": "neg", "tanh": "tanh"}


def _op_name(node) -> str:
    """The capture op name; an opaque in-place ATen form maps to its functional op."""
    name = node.op.name
    if name == "opaque":
        m = _INPLACE.match(node.target_name)
        if m:
            return {"add": "add", "sub": "sub", "mul": "mul", "div": "div"}.get(m.group(1), "opaque")
    return name


def region_io(nodes: Sequence, graph, first_use: bool = False) -> tuple[list, list]:
    """The region's input values (used, not produced inside; in graph order, or with ``first_use`` in the order
    the region's nodes first read them) and output values (produced inside, used outside or returned):
    :func:`~torch_mirage.analysis.cost.region_io`, its inputs put in graph order unless ``first_use``."""
    ins, outs = cost_region_io(nodes, graph)
    if not first_use:
        order = graph.value_positions()
        ins.sort(key=lambda v: order.get(id(v), 0))
    return ins, outs


def reference_of(nodes: Sequence, graph, first_use: bool = False) -> Reference | Decline:
    """The plain μGraph and target expressions of the region ``nodes`` of ``graph`` (its inputs in graph order, or
    with ``first_use`` in the order its nodes first read them: :func:`region_io`)."""
    ins, outs = region_io(nodes, graph, first_use)
    if not outs:
        return Decline(None, "the region has no outputs")
    floats = [v for v in ins if v.meta.dtype.is_floating_point]
    if not floats:
        return Decline(None, "the region has no floating-point input")
    if any(not v.meta.is_static for v in ins):
        return Decline(None, "dynamic shapes", ", ".join(str(v.meta) for v in ins))
    fused = _silu_patterns(nodes)
    needed = _needed(nodes, outs, fused)
    g = new_kernel_graph()
    env: dict[int, Tensor] = {id(v): g.new_input(v.meta.shape, _dt(v.meta.dtype)) for v in ins}
    ref = Reference(graph=None, inputs=list(ins), outputs=list(outs), dtype=_dt(floats[0].meta.dtype))
    try:
        for n in nodes:
            if id(n) not in needed:
                continue
            if id(n) in fused:
                a = fused[id(n)]
                env[id(n.outputs[0])] = g.silu(env[id(a)])
                continue
            _lower(g, n, env, ref)
        for v in outs:
            t = env[id(v)]
            if tuple(t.shape) != tuple(v.meta.shape):
                t = _reshape(g, t, v.meta.shape, v.producer)
            g.mark_output(t)
        ref.graph = g.build()
    except _Decline as d:
        return d.decline
    except MuGraphError as e:
        return Decline(None, "the lowered program is not a valid μGraph", str(e))
    return ref


def _producer(v, name: str):
    n = getattr(v, "producer", None)
    return n if n is not None and _op_name(n) == name else None


def looked_through(node) -> bool:
    """Whether :func:`reference_of` may look through ``node``, a producer outside a cut, to its inputs: only along
    a written-out SiLU (:func:`_silu_patterns`: ``add(exp(neg(a)), 1)``, ``sigmoid(a)``), so an add only with a
    scalar second operand."""
    name = _op_name(node)
    if name == "add":
        return len(node.args) == 2 and _scalar(node.args[1]) is not None
    return name in ("exp", "neg", "sigmoid")


def _silu_patterns(nodes) -> dict[int, object]:
    """Nodes that compute ``silu(a)`` in decomposed form -> ``a``:
    ``div(a, add(exp(neg(a)), 1))`` and ``mul(sigmoid(a), a)``."""
    out = {}
    for n in nodes:
        name = _op_name(n)
        if name == "div" and len(n.args) == 2 and all(_is_value(x) for x in n.args):
            a, d = n.args
            add_n = _producer(d, "add")
            if add_n is None or len(add_n.args) != 2 or _scalar(add_n.args[1]) != 1.0:
                continue
            exp_n = _producer(add_n.args[0], "exp")
            neg_n = _producer(exp_n.args[0], "neg") if exp_n is not None else None
            if neg_n is not None and neg_n.args[0] is a:
                out[id(n)] = a
        elif name == "mul" and len(n.args) == 2 and all(_is_value(x) for x in n.args):
            for s_, a in (n.args, n.args[::-1]):
                sig = _producer(s_, "sigmoid")
                if sig is not None and sig.args[0] is a:
                    out[id(n)] = a
    return out


def _needed(nodes, outs, fused) -> set[int]:
    """The region nodes the outputs depend on (a fused SiLU depends on its operand only)."""
    inside = {id(n) for n in nodes}
    need: set[int] = set()
    stack = [v.producer for v in outs]
    while stack:
        n = stack.pop()
        if n is None or id(n) not in inside or id(n) in need:
            continue
        need.add(id(n))
        deps = [fused[id(n)]] if id(n) in fused else n.inputs
        stack.extend(v.producer for v in deps)
    return need


def _materialise(g: KernelBuilder, t: Tensor, shape, node) -> Tensor:
    """``t`` (kept unexpanded) broadcast to ``shape`` explicitly: copies concatenated
    along each broadcast dim (GQA's ``repeat_kv`` before its reshape)."""
    shape = tuple(int(s) for s in shape)
    xs = tuple(t.shape)
    pad = (1,) * (len(shape) - len(xs)) + xs
    if len(xs) > len(shape) or any(a != b and a != 1 for a, b in zip(pad, shape)):
        raise _Decline(node, "operand does not broadcast to its traced shape", f"{xs} -> {shape}")
    if pad != xs:
        t = g.reshape(t, shape=pad)
    for i, (a, b) in enumerate(zip(pad, shape)):
        if a != b:
            t = g.concat([t] * b, dim=i)
    return t


def _reshape(g: KernelBuilder, t: Tensor, shape, node, src_shape=None) -> Tensor:
    shape = tuple(int(s) for s in shape)
    if tuple(t.shape) == shape:
        return t
    if math.prod(t.shape) != math.prod(shape) and src_shape is not None:
        t = _materialise(g, t, src_shape, node)
    if math.prod(t.shape) != math.prod(shape):
        raise _Decline(node, "reshape of a broadcast tensor", f"{tuple(t.shape)} -> {shape}")
    return g.reshape(t, shape=shape)


def _scalar(a) -> float | None:
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        return float(a)
    return None


def _lower(g: KernelBuilder, n, env: dict, ref: Reference) -> None:
    name = _op_name(n)
    out = n.outputs[0] if n.outputs else None
    args = n.args

    def arg(i):
        a = args[i]
        if _is_value(a):
            if id(a) not in env:
                raise _Decline(n, "operand not computed in the region", repr(a))
            return env[id(a)]
        return a

    def put(t: Tensor):
        env[id(out)] = t

    if name in ("to_dtype", "copy"):
        src = arg(0)
        if out.meta.dtype == torch.float32 and src.dtype != "float32":
            ref.upcast = True
        if not out.meta.dtype.is_floating_point:
            raise _Decline(n, f"cast to {_dt(out.meta.dtype)}", "only float casts are tracked")
        if out.meta.dtype != args[0].meta.dtype:
            ref.casts.append(n)
        put(src)
        return
    if name in ("add", "sub", "mul", "div"):
        if n.kwargs.get("alpha", 1) != 1 or (len(args) > 2 and args[2] != 1):
            raise _Decline(n, f"{name} with alpha", "write it as a separate mul")
        a, b = arg(0), arg(1)
        if "rsub" in n.target_name:
            a, b = b, a
        sa, sb = _scalar(a), _scalar(b)
        if sa is None and sb is None:
            put(getattr(g, name)(a, b))
        elif sb is not None:
            if name == "add":
                put(g.scalar_add(a, value=sb))
            elif name == "sub":
                put(g.scalar_add(a, value=-sb))
            elif name == "mul":
                put(g.scalar_mul(a, value=sb))
            elif sb != 0:
                put(g.scalar_mul(a, value=1.0 / sb))
            else:
                raise _Decline(n, "division by the constant 0")
        elif name == "add":
            put(g.scalar_add(b, value=sa))
        elif name == "mul":
            put(g.scalar_mul(b, value=sa))
        elif name == "sub":
            put(g.scalar_add(g.neg(b), value=sa))
        else:
            raise _Decline(n, "a scalar divided by a tensor", "no reciprocal kernel op")
        return
    if name in _UNARY:
        put(getattr(g, _UNARY[name])(arg(0)))
        return
    if name == "pow":
        e = _scalar(args[1])
        if e == 3.0:            # GPT-2's GELU: x³ = x² · x
            put(g.mul(g.square(arg(0)), arg(0)))
            return
        op = {2.0: "square", 0.5: "sqrt", -0.5: "rsqrt", 1.0: None}.get(e, "?") if e is not None else "?"
        if op == "?":
            raise _Decline(n, f"pow with exponent {args[1]!r}", "only 1, 2, 3, 0.5, -0.5 lower to kernel ops")
        put(arg(0) if op is None else getattr(g, op)(arg(0)))
        return
    if name in ("sum", "mean", "amax"):
        x = arg(0)
        rank = len(x.shape)
        dims = args[1] if len(args) > 1 and args[1] is not None else n.kwargs.get("dim", list(range(rank)))
        dims = [dims] if isinstance(dims, int) else list(dims) or list(range(rank))
        op = {"sum": "reduce_sum", "mean": "reduce_mean", "amax": "reduce_max"}[name]
        for d in sorted({d % rank for d in dims}):
            x = getattr(g, op)(x, dim=d)
        if n.kwargs.get("dtype") not in (None, torch.float32) or (len(args) > 3 and args[3] is not None):
            raise _Decline(n, f"{name} with a dtype argument")
        put(_reshape(g, x, out.meta.shape, n))
        return
    if name == "var_mean":
        _lower_var_mean(g, n, arg(0), env)
        return
    if name == "matmul":
        if "addmm" in n.target_name or "baddbmm" in n.target_name:
            bias, a, b = arg(0), arg(1), arg(2)
            if n.kwargs.get("beta", 1) != 1 or n.kwargs.get("alpha", 1) != 1:
                raise _Decline(n, "addmm with beta / alpha")
            put(g.add(g.matmul(a, b), bias))
        else:
            put(g.matmul(arg(0), arg(1)))
        return
    if name == "permute":
        x = arg(0)
        rank = len(x.shape)
        if "aten.t." in n.target_name:
            perm = [1, 0] if rank == 2 else [0]
        elif "transpose" in n.target_name:
            perm = list(range(rank))
            d0, d1 = args[1] % rank, args[2] % rank
            perm[d0], perm[d1] = perm[d1], perm[d0]
        else:
            perm = [p % rank for p in args[1]]
        if perm == list(range(rank)):
            put(x)
        elif [p for p in perm if x.shape[p] != 1] == [d for d in range(rank) if x.shape[d] != 1]:
            put(_reshape(g, x, out.meta.shape, n))      # moves only dims of size 1: (b, 1, h, d) -> (b, h, 1, d)
        elif rank >= 2 and perm == list(range(rank - 2)) + [rank - 1, rank - 2]:
            put(g.transpose(x))
        else:
            raise _Decline(n, f"permute {perm}", "only a swap of the last two dims is a μGraph op")
        return
    if name in ("view", "squeeze", "unsqueeze"):
        put(_reshape(g, arg(0), out.meta.shape, n, args[0].meta.shape))
        return
    if name == "expand":
        x = arg(0)
        shape = tuple(out.meta.shape)
        xs = tuple(x.shape)
        pad = (1,) * (len(shape) - len(xs)) + xs
        if any(a != b and a != 1 for a, b in zip(pad, shape)):
            raise _Decline(n, "expand that is not a broadcast", f"{xs} -> {shape}")
        put(x)         # kept unexpanded: elementwise ops and matmul broadcast it
        return
    if name in ("split", "slice"):
        _lower_slices(g, n, arg(0), env)
        return
    if name == "cat":
        parts = [env[id(v)] if _is_value(v) and id(v) in env else None for v in args[0]]
        if any(p is None for p in parts):
            raise _Decline(n, "cat of a value not computed in the region")
        put(g.concat(parts, dim=(args[1] if len(args) > 1 else n.kwargs.get("dim", 0)) % len(out.meta.shape)))
        return
    if (update := indexed_update(n)) is not None:     # a static KV cache's write (superopt.updates)
        dst, dim, index, src = update
        if dst.producer is not None or not any(index is v for v in ref.inputs):
            raise _Decline(n, "an indexed update of a value computed in the region, or at positions computed in it",
                           "only a graph input is updated, at positions the region reads")
        rows = tuple(dst.meta.shape[:dim]) + tuple(index.meta.shape) + tuple(dst.meta.shape[dim + 1:])
        put(g.index_copy(env[id(dst)], env[id(index)], _reshape(g, env[id(src)], rows, n), dim=dim))
        return
    if name == "opaque" and _sdpa_op(n) is not None:
        put(_lower_sdpa(g, n, arg))
        return
    raise _Decline(n, f"op {name} has no μGraph kernel op", n.target_name)


def indexed_update(n):
    """``(destination, dim, positions, source)`` of a node that writes the rows of ``source`` into ``destination``
    at ``positions`` along ``dim``: ``index_copy(dst, dim, pos, src)``, or ``index_put(dst, [None, .., pos], src)``
    (what Inductor's decompositions make of ``index_copy_``) with ``src`` of the destination's shape but for
    ``len(pos)`` along ``dim`` (leading unit dims may be missing, as slice assignment's values drop them); None for
    any other node."""
    args = n.args
    if n.target_name == "aten.index_copy.default" and len(args) == 4:
        dst, dim, index, src = args
    elif n.target_name == "aten.index_put.default" and len(args) >= 3 and not (len(args) > 3 and args[3]) \
            and not n.kwargs.get("accumulate", False) and isinstance(args[1], (list, tuple)):
        dst, indices, src = args[:3]
        given = [k for k, x in enumerate(indices) if x is not None]
        if len(given) != 1:
            return None
        dim, index = given[0], indices[given[0]]
    else:
        return None
    if not all(_is_value(x) for x in (dst, index, src)) or not isinstance(dim, int):
        return None
    shape, rows = tuple(dst.meta.shape), tuple(src.meta.shape)
    if len(index.meta.shape) != 1 or index.meta.dtype.is_floating_point or len(rows) > len(shape):
        return None
    dim %= len(shape)
    rows = (1,) * (len(shape) - len(rows)) + rows      # slice assignment's values may drop leading unit dims
    if rows[dim] != index.meta.shape[0] or any(a != b for k, (a, b) in enumerate(zip(rows, shape)) if k != dim):
        return None
    return dst, dim, index, src


def _lower_slices(g: KernelBuilder, n, x: Tensor, env: dict) -> None:
    """``split`` / ``split_with_sizes`` / ``slice`` (step 1) / ``select`` -> ``slice`` ops, each a run of equal
    chunks of the dim (the chunk the gcd of the cut points, so that the search's shrunk sizes keep the cuts)."""
    rank = len(x.shape)
    if "select" in n.target_name:
        raise _Decline(n, "select drops a dim", "index with a slice of length 1 instead")
    at = 1 if "aten.slice" in n.target_name else 2
    dim = (n.args[at] if len(n.args) > at else n.kwargs.get("dim", 0)) % rank
    size = x.shape[dim]
    if at == 1:
        start, end, step = (list(n.args[2:5]) + [None, None, 1][len(n.args[2:5]):])[:3]
        start = 0 if start is None else (start + size if start < 0 else min(start, size))
        end = size if end is None else (end + size if end < 0 else min(end, size))
        if step != 1 or not 0 <= start < end:
            raise _Decline(n, f"slice [{start}:{end}:{step}] of dim {dim}", "only non-empty unit-step slices lower")
        cuts = [(start, end)]
    else:
        sizes = n.args[1]
        sizes = [min(sizes, size - i) for i in range(0, size, sizes)] if isinstance(sizes, int) else list(sizes)
        ends = [sum(sizes[:i + 1]) for i in range(len(sizes))]
        cuts = list(zip([0] + ends[:-1], ends))
    unit = math.gcd(size, *[c for cut in cuts for c in cut])
    for v, (a, b) in zip(n.outputs, cuts):
        env[id(v)] = x if (a, b) == (0, size) else \
            g.slice(x, dim=dim, chunks=size // unit, start=a // unit, stop=b // unit)


def _lower_var_mean(g: KernelBuilder, n, x: Tensor, env: dict) -> None:
    """``var_mean(x, dims, correction)`` (LayerNorm's decomposition; ``prims.var`` gives the variance only):
    ``mean = reduce_mean(x)``, ``var = reduce_sum((x - mean)²) / (count - correction)``."""
    rank = len(x.shape)
    dims = n.args[1] if len(n.args) > 1 and n.args[1] is not None else n.kwargs.get("dim", list(range(rank)))
    dims = sorted({d % rank for d in ([dims] if isinstance(dims, int) else list(dims) or range(rank))})
    corr = n.args[2] if "prims.var" in n.target_name and len(n.args) > 2 else n.kwargs.get("correction")
    corr = 1.0 if corr is None else float(corr)
    count = math.prod(x.shape[d] for d in dims)
    if count <= corr:
        raise _Decline(n, f"variance of {count} elements with correction {corr:g}", "divides by zero")
    mean = x
    for d in dims:
        mean = g.reduce_mean(mean, dim=d)
    sq = g.square(g.sub(x, mean))
    for d in dims:
        sq = g.reduce_sum(sq, dim=d)
    var = g.scalar_mul(sq, value=1.0 / (count - corr))
    for v, t in zip(n.outputs, (var, mean)):
        env[id(v)] = _reshape(g, t, v.meta.shape, n)


# scaled_dot_product_attention as traced (the device picks the ATen op): op -> (attn_mask / bias, dropout_p,
# is_causal) positions; a mask may also come as a keyword.
_SDPA = {"scaled_dot_product_attention": (3, 4, 5),
         "_scaled_dot_product_flash_attention_for_cpu": (None, 3, 4),
         "_scaled_dot_product_flash_attention": (None, 3, 4),
         "_scaled_dot_product_efficient_attention": (3, 5, 6),
         "_scaled_dot_product_cudnn_attention": (3, 5, 6)}


def _sdpa_op(n):
    parts = n.target_name.split(".")
    return _SDPA.get(parts[1]) if len(parts) > 2 and parts[0] == "aten" else None


def is_attention(node) -> bool:
    """``node`` is a scaled_dot_product_attention ATen op (opaque in the capture) that lowers to its softmax
    decomposition (:func:`_lower_sdpa`; masks, causal and dropout still decline there)."""
    return _op_name(node) == "opaque" and _sdpa_op(node) is not None


def _lower_sdpa(g: KernelBuilder, n, arg) -> Tensor:
    """``softmax(q·kᵀ·scale) @ v`` in kernel ops (the decomposition Inductor gives
    ``torch.softmax``), GQA's grouped heads made explicit (kv head ``i`` serves
    query heads ``i·g … i·g + g - 1``). Masks, causal masking and dropout have no
    μGraph op and decline."""
    mask_at, drop_at, causal_at = _sdpa_op(n)

    def pos(i, default=None):
        return n.args[i] if i is not None and len(n.args) > i else default

    mask = pos(mask_at) or n.kwargs.get("attn_mask") or n.kwargs.get("attn_bias")
    if mask is not None:
        raise _Decline(n, "attention with a mask", "an additive / boolean mask has no μGraph op")
    if pos(causal_at, False) or n.kwargs.get("is_causal"):
        raise _Decline(n, "causal attention", "is_causal needs a position mask, which has no μGraph op")
    if (pos(drop_at, 0.0) or n.kwargs.get("dropout_p") or 0.0) != 0.0:
        raise _Decline(n, "attention with dropout")
    q, k, v = arg(0), arg(1), arg(2)
    if len(q.shape) < 3 or len(k.shape) != len(q.shape) or len(v.shape) != len(q.shape):
        raise _Decline(n, "attention operands of rank < 3 or of different ranks",
                       f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    hq, hkv = q.shape[-3], k.shape[-3]
    if hq != hkv:
        if hkv == 0 or hq % hkv or v.shape[-3] != hkv:
            raise _Decline(n, "attention heads that do not group", f"{hq} query heads, {hkv} kv heads")
        k, v = (_repeat_heads(g, t, hq // hkv, n) for t in (k, v))
    scale = n.kwargs.get("scale")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    last = len(q.shape) - 1
    s = g.scalar_mul(g.matmul(q, g.transpose(k)), value=scale)
    e = g.exp(g.sub(s, g.reduce_max(s, dim=last)))
    return g.matmul(g.div(e, g.reduce_sum(e, dim=last)), v)


def _repeat_heads(g: KernelBuilder, t: Tensor, group: int, node) -> Tensor:
    """(…, h, s, d) -> (…, h·group, s, d), each head repeated ``group`` times in place (``repeat_kv``)."""
    *lead, h, s, d = t.shape
    t = _materialise(g, g.reshape(t, shape=(*lead, h, 1, s, d)), (*lead, h, group, s, d), node)
    return g.reshape(t, shape=(*lead, h * group, s, d))
