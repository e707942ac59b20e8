"""A static KV cache's write taken into the projection kernel that computes it (superopt/updates.py): the weight-
streaming claimer takes ``index_copy_`` (HF's ``StaticCache``) or slice assignment at the positions (both
``index_put`` after Inductor's decompositions) into the region, the seed is verified without it and gets it back, and the generated kernel stores the new rows into the
cache itself (codegen ``StoreThrough``); caches equal eager's, their other slots untouched; where the cache's old
value is read elsewhere, the write stays outside. Kernels run in Triton's interpreter on the CPU."""
import inspect
import os

import pytest
import torch
import torch.nn.functional as F

import torch_mirage
from helpers import assert_close
from torch_mirage.capture.lower import trace
from torch_mirage.numerics import rms_norm
from torch_mirage.superopt.builder import new_kernel_graph, new_threadblock_graph
from torch_mirage.codegen.ugraph_triton import StoreThrough
from torch_mirage.superopt.compile import BlockLauncher, compile_ugraph
from torch_mirage.superopt.launch import LaunchConfig
from torch_mirage.superopt.executor import execute
from torch_mirage.superopt.search.reference import reference_of
from torch_mirage.superopt.updates import split_updates, store_through, updates_of, with_updates

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU kernels run only in Triton's interpreter (TRITON_INTERPRET=1)")
D, KV, HD, SLOTS = 48 + 5, 2, 16, 23


def kv_projection(x, g, wk, wv, pos, k_cache, v_cache):
    """A decode step's K and V projections (nn.Linear weights) after an RMSNorm, written into a static cache as HF
    does; returns the caches' new rows as the attention would read them."""
    b = x.shape[0]
    h = rms_norm(x, 1e-5, g)
    k = F.linear(h, wk).view(b, 1, KV, HD).transpose(1, 2)
    v = F.linear(h, wv).view(b, 1, KV, HD).transpose(1, 2)
    k_cache.index_copy_(2, pos, k)
    v_cache.index_copy_(2, pos, v)
    return k_cache.sum(dim=2), v_cache[:, :, :4]


def kv_projection_sliced(x, g, wk, wv, pos, k_cache, v_cache):
    """As :func:`kv_projection`, written the other common way: slice assignment at the positions, the norm spelled
    out, the heads split by ``reshape``."""
    h = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5) * g
    k_cache[:, :, pos] = (h @ wk.t()).reshape(x.shape[0], 1, KV, HD).permute(0, 2, 1, 3)
    v_cache[:, :, pos] = (h @ wv.t()).reshape(x.shape[0], 1, KV, HD).permute(0, 2, 1, 3)
    return k_cache.sum(dim=2), v_cache[:, :, :4]


def old_value_read(x, g, wk, wv, pos, k_cache, v_cache):
    """As :func:`kv_projection`, but the K cache's old contents are read too: its write cannot be made in place by
    the projection kernel."""
    before = k_cache.sum(dim=2)
    new = kv_projection(x, g, wk, wv, pos, k_cache, v_cache)
    return before, *new


def _inputs(b: int):
    x = torch.randn(b, 1, D)
    g = 1 + 0.1 * torch.randn(D)
    wk, wv = (torch.randn(KV * HD, D) * D ** -0.5 for _ in range(2))
    pos = torch.randint(0, SLOTS, (1,))
    caches = [torch.randn(b, KV, SLOTS, HD) for _ in range(2)]
    return [x, g, wk, wv, pos, *caches]


def _compile(fn):
    report = torch_mirage.Report()
    opts = dict(min_region_us=0, measure_regions=False, cache=False)    # the region is kept: its kernel is tested
    return torch.compile(fn, fullgraph=True, backend=torch_mirage.MirageBackend(options=opts, report=report)), report


