"""Abstract expressions of μGraph tensors (Mirage Table 1), in a normal form.

An :class:`Expr` is an immutable, hash-consed term: structurally equal terms are
the same object, so ``a is b`` decides equality and ``hash`` is O(1). Leaves are
kernel inputs (``var(i)``) and constants; inner nodes are ``add`` and ``mul``
(n-ary), ``div``, ``sum`` (a reduction of ``attr`` terms), ``fn`` (an
uninterpreted unary such as exp, sqrt, silu), ``concat`` (kept so that a matmul
of two concats splits into a sum of matmuls, the LoRA identity) and ``sym`` (an
uninterpreted symbol named by a non-LAX or unknown op: a sound default).

Normal form (the constructors produce it; Mirage's A_eq read as rewrite rules):

* ``+`` and ``·`` are flattened and their arguments sorted (AC); constants fold.
* Sums are pulled outward ("prenex"): ``sum(a, x)·y = sum(a, x·y)``,
  ``sum(a, x)/y = sum(a, x/y)``, ``sum(a, sum(b, x)) = sum(a·b, x)``,
  ``sum(a, x + y) = sum(a, x) + sum(a, y)``, ``sum(1, x) = x``. A sum stays
  under a denominator or a unary function. Sizes are concrete ints.
* Division is one ``div(numerator, denominator)`` per product:
  ``x/z·y = (x·y)/z``, ``x/(y/z) = (x·z)/y``, ``(x/y)/z = x/(y·z)``;
  constant denominators become constant factors; ``x/z + y/z = (x+y)/z``.
* ``max`` (non-LAX) is an uninterpreted ``reduce_max`` symbol whose nested
  sizes merge; ``acc_online_softmax(s, v)`` ends as ``(m, l, o)`` with
  ``m = max_n(s)``, ``l = sum(n, exp(s - m))``, ``o = sum(n, exp(s - m)·v)``, so
  FlashAttention's ``o / l`` equals a plain ``softmax(s) @ v``; :func:`softmax_score` recognises that
  stabilised exponential in a target (the search's softmax handling starts from it).
* ``sub(x, y) = x + (-1)·y``; ``rsqrt(x) = 1/sqrt(x)``; ``square(x) = x·x``;
  ``mean_n(x) = (1/n)·sum(n, x)``; ``rms_n(x) = sqrt((1/n)·sum(n, x·x) + eps)``
  and ``rms_norm(x) = x / rms_n(x)``, so both the accumulator ``acc_rms`` and a
  plain ``x * rsqrt(mean(x²) + eps)`` reach the same term, and every prefix of
  one is a subterm of the other.

:func:`expr_of_op` gives the expression of each output of a kernel- or block-level
op from its operands' expressions; :func:`graph_exprs` walks a whole
:class:`~torch_mirage.ugraph.KernelGraph` (block and thread graphs inlined).
"""
from __future__ import annotations

from fractions import Fraction
from typing import Sequence

from ...ugraph import BlockGraph, Ctx, Graph, KernelGraph, MuGraphError, Op, Ref, ThreadGraph


class Expr:
    """A hash-consed abstract expression; build it with the constructors below."""
    __slots__ = ("op", "args", "attr", "_hash", "_str", "__weakref__")

    op: str
    args: tuple
    attr: object

    def __init__(self, *a, **k):
        raise TypeError("Expr is hash-consed: use var / const / add / mul / div / sum_ / fn / sym")

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other

    def __ne__(self, other) -> bool:
        return self is not other

    def __lt__(self, other: "Expr") -> bool:   # the AC argument order
        return self._str < other._str

    def __str__(self) -> str:
        return self._str

    def __repr__(self) -> str:
        return f"Expr({self._str})"

    def __reduce__(self):                       # pickling re-interns (worker processes)
        return (_mk, (self.op, self.args, self.attr))

    # -- helpers
    def subterms(self):
        """Every distinct subterm, this one included (pre-order, each once)."""
        seen: set = set()
        stack = [self]
        while stack:
            e = stack.pop()
            if e in seen:
                continue
            seen.add(e)
            yield e
            stack.extend(e.args)

    @property
    def size(self) -> int:
        return 1 + sum(a.size for a in self.args)


