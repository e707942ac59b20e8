"""The μGraph library as the search's seeds: user programs that compute a hand-built μGraph run it, however they
are written (Triton interpreter on CPU)."""
import os

import pytest
import torch
import torch.nn.functional as F

import torch_mirage
from helpers import assert_close
from torch_mirage.numerics import rms_norm
from torch_mirage.superopt import library
from torch_mirage.superopt.search.claimer import SearchClaimer
from torch_mirage.superopt.search.seeds import BATCHED_INPUT, SEED_WORKLOADS, dims_from_shapes, folded

# tests/conftest.py turns the interpreter on when there is no GPU; setting it here would leak into GPU tests
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU kernels run only in Triton's interpreter (TRITON_INTERPRET=1)")


def lora(x, w, a, b):
    return x @ w + (x @ a) @ b


def gated_mlp(x, w1, w3):
    return F.silu(x @ w1) * (x @ w3)


def _compile(fn, claimers=None, **options):
    report = torch_mirage.Report()
    return torch.compile(fn, backend=torch_mirage.MirageBackend(options=options, report=report,
                                                                claimers=claimers)), report


def _library_only():
    """The library's seeds alone (no enumeration): in the default order the weight-streaming claimer takes
    memory-bound gated MLPs and RMSNorm + Linear first, with their norm and epilogue (tests/test_gemv_claim.py)."""
    return [SearchClaimer(seeds=SEED_WORKLOADS, enumerates=False)]


def _inputs(shapes, dtype):
    return [torch.randn(s, dtype=dtype) * s[-2] ** -0.5 for s in shapes]


def _library_regions(report):
    return [r for r in report.regions if r.claimer == "ugraph-search" and "seed" in r.info.get("source", "")]