@interpreted
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("fn", [kv_projection, kv_projection_sliced, old_value_read])
def test_cache_write_in_the_projection_kernel(fn, rows):
    torch._dynamo.reset()
    args = _inputs(rows)
    eager_args = [a.clone() for a in args]
    want = fn(*eager_args)
    compiled, report = _compile(fn)
    got = compiled(*args)
    assert_close(got, want)
    for i in (5, 6):                                  # both caches: as eager left them, every slot
        assert torch.equal(args[i], eager_args[i]) or assert_close(args[i], eager_args[i]) is None
    mirage = [r for r in report.regions if r.compiled_by == "mirage" and r.claimer == "ugraph-gemv"]
    assert mirage, str(report)
    writes = [r for r in mirage if any(op.startswith(("aten.index_put", "aten.index_copy")) for op in r.ops)]
    (region,) = writes
    taken = 1 if fn is old_value_read else 2           # there k's old value is read: its write stays outside
    assert sum(op.startswith("aten.index_put") for op in region.ops) == taken, str(report)
    assert region.info.get("stored_updates") == taken, str(report)

    args2 = _inputs(rows)                              # a second call, other positions and contents
    args2[4] = torch.tensor([(int(args[4]) + 7) % SLOTS])
    eager2 = [a.clone() for a in args2]
    assert_close(compiled(*args2), fn(*eager2))
    for i in (5, 6):
        assert_close(args2[i], eager2[i])


def test_updates_split_off_and_put_back():
    """The core of a program with a cache write computes the written value as its output (in the projection's rows,
    without the views as heads) and drops the cache and position inputs; putting the write back gives the
    program's results again."""
    args = _inputs(2)
    graph = trace(kv_projection, args)
    last = max(i for i, n in enumerate(graph.nodes) if n.target_name == "aten.index_put.default")
    nodes = graph.nodes[:last + 1]                              # the projections and the writes
    ref = reference_of(nodes, graph)
    program = ref.graph
    assert len(updates_of(program)) == 2
    core, updates = split_updates(program)
    assert not [op for op in core.ops if op.name == "index_copy"]
    assert len(core.inputs) == len(program.inputs) - 3          # the two caches and the positions
    assert [tuple(core.shape(r)) for r in core.outputs] == [(2, KV * HD)] * 2
    back = with_updates(core, updates, program)
    ins = [a.clone() for a in args[:4]] + [torch.tensor([5])] + [a.clone() for a in args[5:]]
    for got, want in zip(execute(back, [x.clone() for x in ins]), execute(program, [x.clone() for x in ins])):
        assert torch.equal(got, want)


@interpreted
def test_store_through_writes_the_rows_at_their_positions():
    """A μGraph whose graph-defined op saves (rows, n) that an update writes at positions as (b, h, 1, d): the
    kernel stores them into the destination itself, the update step launches nothing, and other rows stay."""
    b, h, d, slots = 3, 2, 16, 9
    g = new_kernel_graph()
    x = g.new_input((b, h * d), "float32")
    cache = g.new_input((b, h, slots, d), "float32")
    pos = g.new_input((1,), "int64")
    tb = new_threadblock_graph((h,), 1)
    t = tb.new_input(x, imap=(1,), fmap=None)
    tb.new_output(tb.forloop_accum(tb.scalar_mul(t, value=2.0), "sum"), omap=(1,))
    (y,) = g.customized([x], tb)
    g.mark_output(g.index_copy(cache, pos, g.reshape(y, shape=(b, h, 1, d)), dim=2))
    mu = g.build()
    (found,) = store_through(mu)
    assert found.through.only and found.through.shape == (b, h, 1, d)
    xs = [torch.randn(b, h * d), torch.randn(b, h, slots, d), torch.tensor([5])]
    warmups = {}        # the rebuilt kernel's compile ahead, for the caller's pool round (build._ugraph)
    compiled = compile_ugraph(mu, xs, tune=False, label="writes", warmups=warmups)
    assert compiled.stored_updates == 1 and list(warmups) == ["writes op3"]
    warmups["writes op3"]()                            # under the interpreter: compiles nothing, runs nothing
    want = xs[1].clone()
    want[:, :, 5] = (2 * xs[0]).view(b, h, d)
    (out,) = compiled(*xs)
    assert out.data_ptr() == xs[1].data_ptr()          # updated in place
    assert_close(xs[1], want)


