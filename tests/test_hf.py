"""Hugging Face transformers models through backend="ring", unchanged (fp32, relative error <= 1e-4).

What works so far: the default use_cache=True forward in eval (SDPA with is_causal=True; the KV cache
is gathered). Masks built by compiled training graphs (use_cache=False, padding, packed documents,
sliding windows) are refused until mask lifting lands (issue 4).
"""

import pytest

import hf_workers
from ringpass.launch import spawn_ranks


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_use_cache_forward_in_eval_matches_the_unsharded_model(name):
    for result in spawn_ranks(hf_workers.generate_prefill, 2, (name, 13), timeout=300):
        assert result["logits"] <= 1e-4 and result["cache"] <= 1e-4, result
        assert "2 attention(s) over 2 rank(s)" in result["report"]
        assert "all-gathered per call" in result["report"]  # the cost of returning the KV cache


def test_training_graph_with_an_explicit_mask_is_refused_plainly():
    for message in spawn_ranks(hf_workers.training_graph, 2, ("llama",), timeout=300):
        assert "has an explicit attn_mask" in message and "sdpa_attention.py" in message, message
