import logging
import os
import re
import subprocess
import sys

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


# ---------------------------------------------------------------------------------------------
# Bad values through both channels: the error names the variable or the options= key, and what is allowed

BAD_VALUES = [
    ("verify_trials", "-5", -5, "must be >= 0"),
    ("verify_trials", "many", "many", "is not an int"),
    ("verify_error_bound", "-1", -1.0, "strictly between 0 and 1"),
    ("verify_error_bound", "nan", float("nan"), "strictly between 0 and 1"),
    ("verify_error_bound", "1", 1.0, "strictly between 0 and 1"),
    ("min_region_us", "-3", -3.0, "must be >= 0"),
    ("min_region_us", "nan", float("nan"), "must be >= 0"),
    ("min_region_us", "-5", -5.0, "must be >= 0"),
    ("min_region_us", "fast", "fast", "is not a float"),
    ("search_budget_s", "-1", -1.0, "must be >= 0"),
    ("search_workers", "0", 0, "must be >= 1"),
    ("search_workers", "two", "two", "is not an int"),
    ("cache_dir", "", "", "non-empty path"),
    ("cache_dir", "  ", "  ", "non-empty path"),
    ("stitch", "maybe", "maybe", "not a boolean"),
    ("fallback", "tvm", "tvm", "'inductor', 'eager'"),
    ("log_level", "loud", "loud", "'DEBUG', 'INFO', 'WARNING', 'ERROR'"),
]


@pytest.mark.parametrize("name,env_value,option_value,says", BAD_VALUES)
def test_bad_value_through_the_environment_names_the_variable(name, env_value, option_value, says):
    with pytest.raises(config.ConfigError) as info:
        config.load(environ={config.env_name(name): env_value})
    message = str(info.value)
    assert f"{config.env_name(name)}={env_value!r}" in message and says in message, message
    assert "options=" not in message


@pytest.mark.parametrize("name,env_value,option_value,says", BAD_VALUES)
def test_bad_value_through_options_names_the_key(name, env_value, option_value, says):
    with pytest.raises(config.ConfigError) as info:
        config.load({name: option_value}, environ={})
    message = str(info.value)
    assert f"options={{{name!r}: " in message and says in message, message
    assert "MIRAGE_" not in message


def test_good_edge_values_are_accepted():
    cfg = config.load({"verify_trials": 0, "min_region_us": 0, "verify_error_bound": 0.5}, environ={})
    assert (cfg.verify_trials, cfg.min_region_us, cfg.verify_error_bound) == (0, 0.0, 0.5)


def test_every_range_is_checked_by_the_dataclass_too():
    with pytest.raises(config.ConfigError, match="verify_trials=-1"):
        config.load(environ={}).replace(verify_trials=-1)


def test_unknown_variable_warns_once_with_the_closest_knob(caplog):
    environ = {"MIRAGE_STICH": "0", "MIRAGE_BUILD_CSRC": "0", "MIRAGE_STITCH": "1"}
    with caplog.at_level(logging.WARNING, logger="torch_mirage"):
        config.load(environ=environ)
        config.load(environ=environ)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "MIRAGE_STICH " in lines[0] and "did you mean MIRAGE_STITCH?" in lines[0], lines


