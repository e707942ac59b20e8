"""A mask added as several terms, one of them exactly its band (issue 16): BLOOM's ALiBi (b·h, 1, skv) beside HF's
causal mask, T5's position bias (1, h, sq, skv) beside it. The seeds compute the band's term from indices and load
the other terms' sum at its own shape (a bias), so no (b, h, sq, skv) mask is made per call; eager-equal (fp64
reference) through the backend, and the bias seeds verified (a seed that drops the bias is rejected)."""
import math
import os

import pytest
import torch

import torch_mirage.superopt.attention_claim as attention_claim
from test_attention_band import _inmask
from test_attention_family import _alibi, _check, _qkv
from torch_mirage.superopt.attention_seeds import flash_attention, flash_decoding
from torch_mirage.superopt.verify import verify

interp = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                            reason="CPU kernels run only in Triton's interpreter (TRITON_INTERPRET=1)")


def _alibi_attention(q, k, v, alibi, window=None):
    """BLOOM's eager attention with its causal mask made in the graph: ALiBi in ``baddbmm`` over folded heads."""
    b, h, sq, d = q.shape
    skv = k.shape[2]
    s = alibi.baddbmm(q.reshape(b * h, sq, d), k.reshape(b * h, skv, d).transpose(1, 2), beta=1.0,
                      alpha=1 / math.sqrt(d))
    s = s.view(b, h, sq, skv) + _inmask(sq, skv, window, q.dtype, q.device)
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(p.view(b * h, sq, skv), v.reshape(b * h, skv, d)).view(b, h, sq, d)


def _position_bias_attention(q, k, v, bias, window=None):
    """T5-style: unscaled scores plus a position bias per head and query (1, h, sq, skv) and the causal mask."""
    s = q @ k.transpose(-1, -2) + bias + _inmask(q.shape[2], k.shape[2], window, q.dtype, q.device)
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def _runs(monkeypatch):
    """What each region call passes the seed: the mask argument, the fixed mask and the bias."""
    seen, real = [], attention_claim.run_spec

    def recording(spec, compiled, q, k, v, mask=None, **kw):
        seen.append((mask, kw.get("fixed"), kw.get("bias")))
        return real(spec, compiled, q, k, v, mask, **kw)
    monkeypatch.setattr(attention_claim, "run_spec", recording)
    return seen


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("form,b,sq,skv,window", [("alibi", 2, 16, 16, None), ("alibi", 2, 4, 24, None),
                                                  ("alibi", 1, 16, 16, 5), ("position_bias", 2, 16, 16, None),
                                                  ("position_bias", 1, 4, 24, 7)])
def test_a_bias_beside_a_band_is_loaded_at_its_own_shape(form, b, sq, skv, window, dtype, monkeypatch):
    h, d = 4, 16
    q, k, v = _qkv(b, h, h, sq, skv, d, dtype)
    if form == "alibi":
        fn, bias, want = _alibi_attention, _alibi(b, h, skv, dtype), (b, h, 1, skv)
    else:
        fn, bias, want = _position_bias_attention, torch.randn(1, h, sq, skv, dtype=dtype), (1, h, sq, skv)
    seen = _runs(monkeypatch)
    (region,) = _check(lambda q, k, v, x: fn(q, k, v, x, window), (q, k, v, bias), dtype)
    assert "loaded as a bias" in region.info["mask"] and f"{want}" in region.info["mask"], region.info
    assert f"band={skv - sq}" in region.info["attention"], region.info
    assert seen, "the region's kernel did not run"
    for mask, fixed, got in seen:          # no (b, h, sq, skv) mask made: the stand-in is a broadcast zero
        assert mask is None and got is not None and tuple(got.shape) == want
        assert fixed is not None and fixed.stride()[-2:] == (0, 0)


