"""torch_mirage.numerics: the one relative error, tolerance table and RMSNorm reference the package, the bench
and the tests share."""
import math

import pytest
import torch

from torch_mirage.numerics import TOLERANCE, relative_error, rms_norm, same_non_finite, tolerance
from torch_mirage.superopt.search.driver import _close
from torch_mirage.testing.aten import trace_ir


def test_tolerance_by_dtype_and_use():
    assert tolerance(torch.float16) == TOLERANCE["kernel"][torch.float16] == 1e-2
    assert tolerance(torch.float16, "bench") == 5e-3 and tolerance(torch.bfloat16, "model") == 6e-2
    assert tolerance(torch.bfloat16, "retile") == tolerance(torch.float16, "retile")
    with pytest.raises(ValueError, match=r"no 'probe' tolerance for torch.float32.*torch.float64"):
        tolerance(torch.float32, "probe")


def test_relative_error_norms_masks_and_zero_reference():
    ref = torch.tensor([3.0, 4.0, 0.0])
    got = torch.tensor([3.0, 4.0, 1.0])
    assert relative_error(got, ref) == pytest.approx(1 / 5)
    assert relative_error(got, ref, norm="max") == pytest.approx(1 / 4)
    assert relative_error(torch.ones(3), torch.zeros(3)) == pytest.approx(math.sqrt(3))   # absolute: ref all zero
    where = torch.tensor([1.0, 1.0, float("nan")])          # the third element is not compared
    assert relative_error(got, ref, where=where) == 0.0
    with pytest.raises(ValueError, match=r"shape \(2,\) where the reference has \(3,\)"):
        relative_error(got[:2], ref)


@pytest.mark.parametrize("norm", ["l2", "max"])
def test_a_nan_in_the_output_passes_no_tolerance(norm):
    ref = torch.randn(64)
    got = ref.clone()
    got[17] = float("nan")
    err = relative_error(got, ref, norm=norm)
    assert math.isnan(err) and not err <= 1.0
    inf = ref.clone()
    inf[3] = float("inf")
    assert relative_error(inf, ref, norm=norm) == float("inf")


def test_same_non_finite_compares_places_and_signs():
    ref = torch.tensor([1.0, float("inf"), float("nan")])
    assert same_non_finite(torch.tensor([2.0, float("inf"), float("nan")]), ref)
    assert not same_non_finite(torch.tensor([2.0, float("-inf"), float("nan")]), ref)
    assert not same_non_finite(torch.tensor([float("nan"), float("inf"), 1.0]), ref)


def test_the_search_probe_uses_the_max_norm_and_rejects_nan():
    ref = torch.randn(32, 16, dtype=torch.float64)
    assert _close([ref + 1e-9], [ref])
    one_wrong = ref.clone()
    one_wrong[5, 5] += 1.0                                   # one element off: the max norm sees it
    assert not _close([one_wrong], [ref])
    nan = ref.clone()
    nan[0, 0] = float("nan")
    assert not _close([nan], [ref])


def _written_out(x, w):
    """RMSNorm as a half-precision model writes it, spelled out (what the library claimer must match)."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


def test_rms_norm_is_the_models_formula_op_for_op():
    x, w = torch.randn(4, 32, dtype=torch.float16), torch.randn(32, dtype=torch.float16)
    ours = trace_ir(lambda x, w: rms_norm(x, 1e-6, w), x, w)
    theirs = trace_ir(_written_out, x, w)
    assert [n.target_name for n in ours.nodes] == [n.target_name for n in theirs.nodes]
    assert torch.equal(rms_norm(x, 1e-6, w), _written_out(x, w))


def test_rms_norm_without_upcast_stays_in_the_inputs_dtype():
    x = torch.randn(3, 8, dtype=torch.float64)
    out = rms_norm(x, 0.0, upcast=False)
    assert out.dtype == torch.float64
    assert torch.allclose(out.pow(2).mean(-1), torch.ones(3, dtype=torch.float64), rtol=1e-12)
    assert rms_norm(x, 0.0).dtype == torch.float64      # upcast: normed in fp32 as model code does, cast back
    assert (rms_norm(x, 0.0) - out).abs().max() > 0
