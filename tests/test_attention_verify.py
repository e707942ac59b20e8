"""The attention claimer's seeds verified before they run (superopt/attention_verify.py): each seed's small instance
keeps the region's parameters (mask kind and sharing, band, soft-cap, the seed's schedule kind) and passes the
verifier against softmax attention written in PyTorch; a claim reports each seed's verdict; a seed the verifier
rejects is not run, and a region whose seeds all fail is declined, saying why."""
import os
import sys

import pytest
import torch

from torch_mirage.config import Config
from torch_mirage.superopt import attention_verify
from torch_mirage.superopt.attention_verify import small_instance, verify_seed

sys.path.insert(0, os.path.dirname(__file__))
from test_attention_family import _attention_regions, _compile, _qkv, hf_eager_attention, hf_mask  # noqa: E402

DECODE = dict(scale=0.088, softcap=None, mask=(1, 1), dtype="bfloat16", band=None)


@pytest.mark.parametrize("seed,kwargs,own,field", [
    ("flash_decoding", dict(DECODE, mask_dtype="bool", empty_rows="zero"), {"splits": 32}, True),
    ("flash_attention", dict(DECODE, mask_dtype="bool", empty_rows="zero"), {}, True),
    ("flash_decoding", dict(DECODE, mask_dtype="float32", band=(1, 4000, None, True, True), empty_rows="zero"),
     {"splits": 16}, True),
    ("flash_attention", dict(scale=0.125, softcap=50.0, mask=(1, 1), dtype="float16", mask_dtype="float32",
                             band=(8, 0, 3, True, False), empty_rows="nan"), {}, True),
    ("flash_attention", dict(scale=0.125, softcap=None, mask=(2, 4), dtype="float16", mask_dtype="float32",
                             band=None, empty_rows="nan"), {"scan_table": True}, False),
])
def test_small_instances_of_the_seeds_verify(seed, kwargs, own, field):
    """Seeds at Llama-sized parameters (4k keys, heads of 128, 32 splits) verify at their small instance: the
    finite-field test where the program is LAX (a scan table's -inf sums make it float-only)."""
    b, hk, group, sq, skv = (1, 8, 4, 1, 4096) if kwargs["dtype"] == "bfloat16" else (2, 4, 2, 8, 1024)
    dims, small, small_own = small_instance(b, hk, group, sq, skv, kwargs, own)
    assert dims[0] == 1 and dims[1] <= 2 and dims[4] == 8 and small["scale"] == kwargs["scale"]
    assert small["empty_rows"] == "nan" and (small["band"] is None) == (kwargs["band"] is None)
    if "splits" in own:
        assert small_own["splits"] == 2
    verdict = verify_seed(seed, dims, small, small_own, Config())
    assert verdict.equivalent, verdict.reason
    assert ("finite-field test passed" in verdict.reason) == field, verdict.reason


def test_a_seed_that_computes_something_else_is_rejected():
    """The same seed against a reference with another scale, or another soft-cap: rejected by the field test."""
    kwargs = dict(scale=0.25, softcap=30.0, mask=(1, 2), dtype="float32", mask_dtype="float32", band=None,
                  empty_rows="nan")
    dims, small, own = small_instance(1, 2, 2, 2, 64, kwargs, {})
    assert verify_seed("flash_attention", dims, small, own, Config()).equivalent
    for wrong in (dict(small, scale=0.26), dict(small, softcap=31.0)):
        kg = attention_verify.SEEDS["flash_attention"](*dims, **small, **own)
        ref = attention_verify.reference(wrong["scale"], wrong["softcap"], float("-inf"))
        xs = [torch.zeros(tuple(op.attrs["shape"])) for op in kg.inputs]
        verdict = attention_verify.verify(kg, ref, xs)
        assert not verdict.equivalent and verdict.reason.startswith("finite-field test rejects"), verdict.reason


def _eager_causal():
    b, h, hk, sq, skv, d = 2, 4, 2, 8, 8, 16
    q, k, v = _qkv(b, h, hk, sq, skv, d, torch.float32)
    mask = hf_mask(b, sq, skv, torch.float32)

    def f(q, k, v, mask):
        return hf_eager_attention(q, k, v, mask, d ** -0.5, None)
    return f, (q, k, v, mask)


def test_a_claim_reports_each_seeds_verdict():
    torch._dynamo.reset()
    f, args = _eager_causal()
    compiled, report = _compile(f)
    compiled(*args)
    (region,) = _attention_regions(report)
    verdicts = region.info["verified"]
    assert verdicts and all("test passed" in v or "float test only" in v for v in verdicts.values()), verdicts


