"""The equivalence verifier: finite-field arithmetic, the field test, the float test, verdicts."""
import dataclasses
import math
import time

import pytest
import torch

from torch_mirage import numerics
from torch_mirage.superopt import library as L
from torch_mirage.superopt import verify
from torch_mirage.superopt.ff_field import DEFAULT_FIELD, TINY_FIELD, FieldParams, is_prime, matmul_mod
from torch_mirage.superopt.ff_tensor import raw
from torch_mirage.superopt.finite_field import FiniteFieldArith, ln2_form
from torch_mirage.superopt.verify import _Side, _worst_bound, field_inputs, field_test, mask_flags


# ------------------------------------------------------------------ field arithmetic
def test_field_parameters():
    for f in (DEFAULT_FIELD, TINY_FIELD):
        assert is_prime(f.p) and is_prime(f.q) and (f.p - 1) % f.q == 0
    assert DEFAULT_FIELD.q > 2**29
    with pytest.raises(ValueError):
        FieldParams(169, 83)


def test_matmul_mod_does_not_overflow():
    p = DEFAULT_FIELD.p
    g = torch.Generator().manual_seed(1)
    k = (1 << 15) + 7                                  # more than one contraction chunk
    a = p - 1 - torch.randint(0, 3, (2, k), generator=g)   # residues near p: worst case for overflow
    b = p - 1 - torch.randint(0, 3, (k, 3), generator=g)
    got = matmul_mod(a, b, p)
    want = [[sum(int(x) * int(y) for x, y in zip(a[i].tolist(), b[:, j].tolist())) % p for j in range(3)]
            for i in range(2)]
    assert got.tolist() == want


def test_field_identities():
    A = FiniteFieldArith(rng=torch.Generator().manual_seed(3))
    x, y = A.random((5, 6)), A.random((5, 6))
    assert torch.equal(raw(A.exp(A.add(x, y))), raw(A.mul(A.exp(x), A.exp(y))))   # ω^(a+b) = ω^a ω^b
    assert torch.equal(raw(A.mul(A.div(x, y), y)), raw(x))
    assert pow(A.omega, DEFAULT_FIELD.q, DEFAULT_FIELD.p) == 1
    assert torch.equal(raw(A.mul(A.sqrt(x), A.rsqrt(x))), raw(A.full((5, 6), 1)))
    masked = A.add(x, A.full((5, 6), float("-inf")))
    assert bool((raw(A.exp(masked)) == 0).all())                                    # exp(-inf) = 0
    with pytest.raises(TypeError):
        x + y                                                                       # no real arithmetic on residues


# ------------------------------------------------------------------ programs
def distrib_ref(x, y, z):
    return (x + y) @ z


def distrib(x, y, z):
    return x @ z + y @ z


def softmax_ref(x):
    return torch.softmax(x / 8.0, -1)


def _online(x, rescale=True, split=8):
    a, b = x[:, :split] / 8.0, x[:, split:] / 8.0
    m1 = a.amax(-1, keepdim=True)
    l1 = torch.exp(a - m1).sum(-1, keepdim=True)
    m = torch.maximum(m1, b.amax(-1, keepdim=True))
    l = (l1 * torch.exp(m1 - m) if rescale else l1) + torch.exp(b - m).sum(-1, keepdim=True)
    return torch.exp(x / 8.0 - m) / l


def online_softmax(x):
    return _online(x)


def online_softmax_no_rescale(x):
    return _online(x, rescale=False)


def lora_ref(x, w, a, b):
    return x @ w + (x @ a) @ b


def lora_concat(x, w, a, b):
    return torch.cat([x, x @ a], 1) @ torch.cat([w, b], 0)


def lora_concat_drop_last(x, w, a, b):     # off-by-one tile: the last column of X never used
    return torch.cat([x[:, :-1], x @ a], 1) @ torch.cat([w[:-1], b], 0)


def rms_linear_ref(x, g, w):
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g) @ w


