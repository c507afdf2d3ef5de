"""What the sequence-mixer tests run on each rank: `lowering.sequence_mixers`' ops against the unsharded op,
`lowering.head_exchange`'s against slices of the whole tensor, and models
whose sequence mixers are causal convolutions and cumulative sums, through the ring backend, against the model run
whole (`tests/distributed/test_sequence_mixers.py`)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from reference import recurrent_gated_delta_rule, recurrent_ssd, rel_err

import lowering
import ringpass
from lowering import Layout, record_ring_events
from lowering.head_exchange import heads_to_sequence, own_heads, sequence_to_heads
from lowering.state_passing import gated_delta_rule, sharded_scan, ssd


def runtime_case(rank: int, world_size: int, case: dict) -> dict:
    """One drawn case of `sharded_conv1d` and `sharded_cumsum`: the largest relative error of this rank's output and of
    the input's, weight's and bias's gradients (gathered, summed over the ranks) against the unsharded ops, in the
    case's dtype; and how many summary exchanges ran."""
    dtype = getattr(torch, case["dtype"])
    gen = torch.Generator().manual_seed(case["seed"])
    b, c, n, k = case["batch"], case["channels"], case["seq_len"], case["width"]
    x = torch.randn(b, c, n, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    weight = torch.randn(c, 1, k, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    bias = torch.randn(c, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() if case["bias"] else None
    grad = torch.randn(b, c, n, generator=gen, dtype=torch.float64).to(dtype)
    layout = Layout(case["layout"], world_size, n)
    trained = [t for t in (x, weight, bias) if t is not None]

    conv = F.conv1d(x, weight, bias, padding=k - 1, groups=c)[..., :n]
    expected = [conv, *torch.autograd.grad(conv, trained, grad)]
    cumsum = x.transpose(1, 2).cumsum(1)  # [B, N, C]: the sequence in dim 1 this time
    expected += [cumsum, *torch.autograd.grad(cumsum, x, grad.transpose(1, 2))]

    local = layout.shard(x.detach(), 2, rank).requires_grad_()
    with record_ring_events() as events:
        conv = lowering.sharded_conv1d(local, weight, bias, layout=layout)
        got = [_gather(conv, layout, 2)]
        grads = torch.autograd.grad(conv, [local, *trained[1:]], layout.shard(grad, 2, rank))
        got += [_gather(grads[0], layout, 2), *[_summed(g) for g in grads[1:]]]
        local_t = layout.shard(x.detach().transpose(1, 2), 1, rank).requires_grad_()
        cumsum = lowering.sharded_cumsum(local_t, 1, layout=layout)
        (d_local,) = torch.autograd.grad(cumsum, local_t, layout.shard(grad.transpose(1, 2), 1, rank))
        got += [_gather(cumsum, layout, 1), _gather(d_local.transpose(1, 2), layout, 2)]
    return {
        "errors": [rel_err(g, e) for g, e in zip(got, expected)],
        "exchanges": sum(e.kind == "mixer_exchange" for e in events),
        "local_len": conv.shape[-1],
    }


def head_exchange_case(rank: int, world_size: int, case: dict) -> dict:
    """One drawn case of `lowering.head_exchange`: a whole tensor with a sequence dim and a head dim (anywhere), this
    rank's shard of it exchanged for every token of its heads and back, and a per-head weight narrowed to them; each
    result and gradient against slices of the whole tensors (a move of data: exact). Returns the largest absolute
    error and the all-to-alls counted."""
    gen = torch.Generator().manual_seed(case["seed"])
    shape, seq_dim, head_dim = list(case["shape"]), case["seq_dim"], case["head_dim"]
    n, heads = shape[seq_dim], shape[head_dim]
    share, group = heads // world_size, dist.group.WORLD.group_name
    layout = Layout(case["layout"], world_size, n)
    whole = torch.randn(shape, generator=gen, dtype=torch.float64)
    upstream = torch.randn(shape, generator=gen, dtype=torch.float64)  # the same on every rank
    weight = torch.randn(heads, 3, generator=gen, dtype=torch.float64).requires_grad_()
    mine = slice(rank * share, (rank + 1) * share)
    args = (seq_dim, head_dim, layout.kind, world_size, n, group)
    local = layout.shard(whole, seq_dim, rank).requires_grad_()
    with record_ring_events() as events:
        heads_of_mine = sequence_to_heads(local, *args)
        back = heads_to_sequence(heads_of_mine, *args)
        (d_local,) = torch.autograd.grad(heads_of_mine, local, upstream.narrow(head_dim, mine.start, share))
        (d_heads,) = torch.autograd.grad(back, heads_of_mine, layout.shard(upstream, seq_dim, rank))
    narrowed = own_heads(weight, 0, world_size, group)
    (d_weight,) = torch.autograd.grad(narrowed, weight, torch.ones_like(narrowed))
    errors = [
        heads_of_mine - whole.narrow(head_dim, mine.start, share),  # every token of this rank's heads
        back - local,  # and back to this rank's slots (zero at padding)
        d_local - layout.shard(upstream, seq_dim, rank),  # every rank's heads' gradient of this rank's tokens
        d_heads - upstream.narrow(head_dim, mine.start, share),
        narrowed - weight[mine],
        d_weight - torch.zeros(heads, 3, dtype=torch.float64).index_fill(0, torch.arange(heads)[mine], 1.0),
    ]
    return {
        "error": max(e.abs().max().item() for e in errors),
        "exchanges": sum(e.kind == "heads_exchange" for e in events),
    }


def state_passing_case(rank: int, world_size: int, case: dict) -> dict:
    """One drawn case of `lowering.state_passing.sharded_scan`: a delta rule or an SSD scan (the token-by-token
    reference in fp64, or Hugging Face's chunked function in fp32) on this rank's chunks, against the same function on
    the whole sequence: the relative error of the output and of every input's and weight's gradient, by name (tokens
    gathered, weights summed over the ranks), the summaries exchanged and their bytes, and the local length."""
    gen = torch.Generator().manual_seed(case["seed"])
    b, n, h = case["batch"], case["seq_len"], case["heads"]
    hugging_face, dtype = case["function"] == "hugging face", getattr(torch, case["dtype"])

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    def rand(*shape):
        return torch.rand(shape, generator=gen, dtype=torch.float64).to(dtype)

    if case["scan"] == "delta rule":
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

        dk, dv = case["dims"]
        tokens = dict(query=randn(b, n, h, dk), key=randn(b, n, h, dk), value=randn(b, n, h, dv))
        tokens.update(g=-rand(b, n, h), beta=rand(b, n, h))
        weights = {}
        function = torch_chunk_gated_delta_rule if hugging_face else recurrent_gated_delta_rule
        constants = dict(chunk_size=case["function_chunk"], use_qk_l2norm_in_kernel=case["flag"])
        scan = gated_delta_rule(function, **constants)

        def whole(tokens, weights):
            return function(**tokens, **constants)[0]

    else:
        from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

        head_dim, state_size = case["dims"]
        groups = case["groups"]
        tokens = dict(hidden_states=randn(b, n, h, head_dim), dt=randn(b, n, h))
        tokens.update(B=randn(b, n, groups, state_size), C=randn(b, n, groups, state_size))
        weights = dict(A=-rand(h), D=randn(h), dt_bias=randn(h, scale=0.5))
        function = mamba2_chunk_scan if hugging_face else recurrent_ssd
        constants = dict(chunk_size=case["function_chunk"], dt_softplus=case["flag"], dt_limit=(0.0, float("inf")))
        scan = ssd(function, **constants)

        def whole(tokens, weights):
            return function(**tokens, **weights, **constants)

    tokens = {name: t.requires_grad_() for name, t in tokens.items()}
    weights = {name: w.requires_grad_() for name, w in weights.items()}
    expected = whole(tokens, weights)
    grad = randn(*expected.shape)
    expected_grads = torch.autograd.grad(expected, [*tokens.values(), *weights.values()], grad)
    layout = Layout(case["layout"], world_size, n)
    local = {name: layout.shard(t.detach(), 1, rank).requires_grad_() for name, t in tokens.items()}
    with record_ring_events() as events:
        out = sharded_scan(scan, local, weights, layout=layout)
        grads = torch.autograd.grad(out, [*local.values(), *weights.values()], layout.shard(grad, 1, rank))
    got = [_gather(g, layout, 1) for g in grads[: len(local)]] + [_summed(g) for g in grads[len(local) :]]
    exchanges = [e for e in events if e.kind == "mixer_exchange"]
    return {
        "errors": {
            "output": rel_err(_gather(out, layout, 1), expected),
            **{f"d_{name}": rel_err(g, e) for name, g, e in zip([*tokens, *weights], got, expected_grads)},
        },
        "exchanges": len(exchanges),
        "bytes": sum(e.fields["bytes"] for e in exchanges),
        "local_len": out.shape[1],
        "chunks": len(layout.chunks(rank)),
        "expected_local_len": layout.chunk_len * len(layout.chunks(rank)),
    }


def _gather(x: torch.Tensor, layout: Layout, dim: int) -> torch.Tensor:
    shards = [torch.empty_like(x) for _ in range(layout.world_size)]
    dist.all_gather(shards, x.detach().contiguous())
    return layout.unshard(shards, dim)


def _summed(x: torch.Tensor) -> torch.Tensor:
    total = x.detach().clone()
    dist.all_reduce(total)
    return total


def chunked_decay_scan(x: torch.Tensor, log_decay: torch.Tensor, chunk: int) -> torch.Tensor:
    """``y_t = exp(a_t) y_(t-1) + x_t`` along the sequence of ``x [B, N, H, D]`` with ``a = log_decay [B, N, H]``,
    per head, spelled as Mamba2's SSD spells its scan: padded to whole chunks, each chunk computed at once from its
    decays' cumsum, a state carried from chunk to chunk (a loop Dynamo unrolls)."""
    b, n, h, d = x.shape
    pad = (chunk - n % chunk) % chunk
    x = F.pad(x, (0, 0, 0, 0, 0, pad)).reshape(b, -1, chunk, h, d)
    cum = F.pad(log_decay, (0, 0, 0, pad)).reshape(b, -1, chunk, h).cumsum(2)  # [B, chunks, L, H]
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).triu(1)[:, :, None]  # [L, S, 1]: s > t
    decay = (cum[:, :, :, None] - cum[:, :, None]).masked_fill(later, float("-inf")).exp()  # [B, chunks, L, S, H]
    within = torch.einsum("bclsh,bcshd->bclhd", decay, x)
    state, out = x.new_zeros(b, h, d), []
    for c in range(x.shape[1]):
        out.append(within[:, c] + cum[:, c, :, :, None].exp() * state[:, None])
        state = out[-1][:, -1]
    return torch.stack(out, 1).reshape(b, -1, h, d)[:, :n]


class ConvNet(nn.Module):
    """Two blocks, each a gated causal depthwise convolution over the sequence (Lfm2's and Mamba2's short
    convolution: ``nn.Conv1d(groups=C, padding=k-1)`` then ``[..., :N]``), a cumulative sum of its output along the
    sequence (scaled: the sum grows with the position), with ``scan_chunk`` a `chunked_decay_scan` over its heads in
    chunks of that many tokens, and, with ``attention``, causal SDPA; a padding mask ``keep [B, N]`` zeroes the
    padding tokens before each mixer, as Hugging Face's hybrids do."""

    def __init__(self, vocab: int, dim: int, width: int, attention: bool, heads: int = 4, scan_chunk: int = 0):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)
        self.in_proj = nn.ModuleList(nn.Linear(dim, 2 * dim) for _ in range(2))
        self.conv = nn.ModuleList(nn.Conv1d(dim, dim, width, groups=dim, padding=width - 1) for _ in range(2))
        self.decay = nn.ModuleList(nn.Linear(dim, heads) for _ in range(2)) if scan_chunk else None
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(2)) if attention else None
        self.norm = nn.ModuleList(nn.LayerNorm(dim) for _ in range(2))
        self.heads, self.scan_chunk = heads, scan_chunk

    def forward(self, ids, keep=None):
        x = self.embed(ids)
        n = ids.shape[1]
        for i in range(2):
            h = self.norm[i](x)
            if keep is not None:
                h = h * keep[:, -n:, None]  # a slice that takes the whole mask, as Lfm2 spells it
            gate, h = self.in_proj[i](h).chunk(2, dim=-1)
            h = self.conv[i](h.transpose(1, 2))[..., :n].transpose(1, 2)
            h = torch.sigmoid(gate) * h + torch.cumsum(h, dim=1) / n
            if self.decay is not None:
                log_decay = -F.softplus(self.decay[i](h))
                h = h + chunked_decay_scan(h.unflatten(-1, (self.heads, -1)), log_decay, self.scan_chunk).flatten(2)
            if self.qkv is not None:
                q, k, v = self.qkv[i](h).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
                h = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
            x = x + h
        return self.head(x)


