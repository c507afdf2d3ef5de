"""Hugging Face transformers models through backend="ring", unchanged: compiled on 2 and 4 gloo ranks
against the uncompiled model in one process, fp32, relative error <= 1e-4 for loss, logits and every
parameter gradient.

(a) use_cache=False with labels (HF's mask from position ids: read as plain causal);
(b) a left-padded batch with attention_mask (a lifted mask program, evaluated per tile);
(c) packed documents through restarting position_ids (a lifted program: segment ids from cumsum/diff);
(d) the default use_cache=True in eval (is_causal=True; the KV cache is gathered);
(e) Mistral's sliding window (read as causal + window 5; with padding, a program + window).
"""

import pytest

import hf_workers
from ringpass.launch import spawn_ranks

SEQ = 13  # not a multiple of 2P: zigzag padding is exercised at every world size


def _check(results, expected_mask, world_size=None):
    for case, r in results.items():
        assert r["untrained"] == r["unexpected"] == [], (case, r)  # the same parameters receive gradients
        assert max(r["loss"], r["logits"], r["grads"]) <= 1e-4, (case, r)
        assert expected_mask[case] in r["report"], (case, r["report"])
        assert "2 attention(s) rewritten" in r["report"], (case, r["report"])
        if world_size is not None:  # the ring ran: 2 layers x (P-1) KV hops, forward and again in the backward
            assert r["kv_exchanges"] == 2 * 2 * (world_size - 1), (case, r["kv_exchanges"])


@pytest.mark.parametrize("name,world_size", [("llama", 2), ("gpt2", 2), pytest.param("llama", 4, marks=pytest.mark.heavy),
                                             pytest.param("gpt2", 4, marks=pytest.mark.heavy)])
def test_training_matches_the_unsharded_model(name, world_size):
    cases = ["labels", "left-padded", "packed"] + (["rank-all-padding"] if name == "llama" else [])
    expected_mask = {"labels": "(causal,", "left-padded": "lifted mask program + causal", "packed": "lifted mask program, evaluated",
                     "rank-all-padding": "lifted mask program + causal"}
    for results in spawn_ranks(hf_workers.training_step, world_size, (name, cases, SEQ), timeout=600):
        _check(results, expected_mask, world_size)


AVERAGES = "a query with every key hidden averages all keys, as eager (gradients to q, k, v)"


LEARNED_BIAS_RUNS = {  # (world size, heavy): family -> cases, sequence length[, dynamic]
    (2, False): {"t5": (["right-padded"], SEQ), "mpnet-eager": (["labels"], SEQ)},
    (2, True): {"t5-eager": (["labels", "right-padded"], SEQ), "t5 dynamic": (["right-padded"], SEQ, True),
                "mpnet-eager padded": (["right-padded"], SEQ),
                "mpnet-eager dynamic": (["labels"], SEQ, True), "t5 checkpointed": (["right-padded"], SEQ, None, "non-reentrant")},
    (4, True): {"t5": (["right-padded"], SEQ), "mpnet-eager": (["right-padded"], SEQ)},
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world_size,heavy", [(2, False), pytest.param(2, True, marks=pytest.mark.heavy),
                                              pytest.param(4, True, marks=pytest.mark.heavy)])
def test_learned_relative_position_biases_train_through_the_ring(world_size, heavy):
    """T5's encoder (SDPA with the bias as its float mask, and eager) and MPNet (eager): a learned table of
    relative-position buckets, looked up per tile from positions and trained tile by tile (no S x S tensor),
    with and without padding, static and dynamic (then also at a second length), with gradient checkpointing."""
    trained = {"t5": "relative_attention_bias.weight (trained", "mpnet": "encoder.relative_attention_bias.weight (trained"}
    runs = LEARNED_BIAS_RUNS[world_size, heavy]
    for results in spawn_ranks(hf_workers.training_steps, world_size, (runs,), timeout=850):
        for name, per_case in results.items():
            _check(per_case, {case: trained[name.split("-")[0].split()[0]] for case in per_case}, world_size)
            assert all(r.get("longer", 0.0) <= 1e-4 for r in per_case.values()), per_case


