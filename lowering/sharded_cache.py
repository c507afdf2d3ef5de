"""A KV cache that stays sharded between decode steps: every rank's slots and their global positions.

One attention layer's cache on one rank is three tensors (`ringpass.ShardedCache` keeps them for a
Hugging Face model; a model with its own cache can keep them itself):

    k_slots, v_slots   [B, Hkv, C, D]   this rank's keys and values
    slot_pos           [C] int64        the global position each slot holds; -1: a free slot

with ``C = slot_count(prompt_len, max_new_tokens, world_size)``: first the prompt's slots, ``R =
prompt_slot_count(prompt_len, world_size)`` of them, holding the positions the prefill's layout gave this
rank (`Layout.positions(rank)`; layout padding and the slots a shorter layout leaves are free), then the
generated positions this rank owns: position ``p >= n`` (a prompt of ``n`` tokens) belongs to rank
``(p - n) % P`` (`lowering.decode.new_position_owner`) and sits in its slot ``R + (p - n) // P``.

- `prompt_slots`: the slots of a prompt's keys and values, from the whole prompt or (``sharded=True``)
  from this rank's layout shard of it, which is what a ring prefill holds.
- `append_slots`: writes a decode step's new keys and values into the slots of the positions this rank
  owns, in place; the other ranks write nothing.
- `whole_cache`: the whole cache ``[B, Hkv, length, D]`` in position order, every rank's slots
  all-gathered. A graph the ring backend does not rewrite (one rank, another backend, eager) attends to
  it and so computes the unsharded model's numbers; the backend's decode rewrite never calls it.
- `decode_over_slots`: decode attention over this rank's slots (`lowering.decode`) with the model's own
  mask, written over global key positions, read at the slots' positions; free slots are never visible.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from lowering import events
from lowering.errors import InvalidInputError, RingpassWarning
from lowering.failures import wait_collective
from lowering.groups import world_of
from lowering.layout import cached_layout, local_length

FREE = -1  # slot_pos of a slot that holds no position


def prompt_slot_count(prompt_len: int, world_size: int) -> int:
    """Slots per rank for a prompt of ``prompt_len`` tokens: enough for any layout's shard (zigzag pads most)."""
    return local_length("zigzag", world_size, prompt_len)


