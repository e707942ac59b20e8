"""Attention as a family: masked, soft-capped, GQA and decode attention found by analysis in HF eager code, SDPA
and hand-written forms, run by the attention seed μGraphs (Triton interpreter on CPU), eager-equal."""
import math
import os

import pytest
import torch
import torch.nn.functional as F

import torch_mirage
from helpers import assert_close
from torch_mirage.superopt.attention_seeds import flash_attention, flash_decoding
from torch_mirage.superopt.compile import compile_ugraph

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU kernels run only in Triton's interpreter (TRITON_INTERPRET=1)")


# ------------------------------------------------------------------ forms
def repeat_kv(x, n_rep):
    """HF's repeat_kv: (b, hk, s, d) -> (b, hk·n_rep, s, d)."""
    b, hk, s, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(b, hk, n_rep, s, d).reshape(b, hk * n_rep, s, d)


def hf_eager_attention(q, k, v, mask, scaling, softcap=None):
    """HF's eager_attention_forward (gemma2 style when ``softcap`` is set): matmul, soft-cap, additive mask,
    softmax in fp32, dropout p=0, matmul."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    w = torch.matmul(q, k.transpose(2, 3)) * scaling
    if softcap is not None:
        w = torch.tanh(w / softcap) * softcap
    if mask is not None:
        w = w + mask[:, :, :, : k.shape[-2]]
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    w = F.dropout(w, p=0.0, training=False)
    return torch.matmul(w, v).transpose(1, 2).contiguous()


def hf_mask(b, sq, skv, dtype, window=None, pad=None):
    """An HF-style 4-D additive mask (finfo.min where masked): causal, optionally a sliding window and left
    padding of ``pad`` keys per batch row (whose own query rows are then fully masked)."""
    i = torch.arange(sq)[:, None] + (skv - sq)
    j = torch.arange(skv)[None, :]
    keep = (j <= i).expand(b, 1, sq, skv).clone()
    if window is not None:
        keep &= (i - j < window)
    if pad is not None:
        for r, p in enumerate(pad):
            keep[r, :, :, :p] = False
    return torch.zeros(b, 1, sq, skv, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)


def _compile(fn):
    report = torch_mirage.Report()
    return torch.compile(fn, backend=torch_mirage.MirageBackend(options={"min_region_us": 0}, report=report)), report


def _attention_regions(report):
    return [r for r in report.regions if r.claimer == "attention" and r.compiled_by == "mirage"]


def _qkv(b, h, hk, sq, skv, d, dtype):
    return (torch.randn(b, h, sq, d, dtype=dtype), torch.randn(b, hk, skv, d, dtype=dtype),
            torch.randn(b, hk, skv, d, dtype=dtype))


def _check(fn, args, dtype, expect=1):
    torch._dynamo.reset()
    compiled, report = _compile(fn)
    out = compiled(*args)
    ref = fn(*[a.double() if a.is_floating_point() else a for a in args])
    regions = _attention_regions(report)
    assert len(regions) == expect, str(report)
    if torch.isnan(ref).any():
        assert torch.equal(torch.isnan(out), torch.isnan(ref)), "NaN where eager has none (or the reverse)"
        out, ref = out.nan_to_num(), ref.nan_to_num()
    assert_close(out, ref.to(out.dtype), dtype)
    return regions


# ------------------------------------------------------------------ HF eager
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", ["causal", "padding", "window", "softcap", "gqa_decode"])
def test_hf_eager_forms_are_claimed(case, dtype):
    b, h, hk, sq, skv, d = 2, 4, 2, 8, 8, 16
    window = pad = softcap = None
    if case == "padding":
        pad = (0, 3)
    elif case == "window":
        window = 3
    elif case == "softcap":
        softcap = 5.0
    elif case == "gqa_decode":
        sq, skv = 2, 24
    q, k, v = _qkv(b, h, hk, sq, skv, d, dtype)
    mask = hf_mask(b, sq, skv, dtype, window=window, pad=pad)

    def f(q, k, v, mask):
        return hf_eager_attention(q, k, v, mask, d ** -0.5, softcap)

    (region,) = _check(f, (q, k, v, mask), dtype)
    info = region.info["attention"]
    assert "eager" in info and "hk=2" in info and ("softcap=5" in info) == (case == "softcap"), info


@pytest.mark.parametrize("skv,steps", [(67, 1), (134, 2)])
def test_a_kv_length_without_a_short_divisor_is_walked_in_whole_tiles(skv, steps):
    """Decode GQA (HF's ``repeat_kv`` then SDPA, as its sdpa path runs a DynamicCache) at a KV length whose
    divisors up to the seed's 64-key tile are all below tl.dot's 16 (67 is prime): the seed's loop walks tiles
    of 67 keys padded to 128 (1 step; 2 for 134), not 67 one-key steps, and is eager-equal."""
    b, h, hk, d = 2, 4, 2, 16
    q, k, v = _qkv(b, h, hk, 1, skv, d, torch.float16)

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, repeat_kv(k, h // hk), repeat_kv(v, h // hk))

    (region,) = _check(f, (q, k, v), torch.float16)
    assert [launch["forloop_range"] for launch in region.info["launch"]] == [steps], region.info


def test_a_kv_length_with_only_short_tiles_is_claimed():
    """Decode at 131 keys (a prime above the 128-key widest tile): claimed; the seed's own schedule walks one key
    a step, and the untuned launch (the CPU's) whole 64-key tiles with a ragged last one (three steps over 192),
    eager-equal (a tuned launch on the GPU is checked against the seed's schedule: tests/test_attention_ragged.py)."""
    b, h, hk, d = 2, 4, 2, 16
    q, k, v = _qkv(b, h, hk, 1, 131, d, torch.float16)

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, repeat_kv(k, h // hk), repeat_kv(v, h // hk))

    (region,) = _check(f, (q, k, v), torch.float16)
    assert [(launch["forloop_range"], launch["ragged"]) for launch in region.info["launch"]] == [(3, 192)], region.info


def test_a_prompt_with_only_short_tiles_is_claimed():
    """A 131-token causal prompt: its keys and its query rows have no tile from 16 to 128, so the seed's own
    schedule is one row a program and one key a step; the untuned launch (the CPU's) cuts both into whole
    64-long blocks with a ragged last one (192 covered); claimed, eager-equal."""
    b, h, n, d = 1, 1, 131, 16
    q, k, v = _qkv(b, h, h, n, n, d, torch.float16)

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    (region,) = _check(f, (q, k, v), torch.float16)
    launches = [(c["forloop_range"], c["ragged"], c["ragged_rows"]) for c in region.info["launch"]]
    assert launches == [(3, 192, 192)], region.info


def test_column_sums_at_a_kv_length_with_only_short_tiles_are_left_to_inductor():
    """H2O's column sums of P at 131 keys: the column pass's keys are its programs', which a launch does not cut
    raggedly, so the claimer declines and says why; eager-equal through Inductor."""
    b, h, n, d = 1, 2, 131, 16
    q, k, v = _qkv(b, h, h, n, n, d, torch.float32)

    def f(q, k, v):
        s = (q @ k.transpose(-1, -2)) * d ** -0.5
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        p = torch.softmax(s, -1)
        return p @ v, p.sum(-2)

    torch._dynamo.reset()
    compiled, report = _compile(f)
    out, ref = compiled(q, k, v), f(q.double(), k.double(), v.double())
    for o, r in zip(out, ref):
        assert_close(o, r.float(), torch.float32)
    assert not _attention_regions(report)
    why = [d.detail for r in report.regions for d in r.declines if d.claimer == "attention"]
    assert any("a KV length of 131 keys" in w and "column sums" in w for w in why), why


# ------------------------------------------------------------------ SDPA
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", ["plain", "causal", "bool", "bool_empty_rows", "float", "gqa", "scale",
                                  "repeat_kv", "repeat_interleave"])
def test_sdpa_forms_are_claimed(case, dtype):
    b, h, hk, sq, skv, d = 1, 4, 4, 8, 16, 16
    kw = {}
    if case == "causal":
        kw["is_causal"] = True
        skv = sq
    elif case == "gqa":
        hk, kw["enable_gqa"], kw["is_causal"] = 2, True, True
        skv = sq
    elif case == "scale":
        kw["scale"] = 0.3
    elif case in ("repeat_kv", "repeat_interleave"):   # HF's SDPA path with a mask: K / V repeated per group
        hk, sq, skv = 2, 1, 24
    q, k, v = _qkv(b, h, hk, sq, skv, d, dtype)
    args = [q, k, v]
    if case in ("repeat_kv", "repeat_interleave"):
        args.append(hf_mask(b, sq, skv, dtype))
    if case.startswith("bool"):
        m = torch.rand(b, 1, sq, skv) > 0.4
        m[..., 0] = True
        if case == "bool_empty_rows":
            m[:, :, 2] = False            # padding: a query row with no key; SDPA returns zeros there
        args.append(m)
    elif case == "float":
        args.append(torch.randn(b, h, sq, skv, dtype=dtype))

    def f(q, k, v, *mask):
        if case == "repeat_kv":
            k, v = repeat_kv(k, h // hk), repeat_kv(v, h // hk)
        elif case == "repeat_interleave":
            k, v = k.repeat_interleave(h // hk, dim=1), v.repeat_interleave(h // hk, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[0] if mask else None, **kw)

    (region,) = _check(f, tuple(args), dtype)
    assert "scaled_dot_product" in region.info["attention"]
    if case in ("repeat_kv", "repeat_interleave"):   # the KV heads read as they are: no copy of the repeat
        assert "hk=2" in region.info["attention"] and any("expand" in op for op in region.ops), region.info
    if case.startswith("bool"):           # the kernels read the bool mask as it is: no additive copy per call
        assert region.info.get("mask") == "bool, read in the kernel", region.info


@pytest.mark.parametrize("case", ["plain", "causal", "bool_empty_rows", "float", "gqa"])
def test_sdpa_math_path_is_claimed_with_its_zero_rows(case):
    """SDPA's math backend (what PyTorch decomposes SDPA into where no fused kernel applies; HF BERT's prefill
    without a mask on the H200): Q and Kᵀ each scaled by √scale in fp32, ``_safe_softmax`` (zeros for a row with
    no key), P·V in fp32 cast back to fp16 — one eager attention region whose empty rows are zeros."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype, (b, h, hk, sq, skv, d) = torch.float16, (2, 4, 4, 8, 16, 16)
    kw = {"scale": 0.3}
    if case == "causal":
        kw["is_causal"], skv = True, sq
    elif case == "gqa":
        hk, kw["enable_gqa"] = 2, True
    q, k, v = _qkv(b, h, hk, sq, skv, d, dtype)
    args = [q, k, v]
    if case == "bool_empty_rows":
        m = torch.rand(b, 1, sq, skv) > 0.4
        m[..., 0] = True
        m[1, :, 3] = False                # a query row with no key: zeros, as SDPA gives
        args.append(m)
    elif case == "float":
        args.append(torch.randn(b, 1, sq, skv, dtype=dtype))

    def f(q, k, v, *mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[0] if mask else None, **kw)

    with sdpa_kernel(SDPBackend.MATH):
        (region,) = _check(f, tuple(args), dtype)
    info = region.info["attention"]
    assert info.startswith("eager:") and "scale=0.3" in info, info
    if case == "gqa":
        assert "hk=2" in info, info
    if case == "bool_empty_rows":
        out = torch.compile(f, backend="mirage")(*args)
        assert (out[1, :, 3] == 0).all()


def test_sdpa_bool_mask_read_additive_where_its_where_is_not_free():
    """SDPA with a bool mask: the traced ``where(mask, 0, -inf)`` joins the region and the bool is read; where
    another claim holds that ``where``, the region reads the additive mask it computes instead."""
    from torch_mirage.analysis.attention import find_attention
    from torch_mirage.testing.aten import trace_ir
    q, k, v = _qkv(1, 4, 4, 8, 16, 16, torch.float32)
    m = torch.rand(1, 1, 8, 16) > 0.4
    graph = trace_ir(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), q, k, v, m)
    (spec,) = find_attention(graph)
    assert spec.mask == "bool" and spec.mask_value.meta.dtype is torch.bool
    assert any(n.op.name == "where" for n in spec.nodes)
    held = [n for n in graph.nodes if n.op.name == "where"]
    (spec,) = find_attention(graph, [n for n in graph.nodes if all(n is not h for h in held)])
    assert spec.mask == "additive" and spec.mask_value.meta.dtype is torch.float32
    assert not any(n.op.name == "where" for n in spec.nodes)


@pytest.mark.parametrize("form", ["ones", "index"])
def test_sdpa_mask_that_hides_nothing_is_no_mask(form):
    """A mask the graph builds that keeps every key (transformers 5.17's all-ones padding mask for BERT; a compare
    of indices that always holds, ``i >= 0``) is no mask: the region reads Q, K and V alone, eager-equal."""
    from torch_mirage.analysis.attention import find_attention
    from torch_mirage.testing.aten import trace_ir

    def f(q, k, v):
        if form == "ones":
            m = torch.ones(q.shape[0], 1, q.shape[-2], k.shape[-2], dtype=torch.bool)
        else:
            m = (torch.arange(k.shape[-2]) + torch.arange(q.shape[-2])[:, None]) >= 0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    q, k, v = _qkv(2, 4, 4, 8, 16, 16, torch.float32)
    (spec,) = find_attention(trace_ir(f, q, k, v))
    assert spec.mask == "none" and spec.mask_value is None and len(spec.inputs) == 3
    _check(f, (q, k, v), torch.float32)


# ------------------------------------------------------------------ hand-written
def test_hand_written_causal_attention_from_index_comparisons():
    """Scale on q, the transpose spelled with permute, a causal mask from arange comparisons (its value property
    names it causal), masked_fill with -inf, softmax in the input dtype."""
    def f(q, k, v):
        n = q.shape[-2]
        i = torch.arange(n, device=q.device)
        s = (q * q.shape[-1] ** -0.5) @ k.permute(0, 1, 3, 2)
        s = s.masked_fill(i[None, :] > i[:, None], float("-inf"))
        return torch.softmax(s, dim=-1) @ v

    (region,) = _check(f, _qkv(1, 2, 2, 8, 8, 16, torch.float32), torch.float32)
    assert "mask=bool_inverted(causal)" in region.info["attention"], region.info


@pytest.mark.parametrize("window", [3, 64])
def test_sliding_window_mask_anded_with_ones_gives_its_band(window):
    """transformers 5.24's sliding-window mask: ``ones & ((j > i - window) & (j <= i))`` turned into an additive
    mask. The all-True operand adds no condition, so the band is the window's (a window wider than the prompt
    is the causal band); eager-equal."""
    from torch_mirage.analysis.attention import find_attention
    from torch_mirage.testing.aten import trace_ir

    def f(q, k, v):
        n = q.shape[-2]
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        keep = torch.ones((), dtype=torch.bool) & ((j > i - window) & (j <= i))   # its grouping
        mask = torch.where(keep, 0.0, torch.finfo(torch.float32).min)
        return torch.softmax(q @ k.transpose(-1, -2) * 0.25 + mask, dim=-1) @ v
    qkv = _qkv(1, 2, 2, 8, 8, 16, torch.float32)
    (spec,) = find_attention(trace_ir(f, *qkv))
    assert spec.mask_band == ((0, window) if window < 8 else (0, None)), spec.describe()
    _check(f, qkv, torch.float32)


def _einsum_attention(q, k, v):
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5
    return torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), v)


def _folded_heads_attention(q, k, v):
    """Heads folded into the batch (fairseq / older HF): 3-D bmm on (b·h, s, d), the output viewed back."""
    b, h, sq, d = q.shape
    fold = lambda t: t.reshape(b * h, t.shape[2], d)   # noqa: E731
    p = torch.softmax(torch.bmm(fold(q), fold(k).transpose(1, 2)) * 0.3, dim=-1)
    return torch.bmm(p, fold(v)).view(b, h, sq, d)


def _mT_gqa_attention(q, k, v):
    """GQA by ``repeat_interleave`` on the KV heads, ``k.mT``, the scale after the softmax's input cast."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return torch.softmax((q @ k.mT).float() / math.sqrt(q.shape[-1]), dim=-1).to(q.dtype) @ v


def _late_normalised_attention(q, k, v):
    """Mirage's rewrite written by hand: the row sums divide P·V instead of P (a causal additive mask)."""
    sq, skv = q.shape[2], k.shape[2]
    mask = torch.full((sq, skv), float("-inf")).triu(1 + skv - sq).to(q.dtype)
    s = q @ k.transpose(-1, -2) * 0.3 + mask
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return (e @ v) / e.sum(-1, keepdim=True)


def _packed_gqa_attention(q, k, v):
    """GQA without repeating K / V: each KV head's query heads packed into its rows, one bmm batch per KV head."""
    b, h, sq, d = q.shape
    hk, skv = k.shape[1], k.shape[2]
    qp = q.reshape(b * hk, h // hk * sq, d)
    p = torch.softmax(torch.bmm(qp, k.reshape(b * hk, skv, d).transpose(1, 2)) / math.sqrt(d), dim=-1)
    return torch.bmm(p, v.reshape(b * hk, skv, d)).view(b, h, sq, d)


@pytest.mark.parametrize("form", ["einsum", "folded_heads", "mT_gqa", "late_normalised", "packed_gqa"])
def test_hand_written_forms_are_read_by_what_they_compute(form):
    """The same attention through other layout spellings — einsum's unsqueeze / permute / 5-D views, heads folded
    into a 3-D bmm, GQA by repeat_interleave: each read by comparing layouts — and normalised after P·V."""
    fn = {"einsum": _einsum_attention, "folded_heads": _folded_heads_attention, "mT_gqa": _mT_gqa_attention,
          "late_normalised": _late_normalised_attention, "packed_gqa": _packed_gqa_attention}[form]
    hk = 2 if form in ("mT_gqa", "packed_gqa") else 4
    (region,) = _check(fn, _qkv(2, 4, hk, 8, 16, 16, torch.float16), torch.float16)
    assert f"hk={hk}" in region.info["attention"], region.info


def _alibi(b, h, skv, dtype):
    """BLOOM's ALiBi bias, (b·h, 1, skv): a slope per head times the key position."""
    slopes = torch.tensor([2 ** (-8 * (i + 1) / h) for i in range(h)])
    return (slopes[None, :, None] * torch.arange(skv)[None, None, :]).expand(b, h, skv).reshape(b * h, 1, skv) \
        .to(dtype)


def _bloom_attention(q, k, v, alibi, mask):
    """BLOOM's eager attention: ``alibi.baddbmm(Q, Kᵀ, beta, alpha)`` over heads folded into the batch, viewed as
    (b, h, sq, skv), the causal mask added, the softmax in fp32, P·V on the folded heads again."""
    b, h, sq, d = q.shape
    skv = k.shape[2]
    s = alibi.baddbmm(q.reshape(b * h, sq, d), k.reshape(b * h, skv, d).transpose(1, 2), beta=1.0,
                      alpha=1 / math.sqrt(d))
    p = torch.softmax(s.view(b, h, sq, skv) + mask, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(p.view(b * h, sq, skv), v.reshape(b * h, skv, d)).view(b, h, sq, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_alibi_in_baddbmm_and_a_causal_mask_are_one_region(dtype):
    """Issue 16, any written form: ``baddbmm``'s bias is a mask term over folded heads, the causal mask added
    after the view another; the region reads both (their sum is its mask) and matches eager."""
    b, h, sq, skv, d = 2, 4, 8, 8, 16
    q, k, v = _qkv(b, h, h, sq, skv, d, dtype)
    mask = torch.zeros(b, 1, sq, skv).masked_fill(torch.ones(sq, skv, dtype=torch.bool).triu(1), float("-inf"))
    (region,) = _check(_bloom_attention, (q, k, v, _alibi(b, h, skv, dtype), mask.to(dtype)), dtype)
    assert "mask=additive+1" in region.info["attention"], region.info


@pytest.mark.parametrize("mask_shape", [(8, 6, 10), (1, 6, 10), (8, 1, 10)])
def test_a_mask_over_folded_heads_is_read_per_head(mask_shape):
    """Scores kept (b·h, sq, skv) with a mask added there — per folded head, shared, or per key only — and then
    scaled (the scale applies to the mask too): one region, eager-equal."""
    def fn(q, k, v, mask):
        b, h, sq, d = q.shape
        s = torch.bmm(q.reshape(b * h, sq, d), k.reshape(b * h, -1, d).transpose(1, 2))
        p = torch.softmax((s + mask) * 0.25, dim=-1)
        return torch.bmm(p, v.reshape(b * h, -1, d)).view(b, h, sq, d)

    q, k, v = _qkv(2, 4, 4, 6, 10, 8, torch.float32)
    (region,) = _check(fn, (q, k, v, torch.randn(mask_shape)), torch.float32)
    assert "mask=additive" in region.info["attention"], region.info


@pytest.mark.parametrize("preallocated", ["empty_beta0", "zeros"])
def test_baddbmm_into_a_preallocated_buffer_is_unmasked_attention(preallocated):
    """Megatron's ``baddbmm`` into preallocated scores — ``empty`` with beta 0 (GPT-2's upcast path, ImageGPT),
    or zeros (GPT-NeoX-Japanese) — adds no mask: one unmasked region, the buffer inside it."""
    def fn(q, k, v):
        b, h, sq, d = q.shape
        skv = k.shape[2]
        if preallocated == "zeros":
            buf, beta = torch.zeros(b * h, sq, skv, dtype=q.dtype), 1.0
        else:
            buf, beta = torch.empty(b * h, sq, skv, dtype=q.dtype), 0.0
        s = torch.baddbmm(buf, q.reshape(b * h, sq, d), k.reshape(b * h, skv, d).transpose(1, 2), beta=beta,
                          alpha=d ** -0.5)
        p = torch.softmax(s.view(b, h, sq, skv), dim=-1)
        return torch.matmul(p, v)

    (region,) = _check(fn, _qkv(2, 4, 4, 6, 10, 8, torch.float32), torch.float32)
    assert "mask" not in region.info["attention"], region.info


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("form,sq", [("eager", 6), ("eager", 1), ("sdpa", 6), ("sdpa_causal", 6), ("sdpa_gqa", 1)])
def test_value_heads_of_another_size_are_attention(form, sq, dtype):
    """Multi-head latent attention (DeepSeek-V2 / V3): Q and K heads of 24 (a no-position part and a RoPE part),
    V heads of 16 — eager with an additive mask, prefill and a decode step, and through SDPA (a GQA decode step
    over 512 keys: the split-KV seeds): one region whose output has V's head size, eager-equal."""
    b, h, hk, skv, d, dv = 2, 4, 4, 10, 24, 16
    if form == "sdpa_gqa":
        b, hk, skv = 1, 2, 512
    q, k = torch.randn(b, h, sq, d, dtype=dtype), torch.randn(b, hk, skv, d, dtype=dtype)
    v = torch.randn(b, hk, skv, dv, dtype=dtype)
    if form == "eager":
        def fn(q, k, v, mask):
            s = q @ k.transpose(-1, -2) * d ** -0.5 + mask
            return torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v
        args = (q, k, v, torch.randn(b, 1, sq, skv, dtype=dtype))
    else:
        causal = form == "sdpa_causal"
        if causal:
            k, v = k[:, :, :sq], v[:, :, :sq]

        def fn(q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                    enable_gqa=form == "sdpa_gqa")
        args = (q, k, v)
    (region,) = _check(fn, args, dtype)
    assert f"d={d} dv={dv}" in region.info["attention"], region.info


def test_a_mask_packed_like_the_query_heads_is_read():
    """GQA without repeating K / V, a KV head's query heads packed into its rows, and the (b, 1, sq, skv) mask
    expanded and packed the same way before it is added: the packed mask is a view of (b, h, sq, skv), one
    region."""
    def fn(q, k, v, mask):
        b, h, sq, d = q.shape
        hk, skv = k.shape[1], k.shape[2]
        g = h // hk
        s = torch.bmm(q.reshape(b * hk, g * sq, d), k.reshape(b * hk, skv, d).transpose(1, 2)) * d ** -0.5
        packed = mask.expand(b, h, sq, skv).reshape(b * hk, g * sq, skv)
        p = torch.softmax(s + packed, dim=-1)
        return torch.bmm(p, v.reshape(b * hk, skv, d)).view(b, h, sq, d)

    q, k, v = _qkv(2, 4, 2, 6, 10, 8, torch.float32)
    (region,) = _check(fn, (q, k, v, torch.randn(2, 1, 6, 10)), torch.float32)
    assert "hk=2" in region.info["attention"] and "mask=additive" in region.info["attention"], region.info


def test_a_mask_added_first_is_read_as_the_mask():
    """``mask + scores`` (the mask the first argument of the add) is read as ``scores + mask``: one region."""
    def fn(q, k, v, mask):
        return torch.softmax(mask + q @ k.transpose(-1, -2) * 0.3, dim=-1) @ v

    q, k, v = _qkv(2, 4, 4, 6, 10, 8, torch.float32)
    (region,) = _check(fn, (q, k, v, torch.randn(2, 1, 6, 10)), torch.float32)
    assert "mask=additive" in region.info["attention"], region.info


def test_scores_added_to_themselves_are_not_a_mask():
    """``s + s``: the add's other side is the scores themselves, not a mask from outside: the analysis finds no
    attention (its region would read a value it computes; the check stage caught that before), and the program
    stays eager-equal."""
    from torch_mirage.analysis.attention import find_attention
    from torch_mirage.testing.aten import trace_ir

    def fn(q, k, v):
        s = q @ k.transpose(-1, -2) * 0.3
        return torch.softmax(s + s, dim=-1) @ v

    args = _qkv(1, 2, 2, 4, 8, 8, torch.float32)
    assert not find_attention(trace_ir(fn, *args))
    _check(fn, args, torch.float32, expect=0)


def test_a_soft_cap_after_an_added_mask_is_not_attention():
    """``tanh`` of scores that already hold a mask is not ``softcap`` then mask: left to Inductor, eager-equal."""
    def fn(q, k, v, mask):
        s = torch.tanh((q @ k.transpose(-1, -2) + mask) / 5.0) * 5.0
        return torch.softmax(s, dim=-1) @ v

    q, k, v = _qkv(1, 2, 2, 4, 8, 8, torch.float32)
    _check(fn, (q, k, v, torch.randn(1, 1, 4, 8)), torch.float32, expect=0)


def test_a_reshape_that_is_not_a_transpose_is_not_attention():
    """``k.reshape(b·h, d, s)`` has Kᵀ's shape but other elements: not read as attention, still eager-equal."""
    def fn(q, k, v):
        b, h, s, d = k.shape
        scores = torch.bmm(q.reshape(b * h, -1, d), k.reshape(b * h, d, s)) * 0.3
        return torch.bmm(scores.softmax(-1), v.reshape(b * h, s, d)).view(q.shape)

    _check(fn, _qkv(1, 2, 2, 8, 8, 8, torch.float32), torch.float32, expect=0)


def test_hand_written_padding_with_minus_inf_keeps_eager_nans():
    """Fully masked rows under a -inf additive mask are NaN in eager's decomposed softmax: the same NaN, and
    numbers everywhere else."""
    def f(q, k, v, mask):
        return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask, dim=-1) @ v

    q, k, v = _qkv(1, 2, 2, 4, 8, 16, torch.float32)
    mask = torch.zeros(1, 1, 4, 8)
    mask[..., 5:] = float("-inf")
    mask[..., 1, :] = float("-inf")
    _check(f, (q, k, v, mask), torch.float32)


def test_attention_with_inner_value_read_elsewhere_is_not_claimed():
    def f(q, k, v):
        p = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
        return p @ v, p.sum()

    torch._dynamo.reset()
    compiled, report = _compile(f)
    compiled(*_qkv(1, 2, 2, 4, 4, 8, torch.float32))
    assert not _attention_regions(report), str(report)


def test_an_operand_read_elsewhere_is_where_the_region_starts():
    """Q scaled, and the scaled Q also read by another op: the region reads the scaled Q (its scale 1) rather than
    taking the ``mul`` in and leaving it read outside."""
    def f(q, k, v):
        qs = q * 0.25
        return torch.softmax(qs @ k.transpose(-1, -2), dim=-1) @ v + qs.sum()

    (region,) = _check(f, _qkv(1, 2, 2, 4, 8, 8, torch.float32), torch.float32)
    assert "scale=1 " in region.info["attention"] + " ", region.info


# ------------------------------------------------------------------ seeds
@pytest.mark.parametrize("seed", [flash_attention, flash_decoding])
@pytest.mark.parametrize("shared", [False, True])
def test_seeds_with_softcap_and_fully_masked_tiles(seed, shared):
    """Both seeds against torch: soft-cap, a mask (per batch row and KV head, or one shared by all) with whole KV
    tiles (and a whole split) masked at the clamp value the claimer uses, GQA-packed rows."""
    b, hk, rows, skv, d = 2, 2, 6, 24, 16
    schedule = dict(q_blocks=2, forloop_range=3) if seed is flash_attention else dict(splits=3, forloop_range=2)
    mb, mh = (1, 1) if shared else (b, hk)
    g = seed(b, hk, rows, skv, d, scale=0.3, softcap=4.0, mask=(mb, mh), dtype="float32", **schedule)
    q, k, v = torch.randn(b, hk, rows, d), torch.randn(b, hk, skv, d), torch.randn(b, hk, skv, d)
    m = torch.zeros(mb, mh, rows, skv)
    m[..., 8:16] = -1e30                  # the middle split / tiles: every key masked
    m[..., 1, 20:] = -1e30
    out = compile_ugraph(g, [q, k, v, m])(q, k, v, m)[0]
    ref = torch.softmax(torch.tanh(q @ k.transpose(-1, -2) * 0.3 / 4.0) * 4.0 + m, -1) @ v
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("seed", [flash_attention, flash_decoding])
def test_seeds_take_unclamped_masks_as_eager(seed):
    """Both seeds on a mask nobody clamped: -inf on whole tiles and splits of some rows, a row masked whole by -inf
    (eager: NaN, the kernel's own 0/0) and one masked whole by fp32's lowest value (eager: the uniform average,
    the kernel's held floor), against fp64 eager."""
    b, hk, rows, skv, d = 1, 2, 6, 24, 16
    schedule = dict(q_blocks=2, forloop_range=3) if seed is flash_attention else dict(splits=3, forloop_range=2)
    g = seed(b, hk, rows, skv, d, scale=0.3, mask=(b, hk), dtype="float32", **schedule)
    q, k, v = torch.randn(b, hk, rows, d), torch.randn(b, hk, skv, d), torch.randn(b, hk, skv, d)
    m = torch.zeros(b, hk, rows, skv)
    m[..., 8:16] = float("-inf")                   # the middle split / tiles of every row
    m[0, 0, 1, :] = float("-inf")
    m[0, 1, 4, :] = torch.finfo(torch.float32).min
    out = compile_ugraph(g, [q, k, v, m])(q, k, v, m)[0]
    ref = torch.softmax((q @ k.transpose(-1, -2)).double() * 0.3 + m.double(), -1) @ v.double()
    assert torch.isnan(ref[0, 0, 1]).all() and torch.equal(torch.isnan(out), torch.isnan(ref))
    assert_close(out.nan_to_num(), ref.nan_to_num().float(), torch.float32)


@pytest.mark.parametrize("seed", [flash_attention, flash_decoding])
@pytest.mark.parametrize("shared", [False, True])
def test_seeds_read_a_bool_mask_with_sdpa_empty_rows(seed, shared):
    """Both seeds with a bool mask read as it is (``where(keep, s, -inf)`` per tile) and SDPA's empty rows: whole
    tiles and a whole split dropped, one row with no key (SDPA: 0, not 0/0), against fp64 eager; the reference
    executor (TorchArith) computes the same μGraph alike."""
    from torch_mirage.superopt.executor import execute
    b, hk, rows, skv, d = 2, 2, 6, 24, 16
    schedule = dict(q_blocks=2, forloop_range=3) if seed is flash_attention else dict(splits=3, forloop_range=2)
    mb, mh = (1, 1) if shared else (b, hk)
    g = seed(b, hk, rows, skv, d, scale=0.3, mask=(mb, mh), dtype="float32", mask_dtype="bool",
             empty_rows="zero", **schedule)
    q, k, v = torch.randn(b, hk, rows, d), torch.randn(b, hk, skv, d), torch.randn(b, hk, skv, d)
    keep = torch.rand(mb, mh, rows, skv) > 0.3
    keep[..., 0] = True
    keep[..., 8:16] = False               # the middle split / tiles
    keep[0, 0, 4, :] = False              # a row with no key
    out = compile_ugraph(g, [q, k, v, keep])(q, k, v, keep)[0]
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=keep, scale=0.3)
    ref = torch.where(keep.any(-1, keepdim=True), ref, 0.0)   # SDPA's own answer for a row with no key
    assert not torch.isnan(out).any() and torch.equal(out[0, 0, 4], torch.zeros(d))
    assert_close(out, ref.float(), torch.float32)
    (executed,) = execute(g, [q, k, v, keep])
    assert_close(executed, ref.float(), torch.float32)


@pytest.mark.parametrize("cap", [4.0, 50.0])
def test_softcap_seed_verifies_with_tanh_uninterpreted(cap):
    """tanh is an uninterpreted function in the finite-field test: the soft-capped, masked seed is accepted
    against the eager program and a wrong cap multiplier is rejected by the field test itself."""
    from torch_mirage.superopt.verify import verify

    g = flash_attention(1, 2, 4, 8, 16, scale=0.25, softcap=cap, mask=(1, 2), dtype="float32", forloop_range=2)

    def ref(q, k, v, m, mult=cap):
        return torch.softmax(torch.tanh(q @ k.transpose(-1, -2) * 0.25 / cap) * mult + m, -1) @ v

    xs = [torch.randn(1, 2, 4, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.zeros(1, 2, 4, 8)]
    good = verify(g, ref, xs)
    assert good.equivalent and good.error_bound is not None and "finite-field test passed" in good.reason, good.reason
    bad = verify(g, lambda q, k, v, m: ref(q, k, v, m, cap * 1.01), xs)
    assert not bad.equivalent and bad.reason.startswith("finite-field test rejects"), bad.reason


@pytest.mark.parametrize("form", ["eager", "sdpa"])
def test_decode_over_a_long_cache_can_run_split_kv(monkeypatch, form):
    """One new token, GQA heads, a padded static cache (additive mask shared by the heads) long enough to split:
    split-KV compiles at three split counts (and FlashAttention, whose launches split KV), and the one timed fastest
    (faked: the interpreter has no CUDA graphs)
    runs and matches eager."""
    from torch_mirage import build

    first_seen: dict[int, float] = {}

    def fake_samples(compiled, sets):
        if id(compiled) not in first_seen:              # timed in order 4, 2, 8 splits, FlashAttention: 2 is the fastest
            first_seen[id(compiled)] = (2.0, 1.0, 3.0, 4.0)[len(first_seen)]
        return [first_seen[id(compiled)]]

    monkeypatch.setattr(build, "_timing_sets", lambda examples: [examples])
    monkeypatch.setattr(build, "_time_ugraph", fake_samples)
    b, h, hk, skv, d = 1, 4, 2, 512, 16
    q, k, v = _qkv(b, h, hk, 1, skv, d, torch.float32)
    mask = torch.zeros(b, 1, 1, skv)
    mask[..., 300:] = float("-inf")             # cache slots not written yet: a whole split masked

    def eager(q, k, v, mask):
        return hf_eager_attention(q, k, v, mask, d ** -0.5)

    def sdpa(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    (region,) = _check(eager if form == "eager" else sdpa, (q, k, v, mask), torch.float32)
    us = region.info["ugraph_us"]
    assert set(us) == {"flash_decoding/4", "flash_decoding/2", "flash_decoding/8", "flash_attention"}, region.info
    assert region.info["ugraph"] == "flash_decoding/2" == min(us, key=us.get), region.info


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_static_cache_decode_with_per_row_mask_runs_split_kv(dtype):
    """llama_layer_decode's attention (query heads packed per KV head by a reshape, an additive mask per batch row
    hiding each sequence's unwritten cache slots, fp32 softmax) at b=2: split-KV at the split counts timed (the
    first where nothing is timed; FlashAttention, a program per batch row and KV head whose launches split KV, is timed after them),
    eager-equal."""
    from torch_mirage.bench.workloads import _attention

    b, h, hk, skv, d = 2, 8, 2, 512, 16

    def decode(q, k, v, mask):
        return _attention(q.reshape(b, hk, h // hk, d), k, v, mask)[0]

    q, k, v = _qkv(b, h, hk, 1, skv, d, dtype)
    mask = torch.zeros(b, 1, 1, skv, dtype=dtype)
    mask[0, ..., 300:] = float("-inf")          # row 0 has written 300 slots, row 1 all of them
    (region,) = _check(decode, (q, k, v, mask), dtype)
    assert region.info["ugraph"] == "flash_decoding/4" and "ugraph_us" not in region.info, region.info


def test_sdpa_with_a_mask_broadcast_over_the_batch():
    """A mask passed as an expanded view (stride 0 over the batch, as a caller broadcasting one padding row does):
    its example data keeps the view's strides, the region is claimed, and it equals eager."""
    from torch_mirage.capture.ir import TensorMeta
    from torch_mirage.timing import random_like

    b, h, hk, skv, d = 2, 8, 2, 48, 16
    q, k, v = _qkv(b, h, hk, 1, skv, d, torch.float32)
    mask = torch.where(torch.arange(skv) < 40, 0.0, float("-inf")).expand(b, 1, 1, skv)
    example = random_like(TensorMeta.of(mask))
    assert example.stride() == mask.stride() and example.shape == mask.shape

    def f(q, k, v, mask):
        k, v = repeat_kv(k, h // hk), repeat_kv(v, h // hk)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    (region,) = _check(f, (q, k, v, mask), torch.float32)
    assert "hk=2 " in region.info["attention"], region.info


def test_tuning_sees_the_compiled_calls_mask(monkeypatch):
    """A mask passed in (and sliced in the graph, as HF slices its 4-D mask) reaches the attention seeds' example
    inputs as the compiled call's real values — so that launch tuning can time the mask scan on the tiles it
    skips — and is released after the build; the Q / K / V examples stay random."""
    import torch_mirage.superopt.attention_claim as claim

    seen = []
    examples = claim._examples

    def spy(spec, graph, by_index=False, bool_mask=False, per_head=False, observed=None, bias=False):
        out = examples(spec, graph, by_index, bool_mask, per_head, observed, bias)
        seen.append((dict(observed or {}), out[0], observed))
        return out
    monkeypatch.setattr(claim, "_examples", spy)
    b, h, sq, d = 1, 2, 16, 8
    q, k, v = _qkv(b, h, h, sq, sq, d, torch.float32)
    mask = torch.full((sq, sq + 4), float("-inf")).triu(1)[None, None]
    fn = lambda q, k, v, m: hf_eager_attention(q, k, v, m, d ** -0.5)    # noqa: E731
    _check(fn, [q, k, v, mask], torch.float32)
    tuned = [(obs, ex, live) for obs, ex, live in seen if obs]
    assert tuned, "no example inputs were built with the call's tensors"
    obs, ex, live = tuned[0]
    assert live == {}                                              # emptied once the build was done
    assert any(t is mask for t in obs.values())
    assert torch.equal(ex[3].reshape(sq, sq), mask[0, 0, :, :sq])      # the graph's slice of the real mask
    assert not torch.equal(ex[0], q.reshape(ex[0].shape))


def test_region_timing_sees_a_copy_of_the_calls_mask(monkeypatch):
    """The measure stage (run here without a GPU) still has the compiled call's tensors: a region is timed on
    copies of the call's inputs — its mask above all: a kernel that skips what the mask hides is timed on what
    the call passes, not on a random mask — and the tensors are released after the stage."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    import torch_mirage.pipeline as pipeline
    from torch_mirage.capture.ir import subgraph
    from torch_mirage.runtime.measure import region_check_inputs

    seen = []

    def timing_inputs(regions, graph, ctx):
        for r in regions:
            if r.compiled_by == "mirage":
                with unset_fake_temporarily():
                    seen.append(region_check_inputs(r, graph, subgraph(graph, r.nodes, r.outputs(graph)),
                                                    ctx.observed_inputs))
        seen.append(ctx.observed_inputs)
    monkeypatch.setattr(pipeline, "_measures", lambda config: True)
    monkeypatch.setattr(pipeline, "keep_faster", timing_inputs)
    b, h, sq, d = 1, 2, 16, 8
    q, k, v = _qkv(b, h, h, sq, sq, d, torch.float32)
    mask = torch.full((sq, sq), float("-inf")).triu(1)[None, None]
    fn = lambda q, k, v, m: hf_eager_attention(q, k, v, m, d ** -0.5)    # noqa: E731
    _check(fn, [q, k, v, mask], torch.float32)
    assert len(seen) == 2 and seen[1] == {}                  # one region; the call's tensors released after
    masks = [t for t in seen[0] if tuple(t.shape) == tuple(mask.shape)]
    assert len(masks) == 1 and torch.equal(masks[0], mask) and masks[0] is not mask
    assert not any(t is x for t in seen[0] for x in (q, k, v, mask))      # copies: the region may write them


def test_constant_value_with_observed_inputs():
    """``constant_value`` evaluates a value computed from graph inputs only when their real tensors are given."""
    from torch_mirage.capture.lower import constant_value
    from torch_mirage.testing.aten import trace_ir

    m = torch.randn(1, 1, 4, 6)
    graph = trace_ir(lambda m: m[:, :, :, :4] * 2, m)
    out = graph.outputs[0]
    assert constant_value(graph, out) is None
    assert torch.equal(constant_value(graph, out, {graph.inputs[0].name: m}), m[..., :4] * 2)


def test_constant_value_is_evaluated_once_per_value_and_observed_tensors(monkeypatch):
    """A mask every layer reads is evaluated once in a graph: a second ask runs no slice, and gets a copy (a write
    to the first answer does not reach it); other observed tensors are evaluated again, with their contents."""
    from torch_mirage.capture import lower
    from torch_mirage.testing.aten import trace_ir

    def f(x, m):
        keep = torch.arange(6)[None, :] <= torch.arange(4)[:, None]
        return x + torch.where(keep, 0.0, float("-inf")), x + m[:, :6] * 2
    x, m = torch.randn(4, 6), torch.randn(4, 8)
    graph = trace_ir(f, x, m)
    adds = [n for n in graph.nodes if n.target_name == "aten.add.Tensor"]
    (mask,) = [v for v in adds[0].inputs if v.producer is not None]
    (scaled,) = [v for v in adds[1].inputs if v.producer is not None]
    runs = []
    real = lower._evaluated
    monkeypatch.setattr(lower, "_evaluated", lambda *a: runs.append(a[1]) or real(*a))
    first = lower.constant_value(graph, mask)
    expected = torch.where(torch.arange(6)[None, :] <= torch.arange(4)[:, None], 0.0, float("-inf"))
    assert torch.equal(first, expected)
    first.fill_(7.0)
    assert torch.equal(lower.constant_value(graph, mask), expected) and runs == [mask]
    name = graph.inputs[1].name
    assert torch.equal(lower.constant_value(graph, scaled, {name: m}), m[:, :6] * 2)
    other = torch.randn(4, 8)
    assert torch.equal(lower.constant_value(graph, scaled, {name: other}), other[:, :6] * 2)
    assert torch.equal(lower.constant_value(graph, scaled, {name: m}), m[:, :6] * 2)
    assert runs == [mask, scaled, scaled]


def test_computed_from_constants_says_what_constant_value_would_evaluate():
    """The check stage's key asks only whether an input is computed from the graph's constants alone (a mask from
    ``arange``), without evaluating it: the same answer as ``constant_value`` being a tensor."""
    from torch_mirage.capture.lower import computed_from_constants, constant_value
    from torch_mirage.testing.aten import trace_ir

    def f(x):
        keep = torch.arange(6)[None, :] <= torch.arange(4)[:, None]
        return x + torch.where(keep, 0.0, float("-inf")), x * 2
    graph = trace_ir(f, torch.randn(4, 6))
    adds = [n for n in graph.nodes if n.target_name == "aten.add.Tensor"]
    (mask,) = [v for v in adds[0].inputs if v.producer is not None]
    x = graph.inputs[0]
    assert computed_from_constants(graph, mask) and constant_value(graph, mask) is not None
    assert not computed_from_constants(graph, x) and constant_value(graph, x) is None
    assert not computed_from_constants(graph, graph.outputs[1]) and constant_value(graph, graph.outputs[1]) is None


def test_passed_prefill_mask_adds_the_tile_table_seed():
    """Prefill attention with an additive mask passed in builds FlashAttention with the mask's tile table as one
    more alternative (timed on a GPU on the call's mask); with the mask built in the graph (its band known) the
    table seed is not used."""
    from torch_mirage.context import CompileContext
    from torch_mirage.partition.region import claims
    from torch_mirage.superopt.attention_claim import AttentionClaimer
    from torch_mirage.testing.aten import trace_ir

    n, d = 256, 16
    q, k, v = _qkv(1, 2, 2, n, n, d, torch.float32)
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    names = {}
    for case, fn, args in (
            ("passed", lambda q, k, v, m: hf_eager_attention(q, k, v, m, d ** -0.5, softcap=30.0), (q, k, v, mask)),
            ("in graph", lambda q, k, v: hf_eager_attention(
                q, k, v, torch.zeros(n, n).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1),
                                                       float("-inf"))[None, None], d ** -0.5), (q, k, v))):
        graph = trace_ir(fn, *args)
        found = claims(AttentionClaimer().claim(graph, list(graph.nodes), CompileContext.standalone()))
        assert len(found) == 1, case
        names[case] = [a.name for a in found[0].plan.alternatives]
    assert "flash_attention/scan" in names["passed"]
    assert "flash_attention/scan" not in names["in graph"]


@pytest.mark.parametrize("hk", [4, 2])
def test_transposed_projections_are_read_with_their_strides(monkeypatch, hk):
    """HF's layout: Q / K / V are (b, s, heads, d) projections transposed to (b, heads, s, d) views. The kernels
    take every input's strides, so K and V (and Q where each KV head has one query head) reach the kernel as
    they are, not copied per call — and the result is eager's."""
    from torch_mirage.superopt import attention_claim

    real, seen = attention_claim.run_spec, []

    def spy(spec, compiled, q, k, v, *args, **kwargs):
        def recording(*ins, **kw):
            seen.append({"q": ins[0].data_ptr() == q.data_ptr(), "k": ins[1].data_ptr() == k.data_ptr(),
                         "v": ins[2].data_ptr() == v.data_ptr(), "k_strided": not ins[1].is_contiguous()})
            return compiled(*ins, **kw)
        return real(spec, recording, q, k, v, *args, **kwargs)

    monkeypatch.setattr(attention_claim, "run_spec", spy)
    b, h, s, d, dtype = 2, 4, 16, 16, torch.float32
    xq, xk, xv = torch.randn(b, s, h, d), torch.randn(b, s, hk, d), torch.randn(b, s, hk, d)

    def f(xq, xk, xv):
        q, k, v = ((x * 1.5).transpose(1, 2) for x in (xq, xk, xv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hk < h)
        return out.transpose(1, 2).reshape(b, s, h * d)

    _check(f, (xq, xk, xv), dtype)
    strided = [c for c in seen if c["k_strided"]]
    assert strided, f"the kernel never saw a transposed K: {seen}"
    assert all(c["k"] and c["v"] for c in strided), seen
    assert all(c["q"] for c in strided) == (hk == h), seen      # Q's group packing copies only under GQA


@pytest.mark.parametrize("mask", ["causal", "bool", "additive"])
def test_gqa_prefill_runs_a_program_per_query_head_on_the_regions_tensors(monkeypatch, mask):
    """GQA prefill (a head's rows fill row blocks): FlashAttention with a program per query head, the programs of a
    group reading their KV head's tiles, so Q, K, V and a head-shared mask reach the kernel as the region has them
    (HF's transposed projections, no per-call copy or per-group repeat), P·V is written where the graph wants it —
    and the result is eager's."""
    from torch_mirage.superopt import attention_claim

    real, seen = attention_claim.run_spec, []

    def spy(spec, compiled, q, k, v, *args, **kwargs):
        def recording(*ins, **kw):
            theirs = [q, k, v] + ([args[0]] if mask != "causal" else [])   # causal: the kernel's own band
            res = compiled(*ins, **kw)
            # the kernel writes P·V into the output in the graph's own strides: no copy after it
            seen.append([x.data_ptr() for x in ins[:len(theirs)]] == [x.data_ptr() for x in theirs]
                        and res[0] is kw.get("outs", {}).get(0))
            return res
        return real(spec, recording, q, k, v, *args, **kwargs)

    monkeypatch.setattr(attention_claim, "run_spec", spy)
    b, h, hk, s, d, dtype = 1, 4, 2, 128, 16, torch.float32
    xq, xk, xv = torch.randn(b, s, h, d), torch.randn(b, s, hk, d), torch.randn(b, s, hk, d)
    keep = torch.ones(b, 1, s, s, dtype=torch.bool).tril()
    keep[..., 5:9, :] &= torch.rand(b, 1, 4, s) > 0.3           # not only the band: the mask is read
    extra = {"causal": (), "bool": (keep,),
             "additive": (torch.zeros(b, 1, s, s).masked_fill(~keep, torch.finfo(dtype).min),)}[mask]

    def f(xq, xk, xv, *m):
        q, k, v = (x.transpose(1, 2) for x in (xq, xk, xv))
        if not m:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:   # HF's SDPA path with a mask: K / V repeated per group before the op
            out = F.scaled_dot_product_attention(q, repeat_kv(k, h // hk), repeat_kv(v, h // hk), attn_mask=m[0])
        return out.transpose(1, 2).reshape(b, s, h * d)

    (region,) = _check(f, (xq, xk, xv, *extra), dtype)
    assert "a program per query head" in region.info.get("layout", ""), region.info
    assert seen and all(seen), seen


def test_a_large_constant_value_is_evaluated_again_rather_than_kept(monkeypatch):
    """A value larger than ``CONSTANT_MEMO_BYTES`` (a long prompt's mask) is not held by the graph: each ask
    evaluates it, with the same contents."""
    from torch_mirage.capture import lower
    from torch_mirage.testing.aten import trace_ir

    def f(x):
        keep = torch.arange(6)[None, :] <= torch.arange(4)[:, None]
        return x + torch.where(keep, 0.0, float("-inf"))
    graph = trace_ir(f, torch.randn(4, 6))
    (add,) = [n for n in graph.nodes if n.target_name == "aten.add.Tensor"]
    (mask,) = [v for v in add.inputs if v.producer is not None]
    monkeypatch.setattr(lower, "CONSTANT_MEMO_BYTES", 16)     # smaller than the 4 x 6 fp32 mask
    runs = []
    real = lower._evaluated
    monkeypatch.setattr(lower, "_evaluated", lambda *a: runs.append(a[1]) or real(*a))
    first, second = lower.constant_value(graph, mask), lower.constant_value(graph, mask)
    assert torch.equal(first, second) and first is not second and runs == [mask, mask]
