"""What each rank runs in the Hugging Face tests: tiny transformers models from configs (random weights,
no downloads), compiled with the ring backend, against the same model uncompiled in one process."""

from __future__ import annotations

import copy

import torch
import transformers
from reference import grad_error, rel_err

import lowering
import ringpass
from lowering import record_ring_events

VOCAB = 61


def build(name: str):
    """A tiny model by name; ``<family>-eager`` is the family with Hugging Face's written-out attention."""
    torch.manual_seed(0)
    name, _, implementation = name.partition("-")
    implementation = implementation or "sdpa"
    if name in ("llama", "qwen2"):  # Qwen2: Llama's shape with biased q/k/v projections
        config_class, model_class = {
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        }[name]
        config = config_class(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            attn_implementation=implementation,
        )
        return model_class(config)
    if name in ("falcon", "falcon_mqa"):  # the new decoder architecture (GQA), or the old one with one KV head
        config = transformers.FalconConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_kv_heads=2,
            new_decoder_architecture=name == "falcon",
            multi_query=name == "falcon_mqa",
            alibi=False,
            attention_dropout=0.0,
            hidden_dropout=0.0,
            attn_implementation=implementation,
        )
        return transformers.FalconForCausalLM(config)
    if name == "lfm2":  # a hybrid: short causal depthwise convolutions (width 3) between attention layers
        config = transformers.Lfm2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            layer_types=["conv", "full_attention", "conv"],
            conv_L_cache=3,
            max_position_embeddings=4096,
            attn_implementation=implementation,
        )
        return transformers.Lfm2ForCausalLM(config)
    if name in (
        "mamba2",
        "bamba",
        "zamba2",
        "qwen3_next",
        "jamba",
        "minimax",
        "qwen3_5",
        "olmo_hybrid",
        "kimi_linear",
    ):  # scans: chunked, unrolled
        import model_coverage  # examples/model_coverage.py: Mamba2 alone, the hybrids' two layers

        return model_coverage.build(name)
    if name == "recurrent_gemma":  # a convolution, then an unrolled recurrence filling out[:, t] step by step
        config = transformers.RecurrentGemmaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            block_types=["recurrent", "attention"],
            lru_width=32,
            attention_window_size=8,
            conv1d_width=4,
            attn_implementation=implementation,
        )
        return transformers.RecurrentGemmaForCausalLM(config)
    if name == "mistral":  # a sliding window of 5 keys
        config = transformers.MistralConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            sliding_window=5,
            attn_implementation=implementation,
        )
        return transformers.MistralForCausalLM(config)
    if name == "bloom":  # ALiBi: slopes 1/4, 1/16, ... times key positions (from the padding mask when given)
        config = transformers.BloomConfig(
            vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0
        )
        return transformers.BloomForCausalLM(config)
    if name == "mpt":  # ALiBi over max_seq_len, sliced to the sequence
        config = transformers.MptConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=256)
        return transformers.MptForCausalLM(config)
    if name == "mixtral":  # mixture of experts: tokens sorted by expert, grouped matmuls, order restored
        config = transformers.MixtralConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            attn_implementation=implementation,
        )
        return transformers.MixtralForCausalLM(config)
    if name == "llama4":  # MoE by tiling: hidden.repeat(experts, 1), scaled per expert, summed back; chunked attention
        config = transformers.Llama4TextConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            intermediate_size_mlp=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=2,
            num_experts_per_tok=1,
            attention_chunk_size=5,
            interleave_moe_layer_step=1,
            attn_implementation=implementation,
        )
        return transformers.Llama4ForCausalLM(config)
    if name == "deepseek_v3":  # MLA (keys 8 + 4 rotary wide, values 8; built by copy_ into new_empty) and its MoE
        config = transformers.DeepseekV3Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
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
            attn_implementation=implementation,
        )
        return transformers.DeepseekV3ForCausalLM(config)
    if name == "embeddinggemma":  # Gemma 3 with bidirectional attention: its mask built with vmap
        config = transformers.Gemma3TextConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=5,
            use_bidirectional_attention=True,
            attn_implementation=implementation,
        )
        return transformers.Gemma3ForCausalLM(config)
    if name == "gemma2":  # logit soft-capping (a small cap, so that it bites), every other layer a window of 5
        config = transformers.Gemma2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=5,
            attn_logit_softcapping=0.5,
            attention_dropout=0.0,
            initializer_range=0.5,
            attn_implementation="eager",
        )
        return transformers.Gemma2ForCausalLM(config)
    if name == "gpt_neo":  # eager only: a causal buffer (global layer) or a banded one (local, window 5) under the mask
        config = transformers.GPTNeoConfig(
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
            attention_dropout=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        return transformers.GPTNeoForCausalLM(config)
    if name == "t5":  # the T5 encoder: a learned bias table of relative-position buckets per head, shared by its layers
        config = transformers.T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            num_labels=VOCAB,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            dropout_rate=0.0,
            classifier_dropout=0.0,
            attn_implementation=implementation,
        )
        return transformers.T5ForTokenClassification(config)
    if name == "mpnet":  # a masked LM with a learned relative-position bucket table (eager attention only)
        config = transformers.MPNetConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=256,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            pad_token_id=1,
        )
        return transformers.MPNetForMaskedLM(config)
    if name == "biogpt":  # learned positions from the padding mask's cumsum, a finfo.min additive mask (eager)
        config = transformers.BioGptConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=256,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            attn_implementation=implementation,
        )
        return transformers.BioGptForCausalLM(config)
    if name == "roformer":  # a masked LM: rotary positions, token type ids made by torch.zeros(input_ids.size())
        config = transformers.RoFormerConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            embedding_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=256,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        return transformers.RoFormerForMaskedLM(config)
    if name == "codegen":  # eager only: (q kᵀ + mask) / scale, the scale outside the mask
        config = transformers.CodeGenConfig(
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
        )
        return transformers.CodeGenForCausalLM(config)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=128,
        attn_implementation=implementation,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config)
    if name != "gpt2_as_shipped":  # as shipped, GPT-2's loss property logs a warning, which breaks the graph
        model.loss_type = "ForCausalLM"
    return model


