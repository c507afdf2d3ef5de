"""Generation from a long prompt: the prefill through the ring, decode steps against a KV cache that stays sharded.

    model.forward = torch.compile(model.forward, backend="ring")             # under torchrun
    cache = ringpass.ShardedCache(model.config, max_new_tokens=64)
    out = model.generate(input_ids, attention_mask=mask, past_key_values=cache, max_new_tokens=64)
    out = ringpass.generate(model, input_ids, attention_mask=mask, max_new_tokens=64)   # the same, in one call

`ShardedCache` is a Hugging Face `Cache` whose layers hold this rank's slots of the keys and values
(`lowering.sharded_cache`): the prefill keeps the prompt's keys where the ring's layout put them, each
generated position is written on the rank that owns it, and ``get_seq_length`` answers the *global*
length, so the positions and masks Hugging Face builds are the unsharded model's. In a graph the ring
backend compiles, the prefill's attention becomes ring attention and every decode step's attention becomes
`lowering.decode_attention` over the slots (one small all-gather of out and LSE, no key or value moves).
Anywhere else (one process, another backend) a decode step attends to the whole cache gathered from
every rank, so the numbers are right but nothing is saved.

``torch.compile(model, backend="ring").generate(...)`` does not work: the compiled wrapper hands
``generate`` to the original module, whose forward is not compiled. Compile ``model.forward`` (as above)
or call `generate`.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from lowering import compat
from lowering.errors import InvalidInputError, NotSupportedError
from lowering.groups import resolve_group
from lowering.sharded_cache import slot_count


class ShardedLayer(DynamicLayer):
    """One attention layer's sharded cache: ``keys`` / ``values`` are this rank's slots ``[B, Hkv, C, D]``,
    ``slot_pos`` their global positions (-1: free), ``length`` the global number of positions seen."""

    def __init__(self, max_new_tokens: int, world_size: int, group_name: str):
        super().__init__()
        self.max_new_tokens, self.world_size, self.group_name = max_new_tokens, world_size, group_name
        self.slot_pos: torch.Tensor | None = None
        self.prompt_len: int | None = None
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """The prefill (the first call) keeps this rank's slots of the prompt and attends to the prompt's own
        keys; a decode step writes its keys where they belong and attends to the whole cache."""
        if self.prompt_len is None:
            self.lazy_initialization(key_states, value_states)
            prompt_len = key_states.shape[-2]  # a cache serves one prompt length
            capacity = slot_count(prompt_len, self.max_new_tokens, self.world_size)
            self.keys, self.values, self.slot_pos = torch.ops.ringpass.prompt_slots(
                key_states, value_states, capacity, prompt_len, "zigzag", False, self.group_name
            )
            self.prompt_len, self.length, self.is_initialized = prompt_len, prompt_len, True
            return key_states, value_states
        torch.ops.ringpass.append_slots(
            self.keys,
            self.values,
            self.slot_pos,
            key_states,
            value_states,
            self.length,
            self.prompt_len,
            self.group_name,
        )
        self.length = self.length + key_states.shape[-2]
        return (
            torch.ops.ringpass.whole_cache(self.keys, self.slot_pos, self.length, self.group_name),
            torch.ops.ringpass.whole_cache(self.values, self.slot_pos, self.length, self.group_name),
        )

    def get_seq_length(self) -> int:
        return 0 if self.prompt_len is None else self.length  # the prefill's graph reads no attribute

    def get_max_length(self) -> int:
        return -1 if self.prompt_len is None else self.prompt_len + self.max_new_tokens

    def crop(self, max_length: int) -> None:
        raise NotSupportedError(
            "ShardedCache cannot be cropped (assisted or speculative decoding): its positions are "
            "spread over the ranks. Generate without an assistant model."
        )

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotSupportedError(
            "ShardedCache does not reorder its batch (beam search, num_return_sequences > 1): use "
            "greedy or sampled decoding with num_beams=1."
        )

    batch_select_indices = reorder_cache = batch_repeat_interleave


class ShardedCache(Cache):
    """A Hugging Face KV cache kept sharded across the ranks of ``group`` (module docstring).

    ``config``: the model's config (its number of layers); ``max_new_tokens``: how many positions the cache
    holds past the prompt (each rank allocates ceil(max_new_tokens / P) slots for them at the prefill);
    ``group``: a process group, its name or a one-dimensional DeviceMesh (default: the default group), the
    same as the ring backend's. One cache serves one generation (one prompt)."""

    def __init__(self, config: Any, *, max_new_tokens: int, group: Any = None):
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise InvalidInputError(
                f"ShardedCache: max_new_tokens must be a number of tokens >= 0, got {max_new_tokens!r}."
            )
        import torch.distributed as dist

        resolved = resolve_group(group)
        world_size = dist.get_world_size(resolved) if resolved is not None else 1
        group_name = resolved.group_name if resolved is not None else ""
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        layers = [ShardedLayer(max_new_tokens, world_size, group_name) for _ in range(text_config.num_hidden_layers)]
        super().__init__(layers=layers)
        self.max_new_tokens, self.world_size = max_new_tokens, world_size

    def slot_bytes(self) -> int:
        """Bytes this rank's keys, values and slot positions take."""
        return sum(
            t.numel() * t.element_size()
            for layer in self.layers
            if layer.slot_pos is not None
            for t in (layer.keys, layer.values, layer.slot_pos)
        )


def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    backend: Any = "ring",
    group: Any = None,
    dynamic: bool | None = None,
    **generate_kwargs: Any,
) -> torch.Tensor:
    """``model.generate(input_ids, max_new_tokens=..., **generate_kwargs)`` with ``model.forward`` compiled with
    ``backend`` (and ``torch.compile``'s ``dynamic``; once: later calls reuse it) and a fresh `ShardedCache`;
    returns what ``generate`` returns. ``model`` may be the module or what ``torch.compile(module)`` returned."""
    model = compat.compiled_module_inner(model)
    if "past_key_values" in generate_kwargs:
        raise InvalidInputError(
            "ringpass.generate makes its own ShardedCache; call model.generate to pass your own cache."
        )
    if getattr(model.forward, "_ringpass_compile", None) != (backend, dynamic):
        compiled = torch.compile(model.__class__.forward.__get__(model), backend=backend, dynamic=dynamic)
        compiled._ringpass_compile = (backend, dynamic)
        model.forward = compiled
    cache = ShardedCache(model.config, max_new_tokens=max_new_tokens, group=group)
    return model.generate(input_ids, max_new_tokens=max_new_tokens, past_key_values=cache, **generate_kwargs)
