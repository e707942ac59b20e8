"""Equivalence verifier: the finite-field test of Mirage §5 plus a float test.

``verify(candidate, reference, example_inputs)`` compares two programs; each side is a μGraph
(:class:`~torch_mirage.ugraph.KernelGraph`, run by :func:`~.executor.execute`) or a plain PyTorch callable
(lowered through the capture pipeline, interpreted by :mod:`.ff_interpret`).

* **Finite-field test.** Each trial draws every input element uniformly from Z_p × Z_q, a random
  q-th root of unity ω for exp, a random λ for ln 2 (exp2), fresh random values for ``max``, and a
  fresh key for the sqrt hash (:mod:`.finite_field`), runs both sides and compares the outputs' Z_p
  components exactly. The per-trial false-accept bound ε comes from the degree / term-count bounds
  and denominator ids the field values carry (:func:`~.ff_bound.per_trial_bound`, which
  derives it: Schwartz–Zippel on the cleared-denominator difference N1·D2 − N2·D1, each distinct
  denominator counted once — which is what gives softmax(·)@V a finite bound); the number of trials
  t is the least with ε^t ≤ the target ``error_bound`` (Theorem 3), and the verdict reports ε^t.
  What is proven and what is not: the Schwartz–Zippel parts (coefficients, exponent collisions,
  vanishing denominators) are; the part for an exponential sum at the random root of unity,
  (K−1)/q, is proven for K ≤ 2 terms and rests for K ≥ 3 on the uncertainty principle over Z_p
  that Li & Wu conjecture (Mirage's Theorem 2 rests on it too). ``Verdict.bound_proven`` and
  ``Verdict.reason`` say which case a bound is. If the tracked term count explodes anyway the test
  still runs (``UNBOUNDED_TRIALS``) but no bound is claimed (``error_bound=None``). Equivalent LAX
  programs always pass (perfect completeness), except where a non-LAX treatment is not an
  identity: a program whose output depends on a max value (not only through a cancelling shift)
  or on sqrt rewrites, or on a float constant identity that holds only up to rounding, fails — a
  false reject, never a false accept.
* **Non-LAX programs** (tanh, erf, comparisons, clamp, nested exp ...) get no field test: the
  verdict says so in ``reason`` and its ``error_bound`` is ``None``.
* **Float test** (always): several random real inputs in fp64 — unit scale, large magnitude (×1e4,
  where an unsafe softmax overflows) and, for mask inputs (bool tensors, or float inputs whose
  parameter name contains "mask": filled with 0 / −inf), random masks with one unmasked entry per
  row. Outputs must agree in their non-finite pattern (:func:`~torch_mirage.numerics.same_non_finite`) and
  their max-norm relative error over the reference's finite elements
  (:func:`~torch_mirage.numerics.relative_error`) must be within the ``"verify"`` tolerance of
  :data:`~torch_mirage.numerics.TOLERANCE`.

A candidate that fails either test is rejected; the reason names the test, the output and trial.
"""
from __future__ import annotations

import hashlib
import inspect
import logging
import math
from collections import OrderedDict
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Sequence

import torch

from ..cache import cache_key
from ..capture.lower import trace
from ..config import load
from ..numerics import relative_error, same_non_finite, tolerance
from ..ugraph import KernelGraph
from .executor import execute
from .ff_bound import TrialBound, per_trial_bound
from .ff_interpret import interpret
from .ff_field import DEFAULT_FIELD, FieldParams, NotLAX
from .ff_tensor import FieldTensor, raw
from .finite_field import FiniteFieldArith

log = logging.getLogger("torch_mirage")

FLOAT_SCALES = (1.0, 1.0, 1e4)   # 1e4: an unguarded exp overflows even in fp64
UNBOUNDED_TRIALS = 4      # trials run when no per-trial bound below 1 could be proven


@dataclass(frozen=True)
class Verdict:
    equivalent: bool
    error_bound: float | None     # probability that a non-equivalent pair passed the field test; None: no field test
    float_max_error: float | None
    reason: str
    trials: int                   # finite-field trials run
    bound_proven: bool | None = None   # False: error_bound rests on the Li & Wu conjecture (K ≥ 3 exp terms)

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
                self.graph = _lowered(program, example_inputs)
            except Exception as e:  # noqa: BLE001 - any capture failure means: float test only
                self.lower_error = f"{type(e).__name__}: {e}"

    def run_field(self, inputs: list, arith: FiniteFieldArith) -> list:
        if self.is_ugraph:
            return list(execute(self.program, inputs, arith))
        if self.graph is None:
            raise NotLAX(f"could not be captured ({self.lower_error})")
        return interpret(self.graph, inputs, arith)

    def run_float(self, inputs: list) -> list:
        if self.is_ugraph:
            return list(execute(self.program, inputs))
        with torch.no_grad():
            out = self.program(*inputs)
        return list(out) if isinstance(out, (tuple, list)) else [out]