_TABLE: dict[tuple, Expr] = {}


def _fmt_num(c: Fraction) -> str:
    return str(c.numerator) if c.denominator == 1 else f"{c.numerator}/{c.denominator}"


def _render(op: str, args: tuple, attr) -> str:
    if op == "var":
        return f"v{attr}"
    if op == "const":
        return _fmt_num(attr)
    if op == "add":
        return "(" + " + ".join(a._str for a in args) + ")"
    if op == "mul":
        return "(" + "·".join(a._str for a in args) + ")"
    if op == "div":
        return f"({args[0]._str} / {args[1]._str})"
    if op == "sum":
        return f"sum({attr}, {args[0]._str})"
    if op == "fn":
        return f"{attr}({args[0]._str})"
    return f"{op}{list(attr) if isinstance(attr, tuple) else '[' + str(attr) + ']'}(" \
        + ", ".join(a._str for a in args) + ")"


def _mk(op: str, args: tuple = (), attr=None) -> Expr:
    key = (op, args, attr)
    e = _TABLE.get(key)
    if e is None:
        e = object.__new__(Expr)
        e.op, e.args, e.attr = op, args, attr
        e._hash = hash(key)
        e._str = _render(op, args, attr)
        _TABLE[key] = e
    return e


# ------------------------------------------------------------------ constructors
def _num(c) -> Fraction:
    """Constants as exact fractions; a float within fp32 rounding of a short
    fraction (1/3 from ``1 / n``, eps = 1e-6 read back from fp32) becomes that
    fraction, so a constant written two ways folds alike."""
    if isinstance(c, float):            # fp32's 7 significant digits: 1e-6 and its fp32 rounding fold alike
        c = float(f"{c:.7g}")
    f = Fraction(c)
    for limit in (1 << 12, 1 << 24):     # the shortest fraction within fp32 rounding
        g = f.limit_denominator(limit)
        if abs(g - f) <= abs(f) * 1e-6:
            return g
    return f


def var(i: int) -> Expr:
    """Kernel input ``i``."""
    return _mk("var", (), int(i))


def const(c) -> Expr:
    return _mk("const", (), _num(c))


ONE = const(1)
ZERO = const(0)


def is_const(e: Expr) -> bool:
    return e.op == "const"


def add(*xs: Expr) -> Expr:
    terms: list[Expr] = []
    c = Fraction(0)
    stack = list(xs)
    while stack:
        x = stack.pop()
        if x.op == "add":
            stack.extend(x.args)
        elif x.op == "const":
            c += x.attr
        else:
            terms.append(x)
    by_den: dict[Expr, list[Expr]] = {}
    for t in terms:
        if t.op == "div":
            by_den.setdefault(t.args[1], []).append(t.args[0])
    if any(len(v) > 1 for v in by_den.values()):          # x/z + y/z = (x + y)/z
        terms = [t for t in terms if t.op != "div" or len(by_den[t.args[1]]) == 1]
        for den, nums in by_den.items():
            if len(nums) > 1:
                terms.append(_product([add(*nums)], [den]))
        return add(*terms, const(c))
    if c != 0 or not terms:
        terms.append(const(c))
    if len(terms) == 1:
        return terms[0]
    return _mk("add", tuple(sorted(terms)))


def _product(nums_in: Sequence[Expr], dens_in: Sequence[Expr]) -> Expr:
    """The normal form of ``Π nums / Π dens``."""
    c = Fraction(1)
    size = 1
    nums: list[Expr] = []
    dens: list[Expr] = []
    top, bot = list(nums_in), list(dens_in)
    while top or bot:
        while top:
            x = top.pop()
            if x.op == "mul":
                top.extend(x.args)
            elif x.op == "const":
                c *= x.attr
            elif x.op == "sum":
                size *= x.attr
                top.append(x.args[0])
            elif x.op == "div":
                top.append(x.args[0])
                bot.append(x.args[1])
            else:
                nums.append(x)
        while bot:
            y = bot.pop()
            if y.op == "mul":
                bot.extend(y.args)
            elif y.op == "const" and y.attr != 0:
                c /= y.attr
            elif y.op == "div":
                bot.append(y.args[0])
                top.append(y.args[1])
            else:
                dens.append(y)
    if c == 0:
        return ZERO
    if c != 1 or not nums:
        nums.append(const(c))
    num = nums[0] if len(nums) == 1 else _mk("mul", tuple(sorted(nums)))
    out = num
    if dens:
        den = dens[0] if len(dens) == 1 else _mk("mul", tuple(sorted(dens)))
        out = _mk("div", (num, den))
    return sum_(size, out)