def rms_linear_div_after(x, g, w):
    return ((x * g) @ w) / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def rms_linear_wrong_dim(x, g, w):
    return ((x * g) @ w) / torch.sqrt(x.pow(2).mean(0, keepdim=True).mean(-1, keepdim=True) + 1e-6)


def rms_linear_swapped_div(x, g, w):
    return torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) / ((x * g) @ w)


def attention(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / 8.0, -1) @ v


def attention_wrong_scale(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / 64.0, -1) @ v


def masked_attention(q, k, v, mask):
    return torch.softmax(q @ k.transpose(-1, -2) / 8.0 + mask, -1) @ v


def masked_attention_late_norm(q, k, v, mask):
    s = q @ k.transpose(-1, -2) / 8.0 + mask
    p = torch.exp(s - s.amax(-1, keepdim=True))
    return (p @ v) / p.sum(-1, keepdim=True)


def unsafe_softmax(x):
    e = torch.exp(x / 8.0)
    return e / e.sum(-1, keepdim=True)


def r(*shape):
    return torch.randn(*shape)


EQUIVALENT = [
    ("distributive", distrib, distrib_ref, lambda: [r(4, 8), r(4, 8), r(8, 5)]),
    ("online_softmax", online_softmax, softmax_ref, lambda: [r(4, 16)]),
    ("lora_concat", lora_concat, lora_ref, lambda: [r(4, 16), r(16, 8), r(16, 2), r(2, 8)]),
    ("rmsnorm_linear_div_after", rms_linear_div_after, rms_linear_ref, lambda: [r(4, 16), r(16), r(16, 8)]),
]

NEAR_MISSES = [
    ("wrong_reduction_dim", rms_linear_wrong_dim, rms_linear_ref, lambda: [r(4, 16), r(16), r(16, 8)]),
    ("swapped_div_operands", rms_linear_swapped_div, rms_linear_ref, lambda: [r(4, 16), r(16), r(16, 8)]),
    ("missing_rescale", online_softmax_no_rescale, softmax_ref, lambda: [r(4, 16)]),
    ("off_by_one_tile", lora_concat_drop_last, lora_ref, lambda: [r(4, 16), r(16, 8), r(16, 2), r(2, 8)]),
    ("wrong_scale", attention_wrong_scale, attention, lambda: [r(2, 4, 64), r(2, 16, 64), r(2, 16, 8)]),
]


@pytest.mark.parametrize("name,cand,ref,inputs", EQUIVALENT, ids=[e[0] for e in EQUIVALENT])
def test_accepts_equivalent_callables(name, cand, ref, inputs):
    v = verify(cand, ref, inputs(), error_bound=1e-12)
    assert v.equivalent, v.reason
    assert v.error_bound is not None and v.error_bound <= 1e-12, v
    assert "finite-field test passed" in v.reason and v.trials >= 1
    assert v.float_max_error is not None and v.float_max_error < 1e-9


@pytest.mark.parametrize("name,cand,ref,inputs", NEAR_MISSES, ids=[e[0] for e in NEAR_MISSES])
def test_rejects_near_misses_in_the_field(name, cand, ref, inputs):
    v = verify(cand, ref, inputs())
    assert not v.equivalent
    assert v.reason.startswith("finite-field test rejects"), v.reason


def test_masked_attention_is_field_tested_with_symbolic_minus_inf():
    qkv = [r(2, 4, 16), r(2, 8, 16), r(2, 8, 4), torch.zeros(2, 4, 8)]
    assert mask_flags((masked_attention,), qkv) == [False, False, False, True]
    v = verify(masked_attention_late_norm, masked_attention, qkv)
    assert v.equivalent and "finite-field test passed" in v.reason, v.reason
    w = verify(lambda q, k, v_, mask: masked_attention(q, k, v_, 0 * mask), masked_attention, qkv)
    assert not w.equivalent          # ignoring the mask is caught


def test_float_test_rejects_unsafe_softmax_the_field_cannot_see():
    v = verify(unsafe_softmax, softmax_ref, [r(4, 16)])
    assert not v.equivalent
    assert "float test (scale 10000)" in v.reason and "finite-field test passed" in v.reason