class ScanReadWhole(nn.Module):
    """`chunked_decay_scan` over 4 heads of 2 features (chunks of 5), its output read by causal attention and by a
    flip along the sequence, which needs it whole."""

    def __init__(self):
        super().__init__()
        self.proj, self.decay = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        y = chunked_decay_scan(self.proj(x).unflatten(-1, (4, 2)), -F.softplus(self.decay(x)), 5).flatten(2)
        return F.scaled_dot_product_attention(y[:, None], y[:, None], y[:, None], is_causal=True), y.flip(1)


def scan_read_whole_step(rank: int, world_size: int) -> dict:
    """`ScanReadWhole` (fp64, 11 tokens) through the ring backend against the model run whole: both outputs and every
    gradient; the scan's strategy and its all-to-alls counted."""
    torch.manual_seed(0)
    x = torch.randn(2, 11, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    result, events = _two_outputs_step(
        ScanReadWhole().double(), x, lambda out: out[0].pow(2).sum() + out[1].sin().sum(), "aot_eager"
    )
    return result | {"heads_exchanges": sum(e.kind == "heads_exchange" for e in events)}


def _two_outputs_step(model: nn.Module, x: torch.Tensor, loss, compiler: str) -> tuple[dict, list]:
    """``model`` through the ring backend (outputs gathered) against a copy run whole, ``loss`` of its two outputs
    backward: relative errors of both outputs and every gradient, the report's mixers' strategies; and the ring's
    events."""
    reference = copy.deepcopy(model)
    want = reference(x)
    loss(want).backward()
    backend = ringpass.backend(compiler=compiler, outputs="gathered")
    with record_ring_events() as events:
        got = torch.compile(model, backend=backend, fullgraph=True)(x)
        loss(got).backward()
    expected = dict(reference.named_parameters())
    result = {
        "outputs": [rel_err(g, w) for g, w in zip(got, want)],
        "grads": {name: rel_err(p.grad, expected[name].grad) for name, p in model.named_parameters()},
        "mixers": [m.strategy for m in backend.reports[0].mixers],
    }
    return result, events


def _sharded_step(
    model: nn.Module, kwargs: dict, weights: torch.Tensor, backend, rank: int, world_size: int, dynamic=None
):
    """``model`` compiled with ``backend`` (outputs sharded) called on ``kwargs``, the sum of its local output times
    this rank's shard of ``weights`` backward: (the local output, the whole output gathered, the ring's events)."""
    with record_ring_events() as events:
        local = torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic)(**kwargs)
        layout = Layout(backend.reports[0].layout, world_size, weights.shape[1])
        (local * layout.shard(weights, 1, rank)).sum().backward()
    return local, _gather(local, layout, 1), events