def mul(*xs: Expr) -> Expr:
    return _product(xs, ())


def div(x: Expr, y: Expr) -> Expr:
    return _product((x,), (y,))


def neg(x: Expr) -> Expr:
    return mul(const(-1), x)


def sub(x: Expr, y: Expr) -> Expr:
    return add(x, neg(y))


def sum_(n: int, x: Expr) -> Expr:
    """A reduction of ``n`` terms of ``x``."""
    n = int(n)
    if n < 1:
        raise MuGraphError(f"sum over {n} terms")
    if n == 1:
        return x
    if x.op == "sum":
        return sum_(n * x.attr, x.args[0])
    if x.op == "add":
        return add(*(sum_(n, a) for a in x.args))
    return _mk("sum", (x,), n)


def fn(name: str, x: Expr) -> Expr:
    """An uninterpreted unary function (exp, sqrt, silu, tanh, ...)."""
    return _mk("fn", (x,), str(name))


def sym(name: str, args: Sequence[Expr], attr=None) -> Expr:
    """An uninterpreted symbol for a non-LAX or unknown op (``attr`` hashable)."""
    return _mk("sym", tuple(args), (str(name), attr))


def concat(dim_from_end: int, parts: Sequence[Expr], sizes: Sequence[int]) -> Expr:
    """Concatenation along ``dim_from_end`` (negative) of parts of the given extents; copies of one
    tensor (a broadcast made explicit, e.g. GQA's repeated K/V heads) are that tensor, as
    partitioning is abstracted away."""
    if all(p is parts[0] for p in parts):      # copies of one tensor (a materialised broadcast): abstractly it
        return parts[0]
    return _mk("concat", tuple(parts), ("concat", int(dim_from_end), tuple(int(s) for s in sizes)))


def matmul(a: Expr, b: Expr, k: int) -> Expr:
    """``sum(k, a·b)``; ``concat(a_i)_{-1} @ concat(b_i)_{-2} = Σ_i a_i @ b_i``."""
    if a.op == "concat" and b.op == "concat" and a.attr[1] == -1 and b.attr[1] == -2 and a.attr[2] == b.attr[2]:
        return add(*(matmul(x, y, s) for x, y, s in zip(a.args, b.args, a.attr[2])))
    return sum_(k, mul(a, b))


def max_(n: int, x: Expr) -> Expr:
    """A max over ``n`` terms (non-LAX: an uninterpreted symbol); max of maxes merges like sums."""
    n = int(n)
    if n == 1:
        return x
    if x.op == "sym" and x.attr[0] == "reduce_max":
        return max_(n * x.attr[1], x.args[0])
    return sym("reduce_max", (x,), n)


def softmax_score(t: Expr) -> Expr | None:
    """``s`` when ``t`` is softmax's stabilised exponential ``exp(s − max_n s)`` (what the online-softmax
    accumulator exponentiates), else None."""
    if t.op != "fn" or t.attr != "exp" or t.args[0].op != "add":
        return None
    terms = t.args[0].args
    minus_one = const(-1)
    for k, a in enumerate(terms):
        if a.op != "mul" or len(a.args) != 2 or minus_one not in a.args:
            continue
        m = a.args[1] if a.args[0] is minus_one else a.args[0]
        if m.op == "sym" and m.attr[0] == "reduce_max" and add(*(terms[:k] + terms[k + 1:])) is m.args[0]:
            return m.args[0]
    return None