def batch(case: str, seq_len: int) -> dict:
    """The model's keyword arguments for one test case (batch of 2, labels included)."""
    ids = torch.randint(0, VOCAB, (2, seq_len), generator=torch.Generator().manual_seed(1))
    kwargs = {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
    if case == "left-padded":
        mask = torch.ones(2, seq_len, dtype=torch.long)
        mask[0, :4] = 0  # sequence 0 is 4 tokens shorter, padded on the left
        kwargs["attention_mask"] = mask
        kwargs["labels"] = ids.masked_fill(mask == 0, -100)
    elif case == "right-padded":
        mask = torch.ones(2, seq_len, dtype=torch.long)
        mask[0, -5:] = 0  # sequence 0 is 5 tokens shorter, padded on the right: every query still sees a key
        kwargs["attention_mask"] = mask
        kwargs["labels"] = ids.masked_fill(mask == 0, -100)
    elif (
        case == "rank-all-padding"
    ):  # both rows left-padded over all but their last token: some rank holds padding only
        mask = torch.ones(2, seq_len, dtype=torch.long)
        mask[:, :-1] = 0
        kwargs["attention_mask"] = mask
        kwargs["labels"] = ids.masked_fill(mask == 0, -100)
    elif case == "packed":  # three documents per row, positions restarting at each
        cut = [5, seq_len - 9, 4]
        kwargs["position_ids"] = torch.cat([torch.arange(n) for n in cut]).expand(2, -1).contiguous()
    elif case != "labels":
        raise ValueError(case)
    return kwargs


def training_step(
    rank: int,
    world_size: int,
    name: str,
    cases: list,
    seq_len: int,
    dynamic=None,
    checkpointed: str = "",
    reference: str = "",
    fullgraph: bool = True,
    options: dict | None = None,
) -> dict:
    """(a)-(c), (e): loss, logits and every parameter's gradient of compiled vs uncompiled, per case.
    With ``dynamic=True`` one compile serves the case at ``seq_len`` and at ``seq_len + 6``;
    ``checkpointed="reentrant" | "non-reentrant"`` turns on Hugging Face's gradient checkpointing;
    ``reference`` names the model run uncompiled when it is not ``name`` (the same weights); ``options``: the
    backend's, besides ``compiler="aot_eager"``."""
    results = {}
    for case in cases:
        torch._dynamo.reset()  # each case is a fresh compile, as in a user's process
        model = build(name)
        if checkpointed:
            enable_checkpointing(model, checkpointed)
        kwargs = batch(case, seq_len)
        unsharded = build(reference) if reference else model
        expected = unsharded(**kwargs)
        expected.loss.backward()
        expected_grads = {n: p.grad.clone() for n, p in unsharded.named_parameters() if p.grad is not None}
        unsharded.zero_grad()
        backend = ringpass.backend(compiler="aot_eager", **(options or {}))
        compiled = torch.compile(model, backend=backend, fullgraph=fullgraph, dynamic=dynamic)
        with record_ring_events() as events:
            got = compiled(**kwargs)
            got.loss.backward()
        trained = {n for n, p in model.named_parameters() if p.grad is not None}
        results[case] = {
            "untrained": sorted(set(expected_grads) - trained),
            "unexpected": sorted(trained - set(expected_grads)),
            "loss": rel_err(got.loss, expected.loss),
            "logits": rel_err(got.logits, expected.logits),
            "grads": grad_error(
                {n: p.grad for n, p in model.named_parameters()}, expected_grads
            ),  # BioGPT's key bias: 0
            "reports": [r.as_dict() for r in backend.reports],
            "kv_exchanges": sum(e.kind == "exchange" and e.fields["payload"] == "kv" for e in events),
            "kv_bytes": {e.fields["bytes"] for e in events if e.kind == "exchange" and e.fields["payload"] == "kv"},
            "mixer_exchanges": sum(e.kind == "mixer_exchange" for e in events),
            "all_gathers": sum(e.kind == "all_gather" for e in events),
            "heads_exchanges": sum(e.kind == "heads_exchange" for e in events),
            "saved_bytes": _saved_for_backward(compiled, kwargs),
        }
        if dynamic:
            longer = batch(case, seq_len + 6)
            results[case]["longer"] = rel_err(compiled(**longer).logits, model(**longer).logits)
    return results


def enable_checkpointing(model, kind: str) -> None:
    """Hugging Face's gradient checkpointing of ``kind`` ("reentrant" / "non-reentrant"), set up as
    `docs/training.md` says: Dynamo may skip replaying the forward's Python side effects in the recompute.
    Transformers >= 5.25 installs `kernels`, whose attention wrapper sets a context variable inside each
    checkpointed layer; without the flag Dynamo refuses it under ``fullgraph`` and otherwise leaves those layers
    to eager code."""
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": kind == "reentrant"})


def checkpointed_training_steps(rank: int, world_size: int, name: str, kinds: list, seq_len: int) -> dict:
    """`training_step` without ``fullgraph`` with Hugging Face's gradient checkpointing of each kind in ``kinds``
    (`enable_checkpointing`)."""
    return {
        kind: training_step(rank, world_size, name, ["labels"], seq_len, None, kind, fullgraph=False)["labels"]
        for kind in kinds
    }


def _saved_for_backward(compiled, kwargs) -> int:
    """Bytes of the tensors one (already compiled) forward saves for the backward."""
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        compiled(**kwargs)
    return sum(saved)


def training_steps(rank: int, world_size: int, runs: dict) -> dict:
    """`training_step` for each family of ``runs`` (name -> its arguments after ``name``; a name may carry a
    label after a space: ``"t5 dynamic"``), in one process."""
    return {name: training_step(rank, world_size, name.split()[0], *args) for name, args in runs.items()}


def logits_to_keep(rank: int, world_size: int, values: list) -> list:
    """GPT-2 compiled with ``dynamic=True`` and called with each ``logits_to_keep`` in turn (a symbolic int
    argument that slices the sequence): (value, logits' error against the whole model, logits' length, the
    ring's KV exchanges in that call)."""
    model = build("gpt2").eval()
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, backend=ringpass.backend(compiler="aot_eager"), fullgraph=True, dynamic=True)
    results = []
    with torch.no_grad():
        for value in values:
            with record_ring_events() as events:
                got = compiled(input_ids=ids, logits_to_keep=value, use_cache=False).logits
            results.append(
                (
                    value,
                    rel_err(got, model(input_ids=ids, logits_to_keep=value, use_cache=False).logits),
                    got.shape[1],
                    sum(e.kind == "exchange" and e.fields["payload"] == "kv" for e in events),
                )
            )
    return results


