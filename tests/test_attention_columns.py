"""H2O's column sums of P (each key's accumulated attention) found in any written form, compiled with P·V from one
plan (a two-pass FlashTensor plan or one row-block kernel) picked by a binary linear program, eager-equal."""
import itertools
import logging
import math
import os

import pytest
import torch

import torch_mirage
from helpers import assert_close
from torch_mirage.analysis.attention import find_attention
from torch_mirage.bench.workloads import h2o_core
from torch_mirage.superopt.attention_claim import plan_candidates
from torch_mirage.superopt.attention_seeds import attention_column_sums
from torch_mirage.superopt.compile import compile_ugraph
from torch_mirage.superopt.plan_select import Candidate, PlanError, plan_cost, select_plan
from torch_mirage.testing.aten import trace_ir

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU kernels run only in Triton's interpreter (TRITON_INTERPRET=1)")


# ------------------------------------------------------------------ forms
def transposed_sum(q, k, v, mask):
    """Softmax in the input dtype, the column sum spelled as a transpose and a sum over the last dim."""
    p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask, dim=-1)
    return p @ v, p.transpose(-1, -2).sum(-1)


def einsum_over_heads(q, k, v, mask):
    """Scale on q, the column sums over heads and queries by einsum, plus a per-head mean."""
    p = torch.softmax((q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2) + mask, dim=-1, dtype=torch.float32)
    return (p.to(q.dtype) @ v, torch.einsum("bhqk->bk", p), p.mean(dim=-2, keepdim=True))


def softcapped(q, k, v, mask):
    s = torch.tanh(q @ k.transpose(-1, -2) * 0.25 / 5.0) * 5.0 + mask
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return p @ v, p.sum(dim=(1, 2))


FORMS = {"h2o_core": h2o_core, "transposed_sum": transposed_sum, "einsum_over_heads": einsum_over_heads,
         "softcapped": softcapped}


def _causal(sq, skv, dtype, pad=None, fill=float("-inf")):
    """An additive mask (1 or b, 1, sq, skv): causal (bottom-right aligned), and with ``pad`` the first ``pad[r]``
    keys of batch row ``r`` masked too (its first query rows then see no key)."""
    i = torch.arange(sq)[:, None] + (skv - sq)
    keep = (torch.arange(skv)[None, :] <= i).expand(len(pad or (0,)), 1, sq, skv).clone()
    for r, p in enumerate(pad or ()):
        keep[r, :, :, :p] = False
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, fill)


def test_column_reductions_are_found_in_each_form():
    """Every spelling is read as a reduction of P over the query axis, which replayed on P's column sums gives what
    the spelling computes."""
    b, h, n, d = 1, 2, 8, 16
    args = [torch.randn(b, h, n, d) for _ in range(3)] + [_causal(n, n, torch.float32)]
    expect = {"h2o_core": [lambda p: p.sum(-2)], "transposed_sum": [lambda p: p.transpose(-1, -2).sum(-1)],
              "einsum_over_heads": [lambda p: p.sum((1, 2)), lambda p: p.mean(-2, keepdim=True)],
              "softcapped": [lambda p: p.sum((1, 2))]}
    p = torch.rand(b, h, n, n)
    for name, fn in FORMS.items():
        (spec,) = find_attention(trace_ir(fn, *args))
        assert len(spec.extra_outputs) == len(expect[name]), (name, spec.describe())
        for r, want in zip(spec.extra_outputs, expect[name]):
            torch.testing.assert_close(r.apply(p.sum(2)), want(p).to(r.dtype))


def test_other_readers_of_p_still_block_the_region():
    def f(q, k, v):
        p = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
        return p @ v, p.sum(-1), p.amax(-2)        # a row sum and a column max: not column sums

    assert not find_attention(trace_ir(f, *[torch.randn(1, 2, 4, 8) for _ in range(3)]))