def qkv_projection(x, g, wq, wk, wv, pos, k_cache, v_cache):
    """Norm + Q, K, V projections of a decode step (GQA widths), K and V written into a static cache."""
    b, heads, kv, hd = x.shape[0], wq.shape[0] // k_cache.shape[3], k_cache.shape[1], k_cache.shape[3]
    h = rms_norm(x, 1e-5, g)
    q = F.linear(h, wq).view(b, 1, heads, hd).transpose(1, 2)
    k = F.linear(h, wk).view(b, 1, kv, hd).transpose(1, 2)
    v = F.linear(h, wv).view(b, 1, kv, hd).transpose(1, 2)
    k_cache.index_copy_(2, pos, k)
    v_cache.index_copy_(2, pos, v)
    return q, k_cache.sum(dim=2), v_cache[:, :, -4:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 8])
def test_cache_write_on_gpu(rows):
    """bf16 at Llama-8B widths (d 4096, 32 query and 8 KV heads of 128), tuned: the K / V kernel stores the cache
    rows itself (also where it joins the Q kernel in one launch); caches and outputs match eager over two calls at
    other positions."""
    torch._dynamo.reset()
    dev, dt, d, heads, kv, hd, slots = "cuda", torch.bfloat16, 4096, 32, 8, 128, 256

    def inputs(position):
        w = lambda n: (torch.randn(n, d, device=dev) * d ** -0.5).to(dt)      # noqa: E731
        return [torch.randn(rows, 1, d, device=dev).to(dt), (1 + 0.1 * torch.randn(d, device=dev)).to(dt),
                w(heads * hd), w(kv * hd), w(kv * hd), torch.tensor([position], device=dev),
                *(torch.randn(rows, kv, slots, hd, device=dev).to(dt) for _ in range(2))]
    compiled, report = _compile(qkv_projection)
    for position in (3, slots - 1):
        args = inputs(position)
        eager = [a.clone() for a in args]
        want = qkv_projection(*eager)
        got = compiled(*args)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
        for i in (6, 7):
            torch.testing.assert_close(args[i].float(), eager[i].float(), rtol=2e-2, atol=2e-2)
    writes = [r for r in report.regions if r.compiled_by == "mirage" and any("index_put" in op for op in r.ops)]
    assert len(writes) == 1 and writes[0].info.get("stored_updates") == 2, str(report)
    print(writes[0].info)


@interpreted
def test_hf_llama_decode_writes_its_cache_in_the_qkv_kernels():
    """A tiny HF Llama (2 layers, fp32) decoding one token into a ``StaticCache``: each layer's QKV kernel stores
    its K / V rows into the cache (the positions come from the cache's counter, computed outside the region), and
    its attention reads the cache's KV heads without HF's repeat_kv copy; logits and every cache tensor equal
    eager's."""
    transformers = pytest.importorskip("transformers")
    del transformers
    from torch_mirage.bench import llm
    torch._dynamo.reset()
    model, config = llm.build_model(llm.MODELS["llama3-8b-4l"], torch.float32, torch.device("cpu"), quick=True)
    cache = llm.static_cache(config, 1, 32, torch.device("cpu"), torch.float32)
    ids, position = torch.randint(0, config.vocab_size, (1, 1)), 5

    def step(ids, position_ids, cache_position):
        return model(input_ids=ids, position_ids=position_ids, cache_position=cache_position, past_key_values=cache,
                     use_cache=True).logits
    args = (ids, torch.tensor([[position]]), torch.tensor([position]))
    state = llm.KVState(cache, position, 1, "cache_position" in inspect.signature(model.forward).parameters, "test")
    with torch.no_grad():
        step(*args)                                   # allocates the cache's tensors (lazily, in 5.x)
        for t in llm.cache_tensors(cache):
            t.copy_(torch.randn_like(t))
        state.save()
        state.set_position()                          # 5.x writes at the cache's own counter: put it back
        want = step(*args)
        want_cache = [t.clone() for t in llm.cache_tensors(cache)]
        state.restore()
        report = torch_mirage.Report()
        compiled = torch.compile(step, backend=torch_mirage.MirageBackend(
            options=dict(min_region_us=0, measure_regions=False, cache=False), report=report))
        got = compiled(*args)
    assert_close(got, want)
    for t, w in zip(llm.cache_tensors(cache), want_cache):
        assert_close(t, w)
    writes = [r for r in report.regions if r.compiled_by == "mirage" and r.info.get("stored_updates")]
    assert len(writes) == config.num_hidden_layers and all(r.info["stored_updates"] == 2 for r in writes), str(report)
    # the attention reads the cache's KV heads as written: HF's repeat_kv before SDPA copies nothing
    attention = [r for r in report.regions if r.compiled_by == "mirage" and r.claimer == "attention"]
    hk = config.num_key_value_heads
    assert len(attention) == config.num_hidden_layers and all(f"hk={hk} " in r.info["attention"] for r in attention)
    # HF's bool static-cache mask is read by the kernels as it is (no additive copy, no empty-row scan per layer)
    assert all(r.info.get("mask") == "bool, read in the kernel" for r in attention), [r.info for r in attention]