@pytest.mark.parametrize("name,world_size", [("llama-eager", 2), pytest.param("gpt2-eager", 2, marks=pytest.mark.heavy),
                                             ("biogpt-eager", 2),
                                             pytest.param("llama-eager", 4, marks=pytest.mark.heavy)])
def test_eager_attention_trains_through_the_ring(name, world_size):
    """Hugging Face's written-out attention (matmul, additive mask, softmax in fp32, dropout p=0, cast,
    matmul; Llama's K/V heads repeated) is found and rewritten. Left padding leaves the padded queries no
    visible key: eager's added finfo.min makes their softmax uniform over every key (the last padded
    position's prediction enters the shifted loss), and the ring gives the same, gradients included."""
    cases = ["labels", "packed", "left-padded"] + (["rank-all-padding"] if name.startswith("biogpt") else [])
    for results in spawn_ranks(hf_workers.training_step, world_size, (name, cases, SEQ), timeout=600):
        _check(results, {"labels": "hand-written (lifted mask program", "packed": "hand-written (lifted mask program",
                         "left-padded": AVERAGES, "rank-all-padding": AVERAGES}, world_size)


@pytest.mark.parametrize("name,cases,expected", [
    ("gpt_neo", ["labels", "packed"], ["lifted mask program + causal, evaluated", "+ causal, sliding window 5"]),
    ("codegen", ["labels", "left-padded"], ["scale 0.3536", AVERAGES])])
def test_older_eager_spellings_train_through_the_ring(name, cases, expected):
    """GPT-Neo: ``where(buffer, scores, torch.tensor(finfo.min)) + mask``, a second mask inside the first, read
    from a causal buffer (global layers) or a banded one (local layers: a sliding window of 5). CodeGen:
    ``(q kᵀ + mask) / sqrt(d)``, the scale applied outside the mask (left padding: the scaled finfo.min still
    averages every key)."""
    for results in spawn_ranks(hf_workers.training_step, 2, (name, cases, SEQ), timeout=600):
        _check(results, {case: "hand-written (" for case in cases}, 2)
        for words in expected:
            assert all(words in r["report"] for r in results.values()), (words, results)


def test_two_masks_with_padding_warn_where_eager_averages_fewer_keys():
    """GPT-Neo with left padding: a query whose keys are all hidden averages, in eager, only the keys its buffer
    keeps (keys both masks hide are -inf); the ring gives 0 there, and the report says so."""
    for results in spawn_ranks(hf_workers.training_step, 2, ("gpt_neo", ["left-padded"], SEQ), timeout=600):
        assert "2 attention(s) rewritten" in results["left-padded"]["report"]
        assert "applies two masks: where the mask program hides every key" in results["left-padded"]["report"]


@pytest.mark.parametrize("name,kv_heads", [("falcon", 2), ("falcon_mqa", 1)])
def test_falcon_trains_through_the_ring(name, kv_heads):
    """Falcon's new decoder (``broadcast_to(key, query.shape)`` repeats each KV head over its query group
    before the rotary embedding: proven repeated, one head of each group travels) and the old multi-query
    one (SDPA with one KV head broadcast against four query heads, no enable_gqa: only that head travels;
    K/V picked with ``[..., [-2], :]``). A KV hop carries 2·B·Hkv·n·D·4 bytes: only the distinct heads."""
    cases = ["labels", "left-padded"]
    for results in spawn_ranks(hf_workers.training_step, 2, (name, cases, SEQ), timeout=600):
        _check(results, {"labels": f"sdpa (causal, scale 0.3536, 4 query / {kv_heads} key-value heads",
                         "left-padded": "lifted mask program + causal"}, 2)
        for case, r in results.items():  # batch 2, 8 tokens per rank (13 padded to 16), head dim 8, fp32
            assert r["kv_bytes"] == {2 * 2 * kv_heads * 8 * 8 * 4}, (case, r["kv_bytes"])


