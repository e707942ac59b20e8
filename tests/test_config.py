import pytest
import torch

import torch_mirage
from torch_mirage import config


def test_defaults_and_env_override():
    cfg = config.load(environ={})
    assert cfg.cuda_graphs is True and cfg.fallback == "inductor" and cfg.strict is False
    cfg = config.load(environ={"MIRAGE_CUDA_GRAPHS": "0", "MIRAGE_STRICT": "yes", "MIRAGE_VERIFY_ERROR_BOUND": "2.5e-6",
                               "MIRAGE_FALLBACK": "eager", "MIRAGE_LOG_LEVEL": "debug"})
    assert (cfg.cuda_graphs, cfg.strict, cfg.verify_error_bound, cfg.fallback, cfg.log_level) == (False, True, 2.5e-6, "eager", "DEBUG")


def test_options_override_env():
    cfg = config.load({"cuda_graphs": True, "mirage.verify_trials": 7}, environ={"MIRAGE_CUDA_GRAPHS": "0"})
    assert cfg.cuda_graphs is True and cfg.verify_trials == 7


@pytest.mark.parametrize("bad", [{"no_such_knob": 1}, {"fallback": "tvm"}, {"verify_trials": "many"}])
def test_bad_options_raise_with_the_knob_named(bad):
    with pytest.raises((KeyError, ValueError, TypeError)) as info:
        config.load(bad, environ={})
    assert list(bad)[0].split(".")[-1] in str(info.value) or "MIRAGE" in str(info.value)


def test_bad_env_value_names_the_variable():
    with pytest.raises(ValueError, match="MIRAGE_CUDA_GRAPHS"):
        config.load(environ={"MIRAGE_CUDA_GRAPHS": "maybe"})


def test_printable_and_documented():
    text = str(config.load(environ={}))
    table = config.describe()
    for name in config.Config.__dataclass_fields__:
        assert name in text and config.env_name(name) in table


def test_output_key_changes_with_output_affecting_fields_only():
    a, b = config.load(environ={}), config.load({"fallback": "eager"}, environ={})
    assert a.output_key() != b.output_key()
    assert a.output_key() == config.load({"log_level": "DEBUG"}, environ={}).output_key()


def test_backend_registered_by_entry_point():
    assert "mirage" in torch._dynamo.list_backends()


def test_options_reach_the_backend():
    report = torch_mirage.Report()
    backend = torch_mirage.MirageBackend(options={"fallback": "eager"}, report=report)
    fn = torch.compile(lambda x: torch.sin(x) * 2, backend=backend)
    x = torch.randn(8)
    torch.testing.assert_close(fn(x), torch.sin(x) * 2)
    assert report.regions and all(r.compiled_by == "eager" for r in report.regions)