@interpreted
@pytest.mark.parametrize("split, in_kernel", [(1, False), (2, False), (2, True)])
def test_store_through_after_a_split(split, in_kernel, tmp_path):
    """A GEMV whose result is written at positions: the rows land in the destination whether the kernel stores its
    outputs itself, a combine kernel after a split-K does, or the split's last program (in-kernel fold)."""
    b, k, h, d, slots = 3, 64, 2, 16, 7
    g = new_kernel_graph()
    x, w = g.new_input((b, k), "float32"), g.new_input((k, h * d), "float32")
    tb = new_threadblock_graph((h,), 4)
    acc = tb.forloop_accum(tb.matmul(tb.new_input(x, imap=(None,), fmap=1), tb.new_input(w, imap=(1,), fmap=0)), "sum")
    tb.new_output(acc, omap=(1,))
    (y,) = g.customized([x, w], tb)
    g.mark_output(y)
    body = next(op.body for op in g.build().ops if op.name == "customized")
    through = StoreThrough(0, (b, h, 1, d), 2, "float32", only=False)
    cfg = LaunchConfig(grid=(h,), forloop_range=4, split=split, combine_in_kernel=in_kernel)
    launcher = BlockLauncher(body, cfg, [2, 2], str(tmp_path), through=[through])
    xs = [torch.randn(b, k), torch.randn(k, h * d)]
    cache, pos = torch.randn(b, h, slots, d), torch.tensor([4])
    want = cache.clone()
    want[:, :, 4] = (xs[0] @ xs[1]).view(b, h, d)
    (out,) = launcher(*xs, targets=[(cache, pos)])
    assert_close(out, xs[0] @ xs[1])                  # ``only`` False: its own output is stored too
    assert_close(cache, want)


def kv_projection_cast(x, g, wk, wv, pos, k_cache, v_cache):
    """As :func:`kv_projection`, the cache held in another dtype than the projections compute in (a cast before the
    write, as PyTorch asks)."""
    b = x.shape[0]
    h = rms_norm(x, 1e-5, g)
    k_cache.index_copy_(2, pos, F.linear(h, wk).view(b, 1, KV, HD).transpose(1, 2).to(k_cache.dtype))
    v_cache.index_copy_(2, pos, F.linear(h, wv).view(b, 1, KV, HD).transpose(1, 2).to(v_cache.dtype))
    return k_cache.float().sum(dim=2), v_cache[:, :, :4]


@interpreted
def test_cache_in_another_dtype():
    """A half-precision cache written from fp32 projections: whether the writes join the kernel (the cast then
    stores half) or stay outside, projections and caches equal eager's."""
    torch._dynamo.reset()
    args = _inputs(2)
    args[5], args[6] = args[5].half(), args[6].half()
    eager_args = [a.clone() for a in args]
    want = kv_projection_cast(*eager_args)
    compiled, report = _compile(kv_projection_cast)
    assert_close(compiled(*args), want)
    for i in (5, 6):
        assert_close(args[i], eager_args[i])
    mirage = [r for r in report.regions if r.compiled_by == "mirage" and r.claimer == "ugraph-gemv"]
    assert mirage, str(report)
    for r in mirage:
        assert r.info.get("stored_updates", 0) == sum("index_put" in op for op in r.ops), str(report)


def test_random_positions_are_distinct():
    """Example inputs for a short position vector (a write of a few tokens) never repeat a position: an index_copy
    with repeated positions has no defined result to check a kernel against."""
    from torch_mirage.capture.ir import TensorMeta
    from torch_mirage.timing import random_like

    meta = TensorMeta.of(torch.empty(5, dtype=torch.int64))
    for _ in range(20):
        pos = random_like(meta, "cpu")
        assert pos.dtype == torch.int64 and len(set(pos.tolist())) == 5 and 0 <= int(pos.min()) and int(pos.max()) < 8