SCORE_MODELS = {  # name: {case: what the report says of its attention}
    "bloom": {"labels": "ALiBi slopes, computed in-kernel", "right-padded": "lifted bias program, evaluated per tile"},
    "mpt": {"labels": "ALiBi slopes, computed in-kernel", "right-padded": "ALiBi slopes, computed in-kernel",
            "left-padded": "ALiBi slopes, computed in-kernel from positions; a query with every key hidden averages all keys, as eager (gradients to v)"},  # masked_fill(finfo.min)
    "gemma2": {"labels": "soft-cap 0.5", "packed": "soft-cap 0.5", "left-padded": "soft-cap 0.5; " + AVERAGES},
}


@pytest.mark.parametrize("name,world_size", [("bloom", 2), pytest.param("mpt", 2, marks=pytest.mark.heavy), ("gemma2", 2),
                                             pytest.param("bloom", 4, marks=pytest.mark.heavy)])
def test_score_modifiers_train_through_the_ring(name, world_size):
    """ALiBi (BLOOM: ``baddbmm`` over merged batch and heads, slopes times key positions, from the padding
    mask's cumsum when one is passed; MPT: a bias sliced from a max-length table) and logit soft-capping
    (Gemma 2, eager only): the score modifiers go into the ring's kernels, exact against the model run whole."""
    expected = SCORE_MODELS[name]
    for results in spawn_ranks(hf_workers.training_step, world_size, (name, list(expected), SEQ), timeout=600):
        _check(results, {case: "hand-written (" for case in expected}, world_size)
        for case, words in expected.items():
            assert words in results[case]["report"], (case, results[case]["report"])


@pytest.mark.parametrize("name,world_size", [("mixtral", 2), pytest.param("llama4", 2, marks=pytest.mark.heavy),
                                             pytest.param("mixtral", 4, marks=pytest.mark.heavy)])
def test_mixture_of_experts_trains_through_the_ring(name, world_size):
    """Mixtral's grouped experts sort this rank's tokens by expert, count them per expert (segment offsets
    of the grouped matmuls) and restore their order: a token-local permutation, no gather of the sequence.
    Llama 4 tiles the tokens once per expert (``hidden.repeat(experts, 1)``: k copies of a shard are the shard
    of k copies), runs the experts on the tiles and sums them back."""
    cases = ["labels", "right-padded"]
    for results in spawn_ranks(hf_workers.training_step, world_size, (name, cases, SEQ), timeout=600):
        labels = "sdpa (causal" if name == "mixtral" else "sdpa (lifted mask program + causal"  # Llama 4: chunks of 5
        _check(results, {"labels": labels, "right-padded": "lifted mask program + causal"}, world_size)
        assert all("moe.py" not in r["report"] for r in results.values())  # no expert op computed whole


def test_multi_head_latent_attention_trains_through_the_ring():
    """DeepSeek-V3: keys assembled by ``copy_`` into ``new_empty`` slices (in-place writes the rewrite must
    keep), values narrower than keys (padded to travel), a router built with ``scatter_`` / ``gather``."""
    for results in spawn_ranks(hf_workers.training_step, 2, ("deepseek_v3", ["labels", "right-padded"], SEQ), timeout=600):
        _check(results, {"labels": "sdpa (causal, scale 0.2887, 4 query / 4 key-value heads, head dim 12",
                         "right-padded": "lifted mask program + causal"}, 2)


def test_a_mask_built_with_vmap_is_lifted():
    """Bidirectional Gemma 3 (EmbeddingGemma) builds its mask by vmap over (batch, head, query, key): the
    vmap nest is rewritten into broadcasting and lifted as a mask program."""
    for results in spawn_ranks(hf_workers.training_step, 2, ("embeddinggemma", ["labels", "right-padded"], SEQ),
                               timeout=600):
        _check(results, {"labels": "sdpa (lifted mask program", "right-padded": "sdpa (lifted mask program"}, 2)


