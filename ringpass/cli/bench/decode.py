"""``ringpass bench --what decode``: one decode step's attention, the cache sharded, whole, or gathered;
``--what generate``: a whole model's decode steps after a prompt, per token.

A step is ``--new-tokens`` queries (one by default) against a KV cache of ``--seq-len`` positions (causal:
the queries are the newest positions). Methods (`METHODS`): ``sdpa``, the whole cache in one process
(``F.scaled_dot_product_attention``: the unsharded model; one thread, and as many as the ranks had
together); ``sharded``, `lowering.decode_attention` on P ranks, each holding the slots the zigzag layout
gives it (what a `ringpass.ShardedCache` holds after a ring prefill) and merging out and LSE in one
all-gather; ``gathered``, every one of P ranks holding the whole cache and attending to all of it (the
cache gathered after the prefill, ``cache="gathered"``). The cache is in memory before the call: ``cache_mib``
is what a rank holds of it, the peak columns what the call adds. Every output is checked against fp32
SDPA over the whole cache (``error``). Times are per step: the per-token latency of this attention.

``--what generate`` (`GENERATE_METHODS`): the Llama-style bench model (`model.build_model`, in eval) is given
a prompt of ``--seq-len`` tokens, then generates greedily; each measured repeat is one decode step (the first
``--warmup`` steps, which compile, are not measured). ``sharded``: ``model.forward`` compiled with the ring
backend and a `ringpass.ShardedCache` (the prefill through the ring, the cache kept sharded); ``gathered``:
the same with ``cache="gathered"`` and Hugging Face's ``DynamicCache`` (the prefill's cache gathered onto
every rank, decode steps replicated); ``unsharded``: the model compiled with the same compiler in one process.
``cache_mib``: the KV cache one rank holds after the steps; ``tokens``: the tokens generated, compared with
the unsharded model's (``same_tokens``).
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import lowering
from lowering import compat
from lowering.decode import decode_attention
from ringpass.cli.bench.attention import DTYPES
from ringpass.cli.bench.measure import PeakMemory, gather_record, seconds_since, start_rank

METHODS = ("sdpa", "sharded", "gathered")
GENERATE_METHODS = ("unsharded", "sharded", "gathered")


def _cache(config, seq_len: int, device):
    """The full (q, k, v) of one step, their positions, and fp32 SDPA's output over the whole cache."""
    generator = torch.Generator().manual_seed(config.seed)
    dtype, t = DTYPES[config.dtype], config.new_tokens

    def rand(heads, n):
        return torch.randn(config.batch, heads, n, config.head_dim, generator=generator).to(device, dtype)

    q, k, v = rand(config.heads, t), rand(config.kv_heads, seq_len), rand(config.kv_heads, seq_len)
    q_pos, kv_pos = torch.arange(seq_len - t, seq_len, device=device), torch.arange(seq_len, device=device)
    visible = kv_pos[None, :] <= q_pos[:, None]
    with torch.no_grad():
        reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=visible, enable_gqa=True)
    return q, k, v, q_pos, kv_pos, visible, reference


def _step(method: str, config, seq_len: int, rank: int, world_size: int, device):
    """A function running one step of ``method`` on this rank, and the cache bytes it holds."""
    q, k, v, q_pos, kv_pos, visible, reference = _cache(config, seq_len, device)
    if method == "sharded":
        mine = lowering.Layout("zigzag", world_size, seq_len).positions(rank)
        mine = mine[mine < seq_len].to(device)
        k, v = k[:, :, mine].contiguous(), v[:, :, mine].contiguous()

        def run():
            return decode_attention(q, k, v, q_pos=q_pos, kv_pos=mine, is_causal=True)
    else:
        mask = None if bool(visible.all()) else visible  # one new token sees every key: no mask, as models pass

        def run():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    return run, reference, sum(t.numel() * t.element_size() for t in (k, v))


def _once(run, reference, memory: PeakMemory, device) -> dict:
    memory.start()
    with torch.no_grad(), lowering.record_ring_events() as events:
        start = time.perf_counter()
        out = run()
        seconds = seconds_since(start, device)
    peak = memory.peak()
    error = ((out.float() - reference).abs().max() / reference.abs().max()).item()
    merges = sum(1 for e in events if e.kind == "decode_merge")
    return {
        "forward_s": seconds,
        "total_s": seconds,
        "forward_bytes": peak,
        "total_bytes": peak,
        "error": error,
        "merges": merges,
        "kv_exchanges": sum(1 for e in events if e.kind == "exchange"),
    }


