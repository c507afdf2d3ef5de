"""Tiny models written for the backend tests: the shapes of real ones, random weights."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, n, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Learned positions from arange, LayerNorm, GELU MLP, tied LM head, causal SDPA. With ``regions``, each
    block runs through one ``torch.compiler.nested_compile_region`` (Dynamo's ``invoke_subgraph``)."""

    def __init__(self, vocab=61, dim=32, heads=4, layers=2, max_len=128, regions=False):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(GPTBlock(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.regions = regions

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(pos)
        for block in self.blocks:
            x = _in_a_region(block, x) if self.regions else block(x)
        return self.ln(x) @ self.wte.weight.T


@torch.compiler.nested_compile_region
def _in_a_region(block, x):
    return block(x)


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaBlock(nn.Module):
    def __init__(self, dim, heads, kv_heads, repeat_kv=False):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.repeat_kv = heads, kv_heads, dim // heads, repeat_kv
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.gate, self.up = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, 3 * dim, bias=False)
        self.down = nn.Linear(3 * dim, dim, bias=False)

    def forward(self, x, cos, sin):
        b, n, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(b, n, 2 * self.kv_heads, self.head_dim).transpose(1, 2).chunk(2, dim=1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if self.repeat_kv:  # Hugging Face's repeat_kv: K/V heads repeated before attention
            groups = self.heads // self.kv_heads
            k, v = (
                t[:, :, None]
                .expand(b, self.kv_heads, groups, n, self.head_dim)
                .reshape(b, self.heads, n, self.head_dim)
                for t in (k, v)
            )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=not self.repeat_kv)
        x = x + self.o(y.transpose(1, 2).reshape(b, n, -1))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """RoPE from arange positions, GQA through enable_gqa (or K/V heads repeated first), RMSNorm, SwiGLU."""

    def __init__(self, vocab=61, dim=32, heads=4, kv_heads=2, layers=2, repeat_kv=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(LlamaBlock(dim, heads, kv_heads, repeat_kv) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        head_dim = dim // heads
        self.register_buffer(
            "inv_freq", 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim), persistent=False
        )

    def forward(self, ids):
        return self.head(self.hidden(ids))

    def hidden(self, ids):
        """The last hidden states (normed), before the head."""
        pos = torch.arange(ids.shape[1], device=ids.device)
        freqs = pos[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


class HandWritten(nn.Module):
    """Attention written out: softmax(q kᵀ / sqrt(d) masked by an arange comparison) v. Given document
    ids ``doc [B, N]`` (packed sequences), keys of other documents are masked out too. ``fill``: the value
    ``masked_fill`` gives hidden scores."""

    def __init__(self, vocab=61, dim=32, heads=2, fill=float("-inf")):
        super().__init__()
        self.heads, self.fill = heads, fill
        self.embed, self.qkv, self.out = nn.Embedding(vocab, dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, vocab)

    def forward(self, ids, doc=None):
        b, n = ids.shape
        x = self.embed(ids)
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        idx = torch.arange(n, device=ids.device)
        blocked = idx[None, :] > idx[:, None]
        if doc is not None:
            blocked = blocked | (doc[:, :, None] != doc[:, None, :])[:, None]
        scores = scores.masked_fill(blocked, self.fill)
        y = torch.softmax(scores, dim=-1) @ v
        return self.out(x + y.transpose(1, 2).reshape(b, n, -1))


class LearnedBias(nn.Module):
    """Attention written out with learned score biases, both trained through the ring: a T5-style table of
    relative-position buckets per head (``table[bucket(k - q)]``, ``permute``d to heads first) plus learned
    per-head slopes times the distance (ALiBi with trainable slopes). Causal, or bidirectional with an additive
    padding mask from ``keep [B, N]`` (``finfo.min`` on hidden keys, as Hugging Face adds it)."""

    def __init__(self, vocab=61, dim=32, heads=4, buckets=8, causal=True):
        super().__init__()
        self.heads, self.buckets, self.causal = heads, buckets, causal
        self.embed, self.qkv, self.out = nn.Embedding(vocab, dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, vocab)
        self.table = nn.Embedding(buckets, heads)
        self.slopes = nn.Parameter(torch.linspace(-0.5, -0.05, heads))

    def forward(self, ids, keep=None):
        b, n = ids.shape
        x = self.embed(ids)
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        idx = torch.arange(n, device=ids.device)
        distance = idx[None, :] - idx[:, None]
        half = self.buckets // 2
        bias = self.table(distance.clamp(-half, half - 1) + half).permute(2, 0, 1).unsqueeze(0)
        bias = bias + self.slopes[:, None, None] * distance.abs().to(x.dtype)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1]) + bias
        if self.causal:
            scores = scores.masked_fill(distance > 0, float("-inf"))
        if keep is not None:
            scores = scores + (1.0 - keep[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        y = torch.softmax(scores, dim=-1) @ v
        return self.out(x + y.transpose(1, 2).reshape(b, n, -1))


class SquareBias(nn.Module):
    """Causal attention written out with a learned ``[H, L, L]`` bias table sliced to the sequence: an S x S
    bias, which the ring evaluates per tile only with ``masks="materialize"`` (every rank holds it whole) and
    trains through its tiles."""

    def __init__(self, vocab=61, dim=32, heads=4, longest=64):
        super().__init__()
        self.heads = heads
        self.embed, self.qkv, self.out = nn.Embedding(vocab, dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, vocab)
        self.table = nn.Parameter(0.1 * torch.randn(heads, longest, longest))

    def forward(self, ids):
        b, n = ids.shape
        x = self.embed(ids)
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        idx = torch.arange(n, device=ids.device)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1]) + self.table[:, :n, :n]
        scores = scores.masked_fill(idx[None, :] > idx[:, None], float("-inf"))
        y = torch.softmax(scores, dim=-1) @ v
        return self.out(x + y.transpose(1, 2).reshape(b, n, -1))


class EncoderBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj, self.norm = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim))

    def forward(self, x, mask=None):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        x = self.norm(x + self.proj(y.transpose(1, 2).flatten(2)))
        return x + self.mlp(x)