def kv_projection_returned(x, g, wk, wv, pos, k_cache, v_cache):
    """The caches written, and the K cache itself returned (an output aliasing a mutated input)."""
    kv_projection(x, g, wk, wv, pos, k_cache, v_cache)
    return k_cache, v_cache * 1.0


@interpreted
def test_returned_cache_is_the_input_written_in_place():
    torch._dynamo.reset()
    compiled, report = _compile(kv_projection_returned)
    for _ in range(2):                                  # two calls, other contents and positions
        args = _inputs(2)
        eager = [a.clone() for a in args]
        want = kv_projection_returned(*eager)
        got = compiled(*args)
        assert_close(got, want)
        assert got[0].data_ptr() == args[5].data_ptr()   # as eager: the mutated input itself
        for i in (5, 6):
            assert_close(args[i], eager[i])
    assert any(r.info.get("stored_updates") == 2 for r in report.regions), str(report)


@interpreted
def test_cache_write_in_a_sibling_launch():
    """Q and K / V of different widths are two graph-defined ops; joined in one launch (forced here: the CPU does not
    time), the K / V part still stores the cache rows itself."""
    from torch_mirage.config import load
    from torch_mirage.context import CompileContext
    from torch_mirage.partition.region import Claim
    from torch_mirage.superopt.gemv_claim import GemvClaimer

    heads, b = 4, 2
    x, g = torch.randn(b, 1, D), 1 + 0.1 * torch.randn(D)
    wq, wk, wv = (torch.randn(n * HD, D) * D ** -0.5 for n in (heads, KV, KV))
    caches = [torch.randn(b, KV, SLOTS, HD) for _ in range(2)]
    args = [x, g, wq, wk, wv, torch.tensor([6]), *caches]
    graph = trace(qkv_projection, args)
    ctx = CompileContext.standalone(load({"min_region_us": 0}))
    (claim,) = [o for o in GemvClaimer().claim(graph, list(graph.nodes), ctx)
                if isinstance(o, Claim) and any("index_put" in n.target_name for n in o.nodes)]
    mu = claim.plan.alternatives[0].graph
    ref = claim.plan.bind.args[2]           # the region's reference (reference_kernel's): the μGraph's inputs
    pos = {id(v): i for i, v in enumerate(graph.inputs)}
    examples = [args[pos[id(v)]].clone() for v in ref.inputs]
    compiled = compile_ugraph(mu, examples, tune=False, siblings=True)
    assert compiled.sibling_launches and compiled.stored_updates == 2
    eager = [a.clone() for a in args]
    qkv_projection(*eager)
    compiled(*examples)
    written = [t for t in examples if t.shape == caches[0].shape]
    for got, want in zip(written, eager[6:]):
        assert_close(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 8])
def test_sdpa_after_repeat_kv_on_gpu(rows):
    """HF's decode attention on CUDA with a mask (Llama-3-8B heads, bf16, a 4k cache): K / V repeated per group before
    SDPA; mirage's region reads the 8 KV heads in place and matches eager."""
    torch._dynamo.reset()
    dev, dt, h, hk, skv, d = "cuda", torch.bfloat16, 32, 8, 4096, 128

    def attention(q, k, v, mask):
        k = k[:, :, None].expand(rows, hk, h // hk, skv, d).reshape(rows, h, skv, d)
        v = v[:, :, None].expand(rows, hk, h // hk, skv, d).reshape(rows, h, skv, d)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(rows, 1, h * d)
    q = torch.randn(rows, h, 1, d, device=dev, dtype=dt)
    k, v = (torch.randn(rows, hk, skv, d, device=dev, dtype=dt) for _ in range(2))
    keep = torch.arange(skv, device=dev) < 3000
    mask = torch.where(keep, 0.0, float("-inf")).to(dt).expand(rows, 1, 1, skv)
    compiled, report = _compile(attention)
    got = compiled(q, k, v, mask)
    want = attention(q.double(), k.double(), v.double(), mask.double())
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
    (region,) = [r for r in report.regions if r.compiled_by == "mirage" and r.claimer == "attention"]
    assert f"hk={hk} " in region.info["attention"], region.info