def conv_model_step(rank: int, world_size: int, case: dict) -> dict:
    """One training step of `ConvNet` through the ring backend against the model run whole (fp64 or fp32): relative
    errors of the logits and of every gradient by name; the ring's KV and summary exchanges; the local
    length of the logits; the report's mixers."""
    torch._dynamo.reset()  # a pool's process runs many drawn cases: each compiles ConvNet.forward afresh
    torch.manual_seed(case["seed"])
    dtype = getattr(torch, case["dtype"])
    model = ConvNet(29, 8, case["width"], case["attention"], scan_chunk=case.get("scan", 0)).to(dtype)
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(case["seed"])
    ids = torch.randint(0, 29, (2, case["seq_len"]), generator=gen)
    kwargs = {"ids": ids}
    if case["padding"]:
        keep = torch.ones(2, case["seq_len"], dtype=dtype)
        keep[1, -3:] = 0
        kwargs["keep"] = keep
    weights = torch.randn(2, case["seq_len"], 29, generator=gen, dtype=torch.float64).to(dtype)
    want = reference(**kwargs)
    (want * weights).sum().backward()
    backend = ringpass.backend(compiler="aot_eager", layout=case["layout"], outputs="sharded")
    local, got, events = _sharded_step(model, kwargs, weights, backend, rank, world_size, case.get("dynamic"))
    expected = dict(reference.named_parameters())
    return {
        "logits": rel_err(got, want),
        # the backend sums each parameter's gradient over the ranks (grads="auto" with no wrapper: reduced)
        "grads": {name: rel_err(p.grad, expected[name].grad) for name, p in model.named_parameters()},
        "kv_exchanges": sum(e.kind == "exchange" for e in events),
        "mixer_exchanges": sum(e.kind == "mixer_exchange" for e in events),
        "all_gathers": sum(e.kind == "all_gather" for e in events),
        "heads_exchanges": sum(e.kind == "heads_exchange" for e in events),
        "local_len": local.shape[1],
        "mixers": backend.reports[0].as_dict()["mixers"],
    }