def test_non_lax_program_gets_float_test_only():
    def ref(x):
        return torch.erf(x) * 2

    v = verify(lambda x: 2 * torch.erf(x), ref, [r(3, 5)])
    assert v.equivalent and v.error_bound is None and "float test only" in v.reason
    bad = verify(lambda x: 2 * torch.erf(x) + 1e-3, ref, [r(3, 5)])
    assert not bad.equivalent and bad.reason.startswith("float test")


def test_float_test_tolerance_is_the_numerics_tables(monkeypatch):
    """The float test reads numerics.TOLERANCE["verify"] (one table), in the max norm."""
    def ref(x):
        return torch.erf(x) * 2

    def near(x):
        return torch.erf(x) * (2 + 2e-6)    # max-norm relative error 1e-6: off for fp64, a rewrite bug

    v = verify(near, ref, [r(3, 5)])
    assert not v.equivalent and "relative error 1e-06 > 1e-07" in v.reason, v.reason
    monkeypatch.setitem(numerics.TOLERANCE["verify"], torch.float64, 1e-5)
    v = verify(near, ref, [r(3, 5)])
    assert v.equivalent and 5e-7 < v.float_max_error < 2e-6, v


def test_tanh_is_an_uninterpreted_function_in_the_field():
    """tanh (attention's soft-cap) gets the field test: equal arguments compare equal, others do not."""
    v = verify(lambda x: 2 * torch.tanh(x), lambda x: torch.tanh(x) * 2, [r(3, 5)])
    assert v.equivalent and v.error_bound is not None, v.reason
    bad = verify(lambda x: torch.tanh(x * 1.5), lambda x: torch.tanh(x) * 1.5, [r(3, 5)])
    assert not bad.equivalent and bad.reason.startswith("finite-field test rejects"), bad.reason


def test_trials_follow_the_target_bound():
    xs = [r(4, 8), r(4, 8), r(8, 5)]
    loose = verify(distrib, distrib_ref, xs, error_bound=1e-6)
    tight = verify(distrib, distrib_ref, xs, error_bound=1e-30)
    assert loose.trials < tight.trials and tight.error_bound <= 1e-30 < loose.error_bound
    fixed = verify(distrib, distrib_ref, xs, trials=3)
    assert fixed.trials == 3


def _false_accepts(field, cand, ref, inputs, n):
    xs = inputs()
    c, rf = _Side(cand, xs), _Side(ref, xs)
    masks = [False] * len(xs)
    hits = 0
    for seed in range(n):
        res = field_test(c, rf, xs, masks, target=0.5, trials=1, field=field, rng=torch.Generator().manual_seed(seed))
        hits += bool(res.passed)
    return hits


def test_tiny_field_falsely_accepts_near_misses_ours_does_not():
    # p = 167, q = 83: ω = 1 (prob 1/83) or a colliding exponent makes the missing rescale invisible.
    n = 400

    def near_miss(x):
        return _online(x, rescale=False, split=1)

    tiny = _false_accepts(TINY_FIELD, near_miss, softmax_ref, lambda: [r(1, 2)], n)
    ours = _false_accepts(DEFAULT_FIELD, near_miss, softmax_ref, lambda: [r(1, 2)], n)
    assert tiny >= 3, tiny            # expected ≈ n·2/83 ≈ 10
    assert ours == 0


def _bound_for(field, cand, ref, xs):
    arith = FiniteFieldArith(field, torch.Generator().manual_seed(0))
    ins = field_inputs(xs, [False] * len(xs), arith, arith.rng)
    return _worst_bound(_Side(cand, xs).run_field(ins, arith), _Side(ref, xs).run_field(ins, arith), arith)


def test_per_trial_bound_covers_the_observed_false_accept_rate():
    # On a small field false accepts are frequent enough to count; the derived ε must cover them.
    field, n = FieldParams(983, 491), 300

    def near_miss(x):
        return _online(x, rescale=False, split=1)

    eps = _bound_for(field, near_miss, softmax_ref, [r(1, 2)]).eps
    hits = _false_accepts(field, near_miss, softmax_ref, lambda: [r(1, 2)], n)
    assert 0 < eps < 0.1
    assert hits <= eps * n + 3 * math.sqrt(eps * n), (hits, eps)