def _is_ugraph(x) -> bool:
    return isinstance(x, KernelGraph)


_LOWERED: "OrderedDict[tuple, Any]" = OrderedDict()
LOWERED_CACHE_SIZE = 32


def _lowered(fn: Callable, example_inputs: Sequence):
    """:func:`~..capture.lower.trace`, cached by (callable, input shapes / dtypes): a search verifies one
    reference against many candidates. Assumes ``fn`` is a pure function of its inputs (its ATen
    graph does not change between calls with inputs of the same shapes and dtypes)."""
    key = (fn, tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("value", x)
                     for x in example_inputs))
    try:
        graph = _LOWERED.pop(key, None)
    except TypeError:                       # unhashable callable or input value: no caching
        return trace(fn, example_inputs)
    if graph is None:
        graph = trace(fn, example_inputs)
    _LOWERED[key] = graph
    while len(_LOWERED) > LOWERED_CACHE_SIZE:
        _LOWERED.popitem(last=False)
    return graph


_VERDICTS: "OrderedDict[str, Verdict]" = OrderedDict()
VERDICT_CACHE_SIZE = 256
VERDICT_KIND = "verdict/1"     # the disk cache's entries: bump when the tests' meaning changes


def _verdict_key(candidate, reference, example_inputs: Sequence, target: float, trials: int | None,
                 field: FieldParams, reference_key: str | None = None) -> str | None:
    """The verdict's key where both sides are μGraphs (their canonical JSON), or the candidate is and the caller
    describes its callable reference (``reference_key``; a callable has no canonical form of its own): the two
    sides, the inputs' shapes and dtypes (a bool input's values too: they are program data), the bound or trial count
    and the field. A model's layers verify the same seed against the same program once per layer otherwise (H100
    11-27: 28 s of the Llama decode graph's partition stage; 3 s a layer on a 2-core CPU)."""
    if not _is_ugraph(candidate):
        return None
    ref = reference.to_json() if _is_ugraph(reference) else reference_key
    if ref is None:
        return None
    h = hashlib.sha256()
    for part in (candidate.to_json(), ref, repr((target, trials, field))):
        h.update(part.encode())
    for x in example_inputs:
        if not isinstance(x, torch.Tensor):
            h.update(repr(("value", x)).encode())
            continue
        h.update(repr((tuple(x.shape), str(x.dtype))).encode())
        if x.dtype is torch.bool:
            h.update(x.detach().cpu().numpy().tobytes())
    return h.hexdigest()


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


def band_of(program) -> tuple | None:
    """The for-loop band of a μGraph's block graph (:func:`~torch_mirage.ugraph.band_range`), None without one."""
    for op in getattr(program, "ops", ()) if _is_ugraph(program) else ():
        band = getattr(op.body, "forloop_band", None)
        if band is not None:
            return band
    return None


def _band_mask(shape, band: tuple, keep: torch.Tensor) -> torch.Tensor:
    """``keep`` (random, over (..., rows, keys)) inside the band only, with each row's last visible key kept:
    the band is a precondition on the mask (the claimer reads it off the mask's value property), so the random
    masks both tests draw satisfy it."""
    period, offset, window = band[3], band[4], band[5]
    rows, keys = shape[-2], shape[-1]
    pos = torch.arange(rows)[:, None] % period
    j = torch.arange(keys)[None, :]
    inside = j <= pos + offset
    if window is not None:
        inside &= j > pos + offset - window
    if len(band) > 6 and band[6] is not None:   # the mask is 0 wherever the band sees: exactly the band
        return inside.expand(keep.shape).clone()
    diag = j == (pos + offset).clamp(max=keys - 1)
    return (keep & inside) | (diag & inside)


def _random_inputs(example_inputs, masks, rng, value, masked, band: tuple | None = None) -> list:
    """Fresh inputs shaped like ``example_inputs``: bool tensors become random masks, float mask inputs
    ``masked(keep)`` (inside ``band`` where the candidate has one), other float tensors ``value(shape)``;
    everything else is passed through."""
    out = []
    for x, is_mask in zip(example_inputs, masks):
        if not isinstance(x, torch.Tensor) or not (x.dtype is torch.bool or x.is_floating_point()):
            out.append(x)
        elif x.dtype is torch.bool:
            out.append(_bool_mask(x.shape, rng))
        elif is_mask:
            keep = _bool_mask(x.shape, rng)
            if band is not None and x.dim() >= 2:
                keep = _band_mask(x.shape, band, keep)
            out.append(masked(keep))
        else:
            out.append(value(x.shape))
    return out


