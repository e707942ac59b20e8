"""Expression-guided DFS enumerator of one graph-defined kernel op (Mirage §4, Algorithm 1).

The generator builds the *skeleton* of a block graph op by op: one input iterator per kernel input
(each choosing only its for-loop dim ``fmap``; grid, imap and the for-loop range are deferred to
:mod:`.schedule`), then body ops, for-loop accumulators and finally savers. Shapes are checked on a
probe schedule: grid (1,) and a probe for-loop range ``probe_range`` > 1, so that a wrong fmap shows up
as a shape mismatch or a different reduction size in the abstract expression.

Canonical form (Mirage §4.1): every value has an index (iterators first, then one per body op); each
op has the rank (operand indices newest first, op kind, operands); a new op's rank must be strictly
greater than the previous op's, so every DAG is produced in exactly one order (an op ranks above the
ops whose values it reads). Commutative binary ops take operands i <= j only,
and an op whose abstract expression equals an existing value's (a duplicate value) is dropped.

Def. 2.1 (3), the accumulator discipline: every value carries a flag, 0 before the for-loop
accumulator and 1 after it. Accumulators take flag-0 operands, binary ops take operands with equal
flags, savers take flag-1 values. The graph is complete when the unconsumed values are exactly the
outputs, all flag 1; a complete graph is a candidate when ``is_target`` accepts its output
expressions.

Pruning: ``admits(expr) -> bool`` is called on every new op's abstract expression (computed with
``expr.expr_of_op``); ``lambda e: True`` switches pruning off.

The hot loop: one step of the DFS, ``children`` (the canonical moves after the last op's rank, each one's
block op and abstract expression, both memoised), is what profiling measured as the search's own time
(benchmarks/results/search_profile_cpu.md); csrc/search_core.cpp does the same step in C++ (:mod:`.native`)
and calls back here only on memo misses. Both give the same children in the same order.
"""
from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from ...ugraph import Ctx, KernelGraph, MuGraphError, Ref, make_op
from ..builder import BlockBuilder, new_kernel_graph
from . import expr as E
from . import native as N

# Body-op kinds in rank order (the second half of an op's rank). Each: (name, arity, block op, attrs)
UNARY = ("silu", "exp", "sqrt")
COMMUTATIVE = ("add", "mul")


@dataclass(frozen=True)
class SkelOp:
    """One body op of a skeleton: ``kind`` is a block op name, ``matmul_t`` (matmul with the second
    operand transposed: a transpose and a matmul in the block graph) or ``concat_matmul`` (Mirage's
    LoRA macro: (a ‖ b) @ (c ‖ d), concatenated along a's last and c's second-to-last dim: two
    concats and a matmul); ``inputs`` are value indices."""
    kind: str
    inputs: tuple
    attrs: tuple = ()          # sorted (name, value) pairs

    @property
    def rank(self) -> tuple:
        return _rank(self.kind, self.inputs, self.attrs)


@functools.lru_cache(maxsize=1 << 16)
def _rank(kind: str, inputs: tuple, attrs: tuple) -> tuple:
    """Mirage's canonical rank: the operand indices newest first (a proper prefix is smaller), the op kind,
    then the operands in order (a non-commutative op's). Newest first makes an op that reads a value rank
    above the op that made it, so every DAG has exactly one increasing order (``add(v1, v5)`` may follow
    ``mul(v2, v4)``: its rank starts with 5)."""
    return (tuple(sorted(inputs, reverse=True)), _KIND_INDEX[kind], inputs,
            tuple((k, -1 if v is None else v) for k, v in attrs))


KIND_ORDER = ("silu", "exp", "sqrt", "rms_norm", "reduce_mean", "add", "mul", "div", "sub", "matmul", "matmul_t",
              "concat", "concat_matmul", "acc_sum", "acc_rms", "scalar_mul", "acc_online_softmax")
_KIND_INDEX = {k: i for i, k in enumerate(KIND_ORDER)}
# The block-op outputs that become skeleton values, for ops with more than one: the online-softmax accumulator's
# sum of exponentials l and unnormalised output o (its running max m only rescales inside the accumulator).
VALUE_OUTPUTS = {"acc_online_softmax": (1, 2)}
# The kinds enumerated unless told otherwise: the online-softmax accumulator only for a target with a softmax
# (driver.op_kinds), a scalar_mul only with scale_values.
DEFAULT_KINDS = tuple(k for k in KIND_ORDER if k != "acc_online_softmax")


