"""The benchmark suite: work counts against DESIGN.md, inputs, the correctness gate, the CLI's outputs."""
from __future__ import annotations

import json
import os

import pytest
import torch

from torch_mirage.bench import cli, harness, has_transformers, report
from torch_mirage.bench import workloads as W

# DESIGN.md's floors (µs at 3.0 TB/s and 771 TFLOP/s, fp16), b = 1 and 8
DESIGN_FLOORS = {
    "rmsnorm_linear": (11.2, 11.3), "gated_mlp": (22.4, 22.7), "gated_mlp_llama8b": (78.4, 78.4),
    "gqa": (0.7, 5.9), "qknorm_attention": (0.7, 5.9), "lora": (0.8, 1.1), "ntrans": (0.1, 0.7),
    "bias_residual_layernorm": (6.3, 50.4), "bert_softmax": (4.2, 33.6), "bias_gelu": (2.1, 16.8),
    "h2o_core": (22.3, 1425), "gemma2_softcap": (22.3, 1425), "llama_layer_decode": (152.5, 192.0),
}


@pytest.mark.parametrize("name", sorted(DESIGN_FLOORS))
def test_floor_matches_design(name):
    assert set(DESIGN_FLOORS) == set(W.WORKLOADS)
    for b, expected in zip((1, 8), DESIGN_FLOORS[name]):
        got = W.floor_us(W.cost(W.WORKLOADS[name], b, torch.float16), 3.0e12, 771e12)
        # the table rounds to 0.1 µs; the decode layer's own count differs by 1 % (cache-slot writes)
        assert abs(got - expected) <= max(0.051, 0.012 * expected), (name, b, got, expected)


def test_cost_counts_each_input_and_output_once():
    c = W.cost(W.WORKLOADS["bias_gelu"], 1, torch.float16)
    assert c.bytes == 2 * (512 * 3072 + 3072 + 512 * 3072)   # X and bias read once, Y written once
    assert c.flops == 0
    c = W.cost(W.WORKLOADS["lora"], 1, torch.float32)
    m, d, n, r = 16, 256, 4096, 16
    assert c.flops == 2 * (m * d * n + m * d * r + m * r * n)
    assert c.bytes == 4 * (m * d + d * n + d * r + r * n + m * n)


@pytest.mark.parametrize("name", sorted(W.WORKLOADS))
def test_inputs_are_not_zeros_and_masks_keep_a_key(name):
    w = W.WORKLOADS[name]
    a = w.make_inputs(2, torch.float32, "cpu", seed=3, quick=True)
    b = w.make_inputs(2, torch.float32, "cpu", seed=4, quick=True)
    for spec, x, y in zip(w.arg_specs(2, quick=True), a, b):
        assert tuple(x.shape) == spec.shape
        if spec.kind.endswith("mask"):
            assert torch.isinf(x).any() and torch.isfinite(x).any()
            assert torch.isfinite(x).any(dim=-1).all(), "a fully masked row makes softmax NaN"
        elif spec.kind == "randn":
            assert (x != 0).float().mean() > 0.99 and x.std() > 0
            assert not torch.equal(x, y), "fresh seeds must give fresh inputs"
    outs = harness.run_outputs(w.fn, a, w.mutates)
    assert all(torch.isfinite(o).all() and o.abs().sum() > 0 for o in outs)


# ---------------------------------------------------------------------------------------------
# The correctness gate: a wrong mode is reported failed and never timed


