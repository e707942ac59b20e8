"""Interpret a project-IR :class:`~torch_mirage.capture.ir.Graph` over the finite field.

One handler per op name of :mod:`torch_mirage.capture.ops` (:data:`HANDLERS`): LAX ops go to
:class:`~.finite_field.FiniteFieldArith`, layout ops re-run their ATen overload on the
:class:`~.ff_tensor.FieldTensor` (they only move elements), ``where`` selects with a boolean
condition that is program *data* (a bool input, the same on both sides of a comparison). Ops without
a handler (erf, comparisons of field values, clamp ...) raise :class:`~.ff_field.NotLAX`:
such programs get only the float test.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ..capture.ir import Graph, Value, map_values
from .ff_field import NotLAX
from .ff_tensor import FieldTensor, raw
from .finite_field import FiniteFieldArith

Handler = Callable[[FiniteFieldArith, Any, tuple, dict], Any]


def _alpha(A, b, kwargs):
    alpha = kwargs.get("alpha", 1)
    return b if alpha == 1 else A.mul(b, alpha)


def _add(A, node, args, kwargs):
    return A.add(args[0], _alpha(A, args[1], kwargs))


def _sub(A, node, args, kwargs):
    a, b = args[:2]
    if "rsub" in node.target_name:
        a, b = b, a
    return A.sub(a, _alpha(A, b, kwargs))


def _div(A, node, args, kwargs):
    if kwargs.get("rounding_mode") is not None:
        raise NotLAX(f"{node.describe()}: rounding division")
    return A.div(args[0], args[1])


def _pow(A, node, args, kwargs):
    x, e = args[:2]
    if isinstance(e, torch.Tensor) or isinstance(x, (int, float)):
        raise NotLAX(f"{node.describe()}: tensor exponent")
    if e == 0.5:
        return A.sqrt(x)
    if e == -0.5:
        return A.rsqrt(x)
    if float(e).is_integer() and abs(e) <= 64:
        out = A.constant(1)
        for _ in range(int(abs(e))):
            out = A.mul(out, x)
        return out if e >= 0 else A.inverse(out)
    raise NotLAX(f"{node.describe()}: exponent {e}")


def _dims(node, x, dims):
    nd = raw(x).dim()
    if dims is None or dims == []:
        return list(range(nd))
    dims = [dims] if isinstance(dims, int) else list(dims)
    return sorted(d % nd for d in dims)


def _reduce(A, node, x, dims, keepdim, fn):
    for d in reversed(_dims(node, x, dims)):
        x = fn(x, d, keepdim)
    return x


def _sum(A, node, args, kwargs):
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    return _reduce(A, node, args[0], dims, keepdim, A.sum)


def _mean(A, node, args, kwargs):
    x = args[0]
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    n = math.prod(raw(x).shape[d] for d in _dims(node, x, dims))
    return A.div(_sum(A, node, args, kwargs), n)


def _amax(A, node, args, kwargs):
    x = args[0]
    dims = args[1] if len(args) > 1 else kwargs.get("dim", [])
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    out = _reduce(A, node, x, dims, keepdim, A.max)
    if "max.dim" in node.target_name:     # (values, indices): indices have no field meaning
        return out, None
    return out


def _maximum(A, node, args, kwargs):
    """Elementwise max of two tensors: a fresh random value like ``max`` (a cancelling shift); clamp is not LAX."""
    if "clamp" in node.target_name or not all(isinstance(a, FieldTensor) for a in args[:2]):
        raise NotLAX(f"{node.describe()}: clamp / max with a constant")
    return A.maximum(args[0], args[1])


def _matmul(A, node, args, kwargs):
    name = node.target_name
    if "addmm" in name or "baddbmm" in name:
        bias, a, b = args[:3]
        beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
        prod = A.matmul(a, b)
        prod = prod if alpha == 1 else A.mul(prod, alpha)
        return A.add(bias if beta == 1 else A.mul(bias, beta), prod)
    return A.matmul(args[0], args[1])


def _layout(A, node, args, kwargs):
    return node.target(*args, **kwargs)


def _full(A, node, args, kwargs):
    name = node.target_name
    if "scalar_tensor" in name:
        return A.full((), args[0])
    if "zeros" in name:
        return A.zeros(args[0])
    if "ones" in name:
        return A.full(args[0], 1)
    return A.full(args[0], args[1])


def _to_dtype(A, node, args, kwargs):
    dtype = args[1] if len(args) > 1 else kwargs.get("dtype")
    if dtype is not None and not dtype.is_floating_point:
        raise NotLAX(f"{node.describe()}: conversion to {dtype}")
    return args[0]


def _where(A, node, args, kwargs):
    cond, a, b = args
    if isinstance(cond, FieldTensor) or not isinstance(cond, torch.Tensor) or cond.dtype is not torch.bool:
        raise NotLAX(f"{node.describe()}: the condition is computed from field values (a comparison)")
    return A.where(cond, a, b)


def _bool_op(fn):
    """A comparison or logic op on data that is not field values (bool masks): ``fn``, or the node's own ATen
    target where ``fn`` is None."""
    def handler(A, node, args, kwargs):
        if any(isinstance(a, FieldTensor) for a in args):
            raise NotLAX(f"{node.describe()}: a comparison or logic op on field values")
        return fn(*args) if fn is not None else node.target(*args, **kwargs)
    return handler


def _unary(method: str) -> Handler:
    return lambda A, node, args, kwargs: getattr(A, method)(args[0])


def _binary(method: str) -> Handler:
    return lambda A, node, args, kwargs: getattr(A, method)(args[0], args[1])


HANDLERS: dict[str, Handler] = {
    "add": _add, "sub": _sub, "mul": _binary("mul"), "div": _div,
    "neg": _unary("neg"), "reciprocal": _unary("inverse"), "exp": _unary("exp"), "exp2": _unary("exp2"),
    "sqrt": _unary("sqrt"), "rsqrt": _unary("rsqrt"), "pow": _pow, "silu": _unary("silu"),
    "tanh": _unary("tanh"),
    "sigmoid": _unary("sigmoid"), "to_dtype": _to_dtype, "copy": lambda A, n, a, k: a[0],
    "sum": _sum, "mean": _mean, "amax": _amax, "maximum": _maximum, "matmul": _matmul,
    "view": _layout, "permute": _layout, "expand": _layout, "unsqueeze": _layout, "squeeze": _layout,
    "slice": _layout, "cat": _layout, "split": _layout,
    "full": _full, "where": _where,
    "logical_not": _bool_op(torch.logical_not), "logical_and": _bool_op(torch.logical_and),
    "any": _bool_op(None),   # over bool data (a mask's all-masked rows) only
}


def interpret(graph: Graph, inputs: list, arith: FiniteFieldArith) -> list:
    """Run ``graph`` on field inputs (FieldTensors; bool tensors and non-tensors pass as data)."""
    env: dict[int, Any] = {id(v): x for v, x in zip(graph.inputs, inputs)}
    for node in graph.nodes:
        handler = HANDLERS.get(node.op.name)
        if handler is None:
            raise NotLAX(f"{node.describe()}: op '{node.op.name}' has no finite-field semantics")
        args, kwargs = map_values((node.args, node.kwargs), lambda v: env[id(v)])
        result = handler(arith, node, tuple(args), dict(kwargs))
        outs = node.outputs
        if len(outs) == 1 and isinstance(graph.result(node), Value):
            env[id(outs[0])] = result
        else:
            for v, r in zip(outs, result):
                env[id(v)] = r
    return [env[id(v)] if isinstance(v, Value) else v for v in graph.outputs]