def test_seeds_the_verifier_rejects_do_not_run(monkeypatch):
    """With a reference that computes something else (another scale), every seed is rejected: the region is
    declined with the verifier's reasons and runs as eager / Inductor computes it — still correct."""
    real = attention_verify.reference
    monkeypatch.setattr(attention_verify, "reference", lambda scale, *a: real(scale * 1.01, *a))
    monkeypatch.setattr(attention_verify, "REFERENCE", "softmax attention at a wrong scale")   # no cached verdict
    torch._dynamo.reset()
    f, args = _eager_causal()
    compiled, report = _compile(f)
    out = compiled(*args)
    assert not _attention_regions(report)
    declines = [d for r in report.regions for d in r.declines if d.claimer == "attention"]
    assert declines and "finite-field test rejects" in declines[0].detail, str(report)
    torch.testing.assert_close(out, f(*args), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernels,table", [(("flash_stats", "column_sums"), False), (("row_block",), False),
                                           (("flash_stats", "column_sums"), True)])
def test_column_sum_plans_verify_small(kernels, table):
    """H2O's plans at the claim's parameters (row sums output on, 64-key tiles, 1k keys) verify at their small
    instance without the row sums (which depend on the row max): the field test passes where no scan table makes
    the program float-only; a plan whose column sums use another scale is rejected."""
    kwargs = dict(scale=0.125, softcap=None, mask=(1, 1), dtype="float16", mask_dtype="float32", band=None)
    own = dict(group=2, kernels=kernels, tile=64, scan_table=table, row_sums=True)
    dims, small, small_own = small_instance(2, 4, 2, 512, 1024, kwargs, own)
    assert small_own["row_sums"] is False and small_own["group"] == 2 and "tile" not in small
    assert small_own["tile"] == (64 if table else 4)        # a scan table's squares are 64 keys
    verdict = verify_seed("column_sums", dims, small, small_own, Config())
    assert verdict.equivalent, verdict.reason
    assert ("finite-field test passed" in verdict.reason) == (not table), verdict.reason
    if not table:
        kg = attention_verify.BUILDERS["column_sums"](*dims, **small, **small_own)
        wrong = attention_verify.reference(0.126, None, float("-inf"), (2, dims[2] // 2))
        xs = [torch.zeros(tuple(op.attrs["shape"])) for op in kg.inputs]
        assert not attention_verify.verify(kg, wrong, xs).equivalent


def test_a_column_sum_claim_reports_its_plans_verdicts():
    """H2O's attention with column sums (a causal additive mask): each plan the claim keeps says how it verified."""
    from torch_mirage.bench.workloads import h2o_core
    from test_attention_columns import _causal, _run

    args = [torch.randn(1, 2, 8, 16) for _ in range(3)] + [_causal(8, 8, torch.float32)]
    outs, regions, report = _run(h2o_core, args)
    (region,) = regions
    verdicts = region.info["verified"]
    assert verdicts and all("test passed" in v or "float test only" in v for v in verdicts.values()), verdicts
    torch.testing.assert_close(outs, h2o_core(*args), rtol=1e-4, atol=1e-4)


def test_a_seeds_verdict_is_kept_in_the_process(monkeypatch):
    """A model's next layer asks for the same seed at the same small instance: answered without building it again;
    another reference (its name) is asked anew."""
    from torch_mirage.cache import ProcessMemo

    kwargs = dict(scale=0.25, softcap=None, mask=None, dtype="float32", mask_dtype="float32", band=None,
                  empty_rows="nan")
    dims, small, own = small_instance(1, 2, 2, 2, 64, kwargs, {})
    monkeypatch.setattr(attention_verify, "_VERDICTS", ProcessMemo(256))
    built = []
    real = attention_verify.BUILDERS["flash_attention"]
    monkeypatch.setitem(attention_verify.BUILDERS, "flash_attention", lambda *a, **k: built.append(1) or real(*a, **k))
    first = verify_seed("flash_attention", dims, small, own, Config())
    assert verify_seed("flash_attention", dims, small, own, Config()) is first and len(built) == 1
    monkeypatch.setattr(attention_verify, "REFERENCE", "another reference")
    verify_seed("flash_attention", dims, small, own, Config())
    assert len(built) == 2 and first.equivalent
