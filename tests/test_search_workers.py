"""search_workers: the first-level DFS branches dealt to spawned worker processes (CPU, small shapes)."""
import time

import pytest

from torch_mirage.superopt.builder import new_kernel_graph
from torch_mirage.superopt.search import driver
from torch_mirage.superopt.search.driver import search


def _silu_matmul():
    g = new_kernel_graph()
    X, W = g.new_input((4, 16), "float32"), g.new_input((16, 8), "float32")
    g.mark_output(g.silu(g.matmul(X, W)))
    return g.build()


SPECS = [((4, 16), "float32"), ((16, 8), "float32")]


def test_two_workers_find_the_same_ugraph():
    one = search(_silu_matmul(), SPECS, budget_s=60, workers=1)
    two = search(_silu_matmul(), SPECS, budget_s=60, workers=2)
    assert one.best is not None and two.best is not None
    assert one.best.hash() == two.best.hash()
    assert two.stats.oracle.get("workers") == 2 and two.stats.oracle.get("lost_workers") == []


def test_worker_crash_loses_only_its_share(monkeypatch):
    monkeypatch.setenv(driver.CRASH_ENV, "1")
    r = search(_silu_matmul(), SPECS, budget_s=60, workers=2)
    assert r.stats.oracle.get("lost_workers") == [1]
    assert r.best is None or r.source == "search"     # never an error; what worker 0 found is kept


def test_deadline_respected_with_workers():
    t = time.monotonic()
    r = search(_silu_matmul(), SPECS, budget_s=0.5, workers=2, max_ops=8)
    # spawn + import costs a few seconds; the parent never waits past deadline + GRACE_S
    assert time.monotonic() - t <= 0.5 + driver.GRACE_S + 2.0
    assert r.best is None or r.stats.verified >= 1
