"""Generation from a prompt prefilled through the ring, with the KV cache kept sharded between decode steps
(`ringpass.ShardedCache`, `ringpass.generate`): greedy tokens and per-step logits against the unsharded model,
and proof that the ring ran, the cache is sharded and no key or value was gathered."""

from functools import cache

import generation_workers
import hf_workers
import pytest
import torch
import torch.nn.functional as F

import ringpass
from lowering import whole_cache
from lowering.sharded_cache import slot_count
from ringpass.cli.launch import spawn_ranks

# (family, prompt length, left padded, new tokens): prompts 2P does not divide; Mistral's window is 5 keys
CASES = [("llama", 11, False, 5), ("llama", 13, True, 6), ("mistral", 13, True, 7)]


@cache
def generated(world_size: int, cases: tuple = tuple(CASES)) -> list:
    return spawn_ranks(generation_workers.hf_generate, world_size, (list(cases),), timeout=600)


def check_generated(world_size: int, per_rank: list, cases) -> None:
    for name, prompt_len, padded, new in cases:
        results = [rank[generation_workers.case_name((name, prompt_len, padded, new))] for rank in per_rank]
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
        assert all(r["logits_bits"] == results[0]["logits_bits"] for r in results)  # bit for bit on every rank
        for layer in range(results[0]["layers"]):  # every position on exactly one rank
            held = [p for result in results for p in result["held"][layer]]
            assert sorted(held) == list(range(prompt_len + new - 1)), held
        slots = slot_count(prompt_len, new, world_size)
        for result in results:  # keys and values of `slots` positions per rank, of the whole cache's length
            length = prompt_len + new - 1
            if name == "llama":
                assert result["slot_bytes"] == pytest.approx(result["whole_bytes"] * slots / length, rel=0.05)


@pytest.mark.heavy  # suite time (README, "Heavier cases")
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


@pytest.mark.heavy  # suite time (README, "Heavier cases")
def test_cache_options_without_the_ring_gathered_and_a_dynamic_cache_refused():
    for result in spawn_ranks(generation_workers.hf_cache_options, 2, timeout=300):
        # no backend: every decode step gathers the whole cache and the numbers stay the model's
        assert result["eager_same"] and result["eager_events"].get("cache_gather", 0) > 0
        assert len(result["eager_warnings"]) == 1 and "gathered from every rank" in result["eager_warnings"][0]
        assert result["gathered_same"] and "decode_merge" not in result["gathered_events"]
        assert result["gathered_events"].get("exchange") == 2  # the prefill still ran the ring
        assert any("cache='gathered'" in (report["cache"] or "") for report in result["gathered_reports"])
        assert "ringpass.ShardedCache" in result["sharded_dynamic_cache"]
        assert "options={'cache': 'gathered'}" in result["sharded_dynamic_cache"]


