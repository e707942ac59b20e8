"""How an op's dims relate to its operands' dims, read from its ATen arguments.

This module owns the per-op facts both property analyses need (:mod:`.properties`, the dimension links, and
:mod:`.values`, the value properties) and the cost model reads: a node's arguments by schema name
(:func:`bind_args`), a reduction's reduced dims (:func:`reduction_dims`), a matmul's operands
(:func:`matmul_operands`), and for each single-input layout op the (input dim, output dim) pairs that are one
iteration axis (:data:`LAYOUT_PAIRS`), with whether indices pass unchanged.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from ..capture.ir import Node, Value


def bind_args(node: Node) -> dict[str, Any]:
    """``node``'s ATen arguments by schema name, defaults filled in (empty when the target has no schema)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return {}
    out: dict[str, Any] = {}
    for i, a in enumerate(schema.arguments):
        if i < len(node.args) and not a.kwarg_only:
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    return out


def ndim(v: Value) -> int:
    return len(v.meta.shape)


def is_int(s: Any) -> bool:
    return isinstance(s, int) and not isinstance(s, bool)


def is_one(s: Any) -> bool:
    return is_int(s) and s == 1


def _norm_dims(dims: Any, rank: int) -> list[int]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(rank))
    if is_int(dims):
        dims = [dims]
    return sorted({d % rank if rank else 0 for d in dims})


def tensor_inputs(node: Node) -> list[Value]:
    return [v for v in node.inputs if v.is_tensor]


def reduction_dims(node: Node) -> tuple[Value, list[int], bool]:
    """(input, reduced dims in ``[0, rank)``, keepdim) of a reduction node, from its ATen arguments."""
    b = bind_args(node)
    x = tensor_inputs(node)[0]
    dims = _norm_dims(b.get("dim", b.get("dims")), ndim(x))
    out = next(o for o in node.outputs if o.is_tensor)
    keepdim = bool(dims) and ndim(out) == ndim(x)
    return x, dims, keepdim


def matmul_operands(node: Node) -> tuple[Value | None, Value, Value]:
    """(bias or None, A[..., M, K], B[..., K, N]) of mm / bmm / addmm / baddbmm."""
    ins = tensor_inputs(node)
    return (ins[0] if len(ins) == 3 else None), ins[-2], ins[-1]


# --- layout ops: (input dim, output dim) pairs for single-input ops; ``exact`` when indices are unchanged

def _view_groups(src: Sequence, dst: Sequence) -> list[tuple[list[int], list[int]]] | None:
    """Groups of source / target dims whose sizes multiply to the same number (size-1 dims skipped)."""
    if not all(is_int(s) and s > 0 for s in list(src) + list(dst)):
        return None
    i = j = 0
    groups = []
    while True:
        while i < len(src) and src[i] == 1:
            i += 1
        while j < len(dst) and dst[j] == 1:
            j += 1
        if i >= len(src) or j >= len(dst):
            return groups
        gi, gj, ps, pd = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while ps != pd:
            if ps < pd:
                gi.append(i)
                ps *= src[i]
                i += 1
            else:
                gj.append(j)
                pd *= dst[j]
                j += 1
        groups.append((gi, gj))


def _pairs_view(node: Node, x: Value, out: Value) -> tuple[list[tuple[int, int]], bool]:
    groups = _view_groups(x.meta.shape, out.meta.shape)
    if groups is None:   # symbolic sizes: every dim with every dim
        return [(d, e) for d in range(ndim(x)) for e in range(ndim(out))], False
    pairs = [(d, e) for gi, gj in groups for d in gi for e in gj]
    return pairs, all(len(gi) == 1 and len(gj) == 1 for gi, gj in groups)


def _pairs_permute(node: Node, x: Value, out: Value) -> tuple[list[tuple[int, int]], bool]:
    b = bind_args(node)
    r = ndim(x)
    if "dims" in b:
        perm = [d % r for d in b["dims"]]
    elif "dim0" in b:
        perm = list(range(r))
        i, j = b["dim0"] % r, b["dim1"] % r
        perm[i], perm[j] = perm[j], perm[i]
    else:
        perm = list(reversed(range(r)))
    return [(p, e) for e, p in enumerate(perm)], True


def _pairs_expand(node: Node, x: Value, out: Value) -> tuple[list[tuple[int, int]], bool]:
    off = ndim(out) - ndim(x)
    return [(d, d + off) for d in range(ndim(x))], True


def _pairs_unsqueeze(node: Node, x: Value, out: Value) -> tuple[list[tuple[int, int]], bool]:
    u = bind_args(node)["dim"] % ndim(out)
    return [(d, d if d < u else d + 1) for d in range(ndim(x))], True


def _pairs_squeeze(node: Node, x: Value, out: Value) -> tuple[list[tuple[int, int]], bool]:
    b = bind_args(node)
    dims = set(_norm_dims(b["dim"], ndim(x))) if "dim" in b else set(range(ndim(x)))
    dropped = {d for d in dims if is_one(x.meta.shape[d])}
    kept = [d for d in range(ndim(x)) if d not in dropped]
    return list(zip(kept, range(len(kept)))), True


def _pairs_slice(node: Node, x: Value, out: Value) -> tuple[list[tuple[int, int]], bool]:
    b = bind_args(node)
    d0 = b["dim"] % ndim(x)
    if "index" in b:   # select: the dim disappears
        kept = [d for d in range(ndim(x)) if d != d0]
        return list(zip(kept, range(len(kept)))), False
    exact = b.get("start") in (None, 0) and b.get("step", 1) == 1
    return [(d, d) for d in range(ndim(x))], exact


LAYOUT_PAIRS: dict[str, Callable] = {
    "view": _pairs_view, "permute": _pairs_permute, "expand": _pairs_expand,
    "unsqueeze": _pairs_unsqueeze, "squeeze": _pairs_squeeze, "slice": _pairs_slice,
}