def softmax_row(t: Expr) -> int:
    """The row length ``n`` of the max in a softmax exponential ``exp(s − max_n s)`` (:func:`softmax_score`)."""
    return next(a.attr[1] for x in t.args[0].args if x.op == "mul" for a in x.args if a.op == "sym")


def softmax_scores(targets: Sequence[Expr]) -> list[Expr]:
    """The scores ``s`` of every ``exp(s − max_n s)`` in ``targets``, each once."""
    out: list[Expr] = []
    for e in targets:
        for t in e.subterms():
            s = softmax_score(t)
            if s is not None and s not in out:
                out.append(s)
    return out


def sqrt(x: Expr) -> Expr:
    return fn("sqrt", x)


def rms(n: int, x: Expr, eps: float = 0.0) -> Expr:
    """``sqrt((1/n)·sum(n, x·x) + eps)``."""
    return sqrt(add(mul(const(Fraction(1, n)), sum_(n, mul(x, x))), const(eps)))


def rms_norm(n: int, x: Expr, eps: float = 0.0) -> Expr:
    return div(x, rms(n, x, eps))


def mean(n: int, x: Expr) -> Expr:
    return mul(const(Fraction(1, n)), sum_(n, x))


# ------------------------------------------------------------------ ops
_UNARY_FN = {"exp", "sqrt", "silu", "tanh", "gelu", "relu", "sigmoid", "log", "erf", "clamp"}


def _need_shapes(op: Op, in_shapes) -> list:
    if in_shapes is None:
        raise MuGraphError(f"expr_of_op({op.name}): the operands' shapes are needed (pass in_shapes=) to know "
                           "the reduced size")
    return [tuple(s) for s in in_shapes]


def _dim_size(shape: tuple, dim) -> int:
    if not shape:
        return 1
    return shape[dim % len(shape)]


def expr_of_op(op: Op, args: Sequence[Expr], ctx: Ctx = Ctx(), *, in_shapes: Sequence[tuple] | None = None
               ) -> tuple[Expr, ...]:
    """The abstract expression of each output of ``op`` given its operands' expressions.

    ``in_shapes`` are the operands' shapes (tile shapes inside a block graph);
    they are needed by matmul, reductions, accumulators and concat, which sum or
    split over an operand's extent. An ``iterator`` takes one argument, the
    expression of the kernel tensor it walks; a ``saver`` returns the expression
    it saves. ``customized`` and ``thread`` walk their bodies."""
    name, at = op.name, op.attrs
    x = args[0] if args else None
    if name == "input":
        return (var(at["index"]),)
    if name in ("iterator", "saver", "transpose", "reshape", "acc_concat"):
        if x is None:
            raise MuGraphError(f"expr_of_op({name}): needs the expression of the tensor it passes through")
        return (x,)
    if name in _UNARY_FN:
        return (fn(name, x),)
    if name == "rsqrt":
        return (div(ONE, sqrt(x)),)
    if name == "neg":
        return (neg(x),)
    if name == "square":
        return (mul(x, x),)
    if name == "scalar_mul":
        return (mul(x, const(at["value"])),)
    if name == "scalar_add":
        return (add(x, const(at["value"])),)
    if name == "add":
        return (add(*args),)
    if name == "sub":
        return (sub(*args),)
    if name == "mul":
        return (mul(*args),)
    if name == "div":
        return (div(*args),)
    if name == "customized":
        return tuple(block_exprs(op.body, args))
    if name == "thread":
        return tuple(_walk(op.body, args)[r] for r in op.body.outputs)
    if name not in _SIZED:
        outs = max(1, len(op.shapes))
        return tuple(sym(name, args, ("out", i, _attr_key(at))) for i in range(outs))
    shapes = _need_shapes(op, in_shapes)
    s0 = shapes[0]
    if name == "matmul":
        return (matmul(args[0], args[1], s0[-1]),)
    if name == "concat":
        d = at["dim"] % len(s0)
        return (concat(d - len(s0), args, [s[d] for s in shapes]),)
    if name == "rms_norm":
        return (rms_norm(s0[-1], x, at.get("eps") or 0.0),)
    if name in ("reduce_sum", "reduce_mean", "reduce_max"):
        n = _dim_size(s0, at["dim"])
    else:                                       # for-loop accumulators
        n = ctx.forloop_range * (1 if at.get("dim") is None else _dim_size(s0, at["dim"]))
    if name in ("reduce_sum", "acc_sum"):
        return (sum_(n, x),)
    if name in ("reduce_mean", "acc_mean"):
        return (mean(n, x),)
    if name == "acc_rms":
        return (rms(n, x, at.get("eps") or 0.0),)
    if name == "acc_online_softmax":            # what the rescaled running values end as
        n = ctx.forloop_range * s0[-1]
        m = max_(n, x)
        e = fn("exp", sub(x, m))
        return (m, sum_(n, e), matmul(e, args[1], n))
    return (max_(n, x),)                         # reduce_max, acc_max: non-LAX


