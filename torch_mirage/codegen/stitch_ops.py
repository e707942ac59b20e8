"""What each IR op is in a stitch kernel: its Triton expression, its reduction, its fill, and whether it can be emitted.

This module owns the per-op facts of the stitch codegen: :func:`op_expr` (an elementwise node's Triton expression
over its operands' expressions: the op's entry in :data:`TEMPLATES`, or a rule here for ops whose template
needs the node), :data:`HELPERS` (the ``@triton.jit`` functions those expressions call), :func:`reduction_spec`,
:func:`fill_value` and :func:`node_support`, which says which IR nodes the codegen can emit; the partitioner
claims nothing else. The kernel itself is written by :mod:`.stitch_emit`.

NaN / inf follow eager: ``maximum``/``minimum`` propagate NaN (``tl.maximum`` does not); ``_tanh`` is computed
from ``exp`` (no libdevice in the interpreter), ``_erf`` uses ``tl.erf``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..capture.ir import Node, Value
from ..capture.ops import OpKind

aten = torch.ops.aten
prims = torch.ops.prims

TL_DTYPE = {torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32",
            torch.bool: "tl.int1"}

TEMPLATES: dict[str, str] = {   # elementwise op name -> str.format template over the operand expressions (fp32)
    "add": "({0} + {1})",
    "sub": "({0} - {1})",
    "mul": "({0} * {1})",
    "div": "({0} / {1})",
    "neg": "(-{0})",
    "reciprocal": "(1.0 / {0})",
    "exp": "tl.exp({0})",
    "exp2": "tl.exp2({0})",
    "sqrt": "tl.sqrt({0})",
    "rsqrt": "tl.rsqrt({0})",
    "silu": "({0} * tl.sigmoid({0}))",
    "sigmoid": "tl.sigmoid({0})",
    "to_dtype": "{0}",
    "copy": "{0}",
    "tanh": "_tanh({0})",
    "erf": "_erf({0})",
    "log": "tl.log({0})",
    "abs": "tl.abs({0})",
    "relu": "_maximum({0}, 0.0)",
    "maximum": "_maximum({0}, {1})",
    "minimum": "_minimum({0}, {1})",
    "where": "tl.where({0}, {1}, {2})",
    "eq": "({0} == {1})",
    "ne": "({0} != {1})",
    "lt": "({0} < {1})",
    "le": "({0} <= {1})",
    "gt": "({0} > {1})",
    "ge": "({0} >= {1})",
    "logical_not": "({0} == 0)",
    "logical_and": "(({0} != 0) & ({1} != 0))",
    "isnan": "({0} != {0})",
}


HELPERS = '''
@triton.jit
def _tanh(x):
    # tanh from exp: stable for large |x|, Taylor series near 0 (no libdevice in the interpreter)
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = a * (1.0 - x2 * (0.3333333333333333 - x2 * 0.13333333333333333))
    r = tl.where(a < 0.004, small, big)
    return tl.where(x < 0, -r, r)


@triton.jit
def _erf(x):
    return tl.erf(x)


@triton.jit
def _maximum(a, b):
    # NaN-propagating like torch.maximum / clamp_min
    return tl.where(a != a, a, tl.where(b != b, b, tl.where(a > b, a, b)))


@triton.jit
def _minimum(a, b):
    return tl.where(a != a, a, tl.where(b != b, b, tl.where(a < b, a, b)))
'''

_ALLOWED_KWARGS = {"memory_format", "dtype", "layout", "device", "pin_memory", "non_blocking"}
_POW = {1: "{0}", 2: "({0} * {0})", 3: "({0} * {0} * {0})", 0.5: "tl.sqrt({0})", -0.5: "tl.rsqrt({0})",
        -1: "(1.0 / {0})", -2: "(1.0 / ({0} * {0}))"}
_BOOL_RESULT_OPS = {"eq", "ne", "lt", "le", "gt", "ge", "logical_not", "logical_and", "isnan", "where", "to_dtype", "copy"}


def _swap(t: str) -> Callable[[Node, list[str]], str]:
    return lambda node, a: t.format(a[1], a[0])


def _pow(node: Node, a: list[str]) -> str:
    return _POW[node.args[1]].format(a[0])


def _to_dtype(node: Node, a: list[str]) -> str:
    src, dst = node.inputs[0].meta.dtype, node.outputs[0].meta.dtype
    if dst is torch.bool:
        return f"({a[0]} != 0)"
    if src is torch.bool:
        return f"{a[0]}.to(tl.float32)"
    if dst in (torch.float16, torch.bfloat16) and src is not dst:
        return f"{a[0]}.to({TL_DTYPE[dst]}).to(tl.float32)"   # the rounding eager does
    return a[0]


_RENDER: dict[Any, Callable[[Node, list[str]], str]] = {
    aten.rsub.Scalar: _swap("({0} - {1})"),
    aten.rsub.Tensor: _swap("({0} - {1})"),
    aten.relu.default: lambda node, a: f"_maximum({a[0]}, 0.0)",
    aten.pow.Tensor_Scalar: _pow,
    prims.convert_element_type.default: _to_dtype,
    aten._to_copy.default: _to_dtype,
}


def op_expr(node: Node, operands: list[str]) -> str:
    """The Triton expression of elementwise ``node`` over its operands' expressions."""
    render = _RENDER.get(node.target)
    return render(node, operands) if render else TEMPLATES[node.op.name].format(*operands)


