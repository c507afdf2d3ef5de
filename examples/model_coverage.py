"""Which Hugging Face families train through the ring: builds each from a small config (random weights,
no downloads; a causal LM, or a masked LM for encoders), runs one training step (labels, loss, backward)
compiled with backend="ring" on P gloo processes against the same model run whole, and writes the table in
docs/models.md.

    python examples/model_coverage.py                     # every family, P=2, writes docs/models.md
    python examples/model_coverage.py llama gemma2 --world-size 4 --no-write
    python examples/model_coverage.py --dynamic           # dynamic=True: writes docs/models-dynamic.md

With ``--dynamic`` each family is compiled with ``dynamic=True`` and the compiled model also runs a forward
at a second length (``SEQ + 6``) against the whole model: one compile serves both.

Status per family: "rewritten" (every attention became ring attention; the errors are the largest
relative errors of loss, logits and parameter gradients, fp32), "refused" (the backend's reason), "no
attention" (it would run unsharded), "wrong gradients" (a parameter receives a gradient in one run and none
in the other) or "WRONG ANSWER" (an error above 1e-3): never counted as a pass, the script then exits 1; or
"error" (anything else, with its first line).
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
from collections import Counter
from pathlib import Path

import torch
import transformers

import ringpass
from lowering import record_ring_events
from ringpass.cli.launch import RankFailure, spawn_ranks

VOCAB, SEQ = 61, 13
STATIC_RETRACE = "traced again with static shapes"  # a report note (ringpass.frontend.retrace)
WRONG = 1e-3  # fp32: a larger error is a wrong answer, never a pass (the worst right one measured: 2e-4)
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
)
GQA = dict(SMALL, num_key_value_heads=2)
ENCODER = dict(SMALL, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
# a Mamba2 mixer of 4 heads of 16 (hidden 32, expand 2), state 8, one group, chunks of 8 (Bamba's spelling of it)
MAMBA2_MIXER = dict(
    mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_expand=2, mamba_chunk_size=8
)
# a Gated DeltaNet layer of 4 value heads (2 key heads) of 8, then an attention layer (Qwen3-Next's spelling of it)
GATED_DELTANET = dict(
    layer_types=["linear_attention", "full_attention"],
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
# family -> (config class, config keywords, attention implementation[, "masked-lm" or "token-classification": an
# encoder with that head, else a causal LM])
FAMILIES = {
    "llama": ("LlamaConfig", GQA, "sdpa"),
    "llama (eager)": ("LlamaConfig", GQA, "eager"),
    "mistral": ("MistralConfig", dict(GQA, sliding_window=5), "sdpa"),
    "qwen2": ("Qwen2Config", GQA, "sdpa"),
    "qwen3": ("Qwen3Config", dict(GQA, head_dim=8), "sdpa"),
    "gemma": ("GemmaConfig", dict(GQA, head_dim=8), "sdpa"),
    "gemma2": ("Gemma2Config", dict(GQA, head_dim=8, sliding_window=5), "eager"),
    "gemma3": ("Gemma3TextConfig", dict(GQA, head_dim=8, sliding_window=5), "sdpa"),
    "gemma3 (bidirectional)": (
        "Gemma3TextConfig",
        dict(GQA, head_dim=8, sliding_window=5, use_bidirectional_attention=True),
        "sdpa",
    ),
    "phi": ("PhiConfig", dict(SMALL, resid_pdrop=0.0, embd_pdrop=0.0), "sdpa"),
    "phi3": ("Phi3Config", dict(GQA, resid_pdrop=0.0, embd_pdrop=0.0, pad_token_id=0), "sdpa"),
    "gpt2": (
        "GPT2Config",
        dict(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=256,
            attn_pdrop=0.0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        ),
        "sdpa",
    ),
    "gpt2 (eager)": (
        "GPT2Config",
        dict(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=256,
            attn_pdrop=0.0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        ),
        "eager",
    ),
    "gpt_neox": ("GPTNeoXConfig", dict(SMALL, hidden_dropout=0.0), "sdpa"),
    "gptj": (
        "GPTJConfig",
        dict(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=256,
            rotary_dim=4,
            attn_pdrop=0.0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        ),
        "eager",
    ),
    "falcon": (
        "FalconConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_kv_heads=2,
            new_decoder_architecture=True,
            alibi=False,
            hidden_dropout=0.0,
        ),
        "sdpa",
    ),
    "bloom": ("BloomConfig", dict(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0), "eager"),
    "mpt": ("MptConfig", dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=256), "eager"),
    "opt": (
        "OPTConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
            dropout=0.0,
            word_embed_proj_dim=32,
        ),
        "sdpa",
    ),
    "stablelm": ("StableLmConfig", dict(GQA, hidden_dropout=0.0), "sdpa"),
    "starcoder2": ("Starcoder2Config", dict(GQA, residual_dropout=0.0, embedding_dropout=0.0), "sdpa"),
    "cohere": ("CohereConfig", GQA, "sdpa"),
    "olmo": ("OlmoConfig", GQA, "sdpa"),
    "olmo2": ("Olmo2Config", GQA, "sdpa"),
    "granite": ("GraniteConfig", GQA, "sdpa"),
    "glm4": ("Glm4Config", dict(GQA, head_dim=8, pad_token_id=0), "sdpa"),
    "mixtral": ("MixtralConfig", dict(GQA, num_local_experts=4, num_experts_per_tok=2), "sdpa"),
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            GQA,
            num_key_value_heads=4,
            moe_intermediate_size=16,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=4,
            qk_nope_head_dim=8,
            v_head_dim=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
        "sdpa",
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(GQA, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
        "sdpa",
    ),
    "qwen2 (eager)": ("Qwen2Config", GQA, "eager"),
    "mistral (eager)": ("MistralConfig", dict(GQA, sliding_window=5), "eager"),
    "phi (eager)": ("PhiConfig", dict(SMALL, resid_pdrop=0.0, embd_pdrop=0.0), "eager"),
    "gemma3 (eager)": ("Gemma3TextConfig", dict(GQA, head_dim=8, sliding_window=5), "eager"),
    "codegen": (
        "CodeGenConfig",
        dict(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            rotary_dim=4,
            n_positions=256,
            n_ctx=256,
            n_inner=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        ),
        "eager",
    ),
    "gpt_neo": (
        "GPTNeoConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            num_layers=2,
            num_heads=4,
            intermediate_size=64,
            max_position_embeddings=256,
            attention_types=[[["global", "local"], 1]],
            window_size=5,
            embed_dropout=0.0,
            resid_dropout=0.0,
        ),
        "eager",
    ),
    "gpt_bigcode (multi-query)": (
        "GPTBigCodeConfig",
        dict(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=256,
            multi_query=True,
            attn_pdrop=0.0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        ),
        "sdpa",
    ),
    "gpt_bigcode": (
        "GPTBigCodeConfig",
        dict(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=256,
            multi_query=False,
            attn_pdrop=0.0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        ),
        "sdpa",
    ),
    "persimmon": ("PersimmonConfig", dict(SMALL, hidden_dropout=0.0, partial_rotary_factor=0.5), "sdpa"),
    "cohere2": ("Cohere2Config", dict(GQA, sliding_window=5), "sdpa"),
    "olmo3": ("Olmo3Config", dict(GQA, sliding_window=5), "sdpa"),
    "exaone4": ("Exaone4Config", dict(GQA, head_dim=8, sliding_window=5, sliding_window_pattern=2), "sdpa"),
    "smollm3": ("SmolLM3Config", dict(GQA, pad_token_id=0), "sdpa"),
    "helium": ("HeliumConfig", dict(GQA, head_dim=8), "sdpa"),
    "nemotron": ("NemotronConfig", dict(GQA, head_dim=8, partial_rotary_factor=0.5), "sdpa"),
    "ernie4_5": ("Ernie4_5Config", dict(GQA, head_dim=8), "sdpa"),
    "seed_oss": ("SeedOssConfig", dict(GQA, head_dim=8, residual_dropout=0.0), "sdpa"),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", dict(GQA, head_dim=8), "sdpa"),
    "arcee": ("ArceeConfig", GQA, "sdpa"),
    "apertus": ("ApertusConfig", GQA, "sdpa"),
    "bitnet": ("BitNetConfig", GQA, "sdpa"),
    "glm": ("GlmConfig", dict(GQA, head_dim=8, pad_token_id=0), "sdpa"),
    "llama4_text": (
        "Llama4TextConfig",
        dict(
            GQA,
            head_dim=8,
            intermediate_size_mlp=64,
            num_local_experts=2,
            num_experts_per_tok=1,
            attention_chunk_size=5,
            interleave_moe_layer_step=3,
            no_rope_layers=[1, 0],
        ),
        "sdpa",
    ),  # chunked attention, a no-RoPE layer
    "llama4_text (MoE)": (
        "Llama4TextConfig",
        dict(
            GQA,
            head_dim=8,
            intermediate_size_mlp=64,
            num_local_experts=2,
            num_experts_per_tok=1,
            attention_chunk_size=5,
            interleave_moe_layer_step=1,
        ),
        "sdpa",
    ),
    "granitemoe": ("GraniteMoeConfig", dict(GQA, num_local_experts=4, num_experts_per_tok=2), "sdpa"),
    "olmoe": ("OlmoeConfig", dict(GQA, num_experts=4, num_experts_per_tok=2), "sdpa"),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(GQA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16),
        "sdpa",
    ),
    "phimoe": ("PhimoeConfig", dict(GQA, num_local_experts=4, num_experts_per_tok=2, sliding_window=None), "sdpa"),
    "dbrx": (
        "DbrxConfig",
        dict(
            vocab_size=VOCAB,
            d_model=32,
            n_heads=4,
            n_layers=2,
            max_seq_len=256,
            resid_pdrop=0.0,
            emb_pdrop=0.0,
            attn_config=dict(kv_n_heads=2, attn_pdrop=0.0, rope_theta=10000.0, clip_qkv=8.0),
            ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2),
        ),
        "sdpa",
    ),
    "jetmoe": (
        "JetMoeConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_key_value_heads=2,
            kv_channels=8,
            intermediate_size=64,
            max_position_embeddings=256,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
        "sdpa",
    ),
    "deepseek_v2": (
        "DeepseekV2Config",
        dict(
            GQA,
            num_key_value_heads=4,
            moe_intermediate_size=16,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=4,
            qk_nope_head_dim=8,
            v_head_dim=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
        "sdpa",
    ),  # complex-number RoPE
    "minimax": (
        "MiniMaxConfig",
        dict(
            GQA,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            block_size=4,
            layer_types=["linear_attention", "full_attention"],
        ),
        "sdpa",
    ),
    "zamba2": (
        "Zamba2Config",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            mamba_d_state=8,
            mamba_headdim=16,
            n_mamba_heads=4,
            mamba_ngroups=1,
            max_position_embeddings=256,
            layers_block_type=["mamba", "hybrid"],
            hybrid_layer_ids=[1],
        ),
        "sdpa",
    ),
    "jamba": (
        "JambaConfig",
        dict(
            GQA,
            num_experts=2,
            num_experts_per_tok=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            attn_layer_period=2,
            attn_layer_offset=1,
            mamba_d_state=8,
            mamba_expand=2,
            use_mamba_kernels=False,
        ),
        "sdpa",
    ),
    # hybrids and state-space models: sequence mixers besides attention (docs/backend.md, "Sequence mixers")
    "lfm2": ("Lfm2Config", dict(GQA, layer_types=["conv", "full_attention"], conv_L_cache=3), "sdpa"),
    "mamba2": (
        "Mamba2Config",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_heads=4,
            head_dim=16,
            state_size=8,
            n_groups=1,
            conv_kernel=4,
            chunk_size=8,
        ),
        "eager",  # no attention (Hugging Face refuses "sdpa" for it)
    ),
    "bamba": (
        "BambaConfig",
        dict(GQA, attn_layer_indices=[1], **MAMBA2_MIXER, mamba_d_conv=4),
        "sdpa",
    ),
    "falcon_h1": ("FalconH1Config", dict(GQA, **MAMBA2_MIXER, mamba_d_conv=4, mamba_d_ssm=64), "sdpa"),
    "nemotron_h": (
        "NemotronHConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            layers_block_type=["mamba", "attention"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=256,
            mamba_num_heads=4,
            mamba_head_dim=16,
            ssm_state_size=8,
            n_groups=1,
            conv_kernel=4,
            expand=2,
            chunk_size=8,
            use_mamba_kernels=False,
        ),
        "sdpa",
    ),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        dict(
            GQA,
            layer_types=["mamba", "attention"],
            num_local_experts=2,
            num_experts_per_tok=1,
            shared_intermediate_size=64,
            **MAMBA2_MIXER,
            mamba_d_conv=4,
        ),
        "sdpa",
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        dict(
            GQA,
            head_dim=8,
            **GATED_DELTANET,
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
        ),
        "sdpa",
    ),
    "qwen3_5": (
        "Qwen3_5TextConfig",
        dict(GQA, head_dim=8, **GATED_DELTANET),
        "sdpa",
    ),
    "olmo_hybrid": (
        "OlmoHybridConfig",
        dict(GQA, pad_token_id=0, **GATED_DELTANET),
        "sdpa",
    ),
    "kimi_linear": (
        "KimiLinearConfig",
        dict(
            SMALL,
            pad_token_id=0,
            layer_types=["linear_attention", "full_attention"],
            linear_head_dim=8,
            linear_num_heads=4,
            linear_conv_kernel_dim=4,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=4,
            qk_nope_head_dim=8,
            v_head_dim=8,
        ),
        "sdpa",
    ),
    "recurrent_gemma": (
        "RecurrentGemmaConfig",
        dict(
            GQA,
            num_key_value_heads=1,
            block_types=["recurrent", "attention"],
            lru_width=32,
            attention_window_size=8,
            conv1d_width=4,
        ),
        "sdpa",
    ),
    "bert (masked LM)": ("BertConfig", ENCODER, "sdpa", "masked-lm"),
    "roberta (masked LM)": ("RobertaConfig", dict(ENCODER, pad_token_id=1), "sdpa", "masked-lm"),
    "xlm-roberta (masked LM)": ("XLMRobertaConfig", dict(ENCODER, pad_token_id=1), "sdpa", "masked-lm"),
    "distilbert (masked LM)": (
        "DistilBertConfig",
        dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=256, dropout=0.0),
        "sdpa",
        "masked-lm",
    ),
    "electra (masked LM)": ("ElectraConfig", dict(ENCODER, embedding_size=16), "sdpa", "masked-lm"),
    "albert (masked LM)": ("AlbertConfig", dict(ENCODER, embedding_size=16), "sdpa", "masked-lm"),
    "ernie (masked LM)": ("ErnieConfig", ENCODER, "sdpa", "masked-lm"),
    "modernbert (masked LM)": (
        "ModernBertConfig",
        dict(
            SMALL,
            global_attn_every_n_layers=2,
            local_attention=4,
            mlp_dropout=0.0,
            embedding_dropout=0.0,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            cls_token_id=1,
            sep_token_id=2,
        ),
        "sdpa",
        "masked-lm",
    ),  # global and local (window 4, both ways) layers
    "nomic_bert (masked LM)": ("NomicBertConfig", ENCODER, "sdpa", "masked-lm"),
    "esm (masked LM)": (
        "EsmConfig",
        dict(
            ENCODER,
            pad_token_id=1,
            mask_token_id=2,
            position_embedding_type="rotary",
            token_dropout=False,
            emb_layer_norm_before=False,
        ),
        "sdpa",
        "masked-lm",
    ),
    "megatron_bert (masked LM)": ("MegatronBertConfig", ENCODER, "eager", "masked-lm"),
    "roformer (masked LM)": ("RoFormerConfig", dict(ENCODER, embedding_size=32), "eager", "masked-lm"),
    "big_bird (masked LM)": (
        "BigBirdConfig",
        dict(ENCODER, attention_type="original_full", sep_token_id=3),
        "eager",
        "masked-lm",
    ),
    "deberta-v2 (masked LM)": (
        "DebertaV2Config",
        dict(
            ENCODER, relative_attention=True, pos_att_type=["p2c", "c2p"], max_relative_positions=-1, position_buckets=8
        ),
        "eager",
        "masked-lm",
    ),
    "mpnet (masked LM)": ("MPNetConfig", dict(ENCODER, pad_token_id=1), "eager", "masked-lm"),
    "t5 (encoder, token classification)": (
        "T5Config",
        dict(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            num_labels=VOCAB,
            dropout_rate=0.0,
            classifier_dropout=0.0,
        ),
        "sdpa",
        "token-classification",
    ),
    "t5 (encoder, eager)": (
        "T5Config",
        dict(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            num_labels=VOCAB,
            dropout_rate=0.0,
            classifier_dropout=0.0,
        ),
        "eager",
        "token-classification",
    ),
    "funnel (masked LM)": (
        "FunnelConfig",
        dict(
            vocab_size=VOCAB,
            block_sizes=[1, 1],
            num_decoder_layers=1,
            d_model=32,
            n_head=4,
            d_head=8,
            d_inner=64,
            hidden_dropout=0.0,
            activation_dropout=0.0,
        ),
        "eager",
        "masked-lm",
    ),
    "longformer (masked LM)": (
        "LongformerConfig",
        dict(ENCODER, attention_window=4, pad_token_id=1),
        "eager",
        "masked-lm",
    ),
    "xlm (masked LM)": (
        "XLMConfig",
        dict(vocab_size=VOCAB, emb_dim=32, n_layers=2, n_heads=4, dropout=0.0, max_position_embeddings=256),
        "eager",
        "masked-lm",
    ),
}


def build(family: str) -> torch.nn.Module:
    config_class, keywords, implementation, *head = FAMILIES[family]
    config = getattr(transformers, config_class)(**{"attention_dropout": 0.0, **keywords})
    config._attn_implementation = implementation
    torch.manual_seed(0)
    if head == ["masked-lm"]:
        return transformers.AutoModelForMaskedLM.from_config(config).train()
    if head == ["token-classification"]:
        return transformers.AutoModelForTokenClassification.from_config(config).train()
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.loss_type = "ForCausalLM"  # GPT-2's default loss property breaks the graph
    return model.train()


def training_step(rank: int, world_size: int, family: str, dynamic: bool = False) -> dict:
    """One step compiled with the ring against the model run whole: errors, the report, KV exchanges (with
    ``dynamic``, the logits at a second length too, from the same compile)."""
    model = build(family)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    kwargs = {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
    expected = model(**kwargs)
    expected.loss.backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    backend = ringpass.backend(compiler="aot_eager", report="off")
    compiled = torch.compile(model, backend=backend, dynamic=True if dynamic else None)
    with record_ring_events() as events:
        got = compiled(**kwargs)
        got.loss.backward()
    other_length = []
    if dynamic:
        longer = torch.randint(0, VOCAB, (2, SEQ + 6), generator=torch.Generator().manual_seed(2))
        graphs = len(backend.reports)
        call = {"input_ids": longer, "labels": longer.clone(), "use_cache": False}  # as the first call: no recompile
        other_length = [(compiled(**call).logits.detach(), model(**call).logits.detach())]
        if not all(STATIC_RETRACE in " ".join(r.notes) for r in backend.reports[graphs:]):  # (a chunked scan's
            raise RuntimeError(f"the dynamic compile did not serve {SEQ + 6} tokens: it compiled again")  # do)

    def err(a, b):
        return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()

    # a gradient that is zero in exact arithmetic (a key bias under softmax) is measured against 1e-6 of the largest
    floor = 1e-6 * max(g.abs().max().item() for g in expected_grads.values())
    grads = [
        ((p.grad - expected_grads[n]).abs().max() / max(expected_grads[n].abs().max().item(), floor)).item()
        for n, p in model.named_parameters()
        if n in expected_grads and p.grad is not None
    ]
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    wrong = sorted(set(expected_grads) ^ trained)  # a parameter that trains in one run only: never a pass
    error = max(
        [err(got.loss, expected.loss), err(got.logits, expected.logits)] + grads + [err(a, b) for a, b in other_length]
    )
    status = "wrong gradients" if wrong else "WRONG ANSWER" if error > WRONG else _status(backend.reports)
    return {
        "status": status,
        "why": f"gradient only in one of the runs: {', '.join(wrong)}" if wrong else "",
        "error": error,
        "attention": sorted(
            {
                line.split(": ", 1)[1].split(" -> ")[0]
                for r in backend.reports
                for line in str(r).splitlines()
                if "-> ringpass::ring_attention" in line
            }
        ),
        "kv_exchanges": sum(e.kind == "exchange" and e.fields["payload"] == "kv" for e in events),
        "mixers": [f"{m.kind}: {m.strategy.split(':')[0]}" for r in backend.reports for m in r.mixers],
        "graphs": len(backend.reports),
        "per_length": any(STATIC_RETRACE in " ".join(r.notes) for r in backend.reports),
    }


def _status(reports) -> str:
    statuses = {r.status for r in reports}
    if "no attention" in statuses or not reports:
        return "no attention" if "rewritten" not in statuses else "partly rewritten (graph breaks)"
    return "rewritten"


def measure(family: str, world_size: int, dynamic: bool = False) -> dict:
    try:
        return spawn_ranks(training_step, world_size, (family, dynamic), timeout=600)[0]
    except RankFailure as failure:
        text = str(failure)
        refused = re.search(r"NotSupportedError: (.*)", text)
        if refused:
            return {"status": "refused", "why": refused.group(1).strip()}
        lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
        raised = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Failure): ", line)]
        return {"status": "error", "why": (raised or lines)[-1]}  # the error itself, not Dynamo's hints after it


def table(results: dict, world_size: int, dynamic: bool = False) -> str:
    lines = [
        "# Hugging Face families through the ring" + (", with dynamic shapes" if dynamic else ""),
        "",
        f"Measured {datetime.date.today()} with transformers {transformers.__version__}, torch {torch.__version__}, "
        f"on {world_size} gloo processes: `python examples/model_coverage.py{' --dynamic' if dynamic else ''}`. "
        + (
            f"Compiled with `dynamic=True`; the same compile also runs a forward at {SEQ + 6} tokens, whose logits "
            "count in the error (a second compile there is an error, but for a model with a chunked scan: the backend "
            "has Dynamo trace it again with static shapes, one compile per length, and the row says so). "
            if dynamic
            else ""
        )
        + "Each family is built from a small "
        "config (2 layers, hidden 32, 4 heads, random weights), one training step (labels, loss, backward, fp32, "
        f"{SEQ} tokens, batch 2; a causal LM, a masked LM for the encoders, token classification for T5's encoder) "
        'compiled with `backend="ring"` against the same model run whole. The error is the '
        "largest relative error of loss, logits and every parameter gradient; a parameter with a gradient in one run "
        'only is "wrong gradients" and an error above 1e-3 a "WRONG ANSWER", never a pass (a gradient that is zero '
        "in exact "
        "arithmetic, a key bias under softmax, is measured against 1e-6 of the largest gradient: OPT's and "
        "Megatron-BERT's worst are such, ~4e-11 absolute); KV hops counts the ring's KV "
        "exchanges on rank 0 (forward and backward), which an unsharded run would not make."
        + ("" if dynamic else " With `dynamic=True`: `docs/models-dynamic.md` (`--dynamic`).")
        + ' Default options: with `scans="state"` the calls of `torch_chunk_gated_delta_rule`, '
        "`chunk_kimi_delta_attention` and `mamba2_chunk_scan` pass their state instead (`tests/models/test_hf.py`, "
        'docs/backend.md "Chunked scans").',
        "",
        "| family | attention | status | max rel. error | KV hops | notes |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for family, r in results.items():
        spelling = FAMILIES[family][2]
        if r["status"] in ("refused", "error", "wrong gradients"):  # (a WRONG ANSWER row shows its error)
            why = re.sub(r"\S*/site-packages/", "", r["why"]).replace("|", "/")  # paths from the package root
            lines.append(f"| {family} | {spelling} | {r['status']} | | | {why[:300]} |")
        else:
            mixers = [f"{count} x {kind}" for kind, count in Counter(r.get("mixers", [])).items()]
            graphs = f"; {r['graphs']} graphs" if r["graphs"] > 1 else ""
            if r.get("per_length"):
                graphs = f"; {r['graphs']} graphs: {STATIC_RETRACE}, one per length"
            notes = "; ".join(r["attention"][:1] + mixers) + graphs
            lines.append(
                f"| {family} | {spelling} | {r['status']} | {r['error']:.1e} | {r['kv_exchanges']} | {notes} |"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("families", nargs="*", help=f"default: all of {', '.join(FAMILIES)}")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--dynamic", action="store_true", help="compile with dynamic=True, check a second length")
    parser.add_argument("--no-write", action="store_true", help="print the table instead of writing docs/models.md")
    args = parser.parse_args()
    results = {}
    for family in args.families or FAMILIES:
        results[family] = measure(family, args.world_size, args.dynamic)
        print(f"{family}: {results[family]['status']}", file=sys.stderr)
    text = table(results, args.world_size, args.dynamic)
    if args.no_write:
        print(text)
    else:
        name = "models-dynamic.md" if args.dynamic else "models.md"
        Path(__file__).resolve().parents[1].joinpath("docs", name).write_text(text)
    wrong = [family for family, r in results.items() if r["status"] in ("wrong gradients", "WRONG ANSWER")]
    if wrong:
        print(f"wrong gradients or answers: {', '.join(wrong)}", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
