"""Factories for `ringpass inspect` tests: each returns (model, example_inputs), as a user's would. The
file is written as users write theirs (postponed annotations, a dataclass), since inspect loads it by path."""

from __future__ import annotations

from dataclasses import dataclass

import models
import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Shape:
    seq_len: int
    batch: int


def llama(seq_len: int = 64, batch: int = 2):
    """The test Llama (RoPE from arange, GQA 4 query / 2 KV heads, head dim 8), fp32, on the CPU."""
    torch.manual_seed(0)
    shape = Shape(seq_len, batch)
    return models.Llama(), (torch.randint(0, 61, (shape.batch, shape.seq_len)),)


def llama_with_loss(seq_len: int = 64, batch: int = 2):
    """The same model with a cross-entropy loss inside forward, inputs by keyword (ids and labels)."""
    torch.manual_seed(0)
    ids = torch.randint(0, 61, (batch, seq_len))
    return models.WithLoss(models.Llama()), {"ids": ids, "labels": ids.roll(-1, 1)}


class CumprodAfterAttention(nn.Module):
    """A running product over the tokens of the attention's output: the ring backend must refuse it."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        q = self.proj(x).view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(x.shape)
        return self.proj(y).cumprod(dim=1)  # the blocking op (a cumsum passes state: not refused)


def refused(seq_len: int = 16):
    return CumprodAfterAttention(), (torch.randn(1, seq_len, 8),)


def conv_mixers(seq_len: int = 32):
    """Causal depthwise convolutions and cumsums between attentions (`mixer_workers.ConvNet`): sequence mixers."""
    import mixer_workers

    return mixer_workers.ConvNet(29, 8, 4, attention=True), (torch.randint(0, 29, (2, seq_len)),)


def no_attention():
    return nn.Sequential(nn.Linear(8, 8), nn.GELU()), (torch.randn(1, 16, 8),)


def not_a_pair():
    return nn.Linear(8, 8)


class GraphBreak(nn.Module):
    """Two GPT blocks with a graph break between them: Dynamo captures two graphs."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(61, 32)
        self.first, self.second = models.GPTBlock(32, 4), models.GPTBlock(32, 4)

    def forward(self, ids):
        x = self.first(self.embed(ids))
        torch._dynamo.graph_break()
        return self.second(x)


def graph_break(seq_len: int = 32):
    return GraphBreak(), (torch.randint(0, 61, (1, seq_len)),)


class AttentionOut(nn.Module):
    """Returns the attention's output itself, and keeps a plain (unregistered) tensor attribute."""

    def __init__(me):  # the first argument need not be called self
        super().__init__()
        me.proj = nn.Linear(8, 24)
        me.gain = torch.ones(8)  # not a buffer: a plain attribute

    def forward(me, x):
        q, k, v = (t.view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2) for t in me.proj(x * me.gain).split(8, -1))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def attention_out(seq_len: int = 16):
    return AttentionOut(), (torch.randn(2, seq_len, 8),)


class SoftCappedScores(nn.Module):
    """Written-out attention whose scores are soft-capped (Gemma 2: ``tanh(scores / c) * c``), with a
    distance bias added before the cap (``under_cap``: no form the kernels compute) or after it, or a
    learned ``[S, S]`` bias table (``table``)."""

    def __init__(self, bias: str):
        super().__init__()
        self.bias = bias
        self.proj = nn.Linear(8, 24)
        self.table = nn.Parameter(torch.randn(64, 64))

    def forward(self, x):
        q, k, v = (t.view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2) for t in self.proj(x).split(8, -1))
        pos = torch.arange(x.shape[1], device=x.device)
        distance = -(pos[:, None] - pos[None, :]).abs().float()
        if self.bias == "under_cap":
            scores = torch.tanh((q @ k.transpose(-1, -2) * 0.5 + distance) / 30.0) * 30.0
        elif self.bias == "table":
            scores = torch.tanh(q @ k.transpose(-1, -2) * 0.5 / 30.0) * 30.0 + self.table[: x.shape[1], : x.shape[1]]
        else:
            scores = torch.tanh(q @ k.transpose(-1, -2) * 0.5 / 30.0) * 30.0 + distance
        return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(x.shape)