def slot_count(prompt_len: int, max_new_tokens: int, world_size: int) -> int:
    """Slots per rank for a prompt and up to ``max_new_tokens`` generated positions (ceil(max_new / P) each)."""
    return prompt_slot_count(prompt_len, world_size) + -(-max_new_tokens // world_size)


@torch.library.custom_op("ringpass::prompt_slots", mutates_args=())
def prompt_slots(
    k: torch.Tensor, v: torch.Tensor, capacity: int, prompt_len: int, layout: str, sharded: bool, group_name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_slots, v_slots, slot_pos) of ``capacity`` slots for the prompt's keys and values ``[B, Hkv, ·, D]``:
    the whole prompt of ``prompt_len`` tokens, or with ``sharded`` this rank's ``layout`` shard of it."""
    world_size, rank, _ = world_of(group_name)
    ring = cached_layout(layout, world_size, prompt_len)
    if capacity < ring.local_len:
        raise InvalidInputError(
            f"prompt_slots: {capacity} slots cannot hold this rank's {ring.local_len} prompt slots."
        )
    expected, what = (ring.local_len, "this rank's shard") if sharded else (prompt_len, "the whole prompt")
    if k.size(2) != expected or v.shape[:3] != k.shape[:3]:
        raise InvalidInputError(
            f"prompt_slots: keys {tuple(k.shape)} / values {tuple(v.shape)} along dim 2 must hold "
            f"{expected} tokens ({what} of {prompt_len} under {ring})."
        )
    slot_pos = torch.full((capacity,), FREE, dtype=torch.int64, device=k.device)
    positions = ring.positions(rank).to(k.device)
    slot_pos[: ring.local_len] = torch.where(positions < prompt_len, positions, FREE)
    slots = []
    for x in (k, v):
        mine = x if sharded else ring.shard(x, 2, rank)
        slot = x.new_zeros(*x.shape[:2], capacity, x.size(3))
        slot[:, :, : ring.local_len] = mine
        slots.append(slot)
    return slots[0], slots[1], slot_pos


@prompt_slots.register_fake
def _(k, v, capacity, prompt_len, layout, sharded, group_name):
    return (
        k.new_empty(*k.shape[:2], capacity, k.size(3)),
        v.new_empty(*v.shape[:2], capacity, v.size(3)),
        k.new_empty(capacity, dtype=torch.int64),
    )


@torch.library.custom_op("ringpass::append_slots", mutates_args=("k_slots", "v_slots", "slot_pos"))
def append_slots(
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    slot_pos: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    position: int,
    prompt_len: int,
    group_name: str,
) -> None:
    """Writes the keys and values ``[B, Hkv, t, D]`` of positions ``position .. position + t - 1`` into the
    slots of those this rank owns (module docstring)."""
    world_size, rank, _ = world_of(group_name)
    if position < prompt_len:
        raise InvalidInputError(
            f"append_slots: position {position} is inside the prompt ({prompt_len} tokens); a "
            "prompt is written once, by the prefill."
        )
    first_generated = prompt_slot_count(prompt_len, world_size)
    for j in range(k_new.size(2)):
        offset = position + j - prompt_len
        if offset % world_size != rank:
            continue
        slot = first_generated + offset // world_size
        if slot >= k_slots.size(2):
            raise InvalidInputError(
                f"The sharded KV cache is full: position {position + j} needs slot {slot} on rank {rank}, which has "
                f"{k_slots.size(2)}. Make the cache with a larger max_new_tokens."
            )
        k_slots[:, :, slot] = k_new[:, :, j]
        v_slots[:, :, slot] = v_new[:, :, j]
        slot_pos[slot] = position + j


@append_slots.register_fake
def _(k_slots, v_slots, slot_pos, k_new, v_new, position, prompt_len, group_name):
    return None


@torch.library.custom_op("ringpass::whole_cache", mutates_args=())
def whole_cache(slots: torch.Tensor, slot_pos: torch.Tensor, length: int, group_name: str) -> torch.Tensor:
    """Every rank's ``slots`` ``[B, H, C, D]`` placed at their positions: ``[B, H, length, D]`` (all-gather)."""
    world_size, _, group = world_of(group_name)
    every_slots, every_pos = [slots], [slot_pos]
    if world_size > 1:
        _warn_gathering_once()
        every_slots = [torch.empty_like(slots) for _ in range(world_size)]
        every_pos = [torch.empty_like(slot_pos) for _ in range(world_size)]
        for parts, mine, what in ((every_slots, slots, "slots"), (every_pos, slot_pos, "slot positions")):
            work = dist.all_gather(parts, mine.contiguous(), group=group, async_op=True)
            wait_collective(work, mine, group_name, f"all-gathering the sharded KV cache's {what} {tuple(mine.shape)}")
        events.emit("cache_gather", bytes=slots.numel() * slots.element_size() * world_size, ranks=world_size)
    whole = slots.new_zeros(*slots.shape[:2], length, slots.size(3))
    for part, pos in zip(every_slots, every_pos):
        held = pos != FREE
        whole[:, :, pos[held]] = part[:, :, held]
    return whole


def _warn_gathering_once() -> None:
    if not _warned:
        _warned.append(True)
        warnings.warn(
            "A decode step attended to the whole KV cache, gathered from every rank: it ran without the ring "
            "backend's rewrite (the model's forward is not compiled with backend='ring', or Dynamo gave up "
            "compiling it: torch._dynamo.config.recompile_limit), so each step moves the whole cache. The numbers "
            "are right; compile the forward with the ring backend to attend where the cache lies.",
            RingpassWarning,
            stacklevel=3,
        )


_warned: list = []


@whole_cache.register_fake
def _(slots, slot_pos, length, group_name):
    return slots.new_empty(*slots.shape[:2], length, slots.size(3))


def decode_over_slots(
    q: torch.Tensor,
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    slot_pos: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    group_name: str,
) -> torch.Tensor:
    """Attention of the replicated queries ``q`` ``[B, Hq, t, D]`` over the cache whose slots every rank holds
    a part of; ``mask`` (bool, True = visible, broadcast to ``[B, Hq, t, length]``, or None: every key) is
    the model's mask over global key positions."""
    held = slot_pos != FREE
    visible = held.view(1, 1, 1, -1)
    if mask is not None:
        visible = visible & mask.index_select(-1, slot_pos.clamp(min=0))
    visible = visible.expand(-1, -1, q.size(2), -1)
    scale = q.size(-1) ** -0.5 if scale is None else float(scale)
    q_pos = torch.zeros(q.size(2), dtype=torch.int64, device=q.device)  # unused: the mask says what is visible
    return torch.ops.ringpass.decode_attention(
        q, k_slots, v_slots, q_pos, slot_pos, None, visible, False, None, scale, group_name
    )
