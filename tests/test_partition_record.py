"""The partition record (:mod:`torch_mirage.partition.record`): a graph partitioned once on a disk cache is
replayed on that cache — the same regions, plans and declines, without the claimers' exploration — and a record
that does not replay, or one made under other settings, is never used."""
import pytest
import torch
import torch.nn.functional as F

import torch_mirage
from torch_mirage.cache import DiskCache
from torch_mirage.config import load
from torch_mirage.context import CompileContext
from torch_mirage.partition import stitch
from torch_mirage.partition.record import PartitionRecord
from torch_mirage.pipeline import claim_regions, default_claimers
from torch_mirage.superopt import gemv_claim
from torch_mirage.superopt.search import claimer as search_claimer
from torch_mirage.testing.aten import trace_ir
from helpers import assert_close


def decoder_piece(x, g, w1, w3, w2, y, z, q, k, v):
    """A norm before a gated MLP with a residual (weight streaming), a softmax (stitch), a lone add (a stitch
    decline: too little work) and an attention (the attention claimer, which has no ``replan``)."""
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g
    m = (F.silu(h @ w1) * (h @ w3)) @ w2
    return m + x, torch.softmax(y * 2, dim=-1), z + 1, F.scaled_dot_product_attention(q, k, v)


def _inputs():
    return [torch.randn(4, 64), 1 + 0.1 * torch.randn(64), torch.randn(64, 96) / 8, torch.randn(64, 96) / 8,
            torch.randn(96, 64) / 10, torch.randn(8, 32), torch.randn(5, 7), torch.randn(1, 2, 16, 16), torch.randn(1, 2, 16, 16),
            torch.randn(1, 2, 16, 16)]


def _described(regions):
    """What the report and the build stage read of each region (not the plans' objects, made afresh)."""
    return [(r.ops, r.compiled_by, r.reason, r.detail, r.claimer, type(r.plan).__name__,
             {k: v for k, v in r.info.items() if k != "search_s"},
             [(d.reason, d.detail, d.claimer, [n.name for n in d.nodes]) for d in r.declines]) for r in regions]


def _partition(graph, cache_dir, config=None):
    config = config or load()
    ctx = CompileContext.standalone(config, cache=DiskCache(str(cache_dir)))
    return claim_regions(graph, default_claimers(config), ctx)


def _no_exploration(monkeypatch):
    """The claimers' exploring walks, made to fail: a replay must not reach them."""
    def explored(*a, **k):
        raise AssertionError("explored")
    monkeypatch.setattr(gemv_claim.GemvClaimer, "_claim_anchor", explored)
    monkeypatch.setattr(search_claimer.SearchClaimer, "_seeded", explored)
    monkeypatch.setattr(search_claimer.SearchClaimer, "_searched", explored)
    monkeypatch.setattr(stitch, "grow_groups", explored)


def test_a_partitioned_graph_replays_without_exploring(tmp_path, monkeypatch):
    monkeypatch.setenv("MIRAGE_MIN_REGION_US", "0")
    graph = trace_ir(decoder_piece, *_inputs())
    first = _partition(graph, tmp_path)
    kinds = {(r.compiled_by, r.claimer) for r in first}
    assert {("mirage", "ugraph-gemv"), ("mirage", "stitch"), ("mirage", "attention")} <= kinds, _described(first)
    assert any(d.reason.name == "TOO_LITTLE_WORK" for r in first for d in r.declines), _described(first)
    _no_exploration(monkeypatch)
    again = _partition(graph, tmp_path)
    assert _described(again) == _described(first)
    # another cache directory has no record: the claimers explore (and fail here)
    with pytest.raises(AssertionError, match="explored"):
        _partition(graph, tmp_path / "other")


def test_a_record_made_under_other_settings_is_not_used(tmp_path, monkeypatch):
    """The configuration's output fields are part of the record's key: with another ``min_region_us`` the graph is
    partitioned afresh (the small groups then declined as too small)."""
    monkeypatch.setenv("MIRAGE_MIN_REGION_US", "0")
    graph = trace_ir(decoder_piece, *_inputs())
    _partition(graph, tmp_path)
    config = load(options={"min_region_us": 50.0})
    explored = []
    real = stitch.grow_groups
    monkeypatch.setattr(stitch, "grow_groups", lambda *a, **k: explored.append(1) or real(*a, **k))
    regions = _partition(graph, tmp_path, config)
    assert explored
    assert any(d.reason.name == "BELOW_MIN_REGION" for r in regions for d in r.declines), _described(regions)