def field_inputs(example_inputs, masks, arith: FiniteFieldArith, rng, band: tuple | None = None) -> list:
    return _random_inputs(example_inputs, masks, rng, arith.random,
                          lambda keep: torch.where(keep, arith.zeros(keep.shape), arith.full(keep.shape, float("-inf"))),
                          band)


def float_inputs(example_inputs, masks, scale: float, rng, band: tuple | None = None) -> list:
    return _random_inputs(example_inputs, masks, rng,
                          lambda shape: torch.randn(shape, generator=rng, dtype=torch.float64) * scale,
                          # under a band, masked scores at the claimer's finite floor: a tile some row sees
                          # none of keeps the fp64 online softmax defined (exp(-1e30 - m) is exactly 0)
                          lambda keep: torch.where(keep, 0.0, -1e30 if band is not None else float("-inf")).double(),
                          band)


# ------------------------------------------------------------------ the two tests
@dataclass
class FieldResult:
    passed: bool | None          # None: not field-testable
    trials: int
    per_trial: float | None      # ε; None when no bound < 1 was proven
    detail: str
    bound: TrialBound | None = None   # the worst output's bound (K, provenness)


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
    tb, t, needed = None, 0, trials or 1
    eps = None
    while t < needed:
        for _attempt in range(4):
            arith = FiniteFieldArith(field, rng)
            ins = field_inputs(example_inputs, masks, arith, rng, band_of(cand.program) or band_of(ref.program))
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
            return FieldResult(False, t, eps, bad, tb)
        for i, (a, b) in enumerate(zip(c, r)):
            if not isinstance(a, FieldTensor) or not isinstance(b, FieldTensor):
                return FieldResult(None, t, None, f"output {i} is not a field value")
            if not torch.equal(_p_part(a), _p_part(b)):
                n = int((_p_part(a) != _p_part(b)).sum())
                return FieldResult(False, t, eps, f"output {i} differs in {n} of {a.numel()} elements at trial {t}",
                                   tb)
        if tb is None:
            tb = _worst_bound(c, r, arith)
            eps = tb.eps if tb.eps < 1.0 else None
            if trials is None:
                needed = UNBOUNDED_TRIALS if eps is None else max(1, math.ceil(math.log(target) / math.log(eps)))
    return FieldResult(True, t, eps, "", tb)


def _worst_bound(c: list, r: list, arith: FiniteFieldArith) -> TrialBound:
    """The largest per-trial bound over the output pairs (the degrees do not depend on the draw)."""
    bounds = [per_trial_bound(a.deg, b.deg, arith.f, arith.zero_risk) for a, b in zip(c, r)]
    worst = max(bounds, key=lambda x: x.eps)
    proven = all(x.proven for x in bounds) and arith.zero_risk_proven
    return TrialBound(worst.eps, max(x.terms for x in bounds), proven)


def _p_part(x: FieldTensor) -> torch.Tensor:
    r = raw(x)
    return torch.where(r < 0, -1, r >> 30)   # -inf stays distinguishable


def float_test(cand: _Side, ref: _Side, example_inputs, masks, rng) -> tuple[float | None, str]:
    """Largest relative error over the float trials and a failure message ('' when it passes)."""
    worst, tol = 0.0, tolerance(torch.float64, "verify")
    scales = list(FLOAT_SCALES) + ([1.0] if any(masks) or _has_bool(example_inputs) else [])
    for k, scale in enumerate(scales):
        ins = float_inputs(example_inputs, masks, scale, rng, band_of(cand.program) or band_of(ref.program))
        try:
            c, r = cand.run_float(ins), ref.run_float(ins)
        except Exception as e:  # noqa: BLE001 - a crash on real inputs is a rejection
            return None, f"float test: raised {type(e).__name__}: {e}"
        bad = _shape_mismatch(c, r)
        if bad:
            return None, f"float test: {bad}"
        for i, (a, b) in enumerate(zip(c, r)):
            if not same_non_finite(a, b):
                return None, (f"float test (scale {scale:g}): output {i} has non-finite values where the "
                              f"other side is finite ({int((~torch.isfinite(a)).sum())} vs "
                              f"{int((~torch.isfinite(b)).sum())} non-finite)")
            err = relative_error(a, b, where=b, norm="max")
            worst = max(worst, err)
            if not err <= tol:
                return worst, f"float test (scale {scale:g}, trial {k}): output {i} relative error {err:.3g} > {tol:g}"
    return worst, ""


def _has_bool(xs) -> bool:
    return any(isinstance(x, torch.Tensor) and x.dtype is torch.bool for x in xs)