def attention(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v


def attention_fp32_softmax(q, k, v):
    s = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    return torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v


ATTENTION_SHAPES = [(2, 2, 16, 16), (2, 2, 64, 16), (2, 2, 64, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name,fn,shapes", [
    ("lora", lora, [(24, 40), (40, 56), (40, 8), (8, 56)]),
    ("gated_mlp", gated_mlp, [(24, 40), (40, 56), (40, 56)]),
    ("lora", lora, [(7, 33), (33, 17), (33, 3), (3, 17)]),          # odd sizes: tiles of any divisor
    ("lora", lora, [(3, 8, 40), (40, 56), (40, 8), (8, 56)]),       # (batch, seq, k) activations
    ("gated_mlp", gated_mlp, [(2, 12, 40), (40, 56), (40, 56)]),
])
def test_library_program_runs_its_ugraph(name, fn, shapes, dtype):
    compiled, report = _compile(fn, _library_only())
    xs = _inputs(shapes, dtype)
    out = compiled(*xs)
    assert_close(out, fn(*[x.double() for x in xs]).to(dtype), dtype)
    (region,) = _library_regions(report)
    assert region.compiled_by == "mirage" and region.info["ugraph"] == name, str(report)
    assert region.info["dims"] == list(dims_from_shapes(library.WORKLOADS[name], folded(name, shapes)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fn", [attention, attention_fp32_softmax])
def test_attention_forms_go_to_the_attention_claimer(fn, dtype):
    """Plain attention is claimed by analysis (superopt/attention_claim.py) ahead of the library."""
    compiled, report = _compile(fn)
    xs = _inputs(ATTENTION_SHAPES, dtype)
    assert_close(compiled(*xs), fn(*[x.double() for x in xs]).to(dtype), dtype)
    assert not _library_regions(report), str(report)
    (region,) = [r for r in report.regions if r.claimer == "attention"]
    assert region.compiled_by == "mirage" and region.info["ugraph"] == "flash_attention", str(report)


ATTENTION_LONG_KV = [(2, 2, 80, 16), (2, 2, 512, 16), (2, 2, 512, 16)]   # two row blocks: not decode


@pytest.mark.parametrize("fa_us,fd_us,chosen", [(2.0, 1.0, "flash_decoding"), (1.0, 2.0, "flash_attention")])
def test_attention_runs_the_faster_of_its_ugraphs(monkeypatch, fa_us, fd_us, chosen):
    """Attention over a KV long enough to split has two seeds (FlashAttention and split-KV FlashDecoding): both
    are compiled, the one that times faster runs (timing is faked here: the interpreter has no CUDA graphs), and
    either matches eager."""
    from torch_mirage import build

    first_seen: dict[int, float] = {}   # A B B A: the first μGraph timed is FlashAttention's

    def fake_samples(compiled, sets):
        if id(compiled) not in first_seen:
            first_seen[id(compiled)] = (fa_us, fd_us)[len(first_seen)]
        return [first_seen[id(compiled)]]

    monkeypatch.setattr(build, "_timing_sets", lambda examples: [examples])
    monkeypatch.setattr(build, "_time_ugraph", fake_samples)
    compiled, report = _compile(attention)
    xs = _inputs(ATTENTION_LONG_KV, torch.float32)
    assert_close(compiled(*xs), attention(*[x.double() for x in xs]).float())
    (region,) = [r for r in report.regions if r.claimer == "attention"]
    assert region.info["ugraph"] == chosen and chosen in region.detail, str(report)
    assert region.info["ugraph_us"] == {"flash_attention": fa_us, "flash_decoding": fd_us}


def test_programs_that_differ_are_not_claimed():
    """Other wiring, another constant, an inner value read elsewhere, bf16 under the interpreter (which computes
    bf16 wrongly): no seed verifies, eager's result."""
    def scaled(x, w, a, b):
        return x @ w + (x @ a) @ b * 2

    def other_constant(x, w1, w3):        # silu's decomposition with 2 where it has 1
        h = x @ w1
        return h / (torch.exp(-h) + 2) * (x @ w3)

    def inner_read(x, w, a, b):
        y = x @ a
        return x @ w + y @ b, y

    cases = [(scaled, [(24, 40), (40, 56), (40, 8), (8, 56)]),
             (other_constant, [(24, 40), (40, 56), (40, 56)]),
             (inner_read, [(24, 40), (40, 56), (40, 8), (8, 56)])]
    for fn, shapes in cases:
        compiled, report = _compile(fn, _library_only())
        xs = _inputs(shapes, torch.float32)
        assert_close(compiled(*xs), fn(*[x.double() for x in xs]))
        assert not _library_regions(report), f"{fn.__name__}: {report}"
    compiled, report = _compile(lora, _library_only())
    xs = _inputs([(24, 40), (40, 56), (40, 8), (8, 56)], torch.bfloat16)
    assert_close(compiled(*xs), lora(*[x.double() for x in xs]).bfloat16(), torch.bfloat16)
    assert not _library_regions(report)


def test_library_seeds_can_be_switched_off():
    compiled, report = _compile(lora, ugraph_library=False, search=False)
    xs = _inputs([(24, 40), (40, 56), (40, 8), (8, 56)], torch.float32)
    assert_close(compiled(*xs), lora(*xs))
    assert not _library_regions(report)


def test_dims_from_shapes_inverts_input_shapes():
    w = library.WORKLOADS["lora"]
    assert dims_from_shapes(w, w.input_shapes(24, 40, 56, 8)) == (24, 40, 56, 8)
    assert dims_from_shapes(w, [(24, 40), (41, 56), (40, 8), (8, 56)]) is None   # k disagrees
    g = library.WORKLOADS["gated_mlp"]
    assert dims_from_shapes(g, [(5, 6), (6, 7), (6, 7)]) == (5, 6, 7)


def test_lora_layer_with_parameters():
    class LoRALinear(torch.nn.Module):
        def __init__(self, k, n, r):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(k, n) * k ** -0.5)
            self.a = torch.nn.Parameter(torch.randn(k, r) * k ** -0.5)
            self.b = torch.nn.Parameter(torch.randn(r, n) * r ** -0.5)

        def forward(self, x):
            return x @ self.w + (x @ self.a) @ self.b

    layer = LoRALinear(40, 56, 8).eval()
    compiled, report = _compile(layer)
    x = torch.randn(24, 40)
    with torch.no_grad():
        out = compiled(x)
        ref = lora(x.double(), layer.w.double(), layer.a.double(), layer.b.double())
    assert_close(out, ref.float())
    assert [r.info["ugraph"] for r in _library_regions(report)] == ["lora"], str(report)


def test_llama_style_mlp_of_linear_layers():
    """nn.Linear weights arrive transposed (a permute the claimer binds as the μGraph's input): the gate / up
    half of a Llama MLP on (batch, seq, dim) activations runs the gated-MLP μGraph."""
    class MLP(torch.nn.Module):
        def __init__(self, dim, hidden):
            super().__init__()
            self.gate = torch.nn.Linear(dim, hidden, bias=False)
            self.up = torch.nn.Linear(dim, hidden, bias=False)
            self.down = torch.nn.Linear(hidden, dim, bias=False)

        def forward(self, x):
            return self.down(F.silu(self.gate(x)) * self.up(x))

    report = _library_run_equals_double(MLP(40, 56).eval(), torch.randn(2, 12, 40))
    assert [r.info["ugraph"] for r in _library_regions(report)] == ["gated_mlp"], str(report)


def test_gated_mlp_inside_a_larger_region_runs_its_ugraph():
    """The gate / up half of a Llama MLP after an RMSNorm whose output only it reads (so the region of the mul's
    producers also holds the norm, and no seed is that whole region): the seed binds the smaller cut ending at the
    mul (the library's seeds alone: in the default order the weight-streaming claimer takes this memory-bound
    MLP whole, with its norm)."""
    class NormMLP(torch.nn.Module):
        def __init__(self, dim, hidden):
            super().__init__()
            self.g = torch.nn.Parameter(1 + 0.1 * torch.randn(dim))
            self.gate = torch.nn.Linear(dim, hidden, bias=False)
            self.up = torch.nn.Linear(dim, hidden, bias=False)

        def forward(self, h):
            x = rms_norm(h, 1e-6, self.g)
            return F.silu(self.gate(x)) * self.up(x)

    report = _library_run_equals_double(NormMLP(40, 56).eval(), torch.randn(2, 12, 40))
    regions = [r for r in _library_regions(report) if r.info["ugraph"] == "gated_mlp"]
    assert len(regions) == 1 and regions[0].info["dims"] == [24, 40, 56], str(report)
    assert not any(n.startswith("pow") or n.startswith("rsqrt") for n in regions[0].ops), str(report)


def _library_run_equals_double(module, x):
    """``module(x)`` compiled with the library's seeds alone equals its float64 copy; the compile's report."""
    compiled, report = _compile(module, _library_only())
    with torch.no_grad():
        out = compiled(x)
        ref = copy_double(module)(x.double())
    assert_close(out, ref.float())
    return report


def copy_double(module):
    import copy
    return copy.deepcopy(module).double()


def test_forms_the_library_was_not_written_for_run_its_ugraph():
    """No written form is matched: LoRA with its terms swapped and its arguments in another order, RMSNorm written
    with a division by a square root, each verified equal to a seed, run the library's own μGraph (same hash)."""
    def lora_swapped(a, b, x, w):
        return (x @ a) @ b + x @ w

    def rmsnorm_by_division(w, x, g):
        return (x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * g) @ w

    cases = [(lora_swapped, [(40, 8), (8, 56), (24, 40), (40, 56)], "lora", library.lora(24, 40, 56, 8, dtype="float32")),
             (rmsnorm_by_division, [(48, 40), (12, 48), (48,)], "rmsnorm_linear",
              library.rmsnorm_linear(12, 48, 40, dtype="float32", eps=1e-5))]
    for fn, shapes, name, kgraph in cases:
        compiled, report = _compile(fn, _library_only())
        xs = [torch.randn(s) * (s[-2] ** -0.5 if len(s) > 1 else 1.0) for s in shapes]
        assert_close(compiled(*xs), fn(*[x.double() for x in xs]).float())
        (region,) = _library_regions(report)
        assert region.info["ugraph"] == name and region.info["ugraph_hash"] == kgraph.hash()[:16], str(report)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ntrans_with_its_eps_read_from_the_graph(dtype):
    def ntrans(h, x, alpha):
        return rms_norm(alpha * (rms_norm(h, 1e-6) + x) + x, 1e-6)

    def two_eps(h, x, alpha):          # not nTrans: the norms disagree on eps
        return rms_norm(alpha * (rms_norm(h, 1e-6) + x) + x, 1e-5)

    shapes = [(12, 48)] * 3
    compiled, report = _compile(ntrans)
    xs = [torch.randn(s, dtype=dtype) for s in shapes]
    assert_close(compiled(*xs), ntrans(*[x.double() for x in xs]).to(dtype), dtype)
    (region,) = _library_regions(report)
    assert region.info["ugraph"] == "ntrans" and "eps=1e-06" in region.detail, str(report)
    compiled, report = _compile(two_eps)
    assert_close(compiled(*xs), two_eps(*[x.double() for x in xs]).to(dtype), dtype)
    assert not _library_regions(report), str(report)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("x_shape", [(12, 48), (2, 6, 48)])
def test_rmsnorm_linear_with_its_eps_read_from_the_graph(dtype, x_shape):
    """``rms_norm(x)·g @ w`` (the norm in fp32 and cast back, as half-precision models write it) runs the
    RMSNorm+Linear μGraph with the graph's eps; (batch, seq, k) activations fold into rows."""
    def rmsnorm_linear(x, g, w):
        return rms_norm(x, 1e-5, g) @ w

    compiled, report = _compile(rmsnorm_linear, _library_only())
    xs = [torch.randn(x_shape, dtype=dtype), 1 + 0.1 * torch.randn(48, dtype=dtype),
          torch.randn(48, 40, dtype=dtype) * 48 ** -0.5]
    assert_close(compiled(*xs), rmsnorm_linear(*[x.double() for x in xs]).to(dtype), dtype)
    (region,) = _library_regions(report)
    assert region.info["ugraph"] == "rmsnorm_linear" and "eps=1e-05" in region.detail, str(report)
    assert region.info["dims"] == [12, 48, 40]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_qknorm_attention_runs_the_fused_ugraph(dtype):
    """Attention over RMS-normed Q and K (each norm in fp32, cast back, then its gain) is claimed whole by the
    QK-norm attention μGraph — not as attention with the norms left to other kernels — with the graph's eps."""
    def qknorm_attention(q, k, v, gq, gk):
        return attention_fp32_softmax(rms_norm(q, 1e-6, gq), rms_norm(k, 1e-6, gk), v)

    shapes = [(2, 2, 16, 16), (2, 2, 32, 16), (2, 2, 32, 16), (16,), (16,)]
    xs = [torch.randn(s, dtype=dtype) for s in shapes[:3]] + [1 + 0.1 * torch.randn(s, dtype=dtype)
                                                              for s in shapes[3:]]
    compiled, report = _compile(qknorm_attention)
    assert_close(compiled(*xs), qknorm_attention(*[x.double() for x in xs]).to(dtype), dtype)
    (region,) = _library_regions(report)
    assert region.info["ugraph"] == "qknorm_attention" and "eps=1e-06" in region.detail, str(report)
    assert region.info["dims"] == [2, 2, 16, 32, 16]


@pytest.mark.parametrize("fn,shapes", [(gated_mlp, [(8, 16), (16, 24), (16, 24)]),            # weight streaming
                                       (attention, [(1, 2, 16, 16), (1, 2, 16, 16), (1, 2, 16, 16)])])  # attention
def test_kernel_sources_go_to_the_compiles_cache_dir_with_the_cache_off(tmp_path, monkeypatch, fn, shapes):
    """options={"cache": False, "cache_dir": ...}: the μGraph kernels' sources are written under that cache_dir's
    kernels/, not under the directory the environment names."""
    monkeypatch.setenv("MIRAGE_CACHE_DIR", str(tmp_path / "from_env"))
    report = torch_mirage.Report()
    opts = {"cache": False, "cache_dir": str(tmp_path / "from_options")}
    compiled = torch.compile(fn, backend=torch_mirage.MirageBackend(options=opts, report=report))
    xs = _inputs(shapes, torch.float32)
    assert_close(compiled(*xs), fn(*xs))
    assert any(r.compiled_by == "mirage" and r.claimer in ("ugraph-gemv", "attention") for r in report.regions), \
        str(report)
    assert [f for f in os.listdir(tmp_path / "from_options" / "kernels") if f.startswith("ugraph_")]
    assert not (tmp_path / "from_env").exists()


def relu_gated(x, w1, w3):
    return torch.relu(x @ w1) * (x @ w3)


def test_a_seeds_pass_that_claimed_nothing_is_skipped_warm(tmp_path, monkeypatch):
    """A seeds-only pass that claimed nothing in a graph says so in the disk cache: compiling the graph again on that
    cache lowers no cut of it (the pass is skipped) and runs it alike; where a seed fits, nothing is recorded and the
    second compile claims it again; another cache directory starts afresh."""
    from torch_mirage.superopt.search import claimer as claimer_module

    lowered = []
    real = claimer_module.lowered_reference
    monkeypatch.setattr(claimer_module, "lowered_reference", lambda *a, **k: lowered.append(1) or real(*a, **k))
    xs = _inputs([(24, 40), (40, 56), (40, 56)], torch.float32)
    claimers = lambda: [SearchClaimer(seeds=("gated_mlp",), enumerates=False)]    # noqa: E731
    for fn, fits in ((relu_gated, False), (gated_mlp, True)):
        for cache_dir, expect_walk in ((tmp_path / "a", True), (tmp_path / "a", fits), (tmp_path / "b", True)):
            torch._dynamo.reset()
            lowered.clear()
            compiled, report = _compile(fn, claimers(), cache_dir=str(cache_dir))
            assert_close(compiled(*xs), fn(*[x.double() for x in xs]).float(), torch.float32)
            assert bool(lowered) == expect_walk, (fn.__name__, cache_dir, len(lowered))
            assert len(_library_regions(report)) == fits, str(report)


def _bindings_by_every_permutation(workload, in_shapes, transposable=frozenset()):
    """The definition :func:`bindings` keeps: every flip choice and every permutation tried in turn."""
    import itertools
    flips = [k for k in sorted(transposable) if len(in_shapes[k]) == 2]
    out = []
    for chosen in sorted((c for r in range(len(flips) + 1) for c in itertools.combinations(flips, r)), key=len):
        shapes = [tuple(reversed(s)) if k in chosen else tuple(s) for k, s in enumerate(in_shapes)]
        for order in itertools.permutations(range(len(in_shapes))):
            dims = dims_from_shapes(workload, folded(workload.name, [shapes[i] for i in order]))
            if dims is not None:
                out.append((order, tuple(i in chosen for i in order), dims))
    return out


def test_bindings_are_those_of_every_permutation_in_the_same_order():
    """The rank filter of :func:`bindings` skips only permutations that cannot bind: for every library workload,
    its shapes shuffled (some dims equal, a batched input given leading dims, 2-D inputs transposable), the
    bindings and their order equal those of trying every permutation."""
    import random
    from torch_mirage.superopt.search.seeds import bindings
    rng = random.Random(0)
    for name, w in library.WORKLOADS.items():
        ndims = w.build.__code__.co_argcount
        for trial in range(4):
            dims = [rng.choice([4, 8, 8, 16, 24]) for _ in range(ndims)]
            try:
                shapes = [tuple(s) for s in w.input_shapes(*dims)]
            except Exception:   # noqa: BLE001 - dims a workload does not take
                continue
            i = BATCHED_INPUT.get(name)
            if i is not None and trial % 2 and len(shapes[i]) == 2 and shapes[i][0] % 2 == 0:
                shapes[i] = (2, shapes[i][0] // 2, shapes[i][1])
            order = list(range(len(shapes)))
            rng.shuffle(order)
            shuffled = [shapes[k] for k in order]
            transposable = frozenset(k for k, s in enumerate(shuffled) if len(s) == 2 and rng.random() < 0.5)
            want = _bindings_by_every_permutation(w, shuffled, transposable)
            assert bindings(w, shuffled, transposable) == want, (name, shuffled, transposable)
            assert trial % 2 or want, (name, shuffled)   # the unbatched shapes always bind