def _off_by_one_element(fn, info):
    def wrong(*args):
        out = fn(*args)
        out = out.clone()
        out.view(-1)[out.numel() // 2] += 1.0
        return out
    return wrong


def _nan_mode(fn, info):
    return lambda *args: fn(*args) * float("nan")


def _raising_mode(fn, info):
    def boom(*args):
        raise RuntimeError("this mode cannot compile")
    return boom


def _forgets_cache_update(fn, info):
    def stale(*args):
        args = list(args)
        args[5], args[6] = args[5].clone(), args[6].clone()   # writes to copies: the caller's cache stays stale
        return fn(*args)
    return stale


@pytest.fixture
def fake_timer(monkeypatch):
    calls = []

    def timer(call, sets, target_ms, repeats):
        calls.append(len(sets))
        return {"us": 10.0 + len(calls), "us_min": 9.0, "us_max": 12.0}

    monkeypatch.setattr(harness, "time_in_cuda_graph", timer)
    return calls


def test_wrong_modes_fail_and_are_not_timed(fake_timer):
    spec = harness.workload_spec(W.WORKLOADS["bias_gelu"], 1, torch.float32, torch.device("cpu"), quick=True)
    compilers = {"off_by_one": _off_by_one_element, "nan": _nan_mode, "raises": _raising_mode}
    timing = {"sets": 3, "target_ms": 1.0, "repeats": 1}
    res = harness.run_case(spec, ["eager", *compilers], torch.float32, torch.device("cpu"), timing, compilers)
    assert res["eager"].status == "ok" and res["eager"].us is not None
    assert fake_timer == [3], "only eager may be timed"
    for mode in compilers:
        assert res[mode].status == "failed" and res[mode].us is None and res[mode].error, mode
    assert "relative error" in res["off_by_one"].error
    assert "NaN" in res["nan"].error and harness.result_dict(res["nan"])["rel_err"] is None
    assert "cannot compile" in res["raises"].error


def test_in_place_cache_update_is_checked(fake_timer):
    spec = harness.workload_spec(W.WORKLOADS["llama_layer_decode"], 1, torch.float32, torch.device("cpu"), quick=True)
    res = harness.run_case(spec, ["eager", "stale"], torch.float32, torch.device("cpu"), None,
                           {"stale": _forgets_cache_update})
    assert res["eager"].status == "ok"
    assert res["stale"].status == "failed" and "output 1" in res["stale"].error   # the key cache


def test_case_record_ratios():
    modes = {"inductor": {"status": "ok", "us": 20.0}, "inductor-max-autotune": {"status": "ok", "us": 16.0},
             "mirage": {"status": "ok", "us": 8.0}, "eager": {"status": "failed", "us": None}}
    c = report.case_record("x", "", 1, "float16", 100, 0, 4.0, 3, modes)
    assert c["best_inductor_us"] == 16.0 and c["speedup_vs_best_inductor"] == 2.0 and c["fraction_of_floor"] == 0.5
    modes["mirage"] = {"status": "failed", "us": None}
    c = report.case_record("x", "", 1, "float16", 100, 0, 4.0, 3, modes)
    assert c["speedup_vs_best_inductor"] is None and c["fraction_of_floor"] is None


def test_rotation_exceeds_three_l2():
    l2 = 50 * 2 ** 20
    for set_bytes in (1000, 262144, 6 * 2 ** 20, 400 * 2 ** 20):
        n = harness.rotation_count(set_bytes, l2)
        assert n * set_bytes > 3 * l2 or n == 2048
        assert n == 1 or (n - 1) * set_bytes <= 3 * l2


# ---------------------------------------------------------------------------------------------
# The CLI on the CPU


@pytest.mark.slow
def test_quick_cli_writes_json_and_table(tmp_path, capsys):
    out = tmp_path / "bench"
    rc = cli.main(["--quick", "--workloads", "bert_softmax,bias_gelu", "--modes", "eager", "inductor",
                   "--llms", "none", "--out", str(out)])
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["schema"] == report.SCHEMA and doc["timing"] is False and "no timing claims" in doc["note"]
    assert doc["env"]["torch"] == torch.__version__ and "torch_mirage" in doc["env"]
    assert doc["ceilings"] is None
    assert [(c["workload"], c["batch"], c["dtype"]) for c in doc["cases"]] == \
        [("bert_softmax", 1, "float32"), ("bias_gelu", 1, "float32")]
    for c in doc["cases"]:
        assert set(c["modes"]) == {"eager", "inductor"}
        for m in c["modes"].values():
            assert m["status"] == "ok" and m["us"] is None and m["rel_err"] < 1e-4
        assert c["modes"]["inductor"]["compile_s"] > 0
        assert c["floor_us"] is None and c["speedup_vs_best_inductor"] is None and c["bytes"] > 0
    table = (out / "results.md").read_text()
    assert "| bert_softmax | 1 | float32 | — | ok | ok |" in table
    assert not (out / "results.png").exists()
    merged = report.merge([doc, doc])
    assert len(merged["cases"]) == 2


def test_quick_cli_reports_mirages_cold_and_warm_compile(tmp_path):
    out = tmp_path / "bench"
    rc = cli.main(["--quick", "--workloads", "bias_gelu", "--modes", "mirage", "--llms", "none", "--out", str(out)])
    assert rc == 0
    (case,) = json.loads((out / "results.json").read_text())["cases"]
    m = case["modes"]["mirage"]
    assert m["status"] == "ok" and m["graphs"] >= 1
    assert 0 < m["warm_compile_s"] and 0 < m["compile_s"]
    cell = f"{m['compile_s']:.1f} / {m['warm_compile_s'] / m['graphs']:.2f}"
    assert f"| {cell} |" in (out / "results.md").read_text()


@pytest.mark.parametrize("keep", [False, True], ids=["cold", "inductor-caches"])
def test_inductor_whole_graph_caches_are_off_unless_asked_for(tmp_path, keep):
    """By default the bench turns Inductor's FX graph cache off (no mode's compile a hit on another's);
    ``--inductor-caches`` keeps it as a user has it, for a warm-compile run; the document says which."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    out = tmp_path / "bench"
    argv = ["--quick", "--workloads", "bias_gelu", "--modes", "eager", "--llms", "none", "--out", str(out)]
    # both put back after the test: a later test in this process may rely on the caches users have
    with inductor_config.patch(fx_graph_cache=True), functorch_config.patch(enable_autograd_cache=True):
        assert cli.main(argv + ["--inductor-caches"] * keep) == 0
        assert inductor_config.fx_graph_cache is keep
    caches = json.loads((out / "results.json").read_text())["settings"]["compile_caches"]
    assert caches.startswith("FX graph, AOTAutograd and Triton kernel caches on" if keep else "FX graph and AOTAutograd caches off")


def test_merge_combines_modes_of_the_same_case():
    def case(modes):
        return report.case_record("w", "[4]", 1, "float16", 100, 0, 1.0, 2,
                                  {m: {"status": "ok", "us": us} for m, us in modes.items()})

    def doc(cases, llm=()):
        return {"cases": cases, "llm": list(llm), "timing": True, "env": {}, "ceilings": None, "settings": {}}

    first = doc([case({"inductor": 4.0, "mirage": 5.0})], [{"model": "m", "scenario": "s", "dtype": "bf16",
                                                             "modes": {"eager": {"ms": 2.0}}}])
    second = doc([case({"inductor-max-autotune": 3.0, "mirage": 2.0})], [{"model": "m", "scenario": "s",
                                                                          "dtype": "bf16",
                                                                          "modes": {"mirage": {"ms": 1.0}}}])
    merged = report.merge([first, second])
    (c,) = merged["cases"]
    assert set(c["modes"]) == {"inductor", "inductor-max-autotune", "mirage"} and c["modes"]["mirage"]["us"] == 2.0
    assert c["best_inductor_us"] == 3.0 and c["speedup_vs_best_inductor"] == 1.5 and c["fraction_of_floor"] == 0.5
    (r,) = merged["llm"]
    assert set(r["modes"]) == {"eager", "mirage"}
    third = dict(second, env={"run": 3})
    remerged = report.merge([merged, third])      # a merged file merged again keeps the parts it came from
    assert len(remerged["parts"]) == 3 and remerged["parts"][-1]["env"] == {"run": 3}


def test_the_table_counts_kernels_per_call_where_the_profiler_saw_them():
    """Issue 17 (kernels per decoder layer): each mode's kernel count in one column, in the modes' order; no column
    where none was counted (off CUDA)."""
    def doc(counts):
        modes = {m: {"status": "ok", "us": us, "kernels": counts.get(m)}
                 for m, us in (("inductor", 210.0), ("mirage", 196.0))}
        case = report.case_record("llama_layer_decode", "[b]", 1, "bfloat16", 100, 0, 150.0, 2, modes)
        return {"cases": [case], "llm": [], "timing": True, "env": {"device": "d", "torch": "t", "torch_mirage": "m"},
                "ceilings": None, "settings": {}}
    counted = report.markdown(doc({"inductor": 22, "mirage": 11}))
    assert "kernels / call (inductor / mirage) |" in counted and counted.rstrip().endswith("| 22 / 11 |")
    unseen = report.markdown(doc({"inductor": 22}))
    assert unseen.rstrip().endswith("| 22 / — |")
    assert "kernels / call" not in report.markdown(doc({}))


def test_cli_refuses_timing_without_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    assert cli.main(["--workloads", "gqa", "--out", str(tmp_path)]) == 2


# ---------------------------------------------------------------------------------------------
# On a GPU: the real timing path


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_timing_small(tmp_path):
    out = tmp_path / "bench"
    rc = cli.main(["--workloads", "bias_gelu", "--modes", "eager", "inductor", "--batch", "1", "--dtype", "float16",
                   "--llms", "none", "--out", str(out), "--target-ms", "2", "--repeats", "3"])
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    ceil = doc["ceilings"]
    assert 0.3e12 < ceil["copy_bytes_per_s"] < 20e12 and 10e12 < ceil["matmul_flops_per_s"] < 5e15
    (case,) = doc["cases"]
    assert case["sets"] * case["bytes"] > 3 * ceil["l2_bytes"]
    for m in case["modes"].values():
        assert m["status"] == "ok" and m["us"] > 0 and m["us_min"] <= m["us"] <= m["us_max"]
        assert m["us"] >= 0.5 * case["floor_us"], "faster than the floor: the timing is wrong"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_kernel_count_eager_and_in_a_cuda_graph():
    """Three elementwise ops launch three kernels, called eagerly or replayed in a CUDA graph (None only where
    the profiler cannot see inside the graph); a copy is not a kernel."""
    from torch_mirage.timing import count_device_kernels

    x, y = torch.randn(1 << 16, device="cuda"), torch.empty(1 << 16, device="cuda")
    fn = lambda x: ((x + 1).exp() * 2,)
    assert count_device_kernels(fn, x) == 3
    assert count_device_kernels(lambda: y.copy_(x)) in (0, 1)   # a D2D copy may run as a copy kernel
    fn(x)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(x)
    assert count_device_kernels(g.replay) in (3, None)
    from torch_mirage.timing import activity_table, device_activity
    table = activity_table(device_activity(fn, x))
    assert sum(r["calls"] for r in table) == 3 and all(r["us"] > 0 for r in table), table


def test_activity_table_groups_by_name():
    """The LLM bench's per-step kernel table: entries grouped by name, most device time first, cut at ``top``."""
    from torch_mirage.timing import activity_table

    found = [("gemv", 10.0), ("attn", 5.0), ("gemv", 12.5), ("Memcpy DtoD", 1.0), ("norm", 2.0)]
    table = activity_table(found, top=3)
    assert table == [{"name": "gemv", "calls": 2, "us": 22.5}, {"name": "attn", "calls": 1, "us": 5.0},
                     {"name": "norm", "calls": 1, "us": 2.0}]
    assert activity_table(None) is None


# ---------------------------------------------------------------------------------------------
# The LLM driver, on the CPU, against a small stand-in for the two transformers cache APIs it
# drives: 4.x (a StaticCache writes where the model's cache_position says) and 5.x (each layer
# writes at its own counter, cumulative_length, and advances it; the model takes no cache_position).
# Real transformers models run in the tests after these, on the CPU and on a GPU.


class _Config:
    def __init__(self, **kw):
        self.__dict__.update(kw)
        self._attn_implementation = None


class _Layer:
    keys = values = None

    def __init__(self, max_cache_len, counted):
        self.max_cache_len = max_cache_len
        if counted:
            self.cumulative_length = torch.tensor(0)

    def update(self, k, v, cache_position=None):
        if self.keys is None:
            shape = (k.shape[0], k.shape[1], self.max_cache_len, k.shape[3])
            self.keys, self.values = torch.zeros(shape, dtype=k.dtype), torch.zeros(shape, dtype=k.dtype)
        if cache_position is None:      # 5.x: the layer's own counter
            cache_position = torch.arange(k.shape[2]) + self.cumulative_length
            self.cumulative_length.add_(k.shape[2])
        self.keys.index_copy_(2, cache_position, k)
        self.values.index_copy_(2, cache_position, v)
        return self.keys, self.values


def _causal_lm_class(api):
    class CausalLM(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            d, kv = config.hidden_size, config.num_key_value_heads
            self.hd, self.kv = d // config.num_attention_heads, kv
            self.embed = torch.nn.Embedding(config.vocab_size, d)
            self.qkv = torch.nn.ModuleList(torch.nn.Linear(d, d + 2 * kv * self.hd)
                                           for _ in range(config.num_hidden_layers))
            self.head = torch.nn.Linear(d, config.vocab_size)

        def run(self, input_ids, past_key_values, cache_position, logits_to_keep):
            x = self.embed(input_ids)
            b, t, d = x.shape
            for i, proj in enumerate(self.qkv):
                layer = past_key_values.layers[i]
                pos = cache_position if cache_position is not None else torch.arange(t) + layer.cumulative_length
                q, k, v = proj(x).split([d, self.kv * self.hd, self.kv * self.hd], dim=-1)
                k, v = (z.view(b, t, self.kv, self.hd).transpose(1, 2) for z in (k, v))
                keys, values = layer.update(k, v, cache_position)
                mask = torch.where(torch.arange(keys.shape[2])[None, :] <= pos[:, None], 0.0, float("-inf"))
                q = q.view(b, t, self.kv, -1, self.hd).permute(0, 2, 1, 3, 4).reshape(b, self.kv, -1, self.hd)
                mask = mask.repeat_interleave(q.shape[2] // t, dim=0) if t > 1 else mask
                p = torch.softmax(q @ keys.transpose(-1, -2) * self.hd ** -0.5 + mask, dim=-1)
                x = x + (p @ values).view(b, self.kv, t, -1, self.hd).permute(0, 2, 1, 3, 4).reshape(b, t, d)
            logits = self.head(x[:, -logits_to_keep:] if logits_to_keep else x)
            return type("Out", (), {"logits": logits})()

    if api == "4.x":
        def forward(self, input_ids, position_ids, cache_position, past_key_values, use_cache, logits_to_keep=0):
            return self.run(input_ids, past_key_values, cache_position, logits_to_keep)
    else:
        def forward(self, input_ids, position_ids, past_key_values, use_cache, logits_to_keep=0):
            return self.run(input_ids, past_key_values, None, logits_to_keep)
    CausalLM.forward = forward
    return CausalLM


@pytest.fixture(params=["4.x", "5.x"])
def fake_transformers(monkeypatch, request):
    import sys
    import types

    class StaticCache:
        def __init__(self, config, max_cache_len):
            self.layers = [_Layer(max_cache_len, counted=request.param == "5.x")
                           for _ in range(config.num_hidden_layers)]

    mod = types.ModuleType("transformers")
    mod.LlamaConfig, mod.LlamaForCausalLM, mod.StaticCache = _Config, _causal_lm_class(request.param), StaticCache
    mod.__version__ = request.param
    monkeypatch.setitem(sys.modules, "transformers", mod)
    return mod


def test_llm_driver_checks_every_mode(fake_transformers, monkeypatch):
    from torch_mirage.bench import llm

    assert has_transformers()
    broken = {"eager": harness.COMPILERS["eager"],
              "noisy": lambda fn, info: (lambda *a: fn(*a) + 0.05 * torch.randn(1)),
              "twice": lambda fn, info: (lambda *a: (fn(*a), fn(*a))[1])}
    monkeypatch.setattr(llm, "COMPILERS", broken)
    records = llm.run_model(llm.MODELS["llama3-8b-4l"], [1], torch.float32, ["eager", "noisy", "twice"],
                            torch.device("cpu"), quick=True, timing=None, echo=lambda s: None)
    assert [r["scenario"] for r in records] == ["decode b1 ctx64", "prefill 32"]
    for r in records:
        assert r["modes"]["eager"]["status"] == "ok" and r["modes"]["eager"]["rel_err"] == 0.0, r
        assert r["modes"]["noisy"]["status"] == "failed" and "wrong logits" in r["modes"]["noisy"]["error"]
        twice = r["modes"]["twice"]
        if fake_transformers.__version__ == "5.x":   # the second call writes the next slots: caught on the host
            assert twice["status"] == "failed" and "ended at position" in twice["error"], twice
        else:                                        # 4.x: the same slots again, so the same logits
            assert twice["status"] == "ok" and twice["rel_err"] == 0.0, twice
    doc = report.new_document({"device": "cpu", "torch": "x", "torch_mirage": "y"}, None, {}, False)
    doc["llm"] = records
    assert "| llama3-8b-4l | sdpa | decode b1 ctx64 | float32 | noisy |" in report.markdown(doc)


def test_llm_modes_timed_in_alternating_rounds(fake_transformers, monkeypatch):
    """Every checked mode is timed in rounds of alternating order (A B C, C B A) and gets the median over all
    its rounds' samples; a mode that failed its check is not timed. The timer is faked (no GPU here)."""
    from torch_mirage.bench import llm

    modes = {"eager": harness.COMPILERS["eager"], "also": harness.COMPILERS["eager"],
             "noisy": lambda fn, info: (lambda *a: fn(*a) + 0.05 * torch.randn(1))}
    monkeypatch.setattr(llm, "COMPILERS", modes)
    order, per_call = [], {}

    def fake_timer(step, sets, target_ms, repeats):
        mode = next(m for m, fn in steps_by_fn.items() if fn is step)
        order.append(mode)
        us = {"eager": [100.0, 300.0], "also": [10.0, 20.0]}[mode][len(per_call.setdefault(mode, []))]
        per_call[mode].append(us)
        return {"us": us, "samples": [us] * repeats}

    steps_by_fn = {}
    real_check = llm._check_mode

    def check(case, mode, dtype, peak):
        res, step = real_check(case, mode, dtype, peak)
        if step is not None:
            steps_by_fn[mode] = step
        return res, step

    monkeypatch.setattr(llm, "_check_mode", check)
    monkeypatch.setattr(llm, "time_in_cuda_graph", fake_timer)
    spec = llm.MODELS["llama3-8b-4l"]
    model, config = llm.build_model(spec, torch.float32, torch.device("cpu"), quick=True)
    s = llm.scenarios([1], quick=True)[0]
    r = llm.run_scenario(spec, model, config, s, True, torch.float32, list(modes), torch.device("cpu"),
                         {"target_ms": 1.0, "repeats": 3}, echo=lambda line: None)
    assert llm.TIMING_ROUNDS == 2 and order == ["eager", "also", "also", "eager"]
    assert r["modes"]["eager"]["ms"] == pytest.approx(0.2) and r["modes"]["also"]["ms"] == pytest.approx(0.015)
    assert r["modes"]["noisy"]["status"] == "failed" and r["modes"]["noisy"]["ms"] is None


def test_llm_positions_checked_on_the_host(fake_transformers):
    """A scenario that does not fit the static cache is refused before anything runs (on a GPU, an
    out-of-bounds cache write is a device-side assert that poisons the CUDA context for every later case)."""
    from torch_mirage.bench import llm

    cache = fake_transformers.StaticCache(_Config(num_hidden_layers=2), max_cache_len=64)
    llm.KVState(cache, 32, 32, fake_transformers.__version__ == "4.x", "fits")
    for start, tokens in ((33, 32), (64, 1), (-1, 1)):
        with pytest.raises(ValueError, match="do not fit"):
            llm.KVState(cache, start, tokens, True, "too long")


# ---------------------------------------------------------------------------------------------
# Real transformers models (tiny configs, fp32) on the CPU: eager twice gives the same logits, and
# compiled modes match it. Each family gets one compiled mode on one scenario here (compiling on 2
# CPU cores takes 5–30 s a case); MIRAGE_LLM_FULL=1 runs every family × scenario × mode.

# family: (scenario, compiled mode, whether mirage must claim regions without falling back)
_CPU_LLM_CASES = {"llama3-8b-4l": ("prefill 32", "inductor", None),
                  "qwen2-7b-4l": ("decode b2 ctx64", "mirage", True),
                  # Gemma2's ATen graph holds a tensor constant (get_attr): lowered as a constant input
                  "gemma2-9b-4l": ("decode b1 ctx64", "mirage", True)}


def _real_llm(name):
    pytest.importorskip("transformers")
    from torch_mirage.bench import llm

    spec = llm.MODELS[name]
    model, config = llm.build_model(spec, torch.float32, torch.device("cpu"), quick=True)
    return llm, spec, model, config


def _check_llm_record(r, modes):
    assert set(r["modes"]) == set(modes)
    for mode, m in r["modes"].items():
        assert m["status"] == "ok", (r["model"], r["scenario"], mode, m["error"])
        limit = 1e-6 if mode == "eager" else 1e-4     # eager against eager: the same call from the same state
        assert m["rel_err"] is not None and m["rel_err"] <= limit, (r["model"], r["scenario"], mode, m["rel_err"])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(_CPU_LLM_CASES))
def test_cpu_llm_real_transformers(name):
    import torch._inductor.config as inductor_config

    llm, spec, model, config = _real_llm(name)
    assert model.config._attn_implementation == spec.attn     # Gemma2: eager, so that soft-capping runs
    assert all(getattr(model.config, k) == v for k, v in spec.config.items() if "softcapping" in k)
    compiled_scenario, compiled_mode, claims = _CPU_LLM_CASES[name]
    for s in llm.scenarios([1, 2], quick=True):
        modes = ["eager", compiled_mode] if s.name == compiled_scenario else ["eager"]
        with inductor_config.patch(compile_threads=1):     # no worker pool to start on a 2-core CPU
            r = llm.run_scenario(spec, model, config, s, True, torch.float32, modes, torch.device("cpu"), None,
                                 echo=lambda line: None)
        _check_llm_record(r, modes)
        if compiled_mode == "mirage" and s.name == compiled_scenario:
            summary = r["modes"]["mirage"]["mirage"]
            assert summary["graphs"] >= 1, "the mirage backend never ran"
            if claims:
                assert summary["mirage_regions"] > 0 and not summary["fallback_errors"], summary


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MIRAGE_LLM_FULL"),
                    reason="every family × scenario × mode: 3–10 min on 2 cores; set MIRAGE_LLM_FULL=1")
@pytest.mark.parametrize("name", ["llama3-8b-4l", "qwen2-7b-4l", "gemma2-9b-4l"])
def test_cpu_llm_real_transformers_all_modes(name):
    llm, spec, model, config = _real_llm(name)
    for s in llm.scenarios([1, 2], quick=True):
        modes = ["eager", "inductor", "mirage"]
        _check_llm_record(llm.run_scenario(spec, model, config, s, True, torch.float32, modes, torch.device("cpu"),
                                           None, echo=print), modes)


def test_cpu_llm_cache_corruption_is_caught(monkeypatch):
    """A mode whose logits are right but whose cache update is wrong fails (the next token would be wrong)."""
    llm, spec, model, config = _real_llm("llama3-8b-4l")
    caches = []
    real_static_cache = llm.static_cache
    monkeypatch.setattr(llm, "static_cache", lambda *a: caches.append(real_static_cache(*a)) or caches[-1])

    def corrupts_cache(fn, info):
        def run(*args):
            out = fn(*args)
            llm.cache_tensors(caches[-1])[-1][:, :, s.start] *= 1.5     # the last layer's values at the new slot
            return out
        return run

    monkeypatch.setitem(llm.COMPILERS, "corrupts", corrupts_cache)
    s = llm.scenarios([1], quick=True)[0]
    r = llm.run_scenario(spec, model, config, s, True, torch.float32, ["eager", "corrupts"], torch.device("cpu"),
                         None, echo=lambda line: None)
    assert r["modes"]["eager"]["status"] == "ok" and r["modes"]["eager"]["rel_err"] == 0.0
    assert r["modes"]["corrupts"]["status"] == "failed" and "wrong cache slots" in r["modes"]["corrupts"]["error"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model", ["llama3-8b-4l", "qwen2-7b-4l", "gemma2-9b-4l"])
def test_gpu_llm_tiny_real_transformers(model):
    """The transformers APIs llm.py relies on (configs, StaticCache, logits_to_keep), at tiny sizes, timed."""
    pytest.importorskip("transformers")
    from torch_mirage.bench import llm

    records = llm.run_model(llm.MODELS[model], [2], torch.bfloat16, ["eager", "inductor"], torch.device("cuda"),
                            quick=True, timing={"target_ms": 1.0, "repeats": 2}, echo=print)
    assert [r["batch"] for r in records] == [2, 1]
    for r in records:
        for mode, m in r["modes"].items():
            assert m["status"] == "ok", (r["scenario"], mode, m["error"])
            assert m["ms"] > 0 and m["tokens_per_s"] > 0 and m["peak_gib"] > 0
        assert r["modes"]["eager"]["rel_err"] <= 1e-3, "eager against eager: the same call from the same state"
        assert r["modes"]["inductor"]["timing_method"] == "cuda graph"


def test_mirage_summary_says_where_compile_time_went():
    import torch_mirage

    rep = torch_mirage.Report()
    fn = lambda x: torch.softmax(x * 2, -1) + 1
    torch.compile(fn, backend=torch_mirage.MirageBackend(options={"min_region_us": 0}, report=rep))(
        torch.randn(8, 40))
    summary = harness.mirage_summary({"report": rep})
    assert summary["graphs"] == 1 and summary["regions"] >= 1
    assert summary["stage_ms"] and all(v >= 0 for v in summary["stage_ms"].values())
    assert summary["untimed"] == [] and summary["choices"] == [] and summary["region_times"] == []   # CPU: nothing timed
    built = [r for r in rep.regions if r.compiled_by == "mirage"]
    assert built and summary["build_s"] == [{"claimer": r.claimer, "ops": len(r.ops), "s": r.info["build_s"],
                                             "peak_rise_mib": 0} for r in built]   # CPU: no GPU memory peak
    assert all(b["s"] >= 0 for b in summary["build_s"])


def test_llm_attention_implementations():
    """``--llm-attn``: each model once per implementation (``default`` its own; no model twice); Llama with HF's
    eager attention decodes through mirage equal to eager, and the report keeps the two implementations apart."""
    from torch_mirage.bench import llm, report

    got = [(s.name, s.attn) for s in llm.get(["llama3-8b-4l", "gemma2-9b-4l"], ["default", "eager"])]
    assert got == [("llama3-8b-4l", "sdpa"), ("llama3-8b-4l", "eager"), ("gemma2-9b-4l", "eager")]
    pytest.importorskip("transformers")
    import torch._inductor.config as inductor_config

    spec = llm.get(["llama3-8b-4l"], ["eager"])[0]
    model, config = llm.build_model(spec, torch.float32, torch.device("cpu"), quick=True)
    assert model.config._attn_implementation == "eager"
    decode = llm.scenarios([1], quick=True)[0]
    with inductor_config.patch(compile_threads=1):
        r = llm.run_scenario(spec, model, config, decode, True, torch.float32, ["eager", "mirage"],
                             torch.device("cpu"), None, echo=lambda line: None)
    _check_llm_record(r, ["eager", "mirage"])
    other = dict(r, attn_implementation="sdpa")
    env = {"device": "CPU", "torch": torch.__version__, "torch_mirage": "test"}
    doc = report.merge([dict(report.new_document(env, None, {}, False), llm=[x]) for x in (r, other)])
    assert sorted(x["attn_implementation"] for x in doc["llm"]) == ["eager", "sdpa"]
    assert "| llama3-8b-4l | eager |" in report.markdown(doc)


def test_llm_scenario_kinds():
    """``--llm-scenarios`` picks decode (near the cache's end), prefill and early (a decode step early in the same
    cache); the default is decode and prefill; the CLI refuses an unknown kind."""
    from torch_mirage.bench import cli, llm

    names = lambda kinds: [s.name for s in llm.scenarios([1, 8], quick=False, kinds=kinds)]   # noqa: E731
    assert names(llm.DEFAULT_SCENARIOS) == ["decode b1 ctx4096", "decode b8 ctx4096", "prefill 2048"]
    assert names(["early"]) == ["decode b1 pos256 ctx4096", "decode b8 pos256 ctx4096"]
    early = llm.scenarios([1], quick=False, kinds=["early"])[0]
    assert (early.start, early.tokens) == (llm.EARLY_POSITION, 1)
    assert cli.parser().parse_args(["--llm-scenarios", "early", "prefill"]).llm_scenarios == ["early", "prefill"]
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["--llm-scenarios", "later"])
