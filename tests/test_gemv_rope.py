"""The QKV projection of a Llama decode layer as one weight-streaming μGraph: RMSNorm prologue, the q / k / v
GEMVs and RoPE's rotation in the epilogue (superopt/gemv_seed.py reads the pairing of each head's halves off the
region's cat / neg / slice structure: one head per block, a ``rotate_half`` block op), written two ways (HF's
``rotate_half`` with chunk and cat; slices joined by stack and flatten), batch 1 and 3, fp32 and fp16 (Triton
interpreter on CPU), equal to eager; the bench's decode layer runs in fewer kernels with its caches as eager's."""
import math
import os

import pytest
import torch
import torch.nn.functional as F

import torch_mirage
from helpers import assert_close
from torch_mirage.bench import workloads
from torch_mirage.superopt.gemv_claim import verified_instance
from torch_mirage.superopt.gemv_seed import NotStreamable, gemv_seed
from torch_mirage.superopt.search.shrink import SMALL_HEAD, SMALL_TILE
from torch_mirage.superopt.verify import verify
from torch_mirage.superopt.search.reference import reference_of
from torch_mirage.capture.lower import trace

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU kernels run only in Triton's interpreter (TRITON_INTERPRET=1)")
D, HD, EPS = 64, 16, 1e-5


def rotate_cat(x):                     # HF: chunk and cat
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_stack(x):                   # slices, stacked on a new dim and flattened back
    half = x.shape[-1] // 2
    return torch.stack((x[..., half:].neg(), x[..., :half]), dim=-2).flatten(-2)


def rms_norm(x, g):
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * g


def qkv_rope(rotate, hd=HD):
    def fn(x, cos, sin, g, wq, wk, wv):
        b, t, _ = x.shape
        h = rms_norm(x, g)
        q = F.linear(h, wq).view(b, t, -1, hd).transpose(1, 2)
        k = F.linear(h, wk).view(b, t, -1, hd).transpose(1, 2)
        v = F.linear(h, wv).view(b, t, -1, hd).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin, v
    return fn


