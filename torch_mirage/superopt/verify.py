"""Equivalence verifier: the finite-field test of Mirage §5 plus a float test.

``verify(candidate, reference, example_inputs)`` compares two programs; each side is a μGraph
(:class:`~.ugraph.KernelGraph`, run by :func:`~.executor.execute`) or a plain PyTorch callable
(lowered through the capture pipeline, interpreted by :mod:`.ff_interpret`).

* **Finite-field test.** Each trial draws every input element uniformly from Z_p × Z_q, a random
  q-th root of unity ω for exp, fresh random values for ``max``, and a fresh key for the sqrt hash
  (:mod:`.finite_field`), runs both sides and compares the outputs' Z_p components exactly. The
  per-trial false-accept bound ε comes from the degree / term-count bounds the field values carry
  (:func:`~.finite_field.per_trial_bound`, Theorem 2); the number of trials t is the least with
  ε^t ≤ the target ``error_bound`` (Theorem 3), and the verdict reports ε^t. For programs whose
  difference has more than two exp terms the root-of-unity part of ε, (K−1)/q, rests on the
  uncertainty principle Li & Wu conjecture for Z_p (proven for K ≤ 2). Sums of fractions whose
  denominators hold exp terms (softmax(·)@V) make the tracked term count explode: then the test
  still runs (``UNBOUNDED_TRIALS``) but no bound is claimed (``error_bound=None``). Equivalent LAX
  programs always pass (perfect completeness), except where a non-LAX treatment is not an
  identity: a program whose output depends on a max value (not only through a cancelling shift)
  or on sqrt rewrites fails — a false reject, never a false accept.
* **Non-LAX programs** (tanh, erf, comparisons, clamp, nested exp ...) get no field test: the
  verdict says so in ``reason`` and its ``error_bound`` is ``None``.
* **Float test** (always): several random real inputs in fp64 — unit scale, large magnitude (×1e3,
  where an unsafe softmax overflows) and, for mask inputs (bool tensors, or float inputs whose
  parameter name contains "mask": filled with 0 / −inf), random masks with one unmasked entry per
  row. Outputs must agree in their non-finite pattern and within ``FLOAT_TOL`` relative to the
  reference's largest finite magnitude.

A candidate that fails either test is rejected; the reason names the test, the output and trial.
"""
from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .finite_field import DEFAULT_FIELD, FieldParams, FieldTensor, FiniteFieldArith, NotLAX, per_trial_bound, raw

log = logging.getLogger("torch_mirage")

DEFAULT_ERROR_BOUND = 1e-12
FLOAT_TOL = 1e-7          # fp64 evaluation: reassociation error ~1e-15, a real rewrite bug is O(1)
FLOAT_SCALES = (1.0, 1.0, 1e4)   # 1e4: an unguarded exp overflows even in fp64
UNBOUNDED_TRIALS = 4      # trials run when no per-trial bound below 1 could be proven


@dataclass(frozen=True)
class Verdict:
    equivalent: bool
    error_bound: float | None     # probability that a non-equivalent pair passed the field test; None: no field test
    float_max_error: float | None
    reason: str
    trials: int                   # finite-field trials run

    def __bool__(self) -> bool:
        return self.equivalent


# ------------------------------------------------------------------ sides
class _Side:
    """One program, runnable on field values and on fp64 tensors."""

    def __init__(self, program: Any, example_inputs: Sequence):
        self.program = program
        self.is_ugraph = _is_ugraph(program)
        self.graph = None
        self.lower_error: str | None = None
        if not self.is_ugraph:
            if not callable(program):
                raise TypeError(f"verify: expected a μGraph or a callable, got {type(program).__name__}")
            try:
                self.graph = lower_callable(program, example_inputs)
            except Exception as e:  # noqa: BLE001 - any capture failure means: float test only
                self.lower_error = f"{type(e).__name__}: {e}"

    def run_field(self, inputs: list, arith: FiniteFieldArith) -> list:
        if self.is_ugraph:
            from .executor import execute
            return list(execute(self.program, inputs, arith))
        if self.graph is None:
            raise NotLAX(f"could not be captured ({self.lower_error})")
        from .ff_interpret import interpret
        return interpret(self.graph, inputs, arith)

    def run_float(self, inputs: list) -> list:
        if self.is_ugraph:
            from .executor import execute
            return list(execute(self.program, inputs))
        with torch.no_grad():
            out = self.program(*inputs)
        return list(out) if isinstance(out, (tuple, list)) else [out]


def _is_ugraph(x) -> bool:
    from .ugraph import KernelGraph
    return isinstance(x, KernelGraph)


