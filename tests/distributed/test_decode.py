"""lowering.decode_attention: new queries against a KV cache that stays sharded, at 2 and 4 gloo ranks,
against fp64 attention over the whole cache (left padding, sliding windows, GQA, prompts that 2P does not
divide); the cache's ownership rule; one small all-gather per call and no KV traffic. The same steps through
`lowering.sharded_cache`'s slots (prompt slots, appends, the model's mask over global positions)."""

from functools import cache

import decode_workers
import pytest
import torch

from lowering import InvalidInputError
from lowering.decode import decode_attention, new_position_owner
from ringpass.cli.launch import spawn_ranks

# (prompt length, generated tokens, new queries this step, window)
CASES = [(11, 0, 1, None), (11, 5, 1, None), (13, 6, 3, None), (11, 5, 1, 4), (9, 2, 2, 2)]


@cache
def results(world_size: int) -> list:
    return spawn_ranks(decode_workers.decode_step, world_size, (CASES,), timeout=300)


@pytest.mark.timeout(360)
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.heavy)])
def test_decode_matches_fp64_attention_over_the_whole_cache(world_size):
    for rank, per_rank in enumerate(results(world_size)):
        for case, r in per_rank.items():
            assert r["error"] <= 1e-12, (rank, case, r)
            assert r["slots_error"] <= 1e-12 and r["whole_cache_exact"], (rank, case, r)  # lowering.sharded_cache


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.heavy)])
def test_one_merge_of_out_and_lse_per_call_and_no_kv_traffic(world_size):
    b, hq, d = decode_workers.B, decode_workers.HQ, decode_workers.D
    for per_rank in results(world_size):
        for (_, _, t, _), r in per_rank.items():
            assert r["merges"] == 1 and r["kv_exchanges"] == 0, r
            assert r["bytes"] == [b * hq * t * (d + 1) * 8], r  # out and LSE of the new queries, fp64


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.heavy)])
def test_the_cache_stays_sharded_by_the_ownership_rule(world_size):
    """Every position is held by exactly one rank: the prompt's where the zigzag layout put them, the
    generated ones round-robin from the first rank."""
    prompt_len, generated = 11, 5
    held = [set(per_rank[(prompt_len, generated, 1, None)]["positions"]) for per_rank in results(world_size)]
    assert sum(map(len, held)) == prompt_len + generated and set().union(*held) == set(range(prompt_len + generated))
    for p in range(prompt_len, prompt_len + generated):
        assert p in held[(p - prompt_len) % world_size]


def test_owner_of_a_prompt_position_is_the_layout_not_the_rule():
    assert [new_position_owner(p, 10, 4) for p in range(10, 16)] == [0, 1, 2, 3, 0, 1]
    with pytest.raises(InvalidInputError, match="position 3 is in the prompt"):
        new_position_owner(3, 10, 4)


def test_inputs_that_need_gradients_or_do_not_fit_are_refused():
    q, k = torch.randn(1, 4, 1, 8, requires_grad=True), torch.randn(1, 2, 5, 8)
    with pytest.raises(InvalidInputError, match="requires gradients: decode attention is for inference"):
        decode_attention(q, k, k, q_pos=torch.tensor([5]), kv_pos=torch.arange(5))
    with pytest.raises(InvalidInputError, match="kv_pos \\[5\\]"):
        decode_attention(q.detach(), k, k, q_pos=torch.tensor([5]), kv_pos=torch.arange(4))
    with pytest.raises(InvalidInputError, match="window=3 needs is_causal=True"):
        decode_attention(q.detach(), k, k, q_pos=torch.tensor([5]), kv_pos=torch.arange(5), window=3, is_causal=False)