_SIZED = {"matmul", "concat", "rms_norm", "reduce_sum", "reduce_mean", "reduce_max",
          "acc_sum", "acc_mean", "acc_rms", "acc_max", "acc_online_softmax"}


def sibling_key(e: Expr):
    """For output ``i`` of a multi-output uninterpreted op: what its sibling outputs share, else None."""
    if e.op == "sym" and isinstance(e.attr[1], tuple) and len(e.attr[1]) == 3 and e.attr[1][0] == "out":
        return (e.attr[0], e.args, e.attr[1][2])
    return None


def _attr_key(at) -> tuple:
    return tuple(sorted((k, v) for k, v in at.items() if k not in ("dtype",)))


def _walk(g: Graph, args: Sequence[Expr]) -> dict[Ref, Expr]:
    """The expression of every tensor of ``g`` (a kernel, block or thread graph);
    ``args`` bind a block graph's iterators / a thread graph's inputs by index
    (a kernel graph's inputs are ``var(index)``)."""
    env: dict[Ref, Expr] = {}
    ctx = g.ctx()
    for i, op in enumerate(g.ops):
        if op.name in ("iterator",) or (op.name == "input" and isinstance(g, ThreadGraph)):
            outs = (args[op.attrs["index"]],)
        else:
            ins = [env[Ref(*r)] for r in op.inputs]
            outs = expr_of_op(op, ins, ctx._replace(body=op.body),
                              in_shapes=[g.shape(Ref(*r)) for r in op.inputs])
        if op.name == "saver":
            env[Ref(i, 0)] = outs[0]
            continue
        for j, e in enumerate(outs):
            env[Ref(i, j)] = e
    return env


def block_exprs(bg: BlockGraph, args: Sequence[Expr]) -> list[Expr]:
    """The saved expressions of a block graph (saver index order), its iterators bound to ``args``."""
    env = _walk(bg, args)
    idx = {op.attrs["index"]: i for i, op in enumerate(bg.ops) if op.name == "saver"}
    return [env[Ref(idx[k], 0)] for k in sorted(idx)]


def tensor_exprs(g: Graph, args: Sequence[Expr] = ()) -> dict[Ref, Expr]:
    """Every tensor's expression (savers map to what they save); see :func:`_walk`."""
    return _walk(g, args)


def graph_exprs(g: KernelGraph) -> list[Expr]:
    """The expressions of ``g.outputs`` (inputs are ``var(index)``)."""
    env = _walk(g, ())
    return [env[Ref(*r)] for r in g.outputs]


def sub_exprs(g: KernelGraph) -> list[Expr]:
    """The expression of every op output of ``g`` and of its block graphs, in
    op order (what the generator's prefixes compute; used by the T1 test)."""
    out: list[Expr] = []
    env = _walk(g, ())
    for i, op in enumerate(g.ops):
        if op.name == "customized":
            args = [env[Ref(*r)] for r in op.inputs]
            benv = _walk(op.body, args)
            out += [e for r, e in benv.items() if op.body.ops[r[0]].name != "saver"]
        out += [env[Ref(i, j)] for j in range(len(op.shapes))]
    return out