def test_verify_is_fast_on_small_shapes():
    xs = [r(4, 16), r(16), r(16, 8)]
    verify(rms_linear_div_after, rms_linear_ref, xs)      # warm-up (tracing machinery)
    t = time.perf_counter()
    verify(rms_linear_div_after, rms_linear_ref, xs)
    verify(online_softmax, softmax_ref, [r(4, 16)])
    assert (time.perf_counter() - t) / 2 < 1.0


# ------------------------------------------------------------------ μGraphs
SMALL = {"rmsnorm_linear": (4, 64, 32), "gated_mlp": (4, 64, 32), "lora": (8, 64, 32, 4),
         "gqa_flashdecoding": (1, 2, 4, 32, 16), "gqa_flashattention": (1, 2, 4, 32, 16),
         "qknorm_attention": (1, 2, 4, 32, 16), "ntrans": (4, 64)}


@pytest.mark.parametrize("name", list(L.WORKLOADS))
def test_library_ugraphs_verify_against_their_programs(name):
    w = L.WORKLOADS[name]
    dims = SMALL[name]
    g = w.build(*dims, dtype="float32")
    v = verify(g, w.reference, [torch.randn(s) for s in w.input_shapes(*dims)])
    assert v.equivalent, v.reason
    assert "finite-field test passed" in v.reason, v.reason
    assert v.error_bound is not None and v.error_bound <= 1e-9, v.reason


def test_ugraph_near_miss_rejected_in_the_field():
    w = L.WORKLOADS["rmsnorm_linear"]
    g = w.build(4, 64, 32, dtype="float32")

    def wrong_scale(x, gw, wt):     # mean over k replaced by a sum: off by a factor √k
        return (x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True)) * gw) @ wt

    v = verify(g, wrong_scale, [torch.randn(s) for s in w.input_shapes(4, 64, 32)])
    assert not v.equivalent and v.reason.startswith("finite-field test rejects"), v.reason


# ------------------------------------------------------------------ attention: shared denominators
def _flash(q, k, v, tile=4, rescale=True, use_exp2=False):
    """Online-softmax attention over KV tiles, written out (FlashAttention's loop)."""
    scale = 1 / math.sqrt(q.shape[-1])
    if use_exp2:   # Triton style: base 2, log2(e) folded into the scale
        scale *= 1 / math.log(2)
    ex = torch.exp2 if use_exp2 else torch.exp
    m = l = o = None
    for s0 in range(0, k.shape[-2], tile):
        s = q @ k[..., s0:s0 + tile, :].transpose(-1, -2) * scale
        mt = s.amax(-1, keepdim=True)
        m_new = mt if m is None else torch.maximum(m, mt)
        p = ex(s - m_new)
        pv = p @ v[..., s0:s0 + tile, :]
        if m is None:
            l, o = p.sum(-1, keepdim=True), pv
        else:
            alpha = ex(m - m_new) if rescale else 1.0
            l, o = alpha * l + p.sum(-1, keepdim=True), alpha * o + pv
        m = m_new
    return o / l


def flash(q, k, v):
    return _flash(q, k, v)


def flash_exp2(q, k, v):
    return _flash(q, k, v, use_exp2=True)


def flash_no_rescale(q, k, v):
    return _flash(q, k, v, rescale=False)


def _split_kv(q, k, v, splits=2, weigh_sums=True):
    """FlashDecoding: softmax statistics per KV split, then a combine rescaling each split by exp(m_s − M)."""
    n = k.shape[-2] // splits
    parts = []
    for i in range(splits):
        s = q @ k[..., i * n:(i + 1) * n, :].transpose(-1, -2) / math.sqrt(q.shape[-1])
        m = s.amax(-1, keepdim=True)
        p = torch.exp(s - m)
        parts.append((m, p.sum(-1, keepdim=True), p @ v[..., i * n:(i + 1) * n, :]))
    big = parts[0][0]
    for m, _, _ in parts[1:]:
        big = torch.maximum(big, m)
    num = sum(torch.exp(m - big) * o for m, _, o in parts)
    den = sum((torch.exp(m - big) if weigh_sums else 1.0) * l for m, l, _ in parts)
    return num / den