def _inputs(b, dtype, d=D, hd=HD, heads=4, kv_heads=2, device="cpu"):
    w = lambda n: torch.randn(n, d, device=device) * d ** -0.5                         # noqa: E731
    angle = torch.rand(b, 1, hd // 2, device=device) * 6.0
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    xs = [torch.randn(b, 1, d, device=device), cos, sin, 1 + 0.1 * torch.randn(d, device=device),
          w(heads * hd), w(kv_heads * hd), w(kv_heads * hd)]
    return [x.to(dtype) for x in xs]


def _compile(fn):
    report = torch_mirage.Report()
    opts = dict(min_region_us=0, measure_regions=False)
    return torch.compile(fn, backend=torch_mirage.MirageBackend(options=opts, report=report)), report


@interpreted
@pytest.mark.parametrize("rotate", [rotate_cat, rotate_stack])
@pytest.mark.parametrize("b,dtype", [(1, torch.float32), (3, torch.float16)])
def test_qkv_rope_is_one_streaming_kernel(rotate, b, dtype):
    torch._dynamo.reset()
    fn = qkv_rope(rotate)
    xs = _inputs(b, dtype)
    compiled, report = _compile(fn)
    got = compiled(*xs)
    want = fn(*[x.double() for x in xs])
    for g, w in zip(got, want):
        assert_close(g, w.to(dtype), dtype)
    (region,) = report.regions
    assert region.compiled_by == "mirage" and region.claimer == "ugraph-gemv", str(report)
    assert sum("aten.mm" in op for op in region.ops) == 3 and any("cat" in op for op in region.ops), region.ops


@interpreted
def test_head_bound_grids_get_a_split_that_fills_a_wave(tmp_path):
    """RoPE fixes the grid at one block per head (4 and 2 here, 32 and 8 for Llama-3-8B): where no unsplit
    re-tiling fills the SMs, the launches include the split-K with the fewest splits that fills a wave
    (:func:`wave_split`), at the first of ``WARPS_STAGES`` and at ``FILL_PIPELINE``; every launch of each block
    graph, rotation in its combine kernel where split, equals eager."""
    from torch_mirage.superopt.compile import BlockLauncher
    from torch_mirage.superopt.launch import FILL_PIPELINE, WARPS_STAGES, WAVE_FILL, _scored, streaming_candidates, \
        wave_split

    fn, n_sm = qkv_rope(rotate_cat), 16
    xs = _inputs(1, torch.float32, d=512)     # a long enough K to split (loop tiles of at least 32)
    graph = trace(fn, xs)
    ref = reference_of(graph.nodes, graph)
    seed = gemv_seed(ref.graph)
    pos = {id(v): i for i, v in enumerate(graph.inputs)}
    ins = [xs[pos[id(v)]] for v in ref.inputs]

    def arg(r):        # a kernel input, or a kernel reshape of one
        src = seed.ops[r[0]]
        return ins[src.attrs["index"]] if src.name == "input" else arg(src.inputs[0]).reshape(src.shapes[0])

    want = [w.float() for w in fn(*[x.double() for x in xs])]
    for op in (o for o in seed.ops if o.name == "customized"):
        grid, split = op.body.grid, wave_split(op.body, _scored(op.body, n_sm), n_sm)
        assert split is not None and split[0] == tuple(grid), (grid, split)
        assert split[2] > 1 and math.prod(grid) * split[2] >= WAVE_FILL * n_sm > math.prod(grid) * split[2] / 2
        configs = streaming_candidates(op.body, n_sm)
        pipelines = {(c.num_warps, c.num_stages) for c in configs
                     if (c.grid, c.forloop_range, c.split, c.prologue) == (*split, False)}
        assert pipelines == {WARPS_STAGES[0], FILL_PIPELINE}, configs
        args = [arg(r) for r in op.inputs]
        outs = [BlockLauncher(op.body, cfg, [a.dim() for a in args], str(tmp_path))(*args) for cfg in configs]
        for got in outs[1:]:
            for g, first in zip(got, outs[0]):
                assert_close(g, first)
    compiled, _ = _compile(fn)
    for g, w in zip(compiled(*xs), want):
        assert_close(g, w)


@interpreted
def test_a_padded_retiling_does_not_count_as_filling_the_wave(tmp_path):
    """Qwen2's 28 heads (H100 11-28): 16-column slices of each half make 112 programs on 132 SMs, and the next
    slicing, 8 columns a half, pads to Triton's 16 (twice the bytes), so it must not stand for a filled wave: the
    launches include the split-K that fills one. Here 4 heads of 64 on 10 SMs: 4 x 2 slices of 16 leave a wave
    short, 4 x 4 slices of 8 pad, 4 x 32 single rows run 13 waves; the paired-halves seed gets the 4 x 2 split,
    and its launch equals the unsplit one's."""
    from torch_mirage.superopt.compile import BlockLauncher, op_arguments
    from torch_mirage.superopt.launch import WAVE_FILL, _scored, streaming_candidates, wave_split

    n_sm = 10
    xs = _inputs(1, torch.float32, d=512, hd=64, heads=4, kv_heads=1)
    graph = trace(qkv_rope(rotate_cat, hd=64), xs)
    ref = reference_of(graph.nodes, graph)
    seed = gemv_seed(ref.graph, halves=True)
    pos = {id(v): i for i, v in enumerate(graph.inputs)}
    ins = [xs[pos[id(v)]] for v in ref.inputs]
    q = next(o for o in seed.ops if o.name == "customized" and o.body.grid[0] == 4)
    split = wave_split(q.body, _scored(q.body, n_sm), n_sm)
    assert split is not None and split[0] == (4, 2) and math.prod(split[0]) * split[2] >= WAVE_FILL * n_sm, split
    configs = [c for c in streaming_candidates(q.body, n_sm) if (c.grid, c.forloop_range, c.split) == split]
    assert configs, streaming_candidates(q.body, n_sm)
    args = op_arguments(seed, q, ins)
    unsplit = BlockLauncher(q.body, streaming_candidates(q.body, n_sm)[0], [a.dim() for a in args], str(tmp_path))
    want = unsplit(*args)
    for cfg in configs:
        for g, w in zip(BlockLauncher(q.body, cfg, [a.dim() for a in args], str(tmp_path))(*args), want):
            assert_close(g, w)


@interpreted
@pytest.mark.parametrize("rotate,rows", [(rotate_cat, 1), (rotate_stack, 1), (rotate_cat, 3), (rotate_stack, 16)])
def test_paired_halves_form_equals_eager_at_every_launch(rotate, rows, tmp_path):
    """The paired-halves form (a block holds matching slices of both halves of a head, the weight read through two
    strided half views, a saved concat of the pair): verified against the region's program, and every launch the
    tuner would time — slices of the half heads, splits — equals the head-per-block seed's result and eager, at one
    row and at several (the rows lead the half tiles: one 2-d product per step, by the multiply-sum below 16 rows
    and ``tl.dot`` from 16)."""
    from torch_mirage.config import Config
    from torch_mirage.superopt.compile import BlockLauncher, compile_ugraph, op_arguments
    from torch_mirage.superopt.gemv_claim import verified_halves
    from torch_mirage.superopt.launch import streaming_candidates

    fn = qkv_rope(rotate)
    xs = _inputs(rows, torch.float32, d=128)
    graph = trace(fn, xs)
    ref = reference_of(graph.nodes, graph)
    halves = verified_halves(ref.graph, Config())
    assert halves is not None
    slices = [o for o in halves.ops if o.name == "slice"]
    assert slices and all(o.attrs["chunks"] == 2 for o in slices)          # the weights' halves: views, no copy
    pos = {id(v): i for i, v in enumerate(graph.inputs)}
    ins = [xs[pos[id(v)]] for v in ref.inputs]
    want = compile_ugraph(gemv_seed(ref.graph), ins, tune=False)(*ins)
    got = compile_ugraph(halves, ins, tune=False)(*ins)
    eager = fn(*[x.double() for x in xs])
    for g, w in zip(got, want):
        assert_close(g, w)
    assert sorted(tuple(g.shape) for g in got) == sorted(tuple(e.shape) for e in eager)

    for op in (o for o in halves.ops if o.name == "customized"):
        args = op_arguments(halves, op, ins)
        configs = streaming_candidates(op.body, 4)
        assert any(c.grid[1] > op.body.grid[1] for c in configs), configs     # finer slices of the half heads
        outs = [BlockLauncher(op.body, cfg, [a.dim() for a in args], str(tmp_path))(*args) for cfg in configs]
        for other in outs[1:]:
            for g, first in zip(other, outs[0]):
                assert_close(g, first)


def fused_qkv_rope(rotate, heads=4, kv_heads=2, hd=HD):
    """Phi-3's attention input: one fused projection, q / k / v sliced off its result, RoPE on q and k."""
    def fn(x, cos, sin, g, w):
        b, t, _ = x.shape
        qkv = F.linear(rms_norm(x, g), w)
        q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
        q, k, v = (y.view(b, t, -1, hd).transpose(1, 2) for y in (q, k, v))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin, v
    return fn


@interpreted
@pytest.mark.parametrize("rotate,rows", [(rotate_cat, 1), (rotate_stack, 3)])
def test_fused_qkv_split_before_rope_claims_the_paired_halves_form(rotate, rows):
    """A fused QKV projection split after its matmul (phi-3) streams like three projections: each part's weight
    rows (a slice of the stored (n, k) weight) read through their two half views, RoPE paired in the block; the
    paired-halves form is claimed as for separate projections, and equals eager."""
    torch._dynamo.reset()
    fn = fused_qkv_rope(rotate)
    xs = _inputs(rows, torch.float32)
    xs = xs[:4] + [torch.cat(xs[4:], dim=0)]          # wq, wk, wv stacked: the fused weight
    compiled, report = _compile(fn)
    for g, w in zip(compiled(*xs), fn(*[x.double() for x in xs])):
        assert_close(g, w.float(), torch.float32)
    (region,) = [r for r in report.regions if r.claimer == "ugraph-gemv"]
    assert region.compiled_by == "mirage" and region.info["ugraph"] == "weight_streaming_halves", str(report)
    assert any("split" in op for op in region.ops), region.ops


@interpreted
def test_few_kv_heads_stream_one_row_slices(tmp_path):
    """A width of few heads (k / v: 2 heads of 16 here, 8 of 128 in Llama-3-8B) fills the SMs only with slices of
    one row of each half: those unsplit streams are among the contiguous ones (sides of one count, over at most
    ``PROBE_WAVES[-1]`` waves; sides between one and ``MIN_STREAM_TILE`` do not: they pad) and equal the seed."""
    from torch_mirage.config import Config
    from torch_mirage.superopt.compile import BlockLauncher, op_arguments
    from torch_mirage.superopt.gemv_claim import verified_halves
    from torch_mirage.superopt.launch import (CONTIGUOUS_PIPELINES, MIN_STREAM_TILE, PROBE_WAVES, LaunchConfig,
                                              contiguous_streams, retile, strip)

    fn = qkv_rope(rotate_cat)
    xs = _inputs(1, torch.float32, d=512)
    graph = trace(fn, xs)
    ref = reference_of(graph.nodes, graph)
    halves = verified_halves(ref.graph, Config())
    pos = {id(v): i for i, v in enumerate(graph.inputs)}
    ins = [xs[pos[id(v)]] for v in ref.inputs]
    n_sm = 8
    kv = [o for o in halves.ops if o.name == "customized"][-1]
    assert kv.body.grid[0] == 2                                              # the k / v heads
    streams = contiguous_streams(kv.body, n_sm)
    rows = {min(strip(it.shapes[0])[0][:-1]) for g, f in streams for it in retile(kv.body, g, f).iterators
            if it.attrs["fmap"] is not None and any(m is not None for m in it.attrs["imap"])}
    assert 1 in rows and not any(1 < r < MIN_STREAM_TILE for r in rows), streams
    assert all(math.prod(g) <= PROBE_WAVES[-1] * n_sm for g, _ in streams)
    args = op_arguments(halves, kv, ins)
    ranks = [a.dim() for a in args]
    own = BlockLauncher(kv.body, LaunchConfig(tuple(kv.body.grid), kv.body.forloop_range, 1, 4, 3), ranks,
                        str(tmp_path))(*args)                 # the seed's own schedule (equal to eager: above)
    for grid, f in streams:
        for w, st in CONTIGUOUS_PIPELINES:
            got = BlockLauncher(kv.body, LaunchConfig(grid, f, 1, w, st), ranks, str(tmp_path))(*args)
            for g, r in zip(got, own):
                assert_close(g, r)


def test_paired_halves_need_a_rotation():
    """Without RoPE's rotation the paired-halves form does not apply: no second alternative is offered."""
    from torch_mirage.config import Config
    from torch_mirage.superopt.gemv_claim import verified_halves

    def fn(x, g, wv):
        return F.linear(rms_norm(x, g), wv)
    xs = [torch.randn(1, 1, D), 1 + 0.1 * torch.randn(D), torch.randn(2 * HD, D)]
    graph = trace(fn, xs)
    ref = reference_of(graph.nodes, graph)
    assert verified_halves(ref.graph, Config()) is None
    with pytest.raises(NotStreamable, match="rotation"):
        gemv_seed(ref.graph, halves=True)


def test_rotation_must_pair_the_halves_of_a_head():
    """A concat that does not swap the two halves of each head (here: the halves kept in place, one negated)
    is no rotation: the seed declines it rather than stream a wrong epilogue."""
    def not_rope(x, cos, sin, g, wq, wk, wv):
        q = F.linear(rms_norm(x, g), wq).view(x.shape[0], 1, -1, HD).transpose(1, 2)
        x1, x2 = q.chunk(2, dim=-1)
        return q * cos.unsqueeze(1) + torch.cat((x1, -x2), dim=-1) * sin.unsqueeze(1)

    graph = trace(not_rope, _inputs(1, torch.float32))
    with pytest.raises(NotStreamable, match="is not|is neither"):
        gemv_seed(reference_of(graph.nodes, graph).graph)


@interpreted
@pytest.mark.parametrize("b", [1, 2])
def test_decode_layer_qkv_rope_in_one_kernel(b):
    """The bench's decode layer: norm + Q, K, V + RoPE of q and k are one weight-streaming region (the
    rotate_half ops no Inductor kernel of their own), output and KV caches as eager's (the new slots written, the
    rest untouched)."""
    torch._dynamo.reset()
    wl = workloads.WORKLOADS["llama_layer_decode"]
    args = wl.make_inputs(b, torch.float32, "cpu", 0, quick=True)
    before = [a.clone() for a in args]
    eager_args = [a.clone() for a in args]
    want = wl.fn(*eager_args)
    compiled, report = _compile(wl.fn)
    assert_close(compiled(*args), want)
    slots = args[4]
    kept = torch.ones(args[5].shape[2], dtype=torch.bool)
    kept[slots] = False
    for i, a in enumerate(args):
        if i in wl.mutates:
            assert torch.equal(a[:, :, kept], before[i][:, :, kept]), f"input {i}: slots outside the new token's"
            assert_close(a[:, :, slots], eager_args[i][:, :, slots])
        else:
            assert torch.equal(a, before[i]), f"input {i} written"
    (qkv,) = [r for r in report.regions if r.claimer == "ugraph-gemv" and sum("aten.mm" in o for o in r.ops) == 3]
    assert sum("cat" in op for op in qkv.ops) == 2, qkv.ops
    assert not [r for r in report.regions if r.compiled_by != "mirage" and any("cat" in op for op in r.ops)]
    # the output projection holds nn.Linear's transpose of its weight (a lone permute region before 11-26: the
    # kernel then read the weight through a strided view)
    assert [r for r in report.regions if sum("aten.mm" in o for o in r.ops) == 1 and "aten.permute.default" in r.ops
            and r.claimer == "ugraph-gemv"], str(report)
    assert len(report.regions) == 8, str(report)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("b", [1, 8])
def test_qkv_rope_on_gpu(b):
    """bf16 at Llama-8B widths (4096, 32 heads of 128, 8 KV heads): one tuned weight-streaming kernel for norm +
    Q, K, V + RoPE, equal to eager within bf16 tolerance."""
    torch._dynamo.reset()
    bf = torch.bfloat16
    fn = qkv_rope(rotate_cat, hd=128)
    xs = _inputs(b, bf, d=4096, hd=128, heads=32, kv_heads=8, device="cuda")
    compiled, report = _compile(fn)
    got = compiled(*xs)
    for g, w in zip(got, fn(*[x.double() for x in xs])):
        assert_close(g, w.to(bf), bf)
    (region,) = report.regions
    assert region.compiled_by == "mirage" and region.claimer == "ugraph-gemv", str(report)


def test_rotary_region_verifies_at_two_heads():
    """Its (b, h, 1, d) views keep a region with RoPE from shrinking size by size; the verifier still checks it at
    small sizes: two heads of the head size, the hidden size two heads, its for-loop and grid split as at the real
    sizes (a 4096-wide region takes seconds per verification instead of tens)."""
    fn = qkv_rope(rotate_cat, hd=32)
    graph = trace(fn, _inputs(1, torch.float32, d=256, hd=32, heads=8, kv_heads=2))
    ref = reference_of(graph.nodes, graph).graph
    program, seed = verified_instance(ref, gemv_seed(ref))
    assert program is not ref and max(max(s) for op in program.ops for s in op.shapes) == 64
    (q_block,) = [op.body for op in seed.ops if op.name == "customized" and op.shapes[0][-1] == 64][:1]
    assert q_block.grid == (2,) and q_block.forloop_range > 1
    assert verify(seed, program, [torch.zeros(op.attrs["shape"]) for op in program.inputs])


def test_large_heads_verify_at_two_small_heads():
    """Heads longer than SMALL_HEAD (gemma2's 256) verify at two heads of SMALL_HEAD: the executor's steps grow with
    the head (7.8 s a verification at 256 on the 2-core CPU). Both forms verify there, the halves' blocks hold two
    slices of each half as at the real size, and a wrong rotation (the halves' signs swapped) fails there."""
    hd = 4 * SMALL_HEAD
    fn = qkv_rope(rotate_cat, hd=hd)
    graph = trace(fn, _inputs(1, torch.float32, d=2 * hd, hd=hd, heads=2, kv_heads=1))
    ref = reference_of(graph.nodes, graph).graph
    for halves in (False, True):
        seed = gemv_seed(ref, halves=halves)
        program, small = verified_instance(ref, seed, halves=halves)
        assert max(max(s) for op in program.ops for s in op.shapes) == 2 * SMALL_HEAD
        assert verify(small, program, [torch.zeros(op.attrs["shape"]) for op in program.inputs])
    q_block = next(op.body for op in small.ops if op.name == "customized")
    assert q_block.grid[1] == SMALL_HEAD // 2 // SMALL_TILE == 2
    wrong = trace(qkv_rope(lambda t: -rotate_cat(t), hd=hd), _inputs(1, torch.float32, d=2 * hd, hd=hd, heads=2,
                                                                    kv_heads=1))
    wrong_ref = reference_of(wrong.nodes, wrong).graph
    program, _ = verified_instance(wrong_ref, gemv_seed(wrong_ref))
    assert not verify(small, program, [torch.zeros(op.attrs["shape"]) for op in program.inputs])


@interpreted
def test_a_rotated_region_claims_the_paired_halves_form_alone():
    """Where the region rotates heads and the paired-halves form verifies, that form is the region's μGraph
    (verified_form; with both forms claimed, the CPU, which times nothing, built the first, the head-per-block
    form); the same projections without RoPE get the seed. Both equal eager."""
    torch._dynamo.reset()
    rotated = qkv_rope(rotate_cat)

    def plain(x, cos, sin, g, wq, wk, wv):         # the same projections, no rotation
        h = rms_norm(x, g)
        return F.linear(h, wq), F.linear(h, wk), F.linear(h, wv)

    xs = _inputs(2, torch.float32)
    for fn, form in ((rotated, "weight_streaming_halves"), (plain, "weight_streaming")):
        compiled, report = _compile(fn)
        for g, w in zip(compiled(*xs), fn(*[x.double() for x in xs])):
            assert_close(g, w.float(), torch.float32)
        (region,) = [r for r in report.regions if r.claimer == "ugraph-gemv"]
        assert region.compiled_by == "mirage" and region.info["ugraph"] == form, str(report)
        assert ("paired halves" in region.detail) == (form == "weight_streaming_halves"), region.detail


@interpreted
def test_every_layers_qkv_region_lowers_to_one_program():
    """Two layers' QKV + RoPE regions whose hidden states come in different graph orders (the first layer's is a
    graph input, before cos / sin; the second's is made after them) lower with their inputs in first-use order,
    so both claim one μGraph — the seed is verified once, not once per order — and equal eager."""
    torch._dynamo.reset()
    layer = qkv_rope(rotate_cat)

    def two_layers(x, cos, sin, g, wq, wk, wv):
        x2 = x + 1.0                     # the second layer's hidden state, returned: not taken into its region
        return (x2, *layer(x, cos, sin, g, wq, wk, wv), *layer(x2, cos, sin, g, wq, wk, wv))

    xs = _inputs(1, torch.float32)
    compiled, report = _compile(two_layers)
    for got, want in zip(compiled(*xs), two_layers(*[x.double() for x in xs])):
        assert_close(got, want.float(), torch.float32)
    regions = [r for r in report.regions if r.claimer == "ugraph-gemv"]
    assert len(regions) == 2 and all(r.compiled_by == "mirage" for r in regions), str(report)
    assert regions[0].info["ugraph_hash"] == regions[1].info["ugraph_hash"], [r.info for r in regions]
