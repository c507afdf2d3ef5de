"""What each rank runs in the Hugging Face tests: tiny transformers models from configs (random weights,
no downloads), compiled with the ring backend, against the same model uncompiled in one process."""

from __future__ import annotations

import torch
import transformers

import ringpass
from reference import rel_err


def build(name: str):
    torch.manual_seed(0)
    if name == "llama":
        config = transformers.LlamaConfig(
            vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, attn_implementation="sdpa")
        return transformers.LlamaForCausalLM(config)
    config = transformers.GPT2Config(
        vocab_size=61, n_embd=32, n_layer=2, n_head=4, n_positions=128, attn_implementation="sdpa",
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def generate_prefill(rank: int, world_size: int, name: str, seq_len: int) -> dict:
    """(d) the default use_cache=True in eval: logits and the returned KV cache."""
    model = build(name).eval()
    ids = torch.randint(0, 61, (2, seq_len), generator=torch.Generator().manual_seed(1))
    backend = ringpass.backend(compiler="aot_eager")
    with torch.no_grad():
        expected = model(ids)
        got = torch.compile(model, backend=backend, fullgraph=True)(ids)
    cache = max(
        max(rel_err(g.keys, e.keys), rel_err(g.values, e.values))
        for g, e in zip(got.past_key_values.layers, expected.past_key_values.layers)
    )
    return {"logits": rel_err(got.logits, expected.logits), "cache": cache, "report": str(backend.reports[-1])}


def training_graph(rank: int, world_size: int, name: str) -> str:
    """use_cache=False (how one trains): HF builds an explicit mask; until mask lifting it is refused."""
    model = build(name)
    ids = torch.randint(0, 61, (2, 12))
    try:
        torch.compile(model, backend=ringpass.backend(compiler="eager"), fullgraph=True)(ids, use_cache=False)
    except Exception as error:  # Dynamo wraps the backend's error
        return str(error)
    return "no error"