# ------------------------------------------------------------------ end to end
def _run(fn, args, **options):
    torch._dynamo.reset()
    report = torch_mirage.Report()
    compiled = torch.compile(fn, backend=torch_mirage.MirageBackend(options={"min_region_us": 0, **options},
                                                                    report=report))
    outs = compiled(*args)
    regions = [r for r in report.regions if r.claimer == "attention" and r.compiled_by == "mirage"]
    return outs, regions, report


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mask", ["causal", "padding", "hf_padding"])
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("skv,plan", [(8, ["row_block"]), (136, ["flash_stats", "column_sums"])])
def test_column_sums_are_claimed_and_eager_equal(form, mask, dtype, skv, plan):
    """Each form, causal or padded (fully masked rows: NaN in eager under -inf, finite under HF's finfo.min), in
    fp32 and fp16, against eager in float64: short KV runs the row-block kernel, longer KV the two-pass plan."""
    b, h, sq, d = 2, 2, 8, 16
    fill = torch.finfo(dtype).min if mask == "hf_padding" else float("-inf")
    m = _causal(sq, skv, dtype, pad=None if mask == "causal" else (0, skv - sq + 3), fill=fill)
    args = [torch.randn(b, h, sq, d, dtype=dtype), torch.randn(b, h, skv, d, dtype=dtype),
            torch.randn(b, h, skv, d, dtype=dtype), m]
    outs, regions, report = _run(FORMS[form], args)
    assert len(regions) == 1 and "column_sums" in regions[0].info["attention"], str(report)
    assert regions[0].info["plan"] == plan, regions[0].info["plan_us"]
    refs = FORMS[form](*[a.double() for a in args])
    assert len(outs) == len(refs)
    for out, ref in zip(outs, refs):
        assert out.dtype == ref.to(out.dtype).dtype and out.shape == ref.shape
        assert torch.equal(torch.isnan(out), torch.isnan(ref)), "NaN where eager has none (or the reverse)"
        assert (mask == "padding") == bool(torch.isnan(ref).any())
        assert_close(out.double().nan_to_num(), ref.nan_to_num(), dtype)