def n_values(kind: str) -> int:
    """How many skeleton values an op of ``kind`` adds (value indices count them, iterators first)."""
    return len(VALUE_OUTPUTS.get(kind, (0,)))


@dataclass(frozen=True)
class Skeleton:
    """A block graph without its schedule: iterator fmaps (one per kernel input), body ops in canonical
    order, and the value saved by each saver."""
    fmaps: tuple
    ops: tuple
    outputs: tuple
    probe_range: int

    def __str__(self) -> str:
        n = len(self.fmaps)
        parts = [f"v{i}=iter{i}[fmap={f}]" for i, f in enumerate(self.fmaps)]
        for op in self.ops:
            a = "".join(f", {k_}={v}" for k_, v in op.attrs)
            outs = ", ".join(f"v{n + k}" for k in range(n_values(op.kind)))
            parts.append(f"{outs}={op.kind}({', '.join(f'v{i}' for i in op.inputs)}{a})")
            n += n_values(op.kind)
        return "; ".join(parts) + f"; save {', '.join(f'v{i}' for i in self.outputs)}"


@dataclass
class GenStats:
    generated: int = 0          # ops created (states)
    pruned: int = 0             # rejected by admits()
    duplicates: int = 0         # dropped as duplicate values
    complete: int = 0           # complete graphs reached
    candidates: int = 0         # complete graphs whose expressions match the target
    timed_out: bool = False
    branch: int = -1            # index of the current first-level branch (fmap choice x first op), DFS order

    def as_dict(self) -> dict:
        return dict(self.__dict__)


# ------------------------------------------------------------------ replay: skeleton -> block graph
def build_block(skel: Skeleton, inputs: Sequence, *, grid=(1,), forloop_range=None, imaps=None, omap=None,
                out_dtypes=None, kernel_tensors=None) -> BlockBuilder:
    """Replay ``skel`` into a :class:`BlockBuilder`. ``inputs``: (shape, dtype) per kernel input;
    ``imaps``: one imap per iterator (default: all φ); ``omap``: the savers' omap (default: all φ)."""
    grid = tuple(grid)
    frange = skel.probe_range if forloop_range is None else forloop_range
    tb = BlockBuilder(grid, frange)
    phi = (None,) * len(grid)
    vals = []
    kts = kernel_tensors or _dummy_tensors(inputs)
    for i, f in enumerate(skel.fmaps):
        vals.append(tb.new_input(kts[i], imap=(imaps[i] if imaps else phi), fmap=f))
    for op in skel.ops:
        xs = [vals[i] for i in op.inputs]
        at = dict(op.attrs)
        if op.kind == "matmul_t":
            vals.append(tb.matmul(xs[0], tb.transpose(xs[1])))
        elif op.kind == "concat_matmul":
            a, b, c, d = xs
            vals.append(tb.matmul(tb.concat([a, b], dim=len(a.shape) - 1), tb.concat([c, d], dim=len(c.shape) - 2)))
        elif op.kind == "concat":
            vals.append(tb.concat(xs, **at))
        elif op.kind in VALUE_OUTPUTS:
            outs = tb.add_op(op.kind, xs, **at)
            vals.extend(outs[j] for j in VALUE_OUTPUTS[op.kind])
        else:
            vals.append(tb._one(op.kind, xs, at))
    for k, v in enumerate(skel.outputs):
        dt = out_dtypes[k] if out_dtypes else None
        tb.new_output(vals[v], omap=(omap if omap is not None else phi), dtype=dt)
    return tb


def _dummy_tensors(inputs):
    g = new_kernel_graph()
    return [g.new_input(s, d) for s, d in inputs]


def to_kernel_graph(skel: Skeleton, inputs: Sequence, **schedule) -> KernelGraph:
    """The μGraph of one customized op running ``skel`` under ``schedule`` (see :func:`build_block`)."""
    g = new_kernel_graph()
    kts = [g.new_input(s, d) for s, d in inputs]
    tb = build_block(skel, inputs, kernel_tensors=kts, **schedule)
    for t in g.customized(kts, tb):
        g.mark_output(t)
    return g.build()


