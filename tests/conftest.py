import os

import pytest
import torch

# Without a GPU, generated Triton kernels run in Triton's interpreter (read when @triton.jit runs), so the
# stitch claimer claims on CPU tensors in every test, the way it does on CUDA.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# CPU tests use tiny shapes: claim regions of any size so the kernels are exercised (one test checks the threshold)
os.environ.setdefault("MIRAGE_MIN_REGION_US", "0")

# Backend tests run without CUDA graphs unless a test asks; cache in a per-session temp dir.
os.environ.setdefault("MIRAGE_CACHE_DIR", os.path.join(os.environ.get("TMPDIR", "/tmp"), f"mirage-test-cache-{os.getpid()}"))

from torch_mirage.numerics import relative_error, tolerance  # noqa: E402  (after the variables above are set)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The package's relative error (torch_mirage.numerics), with a NaN in the output named as such."""
    out, ref = out.detach().cpu(), ref.detach().cpu()
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(out).any() or torch.isnan(ref).any(), "NaN in output"
    return relative_error(out, ref)


def assert_close(out, ref, dtype=None) -> None:
    """Each output within the package's kernel tolerance for its dtype (or ``dtype``) of its reference."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        tol = tolerance(dtype or o.dtype)
        err = rel_error(o, r)
        assert err <= tol, f"relative error {err:.3e} > {tol:g} ({o.dtype}, shape {tuple(o.shape)})"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