@dataclass(frozen=True)
class ReductionSpec:
    kind: str          # "sum" | "mean" | "amax" | "amin" | "any" | "var_mean" | "var"
    keepdim: bool
    correction: int = 0


# reductions given as (input, dim, keepdim): the ReductionSpec kind of each
_DIM_REDUCTIONS = {aten.sum.dim_IntList: "sum", aten.mean.dim: "mean", aten.any.dim: "any", aten.any.dims: "any"}


def reduction_spec(node: Node) -> ReductionSpec | None:
    """How the reduction node reduces, when it reduces exactly the last dim of its input; else None."""
    t, a, kw = node.target, node.args, node.kwargs
    x = a[0] if a else None
    if not isinstance(x, Value) or not x.meta or len(x.meta.shape) == 0:
        return None
    nd = len(x.meta.shape)

    def last_only(dims) -> bool:
        dims = list(dims) if isinstance(dims, (list, tuple)) else [dims]
        return len(dims) == 1 and dims[0] % nd == nd - 1 or (not dims and nd == 1)

    if t in _DIM_REDUCTIONS:
        dims = a[1] if len(a) > 1 else kw.get("dim")
        keep = a[2] if len(a) > 2 else kw.get("keepdim", False)
        if dims is None or (a[3:] or kw.get("dtype")) or not last_only(dims):
            return None
        return ReductionSpec(_DIM_REDUCTIONS[t], bool(keep))
    if t in (aten.amax.default, aten.amin.default):
        dims = a[1] if len(a) > 1 else kw.get("dim", [])
        keep = a[2] if len(a) > 2 else kw.get("keepdim", False)
        if not last_only(dims):
            return None
        return ReductionSpec("amax" if t is aten.amax.default else "amin", bool(keep))
    if t is aten.var_mean.correction or t is prims.var.default:
        dims = a[1] if len(a) > 1 else kw.get("dim")
        corr = kw.get("correction", a[2] if t is prims.var.default and len(a) > 2 else 1)
        keep = kw.get("keepdim", False)
        if dims is None or not last_only(dims) or corr not in (0, 1, 0.0, 1.0) or kw.get("output_dtype"):
            return None
        return ReductionSpec("var_mean" if t is aten.var_mean.correction else "var", bool(keep), int(corr))
    return None


def fill_value(node: Node) -> Any:
    """The constant a creation node fills with (None when it is not a constant fill)."""
    t, a = node.target, node.args
    if t is aten.full.default:
        return a[1]
    if t is aten.scalar_tensor.default:
        return a[0]
    return {aten.zeros.default: 0, aten.ones.default: 1}.get(t)


def node_support(node: Node) -> str | None:
    """None when this codegen emits ``node``; else why not (for the report)."""
    kind = node.kind
    if kind is OpKind.REDUCTION:
        spec = reduction_spec(node)
        if spec is None:
            return f"{node.target_name}: only reductions over the last dim are stitched"
        if not node.inputs[0].meta.dtype.is_floating_point and not (spec.kind == "any"
                                                                    and node.inputs[0].meta.dtype is torch.bool):
            return f"{node.target_name}: reduction of {node.inputs[0].meta.dtype}"
        return None
    if kind is OpKind.CREATION:
        v = fill_value(node)
        if v is None or not isinstance(v, (int, float, bool)):
            return f"{node.target_name}: only constant fills are stitched"
        return None
    if kind is not OpKind.ELEMENTWISE:
        return f"{node.target_name}: {kind.value} op"
    if node.op.name not in TEMPLATES and node.target not in _RENDER:
        return f"{node.target_name}: no Triton template"
    if node.target is aten.pow.Tensor_Scalar and node.args[1] not in _POW:
        return f"{node.target_name}: exponent {node.args[1]!r} not stitched"
    if node.target in (aten.pow.Tensor_Tensor,):
        return f"{node.target_name}: tensor exponent"
    alpha = node.kwargs.get("alpha", 1)
    if alpha != 1 or any(k not in _ALLOWED_KWARGS | {"alpha"} for k in node.kwargs):
        return f"{node.target_name}: keyword arguments {sorted(node.kwargs)}"
    if len(node.outputs) != 1:
        return f"{node.target_name}: several outputs"
    out = node.outputs[0].meta
    if out is not None and out.dtype is torch.bool and node.op.name not in _BOOL_RESULT_OPS:
        return f"{node.target_name}: arithmetic on bool"
    return None