def generate_prefill(rank: int, world_size: int, name: str, seq_len: int) -> dict:
    """(d) the default use_cache=True in eval: logits and the returned KV cache."""
    model = build(name).eval()
    ids = torch.randint(0, VOCAB, (2, seq_len), generator=torch.Generator().manual_seed(1))
    backend = ringpass.backend(compiler="aot_eager")
    with torch.no_grad():
        expected = model(ids)
        got = torch.compile(model, backend=backend, fullgraph=True)(ids)
    cache = max(
        max(rel_err(g.keys, e.keys), rel_err(g.values, e.values))
        for g, e in zip(got.past_key_values.layers, expected.past_key_values.layers)
    )
    return {"logits": rel_err(got.logits, expected.logits), "cache": cache, "report": backend.reports[-1].as_dict()}


def mask_tiles(rank: int, world_size: int, seq_lens: list, tile: int, strip: int) -> dict:
    """Largest mask tensor the ring evaluates, and largest mask program input, per sequence length
    (a left-padded Llama batch: the mask is a lifted program), with tiles of ``tile`` x ``tile`` pairs
    evaluated ``strip`` tiles at a time."""
    lowering.masks.MASK_TILE, lowering.masks.MASK_STRIP = tile, strip
    largest = {}
    for seq_len in seq_lens:
        torch._dynamo.reset()
        model = build("llama").eval()
        kwargs = batch("left-padded", seq_len)
        with torch.no_grad(), record_ring_events() as events:
            torch.compile(model, backend=ringpass.backend(compiler="eager"), fullgraph=True)(**kwargs)
        tiles = [e.fields["numel"] for e in events if e.kind == "mask_tile"]
        largest[seq_len] = max(tiles)
    return largest


