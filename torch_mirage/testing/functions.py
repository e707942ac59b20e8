"""Memory-bound building blocks written as model authors write them (tests and GPU check scripts share them)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..numerics import rms_norm


def softmax(x):
    return torch.softmax(x, -1)


def layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b)


def rmsnorm(x, w):
    return rms_norm(x, 1e-6, w)


def bias_gelu(x, bias):
    return F.gelu(x + bias, approximate="tanh")


def bias_residual_layernorm(x, bias, r, w, b):
    return F.layer_norm(x + bias + r, (x.shape[-1],), w, b)


def bert_softmax(s, mask):
    return torch.softmax(s + mask, -1)


def padding_mask(batch: int, n: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """Additive padding mask (b,1,1,n): zeros, -inf over the last quarter of every row (none when n == 1)."""
    m = torch.zeros(batch, 1, 1, n, dtype=dtype, device=device)
    if n > 1:
        m[..., n - max(1, n // 4):] = float("-inf")
    return m
