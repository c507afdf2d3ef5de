"""Generation from a prompt prefilled through the ring, with the KV cache kept sharded between decode steps
(`ringpass.ShardedCache`, `ringpass.generate`): greedy tokens and per-step logits against the unsharded model,
and proof that the ring ran, the cache is sharded and no key or value was gathered."""

from functools import lru_cache

import pytest

import generation_workers
from lowering.sharded_cache import slot_count
from ringpass.launch import spawn_ranks

# (family, prompt length, left padded, new tokens): prompts 2P does not divide; Mistral's window is 5 keys
CASES = [("llama", 11, False, 5), ("llama", 13, True, 6), ("mistral", 13, True, 7)]


@lru_cache(maxsize=None)
def generated(world_size: int, cases: tuple = tuple(CASES)) -> list:
    return spawn_ranks(generation_workers.hf_generate, world_size, (list(cases),), timeout=600)


def check_generated(world_size: int, per_rank: list, cases) -> None:
    for index, (name, prompt_len, padded, new) in enumerate(cases):
        results = [rank[index] for rank in per_rank]
        for result in results:
            assert result["same_tokens"], (name, padded)
            assert result["logits"] < 1e-4, (name, padded, result["logits"])
            assert result["steps"] == new
            layers = result["layers"]
            events = result["events"]
            # the prefill ran the ring (P - 1 KV exchanges per layer), each decode step one merge per layer,
            # and no key or value was ever gathered
            assert events.get("exchange") == layers * (world_size - 1), events
            assert events.get("decode_merge") == layers * (new - 1), events
            assert "cache_gather" not in events, events
            # one prefill, then decode graphs: compiled again once when the cache length first changes
            assert result["statuses"] == ["rewritten"] * 3 and result["decode"] == [0, layers, layers], result
            assert result["slots_hold_cache"]
        for layer in range(results[0]["layers"]):  # every position on exactly one rank
            held = [p for result in results for p in result["held"][layer]]
            assert sorted(held) == list(range(prompt_len + new - 1)), held
        slots = slot_count(prompt_len, new, world_size)
        for result in results:  # keys and values of `slots` positions per rank, of the whole cache's length
            length = prompt_len + new - 1
            if name == "llama":
                assert result["slot_bytes"] == pytest.approx(result["whole_bytes"] * slots / length, rel=0.05)


def test_generate_equals_the_unsharded_model_with_the_cache_sharded_on_2_ranks():
    check_generated(2, generated(2), CASES)


@pytest.mark.heavy
def test_generate_equals_the_unsharded_model_with_the_cache_sharded_on_4_ranks():
    check_generated(4, generated(4), CASES)


def test_a_model_with_its_own_cache_generates_through_the_ring_and_decodes_over_its_slots():
    prompt_len, new = 11, 5
    per_rank = spawn_ranks(generation_workers.own_cache_generate, 2, (prompt_len, new), timeout=300)
    for result in per_rank:
        assert result["same_tokens"] and result["logits"] < 1e-4, result
        assert result["events"].get("exchange") == 2 and result["events"].get("decode_merge") == 2 * (new - 1)
        assert "cache_gather" not in result["events"]
        # its length is an int that changed between the prefill and the first step: one decode graph, dynamic
        assert result["statuses"] == ["rewritten"] * 2 and result["decode"] == [0, 2]
    for layer in range(2):
        held = [p for result in per_rank for p in result["held"][layer]]
        assert sorted(held) == list(range(prompt_len + new - 1))


def test_cache_options_without_the_ring_gathered_and_a_dynamic_cache_refused():
    for result in spawn_ranks(generation_workers.hf_cache_options, 2, timeout=300):
        # no backend: every decode step gathers the whole cache and the numbers stay the model's
        assert result["eager_same"] and result["eager_events"].get("cache_gather", 0) > 0
        assert len(result["eager_warnings"]) == 1 and "gathered from every rank" in result["eager_warnings"][0]
        assert result["gathered_same"] and "decode_merge" not in result["gathered_events"]
        assert result["gathered_events"].get("exchange") == 2  # the prefill still ran the ring
        assert any("cache='gathered'" in line for line in result["gathered_reports"])
        assert "ringpass.ShardedCache" in result["sharded_dynamic_cache"]
        assert "options={'cache': 'gathered'}" in result["sharded_dynamic_cache"]