def split_kv(q, k, v):
    return _split_kv(q, k, v)


def split_kv_unweighted_sums(q, k, v):     # wrong combine: the split sums l_s are not rescaled
    return _split_kv(q, k, v, weigh_sums=False)


def attention_1_over_d(q, k, v):           # wrong scale: 1/d instead of 1/√d
    return torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1], -1) @ v


def attention_ignoring_mask(q, k, v, mask):
    return L.attention_ref(q, k, v)


def _masked_flash(q, k, v, mask, tile=4):
    s_all = q @ k.transpose(-1, -2) / 8.0 + mask
    m = l = o = None
    for s0 in range(0, k.shape[-2], tile):
        s = s_all[..., s0:s0 + tile]
        mt = s.amax(-1, keepdim=True)
        m_new = mt if m is None else torch.maximum(m, mt)
        p = torch.exp(s - m_new)
        l = p.sum(-1, keepdim=True) if m is None else torch.exp(m - m_new) * l + p.sum(-1, keepdim=True)
        o = p @ v[..., s0:s0 + tile, :] if m is None else torch.exp(m - m_new) * o + p @ v[..., s0:s0 + tile, :]
        m = m_new
    return o / l


ATTN = (1, 2, 4, 16, 16)     # b, h, sq, kv, d


def _qkv(b, h, sq, kv, d):
    return [torch.randn(b, h, sq, d), torch.randn(b, h, kv, d), torch.randn(b, h, kv, d)]


ATTENTION_EQUIVALENT = [
    ("ugraph_flashattention", lambda: L.gqa_flashattention(*ATTN, dtype="float32", forloop_range=4)),
    ("ugraph_flashdecoding", lambda: L.gqa_flashdecoding(*ATTN, dtype="float32", splits=2, forloop_range=2)),
    ("flash_callable", lambda: flash),
    ("flash_exp2_callable", lambda: flash_exp2),
    ("split_kv_callable", lambda: split_kv),
]


@pytest.mark.parametrize("name,cand", ATTENTION_EQUIVALENT, ids=[e[0] for e in ATTENTION_EQUIVALENT])
def test_attention_gets_a_finite_bound(name, cand):
    cand = cand()
    xs = _qkv(*ATTN)
    verify(cand, L.attention_ref, xs)                   # warm-up (tracing machinery)
    t = time.perf_counter()
    v = verify(cand, L.attention_ref, _qkv(*ATTN))
    elapsed = time.perf_counter() - t
    assert v.equivalent, v.reason
    assert v.error_bound is not None and v.error_bound <= 1e-9, v.reason
    # softmax(·)@V differences have K = 2·kv² exp terms: the bound rests on the conjecture, and says so
    assert v.bound_proven is False and "conjecture" in v.reason, v.reason
    assert elapsed < 1.0, elapsed


def test_masked_attention_gets_a_finite_bound():
    qkv = _qkv(1, 2, 4, 8, 16)[:3] + [torch.zeros(1, 2, 4, 8)]
    for cand in (masked_attention_late_norm, _masked_flash):
        v = verify(cand, masked_attention, qkv)
        assert v.equivalent and v.error_bound is not None and v.error_bound <= 1e-9, v.reason


def _wrong_scale_reference(q, k, v):
    return attention_1_over_d(q, k, v)


ATTENTION_NEAR_MISSES = [
    ("missing_rescale", lambda: flash_no_rescale, L.attention_ref, _qkv(*ATTN)),
    ("wrong_scale_1_over_d", lambda: attention_1_over_d, L.attention_ref, _qkv(*ATTN)),
    ("ugraph_vs_wrong_scale", lambda: L.gqa_flashattention(*ATTN, dtype="float32", forloop_range=4),
     _wrong_scale_reference, _qkv(*ATTN)),
    ("mask_ignored", lambda: attention_ignoring_mask, masked_attention,
     _qkv(1, 2, 4, 8, 16) + [torch.zeros(1, 2, 4, 8)]),
    ("wrong_kv_split_combine", lambda: split_kv_unweighted_sums, L.attention_ref, _qkv(*ATTN)),
]