# ------------------------------------------------------------------ the DFS
@dataclass
class _State:
    shapes: list = field(default_factory=list)
    dtypes: list = field(default_factory=list)
    flags: list = field(default_factory=list)
    exprs: list = field(default_factory=list)
    uses: list = field(default_factory=list)
    keys: set = field(default_factory=set)      # duplicate detection: (expr, is accumulator) or structural keys
    key_of: list = field(default_factory=list)  # each body op's keys (one per value it adds), in op order
    ops: list = field(default_factory=list)


def enumerate_skeletons(inputs: Sequence, out_shapes: Sequence, *, max_ops: int, probe_range: int = 2,
                        exact_ops: bool = False, eps_values: Sequence[float] = (0.0,),
                        scale_values: Sequence[float] = (),
                        admits: Callable = lambda e: True, is_target: Callable | None = None,
                        expr_of: Callable | None | str = "auto", stats: GenStats | None = None,
                        deadline: float | None = None, fmap_choices: Sequence | None = None,
                        kinds: Sequence[str] = DEFAULT_KINDS, whole_rows: bool = True,
                        share: tuple[int, int] = (0, 1),
                        native: bool | None = None) -> Iterator[tuple[Skeleton, tuple]]:
    """Yield ``(skeleton, output expressions)`` for every complete block graph of at most ``max_ops``
    body ops (exactly, with ``exact_ops``) over kernel inputs ``inputs`` ((shape, dtype) each) whose
    saved tensors have shapes ``out_shapes`` and, when ``is_target`` is given, whose output
    expressions it accepts. ``deadline``: a ``time.monotonic()`` value; past it the DFS stops and
    ``stats.timed_out`` is set. ``share``: ``(k, n)`` enumerates only the first-level branches (the
    iterators' fmap choice and the first body op, numbered in DFS order) whose index is k mod n, for
    splitting the search among n workers; ``stats.branch`` is the index of the branch being expanded.
    ``scale_values``: the constants a ``scalar_mul`` may multiply by (softmax's temperature: the driver takes
    them from the target). ``acc_online_softmax`` adds two values, its sum of exponentials and its unnormalised
    output (:data:`VALUE_OUTPUTS`); its expression (:func:`.expr.expr_of_op`) is softmax's, so ``o / l``
    equals a plain ``softmax(s) @ v`` target.
    ``whole_rows``: a skeleton whose iterators have no for-loop dim runs its loop once (each block holds
    whole rows, an accumulator is the identity: a norm chain); off, it is probed like the others.
    ``native``: expand states with the C++ core (:mod:`.native`: the same children in the same order);
    None uses it when it is built and ``expr_of`` is given, False never, True requires it."""
    stats = stats if stats is not None else GenStats()
    if expr_of == "auto":
        expr_of = E.expr_of_op
    inputs = [(tuple(s), d) for s, d in inputs]
    out_shapes = [tuple(s) for s in out_shapes]
    n_in, n_out = len(inputs), len(out_shapes)
    probe_ctx, whole_ctx = Ctx((1,), probe_range), Ctx((1,), 1)
    ctx = probe_ctx         # whole_ctx once the iterators have no for-loop dim (see iterators())
    st = _State()
    kinds = set(kinds)
    # per for-loop range (the probe's, or 1 for whole rows): the memos of the context they were computed in
    memos = {c.forloop_range: ({}, {}) for c in (probe_ctx, whole_ctx)}
    # (kind, attrs, operand shapes, dtypes) -> block op (None: shapes do not fit);
    # (kind, attrs, operand exprs, shapes) -> expression
    op_memo, expr_memo = memos[ctx.forloop_range]

    def fmaps_of(i):
        if fmap_choices is not None:
            return fmap_choices[i]
        s = inputs[i][0]
        return [None] + [d for d in range(len(s)) if s[d] % probe_range == 0 and s[d] > 1]

    def expr_for(kind, ins, attrs, op):
        """The abstract expression of block op ``op`` on values ``ins`` (memoised; the transpose of a
        matmul_t is the identity)."""
        args, shapes = tuple(st.exprs[i] for i in ins), tuple(st.shapes[i] for i in ins)
        mk = (kind, attrs, args, shapes)
        e = expr_memo.get(mk)
        if e is None:
            e = expr_memo[mk] = expr_miss(kind, args, shapes, op)
        return e

    def expr_miss(kind, args, shapes, op):
        """The expression of the new value (a tuple of them for an op of several values)."""
        if kind in VALUE_OUTPUTS:
            es = expr_of(op, list(args), ctx, in_shapes=list(shapes))
            return tuple(es[j] for j in VALUE_OUTPUTS[kind])
        if kind == "concat_matmul":
            c1, c2, mm = op
            e1 = expr_of(c1, list(args[:2]), ctx, in_shapes=list(shapes[:2]))[0]
            e2 = expr_of(c2, list(args[2:]), ctx, in_shapes=list(shapes[2:]))[0]
            return expr_of(mm, [e1, e2], ctx, in_shapes=[c1.shapes[0], c2.shapes[0]])[0]
        return expr_of(op, list(args), ctx, in_shapes=list(shapes))[0]

    def push(kind, ins, attrs, op, e):
        """Append the value(s) of block op ``op`` (for matmul_t: its matmul) with expression ``e`` (a tuple
        for an op of several values) unless one is a duplicate value or ``admits`` rejects its expression.
        An accumulator's value is not a duplicate of its operand's (with a for-loop range of 1 both have one
        expression)."""
        outs = VALUE_OUTPUTS.get(kind, (0,))
        es = e if len(outs) > 1 else (e,)
        acc = kind.startswith("acc_")
        keys = tuple((x, acc) for x in es) if expr_of is not None else \
            tuple((kind, ins, attrs, j) for j in outs)
        stats.generated += 1
        if any(k in st.keys for k in keys) or len(set(keys)) < len(keys):
            stats.duplicates += 1
            return False
        if any(x is not None and not admits(x) for x in es):
            stats.pruned += 1
            return False
        flag = 1 if acc else st.flags[ins[0]]
        last = op[-1] if isinstance(op, tuple) else op
        for j, x, key in zip(outs, es, keys):
            st.shapes.append(last.shapes[j]); st.dtypes.append(last.dtypes[j]); st.flags.append(flag)
            st.exprs.append(x); st.uses.append(0); st.keys.add(key)
        st.key_of.append(keys)
        st.ops.append(SkelOp(kind, ins, attrs))
        for i in ins:
            st.uses[i] += 1
        return True

    def pop():
        sk = st.ops.pop()
        for i in sk.inputs:
            st.uses[i] -= 1
        for key in st.key_of.pop():
            st.shapes.pop(); st.dtypes.pop(); st.flags.pop(); st.uses.pop(); st.exprs.pop()
            st.keys.discard(key)

    def make(kind, ins, attrs):
        """The block op for a skeleton op on values ``ins`` (None if shapes do not fit)."""
        sh = tuple(st.shapes[i] for i in ins)
        dt = tuple(st.dtypes[i] for i in ins)
        mk = (kind, attrs, sh, dt)
        if mk not in op_memo:
            op_memo[mk] = make_miss(kind, attrs, sh, dt)
        return op_memo[mk]

    def make_miss(kind, attrs, sh, dt):
        sh, dt = list(sh), list(dt)
        try:
            if kind == "concat_matmul":
                r = [Ref(0), Ref(1)]
                c1 = make_op("concat", r, sh[:2], dt[:2], dict(dim=len(sh[0]) - 1), ctx=ctx)
                c2 = make_op("concat", r, sh[2:], dt[2:], dict(dim=len(sh[2]) - 2), ctx=ctx)
                return (c1, c2, make_op("matmul", r, [c1.shapes[0], c2.shapes[0]], [c1.dtypes[0], c2.dtypes[0]],
                                        ctx=ctx))
            if kind == "matmul_t":
                t = make_op("transpose", [Ref(0)], [sh[1]], [dt[1]], ctx=ctx)
                return make_op("matmul", [Ref(0), Ref(1)], [sh[0], t.shapes[0]], [dt[0], t.dtypes[0]], ctx=ctx)
            return make_op(kind, [Ref(k) for k in range(len(sh))], sh, dt, dict(attrs), ctx=ctx)
        except MuGraphError:
            return None

    def moves(last_rank):
        n = len(st.shapes)
        out = []
        for i in range(n):
            if "silu" in kinds or "exp" in kinds or "sqrt" in kinds:
                out += [(k, (i,), ()) for k in UNARY if k in kinds]
            if "rms_norm" in kinds and len(st.shapes[i]) >= 1:
                out += [("rms_norm", (i,), (("eps", e),)) for e in eps_values]
            if "reduce_mean" in kinds and len(st.shapes[i]) >= 1 and st.shapes[i][-1] > 1:
                out.append(("reduce_mean", (i,), (("dim", len(st.shapes[i]) - 1),)))   # a row's mean in the block
            if "scalar_mul" in kinds:
                out += [("scalar_mul", (i,), (("value", c),)) for c in scale_values]
            if st.flags[i] == 0:
                if "acc_sum" in kinds:
                    out += [("acc_sum", (i,), (("dim", None),)), ("acc_sum", (i,), (("dim", len(st.shapes[i]) - 1),))]
                if "acc_rms" in kinds:
                    out += [("acc_rms", (i,), (("dim", len(st.shapes[i]) - 1), ("eps", e))) for e in eps_values]
            for j in range(n):
                if st.flags[i] != st.flags[j]:
                    continue
                if i <= j:
                    out += [(k, (i, j), ()) for k in COMMUTATIVE if k in kinds]
                if i != j:
                    out += [(k, (i, j), ()) for k in ("div", "sub") if k in kinds]
                    if "concat" in kinds and len(st.shapes[i]) == len(st.shapes[j]):
                        out += [("concat", (i, j), (("dim", d),)) for d in range(len(st.shapes[i]))]
                if "matmul" in kinds:
                    out.append(("matmul", (i, j), ()))
                if "matmul_t" in kinds and len(st.shapes[j]) >= 2:
                    out.append(("matmul_t", (i, j), ()))
                if "acc_online_softmax" in kinds and i != j and st.flags[i] == 0:   # (scores, values)
                    out.append(("acc_online_softmax", (i, j), ()))
        if "concat_matmul" in kinds:
            out += concat_matmuls()
        ranked = [(r, m) for m in out if (r := _rank(*m)) > last_rank]
        ranked.sort(key=lambda t: t[0])
        return [m for _, m in ranked]

    def py_children(last_rank, share_base=None):
        """The moves after ``last_rank`` in canonical order whose block op fits, as (index among all
        the moves, kind, inputs, attrs, block op, expression); ``share_base`` (first level only): the
        branch index before these moves, and moves outside this worker's share are skipped. Returns
        (children, number of moves)."""
        ms = moves(last_rank)
        out = []
        for idx, (kind, ins, attrs) in enumerate(ms):
            if share_base is not None and (share_base + idx + 1) % share[1] != share[0]:
                continue
            op = make(kind, ins, attrs)
            if op is not None:
                e = expr_for(kind, ins, attrs, op) if expr_of is not None else None
                out.append((idx, kind, ins, attrs, op, e))
        return out, len(ms)

    children = py_children
    if expr_of is not None and native is not False:
        core = N.search_core()
        if core is not None:
            envs = {r: (KIND_ORDER, tuple(k in kinds for k in KIND_ORDER), tuple(eps_values), tuple(scale_values),
                        st.shapes, st.dtypes, st.flags, st.exprs, om, em, make_miss, expr_miss)
                    for r, (om, em) in memos.items()}
            children = lambda last_rank, share_base=None: core.children(  # noqa: E731
                envs[ctx.forloop_range], last_rank, None if share_base is None else (share[0], share[1], share_base))
        elif native:
            raise RuntimeError("enumerate_skeletons(native=True): the native search core (torch_mirage._C) is "
                               f"not built ({N.why_not()}); reinstall with a C++17 compiler or pass native=None")

    def concat_matmuls():
        """Operand quadruples (a, b, c, d) of (a ‖ b) @ (c ‖ d) whose shapes fit, a != b, c != d."""
        n, sh, out = len(st.shapes), st.shapes, []
        for a, b in itertools.permutations(range(n), 2):
            if st.flags[a] != st.flags[b] or len(sh[a]) < 2 or sh[a][:-1] != sh[b][:-1]:
                continue
            inner = sh[a][-1] + sh[b][-1]
            for c, d in itertools.permutations(range(n), 2):
                if (st.flags[c] == st.flags[a] == st.flags[d] and len(sh[c]) == len(sh[d]) >= 2
                        and sh[c][-1] == sh[d][-1] and sh[c][-2] + sh[d][-2] == inner):
                    out.append(("concat_matmul", (a, b, c, d), ()))
        return out

    def unconsumed():
        return [i for i in range(len(st.shapes)) if st.uses[i] == 0]

    def complete(n_ops):
        """The candidates of this state (a candidate is not expanded further, as in Mirage; with
        ``exact_ops`` one with fewer ops is not yielded again, only its expansion is cut)."""
        free = unconsumed()
        if len(free) != n_out or any(st.flags[i] != 1 for i in free):
            return []
        found = []
        for perm in itertools.permutations(free):
            if [st.shapes[i] for i in perm] != out_shapes:
                continue
            exprs = tuple(st.exprs[i] for i in perm)
            if is_target is not None and not is_target(exprs):
                continue
            found.append((Skeleton(tuple(fm), tuple(st.ops), tuple(perm), probe_range), exprs))
        if exact_ops and n_ops != max_ops:
            return found[:1] and [None]
        stats.complete += 1
        stats.candidates += len(found)
        return found

    fm: list = []
    branch = [-1]

    def dfs(last_rank, n_ops):
        if deadline is not None and time.monotonic() > deadline:
            stats.timed_out = True
            return
        found = complete(n_ops)
        for c in found:
            if c is not None:
                yield c
        if found or n_ops >= max_ops:
            return
        # each op lowers the unconsumed count by at most 1: prune states that cannot finish
        if len(unconsumed()) - (max_ops - n_ops) > n_out:
            return
        base = branch[0] if n_ops == 0 else None
        kids, n_moves = children(last_rank, base)
        if n_ops == 0:
            branch[0] += n_moves
        for idx, kind, ins, attrs, op, e in kids:
            if n_ops == 0:
                stats.branch = base + idx + 1
            if not push(kind, ins, attrs, op, e):
                continue
            yield from dfs(_rank(kind, ins, attrs), n_ops + 1)
            pop()
            if stats.timed_out:
                return

    def iterators(i):
        nonlocal ctx, op_memo, expr_memo
        if i == n_in:
            # no for-loop dim: the loop runs once (whole rows per block), so an accumulator is the identity
            ctx = whole_ctx if whole_rows and all(f is None for f in fm) else probe_ctx
            op_memo, expr_memo = memos[ctx.forloop_range]
            yield from dfs(((), -1, (), ()), 0)
            ctx = probe_ctx
            op_memo, expr_memo = memos[ctx.forloop_range]
            return
        s, d = inputs[i]
        for f in fmaps_of(i):
            try:
                op = make_op("iterator", [], [], [], dict(index=i, shape=s, dtype=d, imap=(None,), fmap=f), ctx=ctx)
            except MuGraphError:
                continue
            e = None
            if expr_of is not None:     # an iterator's expression is its kernel input's, var(i)
                e = expr_of(make_op("input", [], [], [], dict(index=i, shape=s, dtype=d)), [], ctx, in_shapes=[])[0]
            st.shapes.append(op.shapes[0]); st.dtypes.append(d); st.flags.append(0)
            st.exprs.append(e); st.uses.append(0)
            st.keys.add((e, False) if expr_of is not None else ("iterator", i))
            fm.append(f)
            yield from iterators(i + 1)
            fm.pop()
            st.shapes.pop(); st.dtypes.pop(); st.flags.pop(); st.exprs.pop(); st.uses.pop()
            st.keys.discard((e, False) if expr_of is not None else ("iterator", i))
            if stats.timed_out:
                return

    yield from iterators(0)
