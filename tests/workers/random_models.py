"""A small generator of random transformer architectures, for fuzzing the ring backend against eager.

`draw(seed)` picks, from one seeded generator: the position scheme (learned table, RoPE from arange,
none), the norm (LayerNorm, RMS written out), the MLP (GELU, SwiGLU), query and key/value heads (GQA by
``enable_gqa`` or by repeating K/V), the attention spelling (SDPA causal, SDPA with a boolean mask from
an arange comparison, written out with ``masked_fill`` and softmax), a key padding mask input, layers
and width, and the output (logits, a token-mean cross-entropy with ignored labels, a sum). `RandomModel`
builds it; every rank that draws the same seed builds the same model.
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn as nn
import torch.nn.functional as F
from models import RMSNorm

VOCAB = 37


def draw(seed: int) -> dict:
    rng = random.Random(seed)
    kv_heads = rng.choice([1, 2])
    return dict(
        positions=rng.choice(["learned", "rope", "none"]),
        norm=rng.choice(["layer", "rms"]),
        mlp=rng.choice(["gelu", "swiglu"]),
        kv_heads=kv_heads,
        heads=kv_heads * rng.choice([1, 2]),
        gqa=rng.choice(["enable_gqa", "repeat"]),
        spelling=rng.choice(["sdpa_causal", "sdpa_mask", "written"]),
        padding=rng.random() < 0.4,
        layers=rng.choice([1, 2]),
        head_dim=rng.choice([4, 8]),
        output=rng.choice(["logits", "loss", "sum"]),
    )


class _Block(nn.Module):
    def __init__(self, spec: dict):
        super().__init__()
        self.spec = spec
        d, hd = spec["heads"] * spec["head_dim"], spec["head_dim"]
        self.q = nn.Linear(d, spec["heads"] * hd)
        self.kv = nn.Linear(d, 2 * spec["kv_heads"] * hd)
        self.o = nn.Linear(spec["heads"] * hd, d)
        norm = (lambda: nn.LayerNorm(d)) if spec["norm"] == "layer" else (lambda: RMSNorm(d))
        self.n1, self.n2 = norm(), norm()
        self.up = nn.Linear(d, 4 * d if spec["mlp"] == "gelu" else 2 * 2 * d)
        self.down = nn.Linear(4 * d if spec["mlp"] == "gelu" else 2 * d, d)

    def forward(self, x, rope, keep):
        s, (b, n, _) = self.spec, x.shape
        h = self.n1(x)
        q = self.q(h).view(b, n, s["heads"], -1).transpose(1, 2)
        k, v = self.kv(h).view(b, n, 2, s["kv_heads"], -1).permute(2, 0, 3, 1, 4)
        if rope is not None:
            cos, sin = rope
            q, k = (
                t * cos + torch.cat((-t[..., t.shape[-1] // 2 :], t[..., : t.shape[-1] // 2]), -1) * sin for t in (q, k)
            )
        y = self._attention(q, k, v, keep)
        x = x + self.o(y.transpose(1, 2).reshape(b, n, -1))
        u = self.up(self.n2(x))
        u = F.gelu(u) if s["mlp"] == "gelu" else F.silu(u.chunk(2, -1)[0]) * u.chunk(2, -1)[1]
        return x + self.down(u)

    def _attention(self, q, k, v, keep):
        s, n = self.spec, q.shape[2]
        repeat = s["gqa"] == "repeat" or s["spelling"] == "written"
        if repeat and s["heads"] != s["kv_heads"]:
            k, v = (t.repeat_interleave(s["heads"] // s["kv_heads"], dim=1) for t in (k, v))
        idx = torch.arange(n, device=q.device)
        visible = idx[None, :] <= idx[:, None]
        if keep is not None:
            visible = visible & keep[:, None, None, :]
        if s["spelling"] == "written":
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
            return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v
        gqa = not repeat and s["heads"] != s["kv_heads"]
        if s["spelling"] == "sdpa_causal" and keep is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=gqa)


class RandomModel(nn.Module):
    def __init__(self, spec: dict):
        super().__init__()
        self.spec = spec
        d = spec["heads"] * spec["head_dim"]
        self.embed = nn.Embedding(VOCAB, d)
        self.table = nn.Embedding(64, d) if spec["positions"] == "learned" else None
        self.blocks = nn.ModuleList(_Block(spec) for _ in range(spec["layers"]))
        self.head = nn.Linear(d, VOCAB)

    def forward(self, ids, labels, keep=None):
        n = ids.shape[1]
        pos = torch.arange(n, device=ids.device)
        x = self.embed(ids) + (self.table(pos) if self.table is not None else 0)
        rope = None
        if self.spec["positions"] == "rope":
            half = self.spec["head_dim"] // 2
            angles = pos[:, None].to(x.dtype) * (10000.0 ** (-torch.arange(half, dtype=x.dtype) / half))
            rope = (torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin())
        for block in self.blocks:
            x = block(x, rope, keep)
        logits = self.head(x)
        if self.spec["output"] == "loss":
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return logits.sum() if self.spec["output"] == "sum" else logits


def inputs(spec: dict, seq_len: int, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, seq_len), generator=gen)
    labels = ids.roll(-1, 1).masked_fill(torch.rand(2, seq_len, generator=gen) < 0.2, -100)
    if not spec["padding"]:
        return ids, labels
    keep = torch.ones(2, seq_len, dtype=torch.bool)
    keep[1, -3:] = False  # row 1 right-padded by three tokens: every query still sees a key
    return ids, labels.masked_fill(~keep, -100), keep