# ------------------------------------------------------------------ entry point
def verify(candidate, reference, example_inputs: Sequence, *, error_bound: float | None = None,
           trials: int | None = None, field: FieldParams = DEFAULT_FIELD, seed: int | None = None,
           cache: Any = None, reference_key: str | None = None) -> Verdict:
    """Is ``candidate`` equivalent to ``reference`` on inputs shaped like ``example_inputs``?

    ``error_bound``: target probability of accepting a non-equivalent candidate (default: the configuration's
    ``verify_error_bound``, ``MIRAGE_VERIFY_ERROR_BOUND``); ``trials``: run exactly this many field trials
    instead (default: the ``verify_trials`` knob, ``MIRAGE_VERIFY_TRIALS``; 0 derives the count from the bound,
    as the knob's 0 does; the achieved bound is reported). A caller holding a configuration (the search
    claimer's ``ctx.config``) passes both, so ``options=`` reach the verifier. Two μGraphs verified alike before
    in this process (same graphs, input shapes, bound; no ``seed``) get that verdict again (:func:`_verdict_key`);
    with ``cache`` (the compile's :class:`~..cache.DiskCache`), across processes too: a warm compile of a model
    re-verifies nothing. A callable ``reference`` is kept so only with ``reference_key``, a stable description
    of what it computes (its parameters included). The backend's float check of every region against eager still runs on each compile.
    """
    cfg = load() if error_bound is None or trials is None else None
    target = cfg.verify_error_bound if error_bound is None else error_bound
    trials = (cfg.verify_trials if trials is None else trials) or None
    if not 0.0 < target < 1.0:
        raise ValueError(f"verify: error_bound must be in (0, 1), got {target}")
    example_inputs = list(example_inputs)
    key = _verdict_key(candidate, reference, example_inputs, target, trials, field, reference_key) \
        if seed is None else None
    if key is not None and (known := _VERDICTS.get(key)) is not None:
        _VERDICTS.move_to_end(key)
        return known
    disk_key = cache_key(kind=VERDICT_KIND, verdict=key) if key is not None and cache is not None else None
    stored = cache.get_json(disk_key) if disk_key is not None else None
    if isinstance(stored, dict) and set(stored) == {f.name for f in fields(Verdict)}:
        verdict = Verdict(**stored)
    else:
        verdict = _verify(candidate, reference, example_inputs, target, trials, field, seed)
        if disk_key is not None:
            cache.put_json(disk_key, asdict(verdict))
    if key is not None:
        _VERDICTS[key] = verdict
        while len(_VERDICTS) > VERDICT_CACHE_SIZE:
            _VERDICTS.popitem(last=False)
    return verdict


def _verify(candidate, reference, example_inputs: list, target: float, trials: int | None, field: FieldParams,
            seed: int | None) -> Verdict:
    """:func:`verify`'s tests, run."""
    rng = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
    masks = mask_flags((candidate, reference), example_inputs)
    cand, ref = _Side(candidate, example_inputs), _Side(reference, example_inputs)

    fr = field_test(cand, ref, example_inputs, masks, target=target, trials=trials, field=field, rng=rng)
    ferr, fmsg = float_test(cand, ref, example_inputs, masks, rng)
    bound = None if fr.per_trial is None else fr.per_trial ** fr.trials

    proven = None if bound is None or fr.bound is None else fr.bound.proven
    if fr.passed is False:
        return Verdict(False, bound, ferr, f"finite-field test rejects: {fr.detail}" + (f"; {fmsg}" if fmsg else ""),
                       fr.trials, proven)
    if fmsg:
        field_note = ("finite-field test passed" if fr.passed else f"no finite-field test ({fr.detail})")
        return Verdict(False, bound if fr.passed else None, ferr, f"{fmsg} ({field_note})", fr.trials,
                       proven if fr.passed else None)
    if fr.passed is None:
        return Verdict(True, None, ferr, f"float test only, no error bound: {fr.detail}", fr.trials)
    if bound is None:
        return Verdict(True, None, ferr, f"finite-field test passed {fr.trials} trials, but no per-trial bound < 1 "
                       f"could be proven (K = {fr.bound.terms:.3g} exp terms in the cleared difference: too many, or "
                       "too high degrees, for Theorem 2); float test passed", fr.trials)
    note = (f"finite-field test passed {fr.trials} trials (per-trial bound {fr.per_trial:.3g}, "
            f"{_provenance(fr.bound)}); float test passed")
    return Verdict(True, bound, ferr, note, fr.trials, proven)


def _provenance(tb: TrialBound) -> str:
    if tb.proven and tb.terms == 0:
        return "proven: Schwartz-Zippel on the cleared rational functions, no exp"
    if tb.proven:
        return f"proven: Schwartz-Zippel, K = {tb.terms:.3g} <= 2 exp terms"
    return (f"rests on the conjecture of Li & Wu (uncertainty principle over Z_p, Mirage Theorem 2) for the "
            f"K = {tb.terms:.3g}-term exponential sums; the Schwartz-Zippel parts are proven")