def test_a_record_that_does_not_replay_is_partitioned_afresh_and_recorded_again(tmp_path, monkeypatch, caplog):
    """A recorded claim the claimer does not make again (here its ``replan`` declines) drops the record: the graph
    is partitioned as without one (an INFO line names the claimer and why), and the new record replays."""
    import logging
    monkeypatch.setenv("MIRAGE_MIN_REGION_US", "0")
    graph = trace_ir(decoder_piece, *_inputs())
    first = _partition(graph, tmp_path)
    real = gemv_claim.GemvClaimer.replan
    logger = logging.getLogger("torch_mirage")
    logger.addHandler(caplog.handler)
    try:
        with monkeypatch.context() as m, caplog.at_level(logging.INFO, logger="torch_mirage"):
            m.setattr(gemv_claim.GemvClaimer, "replan",
                      lambda self, g, nodes, *a: gemv_claim.Decline(nodes, gemv_claim.Reason.NO_KERNEL, "test"))
            assert _described(_partition(graph, tmp_path)) == _described(first)
    finally:
        logger.removeHandler(caplog.handler)
    assert any("does not replay (ugraph-gemv: it did not claim" in r.getMessage() and "NO_KERNEL, test" in
               r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert gemv_claim.GemvClaimer.replan is real
    _no_exploration(monkeypatch)
    assert _described(_partition(graph, tmp_path)) == _described(first)


def test_no_record_without_a_disk_cache():
    graph = trace_ir(decoder_piece, *_inputs())
    record = PartitionRecord(graph, default_claimers(load()), CompileContext.standalone(load()))
    assert record.key is None and record.load() is None


def test_a_warm_compile_replays_and_runs_alike(tmp_path, monkeypatch):
    """Through ``torch.compile`` twice on one cache directory (a fresh Dynamo each time): the second compile
    explores nothing and its results equal eager's."""
    monkeypatch.setenv("MIRAGE_MIN_REGION_US", "0")
    xs = _inputs()
    reports = []
    for warm in (False, True):
        torch._dynamo.reset()
        report = torch_mirage.Report()
        compiled = torch.compile(decoder_piece, backend=torch_mirage.MirageBackend(
            options={"cache_dir": str(tmp_path)}, report=report))
        if warm:
            _no_exploration(monkeypatch)
        for got, want in zip(compiled(*xs), decoder_piece(*[x.double() for x in xs])):
            assert_close(got, want.float(), torch.float32)
        reports.append([(r.ops, r.compiled_by, r.claimer, r.detail) for r in report.regions])
    assert reports[0] == reports[1]


def test_a_replay_reads_the_device_model_once_per_claimer(tmp_path, monkeypatch):
    """The stitch claimer's plans are made for the device model it reads once (on CUDA each read queries NVML): a
    replay of several stitch claims reads it once, as the partition that recorded them did."""
    monkeypatch.setenv("MIRAGE_MIN_REGION_US", "0")

    def two_groups(a, b):
        return torch.softmax(a * 2, dim=-1), torch.sigmoid(b) * b.sum(-1, keepdim=True)

    graph = trace_ir(two_groups, torch.randn(8, 32), torch.randn(6, 20))
    reads = []
    real = stitch.device_model
    monkeypatch.setattr(stitch, "device_model", lambda: reads.append(1) or real())
    for replay in (False, True):
        reads.clear()
        regions = _partition(graph, tmp_path)
        assert [r.claimer for r in regions if r.compiled_by == "mirage"] == ["stitch", "stitch"], _described(regions)
        assert len(reads) == 1, (replay, len(reads))


def test_a_graph_calling_a_python_function_keys_its_record_the_same_in_every_process():
    """A symbolic decode graph calls ``torch.sym_sum`` (HF's DynamicCache lengths): the graph's text, from which
    the record's key is made, names it by module and name; with its repr's address (``<function sym_sum at
    0x7f…>``) no warm process found the record (H200 12-03: the llama's symbolic decode graph partitioned afresh,
    1.25 s, in every warm compile)."""
    from torch_mirage.capture.lower import trace

    def grow(x):
        return x.new_zeros(torch.sym_sum([1, x.shape[0]])).sum() + x.sin().sum()

    text = str(trace(grow, [torch.randn(4)], tracing_mode="symbolic"))
    assert "opaque<torch.sym_sum>" in text and " at 0x" not in text, text