def converted_scan_step(rank: int, world_size: int, folder: str) -> dict:
    """`ConvNet` with a chunked scan (fp64, 13 tokens, chunks of 3) converted by `ringpass.convert`, saved and loaded
    again: its logits and every gradient against the model run whole; the scan's all-to-alls counted."""
    torch.manual_seed(0)
    model = ConvNet(29, 8, 3, attention=True, scan_chunk=3).double()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 29, (2, 13), generator=torch.Generator().manual_seed(1))
    want = reference(ids)
    want.pow(2).sum().backward()
    path = f"{folder}/scan-{rank}.pt2"
    ringpass.convert(model, (ids,), world_size=world_size).save(path)
    loaded = ringpass.load(path)
    with record_ring_events() as events:
        got = loaded(ids)
        got.pow(2).sum().backward()
    expected = dict(reference.named_parameters())
    return {
        "logits": rel_err(got, want),
        "grads": {name: rel_err(p.grad, expected[name].grad) for name, p in loaded.model.named_parameters()},
        "heads_exchanges": sum(e.kind == "heads_exchange" for e in events),
    }


class DeltaRuleScan(nn.Module):
    """Hugging Face's ``torch_chunk_gated_delta_rule`` (or ``scan``, a function of its signature; chunks of 5, q and k
    l2-normed) over 4 heads of 3 features, then causal attention."""

    def __init__(self, scan=None):
        super().__init__()
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

        self.qkv, self.gates, self.scan = nn.Linear(8, 36), nn.Linear(8, 8), scan or torch_chunk_gated_delta_rule

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 4, 3)).unbind(2)
        g, beta = self.gates(x).unflatten(-1, (2, 4)).unbind(2)
        out, _ = self.scan(q, k, v, -F.softplus(g), beta.sigmoid(), chunk_size=5, use_qk_l2norm_in_kernel=True)
        y = out.flatten(2)[:, None]
        return F.scaled_dot_product_attention(y, y, y, is_causal=True)