def soft_capped_scores(seq_len: int = 16, bias: str = "after_cap"):
    return SoftCappedScores(bias), (torch.randn(1, seq_len, 8),)


def bias_under_the_cap(seq_len: int = 16):
    return soft_capped_scores(seq_len, "under_cap")


def learned_bias_table(seq_len: int = 16):
    return soft_capped_scores(seq_len, "table")


class SortedExperts(nn.Module):
    """Attention, then a mixture of experts written out: tokens sorted by their expert, each row multiplied
    by its expert's weights, order restored by the inverse permutation. ``leak``: the sorted rows are also
    added to the restored ones (token order meets sorted order: not token-local)."""

    def __init__(self, leak: bool):
        super().__init__()
        self.leak = leak
        self.proj, self.router = nn.Linear(8, 24), nn.Linear(8, 3)
        self.experts = nn.Parameter(torch.randn(3, 8, 8))

    def forward(self, x):
        q, k, v = (t.view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2) for t in self.proj(x).split(8, -1))
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(-1, 8)
        expert_ids, perm = torch.sort(self.router(h).argmax(-1))
        rows = h[perm]
        out = (rows.unsqueeze(1) @ self.experts[expert_ids]).squeeze(1)[torch.argsort(perm)]
        return (out + rows if self.leak else out).view(x.shape)


def sorted_experts(seq_len: int = 16):
    return SortedExperts(False), (torch.randn(2, seq_len, 8),)


def sorted_rows_leak(seq_len: int = 16):
    return SortedExperts(True), (torch.randn(2, seq_len, 8),)


class DropoutAround(nn.Module):
    """Dropout (p=0.1, training) on written-out attention probabilities, or only on an MLP's input."""

    def __init__(self, in_attention: bool):
        super().__init__()
        self.in_attention = in_attention
        self.proj, self.mlp = nn.Linear(8, 24), nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        q, k, v = (t.view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2) for t in self.proj(x).split(8, -1))
        probs = torch.softmax(q @ k.transpose(-1, -2) * 0.5, dim=-1).to(x.dtype)
        y = (
            ((F.dropout(probs, 0.1, training=True) if self.in_attention else probs) @ v)
            .transpose(1, 2)
            .reshape(x.shape)
        )
        return F.dropout(y, 0.1, training=True) @ self.mlp


def dropout_in_attention(seq_len: int = 16):
    return DropoutAround(True), (torch.randn(1, seq_len, 8),)


def dropout_in_mlp(seq_len: int = 16):
    return DropoutAround(False), (torch.randn(1, seq_len, 8),)


class MaskBeforeABreak(nn.Module):
    """Builds a 4-D padding mask, breaks the graph (as a data-dependent expert loop would), then attends."""

    def __init__(self):
        super().__init__()
        self.embed, self.block = nn.Embedding(61, 32), models.EncoderBlock(32, 4)

    def forward(self, ids, keep):
        idx = torch.arange(ids.shape[1], device=ids.device)
        mask = (idx[None, :] <= idx[:, None])[None, None] & keep[:, None, None, :].bool()
        x = self.embed(ids)
        torch._dynamo.graph_break()
        return self.block(x, mask)


def mask_before_a_break(seq_len: int = 16):
    return MaskBeforeABreak(), (torch.randint(0, 61, (2, seq_len)), torch.ones(2, seq_len, dtype=torch.long))


class MaskGivenWhole(nn.Module):
    """Takes its attention mask as a ``[B, 1, S, S]`` input, made whole by the caller."""

    def __init__(self):
        super().__init__()
        self.embed, self.block = nn.Embedding(61, 32), models.EncoderBlock(32, 4)

    def forward(self, ids, mask):
        return self.block(self.embed(ids), mask)