@pytest.mark.parametrize("name,cand,ref,xs", ATTENTION_NEAR_MISSES, ids=[e[0] for e in ATTENTION_NEAR_MISSES])
def test_attention_near_misses_rejected_in_the_field(name, cand, ref, xs):
    v = verify(cand(), ref, xs)
    assert not v.equivalent
    assert v.reason.startswith("finite-field test rejects"), v.reason


def test_softmax_rows_share_one_denominator():
    A = FiniteFieldArith(rng=torch.Generator().manual_seed(5))
    x, vals = A.random((3, 6)), A.random((6, 2))
    e = A.exp(x)
    p = A.div(e, A.sum(e, -1))                       # e / l, l broadcast along the row
    ids = p.den
    assert bool((ids == ids[:, :1]).all()) and len(set(ids[:, 0].tolist())) == 3
    o = A.matmul(p, vals)
    assert (o.deg.kn, o.deg.kd) == (6, 6)            # (Σ_j e_j v_j) / l: one l, not l^6
    assert A.sum(p, -1).deg.kd == 6
    # layout ops carry the ids: the transposed rows still share theirs
    pt = p.transpose(0, 1)
    assert bool((pt.den == ids.transpose(0, 1)).all())
    assert A.sum(pt, 0).deg.kd == 6
    # a buffer assembled tile by tile keeps them too
    out = A.zeros((3, 6))
    out[:, :3], out[:, 3:] = p[:, :3], p[:, 3:]
    assert bool((out.den == ids).all()) and A.sum(out, -1).deg.kd == 6
    # distinct denominators are all counted: Σ_j x_j / y_j has degree-6 denominators
    y = A.random((3, 6))
    assert A.sum(A.div(x, y), -1).deg.dd == 6
    assert A.sum(A.div(x, A.sum(y, -1)), -1).deg.dd == 1


def test_exp2_is_exp_of_x_ln2_with_one_base():
    A = FiniteFieldArith(rng=torch.Generator().manual_seed(7))
    x = A.random((4, 5))
    assert torch.equal(raw(A.exp2(A.mul(x, 1 / math.log(2)))), raw(A.exp(x)))
    assert torch.equal(raw(A.exp2(A.mul(x, 1.44269504))), raw(A.exp(x)))          # Triton's float32 literal
    assert torch.equal(raw(A.exp2(A.mul(x, 0.125 / math.log(2)))), raw(A.exp(A.mul(x, 0.125))))
    assert torch.equal(raw(A.exp2(x)), raw(A.exp(A.mul(x, math.log(2)))))
    assert not torch.equal(raw(A.exp2(x)), raw(A.exp(x)))
    assert ln2_form(math.log(2)) == (1, 0, 1) and ln2_form(-4 / math.log(2)) == (-1, 2, -1)
    assert ln2_form(0.7) is None and ln2_form(1 / math.sqrt(48)) is None