def test_new_fields_are_knobs_with_their_checks_at_once(monkeypatch, caplog):
    """A knob added to Config (as the search's budget will be) is read, range-checked, and known to the
    unknown-variable warning, with no list to update."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Extended(config.Config):
        search_budget_s_test: float = config._knob(30.0, "test knob", check=config.at_least(0))

    monkeypatch.setattr(config, "Config", Extended)
    with caplog.at_level(logging.WARNING, logger="torch_mirage"):
        cfg = config.load(environ={"MIRAGE_SEARCH_BUDGET_S_TEST": "5", "MIRAGE_SEARCH_BUDGT_S_TEST": "1"})
    assert cfg.search_budget_s_test == 5.0
    (line,) = [r.getMessage() for r in caplog.records]
    assert "MIRAGE_SEARCH_BUDGT_S_TEST" in line and "did you mean MIRAGE_SEARCH_BUDGET_S_TEST?" in line
    with pytest.raises(config.ConfigError, match="MIRAGE_SEARCH_BUDGET_S_TEST='-1'"):
        config.load(environ={"MIRAGE_SEARCH_BUDGET_S_TEST": "-1"})
    assert "`MIRAGE_SEARCH_BUDGET_S_TEST` | `search_budget_s_test` | `30.0` | test knob Must be >= 0." in \
        config.describe()


def test_unknown_option_suggests_the_closest():
    with pytest.raises(KeyError, match="did you mean 'stitch'"):
        config.load({"stich": True}, environ={})


def test_registered_with_torch_logging_and_mirage_log_level_wins(monkeypatch):
    from torch._logging._internal import log_registry

    from torch_mirage.backend import _configure_logging

    assert log_registry.is_log("torch_mirage")
    log = logging.getLogger("torch_mirage")
    monkeypatch.delenv("TORCH_LOGS", raising=False)
    try:
        torch._logging.set_logs(modules={"torch_mirage": logging.DEBUG})   # what TORCH_LOGS=+torch_mirage does
        assert log.level == logging.DEBUG
        _configure_logging("WARNING", explicit=False)     # no MIRAGE_LOG_LEVEL: TORCH_LOGS' level stays
        assert log.level == logging.DEBUG
        _configure_logging("ERROR", explicit=True)        # MIRAGE_LOG_LEVEL given: it wins
        assert log.level == logging.ERROR
    finally:
        torch._logging.set_logs()
        log.setLevel(logging.NOTSET)
        _configure_logging("WARNING", explicit=False)
    assert log.level == logging.WARNING


@pytest.mark.parametrize("value,says", [("-5", "MIRAGE_MIN_REGION_US='-5': min_region_us must be >= 0"),
                                        ("fast", "MIRAGE_MIN_REGION_US='fast' is not a float")])
def test_a_bad_value_stops_torch_compile_with_the_same_clear_error(monkeypatch, value, says):
    """Out of range or not a number, through torch.compile: one ConfigError naming the variable, not a fallback."""
    monkeypatch.setenv("MIRAGE_MIN_REGION_US", value)
    with pytest.raises(Exception) as info:
        torch.compile(lambda x: torch.softmax(x, -1), backend="mirage")(torch.randn(4, 8))
    error = info.value
    while not isinstance(error, config.ConfigError) and (getattr(error, "inner_exception", None) or error.__cause__):
        error = getattr(error, "inner_exception", None) or error.__cause__    # Dynamo's BackendCompilerFailed
    assert isinstance(error, config.ConfigError) and says in str(error), repr(info.value)
    assert says in str(info.value)        # the message the user sees names it too


def test_every_knob_is_read_by_the_package():
    """A knob nothing reads would be documented and do nothing: each field is read as ``config.<name>`` /
    ``cfg.<name>`` outside config.py."""
    root = os.path.dirname(torch_mirage.__file__)
    text = ""
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py") and os.path.join(folder, name) != config.__file__:
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    text += f.read()
    unread = [name for name in config.Config.__dataclass_fields__
              if not re.search(rf"\b(config|cfg)\.{name}\b", text)]
    assert not unread, f"knobs nothing reads: {unread}"


@pytest.mark.parametrize("torch_logs,level", [("+torch_mirage", logging.DEBUG), ("torch_mirage", logging.INFO)])
def test_torch_logs_in_a_fresh_process_turns_the_logger_on(torch_logs, level):
    """TORCH_LOGS is read when torch is imported, before torch_mirage registers its log: it still applies."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIRAGE_")}
    env.update(TORCH_LOGS=torch_logs, PYTHONPATH=os.pathsep.join(sys.path))
    code = "import logging, torch, torch_mirage; print(logging.getLogger('torch_mirage').getEffectiveLevel())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) == level


def test_every_inductor_mode_compiles_the_fallback_with_its_own_configs():
    """Each choice of ``inductor_mode`` has Inductor config patches (one mapping for the fallback's partitions, the
    measure stage's region versions and a whole graph), and a graph whose fallback holds a matmul gives eager's
    answer under the GEMM-only mode."""
    import dataclasses

    from torch_mirage.runtime.assemble import inductor_configs

    choices = next(f for f in dataclasses.fields(config.Config) if f.name == "inductor_mode").metadata["choices"]
    assert inductor_configs("default") == {} and inductor_configs("max-autotune-gemm") == {"max_autotune_gemm": True}
    assert all(isinstance(inductor_configs(m), dict) for m in choices)

    def f(x, w):
        return torch.relu(x @ w) + 1.0
    x, w = torch.randn(8, 16), torch.randn(16, 8)
    torch._dynamo.reset()
    got = torch.compile(f, backend="mirage", options={"inductor_mode": "max-autotune-gemm", "stitch": False})(x, w)
    torch.testing.assert_close(got, f(x, w))