def mask_given_whole(seq_len: int = 16):
    return MaskGivenWhole(), (torch.randint(0, 61, (2, seq_len)), torch.ones(2, 1, seq_len, seq_len, dtype=torch.bool))


class AttentionInACond(nn.Module):
    """Attention inside one branch of ``torch.cond``: a higher-order op the ring does not open."""

    def __init__(self):
        super().__init__()
        self.embed, self.block = nn.Embedding(61, 32), models.GPTBlock(32, 4)

    def forward(self, ids, flag):
        x = self.embed(ids)
        return torch.cond(flag.sum() > 0, lambda t: self.block(t), lambda t: t.clone(), (x,))


def attention_in_a_cond(seq_len: int = 16):
    return AttentionInACond(), (torch.randint(0, 61, (2, seq_len)), torch.ones(2))


class CappedWithoutMask(nn.Module):
    """Soft-capped scores with no mask at all: ``softmax(tanh(s / c) · c)`` (the cap's factor is no outer scale)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = (t.view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2) for t in self.proj(x).split(8, -1))
        scores = torch.tanh(q @ k.transpose(-1, -2) * 0.5 / 3.0) * 3.0
        return torch.softmax(scores, dim=-1) @ v


def capped_without_mask(seq_len: int = 16):
    return CappedWithoutMask(), (torch.randn(2, seq_len, 8),)


class EinsumWithHeadsLast(nn.Module):
    """Funnel's layout: values [B, S, H, D], ``einsum("bnij,bjnd->bind", probs, v)``: attention the pass does
    not read (the operands' leading dims differ), so it must be refused, not run unsharded."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = (t.view(x.shape[0], x.shape[1], 2, 4) for t in self.proj(x).split(8, -1))
        scores = torch.einsum("bind,bjnd->bnij", q, k)
        return torch.einsum("bnij,bjnd->bind", torch.softmax(scores, dim=-1), v)


def einsum_with_heads_last(seq_len: int = 16):
    return EinsumWithHeadsLast(), (torch.randn(2, seq_len, 8),)


class ScoresCopiedFirst(nn.Module):
    """Longformer's way: scores computed, written into a new tensor, softmaxed; the probabilities leave the
    graph (a graph break would split them from the values)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 16)

    def forward(self, x):
        q, k = (t.view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2) for t in self.proj(x).split(8, -1))
        scores = q.new_zeros(x.shape[0], 2, x.shape[1], x.shape[1])
        scores[:, :, :, :] = q @ k.transpose(-1, -2)
        return torch.softmax(scores, dim=-1)


def scores_copied_first(seq_len: int = 16):
    return ScoresCopiedFirst(), (torch.randn(2, seq_len, 8),)


class SlicedTypeIds(nn.Module):
    """BigBird's token types: a buffer sliced to the length and expanded over the batch, then embedded."""

    def __init__(self):
        super().__init__()
        self.register_buffer("token_type_ids", torch.zeros(1, 64, dtype=torch.long), persistent=False)
        self.embed, self.types, self.block = nn.Embedding(61, 32), nn.Embedding(2, 32), models.EncoderBlock(32, 4)

    def forward(self, ids):
        types = self.token_type_ids[:, : ids.shape[1]].expand(ids.shape[0], ids.shape[1])
        return self.block(self.embed(ids) + self.types(types))


def sliced_type_ids(seq_len: int = 16):
    return SlicedTypeIds(), (torch.randint(0, 61, (2, seq_len)),)


def llama_config_file(folder, **overrides) -> str:
    """A small Llama config (8k positions) saved in ``folder``: the path of its config.json."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=8192,
        **overrides,
    )
    config.save_pretrained(folder)
    return str(folder / "config.json")