def classification_step(rank: int, world_size: int, seq_len: int, family: str = "bert") -> dict:
    """Sequence classification. BERT: the pooler reads the first token (a pick of one position). Llama:
    the logits of each row's last non-padding token (``logits[arange(B), last]``, positions from the data;
    row 0 is right-padded by 4 tokens)."""
    torch.manual_seed(0)
    ids = torch.randint(1, VOCAB, (2, seq_len), generator=torch.Generator().manual_seed(1))
    if family == "bert":
        config = transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            attn_implementation="sdpa",
            num_labels=3,
        )
        model = transformers.BertForSequenceClassification(config).train()
    else:
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            attn_implementation="sdpa",
            num_labels=3,
            pad_token_id=0,
        )
        model = transformers.LlamaForSequenceClassification(config).train()
        ids[0, -4:] = 0
    kwargs = {"input_ids": ids, "labels": torch.tensor([0, 2])} | ({"use_cache": False} if family != "bert" else {})
    expected = model(**kwargs)
    expected.loss.backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    backend = ringpass.backend(compiler="aot_eager")
    with record_ring_events() as events:
        got = torch.compile(model, backend=backend, fullgraph=True)(**kwargs)
        got.loss.backward()
    return {
        "loss": rel_err(got.loss, expected.loss),
        "logits": rel_err(got.logits, expected.logits),
        "grads": grad_error({n: p.grad for n, p in model.named_parameters()}, expected_grads),
        "report": backend.reports[-1].as_dict(),
        "kv_exchanges": sum(e.kind == "exchange" and e.fields["payload"] == "kv" for e in events),
    }


def flex_training_step(rank: int, world_size: int, cases: list, seq_len: int, fullgraph: bool) -> dict:
    """Llama with ``attn_implementation="flex_attention"`` against the same weights with SDPA run whole.
    With ``fullgraph``, Dynamo ignores ``warnings.warn`` (HF's ``create_block_mask(_compile=True)`` warns,
    which Dynamo cannot trace); without, the model compiles in several graphs."""
    import warnings

    import torch.nn.attention.flex_attention as flex

    flex._validate_device = lambda *tensors: None  # its "no backward on the CPU" check: the ring replaces flex
    if fullgraph:
        torch._dynamo.config.ignore_logging_functions.add(warnings.warn)
    return training_step(
        rank, world_size, "llama-flex_attention", cases, seq_len, reference="llama", fullgraph=fullgraph
    )


def per_block_step(rank: int, world_size: int, name: str, seq_len: int) -> dict:
    """One training step with each decoder layer compiled on its own (torchtitan's way: `SequenceSharded` between
    the layers) against the model run whole: relative errors of the loss and the worst gradient, each graph's status,
    the mixers' summary exchanges."""
    model = build(name)
    reference = copy.deepcopy(model)
    kwargs = batch("labels", seq_len)
    expected = reference(**kwargs)
    expected.loss.backward()
    backend = ringpass.backend(compiler="aot_eager", report="off")
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = torch.compile(layer, backend=backend)
    with record_ring_events() as events:
        got = model(**kwargs)
        got.loss.backward()
    pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()) if q.grad is not None]
    return {
        "loss": rel_err(got.loss, expected.loss),
        "grads": max(rel_err(g, want) for g, want in pairs),
        "statuses": [r.status for r in backend.reports],
        "mixer_exchanges": sum(e.kind == "mixer_exchange" for e in events),
    }
