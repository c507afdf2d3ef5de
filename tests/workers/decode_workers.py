"""What each rank runs in the decode tests: a prompt's cache sharded by the prefill's layout, generated tokens
appended by the ownership rule, then a decode step against fp64 attention over the whole cache."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from lowering import Layout, append_slots, decode_over_slots, prompt_slots, record_ring_events, whole_cache
from lowering.decode import append_to_cache, decode_attention
from lowering.errors import RingpassWarning
from lowering.sharded_cache import slot_count

B, HQ, HKV, D = 2, 4, 2, 8


def cache_of(prompt_len: int, generated: int, seed: int = 0):
    """(k, v) of every position, (prompt and generated), and a left-padding mask [B, positions]: row 1's first
    three prompt tokens are padding."""
    generator = torch.Generator().manual_seed(seed)
    n = prompt_len + generated
    k, v = (torch.randn(B, HKV, n, D, generator=generator, dtype=torch.float64) for _ in range(2))
    real = torch.ones(B, n, dtype=torch.bool)
    real[1, :3] = False
    return k, v, real


def reference(q, k, v, q_pos, kv_pos, real, window):
    """Attention in fp64 over the whole cache, written out; a query that sees no key gives 0."""
    scores = q @ k.repeat_interleave(HQ // HKV, dim=1).transpose(-1, -2) * D**-0.5
    visible = (kv_pos[None, :] <= q_pos[:, None])[None, None] & real[:, None, None, :]
    if window is not None:
        visible = visible & (q_pos[:, None] - kv_pos[None, :] < window)[None, None]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    return probs @ v.repeat_interleave(HQ // HKV, dim=1)


def decode_step(rank: int, world_size: int, cases: list) -> dict:
    """Per case (prompt_len, generated, new queries t, window): max |decode - reference| / max |reference|, the
    merges recorded and their bytes, and this rank's cache positions."""
    results = {}
    for prompt_len, generated, t, window in cases:
        k, v, real = cache_of(prompt_len, generated)
        layout = Layout("zigzag", world_size, prompt_len)
        slots = layout.positions(rank)[: layout.valid_len(rank)]
        k_mine, v_mine, pos_mine = k[:, :, slots], v[:, :, slots], slots
        for p in range(prompt_len, prompt_len + generated):  # one generated token at a time, as decoding appends
            new = torch.tensor([p])
            k_mine, v_mine, pos_mine = append_to_cache(
                k_mine,
                v_mine,
                pos_mine,
                k[:, :, new],
                v[:, :, new],
                new,
                prompt_len=prompt_len,
                rank=rank,
                world_size=world_size,
            )
        n = prompt_len + generated
        q_pos = torch.arange(n - t, n)
        q = torch.randn(B, HQ, t, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        with torch.no_grad(), record_ring_events() as events:
            out = decode_attention(
                q, k_mine, v_mine, q_pos=q_pos, kv_pos=pos_mine, window=window, key_padding=real[:, pos_mine]
            )
        want = reference(q, k, v, q_pos, torch.arange(n), real, window)
        merges = [e for e in events if e.kind == "decode_merge"]
        slots_out, whole = _through_slots(q, k, v, q_pos, real, window, prompt_len, generated)
        results[(prompt_len, generated, t, window)] = {
            "error": ((out - want).abs().max() / want.abs().max()).item(),
            "slots_error": ((slots_out - want).abs().max() / want.abs().max()).item(),
            "whole_cache_exact": torch.equal(whole, k),
            "merges": len(merges),
            "bytes": [e.fields["bytes"] for e in merges],
            "kv_exchanges": sum(e.kind == "exchange" for e in events),
            "positions": pos_mine.tolist(),
        }
    return results


def _through_slots(q, k, v, q_pos, real, window, prompt_len: int, generated: int):
    """The same step through `lowering.sharded_cache`: the prompt's slots from the whole prompt, generated keys
    appended one position at a time, decode over the slots with the mask written over global positions;
    and the whole cache read back from every rank's slots."""
    group = dist.group.WORLD.group_name
    capacity = slot_count(prompt_len, generated, dist.get_world_size())
    k_slots, v_slots, slot_pos = prompt_slots(
        k[:, :, :prompt_len], v[:, :, :prompt_len], capacity, prompt_len, "zigzag", False, group
    )
    for p in range(prompt_len, prompt_len + generated):
        append_slots(k_slots, v_slots, slot_pos, k[:, :, p : p + 1], v[:, :, p : p + 1], p, prompt_len, group)
    kv_pos = torch.arange(prompt_len + generated)
    visible = (kv_pos[None, :] <= q_pos[:, None])[None, None] & real[:, None, None, :]
    if window is not None:
        visible = visible & (q_pos[:, None] - kv_pos[None, :] < window)[None, None]
    with torch.no_grad():
        out = decode_over_slots(q, k_slots, v_slots, slot_pos, visible, None, group)
    with warnings.catch_warnings():  # reading the whole cache warns that it moves it: here that is the point
        warnings.simplefilter("ignore", RingpassWarning)
        return out, whole_cache(k_slots, slot_pos, prompt_len + generated, group)
