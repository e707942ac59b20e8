"""Goal-directed skeletons: the target expression taken apart top-down into block ops (expression-guided search,
read from the target's side).

The DFS of :mod:`.generate` builds block graphs bottom-up and keeps a value when its expression is a subexpression
of the target; a deep target (QK-norm attention: two norms, two weight products, the temperature, Q·Kᵀ, the
online-softmax accumulator and its division: 8 ops over 5 inputs with 4 for-loop choices each) has hundreds of
thousands of admitted states per depth, more than a 30 s budget enumerates. Here the target is split instead:
each rule inverts one block op on normal forms (:mod:`.expr`) and names the operands' expressions as subgoals,

* a softmax ``Σ_n exp(s − max s)·V / Σ_n exp(s − max s)`` → ``div(o, l)`` of ``acc_online_softmax(s, V)``;
* ``Σ_k A·B`` → ``matmul(A, B)`` or ``matmul_t(A, B)`` for every split of the product's factors;
* a product or quotient → ``mul`` / ``div`` of a split; ``c·X`` (``c`` a scale the target multiplies by) →
  ``scalar_mul``; ``X / rms(X)`` → ``rms_norm``; ``f(X)`` → the unary ``f``; an input → its iterator,

memoised per subgoal, keeping the :data:`LIMIT` cheapest trees of each (cost: distinct block ops) per tensor shape:
a tree's ops must fit the whole (untiled) input shapes — abstract expressions do not say which dim a matmul
contracts, shapes do (``Σ_d q·k`` is Q·Kᵀ, not Q·K). A tree becomes a
:class:`~.generate.Skeleton` by choosing each iterator's for-loop dim where it is first read (shapes checked op by op
on the generator's probe schedule, the accumulator discipline of Def. 2.1 (3) kept); a skeleton is yielded only if
its replayed expression *is* the target, so a sloppy inverse costs a candidate, never a wrong answer — and every
skeleton is still probed and verified by the driver like the DFS's. The rules cover the ops of attention and its
prologues (norms, weights, scales); a target they do not take apart yields nothing and the DFS runs.
"""
from __future__ import annotations

import itertools
from typing import Iterator, NamedTuple, Sequence

from ...ugraph import Ctx, MuGraphError, Ref, make_op
from . import expr as E
from .generate import VALUE_OUTPUTS, Skeleton, SkelOp, to_kernel_graph

LIMIT = 16          # cheapest trees kept per subgoal
MAX_SPLIT = 10      # factors of a product split at most (2^10 splits)


class Node(NamedTuple):
    """A tree of block ops: ``kind`` "iter" (``attrs`` the input index) or a skeleton op kind; ``out``: which value
    of a multi-value op (acc_online_softmax: 0 = its sum l, 1 = its output o)."""
    kind: str
    attrs: tuple
    inputs: tuple
    out: int = 0

    @property
    def op_id(self) -> tuple:
        return (self.kind, self.attrs, self.inputs)


def _ops(node: Node, memo: dict) -> frozenset:
    got = memo.get(node)
    if got is None:
        got = frozenset() if node.kind == "iter" else \
            frozenset({node.op_id}).union(*(_ops(a, memo) for a in node.inputs))
        memo[node] = got
    return got


def _parts(e: E.Expr) -> tuple[int, tuple, tuple]:
    """``e`` as (outer sum size, numerator factors, denominator factors)."""
    size = 1
    if e.op == "sum":
        size, e = e.attr, e.args[0]
    num, den = (e.args[0], e.args[1]) if e.op == "div" else (e, None)
    nums = num.args if num.op == "mul" else (num,)
    dens = () if den is None else (den.args if den.op == "mul" else (den,))
    return size, tuple(nums), tuple(dens)


def _build(size: int, nums: Sequence, dens: Sequence) -> E.Expr:
    x = E.mul(*nums) if nums else E.ONE
    return E.sum_(size, E.div(x, E.mul(*dens)) if dens else x)


def _has_leaf(nums: Sequence) -> bool:
    return any(f.op != "const" for f in nums)


