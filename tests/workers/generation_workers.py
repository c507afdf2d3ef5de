"""What each rank runs in the generation tests: greedy generation with the prompt prefilled through the ring
and the KV cache kept sharded (`ringpass.ShardedCache`), against the same model generating unsharded."""

from __future__ import annotations

import hashlib
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hf_workers import VOCAB, build
from reference import rel_err
from torch import nn

import ringpass
from lowering import append_slots, prompt_slots, record_ring_events, whole_cache
from lowering.sharded_cache import FREE, slot_count


def _prompt(batch: int, prompt_len: int, padded: bool):
    ids = torch.randint(1, VOCAB, (batch, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    mask = torch.ones_like(ids)
    if padded:  # row 1 left-padded by three tokens
        mask[1, :3] = 0
        ids[1, :3] = 0
    return ids, mask


def _counts(events) -> dict:
    counts: dict = {}
    for event in events:
        counts[event.kind] = counts.get(event.kind, 0) + 1
    return counts


def _held(cache) -> list:
    """Per layer, the positions this rank's slots hold."""
    return [sorted(p for p in layer.slot_pos.tolist() if p != FREE) for layer in cache.layers]


def case_name(case: tuple) -> str:
    """``("llama", 13, True, 4)`` as ``"llama 13 padded 4"``: how `hf_generate` keys its results."""
    name, prompt_len, padded, new = case
    return f"{name} {prompt_len}{' padded' * padded} {new}"


def hf_generate(rank: int, world_size: int, cases: list) -> dict:
    """Per case (family, prompt length, left padded, new tokens), keyed by `case_name`: greedy ``ringpass.generate``
    against ``model.generate`` unsharded: tokens equal, worst per-step logits error, events, compiles, what the
    slots hold and whether they hold the unsharded cache's keys and values there, and the cache's bytes."""
    results = {}
    for name, prompt_len, padded, new in cases:
        model = build(name).eval()
        ids, mask = _prompt(2, prompt_len, padded)
        options = dict(
            max_new_tokens=new,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
            pad_token_id=0,
            attention_mask=mask,
        )
        expected = model.generate(ids, **options)
        real = torch.cat([mask, torch.ones(2, new - 1, dtype=mask.dtype)], 1)
        positions = (real.cumsum(-1) - 1).masked_fill(real == 0, 1)  # as generate counts them, padding skipped
        with torch.no_grad():  # the unsharded model's cache of every position generate attended to
            whole = model(expected.sequences[:, :-1], attention_mask=real, position_ids=positions).past_key_values
        torch._dynamo.reset()  # every family's forward is one Hugging Face wrapper: compiles counted per case
        backend = ringpass.backend(compiler="aot_eager", report="off")
        with record_ring_events() as events:
            got = ringpass.generate(model, ids, backend=backend, **options)
        cache = got.past_key_values
        slots_hold_cache = all(
            layer_whole.keys.shape[2] < prompt_len + new - 1  # a sliding-window cache keeps only the window
            or _slots_hold(layer, layer_whole, real.bool())
            for layer, layer_whole in zip(cache.layers, whole.layers)
        )
        results[case_name((name, prompt_len, padded, new))] = {
            "same_tokens": torch.equal(got.sequences, expected.sequences),
            "logits": max(rel_err(g, e) for g, e in zip(got.logits, expected.logits)),
            "logits_bits": [hashlib.sha256(g.numpy().tobytes()).hexdigest() for g in got.logits],  # every rank's?
            "steps": len(got.logits),
            "layers": len(cache.layers),
            "events": _counts(events),
            "compiles": len(backend.reports),
            "statuses": [r.status for r in backend.reports],
            "decode": [r.decode for r in backend.reports],
            "held": _held(cache),
            "slots_hold_cache": slots_hold_cache,
            "slot_bytes": cache.slot_bytes(),
            "whole_bytes": sum(
                t.numel() * t.element_size() for layer in whole.layers for t in (layer.keys, layer.values)
            ),
        }
    return results


def _slots_hold(layer, whole, real: torch.Tensor) -> bool:
    """This rank's slots hold the unsharded cache's keys and values of their positions (at real tokens: what a
    padding query computes, seeing no key, is the model's own business)."""
    held = layer.slot_pos != FREE
    positions = layer.slot_pos[held]
    for b in range(real.shape[0]):
        at = real[b, positions]
        for slots, full in ((layer.keys, whole.keys), (layer.values, whole.values)):
            if not torch.allclose(slots[b][:, held][:, at], full[b][:, positions[at]], atol=1e-5):
                return False
    return True


def hf_cache_options(rank: int, world_size: int) -> dict:
    """A ShardedCache without the ring backend (eager), a DynamicCache under ``cache="gathered"`` and under the
    default ``cache="sharded"``."""
    model = build("llama").eval()
    ids, mask = _prompt(2, 9, True)
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, attention_mask=mask)
    expected = model.generate(ids, **options)
    with record_ring_events() as events, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eager = model.generate(ids, past_key_values=ringpass.ShardedCache(model.config, max_new_tokens=4), **options)
    results = {
        "eager_same": torch.equal(eager, expected),
        "eager_events": _counts(events),
        "eager_warnings": [str(w.message) for w in caught if issubclass(w.category, ringpass.RingpassWarning)],
    }
    gathered = ringpass.backend(compiler="aot_eager", report="off", cache="gathered")
    model.forward = torch.compile(model.__class__.forward.__get__(model), backend=gathered)
    with record_ring_events() as events:
        results["gathered_same"] = torch.equal(model.generate(ids, **options), expected)
    results["gathered_events"], results["gathered_reports"] = _counts(events), [r.as_dict() for r in gathered.reports]
    model.forward = torch.compile(
        model.__class__.forward.__get__(model), backend=ringpass.backend(compiler="aot_eager")
    )
    try:
        model.generate(ids, **options)
        results["sharded_dynamic_cache"] = "no error"
    except ringpass.NotSupportedError as error:
        results["sharded_dynamic_cache"] = str(error)
    return results


class OwnCache:
    """A hand-written model's cache: per layer this rank's slots, and the global length."""

    def __init__(self, layers: int, max_new_tokens: int):
        self.slots, self.length, self.prompt_len, self.max_new_tokens = [None] * layers, 0, None, max_new_tokens


class OwnCacheDecoder(nn.Module):
    """A decoder written by hand that keeps its own KV cache sharded with lowering's slot operations and builds
    its causal mask from positions; ``cache=None`` runs the whole sequence without a cache."""

    def __init__(self, dim: int = 32, heads: int = 4, kv_heads: int = 2, layers: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.embed, self.position = nn.Embedding(VOCAB, dim), nn.Embedding(256, dim)
        self.qkv = nn.ModuleList(nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor, cache: OwnCache | None = None) -> torch.Tensor:
        batch, t = ids.shape
        start = 0 if cache is None else cache.length
        positions = torch.arange(t) + start
        x = self.embed(ids) + self.position(positions)
        group = dist.group.WORLD.group_name if dist.is_initialized() else ""
        for i, (qkv, out) in enumerate(zip(self.qkv, self.out)):
            q, k, v = (
                qkv(x)
                .view(batch, t, -1, self.head_dim)
                .transpose(1, 2)
                .split([self.heads, self.kv_heads, self.kv_heads], dim=1)
            )
            keys, values, key_positions = k, v, positions
            if cache is not None and cache.prompt_len is None:  # the prefill keeps this rank's slots
                capacity = slot_count(t, cache.max_new_tokens, dist.get_world_size() if group else 1)
                cache.slots[i] = prompt_slots(k, v, capacity, t, "zigzag", False, group)
            elif cache is not None:  # a decode step: write the new keys where they belong, attend to all
                k_slots, v_slots, slot_pos = cache.slots[i]
                append_slots(k_slots, v_slots, slot_pos, k, v, start, cache.prompt_len, group)
                keys, values = (whole_cache(s, slot_pos, start + t, group) for s in (k_slots, v_slots))
                key_positions = torch.arange(start + t)
            visible = key_positions[None, :] <= positions[:, None]
            attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, enable_gqa=True)
            x = x + out(attended.transpose(1, 2).reshape(batch, t, -1))
        if cache is not None:
            cache.prompt_len = t if cache.prompt_len is None else cache.prompt_len
            cache.length = start + t
        return self.head(x)


def own_cache_generate(rank: int, world_size: int, prompt_len: int, new: int) -> dict:
    """Greedy generation of `OwnCacheDecoder` through the ring backend (prefill: ring; steps: decode over the
    slots) against the same model recomputing the whole sequence unsharded at every step."""
    model = OwnCacheDecoder().eval()
    ids, _ = _prompt(2, prompt_len, False)
    backend = ringpass.backend(compiler="aot_eager", report="off")
    compiled = torch.compile(model, backend=backend)
    cache, sequence, errors, same = OwnCache(len(model.qkv), new), ids, [], True
    with torch.no_grad(), record_ring_events() as events:
        step_ids = ids
        for _ in range(new):
            logits = compiled(step_ids, cache)[:, -1]
            expected = model(sequence)[:, -1]
            errors.append(rel_err(logits, expected))
            same = same and torch.equal(logits.argmax(-1), expected.argmax(-1))
            step_ids = expected.argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, step_ids], 1)
    return {
        "same_tokens": same,
        "logits": max(errors),
        "events": _counts(events),
        "statuses": [r.status for r in backend.reports],
        "decode": [r.decode for r in backend.reports],
        "held": [sorted(p for p in s[2].tolist() if p != FREE) for s in cache.slots],
    }