def converted_state_step(rank: int, world_size: int, folder: str) -> dict:
    """`DeltaRuleScan` (fp32, 11 tokens) converted by `ringpass.convert` with ``scans="state"``, saved and loaded
    again: its output and every gradient against the model run whole; the summaries' all-gathers counted."""
    torch.manual_seed(0)
    model = DeltaRuleScan()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 11, 8, generator=torch.Generator().manual_seed(1))
    want = reference(x)
    want.pow(2).sum().backward()
    path = f"{folder}/state-{rank}.pt2"
    ringpass.convert(model, (x,), world_size=world_size, scans="state").save(path)
    loaded = ringpass.load(path)
    with record_ring_events() as events:
        got = loaded(x)
        got.pow(2).sum().backward()
    expected = dict(reference.named_parameters())
    return {
        "output": rel_err(got, want),
        "grads": {name: rel_err(p.grad, expected[name].grad) for name, p in loaded.model.named_parameters()},
        "summaries": sum(e.kind == "mixer_exchange" for e in events),
    }


class EveryMixerKind(nn.Module):
    """Each kind of sequence mixer in one block: a causal depthwise convolution (width 3), a cumulative sum, the gated
    delta rule (4 heads of 3 features, l2-normed q and k) and Mamba2's SSD (4 heads of 2 features, one group of B and
    C of 3 states, ``dt`` biased, softplus'd and clamped to (0, 4)), both over chunks of ``chunk`` tokens, then causal
    attention. The scans are `fp64_scans`' (the known names, computed in the inputs' dtype)."""

    def __init__(self, chunk: int, vocab: int = 29, dim: int = 8, heads: int = 4):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)
        self.conv = nn.Conv1d(dim, dim, 3, groups=dim, padding=2)
        self.qkv, self.gates = nn.Linear(dim, 3 * heads * 3), nn.Linear(dim, 2 * heads)
        self.delta_out = nn.Linear(heads * 3, dim)
        self.ssd_in, self.ssd_out = nn.Linear(dim, heads * 2 + heads + 6), nn.Linear(heads * 2, dim)
        self.A_log, self.D, self.dt_bias = (nn.Parameter(torch.randn(heads) * 0.5) for _ in range(3))
        self.heads, self.chunk = heads, chunk

    def forward(self, ids):
        from fp64_scans import mamba2_chunk_scan, torch_chunk_gated_delta_rule

        n, heads = ids.shape[1], self.heads
        x = self.embed(ids)
        h = self.conv(x.transpose(1, 2))[..., :n].transpose(1, 2)
        h = h + torch.cumsum(h, dim=1) / n
        q, k, v = self.qkv(h).unflatten(-1, (3, heads, 3)).unbind(2)
        g, beta = self.gates(h).unflatten(-1, (2, heads)).unbind(2)
        out, _ = torch_chunk_gated_delta_rule(
            q, k, v, -F.softplus(g), beta.sigmoid(), chunk_size=self.chunk, use_qk_l2norm_in_kernel=True
        )
        h = h + self.delta_out(out.flatten(2))
        states, dt, b, c = self.ssd_in(h).split([heads * 2, heads, 3, 3], dim=-1)
        y = mamba2_chunk_scan(
            states.unflatten(-1, (heads, 2)), dt, -self.A_log.exp(), b[:, :, None], c[:, :, None], self.chunk,
            D=self.D, dt_bias=self.dt_bias, dt_softplus=True, dt_limit=(0.0, 4.0),
        )  # fmt: skip
        h = h + self.ssd_out(y.flatten(2))
        a = h.unflatten(-1, (2, 4)).transpose(1, 2)
        return self.head(h + F.scaled_dot_product_attention(a, a, a, is_causal=True).transpose(1, 2).flatten(2))