class Encoder(nn.Module):
    """Bidirectional (no mask, so the contiguous layout); also a mean over tokens as a pooled output.
    Given ``keep [B, N]`` (a padding mask), padded keys are masked out; given ``mask [B, 1, N, N]``, that."""

    def __init__(self, dim=32, heads=4, layers=2):
        super().__init__()
        self.blocks = nn.ModuleList(EncoderBlock(dim, heads) for _ in range(layers))

    def forward(self, x, keep=None, mask=None):
        if keep is not None:
            mask = keep[:, None, None, :]
        for block in self.blocks:
            x = block(x, mask)
        return x, x.mean(dim=1)


class TorchLayers(nn.Module):
    """PyTorch's own attention modules: ``nn.MultiheadAttention`` under a causal mask (a ``triu(-inf)``
    buffer-free mask from ``generate_square_subsequent_mask``) and an ``nn.TransformerEncoderLayer`` with a
    key padding mask from ``keep [B, N]``."""

    def __init__(self, vocab=61, dim=32, heads=4):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True)

    def forward(self, ids, keep):
        x = self.embed(ids)
        causal = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device, dtype=x.dtype)
        x = x + self.attn(x, x, x, attn_mask=causal, is_causal=True)[0]
        return self.head(self.layer(x, src_key_padding_mask=~keep))


class WithLoss(nn.Module):
    """A language model that computes its loss (HF-style label shift, ignore_index) inside forward."""

    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, ids, labels):
        logits = self.body(ids)
        labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        return loss, logits


class ShiftedHead(nn.Module):
    """A language model that scores the hidden states shifted by one against the next tokens, flattened, with the
    head tied to the embedding (TRL's fused LM head, spelled out): ops after the last attention that mix tokens."""

    def __init__(self, body: Llama):
        super().__init__()
        self.body = body
        body.head.requires_grad_(False)  # unused (DDP would wait for its gradient)

    def forward(self, ids, labels):
        hidden = self.body.hidden(ids)[:, :-1]
        logits = hidden.reshape(-1, hidden.shape[-1]) @ self.body.embed.weight.T
        targets = labels[:, 1:].reshape(-1)
        return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum") / (targets != -100).sum()