def hf_generate_as_documented(rank: int, world_size: int) -> dict:
    """``ringpass.generate(model, ...)`` with nothing else said (backend "ring", Inductor compiling), then with
    ``dynamic=True`` (aot_eager) for two prompt lengths: tokens, events, compiles."""
    model = build("llama").eval()
    runs = (
        ("default", 13, {}),
        ("dynamic", 13, {"dynamic": True, "backend": ringpass.backend(compiler="aot_eager")}),
        ("dynamic again", 17, None),
    )
    generate = {
        name: dict(max_new_tokens=5, do_sample=False, pad_token_id=0, attention_mask=_prompt(2, n, True)[1])
        for name, n, _ in runs
    }
    # the unsharded tokens first: ringpass.generate leaves model.forward compiled
    expected = {name: model.generate(_prompt(2, n, True)[0], **generate[name]) for name, n, _ in runs}
    results = {}
    for name, prompt_len, options in runs:
        ids, generate_options = _prompt(2, prompt_len, True)[0], generate[name]
        options = results["dynamic"]["options"] if options is None else options  # the same compiled forward
        before = len(options["backend"].reports) if "backend" in options else 0
        with record_ring_events() as events:
            got = ringpass.generate(model, ids, **options, **generate_options)
        results[name] = {
            "same_tokens": torch.equal(got, expected[name]),
            "events": _counts(events),
            "options": options,
            "compiles": len(options["backend"].reports) - before if "backend" in options else None,
        }
    for result in results.values():
        result.pop("options")
    return results