def every_mixer_kind_step(rank: int, world_size: int, case: dict) -> dict:
    """One training step of `EveryMixerKind` (``case``: dtype, seq_len, chunk, layout, scans, ulysses, seed) through
    the ring backend, outputs sharded, against the model run whole: relative errors of the logits and of every
    gradient by name; the exchanges of each kind counted; the logits' local length; each mixer's strategy."""
    torch._dynamo.reset()
    torch.manual_seed(case["seed"])
    dtype = getattr(torch, case["dtype"])
    model = EveryMixerKind(case["chunk"]).to(dtype)
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(case["seed"])
    ids = torch.randint(0, 29, (2, case["seq_len"]), generator=gen)
    weights = torch.randn(2, case["seq_len"], 29, generator=gen, dtype=dtype)
    want = reference(ids)
    (want * weights).sum().backward()
    backend = ringpass.backend(
        compiler="aot_eager", layout=case["layout"], outputs="sharded", scans=case["scans"], ulysses=case["ulysses"]
    )
    local, got, events = _sharded_step(model, {"ids": ids}, weights, backend, rank, world_size)
    expected = dict(reference.named_parameters())
    return {
        "logits": rel_err(got, want),
        "grads": {name: rel_err(p.grad, expected[name].grad) for name, p in model.named_parameters()},
        "local_len": local.shape[1],
        "events": {kind: sum(e.kind == kind for e in events) for kind in {e.kind for e in events}},
        "mixers": [(m.kind, m.strategy) for m in backend.reports[0].mixers],
    }