@interp
@pytest.mark.parametrize("why", ["knob_off", "mask_passed_in", "decode"])
def test_without_a_band_both_terms_are_loaded_at_their_shapes(why, monkeypatch):
    """No band to compute the mask term from — the band knob off, a mask passed in (no value property to read a
    band off), a decode step's mask — and still no per-call sum: the mask term and the bias are each loaded at
    their own shapes, eager-equal."""
    b, h, d = 2, 4, 16
    sq, skv = (1, 24) if why == "decode" else (16, 16)
    q, k, v = _qkv(b, h, h, sq, skv, d, torch.float32)
    alibi, causal = _alibi(b, h, skv, torch.float32), _inmask(sq, skv).expand(b, 1, sq, skv).contiguous()
    seen = _runs(monkeypatch)
    if why == "knob_off":
        monkeypatch.setenv("MIRAGE_ATTENTION_BAND", "0")
        fn, args = _alibi_attention, (q, k, v, alibi)
    else:
        def fn(q, k, v, alibi, mask):
            s = alibi.baddbmm(q.reshape(b * h, sq, d), k.reshape(b * h, skv, d).transpose(1, 2), alpha=d ** -0.5)
            p = torch.softmax(s.view(b, h, sq, skv) + mask, dim=-1)
            return torch.bmm(p.view(b * h, sq, skv), v.reshape(b * h, skv, d)).view(b, h, sq, d)
        args = (q, k, v, alibi, causal)
    (region,) = _check(fn, args, torch.float32)
    assert "from indices" not in region.info["mask"] and "loaded as a bias" in region.info["mask"], region.info
    most = 4 * max(b * h * skv, b * sq * skv)      # bytes of ALiBi's or the causal term's own tensor
    assert seen and all(fixed is None and bias is not None and mask is not None
                        and max(x.untyped_storage().nbytes() for x in (mask, bias)) <= most
                        for mask, fixed, bias in seen), [(tuple(m.shape), f, tuple(x.shape)) for m, f, x in seen]


def _reference(scale, drop_bias=False):
    def ref(q, k, v, mask, bias):
        s = q @ k.transpose(-1, -2) * scale + mask
        return torch.softmax(s if drop_bias else s + bias, -1) @ v
    return ref


@pytest.mark.parametrize("seed,bias", [("flash", (1, 2, 1)), ("flash", (1, 1, 8)), ("decode", (1, 2, 1)),
                                       ("split", (1, 1, 1)), ("split", (1, 2, 4))])
def test_bias_seeds_verify(seed, bias):
    """A seed with a bias, its band's term from indices (a stand-in mask): the verifier draws the mask as exactly
    the band and the bias as any float input; the seed passes, and fails against the attention without its bias."""
    band = (8, 0, None, True, True)
    if seed == "flash":
        g = flash_attention(1, 2, 8, 8, 16, scale=0.25, mask=(1, 1), dtype="float32", forloop_range=2, q_blocks=2,
                            band=band, bias=bias)
        rows, skv = 8, 8
    elif seed == "decode":                  # one row block (two query rows), split over KV
        band = (2, 30, None, True, True)
        g = flash_decoding(1, 2, 2, 32, 16, scale=0.25, mask=(1, 1), dtype="float32", splits=4, forloop_range=2,
                           band=band, bias=bias)
        rows, skv = 2, 32
    else:                                   # several row blocks, split over KV
        band = (4, 28, None, True, True)
        g = flash_decoding(1, 2, 4, 32, 16, scale=0.25, mask=(1, 1), dtype="float32", splits=4, forloop_range=2,
                           q_blocks=2, band=band, bias=bias)
        rows, skv = 4, 32
    xs = [torch.randn(1, 2, rows, 16), torch.randn(1, 2, skv, 16), torch.randn(1, 2, skv, 16),
          torch.zeros(1, 1, rows, skv), torch.zeros(*bias, skv)]
    good = verify(g, _reference(0.25), xs)
    assert good.equivalent, good.reason
    bad = verify(g, _reference(0.25, drop_bias=True), xs)
    assert not bad.equivalent, bad.reason


def test_a_bias_of_other_rows_is_refused():
    with pytest.raises(ValueError, match="bias of 3 rows"):
        flash_attention(1, 2, 8, 8, 16, scale=0.25, mask=(1, 1), dtype="float32", band=(8, 0, None, True, True),
                        bias=(1, 2, 3))


@interp
def test_gqa_prefill_with_a_bias_runs_a_program_per_query_head(monkeypatch):
    """GQA prefill (a program per query head, Q and the masks read as they are): the bias (b, h, 1, skv) is read
    per query head beside the causal term computed from indices, eager-equal."""
    b, h, hk, sq, d = 1, 4, 2, 128, 16

    def fn(q, k, v, bias):
        k, v = (x[:, :, None].expand(b, hk, h // hk, sq, d).reshape(b, h, sq, d) for x in (k, v))
        s = q @ k.transpose(-1, -2) * d ** -0.5 + bias + _inmask(sq, sq, None, q.dtype, q.device)
        return torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v

    q, k, v = _qkv(b, h, hk, sq, sq, d, torch.float32)
    seen = _runs(monkeypatch)
    (region,) = _check(fn, (q, k, v, _alibi(b, h, sq, torch.float32).reshape(b, h, 1, sq)), torch.float32)
    assert region.info.get("layout", "").startswith("a program per query head"), region.info
    assert "loaded as a bias (1, 4, 1, 128)" in region.info["mask"], region.info
    assert seen and all(tuple(bias.shape) == (b, h, 1, sq) for _, _, bias in seen)