# ---- without processes: what one rank's cache does, and what the pass refuses (ringpass.inspect, offline) ----
def test_one_process_generates_with_a_sharded_cache_and_refuses_what_it_cannot_hold():
    model = hf_workers.build("llama").eval()
    ids = torch.randint(1, hf_workers.VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    cache = ringpass.ShardedCache(model.config, max_new_tokens=4)
    assert torch.equal(model.generate(ids, past_key_values=cache, **options), model.generate(ids, **options))
    held = [p for p in cache.layers[0].slot_pos.tolist() if p >= 0]
    assert held == list(range(10))  # one rank holds every position the steps attended to
    with pytest.raises(ringpass.InvalidInputError, match="The sharded KV cache is full"):
        model.generate(ids, past_key_values=ringpass.ShardedCache(model.config, max_new_tokens=2), **options)
    with pytest.raises(ringpass.NotSupportedError, match="beam search"):
        model.generate(
            ids, past_key_values=ringpass.ShardedCache(model.config, max_new_tokens=4), num_beams=2, **options
        )
    with pytest.raises(ringpass.NotSupportedError, match="cannot be cropped"):
        cache.crop(3)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"cache": "gathered"}, "cache='gathered'; drop the option or pass a DynamicCache"),
        ({"inputs": "sharded"}, "takes the whole prompt"),
    ],
)
def test_a_sharded_cache_prefill_is_refused_where_it_cannot_stay_sharded(options, message):
    model = hf_workers.build("llama").eval()
    ids = torch.randint(1, hf_workers.VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    cache = ringpass.ShardedCache(model.config, max_new_tokens=4)
    found = ringpass.inspect(model, {"input_ids": ids, "past_key_values": cache}, world_size=2, **options)
    assert found.status == "refused" and message in found.reports[0].refusal.message


class _DecodeStep(torch.nn.Module):
    """One decode attention over a sharded cache's whole view, spelled as a model might."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling

    def forward(self, q, k_slots, v_slots, slot_pos, k_whole, v_whole):
        if self.spelling == "plain cache":  # a cache held whole: keys concatenated, as a DynamicCache does
            return F.scaled_dot_product_attention(q, k_whole, v_whole, enable_gqa=True)
        keys, values = (whole_cache(s, slot_pos, k_whole.size(2), "") for s in (k_slots, v_slots))
        if self.spelling == "is_causal":
            return F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True)
        if self.spelling == "soft-cap":  # Gemma 2's written-out attention: c·tanh(scores / c)
            scores = torch.tanh(q @ keys.repeat_interleave(2, dim=1).mT * 8**-0.5 / 50.0) * 50.0
            return torch.softmax(scores, dim=-1) @ values.repeat_interleave(2, dim=1)
        if self.spelling == "with a prompt":  # a chunk of prompt attending to itself next to a decode step
            return F.scaled_dot_product_attention(q, q, q) + F.scaled_dot_product_attention(
                q, keys, values, enable_gqa=True
            )
        if self.spelling == "float mask":
            return F.scaled_dot_product_attention(
                q, keys, values, attn_mask=q.new_zeros(1, 1, 1, k_whole.size(2)), enable_gqa=True
            )
        return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)


@pytest.mark.parametrize(
    "spelling, options, status, message",
    [
        ("plain cache", {}, "refused", "pass past_key_values=ringpass.ShardedCache"),
        ("plain cache", {"cache": "gathered"}, "no attention", ""),
        ("is_causal", {}, "refused", "is_causal=True"),
        ("float mask", {}, "refused", "float mask"),
        ("soft-cap", {}, "refused", "modifies its scores"),
        ("with a prompt", {}, "refused", "one per graph"),
        ("no mask", {}, "rewritten", ""),
    ],
)
def test_decode_steps_are_recognised_from_the_graph(spelling, options, status, message):
    q, slots, slot_pos, whole = (
        torch.randn(1, 4, 1, 8),
        torch.randn(1, 2, 6, 8),
        torch.arange(6),
        torch.randn(1, 2, 6, 8),
    )
    found = ringpass.inspect(_DecodeStep(spelling), (q, slots, slots, slot_pos, whole, whole), world_size=2, **options)
    report = found.reports[0]
    assert found.status == status, str(report)
    if status == "refused":
        assert message in report.refusal.message
    elif status == "rewritten":  # the attention reads this rank's slots: one merge, no gather of the cache
        assert report.decode == 1 and [c.what for c in report.collectives] == ["decode attention's out and LSE"]
        assert "whole_cache" not in found.graphs[0].gm.code and "decode_over_slots" in found.graphs[0].gm.code
    else:  # the text users read: the summary line says why the graph runs unchanged
        assert "cache='gathered'" in report.summary()


@pytest.mark.heavy  # Inductor compiles three graphs on two ranks (~50 s)
def test_generate_as_documented_with_the_default_backend_and_inductor_and_dynamic_shapes():
    for per_rank in spawn_ranks(generation_workers.hf_generate_as_documented, 2, timeout=600):
        for name, result in per_rank.items():
            assert result["same_tokens"], (name, result)
            assert result["events"].get("decode_merge") == 2 * 4 and "cache_gather" not in result["events"], result
        # dynamic=True: the prefill twice (Dynamo restarts its first analysis), two decode graphs; another
        # prompt length compiles nothing new
        assert per_rank["dynamic"]["compiles"] == 4 and per_rank["dynamic again"]["compiles"] == 0, per_rank