@pytest.mark.parametrize("checkpointed", ["non-reentrant", pytest.param("reentrant", marks=pytest.mark.heavy)])
def test_gradient_checkpointing_trains_through_the_ring(checkpointed):
    """HF gradient checkpointing puts every layer in an activation-checkpoint region; the regions are
    opened, the layers' attention rewritten, and the backward recomputes the rest of each layer (less is
    saved than without checkpointing) but never a forward ring (the KV hops are the forward's and the
    backward's own: 2 layers x (P-1) each)."""
    cases = ["labels", "left-padded"]
    expected = {"labels": "sdpa (causal", "left-padded": "lifted mask program + causal"}
    plain, = spawn_ranks(hf_workers.training_step, 2, ("llama", ["labels"], SEQ), timeout=600)[:1]
    for results in spawn_ranks(hf_workers.training_step, 2, ("llama", cases, SEQ, None, checkpointed), timeout=600):
        _check(results, expected, 2)
        assert all("activation-checkpoint region(s) opened: recomputed" in r["report"] for r in results.values())
        assert results["labels"]["saved_bytes"] < 0.8 * plain["labels"]["saved_bytes"], (results, plain)


@pytest.mark.heavy  # ~25 s; test_backend's dynamic cases keep one-compile-many-lengths in the default suite
def test_one_dynamic_compile_serves_two_lengths():
    cases = ["labels", "packed"]
    # with dynamic shapes only tables computed from the length alone are read symbolically: HF's segment ids
    # (a cumsum) are evaluated per tile, the causal term still sets the flag
    expected_mask = {"labels": "lifted mask program + causal", "packed": "lifted mask program, evaluated"}
    for results in spawn_ranks(hf_workers.training_step, 2, ("llama", cases, SEQ, True), timeout=600):
        _check(results, expected_mask)
        for case, r in results.items():
            assert r["longer"] <= 1e-4, (case, r)


@pytest.mark.heavy  # ~50 s: three HF families compiled dynamic; the logits_to_keep test below stays in the default suite
def test_dynamic_shapes_in_families_that_spell_sizes_their_own_way():
    """``dynamic=True``, one compile serving two lengths: GPT-2 as shipped, whose loss property logs (a graph
    break), so the resumed frame gets ``logits_to_keep`` as a symbolic int that slices the sequence (read as
    its number, guarded), and whose Conv1D reshapes to ``x.size()[:-1] + (nf,)`` (a ``torch.Size`` of the
    length); BLOOM's merged batch x heads with ALiBi slopes; RoFormer's ``torch.zeros(input_ids.size())``."""
    runs = {"gpt2_as_shipped": (["left-padded"], SEQ, True, "", "", False), "bloom": (["labels"], SEQ, True),
            "roformer": (["left-padded"], SEQ, True)}
    expected = {"gpt2_as_shipped": "lifted mask program + causal", "bloom": "ALiBi slopes", "roformer": "lifted mask program"}
    for by_family in spawn_ranks(hf_workers.training_steps, 2, (runs,), timeout=600):
        for name, results in by_family.items():
            _check(results, {case: expected[name] for case in results}, 2)
            assert all(r["longer"] <= 1e-4 for r in results.values()), (name, results)


def test_a_symbolic_logits_to_keep_is_read_as_its_number_and_guarded():
    """Each value of ``logits_to_keep`` after a ``dynamic=True`` compile gives the whole model's logits: the
    number the slice was compiled for is guarded, so another one compiles again."""
    for results in spawn_ranks(hf_workers.logits_to_keep, 2, ([0, 3, 0, 1],), timeout=300):
        for value, error, length, kv_exchanges in results:
            assert error <= 1e-4 and length == (value or 13), results
            assert kv_exchanges == 2, results  # the ring ran: 2 layers x 1 KV hop at P=2, forward only


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.heavy)])
def test_sliding_window_matches_the_unsharded_model(world_size):
    cases = ["labels", "left-padded"]
    expected_mask = {"labels": "(causal, sliding window 5,", "left-padded": "lifted mask program + causal, sliding window 5"}
    for results in spawn_ranks(hf_workers.training_step, world_size, ("mistral", cases, SEQ), timeout=600):
        _check(results, expected_mask)