class BreakBeforeScan(nn.Module):
    """Causal attention, a graph break, then a `chunked_decay_scan` over 4 heads in chunks of 3: the scan's graph
    takes the attention's output carried sharded from the first graph (under dynamic shapes marked dynamic)."""

    def __init__(self, vocab: int = 29, dim: int = 8, heads: int = 4):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)
        self.qkv, self.decay = nn.Linear(dim, 3 * dim), nn.Linear(dim, heads)
        self.heads = heads

    def forward(self, ids):
        x = self.embed(ids)
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        h = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        torch._dynamo.graph_break()
        log_decay = -F.softplus(self.decay(h))
        return self.head(h + chunked_decay_scan(h.unflatten(-1, (self.heads, -1)), log_decay, 3).flatten(2))


def variable_length_steps(rank: int, world_size: int, case: dict) -> list[dict]:
    """``case["model"]`` (fp64): `EveryMixerKind` (chunks of 3, its scans passing their state), `ConvNet` (its scan's
    chunks of 3 split by heads, then attention) or `BreakBeforeScan` (two graphs), compiled once with
    ``dynamic=case["dynamic"]`` and trained at each of ``case["lengths"]`` (``mark_dynamic``: the length marked dynamic
    by the user first), against the model run whole: for each step the relative errors of the logits and of every
    gradient by name, the logits' local length (and the layout's), the exchanges of each kind, the graphs compiled so
    far (length, report notes, status), the last one's mixers (kind, strategy) and the reports' recompile-limit
    warnings."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    every = case["model"] == "every"
    model = {
        "every": lambda: EveryMixerKind(chunk=3),
        "conv": lambda: ConvNet(29, 8, 3, attention=True, scan_chunk=3),
        "break": BreakBeforeScan,
    }[case["model"]]().double()
    reference = copy.deepcopy(model)
    breaks = case["model"] == "break"  # the first graph's outputs are carried into the second (it ends at a break)
    backend = ringpass.backend(compiler="aot_eager", outputs="sharded", scans="state" if every else "heads")
    compiled = torch.compile(model, backend=backend, fullgraph=not breaks, dynamic=case["dynamic"])
    steps = []
    limit = torch._dynamo.config.patch(recompile_limit=case.get("recompile_limit", 8))
    for n in case["lengths"]:
        gen = torch.Generator().manual_seed(n)
        ids = torch.randint(0, 29, (2, n), generator=gen)
        weights = torch.randn(2, n, 29, generator=gen, dtype=torch.float64)
        if case.get("mark_dynamic"):
            torch._dynamo.mark_dynamic(ids, 1)
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
        want = reference(ids)
        (want * weights).sum().backward()
        with record_ring_events() as events, limit:
            local = compiled(ids)
            layout = Layout(next(r.layout for r in backend.reports if r.layout), world_size, n)
            (local * layout.shard(weights, 1, rank)).sum().backward()
        expected = dict(reference.named_parameters())
        steps.append(
            {
                "logits": rel_err(_gather(local, layout, 1), want),
                "grads": {name: rel_err(p.grad, expected[name].grad) for name, p in model.named_parameters()},
                "local_len": (local.shape[1], layout.local_len),
                "events": {kind: sum(e.kind == kind for e in events) for kind in {e.kind for e in events}},
                "graphs": [(r.seq_len, r.notes, r.status) for r in backend.reports],
                "mixers": [(m.kind, m.strategy) for m in backend.reports[-1].mixers],
                "limit_warnings": [w for r in backend.reports for w in r.warnings if "recompile_limit" in w],
            }
        )
    return steps


class WholeInputMixers(nn.Module):
    """A cumsum and a causal convolution of a value another op needs whole (a flip along the sequence, before the
    attention): both run whole on every rank, and what the attention and the sum read is sharded after them."""

    def __init__(self):
        super().__init__()
        self.embed, self.conv = nn.Embedding(11, 4), nn.Conv1d(4, 4, 3, groups=4, padding=2)

    def forward(self, ids):
        x = self.embed(ids).transpose(1, 2)  # [B, C, N]
        z = x.flip(2).amax(2, keepdim=True)  # needs x whole
        c = x.cumsum(2) + self.conv(x)[..., : ids.shape[1]]
        q = (c + z).transpose(1, 2).unsqueeze(1)
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True).squeeze(1)
        return out, c.sum(1)


def whole_input_mixers(rank: int, world_size: int, compiler: str) -> dict:
    """`WholeInputMixers` (fp64) through the ring backend against the model run whole: relative errors of both
    outputs and every gradient; the report's mixers; the KV exchanges."""
    torch.manual_seed(0)
    ids = torch.randint(0, 11, (2, 16), generator=torch.Generator().manual_seed(1))
    result, events = _two_outputs_step(
        WholeInputMixers().double(), ids, lambda out: out[0].sum() + out[1].pow(2).sum(), compiler
    )
    return result | {"kv_exchanges": sum(e.kind == "exchange" for e in events)}


