"""The tuning loop (tune.py): build, check, A B … B A timing, the winner and its cache."""
import logging

from torch_mirage.cache import DiskCache, cache_key
from torch_mirage.tune import tune

SPEED = {"a": 3.0, "b": 1.0, "c": 2.0}


def _timer(calls):
    def time_half(name, made):
        calls.append(name)
        return [SPEED[name], SPEED[name] + 0.1]
    return time_half


def test_fastest_wins_and_the_order_is_abba():
    calls = []
    t = tune(["a", "b", "c"], _timer(calls))
    assert t.winner == "b" and set(t.times) == {"a", "b", "c"} and not t.cached
    assert calls == ["a", "b", "c", "c", "b", "a"]


def test_build_failures_and_disagreements_are_dropped_and_said(caplog):
    def build(name):
        if name == "b":
            raise RuntimeError("out of shared memory")
        return name.upper()

    def check(name, made):
        assert made == name.upper()
        return "disagrees (relative error 1.00e+00)" if name == "a" else None

    with caplog.at_level(logging.INFO, logger="torch_mirage"):
        t = tune(["a", "b", "c"], _timer([]), build=build, check=check, label="launch config")
    assert t.winner == "c" and set(t.times) == {"c"} and set(t.built) == {"c"}
    assert t.dropped["b"].startswith("build") and "disagrees" in t.dropped["a"]
    text = caplog.text
    assert "launch config b failed to build" in text and "launch config a disagrees" in text


def test_a_check_that_raises_drops_the_candidate_and_only_built_things_are_kept(caplog):
    """The check runs a candidate (its outputs freed once compared: a prefill attention's candidates held 6 GiB of
    outputs at once when the build ran them, H100 11-28); a run that raises there drops it as a build failure,
    and what tune keeps for timing is what build returned, not anything the check made."""
    made_outputs = []

    def check(name, run):
        outs = run()                      # the candidate's first run, inside the check
        made_outputs.append(outs)
        return None

    def build(name):
        if name == "a":
            return lambda: 1 / 0          # compiles, fails at its first launch
        return lambda: [name] * 3

    with caplog.at_level(logging.INFO, logger="torch_mirage"):
        t = tune(["a", "b", "c"], _timer([]), build=build, check=check, label="launch config")
    assert t.winner == "b" and t.dropped["a"] == "build: ZeroDivisionError" and set(t.built) == {"b", "c"}
    assert all(callable(v) for v in t.built.values()) and made_outputs == [["b"] * 3, ["c"] * 3]
    assert "launch config a failed to build or run" in caplog.text


def test_a_timing_error_drops_only_that_candidate():
    def time_half(name, made):
        if name == "b":
            raise RuntimeError("not capturable")
        return [SPEED[name]]

    t = tune(["a", "b", "c"], time_half)
    assert t.winner == "c" and "timing" in t.dropped["b"]
    assert tune([], time_half).winner is None


def test_the_cache_answers_a_second_time(tmp_path):
    cache = DiskCache(str(tmp_path))
    key = cache_key(kind="test-tune", n=1)
    first = tune(["a", "b", "c"], _timer([]), cache=cache, key=key)
    calls = []
    again = tune(["a", "b", "c"], _timer(calls), build=lambda n: 1 / 0, cache=cache, key=key)
    assert again.cached and again.winner == first.winner == "b" and calls == []
    # a cached winner that is no longer a candidate is a miss: everything is timed again
    calls = []
    other = tune(["a", "c"], _timer(calls), cache=cache, key=key)
    assert not other.cached and other.winner == "c" and calls


def test_partial_timings_are_not_cached(tmp_path):
    cache = DiskCache(str(tmp_path))
    key = cache_key(kind="test-tune", n=2)

    def time_half(name, made):
        if name == "b":
            raise RuntimeError("not capturable")
        return [SPEED[name]]

    tune(["a", "b", "c"], time_half, cache=cache, key=key)
    assert cache.get_json(key) is None


def test_a_spent_budget_takes_the_first_candidate_that_builds_untimed(caplog):
    from torch_mirage.tune import budget

    def build(name):
        if name == "a":
            raise RuntimeError("out of shared memory")
        return name

    calls = []
    with caplog.at_level(logging.INFO, logger="torch_mirage"), budget(1e-9):
        t = tune(["a", "b", "c"], _timer(calls), build=build, label="launch config")
        again = tune(["c", "a", "b"], _timer(calls), build=build, label="launch config")
    assert (t.winner, again.winner) == ("b", "c") and calls == [] and t.times == {}
    assert t.dropped == {"a": "build: RuntimeError", "c": "tuning budget spent"}
    assert caplog.text.count("tuning budget (MIRAGE_TUNE_BUDGET_S=1e-09) is spent") == 1


def test_the_budget_stops_building_but_times_what_was_built(tmp_path):
    import time
    from torch_mirage.tune import budget

    def slow_build(name):
        time.sleep(0.05)
        return name

    cache = DiskCache(str(tmp_path))
    key = cache_key(kind="test-budget")
    with budget(0.06):
        t = tune(["a", "b", "c"], _timer([]), build=slow_build, cache=cache, key=key)
    assert set(t.times) == {"a", "b"} and t.winner == "b" and t.dropped == {"c": "tuning budget spent"}
    assert t.budget_spent and cache.get_json(key) is None          # not every candidate timed: not cached
    t = tune(["a", "b", "c"], _timer([]), build=slow_build)   # outside a budget: no limit
    assert t.winner == "b" and set(t.times) == {"a", "b", "c"}


def test_choices_outside_a_budget_are_unlimited_and_budget_zero_is_no_limit():
    from torch_mirage.tune import budget

    with budget(0):
        assert tune(["a", "b"], _timer([])).winner == "b"


def test_agrees_with_first_keeps_only_the_reference():
    """The launch tuners' check: the first candidate it runs is the reference (cloned); another is compared by
    the re-tiling tolerance of the lowest precision involved (fp16 here), and nothing else it made is kept."""
    import torch
    from torch_mirage.superopt.launch import AgreesWithFirst

    x = torch.randn(64, dtype=torch.float16)
    check = AgreesWithFirst([x], "the first launch")
    assert check("a", lambda t: [t * 2]) is None and torch.equal(check.want[0], x * 2)
    assert check("b", lambda t: [(t.float() * 2 * (1 + 1e-4)).half()]) is None       # a re-tiling's rounding
    assert "disagrees with the first launch" in check("c", lambda t: [t * 3])
    assert len(check.want) == 1
