"""The layout map against real tensors: for chains of layout ops, the base elements a Layout names are the ones
PyTorch's ops put there."""
import math

import torch

from torch_mirage.analysis.layout_map import Layout, apply


def _indices(layout: Layout) -> torch.Tensor:
    """The base's linear index held at each element of a value with ``layout``."""
    idx = torch.zeros(layout.shape, dtype=torch.long)
    for d, modes in enumerate(layout.modes):
        size = math.prod(n for n, _ in modes)
        offs = torch.zeros(size, dtype=torch.long)
        inner = size
        for n, st in modes:                      # row-major: the first mode is the outermost
            inner //= n
            offs += (torch.arange(size) // inner % n) * st
        shape = [1] * len(layout.modes)
        shape[d] = size
        idx = idx + offs.view(shape)
    return idx


def _run(base_shape, ops):
    """(the real tensor after ``ops``, the layout the map computes) for a base of ``base_shape``."""
    t = torch.arange(math.prod(base_shape)).view(base_shape)
    layout = Layout.of_base(base_shape)
    for op, *args in ops:
        t = {"view": lambda a: t.reshape(a[0]), "permute": lambda a: t.permute(*a) if len(a) == 1 else t.transpose(*a),
             "unsqueeze": lambda a: t.unsqueeze(a[0]), "squeeze": lambda a: t.squeeze(*a),
             "expand": lambda a: t.expand(a[0]), "copy": lambda a: t.clone()}[op](args)
        layout = apply(layout, op, [None, *args])
    return t, layout


def test_chains_name_the_elements_pytorch_puts_there():
    b, hk, g, s, d = 2, 3, 4, 5, 6
    chains = {
        "repeat_kv then fold heads and transpose": ((b, hk, s, d), [
            ("unsqueeze", 2), ("expand", (b, hk, g, s, d)), ("copy",), ("view", (b * hk * g, s, d)),
            ("permute", (0, 2, 1))]),
        "einsum's 5-D detour": ((b, hk, s, d), [
            ("unsqueeze", 4), ("permute", (0, 1, 2, 4, 3)), ("permute", (0, 1, 2, 4, 3)), ("view", (b * hk, s, d))]),
        "transpose of a projection, then fold": ((b, s, hk * d), [
            ("view", (b, s, hk, d)), ("permute", (0, 2, 1, 3)), ("copy",), ("view", (b * hk, s, d))]),
        "split a dim, squeeze, -1": ((b * hk, 1, s * d), [("squeeze", 1), ("view", (b, hk, s, -1))]),
        "transpose.int": ((b, hk, s, d), [("permute", 2, 3)]),
    }
    for name, (shape, ops) in chains.items():
        t, layout = _run(shape, ops)
        assert layout is not None, name
        assert torch.equal(_indices(layout), t), name


def test_equal_layouts_for_two_spellings_and_not_for_a_transpose():
    b, h, s, d = 2, 3, 4, 5
    _, folded = _run((b, h, s, d), [("view", (b * h, s, d))])
    _, einsum = _run((b, h, s, d), [("unsqueeze", 4), ("permute", (0, 1, 2, 4, 3)), ("permute", (0, 1, 2, 4, 3)),
                                    ("view", (b * h, s, d))])
    assert folded.same_as(einsum)
    _, wrong = _run((b, h, d, s), [("view", (b * h, d, s)), ("permute", (0, 2, 1))])   # same shape, other data
    assert wrong.shape == folded.shape and not folded.same_as(wrong)


def test_a_view_across_a_repeat_at_a_size_that_splits_no_mode_is_refused():
    _, layout = _run((2, 3, 5), [("unsqueeze", 1), ("expand", (2, 4, 3, 5)), ("view", (8, 15))])
    assert layout is not None and layout.shape == (8, 15)
    assert layout.view((6, 4, 5)) is None        # 8 = (2, 4 of stride 0) cannot split at 6
