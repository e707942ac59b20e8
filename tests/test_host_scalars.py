"""Symbolic scalars that only feed host arithmetic (a counter a graph returns plus one, as transformers' sliding-window
caches keep ``cumulative_length_int``) are computed in Python around a static compile of the rest; a scalar that
reaches a tensor keeps the graph symbolic. Eager-equal either way, the counter's state too."""
import torch

import torch_mirage
from helpers import assert_close
from torch_mirage.capture.host_scalars import split_host_scalars


class Counter:
    def __init__(self):
        self.count, self.steps = 0, 10


def host_only(x, state):
    state.count = state.count + 1            # Dynamo: an int input, its new value an output
    state.steps = state.steps - 2
    return torch.softmax(x * 2, -1) + 1, x.sum(-1)


def scalar_reaches_a_tensor(x, state):
    state.count = state.count + 1
    return torch.softmax(x * state.count, -1)


def _run(fn, calls=4):
    report = torch_mirage.Report()
    compiled = torch.compile(fn, backend=torch_mirage.MirageBackend(options={"min_region_us": 0}, report=report))
    mine, theirs = Counter(), Counter()
    for _ in range(calls):
        x = torch.randn(8, 64)
        assert_close(list(compiled(x, mine)), list(fn(x, theirs)), torch.float32)
        assert (mine.count, mine.steps) == (theirs.count, theirs.steps)
    return report


def test_host_only_scalars_leave_a_static_graph_that_mirage_compiles():
    report = _run(host_only)
    assert len(report.graphs) == 2, str(report)       # the first call's static graph, then the one for every count
    first, later = report.graphs
    assert first.host_scalars == () and len(later.host_scalars) == 2, str(report)
    assert "symbolic scalars computed on the host" in str(later)
    assert later.regions and all(r.compiled_by == "mirage" for r in later.regions), str(later)


def test_a_scalar_that_reaches_a_tensor_keeps_the_graph_symbolic():
    report = _run(scalar_reaches_a_tensor)
    assert all(g.host_scalars == () for g in report.graphs), str(report)


def test_split_copies_the_graph_and_puts_each_output_back_in_its_place():
    seen = []

    def capture(gm, example_inputs):
        seen.append((gm, list(example_inputs)))
        return gm.forward

    def mixed(x, state):
        state.count = state.count + 1
        y = x.exp()
        state.steps = state.steps * 3
        return y

    compiled = torch.compile(mixed, backend=capture)
    state = Counter()
    for _ in range(2):
        compiled(torch.randn(3), state)
    gm, inputs = seen[-1]
    before = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    host = split_host_scalars(gm, inputs)
    assert host is not None and len(host.scalar_positions) == 2
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == before      # Dynamo's graph as it was
    static = [n for n in host.static_graph.graph.nodes if n.op == "placeholder"]
    assert len(static) == len(before) - 2
    assert not any(isinstance(x, torch.SymInt) for x in host.static_inputs(inputs))
    args = [7 if isinstance(a, torch.SymInt) else torch.randn(3) for a in inputs]
    got, want = host.around(host.static_graph)(*args), gm(*args)
    assert [type(v) for v in got] == [type(v) for v in want]      # ints where the graph returned ints
    ints = [v for v in got if isinstance(v, int)]
    assert ints == [v for v in want if isinstance(v, int)] and sorted(ints) == [8, 21]   # 7 + 1, 7 * 3
    assert_close([v for v in got if isinstance(v, torch.Tensor)], [v for v in want if isinstance(v, torch.Tensor)],
                 torch.float32)
    assert split_host_scalars(seen[0][0], seen[0][1]) is None          # the first, static graph: nothing to split


def test_training_graph_with_a_host_only_counter_matches_eager_gradients():
    """The split wraps AOTAutograd's compile of the static graph, backward included: gradients equal eager's."""
    def step(x, w, state):
        state.count = state.count + 1
        return (torch.tanh(x @ w) * 0.5).sum()

    report = torch_mirage.Report()
    compiled = torch.compile(step, backend=torch_mirage.MirageBackend(options={"min_region_us": 0}, report=report))
    mine, theirs = Counter(), Counter()
    for _ in range(3):
        x, w = torch.randn(4, 8), torch.randn(8, 5)
        w1, w2 = w.clone().requires_grad_(), w.clone().requires_grad_()
        compiled(x, w1, mine).backward()
        step(x, w2, theirs).backward()
        assert_close([w1.grad], [w2.grad], torch.float32)
    assert mine.count == theirs.count == 3
    assert [g.kind for g in report.graphs if g.host_scalars] == ["forward"], str(report)   # backward: compiled later


def test_a_counter_returned_as_it_is_and_one_returned_twice():
    """Outputs that are the scalar input itself, or one host value in two places, come back where they were."""
    def fn(x, state):
        state.count = state.count + 1
        state.steps = state.count
        return x * 2

    report = torch_mirage.Report()
    compiled = torch.compile(fn, backend=torch_mirage.MirageBackend(options={"min_region_us": 0}, report=report))
    mine, theirs = Counter(), Counter()
    for _ in range(4):
        x = torch.randn(5)
        assert_close([compiled(x, mine)], [fn(x, theirs)], torch.float32)
        assert (mine.count, mine.steps) == (theirs.count, theirs.steps)
    assert any(g.host_scalars for g in report.graphs), str(report)