@interpreter
@pytest.mark.parametrize("skv,mask_heads,claimed", [(8, 1, True), (136, 4, True), (136, 1, False)])
def test_gqa_column_sums_per_query_head(skv, mask_heads, claimed):
    """HF's repeat_kv (two query heads per KV head), column sums per query head: packed rows of one KV head are
    split back into heads (the row blocks of a head, or the column pass's grid over the group). The column pass
    under GQA takes a mask per (batch row, KV head) or one shared by all: a padding mask per batch row shared by
    the heads leaves long KV with no plan, and the region to Inductor."""
    b, h, hk, sq, d = 2, 4, 2, 4, 16

    def f(q, k, v, mask):
        k = k[:, :, None].expand(b, hk, h // hk, skv, d).reshape(b, h, skv, d)
        v = v[:, :, None].expand(b, hk, h // hk, skv, d).reshape(b, h, skv, d)
        p = torch.softmax(q @ k.transpose(2, 3) * d ** -0.5 + mask, dim=-1, dtype=torch.float32)
        return p.to(q.dtype) @ v, p.sum(-2)

    mask = _causal(sq, skv, torch.float32, pad=(0, 2)).expand(b, mask_heads, sq, skv).contiguous()
    args = [torch.randn(b, h, sq, d), torch.randn(b, hk, skv, d), torch.randn(b, hk, skv, d), mask]
    outs, regions, report = _run(f, args, fallback="eager")
    assert len(regions) == claimed, str(report)
    if claimed:
        assert "hk=2" in regions[0].info["attention"], regions[0].info
    assert_close(outs, f(*[a.double() for a in args]), torch.float32)


@interpreter
def test_check_stage_compares_the_column_sums(monkeypatch):
    """The compile-time check runs every output of the region against eager: column sums off by 1% hand the
    region back to the fallback (eager here: quicker on the CPU than Inductor), naming the output."""
    from torch_mirage.analysis.attention import ColumnReduction

    right = ColumnReduction.apply
    monkeypatch.setattr(ColumnReduction, "apply", lambda self, colsum: right(self, colsum) * 1.01)
    args = [torch.randn(1, 2, 8, 16) for _ in range(3)] + [_causal(8, 8, torch.float32)]
    outs, regions, report = _run(h2o_core, args, fallback="eager")
    assert not regions, str(report)
    (back,) = [r for r in report.regions if r.claimer == "attention"]
    assert back.compiled_by == "eager" and "output" in back.detail and "relative error" in back.detail, back.detail
    assert_close(outs, h2o_core(*[a.double() for a in args]), torch.float32)


# ------------------------------------------------------------------ the plans as μGraphs
@pytest.mark.parametrize("kernels", [("flash_stats", "column_sums"), ("row_block",)])
def test_column_plans_verify(kernels):
    """Both plans are μGraphs the verifier accepts against eager (P·V and the column sums per head), with a
    soft-cap, GQA-packed rows and a mask, in both tests (the field test gives no bound: the column sums add
    fractions of as many denominators as rows); column sums of a wrong scale are rejected by the field test."""
    from torch_mirage.superopt.verify import verify

    b, hk, g, sq, skv, d = 1, 2, 2, 8, 8, 16          # two row blocks per head
    kg = attention_column_sums(b, hk, g * sq, skv, d, group=g, kernels=kernels, scale=0.25, softcap=5.0,
                               mask=(1, 1), dtype="float32", tile=4)

    def probs(q, k, mask, scale):
        return torch.softmax(torch.tanh(q @ k.transpose(-1, -2) * scale / 5.0) * 5.0 + mask, -1)

    def ref(q, k, v, mask, col_scale=0.25):
        return probs(q, k, mask, 0.25) @ v, probs(q, k, mask, col_scale).reshape(b, hk * g, sq, skv).sum(2)

    xs = [torch.randn(b, hk, g * sq, d), torch.randn(b, hk, skv, d), torch.randn(b, hk, skv, d),
          torch.zeros(1, 1, g * sq, skv)]
    good = verify(kg, ref, xs)
    assert good.equivalent and "finite-field test passed" in good.reason, good.reason
    bad = verify(kg, lambda *a: ref(*a, col_scale=0.26), xs)
    assert not bad.equivalent and "output 1" in bad.reason and bad.reason.startswith("finite-field test rejects"), \
        bad.reason


@interpreter
def test_column_plan_kernels_match_torch_with_masked_tiles():
    """The compiled plans on ragged tiles (tiles of 3 rows × 6 keys, padded to 16), whole key tiles masked at the
    claimer's clamp value, a mask per batch row shared by heads (one query head per KV head), two row blocks."""
    b, hk, sq, skv, d = 2, 2, 6, 24, 16
    q, k, v = torch.randn(b, hk, sq, d), torch.randn(b, hk, skv, d), torch.randn(b, hk, skv, d)
    m = torch.zeros(b, 1, sq, skv)
    m[..., 6:12] = -1e30
    m[1, :, 2, 18:] = -1e30
    p = torch.softmax(q @ k.transpose(-1, -2) * 0.3 + m, -1)
    for kernels in (("flash_stats", "column_sums"), ("row_block",)):
        kg = attention_column_sums(b, hk, sq, skv, d, group=1, kernels=kernels, scale=0.3, mask=(b, 1),
                                   dtype="float32", tile=3 if kernels == ("row_block",) else 6)
        out, col = compile_ugraph(kg, [q, k, v, m])(q, k, v, m)
        assert_close([out, col], [p @ v, p.sum(2)], torch.float32)


def test_column_pass_derives_p_with_one_fma_and_an_exp2_per_score():
    """The column pass re-derives P from the row statistics as exp(s·c − m) / l: in the tiles every row sees whole
    (no mask) the scale, the sub and exp's log2 e are one FMA before an exp2, m·log2 e once per row; the edge tiles
    (masked, held scores) subtract first. Eager-equal under a causal band, fully masked rows included."""
    from torch_mirage.codegen.ugraph_triton import emit_block_kernel

    b, hk, sq, d = 1, 2, 12, 16
    kg = attention_column_sums(b, hk, sq, sq, d, group=1, kernels=("flash_stats", "column_sums"), scale=0.3,
                               mask=(1, 1), dtype="float32", tile=4, band=(sq, 0, None, True))
    column = kg.ops[max(i for i, op in enumerate(kg.ops) if op.name == "customized")].body
    src = emit_block_kernel(column, [4] * len(column.iterators), "column").source
    loops = src.split("for it in ")[1:]
    full = [body for body in loops if "NUM_STAGES" in body.split("\n")[0]]     # the band's pipelined loop
    assert len(full) == 1 and "tl.exp(" not in full[0] and full[0].count("tl.math.exp2(") == 1, src
    assert all("tl.exp(" in body for body in loops if body not in full), src
    m = torch.zeros(sq, sq).masked_fill(~(torch.arange(sq)[None, :] <= torch.arange(sq)[:, None]), -1e30)[None, None]
    xs = [torch.randn(b, hk, sq, d), torch.randn(b, hk, sq, d), torch.randn(b, hk, sq, d), m]
    p = torch.softmax(xs[0] @ xs[1].transpose(-1, -2) * 0.3 + m, -1)
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert_close(list(compile_ugraph(kg, xs)(*xs)), [p @ xs[2], p.sum(2)], torch.float32)


@interpreter
@pytest.mark.parametrize("group,sq,skv,offset,window,skips", [
    (1, 12, 12, 0, None, True), (2, 6, 12, 6, None, False), (1, 12, 12, 0, 5, True), (2, 8, 12, 2, 4, True),
    (1, 6, 12, 0, None, True)])
def test_column_pass_walks_only_the_query_tiles_that_see_its_keys(group, sq, skv, offset, window, skips):
    """Under a causal / sliding-window band (query p sees key k iff k <= p + offset, k > p + offset - window) the
    column pass's key blocks skip the query tiles that see none of their keys (keys no query sees get 0), compiled
    and in the executor, equal to torch; the verifier (masks drawn inside the band) accepts the plan."""
    from torch_mirage.superopt.executor import execute
    from torch_mirage.superopt.verify import verify
    from torch_mirage.ugraph import band_range

    b, hk, d, rows = 1, 2, 16, group * sq
    i, j = torch.arange(sq)[:, None], torch.arange(skv)[None, :]
    keep = (j <= i + offset) & ((j > i + offset - window) if window else True)
    m = torch.zeros(sq, skv).masked_fill(~keep, -1e30).repeat(group, 1)[None, None]
    kg = attention_column_sums(b, hk, rows, skv, d, group=group, kernels=("flash_stats", "column_sums"), scale=0.3,
                               mask=(1, 1), dtype="float32", tile=4, band=(sq, offset, window, group == 1))
    column = kg.ops[max(i for i, op in enumerate(kg.ops) if op.name == "customized")].body
    runs = [hi - lo for lo, hi in (band_range(column, blk) for blk in itertools.product(*map(range, column.grid)))]
    assert (min(runs) < column.forloop_range) == skips, runs
    xs = [torch.randn(b, hk, rows, d), torch.randn(b, hk, skv, d), torch.randn(b, hk, skv, d), m]
    p = torch.softmax(xs[0] @ xs[1].transpose(-1, -2) * 0.3 + m, -1)
    want = [p @ xs[2], p.reshape(b, hk * group, sq, skv).sum(2)]
    assert_close(list(compile_ugraph(kg, xs)(*xs)), want, torch.float32)
    assert_close(list(execute(kg, [x.double() for x in xs])), want, torch.float32)
    if (group, window) == (1, None):
        def ref(q, k, v, mask):
            pr = torch.softmax(q @ k.transpose(-1, -2) * 0.3 + mask, -1)
            return pr @ v, pr.sum(2)
        assert verify(kg, ref, xs).equivalent


@interpreter
@pytest.mark.parametrize("group", [1, 2])
def test_both_passes_scan_the_mask_tile_table(monkeypatch, group):
    """The two-pass plan with the mask's tile table (a mask passed in, no band known): launches that scan it walk,
    in the FlashAttention pass, only the key tiles a row block sees and, in the column pass, only the query tiles
    that see a key block's keys — keys no query sees (padding) hold NaN and are never read — and neither reads
    the mask on its all-0 squares; eager-equal under a causal mask with padding, a square that is 0 but for one
    entry, and a random mask (nothing skipped)."""
    from torch_mirage.superopt import compile as compile_mod
    from torch_mirage.superopt.launch import scanning

    own = compile_mod.untuned_config
    monkeypatch.setattr(compile_mod, "untuned_config", lambda bg: scanning(bg, [own(bg)])[0])
    b, hk, n, d = 1, 2, 256, 16
    sq = n // group                                    # GQA: the group's query heads packed, sq rows each
    kg = attention_column_sums(b, hk, n, n, d, group=group, kernels=("flash_stats", "column_sums"), scale=0.3,
                               mask=(1, 1), dtype="float32", tile=64, scan_table=True)
    causal = torch.full((sq, n), float("-inf")).triu(1 + n - sq).repeat(group, 1)
    causal[:, 192:] = float("-inf")
    causal[100, 10] = -3.0
    for m, padded in ((causal, True), (torch.randn(n, n), False)):
        m = m[None, None]
        q, k, v = torch.randn(b, hk, n, d), torch.randn(b, hk, n, d), torch.randn(b, hk, n, d)
        p = torch.softmax(q.double() @ k.double().transpose(-1, -2) * 0.3 + m.double(), -1)
        want = [p @ v.double(), p.reshape(b, hk * group, sq, n).sum(2)]
        if padded:
            k[..., 192:, :], v[..., 192:, :] = float("nan"), float("nan")
        c = compile_ugraph(kg, [q, k, v, m])
        scanned = [src for src in c.sources if "zero_lo" in src]
        assert len(scanned) == 2, "both passes scan the table and skip the mask on all-0 squares"
        assert_close(list(c(q, k, v, m)), [w.float() for w in want], torch.float32)


@interpreter
def test_scanned_column_pass_gives_eager_nan_for_a_row_it_skips(monkeypatch):
    """A row masked whole by -inf makes eager's column sums NaN for every key of its head (the sum over its NaN
    row). The scanning column pass never visits that row for key blocks whose square with it is all -inf (here
    keys 64.. against rows 0..63 under a causal mask), so the region's kernel takes the rows it must fill from the
    first pass's row sums: eager's NaN pattern exactly — the other head, whose rows all see a key, stays finite."""
    from torch_mirage.superopt import compile as compile_mod
    from torch_mirage.superopt.attention_claim import run_spec
    from torch_mirage.superopt.launch import scanning

    own = compile_mod.untuned_config
    monkeypatch.setattr(compile_mod, "untuned_config", lambda bg: scanning(bg, [own(bg)])[0])
    b, h, n, d = 1, 2, 128, 16
    m = _causal(n, n, torch.float32).repeat(1, h, 1, 1)
    m[0, 0, 3] = float("-inf")                        # head 0, row 3: no key
    args = [torch.randn(b, h, n, d) for _ in range(3)] + [m]
    (spec,) = find_attention(trace_ir(h2o_core, *args))
    kg = attention_column_sums(b, h, n, n, d, group=1, kernels=("flash_stats", "column_sums"), scale=d ** -0.5,
                               mask=(1, h), dtype="float32", tile=64, scan_table=True, row_sums=True)
    c = compile_ugraph(kg, args)
    assert sum("zero_lo" in src for src in c.sources) == 2, "both passes scan the table"
    assert torch.isfinite(c(*args)[1][0, 0, 64:]).all(), "the column pass itself skips row 3 for keys 64.."
    want = h2o_core(*[a.double() for a in args])
    got = run_spec(spec, c, *args)
    for g, w in zip(got, want):
        assert torch.equal(torch.isnan(g), torch.isnan(w)), "NaN where eager has none (or the reverse)"
        assert_close(g.double().nan_to_num(), w.nan_to_num(), torch.float32)
    assert torch.isnan(got[1][0, 0]).all() and torch.isfinite(got[1][0, 1]).all()


def test_column_pass_gets_its_own_schedules():
    """The two-pass plan's column pass (keys per program, the loop over query tiles) is recognised, and the column
    schedules — 128-row steps on 8 warps among them — are timed besides the roofline re-tilings, scanning the
    table where the plan has one; the FlashAttention pass and a GEMV are not column passes."""
    from torch_mirage.superopt.launch import COLUMN_SCHEDULES, candidates, column_candidates, column_pass

    kg = attention_column_sums(1, 32, 1024, 1024, 128, group=1, kernels=("flash_stats", "column_sums"), scale=0.09,
                               mask=(1, 1), dtype="bfloat16", mask_dtype="bfloat16", tile=64, scan_table=True)
    bodies = [op.body for op in kg.ops if op.name == "customized"]
    flash, columns = bodies[-2], bodies[-1]
    assert column_pass(flash) is None and column_pass(columns) == (2, 1024, 1024)
    own = column_candidates(columns)
    assert {(c.grid[2], c.forloop_range, c.num_warps, c.num_stages) for c in own} == \
        {(1024 // t, 1024 // r, w, st) for t, r, w, st in COLUMN_SCHEDULES}
    cands = candidates(columns, 132)
    assert all(c.mask_scan for c in cands if c.grid[2] in (4, 8) and c.forloop_range in (8, 16))
    assert {(c.grid, c.forloop_range, c.num_warps, c.num_stages) for c in own} <= \
        {(c.grid, c.forloop_range, c.num_warps, c.num_stages) for c in cands}
    assert len(set(cands)) == len(cands)


@interpreter
def test_column_schedules_are_eager_equal(monkeypatch):
    """Each column schedule that re-tiles a small column pass (256 keys and query rows) computes eager's column
    sums under a causal mask."""
    from torch_mirage.superopt import compile as compile_mod
    from torch_mirage.superopt.launch import column_candidates, column_pass

    b, hk, n, d = 1, 2, 256, 16
    kg = attention_column_sums(b, hk, n, n, d, group=1, kernels=("flash_stats", "column_sums"), scale=0.3,
                               mask=(1, 1), dtype="float32", tile=64)
    m = torch.full((n, n), float("-inf")).triu(1)[None, None]
    q, k, v = (torch.randn(b, hk, n, d) for _ in range(3))
    p = torch.softmax(q.double() @ k.double().transpose(-1, -2) * 0.3 + m.double(), -1)
    cands = column_candidates(next(op.body for op in reversed(kg.ops) if op.name == "customized"))
    assert len(cands) >= 3
    own = compile_mod.untuned_config
    for cfg in cands:
        monkeypatch.setattr(compile_mod, "untuned_config", lambda bg: cfg if column_pass(bg) else own(bg))
        c = compile_ugraph(kg, [q, k, v, m])
        assert any(f"pid_2 * {n // cfg.grid[2]}" in src for src in c.sources), cfg
        assert_close(c(q, k, v, m)[1], p.sum(2).float(), torch.float32)


@interpreter
def test_column_sums_under_an_in_graph_causal_mask():
    """A causal mask from index comparisons (its value property gives the band) with column sums over KV too long
    for whole rows: the two-pass plan under the band, eager-equal in float64 (the check stage ran it on the mask
    the graph computes)."""
    def f(q, k, v):
        n = q.shape[-2]
        i = torch.arange(n, device=q.device)
        s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(i[None, :] > i[:, None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        return p @ v, p.sum(-2)

    args = [torch.randn(1, 1, 136, 16) for _ in range(3)]
    outs, regions, report = _run(f, args, fallback="eager")
    assert len(regions) == 1 and regions[0].info["plan"] == ["flash_stats", "column_sums"], str(report)
    assert regions[0].info["forloop_band"][3:5] == [136, 0], regions[0].info
    assert_close(outs, f(*[a.double() for a in args]), torch.float32)


@interpreter
def test_check_stage_feeds_in_graph_masks_as_computed():
    """A banded attention whose causal mask is computed in the graph skips whole key tiles (136 keys, tiles of
    34): the compile-time check feeds that mask as the graph computes it (random masks break the band's
    precondition), so the region stays mirage's."""
    def f(q, k, v):
        i = torch.arange(q.shape[-2], device=q.device)
        s = (q @ k.transpose(-1, -2)).masked_fill(i[None, :] > i[:, None], float("-inf"))
        return torch.softmax(s, dim=-1) @ v

    args = [torch.randn(1, 1, 136, 16) for _ in range(3)]
    out, regions, report = _run(f, args, fallback="eager")
    assert len(regions) == 1 and regions[0].info["forloop_band"][4] == 0, str(report)
    assert_close(out, f(*[a.double() for a in args]), torch.float32)


def test_plan_kernels_must_produce_what_they_need_first():
    with pytest.raises(ValueError, match="needs"):
        attention_column_sums(1, 1, 4, 8, 16, group=1, kernels=("column_sums", "flash_stats"), scale=0.25)
    with pytest.raises(ValueError, match="do not produce both"):
        attention_column_sums(1, 1, 4, 8, 16, group=1, kernels=("flash",), scale=0.25)


# ------------------------------------------------------------------ the BLP
def _greedy(cands, outputs):
    """Per output, the cheapest way to make it alone (a producer, plus the cheapest producer of each value it
    needs); the union of those choices."""
    chosen = {}
    for o in sorted(outputs):
        def alone(c):
            return c.cost_us + sum(min(p.cost_us for p in cands if t in p.produces) for t in c.needs)
        best = min((c for c in cands if o in c.produces), key=alone)
        chosen[best.name] = best
        for t in best.needs:
            dep = min((p for p in cands if t in p.produces), key=lambda p: p.cost_us)
            chosen[dep.name] = dep
    return list(chosen.values())


def test_blp_beats_the_greedy_choice_on_h2o():
    """h2o_core at the bench's n = 1024 (meta tensors), costs from the cost model: a greedy choice per output takes
    FlashAttention for P·V and FlashAttention-with-statistics again for the column pass; the BLP sees that one
    kernel can do both (each output produced once, the statistics shared)."""
    b, h, n, d = 1, 32, 1024, 128
    args = [torch.randn(b, h, n, d, dtype=torch.float16, device="meta") for _ in range(3)]
    g = trace_ir(h2o_core, *args, torch.zeros(1, 1, n, n, dtype=torch.float16, device="meta"))
    (spec,) = find_attention(g)
    cands = plan_candidates(spec, g, (1, 1))
    assert "row_block" not in {c.name for c in cands}          # KV too long for whole rows in a block
    plan = select_plan(cands, ("out", "colsum"))
    greedy = _greedy(cands, ("out", "colsum"))
    assert [c.name for c in plan] == ["flash_stats", "column_sums"]
    assert plan_cost(plan) < plan_cost(greedy), (plan, greedy)
    assert sum("out" in c.produces for c in greedy) == 2        # greedy computes P·V twice


def test_blp_constraints():
    c = lambda name, cost, produces, needs=(): Candidate(name, cost, frozenset(produces), frozenset(needs))
    cands = [c("a", 1.0, {"x"}), c("b", 1.5, {"x", "t"}), c("u", 1.0, {"y"}, {"t"}), c("t", 1.0, {"t"}),
             c("xy", 3.0, {"x", "y"})]
    assert [x.name for x in select_plan(cands, {"x", "y"})] == ["b", "u"]          # 2.5: t shared, not paid twice
    assert [x.name for x in select_plan(cands[:4] + [c("xy", 2.0, {"x", "y"})], {"x", "y"})] == ["xy"]
    assert [x.name for x in select_plan(cands, {"x"})] == ["a"]
    with pytest.raises(PlanError, match="no candidate kernel produces"):
        select_plan(cands, {"z"})
    with pytest.raises(PlanError, match="no plan"):
        select_plan([c("u", 1.0, {"y"}, {"t"})], {"y"})                          # t has no producer


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_column_plan_with_tile_table_tuned(dtype, caplog):
    """H100: the two-pass H2O plan with the mask's tile table, tuned (scanning launches timed among the candidates
    of both passes; the column pass's re-tilings that split a square are not scanned) on a causal mask with padded
    keys, fp64-equal for that mask and a random one. Whether a scanning launch wins is the bench's to show: at 4
    heads the unscanned re-tilings fill idle SMs, and on 11-27 (seventh session) bf16 once kept none."""
    n, h, d = 1024, 4, 128
    name = {torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    kg = attention_column_sums(1, h, n, n, d, group=1, kernels=("flash_stats", "column_sums"), scale=d ** -0.5,
                               mask=(1, 1), dtype=name, mask_dtype=name, scan_table=True)
    q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=dtype) for _ in range(3))
    causal = torch.full((n, n), float("-inf"), device="cuda").triu(1)
    causal[:, 1000:] = float("-inf")
    with caplog.at_level(logging.INFO, logger="torch_mirage"):
        c = compile_ugraph(kg, [q, k, v, causal[None, None].to(dtype)])
    timed = [m for m in caplog.messages if m.startswith("torch_mirage: launch config")]
    assert sum('"mask_scan": true' in m for m in timed) >= 2, "both passes timed scanning launches"
    for m in (causal, torch.randn(n, n, device="cuda")):
        m = m[None, None].to(dtype)
        p = torch.softmax(q.double() @ k.double().transpose(-1, -2) * d ** -0.5 + m.double(), -1)
        out, col = c(q, k, v, m)
        assert_close(out, (p @ v.double()).to(dtype), dtype)
        assert_close(col, p.sum(2).float(), dtype)