def lower_callable(fn: Callable, example_inputs: Sequence):
    """``fn`` as a project-IR Graph whose inputs are ``example_inputs`` in order (make_fx keeps the
    positional order and unused inputs, which Dynamo's capture does not)."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    from ..capture.lower import lower

    def positional(*xs):   # hides defaulted keyword parameters from make_fx
        return fn(*xs)

    gm = make_fx(torch.func.functionalize(positional), decomposition_table=select_decomp_table(),
                 tracing_mode="fake")(*example_inputs)
    return lower(gm)


# ------------------------------------------------------------------ inputs
def mask_flags(programs: Sequence, example_inputs: Sequence) -> list[bool]:
    """Which float inputs are additive masks: a callable side names the parameter ``*mask*``."""
    flags = [False] * len(example_inputs)
    for prog in programs:
        if _is_ugraph(prog) or not callable(prog):
            continue
        try:
            names = list(inspect.signature(prog).parameters)
        except (TypeError, ValueError):
            continue
        for i, n in enumerate(names[:len(flags)]):
            flags[i] |= "mask" in n.lower()
    return flags


def _bool_mask(shape, rng: torch.Generator) -> torch.Tensor:
    keep = torch.rand(shape, generator=rng) < 0.7
    if len(shape):
        keep[..., 0] = True      # one unmasked entry per row: no all -inf softmax rows
    return keep


def field_inputs(example_inputs, masks, arith: FiniteFieldArith, rng) -> list:
    out = []
    for x, is_mask in zip(example_inputs, masks):
        if not isinstance(x, torch.Tensor):
            out.append(x)
        elif x.dtype is torch.bool:
            out.append(_bool_mask(x.shape, rng))
        elif x.is_floating_point() and is_mask:
            keep = _bool_mask(x.shape, rng)
            out.append(torch.where(keep, arith.zeros(x.shape), arith.full(x.shape, float("-inf"))))
        elif x.is_floating_point():
            out.append(arith.random(x.shape))
        else:
            out.append(x)
    return out


def float_inputs(example_inputs, masks, scale: float, rng) -> list:
    out = []
    for x, is_mask in zip(example_inputs, masks):
        if not isinstance(x, torch.Tensor):
            out.append(x)
        elif x.dtype is torch.bool:
            out.append(_bool_mask(x.shape, rng))
        elif x.is_floating_point() and is_mask:
            out.append(torch.where(_bool_mask(x.shape, rng), 0.0, float("-inf")).double())
        elif x.is_floating_point():
            out.append(torch.randn(x.shape, generator=rng, dtype=torch.float64) * scale)
        else:
            out.append(x)
    return out


# ------------------------------------------------------------------ the two tests
@dataclass
class FieldResult:
    passed: bool | None          # None: not field-testable
    trials: int
    per_trial: float | None      # ε; None when no bound < 1 was proven
    detail: str


def _shape_mismatch(c, r) -> str | None:
    if len(c) != len(r):
        return f"{len(c)} outputs vs {len(r)}"
    for i, (a, b) in enumerate(zip(c, r)):
        if tuple(a.shape) != tuple(b.shape):
            return f"output {i} has shape {tuple(a.shape)}, reference {tuple(b.shape)}"
    return None


def field_test(cand: _Side, ref: _Side, example_inputs, masks, *, target: float, trials: int | None,
               field: FieldParams, rng: torch.Generator) -> FieldResult:
    """Run trials until the per-trial bound ε reaches ``target`` (or exactly ``trials`` trials)."""
    eps, t, needed = None, 0, trials or 1
    while t < needed:
        for _attempt in range(4):
            arith = FiniteFieldArith(field, rng)
            ins = field_inputs(example_inputs, masks, arith, rng)
            try:
                c, r = cand.run_field(ins, arith), ref.run_field(ins, arith)
            except NotLAX as e:
                return FieldResult(None, t, None, f"not LAX: {e}")
            if not arith.zero_division:
                break
        else:
            return FieldResult(None, t, None, "a denominator vanished in 4 random trials in a row")
        t += 1
        bad = _shape_mismatch(c, r)
        if bad:
            return FieldResult(False, t, eps, bad)
        for i, (a, b) in enumerate(zip(c, r)):
            if not isinstance(a, FieldTensor) or not isinstance(b, FieldTensor):
                return FieldResult(None, t, None, f"output {i} is not a field value")
            if not torch.equal(_p_part(a), _p_part(b)):
                n = int((_p_part(a) != _p_part(b)).sum())
                return FieldResult(False, t, eps, f"output {i} differs in {n} of {a.numel()} elements at trial {t}")
        if eps is None:
            eps = max(per_trial_bound(a.deg, b.deg, field) for a, b in zip(c, r))
            if trials is None:
                needed = UNBOUNDED_TRIALS if eps >= 1.0 else max(1, math.ceil(math.log(target) / math.log(eps)))
    return FieldResult(True, t, eps if eps is not None and eps < 1.0 else None, "")


def _p_part(x: FieldTensor) -> torch.Tensor:
    r = raw(x)
    return torch.where(r < 0, -1, r >> 30)   # -inf stays distinguishable


def float_test(cand: _Side, ref: _Side, example_inputs, masks, rng) -> tuple[float | None, str]:
    """Largest relative error over the float trials and a failure message ('' when it passes)."""
    worst = 0.0
    scales = list(FLOAT_SCALES) + ([1.0] if any(masks) or _has_bool(example_inputs) else [])
    for k, scale in enumerate(scales):
        ins = float_inputs(example_inputs, masks, scale, rng)
        try:
            c, r = cand.run_float(ins), ref.run_float(ins)
        except Exception as e:  # noqa: BLE001 - a crash on real inputs is a rejection
            return None, f"float test: raised {type(e).__name__}: {e}"
        bad = _shape_mismatch(c, r)
        if bad:
            return None, f"float test: {bad}"
        for i, (a, b) in enumerate(zip(c, r)):
            a, b = a.double(), b.double()
            fa, fb = torch.isfinite(a), torch.isfinite(b)
            if not torch.equal(fa, fb) or not torch.equal(a[~fa].nan_to_num(0.0), b[~fb].nan_to_num(0.0)):
                return None, (f"float test (scale {scale:g}): output {i} has non-finite values where the "
                              f"other side is finite ({int((~fa).sum())} vs {int((~fb).sum())} non-finite)")
            if fb.any():
                denom = max(float(b[fb].abs().max()), 1e-300)
                err = float((a[fa] - b[fb]).abs().max()) / denom
                worst = max(worst, err)
                if not err <= FLOAT_TOL:
                    return worst, f"float test (scale {scale:g}, trial {k}): output {i} relative error {err:.3g} > {FLOAT_TOL:g}"
    return worst, ""


def _has_bool(xs) -> bool:
    return any(isinstance(x, torch.Tensor) and x.dtype is torch.bool for x in xs)


# ------------------------------------------------------------------ entry point
def verify(candidate, reference, example_inputs: Sequence, *, error_bound: float | None = None,
           trials: int | None = None, field: FieldParams = DEFAULT_FIELD, seed: int | None = None) -> Verdict:
    """Is ``candidate`` equivalent to ``reference`` on inputs shaped like ``example_inputs``?

    ``error_bound``: target probability of accepting a non-equivalent candidate (default 1e-9);
    ``trials``: run exactly this many field trials instead (the achieved bound is reported).
    """
    target = DEFAULT_ERROR_BOUND if error_bound is None else error_bound
    if not 0.0 < target < 1.0:
        raise ValueError(f"verify: error_bound must be in (0, 1), got {target}")
    rng = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
    example_inputs = list(example_inputs)
    masks = mask_flags((candidate, reference), example_inputs)
    cand, ref = _Side(candidate, example_inputs), _Side(reference, example_inputs)

    fr = field_test(cand, ref, example_inputs, masks, target=target, trials=trials, field=field, rng=rng)
    ferr, fmsg = float_test(cand, ref, example_inputs, masks, rng)
    bound = None if fr.per_trial is None else fr.per_trial ** fr.trials

    if fr.passed is False:
        return Verdict(False, bound, ferr, f"finite-field test rejects: {fr.detail}" + (f"; {fmsg}" if fmsg else ""),
                       fr.trials)
    if fmsg:
        field_note = ("finite-field test passed" if fr.passed else f"no finite-field test ({fr.detail})")
        return Verdict(False, bound if fr.passed else None, ferr, f"{fmsg} ({field_note})", fr.trials)
    if fr.passed is None:
        return Verdict(True, None, ferr, f"float test only, no error bound: {fr.detail}", fr.trials)
    if bound is None:
        return Verdict(True, None, ferr, f"finite-field test passed {fr.trials} trials, but no per-trial bound < 1 "
                       "could be proven (too many exp terms for Theorem 2); float test passed", fr.trials)
    note = f"finite-field test passed {fr.trials} trials (per-trial bound {fr.per_trial:.3g}); float test passed"
    return Verdict(True, bound, ferr, note, fr.trials)