class Decomposer:
    """Top-down decompositions of a target over kernel inputs ``inputs`` ((shape, dtype) each) into trees of
    block ops (see the module docstring)."""

    def __init__(self, inputs: Sequence, kinds: Sequence[str], scale_values: Sequence[float] = (),
                 eps_values: Sequence[float] = ()):
        self.inputs = [(tuple(s), d) for s, d in inputs]
        self.kinds = set(kinds)
        self.scales = {E.const(v): float(v) for v in scale_values}
        self.eps = {E.const(v): float(v) for v in eps_values}
        self.memo: dict = {}
        self.cost_memo: dict = {}
        self.shape_memo: dict = {}

    def cost(self, node: Node) -> int:
        return len(_ops(node, self.cost_memo))

    def shape(self, node: Node):
        """The tree's shape on the whole inputs (one block, one for-loop step), None when an op does not fit."""
        if node in self.shape_memo:
            return self.shape_memo[node]
        out = None
        if node.kind == "iter":
            out = self.inputs[node.attrs][0]
        else:
            sh = [self.shape(a) for a in node.inputs]
            if all(x is not None for x in sh):
                out = _fit(node.kind, node.attrs, sh, self.inputs[0][1], Ctx((1,), 1))
                out = None if out is None else out[VALUE_OUTPUTS.get(node.kind, (0,))[node.out]]
        self.shape_memo[node] = out
        return out

    def ways(self, e: E.Expr) -> list[Node]:
        """The cheapest trees computing ``e`` (at most :data:`LIMIT`), [] when the rules do not reach it."""
        got = self.memo.get(e)
        if got is not None:
            return got
        self.memo[e] = []                   # a goal met again inside itself has no tree (no cycles)
        by_shape: dict = {}
        for t in dict.fromkeys(self._ways(e)):
            sh = self.shape(t)
            if sh is not None:
                by_shape.setdefault(sh, []).append(t)
        got = [t for ts in by_shape.values() for t in sorted(ts, key=lambda t: (self.cost(t), str(t)))[:LIMIT]]
        self.memo[e] = got = sorted(got, key=lambda t: (self.cost(t), str(t)))
        return got

    def _ways(self, e: E.Expr) -> list[Node]:
        if e.op == "var":
            return [Node("iter", e.attr, ())]
        out: list[Node] = []
        sm = self._softmax(e)
        if sm is not None:
            s, v = sm
            for a, b in itertools.product(self.ways(s), self.ways(v)):
                acc = ("acc_online_softmax", (), (a, b))
                out.append(Node("div", (), (Node(*acc, out=1), Node(*acc, out=0))))
            return out
        if e.op == "fn":
            if e.attr in self.kinds:
                out += [Node(e.attr, (), (t,)) for t in self.ways(e.args[0])]
            return out
        size, nums, dens = _parts(e)
        for c in nums:
            if c in self.scales and "scalar_mul" in self.kinds:
                rest = list(nums)
                rest.remove(c)
                if _has_leaf(rest):
                    out += [Node("scalar_mul", (("value", self.scales[c]),), (t,))
                            for t in self.ways(_build(size, rest, dens))]
        if size == 1 and "rms_norm" in self.kinds:
            out += self._rms_norm(e, nums, dens)
        factors = [(f, 0) for f in nums] + [(f, 1) for f in dens]
        if 2 <= len(factors) <= MAX_SPLIT:
            seen = set()
            for mask in range(1, (1 << len(factors)) - 1):
                a = [factors[k] for k in range(len(factors)) if mask >> k & 1]
                b = [factors[k] for k in range(len(factors)) if not mask >> k & 1]
                an, ad = [f for f, d in a if not d], [f for f, d in a if d]
                bn, bd = [f for f, d in b if not d], [f for f, d in b if d]
                if size > 1:
                    if _has_leaf(an) and _has_leaf(bn):
                        pair = (_build(1, an, ad), _build(1, bn, bd))
                        if pair not in seen:
                            seen.add(pair)
                            out += self._binary(("matmul", "matmul_t"), *pair)
                    continue
                if _has_leaf(an) and _has_leaf(bn):          # mul(A, B): once per unordered pair
                    pair = tuple(sorted((_build(1, an, ad), _build(1, bn, bd))))
                    if pair not in seen:
                        seen.add(pair)
                        out += self._binary(("mul",), *pair)
                if _has_leaf(an) and not bn and bd:                 # div(A, B): B a product of denominators
                    pair = ("div", _build(1, an, ad), _build(1, bd, ()))
                    if pair not in seen:
                        seen.add(pair)
                        out += self._binary(("div",), *pair[1:])
        return out

    def _binary(self, kinds, a: E.Expr, b: E.Expr) -> list[Node]:
        kinds = [k for k in kinds if k in self.kinds]
        if not kinds:
            return []
        wa, wb = self.ways(a), self.ways(b)
        return [Node(k, (), (x, y)) for k in kinds for x in wa for y in wb]

    def _rms_norm(self, e: E.Expr, nums, dens) -> list[Node]:
        """``X / sqrt(eps + (1/n)·Σ_n X·X)`` → ``rms_norm(X)``."""
        out = []
        for r in dens:
            if r.op != "fn" or r.attr != "sqrt" or r.args[0].op != "add":
                continue
            terms = r.args[0].args
            eps = [t for t in terms if t.op == "const"]
            rest = [t for t in terms if t.op != "const"]
            if len(rest) != 1 or len(eps) > 1:
                continue
            _, inner_nums, inner_dens = _parts(rest[0])
            sums = [t for t in inner_nums if t.op == "sum"] or ([rest[0]] if rest[0].op == "sum" else [])
            if len(sums) != 1:
                continue
            n, sq = sums[0].attr, sums[0].args[0]
            counts: dict = {}
            for f in (sq.args if sq.op == "mul" else (sq,)):
                if f.op != "const":
                    counts[f] = counts.get(f, 0) + 1
            if not counts or any(c % 2 for c in counts.values()):
                continue
            x = E.mul(*[f for f, c in counts.items() for _ in range(c // 2)])
            eps_v = float(eps[0].attr) if eps else 0.0
            if eps and eps[0] not in self.eps:
                continue
            if E.rms_norm(n, x, eps_v) is e:
                out += [Node("rms_norm", (("eps", self.eps.get(eps[0], eps_v) if eps else 0.0),), (t,))
                        for t in self.ways(x)]
        return out

    def _softmax(self, e: E.Expr):
        """``Σ_n exp(s − max s)·V / Σ_n exp(s − max s)`` → (s, V); None for another shape."""
        if e.op != "sum":
            return None
        n, x = e.attr, e.args[0]
        if x.op != "div" or x.args[1].op != "sum" or x.args[1].attr != n:
            return None
        ex = x.args[1].args[0]
        score = E.softmax_score(ex)
        if score is None or E.softmax_row(ex) != n or "acc_online_softmax" not in self.kinds:
            return None
        num = x.args[0]
        factors = list(num.args if num.op == "mul" else (num,))
        if ex not in factors:
            return None
        factors.remove(ex)
        if not _has_leaf(factors):
            return None
        return score, E.mul(*factors)


# ------------------------------------------------------------------ trees -> skeletons
def _fit(kind: str, attrs: tuple, sh: list, dtype: str, ctx: Ctx) -> tuple | None:
    """The output shapes of a skeleton op on operand shapes ``sh`` (None when they do not fit)."""
    dt = [dtype] * len(sh)
    try:
        if kind == "matmul_t":
            t = make_op("transpose", [Ref(0)], [sh[1]], [dt[1]], ctx=ctx)
            return make_op("matmul", [Ref(0), Ref(1)], [sh[0], t.shapes[0]], dt, ctx=ctx).shapes
        return make_op(kind, [Ref(j) for j in range(len(sh))], sh, dt, dict(attrs), ctx=ctx).shapes
    except MuGraphError:
        return None


def loop_ops(skel: Skeleton) -> int:
    """Body ops that run at every for-loop step: those reading, directly or not, an iterator with a for-loop dim
    (before the accumulator); the rest is hoisted out of the loop or runs once after it."""
    walked = [f is not None for f in skel.fmaps]
    n = 0
    for op in skel.ops:
        w = not op.kind.startswith("acc_") and any(walked[i] for i in op.inputs)
        n += w
        walked += [w] * len(VALUE_OUTPUTS.get(op.kind, (0,)))
    return n


def skeletons(targets: Sequence[E.Expr], inputs: Sequence, out_shapes: Sequence, *, kinds: Sequence[str],
              probe_range: int, scale_values: Sequence[float] = (), eps_values: Sequence[float] = (),
              max_ops: int = 8, fmaps_of=None) -> Iterator[Skeleton]:
    """Skeletons whose replayed expression is the (single) target: fewest ops first, then fewest ops in the
    for-loop (:func:`loop_ops`: a temperature on the hoisted Q tile, not on every K tile); nothing for several
    outputs or a target the rules do not take apart."""
    if len(targets) != 1 or len(out_shapes) != 1:
        return
    inputs = [(tuple(s), d) for s, d in inputs]
    dec = Decomposer(inputs, kinds, scale_values, eps_values)
    trees = [t for t in dec.ways(targets[0]) if dec.cost(t) <= max_ops and dec.shape(t) == tuple(out_shapes[0])]
    seen = set()
    for _, group in itertools.groupby(trees, key=dec.cost):
        found = []
        for tree in group:
            for skel in _instantiate(tree, inputs, tuple(out_shapes[0]), probe_range, fmaps_of):
                key = (skel.fmaps, skel.ops)
                if key not in seen:
                    seen.add(key)
                    found.append(skel)
        for skel in sorted(found, key=loop_ops):
            try:
                got = E.graph_exprs(to_kernel_graph(skel, inputs))
            except MuGraphError:
                continue
            if got == list(targets):
                yield skel


def _order(tree: Node) -> list[tuple]:
    """The tree's distinct ops in post order (operands first)."""
    order, seen = [], set()

    def walk(n: Node):
        if n.kind == "iter" or n.op_id in seen:
            return
        for a in n.inputs:
            walk(a)
        if n.op_id not in seen:
            seen.add(n.op_id)
            order.append(n.op_id)
    walk(tree)
    return order


def _instantiate(tree: Node, inputs, out_shape: tuple, probe_range: int, fmaps_of) -> Iterator[Skeleton]:
    """The skeletons of ``tree``: each iterator's for-loop dim chosen where it is first read, shapes and flags
    checked op by op on the probe schedule (grid (1,), for-loop range ``probe_range``)."""
    ops = _order(tree)
    used = sorted({n.attrs for n in _leaves(tree)})
    if used != list(range(len(inputs))):
        return                              # an unread input would be one more output
    ctx = Ctx((1,), probe_range)
    n_in = len(inputs)
    base, k = {}, n_in
    for op in ops:
        base[op] = k
        k += len(VALUE_OUTPUTS.get(op[0], (0,)))

    def ref(node: Node) -> int:
        return node.attrs if node.kind == "iter" else base[node.op_id] + node.out

    choices = fmaps_of or (lambda i: [None] + [d for d in range(len(inputs[i][0]))
                                               if inputs[i][0][d] > 1 and inputs[i][0][d] % probe_range == 0])
    fm: list = [Ellipsis] * n_in
    shapes: dict = {}
    flags: dict = {}

    def iterator(i) -> Iterator[None]:
        if fm[i] is not Ellipsis:
            yield
            return
        s, d = inputs[i]
        for f in choices(i):
            try:
                op = make_op("iterator", [], [], [], dict(index=i, shape=s, dtype=d, imap=(None,), fmap=f), ctx=ctx)
            except MuGraphError:
                continue
            fm[i], shapes[i], flags[i] = f, op.shapes[0], 0
            yield
            fm[i] = Ellipsis
            del shapes[i], flags[i]

    def place(k: int) -> Iterator[Skeleton]:
        if k == len(ops):
            top = ref(tree)
            if shapes[top] == out_shape and flags[top] == 1:
                skel_ops = tuple(SkelOp(kind, tuple(ref(a) for a in ins), attrs) for kind, attrs, ins in ops)
                yield Skeleton(tuple(None if f is Ellipsis else f for f in fm), skel_ops, (top,), probe_range)
            return
        kind, attrs, ins = ops[k]
        leaves = [a.attrs for a in ins if a.kind == "iter"]
        yield from _with_iterators(leaves, lambda: step(k, kind, attrs, ins))

    def _with_iterators(leaves, then):
        if not leaves:
            yield from then()
            return
        for _ in iterator(leaves[0]):
            yield from _with_iterators(leaves[1:], then)

    def step(k, kind, attrs, ins) -> Iterator[Skeleton]:
        refs = [ref(a) for a in ins]
        fl = [flags[r] for r in refs]
        acc = kind.startswith("acc_")
        if (acc and any(fl)) or (not acc and len(set(fl)) > 1):
            return
        out = _fit(kind, attrs, [shapes[r] for r in refs], inputs[0][1], ctx)
        if out is None:
            return
        b = base[(kind, attrs, ins)]
        for j, o in enumerate(VALUE_OUTPUTS.get(kind, (0,))):
            shapes[b + j], flags[b + j] = out[o], 1 if acc else fl[0]
        yield from place(k + 1)

    yield from place(0)


def _leaves(tree: Node):
    if tree.kind == "iter":
        yield tree
    for a in tree.inputs:
        yield from _leaves(a)