@pytest.mark.parametrize("name,world_size", [("llama", 2), ("gpt2", 2), pytest.param("gpt2", 4, marks=pytest.mark.heavy),
                                             pytest.param("llama", 4, marks=pytest.mark.heavy)])
def test_use_cache_forward_in_eval_matches_the_unsharded_model(name, world_size):
    for result in spawn_ranks(hf_workers.generate_prefill, world_size, (name, SEQ), timeout=300):
        assert result["logits"] <= 1e-4 and result["cache"] <= 1e-4, result
        assert f"2 attention(s) rewritten to ring attention over {world_size} ranks" in result["report"]
        assert "all-gathered per call" in result["report"]  # the cost of returning the KV cache


def test_mask_memory_does_not_grow_with_the_sequence():
    """A layer's mask is evaluated in strips of tiles: the largest mask tensor is the same at 600 and 1500
    tokens (one strip of 2 tiles of 64 x 64 per batch row), not S x S or S/P x S."""
    lengths = [600, 1500]
    for largest in spawn_ranks(hf_workers.mask_tiles, 2, (lengths, 64, 2), timeout=600):
        assert largest[600] == largest[1500] == 2 * 64 * 2 * 64, largest


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.heavy)])
def test_sequence_classification_picks_the_first_token(world_size):
    """BERT's pooler reads hidden_states[:, 0] of a sharded activation: the rank holding position 0 sends
    that row to every rank (an all-reduce of B x hidden), nothing is gathered."""
    for r in spawn_ranks(hf_workers.classification_step, world_size, (SEQ,), timeout=300):
        assert max(r["loss"], r["logits"], r["grads"]) <= 1e-4, r
        assert "2 attention(s) rewritten" in r["report"] and "position(s) [0] picked by every rank" in r["report"]
        assert "all-gather" not in r["report"].split("collectives inserted")[1].split("sequence-sharded")[0]
        assert r["kv_exchanges"] == 2 * 2 * (world_size - 1), r["kv_exchanges"]


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.heavy)])
def test_sequence_classification_picks_the_last_non_padding_token(world_size):
    """Llama's classifier reads ``logits[arange(B), last_non_pad]``, positions computed from the ids: each rank
    indexes the rows it holds, the rest are zero, and an all-reduce of B x labels gives every rank all."""
    for r in spawn_ranks(hf_workers.classification_step, world_size, (SEQ, "llama"), timeout=300):
        assert max(r["loss"], r["logits"], r["grads"]) <= 1e-4, r
        assert "data-dependent positions picked by every rank" in r["report"], r["report"]
        assert "all-gather" not in r["report"].split("collectives inserted")[1].split("sequence-sharded")[0]
        assert r["kv_exchanges"] == 2 * 2 * (world_size - 1), r["kv_exchanges"]


@pytest.mark.parametrize("fullgraph", [True, pytest.param(False, marks=pytest.mark.heavy)], ids=["fullgraph", "graph-breaks"])
def test_hugging_face_flex_attention_trains_through_the_ring(fullgraph):
    """``attn_implementation="flex_attention"``: HF's block mask (causal, padding, packed documents) becomes a
    mask program evaluated per tile; the same weights with SDPA, run whole, are the reference. (HF's flex mask
    branches on the padding mask's values, ``if not fast_all(attention_mask)``: padding needs graph breaks.)"""
    cases = ["labels", "packed"] + ([] if fullgraph else ["left-padded"])
    for results in spawn_ranks(hf_workers.flex_training_step, 2, (cases, SEQ, fullgraph), timeout=600):
        _check(results, {case: "flex_attention (lifted mask program" for case in cases}, 2)