def softmax_exp2(x):
    s = x * (0.125 / math.log(2))
    e = torch.exp2(s - s.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def softmax_exp2_no_log2e(x):
    s = x * 0.125
    e = torch.exp2(s - s.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def scale_by_division(x):
    return x / math.sqrt(48)


def scale_by_reciprocal(x):
    return x * (1 / math.sqrt(48))


def test_exp2_and_exp_programs_compare():
    v = verify(softmax_exp2, softmax_ref, [r(4, 16)])
    assert v.equivalent and v.error_bound is not None and v.error_bound <= 1e-9, v.reason
    w = verify(softmax_exp2_no_log2e, softmax_ref, [r(4, 16)])
    assert not w.equivalent and w.reason.startswith("finite-field test rejects"), w.reason


def test_float_constants_are_canonical():
    v = verify(scale_by_division, scale_by_reciprocal, [r(3, 48)])
    assert v.equivalent and v.error_bound is not None and v.error_bound <= 1e-12, v.reason
    assert v.bound_proven is True
    # a μGraph scaling by 1/√48 against a program dividing by √48, inside attention
    dims = (1, 1, 4, 8, 48)
    g = L.gqa_flashattention(*dims, dtype="float32", forloop_range=2)
    u = verify(g, L.attention_ref, _qkv(*dims))
    assert u.equivalent and u.error_bound is not None and u.error_bound <= 1e-9, u.reason


def layer_norm_ref(x):
    mu = x.mean(-1, keepdim=True)
    return (x - mu) * torch.rsqrt(((x - mu) ** 2).mean(-1, keepdim=True) + 1e-5)


def layer_norm_shifted(x):      # the weight-streaming seed's form: the rows less their first column first
    return layer_norm_ref(x - x[:, :1])


def layer_norm_shifted_wrong(x):      # shifted by a column vector, not a row constant: not a LayerNorm of x
    return layer_norm_ref(x - x[:1, :])


def test_reciprocals_of_integers_are_exact_in_the_field():
    """fl(1/n) stands for 1/n (module docstring of finite_field): ``k · mean`` is the sum and a LayerNorm does
    not see a row-constant shift — identities the weight-streaming seed's shifted LayerNorm rests on —, over a
    row of 103 (1/103 is not a binary rational) and a row of 48; a shift that is not row-constant is rejected."""
    from fractions import Fraction

    from torch_mirage.superopt.ff_field import reciprocal_of
    assert reciprocal_of(1.0 / 103) == Fraction(1, 103) and reciprocal_of(-1.0 / 3) == Fraction(-1, 3)
    assert reciprocal_of(float(torch.tensor(1.0 / 103, dtype=torch.float32))) == Fraction(1, 103)   # an fp32 1/k
    assert reciprocal_of(0.125) is None and reciprocal_of(0.3) is None and reciprocal_of(0.044715) is None
    assert reciprocal_of(0.5) is None and reciprocal_of(3.0) is None and reciprocal_of(1.0 / (1 << 25)) is None
    for k in (103, 48):
        v = verify(lambda x: x / 3 * 3, lambda x: x, [r(4, k)])
        assert v.equivalent and "finite-field test passed" in v.reason, v.reason
        v = verify(layer_norm_shifted, layer_norm_ref, [r(4, k)])
        assert v.equivalent and "finite-field test passed" in v.reason, v.reason
        w = verify(layer_norm_shifted_wrong, layer_norm_ref, [r(4, k)])
        assert not w.equivalent and w.reason.startswith("finite-field test rejects"), w.reason


def test_trials_and_bound_come_from_the_configuration(monkeypatch):
    from torch_mirage.superopt import verify as verify_fn
    x, y = torch.randn(3, 4), torch.randn(4, 5)
    monkeypatch.setenv("MIRAGE_VERIFY_TRIALS", "2")
    verdict = verify_fn(lambda a, b: a @ b * 2, lambda a, b: (a + a) @ b, [x, y])
    assert verdict.equivalent and verdict.trials == 2


def test_verdicts_of_two_ugraphs_are_remembered(monkeypatch):
    """A model's identical layers verify the same seed against the same program: the second call gets the first
    verdict without running the tests again; another bound, other input shapes or an explicit seed run them."""
    import importlib
    V = importlib.import_module("torch_mirage.superopt.verify")
    runs = []
    real = V._verify
    monkeypatch.setattr(V, "_verify", lambda *a: runs.append(a) or real(*a))
    monkeypatch.setattr(V, "_VERDICTS", type(V._VERDICTS)())
    a = L.gqa_flashattention(*ATTN, dtype="float32", forloop_range=4)
    b = L.gqa_flashdecoding(*ATTN, dtype="float32", splits=2, forloop_range=2)
    first = V.verify(a, b, _qkv(*ATTN), error_bound=1e-9, trials=0)
    again = V.verify(L.gqa_flashattention(*ATTN, dtype="float32", forloop_range=4), b, _qkv(*ATTN),
                     error_bound=1e-9, trials=0)
    assert first.equivalent and again is first and len(runs) == 1
    V.verify(a, b, _qkv(*ATTN), error_bound=1e-6, trials=0)
    V.verify(a, b, _qkv(*ATTN), error_bound=1e-9, trials=0, seed=3)
    assert len(runs) == 3
    V.verify(a, lambda q, k, v: L.attention_ref(q, k, v), _qkv(*ATTN), error_bound=1e-9, trials=0)
    V.verify(a, lambda q, k, v: L.attention_ref(q, k, v), _qkv(*ATTN), error_bound=1e-9, trials=0)
    assert len(runs) == 5                  # a callable side has no canonical form: never remembered


def test_verdicts_are_kept_in_the_disk_cache(monkeypatch, tmp_path):
    """With the compile's disk cache, a verdict survives the process's memory (a warm compile re-verifies nothing);
    an entry that is not a verdict is ignored and rewritten."""
    import importlib
    from torch_mirage.cache import DiskCache
    V = importlib.import_module("torch_mirage.superopt.verify")
    runs = []
    real = V._verify
    monkeypatch.setattr(V, "_verify", lambda *a: runs.append(a) or real(*a))
    cache = DiskCache(str(tmp_path))
    a = L.gqa_flashattention(*ATTN, dtype="float32", forloop_range=4)
    b = L.gqa_flashdecoding(*ATTN, dtype="float32", splits=2, forloop_range=2)
    monkeypatch.setattr(V, "_VERDICTS", type(V._VERDICTS)())
    first = V.verify(a, b, _qkv(*ATTN), error_bound=1e-9, trials=0, cache=cache)
    monkeypatch.setattr(V, "_VERDICTS", type(V._VERDICTS)())          # a new process: nothing in memory
    again = V.verify(a, b, _qkv(*ATTN), error_bound=1e-9, trials=0, cache=cache)
    assert len(runs) == 1 and again == first and again.equivalent
    key = V.cache_key(kind=V.VERDICT_KIND, verdict=V._verdict_key(a, b, _qkv(*ATTN), 1e-9, None, V.DEFAULT_FIELD))
    cache.put_json(key, {"not": "a verdict"})
    monkeypatch.setattr(V, "_VERDICTS", type(V._VERDICTS)())
    assert V.verify(a, b, _qkv(*ATTN), error_bound=1e-9, trials=0, cache=cache).equivalent and len(runs) == 2
    assert cache.get_json(key) == dataclasses.asdict(first) | {"float_max_error": cache.get_json(key)["float_max_error"]}


def _bool_masked_scores(q, k, mask):
    return (q @ k.transpose(-1, -2) / 8.0).masked_fill(~mask, float("-inf"))


def safe_bool_masked_attention(q, k, v, mask):
    """SDPA's math path: a row whose keys are all masked gives zeros (``all(~mask)``: a bool reduction)."""
    p = torch.softmax(_bool_masked_scores(q, k, mask), -1)
    return torch.where(torch.all(~mask, -1, keepdim=True), 0.0, p) @ v


def safe_bool_masked_attention_rows_late(q, k, v, mask):
    p = torch.softmax(_bool_masked_scores(q, k, mask), -1)
    return torch.where(mask.any(-1, keepdim=True), p @ v, 0.0)


def test_bool_reduction_of_a_mask_is_data_in_the_field():
    mask = torch.rand(2, 4, 8) > 0.3
    mask[0, 1] = False                          # one row masked whole
    qkv = [r(2, 4, 16), r(2, 8, 16), r(2, 8, 4), mask]
    v = verify(safe_bool_masked_attention_rows_late, safe_bool_masked_attention, qkv)
    assert v.equivalent and "finite-field test passed" in v.reason, v.reason
    w = verify(lambda q, k, v_, m: torch.where(m.any(-1, keepdim=True), 2 * (torch.softmax(
        _bool_masked_scores(q, k, m), -1) @ v_), 0.0), safe_bool_masked_attention, qkv)
    assert not w.equivalent and w.reason.startswith("finite-field test rejects"), w.reason
