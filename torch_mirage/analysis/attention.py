"""Attention regions found by analysis of what a subgraph computes, not by its written form.

An attention region is ``softmax(mask(softcap(scale · Q Kᵀ))) · V`` wherever it appears in an ATen graph:

* from the decomposed eager form — a batched matmul ``Q·Kᵀ`` whose operands are read by what they hold
  (:mod:`.layout_map`): any chain of views, permutes, expands, copies, casts and scalar factors that flattens Q
  (b, h, sq, d), Kᵀ and V per head, K and V optionally repeated per query-head group — HF's ``repeat_kv``
  (unsqueeze → expand → clone → view), ``repeat_interleave``, an einsum's 5-D views, heads folded into a 3-D
  ``bmm`` whose scores stay (b·h, sq, skv) (then without a mask) —, scalar ``mul`` / ``div`` anywhere before
  the soft-cap (``q*scale``, ``s*scale``, ``s/√d``), an optional soft-cap ``tanh(s/c)·c``, an optional mask (an
  additive float tensor, or a bool tensor through ``where``), the softmax decomposed into
  ``amax / sub / exp / sum / div`` with any casts around it, or SDPA's math path's ``_safe_softmax`` (the same,
  then ``where(all(x == -inf), 0, ·)``: a row with no key gives zeros), then ``P·V`` (its fp32 result cast back
  to the inputs' dtype, as the math path does, inside the region);
* from the fused SDPA ATen ops (``_scaled_dot_product_{flash,efficient,cudnn}_attention``,
  ``_scaled_dot_product_flash_attention_for_cpu``, ``scaled_dot_product_attention``) with their ``attn_mask`` /
  ``is_causal`` / ``scale`` / GQA (fewer K/V heads) arguments; K and V repeated per query-head group by
  ``repeat_kv`` before the op (HF does, where it passes a mask) are read as the KV heads, the repeat in the region.

:func:`find_attention` returns one :class:`AttentionSpec` per region found: its shape parameters, scale, soft-cap,
mask (kind and the value that carries it), the capture-IR nodes it covers and the values it reads. A mask tensor's
value property (:mod:`.values`) names its structure (causal triangle / sliding window) where it is computed from
index comparisons in the same graph.

An eager region's P may also be read by reductions over the query axis — H2O's accumulated attention per key,
spelled ``p.sum(-2)``, ``p.transpose(-1, -2).sum(-1)``, an einsum, a mean, summed over heads too: each becomes a
:class:`ColumnReduction` in :attr:`AttentionSpec.extra_outputs` (its nodes join the region, its value leaves it);
any other reader of an inner value keeps the region from being found.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from .layout_map import Layout, apply as apply_layout
from .op_dims import bind_args, matmul_operands
from .values import Affine, ValueKind, analyze_values

from ..capture.ir import Graph, Node, Value

# layout ops that move no arithmetic: followed through when looking for a region's operands
_LAYOUT = {"view", "permute", "expand", "copy", "unsqueeze", "squeeze"}   # ops that only move elements
SDPA_TARGETS = {
    "aten._scaled_dot_product_flash_attention.default": ("dropout_p", "is_causal", None),
    "aten._scaled_dot_product_flash_attention_for_cpu.default": ("dropout_p", "is_causal", None),
    "aten._scaled_dot_product_efficient_attention.default": ("attn_mask", None, "dropout_p", "is_causal"),
    "aten._scaled_dot_product_cudnn_attention.default": ("attn_mask", None, "dropout_p", "is_causal"),
    "aten.scaled_dot_product_attention.default": ("attn_mask", "dropout_p", "is_causal", "scale"),
}


@dataclass(frozen=True)
class MaskTerm:
    """One additive tensor of a mask read as several (:attr:`AttentionSpec.mask_terms`): the scores get
    ``factor · value.reshape(shape)``, ``shape`` 4-D and broadcast to (b, h, sq, skv) — a tensor added to scores
    whose heads are folded into the batch, ``(b·h, ·, skv)``, is viewed as ``(b, h, ·, skv)``."""
    value: Value
    factor: float
    shape: tuple


@dataclass
class AttentionSpec:
    """One attention region: ``softmax(mask(softcap(scale · Q Kᵀ))) · V``, Q (b, h, sq, d), K (b, hk, skv, d),
    V (b, hk, skv, dv) (:attr:`dv` where V's head size is not Q's and K's: multi-head latent attention)."""
    b: int
    h: int
    hk: int
    sq: int
    skv: int
    d: int
    scale: float
    softcap: float | None = None
    mask: str = "none"              # none | causal | additive | bool
    mask_structure: str = ""        # what the mask tensor's value property shows: "causal", "window(w)", ""
    mask_value: Value | None = None
    bool_fill: float | None = None  # bool masks: the score where the mask is False
    dtype: torch.dtype = torch.float16
    form: str = "eager"             # eager | the SDPA op's name
    q: Value | None = None
    k: Value | None = None
    v: Value | None = None
    output: Value | None = None
    nodes: list[Node] = field(default_factory=list)
    extra_outputs: tuple = ()       # ColumnReductions: P reduced over the query axis (H2O's column sums)
    # where the mask's value property bounds the keys a query sees: (offset, window): query i sees key j only if
    # j <= i + offset (and j > i + offset - window); None where nothing is known. Attention seeds skip the key
    # tiles outside (``forloop_band``); the mask is still applied inside (computed from indices where it is exactly
    # the band and 0 where seen: ``mask_zero_visible``, the claimer's ``index_mask``).
    mask_band: tuple | None = None
    mask_zero_visible: bool = False  # the mask (as the seed adds it) is 0 wherever the band sees
    empty_rows_zero: bool = False   # eager form: a row whose scores are all -inf gives zeros (_safe_softmax)
    probs: tuple = ()               # eager form: the values holding P (b, h, sq, skv), from the softmax to P·V
    row_stats: tuple = ()           # eager form: the softmax's row max and row sum of exponentials (b, h, sq, 1)
    # an additive mask the graph adds as more than one tensor (BLOOM's ALiBi bias in ``baddbmm`` and the causal
    # mask), over heads folded into the batch, or scaled after it is added: the mask is the sum of these terms
    # (``mask`` "additive", ``mask_value`` the term whose value property gives the band, or the first); empty
    # where the mask is ``mask_value`` itself
    mask_terms: tuple = ()
    # of more than one :attr:`mask_terms`: the one holding ``mask_value`` (:attr:`mask_term`) and the others, whose
    # sum (:meth:`combine_mask` over them) the seeds may load as a bias at its own shape — BLOOM's ALiBi
    # (b, h, 1, skv) — beside the mask term at its own (HF's causal (b, 1, sq, skv)), not summed per call;
    # ``band_term_exact``: the mask term is exactly its band (0 wherever it sees): the seeds compute it from indices
    mask_term: MaskTerm | None = None
    bias_terms: tuple = ()
    band_term_exact: bool = False
    dv: int | None = None           # V's head size (and the output's) where it is not ``d``

    @property
    def v_dim(self) -> int:
        return self.dv or self.d

    @property
    def group(self) -> int:
        return self.h // self.hk

    @property
    def inputs(self) -> list[Value]:
        if self.mask_terms:
            return [self.q, self.k, self.v] + [t.value for t in self.mask_terms]
        return [self.q, self.k, self.v] + ([self.mask_value] if self.mask_value is not None else [])

    @property
    def mask_shape(self) -> tuple:
        """The mask's shape as the scores (b, h, sq, skv) broadcast it, 4-D; () when there is no mask tensor."""
        if self.mask_terms:
            return tuple(torch.broadcast_shapes(*(t.shape for t in self.mask_terms)))
        if self.mask_value is None:
            return ()
        shape = tuple(self.mask_value.meta.shape)
        return (1,) * (4 - len(shape)) + shape

    def combine_mask(self, terms: Sequence[torch.Tensor], of: Sequence[MaskTerm] | None = None) -> torch.Tensor:
        """The mask of :attr:`mask_terms` (or of the terms ``of``) from those terms' tensors (in that order), in
        :attr:`mask_value`'s dtype (the one the seeds' mask input is built for), at the terms' broadcast shape."""
        of, dtype = self.mask_terms if of is None else of, self.mask_value.meta.dtype
        if len(of) == 1 and of[0].factor == 1.0:       # one term as it is: a view where it has the dtype
            return terms[0].reshape(of[0].shape).to(dtype)
        total = None
        for t, x in zip(of, terms):
            x = x.reshape(t.shape).float()
            x = x * t.factor if t.factor != 1.0 else x
            total = x if total is None else total + x
        return total.to(dtype)

    def describe(self) -> str:
        parts = [f"b={self.b} h={self.h} hk={self.hk} sq={self.sq} skv={self.skv} d={self.d}"
                 + (f" dv={self.dv}" if self.dv else "") + f" scale={self.scale:.4g}"]
        if self.softcap is not None:
            parts.append(f"softcap={self.softcap:g}")
        if self.mask != "none":
            parts.append(f"mask={self.mask}" + (f"({self.mask_structure})" if self.mask_structure else "")
                         + (f"+{len(self.mask_terms) - 1}" if len(self.mask_terms) > 1 else ""))
        if self.mask_band is not None:
            parts.append(f"band={self.mask_band[0]}" + (f",w{self.mask_band[1]}" if self.mask_band[1] else ""))
        if self.extra_outputs:
            parts.append(f"column_sums={len(self.extra_outputs)}")
        return f"{self.form}: " + " ".join(parts)


@dataclass
class ColumnReduction:
    """A reduction of the region's P over the query axis — H2O's accumulated attention per key — read off the
    graph, whatever its spelling (``p.sum(-2)``, ``p.transpose(-1, -2).sum(-1)``, an einsum, a mean, summed over
    heads too): ``P.permute(order).sum(dims, keepdim) · factor`` in ``dtype``, where ``order`` lists P's logical
    dims (0 b, 1 h, 2 query, 3 key) in the order the reduction sees them; ``dims`` hold the query dim and not the
    key dim."""
    value: Value
    nodes: list[Node]
    order: tuple
    dims: tuple
    keepdim: bool
    factor: float
    dtype: torch.dtype

    def apply(self, colsum: torch.Tensor) -> torch.Tensor:
        """This reduction's value from the column sums per query head, ``colsum`` (b, h, skv)."""
        x = colsum.unsqueeze(2).permute(self.order)
        # the query dim is 1 here: squeezed, not summed (a reduction kernel per call for nothing: 4 µs on an H100)
        summed = tuple(d for d in self.dims if x.shape[d] > 1)
        if summed:
            x = x.sum(summed, keepdim=True)
        if not self.keepdim:
            x = x.squeeze(self.dims)
        return (x * self.factor if self.factor != 1.0 else x).to(self.dtype)


def _shape(v: Any) -> tuple | None:
    return tuple(v.meta.shape) if isinstance(v, Value) and v.meta is not None else None


def _op(v: Any) -> str | None:
    return v.producer.op.name if isinstance(v, Value) and v.producer is not None else None


def _scalar(a: Any) -> float | None:
    """A Python number, or the fill of a ``full`` tensor of one element (``masked_fill``'s value after
    decomposition)."""
    if isinstance(a, Value) and _op(a) == "full" and (a.meta is None or a.meta.numel == 1):
        a = next((x for x in reversed(a.producer.args) if isinstance(x, (int, float))), None)
    return float(a) if isinstance(a, (int, float)) and not isinstance(a, bool) else None


def _back(v: Value, seen: list[Node], ops: set[str]) -> Value:
    """``v`` followed back through arithmetic-free ops (recorded in ``seen``)."""
    while _op(v) in ops:
        seen.append(v.producer)
        v = v.producer.args[0]
    return v


def _scalar_factor(n: Node) -> float | None:
    """The factor a scalar ``mul`` / ``div`` applies (1 for a cast), None for any other node."""
    if n.op.name == "to_dtype":
        return 1.0
    if n.op.name in ("mul", "div") and len(n.args) > 1 and _scalar(n.args[1]) is not None:
        return _scalar(n.args[1]) if n.op.name == "mul" else 1.0 / _scalar(n.args[1])
    return None


def _replay(base: Value, chain: Sequence[Node]) -> Layout | None:
    """The layout of the value ``chain`` (layout ops, casts and scalar factors, first to last) makes of ``base``."""
    layout: Layout | None = Layout.of_base(_shape(base))
    for n in chain:
        if n.op.name not in ("mul", "div"):
            layout = apply_layout(layout, n.op.name, n.args)
    return layout


def _heads_repeated(x_shape: tuple, shape: tuple) -> Layout | None:
    """A 4-D ``(b, heads, s, d)`` tensor with each head repeated ``h / heads`` times (a query-head group reading
    its KV head; once for Q), as a row-major view of ``shape``: ``(b, h, s, d)``, or ``(b·h, s, d)``."""
    b, heads, n, k = x_shape
    per_head = b * n * k
    if math.prod(shape) % (per_head * heads) or tuple(shape[-2:]) != (n, k):
        return None
    group = math.prod(shape) // (per_head * heads)
    return Layout.of_base(x_shape).unsqueeze(2).expand((b, heads, group, n, k)).view(shape)


def _farthest(v: Value, seen: list[Node], want: Callable[[tuple], Layout | None],
              scalars: bool, stop: frozenset = frozenset()) -> tuple[Value, list[Node]] | None:
    """The farthest 4-D value ``x`` behind ``v`` — through layout ops, and casts and scalar ``mul`` / ``div``
    where ``scalars``, each value on the way read by the next op alone and none past a value of ``stop`` (ids of
    values read outside the region: a graph output) — of which ``v`` holds the elements as ``want(x's shape)``
    says (:mod:`.layout_map`), with the nodes from it to ``v`` (which join ``seen``); None where there is none."""
    chain: list[Node] = []            # from v backwards
    x, best = v, None
    for _ in range(32):
        if len(_shape(x) or ()) == 4:
            layout = want(_shape(x))
            if layout is not None and layout.same_as(_replay(x, chain[::-1])):
                best = (x, list(chain))
        n = x.producer
        if n is None or not (n.op.name in _LAYOUT or (scalars and _scalar_factor(n) is not None)) or not n.args \
                or not isinstance(n.args[0], Value) or len(x.users) != 1 or id(x) in stop:   # x read elsewhere
            break
        chain.append(n)
        x = n.args[0]
    if best is not None:
        seen.extend(best[1])
    return best


def _operand(v: Value, seen: list[Node], transposed: bool, query: str = "",
             stop: frozenset = frozenset()) -> tuple[Value, float] | None:
    """The 4-D ``(b, heads, s, d)`` tensor a bmm operand ``v`` reads — ``v`` holds it flattened to ``(b·h, s, d)``,
    each head repeated per query-head group (:func:`_heads_repeated`), transposed for Kᵀ; for Q (``query``) a
    row-major flattening, one head per bmm batch (``"per_head"``) or also a KV head's query heads packed into its
    rows ``(b·hk, g·s, d)`` (``"packed"``) — with the product of the scalar factors applied on the way. The
    operand is followed back through layout ops, casts and scalar ``mul`` / ``div`` in any order and spelling (a
    reshape, an einsum's permutes and 5-D views, HF's ``repeat_kv``, ``k.mT``, SDPA's math path scaling Q and Kᵀ
    each by √scale) and compared by layout."""
    if len(_shape(v) or ()) != 3:
        return None
    batch, rows, cols = _shape(v)
    flat = (batch, cols, rows) if transposed else (batch, rows, cols)

    def want(x_shape: tuple) -> Layout | None:
        if query:   # Q's heads in order, one per bmm batch or a KV head's group of them packed into its rows
            heads = x_shape[0] * x_shape[1]
            if x_shape[-1] != cols or heads % batch or heads // batch * x_shape[2] != rows or \
                    (query == "per_head" and heads != batch):
                return None
            return Layout.of_base(x_shape).view(flat)
        layout = _heads_repeated(x_shape, flat)
        return layout.permute((0, 2, 1)) if transposed and layout is not None else layout

    found = _farthest(v, seen, want, scalars=True, stop=stop)
    if found is None:
        return None
    x, nodes = found
    return x, math.prod(f for n in nodes if (f := _scalar_factor(n)) is not None)


def _unrepeat(v: Value, seen: list[Node], stop: frozenset = frozenset()) -> Value:
    """The KV heads a 4-D K or V ``(b, h, s, d)`` repeats per query-head group (HF's ``repeat_kv``,
    ``repeat_interleave``: any spelling, compared by layout), else ``v``; not past the values of ``stop``."""
    found = _farthest(v, seen, lambda x_shape: _heads_repeated(x_shape, _shape(v)), scalars=False, stop=stop)
    return v if found is None else found[0]


def _is_view_of(x: Value, chain: Sequence[Node], v: Value) -> bool:
    """Whether ``chain`` (layout ops, first to last) takes ``x`` to ``v`` as a row-major view of ``v``'s shape
    would, whatever the ops (a 5-D view and a permute back, a no-op expand, a copy)."""
    return Layout.of_base(_shape(x)).view(_shape(v)).same_as(_replay(x, chain))


def _viewed_back(v: Value, seen: list[Node]) -> Value:
    """The value ``v`` is a plain row-major view of, followed back through layout ops (their nodes join
    ``seen``); ``v`` itself where the ops do something else (a transpose)."""
    chain: list[Node] = []
    x = v
    while x.producer is not None and x.producer.op.name in _LAYOUT:
        chain.append(x.producer)
        x = x.producer.args[0]
    chain.reverse()
    if not chain or not _is_view_of(x, chain, v):
        return v
    seen.extend(chain)
    return x


def _viewed_forward(v: Value, seen: list[Node], shape: tuple) -> Value | None:
    """The first value of ``shape`` reached from ``v`` through single readers that are layout ops and holding
    ``v`` as a row-major view of ``shape`` would (their nodes join ``seen``); None where there is none."""
    chain: list[Node] = []
    x = v
    while len(x.users) == 1 and x.users[0].op.name in _LAYOUT and len(chain) < 32:
        chain.append(x.users[0])
        x = x.users[0].outputs[0]
        if _shape(x) == shape and _is_view_of(v, chain, x):
            seen.extend(chain)
            return x
    return None


def _all_minus_inf(cond: Any) -> tuple[Value, list[Node]] | None:
    """``(x, nodes)`` where ``cond`` is ``all(x == -inf, -1, keepdim=True)`` as decomposed:
    ``logical_not(any(logical_not(eq(x, -inf)), -1, True))``."""
    nodes = []
    for name in ("logical_not", "any", "logical_not", "eq"):
        if _op(cond) != name:
            return None
        node = cond.producer
        if name == "any" and (len(node.args) < 3 or node.args[2] is not True
                              or node.args[1] not in (-1, len(_shape(cond)) - 1, [-1], [len(_shape(cond)) - 1])):
            return None
        nodes.append(node)
        cond = node.args[0]
    if _scalar(nodes[-1].args[1]) != -math.inf:
        return None
    return cond, nodes


def _zero(v: Any) -> list[Node] | None:
    """The nodes making ``v`` a zero fill (none for the scalar 0); None when it is not one."""
    if _scalar(v) == 0:
        return []
    if _op(v) == "full" and _scalar(v.producer.args[1]) == 0 and len(v.users) == 1:
        return [v.producer]
    return None


def _softmax_input(p: Value, seen: list[Node]) -> tuple[Value, bool, Value | None] | None:
    """``(x, empty_rows_zero, late_sum)``: the scores ``x`` of ``p = exp(x - amax(x)) / sum(exp(x - amax(x)))``
    over the last dim (casts allowed), or of ``_safe_softmax``'s ``where(all(x == -inf), 0, p)``
    (``empty_rows_zero``), or of ``p = exp(x - amax(x))`` whose row sums divide ``P·V`` afterwards (the late
    normalisation: ``late_sum`` is that ``sum``'s value)."""
    p = _back(p, seen, {"to_dtype", "copy"})
    if _op(p) == "exp":
        total = next((u.outputs[0] for u in p.users if u.op.name == "sum" and u.args[0] is p), None)
        if total is None or list(total.producer.args[1]) not in ([-1], [len(_shape(p)) - 1]) \
                or _shape(total)[-1] != 1 or len(total.users) != 1:
            return None
        x = _exp_shifted(p)
        if x is None:
            return None
        seen.extend([total.producer, p.producer, p.producer.args[0].producer,
                     p.producer.args[0].producer.args[1].producer])
        return x, False, total
    safe = None
    if _op(p) == "where":
        where = p.producer
        cond, fill, p = where.args
        rows, zero = _all_minus_inf(cond), _zero(fill)
        if rows is None or zero is None or not isinstance(p, Value):
            return None
        safe = (rows[0], rows[1] + zero + [where])
        p = _back(p, seen, {"to_dtype", "copy"})
    if _op(p) != "div":
        return None
    div = p.producer
    e, total = div.args[0], div.args[1]
    if _op(e) != "exp" or _op(total) != "sum" or total.producer.args[0] is not e:
        return None
    dims = list(total.producer.args[1])
    if dims not in ([-1], [len(_shape(e)) - 1]):
        return None
    x = _exp_shifted(e)
    if x is None or (safe is not None and safe[0] is not x):
        return None
    sub = e.producer.args[0]
    seen.extend([div, total.producer, e.producer, sub.producer, sub.producer.args[1].producer])
    seen.extend(safe[1] if safe is not None else ())
    return x, safe is not None, None


def _exp_shifted(e: Value) -> Value | None:
    """``x`` where ``e`` is ``exp(x - amax(x))``."""
    sub = e.producer.args[0]
    if _op(sub) != "sub" or _op(sub.producer.args[1]) != "amax":
        return None
    x = sub.producer.args[0]
    return x if sub.producer.args[1].producer.args[0] is x else None


def _data_arg(n: Node, depth: int = 24) -> Value | None:
    """The score operand of a node on the chain from the scores to the softmax: ``where``'s non-fill side, the
    side of an ``add`` that leads back to a matmul (``mask + scores`` as well as ``scores + mask``), else the
    first argument. ``depth``: how far back an ``add``'s sides are followed."""
    if n.op.name == "where":
        a = n.args[2] if _scalar(n.args[1]) is not None else n.args[1]
    elif n.op.name == "add" and len(n.args) == 2 and isinstance(n.args[1], Value) \
            and not _leads_to_matmul(n.args[0], depth) and _leads_to_matmul(n.args[1], depth):
        a = n.args[1]
    else:
        a = n.args[0] if n.args else None
    return a if isinstance(a, Value) else None


def _leads_to_matmul(v: Any, depth: int) -> bool:
    """Whether ``v`` is a matmul's output followed forward through at most ``depth`` nodes of a score chain."""
    while depth > 0 and isinstance(v, Value) and v.producer is not None:
        if v.producer.op.name == "matmul":
            return True
        depth -= 1
        v = _data_arg(v.producer, depth)
    return False


def _scores(x: Value, s: Value, seen: list[Node], pre: float = 1.0, terms: Sequence[list] = ()) -> dict | None:
    """The chain from the raw scores ``s`` to the softmax input ``x``: scale, soft-cap, mask. ``pre``: a factor
    the scores already have, ``terms``: tensors already added to them, each ``[value, factor, the shape of the
    scores it is added to]`` (``baddbmm``'s). Additive masks are collected as such terms, scaled by the factors
    that follow them (no soft-cap then); ``mask_value`` is set where there is one term, added unscaled."""
    steps: list[tuple[Node, Value]] = []     # each node from the softmax input back, with its score operand
    y = x
    while y is not s:
        if y.producer is None:
            return None
        data = _data_arg(y.producer)
        if data is None:
            return None
        steps.append((y.producer, data))
        y = data
    chain = [n for n, _ in steps]
    post, cap_seen, out = 1.0, False, {"mask": "none"}
    terms = [list(t) for t in terms]
    for n, data in reversed(steps):
        name = n.op.name
        a1 = n.args[1] if len(n.args) > 1 else None
        if name == "add" and a1 is data:           # mask + scores: the mask is the first argument
            a1 = n.args[0]
        if name == "to_dtype" or name == "copy":
            pass
        elif name in _LAYOUT:          # between adds only a plain view (BLOOM's folded heads viewed as (b, h, ·, ·))
            if _shape(n.outputs[0])[-1:] != _shape(n.args[0])[-1:] or not _is_view_of(n.args[0], [n], n.outputs[0]):
                return None
        elif name in ("mul", "div") and _scalar(a1) is not None and out["mask"] in ("none", "additive") \
                and not (cap_seen and terms):
            f = _scalar(a1) if name == "mul" else 1.0 / _scalar(a1)
            if cap_seen:
                post *= f
            else:
                pre *= f
                for t in terms:
                    t[1] *= f
        elif name == "tanh" and not cap_seen and not terms and out["mask"] == "none":
            cap_seen = True
        elif name == "add" and isinstance(a1, Value) and out["mask"] in ("none", "additive") \
                and len(n.args) == 2 and not n.kwargs:
            terms.append([a1, 1.0, _shape(n.outputs[0])])
            out["mask"] = "additive"
        elif name == "where" and out["mask"] == "none" and not terms and isinstance(n.args[0], Value):
            m = n.args[0]
            if m.meta is None or m.meta.dtype is not torch.bool:
                return None
            if _scalar(n.args[1]) is None:         # where(keep, s, fill)
                fill, keep = _scalar(n.args[2]), True
            else:                                  # where(masked, fill, s): masked_fill
                fill, keep = _scalar(n.args[1]), False
            if fill is None:
                return None
            fill_arg = n.args[2] if keep else n.args[1]
            if isinstance(fill_arg, Value):        # a full() constant: part of the region
                chain.append(fill_arg.producer)
            out.update(mask="bool" if keep else "bool_inverted", mask_value=m, bool_fill=fill)
        else:
            return None
    seen.extend(chain)
    if terms:
        out["mask"] = "additive"
        if len(terms) == 1 and terms[0][1] == 1.0:
            out["mask_value"] = terms[0][0]
    out["terms"] = [tuple(t) for t in terms]
    if cap_seen:
        out.update(softcap=post, scale=pre * post)
    else:
        out.update(softcap=None, scale=pre)
    return out


def _mask_structure(mask: Value, values: dict | None) -> str:
    """What the mask's value property shows: ``causal`` (a triangle on the last two dims), ``window(w)``."""
    if values is None:
        return ""
    p = values.get(id(mask))
    if p is None or not p.known or p.expr is None:
        return ""
    terms = dict(p.expr.terms)
    if p.is_triangle and set(terms) == {-1, -2}:
        return "causal" if p.expr.const in (0, -1) else f"diagonal({p.expr.const})"
    return str(p)


_BAND_PASS = {"view", "expand", "unsqueeze", "to_dtype", "copy", "slice", "squeeze"}
_AND = {"bitwise_and", "logical_and", "mul"}
_OR = {"bitwise_or", "logical_or"}
_NOT = {"bitwise_not", "logical_not"}


def _is_floor(x: Any) -> bool:
    """A masked score: exp of it (minus a row max) is 0 in fp32 — fp16's finfo.min (HF masks) and below."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x <= -6e4


def _visible_preds(v: Value, values: dict, keep: bool, depth: int = 0) -> list | None:
    """Affine predicates ``e(i, j) >= 0`` (dims from the right: -1 key, -2 query) that every visible score of
    mask ``v`` satisfies: ``keep`` — a bool mask True where visible (else True where masked), or an additive
    mask (``keep`` True) whose masked part is a constant at or below -1e30. Read off the value properties, through
    ``&`` / ``|`` / ``~``, ``where`` with constant sides and layout ops keeping the last two dims; None where the
    visible part is not exactly such a conjunction (a padding mask joined in: then a row may be fully masked, where
    eager's answer depends on every key)."""

    if depth > 16 or not isinstance(v, Value):
        return None
    p = values.get(id(v))
    is_bool = v.meta is not None and v.meta.dtype is torch.bool
    if p is not None and p.is_constant and is_bool and p.fill == keep:   # keeps every score (HF's ``ones & ...``)
        return []
    if p is not None and p.known and p.expr is not None:
        if p.kind is ValueKind.MASK and is_bool:
            return [p.expr if keep else p.expr.scaled(-1).plus(Affine((), -1))]
        if p.kind is ValueKind.PIECEWISE and not is_bool:
            for side in (p.inside, p.outside):
                if side is not None and side.is_constant and _is_floor(side.fill):
                    masked = p.constant_where(side.fill)          # masked where masked >= 0
                    if masked is not None:
                        return [masked.scaled(-1).plus(Affine((), -1))]
    n = v.producer
    if n is None:
        return None
    name = n.op.name
    if name in _BAND_PASS and isinstance(n.args[0], Value) and (_shape(n.args[0]) or ())[-2:] == _shape(v)[-2:]:
        return _visible_preds(n.args[0], values, keep, depth + 1)
    if name in _NOT and is_bool:
        return _visible_preds(n.args[0], values, not keep, depth + 1)
    if is_bool and ((name in _AND and keep) or (name in _OR and not keep)):
        parts = [_visible_preds(a, values, keep, depth + 1) for a in n.args[:2]]
        return None if None in parts else [e for x in parts for e in x]
    if name == "where" and not is_bool and len(n.args) == 3:
        a, b = _scalar(n.args[1]), _scalar(n.args[2])
        if a == 0.0 and _is_floor(b):
            return _visible_preds(n.args[0], values, True, depth + 1)
        if _is_floor(a) and b == 0.0:
            return _visible_preds(n.args[0], values, False, depth + 1)
    return None


def _visible_zero(v: Value, values: dict, depth: int = 0) -> bool:
    """Whether an additive mask is 0 wherever it is not at its masked floor (HF's ``where(keep, 0, min)``)."""

    if depth > 16 or not isinstance(v, Value):
        return False
    p = values.get(id(v))
    if p is not None and p.kind is ValueKind.PIECEWISE:
        sides = [x for x in (p.inside, p.outside) if x is not None and x.is_constant]
        if len(sides) == 2 and {(_is_floor(x.fill), x.fill == 0) for x in sides} == {(True, False), (False, True)}:
            return True
    n = v.producer
    if n is None:
        return False
    if n.op.name in _BAND_PASS and isinstance(n.args[0], Value):
        return _visible_zero(n.args[0], values, depth + 1)
    if n.op.name == "where" and len(n.args) == 3:
        a, b = _scalar(n.args[1]), _scalar(n.args[2])
        return (a == 0.0 and _is_floor(b)) or (_is_floor(a) and b == 0.0)
    return False


def _mask_band(mask: Value, values: dict | None, kind: str, sq: int, skv: int) -> tuple | None:
    """The (offset, window) band of :attr:`AttentionSpec.mask_band` read off the mask's value properties: the
    mask is exactly ``j <= i + offset`` (and ``j > i + offset - window``) and every query row sees a key (so the
    skipped tiles are ones eager gives weight 0)."""
    if values is None or len(_shape(mask) or ()) < 2 or _shape(mask)[-2] != sq:
        return None
    preds = _visible_preds(mask, values, kind != "bool_inverted")
    if not preds:
        return None
    hi = lo = None
    for e in preds:
        t = dict(e.terms)
        if t == {-1: -1, -2: 1}:                   # i - j + c >= 0: j <= i + c
            hi = e.const if hi is None else min(hi, e.const)
        elif t == {-1: 1, -2: -1}:                 # j - i + c >= 0: j >= i - c
            lo = -e.const if lo is None else max(lo, -e.const)
        else:
            return None
    if hi is None or hi < 0:                       # row 0 sees no key
        return None
    window = None if lo is None else hi - lo + 1   # j > i + hi - window  <=>  j >= i + lo
    if window is not None and (window < 1 or sq - 1 + lo > skv - 1):   # a row whose window holds no key
        return None
    return hi, window


_COLUMN_PASS = {"to_dtype", "copy", "permute", "expand"}


def _column_reduction(user: Node, p: Value, outputs: set[int]) -> ColumnReduction | None:
    """The reduction of P over the query axis that starts at ``user`` (a reader of ``p``), through casts,
    permutes and no-op expands whose results nothing else reads, to a ``sum`` / ``mean``; None otherwise."""
    nodes: list[Node] = []
    order, x, n = list(range(4)), p, user
    while n.op.name not in ("sum", "mean"):
        if n.op.name not in _COLUMN_PASS or n.args[0] is not x:
            return None
        y = n.outputs[0]
        if n.op.name == "expand" and _shape(y) != _shape(x):
            return None
        if n.op.name == "permute":
            order = [order[i % 4] for i in n.args[1]]
        nodes.append(n)
        x = y
        if id(x) in outputs or len(x.users) != 1:
            return None
        n = x.users[0]
    dims = n.args[1] if len(n.args) > 1 else None
    if n.args[0] is not x or not dims or len(n.outputs) != 1:
        return None
    dims = tuple(sorted({int(d) % 4 for d in dims}))
    logical = {order[d] for d in dims}
    if 2 not in logical or 3 in logical:
        return None
    keepdim = bool(n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False))
    factor = 1.0 / math.prod(_shape(x)[d] for d in dims) if n.op.name == "mean" else 1.0
    return ColumnReduction(n.outputs[0], nodes + [n], tuple(order), dims, keepdim, factor, n.outputs[0].meta.dtype)


def _column_reductions(spec: AttentionSpec, outputs: set[int]) -> list[ColumnReduction]:
    """The readers of the region's P outside it that reduce P over the query axis."""
    inside = {id(n) for n in spec.nodes}
    found = []
    for p in spec.probs:
        for u in p.users:
            if id(u) not in inside and (r := _column_reduction(u, p, outputs)) is not None:
                found.append(r)
    return found


def _eager_at(pv: Node, values: dict | None, stop: frozenset = frozenset()) -> AttentionSpec | None:
    """The eager attention whose ``P·V`` bmm is ``pv``; Q, K and V followed back no further than ``stop``."""
    seen: list[Node] = [pv]
    bias, p_in, v_in = matmul_operands(pv)
    if bias is not None or len(_shape(p_in) or ()) != 3:
        return None
    p = _viewed_back(p_in, seen)              # P (b, h, sq, skv) or (b·h, sq, skv), however it was flattened
    softmax = _softmax_input(p, seen)
    if softmax is None:
        return None
    x, empty_rows_zero, late_sum = softmax
    # the raw scores: x followed back through the chain (scale, soft-cap, mask, casts) to the Q·Kᵀ bmm
    path, y = [x], x
    while y.producer is not None and y.producer.op.name != "matmul" and len(path) < 24:
        y = _data_arg(y.producer)
        if y is None:
            return None
        path.append(y)
    qk = y.producer
    if qk is None or qk.op.name != "matmul" or len(_shape(y) or ()) != 3:
        return None
    bias, q_in, k_in = matmul_operands(qk)
    pre, terms = 1.0, []                    # baddbmm(bias, Q, Kᵀ, beta, alpha): alpha·Q·Kᵀ + beta·bias
    if bias is not None:
        bound = bind_args(qk)
        beta, alpha = _scalar(bound.get("beta", 1)), _scalar(bound.get("alpha", 1))
        if beta is None or alpha is None:
            return None
        pre = alpha
        # beta 0 ignores the bias (Megatron's preallocated ``empty`` scores); a zero fill adds nothing: either
        # way no mask, and a buffer made only for this joins the region (dead once it runs)
        made_here = bias.producer is not None and len(bias.users) == 1 and not bias.producer.inputs
        if beta != 0 and not (made_here and _zero(bias) is not None):
            terms = [[bias, beta, _shape(y)]]
        elif made_here:
            seen.append(bias.producer)
    # Q one head per bmm batch where some 4-D tensor on the way is so read (a decode step's reshape of its query
    # heads into (b, hk, g, d) is then read as g query rows per KV head), else packed per KV head
    q = _operand(q_in, seen, False, query="per_head", stop=stop) or \
        _operand(q_in, seen, False, query="packed", stop=stop)
    k = _operand(k_in, seen, True, stop=stop)
    vv = _operand(v_in, seen, False, stop=stop)
    if q is None or k is None or vv is None or vv[1] != 1.0:
        return None
    (qv, qf), (kv, kf), vv = q, k, vv[0]
    b, h, sq, d = _shape(qv)
    _, hk, skv, dk = _shape(kv)
    dv = _shape(vv)[-1]
    # the bmm's batch: one per query head, or one per KV head with its group's rows packed (then Kᵀ and V are
    # read once per KV head)
    if dk != d or _shape(vv) != (b, hk, skv, dv) or _shape(kv)[0] != b or h % hk or \
            _shape(y)[:2] not in ((b * h, sq), (b * hk, h // hk * sq)) or \
            len({qv.meta.dtype, kv.meta.dtype, vv.meta.dtype}) != 1:   # casts followed back: one dtype read
        return None
    # the scores as the softmax's chain reads them: the bmm's own, or a plain row-major view of them through
    # layout ops alone (an einsum's 5-D view and permute back to (b, h, sq, skv))
    prefix, s_raw = [], y
    for value in reversed(path[:-1]):
        if value.producer.op.name not in _LAYOUT:
            break
        prefix.append(value.producer)
        s_raw = value
    if s_raw is not y and not (_shape(s_raw)[-1] == skv and _is_view_of(y, prefix, s_raw)):
        return None
    scores = _scores(x, s_raw, seen, pre, terms)
    if scores is None:
        return None
    mask_terms = []
    for value, factor, space in scores["terms"]:
        shape = _term_shape(_shape(value), space, b, h, hk, sq, skv)
        if shape is None:                      # a mask broadcast over packed heads: not read
            return None
        mask_terms.append(MaskTerm(value, factor, shape))
    if len(mask_terms) == 1 and scores.get("mask_value") is not None and scores["terms"][0][2] == (b, h, sq, skv):
        mask_terms = []                        # one tensor added as it is: the mask is that value
    seen.extend(prefix + [qk])
    # the output: (b·h, sq, dv) as (b, h, sq, dv), through layout ops that only view it
    out = _viewed_forward(pv.outputs[0], seen, (b, h, sq, dv))
    if out is None:
        return None
    if late_sum is not None:             # (exp(x - m) · V) / sum(exp(x - m)): the division after P·V
        norm = out.users[0] if len(out.users) == 1 else None
        if norm is None or norm.op.name != "div" or norm.args[0] is not out or norm.args[1] is not late_sum \
                or _shape(late_sum) != (b, h, sq, 1):
            return None
        seen.append(norm)
        out = norm.outputs[0]
    if out.meta.dtype != qv.meta.dtype:   # SDPA's math path: fp32 P·V, cast back to the inputs' dtype
        cast = out.users[0] if len(out.users) == 1 else None
        if cast is None or cast.op.name != "to_dtype" or cast.outputs[0].meta.dtype != qv.meta.dtype:
            return None
        seen.append(cast)
        out = cast.outputs[0]
    mask_value = scores.get("mask_value")
    inner = {id(n) for n in seen}              # a mask computed by the region itself (``s + s``) is no mask
    if any(m is not None and m.producer is not None and id(m.producer) in inner
           for m in [mask_value] + [t.value for t in mask_terms]):
        return None
    if mask_terms:                             # the band is read off a term added to the (b, h, sq, skv) scores
        banded = [t for t in mask_terms if len(_shape(t.value)) == 4 and t.shape == _shape(t.value)
                  and _mask_band(t.value, values, "additive", sq, skv) is not None]
        mask_value = (banded or mask_terms)[0].value
    spec = AttentionSpec(b, h, hk, sq, skv, d, scores["scale"] * qf * kf, scores["softcap"],
                         scores["mask"], "", mask_value, scores.get("bool_fill"), qv.meta.dtype, "eager",
                         qv, kv, vv, out, seen)
    spec.empty_rows_zero = empty_rows_zero
    spec.dv = dv if dv != d else None
    spec.probs, y = (), p_in                  # P from P·V's operand back to the softmax's div
    while late_sum is None:                   # (late normalisation: P itself is never formed)
        if _shape(y) == (b, h, sq, skv):
            spec.probs += (y,)
        if _op(y) == "div":
            break
        y = y.producer.args[2 if _op(y) == "where" else 0]
    exps = late_sum.producer.args[0] if late_sum is not None else y.producer.args[0]
    spec.row_stats = (exps.producer.args[0].producer.args[1], late_sum if late_sum is not None else y.producer.args[1])
    spec.mask_terms = tuple(mask_terms)
    if mask_value is not None:
        ms = spec.mask_shape
        if len(_shape(mask_value)) > 4 or any(a not in (1, e) for a, e in zip(ms, (b, h, sq, skv))):
            return None
        spec.mask_structure = _mask_structure(mask_value, values)
        spec.mask_band = _mask_band(mask_value, values, spec.mask, sq, skv)
        spec.mask_zero_visible = spec.mask_band is not None and not mask_terms and (
            spec.mask != "additive" or _visible_zero(mask_value, values))
        if len(mask_terms) > 1:
            spec.mask_term = (banded or mask_terms)[0]
            spec.bias_terms = tuple(t for t in mask_terms if t is not spec.mask_term)
            spec.band_term_exact = bool(banded) and spec.mask_band is not None and spec.mask_term.factor == 1.0 \
                and _visible_zero(mask_value, values)
    return spec


def _term_shape(shape: tuple, space: tuple, b: int, h: int, hk: int, sq: int, skv: int) -> tuple | None:
    """The 4-D shape (broadcast to (b, h, sq, skv)) of a tensor of ``shape`` added to scores of shape ``space``:
    (b, h, sq, skv) itself; with the heads folded into the batch, (b·h, sq, skv), its first dim split into (b, h);
    with a KV head's query heads packed into its rows, (b·hk, g·sq, skv), only a tensor of one entry per score row
    (a row-major view of (b, h, sq, ·)); None for any other (a packed tensor broadcast over heads or rows)."""
    if len(shape) > len(space) or any(a not in (1, e) for a, e in zip(shape[::-1], space[::-1])):
        return None
    full = (1,) * (len(space) - len(shape)) + tuple(shape)
    if space == (b, h, sq, skv):
        return full
    if space == (b * h, sq, skv):
        return ((b, h) if full[0] == b * h else (1, 1)) + full[1:]
    if space == (b * hk, h // hk * sq, skv) and full[:2] == space[:2]:
        return (b, h, sq, full[2])
    return None


def _bind(node: Node, names: Sequence[str | None]) -> dict:
    got = dict(node.kwargs)
    for name, a in zip(names, node.args[3:]):
        if name is not None:
            got.setdefault(name, a)
    return got


def _bool_behind(mask: Value) -> tuple[Value, str, float, list[Node]] | None:
    """An additive mask that is ``where(keep, 0, fill)`` (or ``where(masked, fill, 0)``) of a bool tensor — what
    SDPA's decomposition traces for a bool ``attn_mask``: ``(the bool, "bool" | "bool_inverted", fill, the nodes
    that build the additive mask for this use alone)``, else None. The builders join the region (dead once the
    kernels read the bool) only where nothing else reads them; an additive mask shared with other ops stays."""
    n = mask.producer
    if _op(mask) != "where" or not isinstance(n.args[0], Value) or n.args[0].meta is None \
            or n.args[0].meta.dtype is not torch.bool:
        return None
    a, b = _scalar(n.args[1]), _scalar(n.args[2])
    if a == 0.0 and b is not None:
        kind, fill = "bool", b
    elif b == 0.0 and a is not None:
        kind, fill = "bool_inverted", a
    else:
        return None
    builders = []
    if len(mask.users) == 1:
        builders = [x.producer for x in n.args[1:] if isinstance(x, Value) and len(x.users) == 1] + [n]
    return n.args[0], kind, fill, builders


def _sdpa_at(node: Node, values: dict | None, read_bool: bool = True,
             stop: frozenset = frozenset()) -> AttentionSpec | None:
    """The attention of an SDPA ATen op (its first output; the others must be unread). ``read_bool``: a mask
    traced from a bool one is read as that bool (:func:`_bool_behind`), else as the additive mask it is. K and V
    are followed back through the ops that repeat (or copy) their heads, which join the region, not past the
    values of ``stop``."""
    names = SDPA_TARGETS.get(node.target_name)
    if names is None:
        return None
    q, k, v = node.args[:3]
    if not all(len(_shape(t) or ()) == 4 for t in (q, k, v)):
        return None
    kw = _bind(node, names)
    mask = kw.get("attn_mask", kw.get("attn_bias"))
    if float(kw.get("dropout_p", 0.0) or 0.0) != 0.0:
        return None
    if any(o.users for o in node.outputs[1:]):
        return None
    repeats: list[Node] = []        # HF's repeat_kv before SDPA (with a mask it does not pass enable_gqa): read
    # the KV heads themselves, no copy per query head
    k0, v0 = _unrepeat(k, repeats, stop), _unrepeat(v, repeats, stop)
    if k0 is k or v0 is v or _shape(k0)[:3] != _shape(v0)[:3]:
        k0, v0, repeats = k, v, []
    b, h, sq, d = _shape(q)
    _, hk, skv, _ = _shape(k0)
    dv = _shape(v0)[-1]
    if _shape(k0)[0] != b or _shape(v0)[:3] != _shape(k0)[:3] or h % hk or _shape(k0)[-1] != d:
        return None
    scale = kw.get("scale")
    spec = AttentionSpec(b, h, hk, sq, skv, d, float(scale) if scale is not None else 1.0 / math.sqrt(d),
                         dtype=q.meta.dtype, form=node.target_name.split(".")[1], q=q, k=k0, v=v0,
                         output=node.outputs[0], nodes=repeats + [node], dv=dv if dv != d else None)
    if kw.get("is_causal"):
        if mask is not None:
            return None
        spec.mask, spec.mask_structure, spec.mask_band, spec.mask_zero_visible = "causal", "causal", (0, None), True
    elif isinstance(mask, Value) and not _hides_nothing(mask, values):
        spec.mask = "bool" if mask.meta.dtype is torch.bool else "additive"
        if read_bool and (behind := _bool_behind(mask)) is not None:   # SDPA's bool -> additive conversion
            mask, spec.mask, spec.bool_fill, builders = behind
            spec.nodes = builders + spec.nodes
        elif spec.mask == "bool":
            spec.bool_fill = float("-inf")
        spec.mask_value = mask
        spec.mask_structure = _mask_structure(mask, values)
        spec.mask_band = _mask_band(mask, values, spec.mask, sq, skv)
        spec.mask_zero_visible = spec.mask_band is not None and (
            spec.mask != "additive" or _visible_zero(mask, values))
    return spec


def _hides_nothing(mask: Value, values: dict | None) -> bool:
    """Whether the mask's value property says it is all True (bool) or all 0 (additive): the region is then
    unmasked (transformers 5.17 passes BERT's all-ones padding mask to SDPA as such a bool mask)."""
    p = values.get(id(mask)) if values is not None else None
    if p is None or not p.is_constant:
        return False
    return p.fill is True if mask.meta.dtype is torch.bool else p.fill == 0 and not isinstance(p.fill, bool)


def find_attention(graph: Graph, nodes: Sequence[Node] | None = None,
                   values: dict | None = None) -> list[AttentionSpec]:
    """Every attention region among ``nodes`` (default: the whole graph) whose inner values nothing else reads.
    ``values``: the graph's value properties (the analyse stage's), else computed here when a mask needs them."""

    class _Values(dict):
        """The graph's value properties, computed on the first look-up (only masked regions need them)."""
        ready = False

        def get(self, key, default=None):
            if not self.ready:
                self.ready = True
                try:
                    self.update(analyze_values(graph.nodes))
                except Exception:   # a value analysis that fails only loses the mask's structure
                    pass
            return super().get(key, default)

    values = _Values() if values is None else values
    pool = list(graph.nodes if nodes is None else nodes)
    allowed = {id(n) for n in pool}
    outputs = {id(v) for v in graph.output_values}
    found: list[AttentionSpec] = []
    taken: set[int] = set()
    for n in pool:
        if id(n) in taken:
            continue
        # an SDPA op whose traced bool -> additive mask nodes are not free (another claim holds them): again,
        # reading the additive mask
        for read_bool in ((True, False) if n.target_name in SDPA_TARGETS else (True,)):
            spec = _region_at(n, values, read_bool, graph, allowed, taken, outputs)
            if spec is not None:
                taken |= {id(x) for x in spec.nodes}
                found.append(spec)
                break
    return found


def _region_at(n: Node, values, read_bool: bool, graph: Graph, allowed: set, taken: set, outputs: set
               ) -> AttentionSpec | None:
    """:func:`find_attention`'s attention at ``n`` with its column reductions, where all its nodes are free and
    none of its inner values is read outside; else None. Where values that Q, K or V were followed back through
    leave the region — a cache keeps the contiguous K and V that a ``contiguous`` or HF's ``repeat_kv`` made
    (transformers' DynamicCache) — the attention is read again, stopping at those values: the region reads them."""
    spec, leaks = _region_once(n, values, read_bool, graph, allowed, taken, outputs)
    if spec is None and leaks:
        spec, _ = _region_once(n, values, read_bool, graph, allowed, taken, outputs, leaks)
    return spec


def _region_once(n: Node, values, read_bool: bool, graph: Graph, allowed: set, taken: set, outputs: set,
                 stop: frozenset = frozenset()) -> tuple[AttentionSpec | None, frozenset]:
    """:func:`_region_at` once, Q, K and V followed back no further than the values of ``stop``: the spec, or None
    and the inner values read outside the region (empty where something else failed)."""
    try:
        spec = _sdpa_at(n, values, read_bool, stop) if n.target_name in SDPA_TARGETS else (
            _eager_at(n, values, stop) if n.op.name == "matmul" else None)
    except (AttributeError, IndexError, TypeError, ValueError):   # a shape this analysis does not read
        spec = None
    if spec is None:
        return None, frozenset()
    spec.nodes = list({id(x): x for x in spec.nodes}.values())
    spec.extra_outputs = tuple(r for r in _column_reductions(spec, outputs)
                               if all(id(x) in allowed and id(x) not in taken for x in r.nodes))
    spec.nodes += [x for r in spec.extra_outputs for x in r.nodes]
    ids = {id(x) for x in spec.nodes}
    if not ids <= allowed or ids & taken:
        return None, frozenset()
    leaving = {id(spec.output)} | {id(r.value) for r in spec.extra_outputs}
    leaks = frozenset(id(w) for x in spec.nodes for w in x.outputs
                      if id(w) not in leaving and (id(w) in outputs or any(id(u) not in ids for u in w.users)))
    if leaks:
        return None, leaks
    order = graph.positions()
    spec.nodes.sort(key=lambda x: order[id(x)])
    return spec, frozenset()