class Spellings(nn.Module):
    """Single-head causal attention in another spelling, chosen by name (see SPELLINGS)."""

    def __init__(self, spelling: str, vocab=61, dim=16):
        super().__init__()
        self.spelling = spelling
        self.embed, self.qkv, self.out = nn.Embedding(vocab, dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, vocab)
        self.register_buffer("causal", torch.tril(torch.ones(64, 64, dtype=torch.bool)))

    def forward(self, ids):
        n = ids.shape[1]
        x = self.embed(ids)
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # single head: [B, N, D]
        s = self.spelling
        if s == "bmm_mT_tril_buffer_where":
            scores = torch.bmm(q, k.mT) * q.shape[-1] ** -0.5
            scores = torch.where(self.causal[:n, :n], scores, float("-inf"))
            probs = F.softmax(scores, dim=-1)
        elif s == "matmul_permute_additive_method_softmax":
            q4, k4, v = q[:, None], k[:, None], v[:, None]
            bias = torch.full((n, n), float("-inf")).triu(1)
            scores = q4 @ k4.permute(0, 1, 3, 2) / q.shape[-1] ** 0.5 + bias
            probs = scores.softmax(-1)
        elif s == "einsum_scale_on_q":
            scores = torch.einsum("bqd,bkd->bqk", q * q.shape[-1] ** -0.5, k)
            probs = torch.softmax(scores.masked_fill(~self.causal[:n, :n], float("-inf")), dim=-1)
            return self.out(x + torch.einsum("bqk,bkd->bqd", probs, v))
        elif s == "sdpa_all_keywords":
            y = F.scaled_dot_product_attention(
                query=q[:, None],
                key=k[:, None],
                value=v[:, None],
                attn_mask=None,
                dropout_p=0.0,
                is_causal=True,
                scale=0.3,
            )
            return self.out(x + y[:, 0])
        elif s == "scale_outside_bias_and_mask":  # CodeGen: (q kᵀ + bias + mask) / s scales the bias too
            idx = torch.arange(n, device=ids.device)
            distance = (idx[None, :] - idx[:, None]).float() * 0.3
            mask = torch.zeros(n, n).masked_fill(idx[None, :] > idx[:, None], torch.finfo(torch.float32).min)
            probs = torch.softmax((q @ k.mT + distance + mask) / q.shape[-1] ** 0.5, dim=-1)
        elif s == "nan_to_num_after_softmax":  # the first two keys hidden: queries 0 and 1 see none, NaN -> 0
            idx = torch.arange(n, device=ids.device)
            visible = (idx[None, :] <= idx[:, None]) & (idx[None, :] >= 2)
            probs = torch.softmax((q @ k.mT * 0.25).masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
        else:  # "tril_ones_masked_fill_float32_softmax"
            mask = torch.tril(torch.ones(n, n, device=ids.device))
            scores = (q @ k.transpose(1, 2)) * 0.25
            probs = torch.softmax(scores.masked_fill(mask == 0, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
        y = probs @ v
        return self.out(x + y.reshape(x.shape))


SPELLINGS = (
    "bmm_mT_tril_buffer_where",
    "matmul_permute_additive_method_softmax",
    "tril_ones_masked_fill_float32_softmax",
    "sdpa_all_keywords",
    "einsum_scale_on_q",
    "scale_outside_bias_and_mask",
    "nan_to_num_after_softmax",
)


class PositionTableAndPooling(nn.Module):
    """A learned position table sliced to the length, and a mean over tokens fed back into every token."""

    def __init__(self, vocab=61, dim=32, heads=4, max_len=64):
        super().__init__()
        self.embed, self.block, self.head = nn.Embedding(vocab, dim), GPTBlock(dim, heads), nn.Linear(dim, vocab)
        self.pos = nn.Parameter(torch.randn(1, max_len, dim) * 0.1)

    def forward(self, ids):
        x = self.block(self.embed(ids) + self.pos[:, : ids.shape[1]])
        return self.head(x - x.mean(1, keepdim=True))


class LastTokens(nn.Module):
    """A language model that returns only its last three positions' logits (generate's logits_to_keep)."""

    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, ids):
        return self.body(ids)[:, -3:]


class PackedAttention(nn.Module):
    """Causal attention (SDPA with a boolean mask) inside packed documents, given as ``cu_seqlens`` (flash-style
    varlen: ids by ``searchsorted``), as position ids restarting at each document (``positions``: ids by HF's
    ``cumsum(diff(position_ids) != 1)``), as ``doc [B, N]`` ids (``ids``) with their rows on the batch, or as no model
    means but broadcasting allows: rows on the heads (``rows_on_heads``), a table longer than the row read at its
    positions (``longer_table``)."""

    def __init__(self, given: str):
        super().__init__()
        self.given, self.qkv = given, nn.Linear(16, 48)

    def forward(self, x, packing):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, 8).permute(2, 0, 3, 1, 4)
        pos = torch.arange(n, device=x.device)
        if self.given == "cu_seqlens":
            doc = torch.searchsorted(packing, pos, right=True)
            same = (doc[:, None] == doc[None, :])[None, None]
        elif self.given in ("ids", "positions"):
            doc = packing
            if self.given == "positions":
                doc = (torch.diff(packing, prepend=packing[:, :1] - 1, dim=-1) != 1).cumsum(-1)
            same = (doc[:, :, None] == doc[:, None, :])[:, None]
        elif self.given == "longer_table":  # ids of more tokens than the row, read at its positions
            same = (packing[pos][:, None] == packing[pos][None, :])[None, None]
        else:
            same = packing[None, :, :, None] == packing[None, :, None, :]
        mask = same & (pos[None, :] <= pos[:, None])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, n, 16)
