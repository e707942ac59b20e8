"""Small reference models written as model authors write them (random weights, nothing downloaded).

Used by the tests, ``python -m torch_mirage demo`` and the benchmarks: an MLP, a CNN, a BERT-style
encoder layer and a Llama-style decoder block (RMSNorm, attention with RoPE and grouped KV heads,
gated SiLU MLP).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..numerics import rms_norm


class MLP(nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 256):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class CNN(nn.Module):
    def __init__(self, channels: int = 8, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv1(x)))
        x = F.relu(self.conv2(x)) + x
        return self.head(x.mean(dim=(2, 3)))


class BertLayer(nn.Module):
    """Post-norm encoder layer: self-attention with an additive padding mask, GELU FFN."""

    def __init__(self, dim: int = 64, heads: int = 4, ffn: int = 256):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.ff1, self.ff2 = nn.Linear(dim, ffn), nn.Linear(ffn, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads) + mask
        ctx = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, s, d)
        x = self.ln1(x + self.out(ctx))
        return self.ln2(x + self.ff2(F.gelu(self.ff1(x), approximate="tanh")))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.eps, self.weight)


def rope_tables(seq: int, head_dim: int, base: float = 10000.0, device=None, dtype=torch.float32):
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


@dataclass
class LlamaConfig:
    dim: int = 64
    heads: int = 4
    kv_heads: int = 2
    hidden: int = 160
    eps: float = 1e-6


class LlamaBlock(nn.Module):
    """Pre-norm decoder block: RMSNorm → causal GQA attention with RoPE → residual → RMSNorm → SwiGLU MLP."""

    def __init__(self, cfg: LlamaConfig = LlamaConfig()):
        super().__init__()
        self.cfg = cfg
        hd = cfg.dim // cfg.heads
        self.attn_norm, self.mlp_norm = RMSNorm(cfg.dim, cfg.eps), RMSNorm(cfg.dim, cfg.eps)
        self.wq = nn.Linear(cfg.dim, cfg.heads * hd, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * hd, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.heads * hd, cfg.dim, bias=False)
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        cfg, hd = self.cfg, self.cfg.dim // self.cfg.heads
        h = self.attn_norm(x)
        q = self.wq(h).view(b, s, cfg.heads, hd).transpose(1, 2)
        k = self.wk(h).view(b, s, cfg.kv_heads, hd).transpose(1, 2)
        v = self.wv(h).view(b, s, cfg.kv_heads, hd).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        rep = cfg.heads // cfg.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        attn = torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v
        x = x + self.wo(attn.transpose(1, 2).reshape(b, s, cfg.heads * hd))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def llama_inputs(cfg: LlamaConfig, batch: int, seq: int, device=None, dtype=torch.float32):
    x = torch.randn(batch, seq, cfg.dim, device=device, dtype=dtype)
    cos, sin = rope_tables(seq, cfg.dim // cfg.heads, device=device, dtype=dtype)
    return x, cos, sin


def bert_inputs(dim: int, batch: int, seq: int, device=None, dtype=torch.float32):
    x = torch.randn(batch, seq, dim, device=device, dtype=dtype)
    mask = torch.zeros(batch, 1, 1, seq, device=device, dtype=dtype)
    mask[:, :, :, seq - max(1, seq // 4):] = float("-inf")   # padding at the end of every row
    return x, mask