def inductor_step(rank: int, world_size: int) -> dict:
    """`ConvNet` (fp32, with attention) compiled by Inductor (the default inner compiler; the mixers' ops must give
    it the strides they return) against the model run whole: the logits' and every gradient's relative error."""
    torch.manual_seed(0)
    model = ConvNet(29, 8, 4, attention=True)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 29, (2, 13), generator=torch.Generator().manual_seed(1))
    want = reference(ids)
    want.pow(2).mean().backward()
    with record_ring_events() as events:
        got = torch.compile(model, backend=ringpass.backend(outputs="gathered"), fullgraph=True)(ids)
        got.pow(2).mean().backward()
    expected = dict(reference.named_parameters())
    return {
        "logits": rel_err(got, want),
        "grads": {name: rel_err(p.grad, expected[name].grad) for name, p in model.named_parameters()},
        "mixer_exchanges": sum(e.kind == "mixer_exchange" for e in events),
    }


def per_rank_step(rank: int, world_size: int) -> dict:
    """`EveryMixerKind` (fp64, its scans passing their state) under ``inputs="per_rank"``: each rank passes its own
    batch; the reference is a data-parallel job (each rank's output on its batch, the mean of the ranks' gradients)."""
    torch.manual_seed(0)
    model = EveryMixerKind(chunk=3).double()
    reference = copy.deepcopy(model)
    batches = [
        torch.randint(0, 29, (2, 13), generator=torch.Generator().manual_seed(10 + r)) for r in range(world_size)
    ]
    for batch in batches:
        (reference(batch).pow(2).mean() / world_size).backward()
    want = reference(batches[rank]).detach()
    backend = ringpass.backend(compiler="aot_eager", inputs="per_rank", scans="state")
    with record_ring_events() as events:
        got = torch.compile(model, backend=backend, fullgraph=True)(batches[rank])
        got.pow(2).mean().backward()
    expected = dict(reference.named_parameters())
    return {
        "output": rel_err(got, want),
        "grads": {name: rel_err(p.grad, expected[name].grad) for name, p in model.named_parameters()},
        "mixer_exchanges": sum(e.kind == "mixer_exchange" for e in events),
        "heads_exchanges": sum(e.kind == "heads_exchange" for e in events),
        "mixers": [m.strategy for m in backend.reports[0].mixers],
    }
