"""Lowering ATen graphs into the IR and back."""
import torch
import torch.nn.functional as F

from torch_mirage.capture.lower import lower, to_fx
from torch_mirage.capture.ops import OpKind
from torch_mirage.testing.aten import trace_aten
from torch_mirage.testing.models import BertLayer, LlamaBlock, LlamaConfig, bert_inputs, llama_inputs
from helpers import assert_close


def _roundtrip(fn, *inputs):
    gm = trace_aten(fn, *inputs)
    graph = lower(gm)
    graph.validate()
    back = to_fx(graph)
    args = [torch.randn(v.meta.shape, dtype=v.meta.dtype) if v.meta.dtype.is_floating_point else v.example
            for v in graph.inputs]   # parameters are graph inputs too
    with torch.no_grad():
        got = back(*args)
        want = gm(*args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    return graph


def test_roundtrip_layernorm_softmax_split():
    def fn(x, w):
        h = F.layer_norm(x, (x.shape[-1],))
        a, b = h.split(4, dim=-1)
        return torch.softmax(a @ w, -1) + b.sum(), torch.var_mean(x, -1)[0]
    graph = _roundtrip(fn, torch.randn(3, 8), torch.randn(4, 4))
    kinds = {n.op.name for n in graph.nodes}
    assert {"var_mean", "matmul", "amax", "exp", "sum", "div", "split"} <= kinds


def test_every_value_has_meta():
    cfg = LlamaConfig()
    graph = _roundtrip(LlamaBlock(cfg).eval(), *llama_inputs(cfg, 2, 8))
    for v in graph.values():
        if isinstance(v.example, torch.Tensor):
            assert v.meta.shape == tuple(v.example.shape) and v.meta.dtype == v.example.dtype
            assert v.meta.stride == tuple(v.example.stride()) and v.meta.device == v.example.device


def test_unknown_ops_are_opaque_and_printed():
    graph = _roundtrip(lambda x: torch.cumsum(x, 0) * 2, torch.randn(5, 3))
    opaque = [n for n in graph.nodes if n.kind is OpKind.OPAQUE]
    assert opaque and "cumsum" in opaque[0].target_name
    text = str(graph)
    assert "opaque<aten.cumsum.default>" in text and "mul(" in text and "float32[5,3]" in text


def test_bert_layer_roundtrip():
    layer = BertLayer().eval()
    x, mask = bert_inputs(64, 2, 8)
    _roundtrip(layer, x, mask)


def test_describe_names_op_shape_dtype():
    graph = lower(trace_aten(lambda x, y: x + y, torch.randn(2, 3, dtype=torch.float16), torch.randn(3, dtype=torch.float16)))
    assert graph.nodes[0].describe() == "aten.add.Tensor(float16[2,3], float16[3])"


def test_positions_and_output_values_follow_the_graph():
    """The graph's cached node / value positions and output values are those of its lists, also after a node is
    added (the partitioner asks for them once per candidate cut)."""
    gm = trace_aten(lambda x, g: F.rms_norm(x, (x.shape[-1],), g) * 2, torch.randn(4, 8), torch.randn(8))
    graph = lower(gm)
    assert graph.positions() == {id(n): i for i, n in enumerate(graph.nodes)}
    assert graph.value_positions() == {id(v): i for i, v in enumerate(graph.values())}
    outs = graph.output_values
    outs.clear()                                        # a caller's list: the graph's stays
    assert graph.output_values and all(v in list(graph.values()) for v in graph.output_values)
    last = graph.nodes[-1]
    added = graph.add_node("again", last.op, last.target, last.args, last.kwargs, last.outputs[0].example)
    assert graph.positions()[id(added)] == len(graph.nodes) - 1
    assert graph.value_positions()[id(added.outputs[0])] == len(list(graph.values())) - 1


def test_is_convex_agrees_with_reachability_on_every_small_set():
    """is_convex walks only the nodes between a set's first and last: the answer is the definition's (no node
    outside the set both reachable from it and reaching it) on windows and random subsets of a Llama block."""
    import random

    from torch_mirage.partition.region import is_convex

    cfg = LlamaConfig(dim=32, heads=4, kv_heads=2, hidden=64)
    graph = lower(trace_aten(LlamaBlock(cfg), *llama_inputs(cfg, batch=1, seq=4)))
    nodes = graph.nodes
    reach = {id(n): set() for n in nodes}               # nodes reachable from n (n excluded)
    for n in reversed(nodes):
        for v in n.outputs:
            for u in v.users:
                reach[id(n)] |= {id(u)} | reach[id(u)]

    def convex(subset):
        inside = {id(n) for n in subset}
        below = set().union(*(reach[i] for i in inside)) - inside
        return not any(inside & reach[o] for o in below)
    rng = random.Random(0)
    sets = [nodes[i:i + w] for w in (2, 3, 5, 8) for i in range(0, len(nodes) - w, 3)]
    sets += [sorted(rng.sample(nodes, rng.randint(2, 6)), key=nodes.index) for _ in range(200)]
    assert any(not convex(s) for s in sets) and any(convex(s) for s in sets)
    for s in sets:
        assert is_convex(graph, s) == convex(s), [n.name for n in s]


def _contracted_acyclic(nodes, groups):
    """Reference for ClaimedRegions.admits: the graph with each group contracted to one node has no cycle."""
    owner = {}
    for g, members in enumerate(groups):
        for n in members:
            owner[id(n)] = ("g", g)
    item = lambda n: owner.get(id(n), id(n))    # noqa: E731
    succ = {}
    for n in nodes:
        for v in n.outputs:
            for u in v.users:
                if item(u) != item(n):
                    succ.setdefault(item(n), set()).add(item(u))
    state = {}

    def cyclic(x):
        state[x] = 1
        for y in succ.get(x, ()):
            if state.get(y) == 1 or (y not in state and cyclic(y)):
                return True
        state[x] = 2
        return False
    return not any(x not in state and cyclic(x) for x in {item(n) for n in nodes})


def test_claimed_regions_admit_a_claim_exactly_where_the_contracted_graph_stays_acyclic():
    """Two claims may each be convex and still need each other first (A reads B's value and B reads A's, through
    parts of each that do not depend on one another). ``ClaimedRegions.admits`` answers as the contracted graph
    does, on random convex sets of a Llama block claimed one after another."""
    import random

    from torch_mirage.partition.region import ClaimedRegions, is_convex

    cfg = LlamaConfig(dim=32, heads=4, kv_heads=2, hidden=64)
    graph = lower(trace_aten(LlamaBlock(cfg), *llama_inputs(cfg, batch=1, seq=4)))
    nodes = graph.nodes
    rng = random.Random(1)
    refused = admitted = 0
    for trial in range(60):
        held, groups, free = ClaimedRegions(graph), [], list(nodes)
        for _ in range(8):
            pick = sorted(rng.sample(free, min(len(free), rng.randint(2, 4))), key=nodes.index)
            if not is_convex(graph, pick):
                continue
            want = _contracted_acyclic(nodes, groups + [pick])
            assert held.admits(pick) == want, (trial, [n.name for n in pick])
            if want:
                admitted += 1
                held.add(pick)
                groups.append(pick)
                free = [n for n in free if n not in pick]
            else:
                refused += 1
    assert refused and admitted, (refused, admitted)


def test_a_claim_needing_an_earlier_claim_both_ways_is_passed_over_and_the_program_runs():
    """``a = x*2; b = y*3``, then ``a2 = b*4`` and ``b2 = a+1``: claims {a, a2} and {b, b2} are each convex but each
    reads the other's value. The partition takes the first, passes over the second (NOT_CONVEX, "a cycle with an
    earlier claim") and leaves its nodes to the fallback; the assemble stage then has an order (it raised before)."""
    from torch_mirage.partition.region import Claim, Reason
    from torch_mirage.pipeline import _taken

    def fn(x, y):
        a = x * 2
        b = y * 3
        return a * 5 + (b * 4).sum(), (a + 1) * b

    graph = lower(trace_aten(fn, torch.randn(4, 8), torch.randn(4, 8)))
    by = {n.name: n for n in graph.nodes}
    mul, mul_1 = by["mul"], by["mul_1"]          # a, b
    a2 = next(n for n in graph.nodes if any(v.producer is mul_1 for v in n.inputs) and n.target_name == "aten.mul.Tensor"
              and n is not mul_1)
    b2 = next(n for n in graph.nodes if any(v.producer is mul for v in n.inputs) and n.target_name == "aten.add.Tensor")

    class Take:
        def __init__(self, name, picks):
            self.name, self.picks = name, picks

        def claim(self, graph, free, ctx):
            return [Claim(sorted(p, key=graph.nodes.index), plan=None) for p in self.picks]

    first, second = [mul, a2], [mul_1, b2]
    claimers = [Take("one", [first]), Take("two", [second])]
    regions, passed, _, claimed = _taken(graph, claimers, list(graph.nodes),
                                         lambda i, c, free: list(c.claim(graph, free, None)))
    assert [r.claimer for r in regions] == ["one"]
    assert claimed == {id(n) for n in first}
    assert any(d.reason is Reason.NOT_CONVEX and d.claimer == "two" and "cycle" in d.detail for d in passed), passed