def decode_rank(rank: int, world_size: int, config, methods, progress_done: int, progress_total: int) -> list:
    """Every (cache length, method) case on one rank; rank 0's list of records is the result."""
    device, progress = start_rank(rank, config, progress_done, progress_total)
    memory, records = PeakMemory(device), []
    for seq_len in config.seq_lens:
        for method in methods:
            threads = torch.get_num_threads()
            progress.advance(f"{method} P={world_size} cache {seq_len} ({threads} thread{'s' * (threads > 1)})")
            run, reference, cache_bytes = _step(method, config, seq_len, rank, world_size, device)
            for _ in range(config.warmup):
                _once(run, reference, memory, device)
            samples = []
            for _ in range(config.repeats):
                if world_size > 1:
                    dist.barrier()
                samples.append(_once(run, reference, memory, device))
            mine = {
                "samples": samples,
                "memory_note": memory.unavailable,
                "first_call_bytes": None,
                "cache_bytes": cache_bytes,
            }
            records.append(gather_record(mine, method=method, world_size=world_size, seq_len=seq_len, device=device))
            del run, reference
    return records


def _generator(method: str, model, compiler: str, steps: int):
    """(the forward to call, a fresh cache) for one generation by ``method``."""
    from transformers import DynamicCache

    import ringpass

    compat.dynamo_reset()  # each method compiles from scratch
    if method == "unsharded":
        forward = model if compiler == "eager" else torch.compile(model, backend=compiler)
        return forward, DynamicCache(config=model.config)
    cache = "sharded" if method == "sharded" else "gathered"
    forward = torch.compile(
        model.__class__.forward.__get__(model), backend=ringpass.backend(compiler=compiler, report="off", cache=cache)
    )
    if method == "sharded":
        return forward, ringpass.ShardedCache(model.config, max_new_tokens=steps)
    return forward, DynamicCache(config=model.config)


def _cache_bytes(cache) -> int:
    if hasattr(cache, "slot_bytes"):
        return cache.slot_bytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def generate_rank(rank: int, world_size: int, config, methods, progress_done: int, progress_total: int) -> list:
    """Every (prompt length, method) case on one rank: the prefill, then ``warmup + repeats`` decode steps,
    each step timed; rank 0's list of records is the result."""
    from ringpass.cli.bench.model import build_model

    device, progress = start_rank(rank, config, progress_done, progress_total)
    memory, records = PeakMemory(device), []
    steps = config.warmup + config.repeats
    for seq_len in config.seq_lens:
        model, vocab = build_model(dataclasses.replace(config, seq_lens=(seq_len + steps,)), seq_len, device)
        model.eval()
        ids = torch.randint(vocab, (config.batch, seq_len), generator=torch.Generator().manual_seed(config.seed))
        for method in methods:
            threads = torch.get_num_threads()
            progress.advance(f"{method} P={world_size} prompt {seq_len} ({threads} thread{'s' * (threads > 1)})")
            forward, cache = _generator(method, model, config.compiler, steps)
            samples, tokens = [], []
            with torch.no_grad(), lowering.record_ring_events() as events:
                step = forward(input_ids=ids.to(device), past_key_values=cache, use_cache=True).logits[:, -1:]
                for i in range(steps):
                    token = step.argmax(-1)
                    tokens.append(token.flatten().tolist())
                    if world_size > 1:
                        dist.barrier()
                    memory.start()
                    start = time.perf_counter()
                    step = forward(input_ids=token, past_key_values=cache, use_cache=True).logits
                    seconds = seconds_since(start, device)
                    if i >= config.warmup:
                        peak = memory.peak()
                        samples.append(
                            {"forward_s": seconds, "total_s": seconds, "forward_bytes": peak, "total_bytes": peak}
                        )
            merges = sum(1 for e in events if e.kind == "decode_merge")
            mine = {
                "samples": samples,
                "memory_note": memory.unavailable,
                "first_call_bytes": None,
                "cache_bytes": _cache_bytes(cache),
                "tokens": tokens,
                "merges": merges,
                "cache_gathers": sum(1 for e in events if e.kind == "cache_gather"),
            }
            records.append(gather_record(mine, method=method, world_size=world_size, seq_len=seq_len, device=device))
        del model
    return records
