"""Hugging Face transformers models through backend="ring", unchanged: compiled on 2 and 4 gloo ranks
against the uncompiled model in one process, fp32, relative error <= 1e-4 for loss, logits and every
parameter gradient.

(a) use_cache=False with labels (HF's mask from position ids: read as plain causal);
(b) a left-padded batch with attention_mask (a lifted mask program, evaluated per tile);
(c) packed documents through restarting position_ids (read as the documents mask: ids from cumsum/diff, no program);
(d) the default use_cache=True in eval (is_causal=True; the KV cache is gathered);
(e) Mistral's sliding window (read as causal + window 5; with padding, a program + window).
"""

import hf_workers
import pytest

from ringpass.cli.launch import spawn_ranks

SEQ = 13  # not a multiple of 2P: zigzag padding is exercised at every world size


def _agrees(got, want) -> bool:
    """A report field against what a test expects of it: a string it starts with (a mask's kind, before its
    details), items it holds, a number to the 4 significant digits the report prints, or the value itself."""
    if isinstance(want, str):
        return got.startswith(want)
    if isinstance(want, list):
        return set(want) <= set(got)
    if isinstance(want, float):
        return f"{got:.4g}" == f"{want:.4g}"
    return got == want


def _has_attention(reports: list, **expected) -> bool:
    """Some attention of the graphs' reports (`Report.as_dict`) has every field of ``expected`` (`_agrees`)."""
    return any(all(_agrees(a[k], v) for k, v in expected.items()) for report in reports for a in report["attentions"])


def _rewrote_two(reports: list) -> bool:
    return any(report["status"] == "rewritten" and len(report["attentions"]) == 2 for report in reports)


def _check(results, expected, world_size=None):
    """``expected``: per case, the fields of `AttentionRecord` one of its attentions has."""
    for case, r in results.items():
        assert r["untrained"] == r["unexpected"] == [], (case, r)  # the same parameters receive gradients
        assert max(r["loss"], r["logits"], r["grads"]) <= 1e-4, (case, r)
        assert _has_attention(r["reports"], **expected[case]), (case, r["reports"])
        assert _rewrote_two(r["reports"]), (case, r["reports"])
        if world_size is not None:  # the ring ran: at most 2 layers x (P-1) KV hops, forward and in the backward
            lap = 2 * 2 * (world_size - 1)  # (fewer where no later rank needs a block: padding, documents)
            assert 0 < r["kv_exchanges"] <= lap and (world_size > 2 or r["kv_exchanges"] == lap), (case, r)


@pytest.mark.parametrize(
    "name,world_size",
    [
        ("llama", 2),
        pytest.param("gpt2", 2, marks=pytest.mark.heavy),  # suite time
        pytest.param("llama", 4, marks=pytest.mark.heavy),
        pytest.param("gpt2", 4, marks=pytest.mark.heavy),
    ],
)
def test_training_matches_the_unsharded_model(name, world_size):
    cases = ["labels", "left-padded", "packed"] + (["rank-all-padding"] if name == "llama" else [])
    expected = {
        "labels": CAUSAL,
        "left-padded": PROGRAM_AND_CAUSAL,
        "packed": DOCUMENTS,
        "rank-all-padding": PROGRAM_AND_CAUSAL,
    }
    for results in spawn_ranks(hf_workers.training_step, world_size, (name, cases, SEQ), timeout=600):
        _check(results, expected, world_size)


@pytest.mark.parametrize("name,world_size", [("qwen2", 2), pytest.param("llama", 4, marks=pytest.mark.heavy)])
def test_packed_rows_train_on_the_documents_layout(name, world_size):
    """``layout="documents"``: a row packed from documents of 5, 31 and 4 tokens (position ids restarting) split by
    its documents (`lowering.DocumentLayout`, planned per call from the ids the mask reads): loss, logits (returned
    sharded) and every gradient as the unsharded model's, the ring ran."""
    args = (name, ["packed"], 40, None, "", "", True, {"layout": "documents"})
    for results in spawn_ranks(hf_workers.training_step, world_size, args, timeout=600):
        _check(results, {"packed": DOCUMENTS}, world_size)
        assert {report["layout"] for report in results["packed"]["reports"]} == {"documents"}, results


@pytest.mark.parametrize(
    "world_size,dynamic,checkpointed",
    [  # (suite time: LFM2 trains by default under FSDP2 in test_composition.py's hybrid cases)
        pytest.param(2, None, "", marks=pytest.mark.heavy),
        pytest.param(4, None, "", marks=pytest.mark.heavy),
        pytest.param(2, True, "", marks=pytest.mark.heavy),
        pytest.param(2, None, "non-reentrant", marks=pytest.mark.heavy),
        pytest.param(2, None, "reentrant", marks=pytest.mark.heavy),
    ],
)
def test_convolution_layers_between_attention_layers_train_through_the_ring(world_size, dynamic, checkpointed):
    """Lfm2, a hybrid: its short convolutions (causal, depthwise, width 3) pass each chunk the tokens before it, its
    attention layer is the ring; padded (the convolution layer multiplies by a slice of the padding mask) and packed;
    with dynamic shapes (and a second length), with Hugging Face's gradient checkpointing."""
    cases = ["labels", "left-padded", "packed"]
    args = ("lfm2", cases, SEQ, dynamic, checkpointed)
    for results in spawn_ranks(hf_workers.training_step, world_size, args, timeout=600):
        for case, r in results.items():
            assert r["untrained"] == r["unexpected"] == [], (case, r)
            assert max(r["loss"], r["logits"], r["grads"]) <= 1e-4, (case, r)
            lap = 2 * (world_size - 1)  # one attention layer, forward and backward (fewer: blocks no rank needs)
            assert 0 < r["kv_exchanges"] <= lap and (world_size > 2 or r["kv_exchanges"] == lap), (case, r)
            assert r["mixer_exchanges"] == 4, (case, r)  # 2 convolutions' halos, forward and backward
            assert r.get("longer", 0.0) <= 1e-4, (case, r)  # dynamic: the same compile at a second length
            for report in r["reports"]:  # (dynamic: Dynamo may trace the frame twice, the same graph: torch's restart)
                assert [m["kind"] for m in report["mixers"]] == ["causal depthwise conv1d, width 3, 32 channels"] * 2


def test_a_hybrid_compiled_layer_by_layer_passes_state_between_its_graphs():
    """Lfm2 with each decoder layer compiled on its own: the convolution layers' graphs take the hidden states sharded
    (`SequenceSharded`, no attention in them) and pass their halos; exact, every graph sharded."""
    for result in spawn_ranks(hf_workers.per_block_step, 2, ("lfm2", SEQ), timeout=600):
        assert max(result["loss"], result["grads"]) <= 1e-4, result
        assert result["statuses"] == ["rewritten"] * 3 and result["mixer_exchanges"] == 4, result


def test_a_recurrence_before_the_first_attention_runs_whole_and_exactly():
    """RecurrentGemma: its convolution feeds an unrolled recurrence (``out[:, t] = state``, filled in place step by
    step), so both run whole on every rank, before the ring's attention layer; the recurrence's output is sharded
    after its last write, not before (it once was: zeros)."""
    for results in spawn_ranks(hf_workers.training_step, 2, ("recurrent_gemma", ["labels"], SEQ), timeout=600):
        r = results["labels"]
        assert r["untrained"] == r["unexpected"] == [], r
        assert max(r["loss"], r["logits"], r["grads"]) <= 1e-4, r
        assert r["kv_exchanges"] == 2, r  # the one attention layer, forward and backward
        (report,) = r["reports"]
        (mixer,) = report["mixers"]
        assert mixer["strategy"] == "computed whole on every rank (its input is needed whole)", mixer


# function calls split by heads or computed whole (one per such layer), and short convolutions passing state, per family
SCANS = {"mamba2": 2, "bamba": 1, "zamba2": 2, "qwen3_next": 1, "jamba": 1, "minimax": 1}
SCANS |= {"qwen3_5": 1, "olmo_hybrid": 1, "kimi_linear": 1}
CONVOLUTIONS = {"mamba2": 2, "bamba": 1, "zamba2": 2, "qwen3_next": 1, "jamba": 1, "minimax": 0}
CONVOLUTIONS |= {"qwen3_5": 1, "olmo_hybrid": 1, "kimi_linear": 1}  # (cut to N by `x[:, :, -N:]`: every token)
# (family, P) whose scans split by heads (4 heads: P = 3 does not divide them); the others run whole, and why
SPLIT = {("mamba2", 2), ("mamba2", 4), ("bamba", 2), ("zamba2", 2), ("qwen3_next", 2), ("qwen3_next", 4)}
WHY_WHOLE = {
    "jamba": "it runs under vmap",
    "minimax": "has 2 dims of size",  # its call is the module's forward: projections [hidden, hidden] inside
    "bamba": "4 does not divide by 3 ranks",
}


def _exact_steps(world_size: int, args: tuple):
    """(case, result, report) of each rank's `hf_workers.training_step`, its loss, logits and every gradient checked
    against the model run whole (fp32: 1e-4)."""
    for results in spawn_ranks(hf_workers.training_step, world_size, args, timeout=600):
        for case, r in results.items():
            assert r["untrained"] == r["unexpected"] == [], (case, r)
            assert max(r["loss"], r["logits"], r["grads"]) <= 1e-4, (case, r)
            (report,) = r["reports"]
            yield case, r, report


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "family,world_size",
    [
        pytest.param("mamba2", 2, marks=pytest.mark.heavy),  # (suite time: its SSD scan in test_sequence_mixers.py)
        ("qwen3_next", 2),
        # suite time: a call computed whole trains in the drawn models of test_sequence_mixers.py (P = 3)
        pytest.param("jamba", 2, marks=pytest.mark.heavy),
        pytest.param("bamba", 2, marks=pytest.mark.heavy),
        pytest.param("minimax", 2, marks=pytest.mark.heavy),
        # a hybrid layer concatenates the embeddings with the hidden states along the features (`torch.concatenate`)
        pytest.param("zamba2", 2, marks=pytest.mark.heavy),
        pytest.param("mamba2", 4, marks=pytest.mark.heavy),
        pytest.param("bamba", 3, marks=pytest.mark.heavy),
        pytest.param("qwen3_next", 4, marks=pytest.mark.heavy),
    ],
)
def test_chunked_scans_run_split_by_heads_or_whole_and_the_rest_sharded(family, world_size):
    """Mamba2 (no attention: SSD in chunks of 8 over 13 tokens), Bamba (a Mamba2 layer, then attention), Qwen3-Next
    (Gated DeltaNet's delta rule, then attention), Jamba (Mamba's selective scan: a loop over the tokens, unrolled, with
    vmaps inside) and MiniMax (lightning attention: a loop over blocks): each scan's function call
    (``mamba2_chunk_scan``, ``torch_chunk_gated_delta_rule``, ``mamba_selective_scan``, a module's ``forward``) runs
    unchanged on every token of this rank's share of its heads (all-to-all in and out) where they divide by P, else on
    the whole sequence on every rank (its per-token inputs all-gathered, the report saying why); the convolutions
    before it pass state, the attention is the ring. Padded too."""
    args = (family, ["labels", "left-padded"], SEQ)
    split = (family, world_size) in SPLIT
    for case, r, report in _exact_steps(world_size, args):
        strategy = "split by heads: every token of" if split else "computed whole on every rank: its"
        scans = [m for m in report["mixers"] if m["strategy"].startswith(strategy)]
        assert len(scans) == SCANS[family] and all(m["bytes_per_call"] > 0 for m in scans), report["mixers"]
        assert split or all(WHY_WHOLE[family] in m["strategy"] for m in scans), report["mixers"]
        forward = [(c["kind"], c["what"]) for c in report["collectives"] if c["phase"] == "forward"]
        exchanged = [c for c in forward if c[0] == "all-to-all" and "split by heads" in c[1]]
        gathered = [c for c in forward if c[0] == "all-gather" and "`" in c[1].partition(" read by ")[2]]
        assert (len(exchanged) > 0) == split and (split or gathered), forward  # (q, k of fewer heads: gathered)
        assert r["heads_exchanges"] == 2 * len(exchanged), (case, r)  # forward and backward
        assert r["all_gathers"] >= len(gathered), (case, r["all_gathers"], gathered)  # (and gradients')
        assert r["mixer_exchanges"] == 2 * CONVOLUTIONS[family], (case, r)  # the convolutions' halos, both ways
        assert (r["kv_exchanges"] > 0) == (family != "mamba2"), (case, r)  # the attention layer is the ring
        assert [i["placement"] for i in report["inputs"] if i["name"] == "input_ids"] == ["sharded"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "family,world_size",
    [
        # suite time: the state passing is checked by default on hand-written scans in
        # tests/distributed/test_sequence_mixers.py, the delta rule's binding and rewrite in
        # tests/unit/test_each_pass.py
        pytest.param("mamba2", 3, marks=pytest.mark.heavy),  # 4 heads do not divide by 3: split by heads, whole
        pytest.param("qwen3_next", 2, marks=pytest.mark.heavy),
        pytest.param("mamba2", 2, marks=pytest.mark.heavy),
        pytest.param("bamba", 2, marks=pytest.mark.heavy),
        pytest.param("zamba2", 2, marks=pytest.mark.heavy),
        pytest.param("qwen3_next", 4, marks=pytest.mark.heavy),
        pytest.param("jamba", 2, marks=pytest.mark.heavy),
        pytest.param("qwen3_5", 2, marks=pytest.mark.heavy),
        pytest.param("olmo_hybrid", 2, marks=pytest.mark.heavy),
        pytest.param("kimi_linear", 3, marks=pytest.mark.heavy),  # Kimi Delta Attention: a decay per key channel
    ],
)
def test_chunked_scans_pass_their_state_with_scans_state(family, world_size):
    """``scans="state"``: each call of Hugging Face's ``torch_chunk_gated_delta_rule`` / ``mamba2_chunk_scan`` /
    ``chunk_kimi_delta_attention`` (Qwen3-Next, Qwen3.5, OLMo-Hybrid; Mamba2, Bamba, Zamba2; Kimi-Linear) is bound
    to the function by what it computes and runs on this rank's chunks only, each from the state the chunks before it
    leave (one all-gather of the chunks' summaries per call, no all-to-all); any number of ranks. Jamba's selective
    scan is not one ringpass knows: computed whole, the report saying so. Loss, logits, every gradient; padded too."""
    args = (family, ["labels", "left-padded"], SEQ, None, "", "", True, {"scans": "state"})
    known = family != "jamba"
    for case, r, report in _exact_steps(world_size, args):
        strategy = "state passing: each of this rank's chunks" if known else "computed whole on every rank"
        scans = [m for m in report["mixers"] if m["strategy"].startswith(strategy)]
        assert len(scans) == SCANS[family] and all(m["bytes_per_call"] > 0 for m in scans), report["mixers"]
        assert known or all("(state not passed: `mamba_selective_scan` is not a scan" in m["strategy"] for m in scans)
        forward = [(c["kind"], c["what"]) for c in report["collectives"] if c["phase"] == "forward"]
        summaries = [c for c in forward if c[0] == "all-gather" and "summaries" in c[1]]
        assert len(summaries) == (SCANS[family] if known else 0), forward
        assert r["heads_exchanges"] == 0, (case, r)  # no all-to-all: the sequence stays in chunks
        # the convolutions' halos both ways, and each scan's summaries once (their backward: an all-reduce)
        assert r["mixer_exchanges"] == 2 * CONVOLUTIONS[family] + len(summaries), (case, r)
        assert known or r["all_gathers"] > 0, (case, r)
        assert (r["kv_exchanges"] > 0) == (family != "mamba2"), (case, r)
        assert [i["placement"] for i in report["inputs"] if i["name"] == "input_ids"] == ["sharded"]


@pytest.mark.heavy
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "kind,scans",
    [("non-reentrant", "heads"), ("reentrant", "heads"), ("non-reentrant", "state"), ("reentrant", "state")],
)
def test_chunked_scans_train_exactly_under_gradient_checkpointing(kind, scans):
    """Mamba2 with Hugging Face's gradient checkpointing: each checkpointed layer's scan recomputed, split by heads or
    passing its state (its summaries all-gathered again in the recomputation)."""
    args = ("mamba2", ["labels"], SEQ, None, kind, "", True, {"scans": scans})
    for results in spawn_ranks(hf_workers.training_step, 2, args, timeout=600):
        r = results["labels"]
        assert r["untrained"] == r["unexpected"] == [], r
        assert max(r["loss"], r["logits"], r["grads"]) <= 1e-4, r
        (report,) = r["reports"]
        strategy = "split by heads: every token of 2 of its 4" if scans == "heads" else "state passing: each of this"
        assert [m["strategy"].startswith(strategy) for m in report["mixers"]].count(True) == 2, report["mixers"]
        exchanges = r["heads_exchanges"] if scans == "heads" else r["mixer_exchanges"] - 2 * CONVOLUTIONS["mamba2"]
        assert exchanges >= (12 if scans == "heads" else 2), (report["mixers"], r)
        assert (r["heads_exchanges"] == 0) == (scans == "state"), r


CAUSAL = {"mask": "causal"}  # read as the causal flag
PROGRAM, PROGRAM_AND_CAUSAL = {"mask": "lifted mask program, evaluated"}, {"mask": "lifted mask program + causal"}
DOCUMENTS = {"mask": "packed documents (position_ids restarting at each) + causal inside each"}  # no program
AVERAGES = {"fully_masked": "uniform"}  # a query with every key hidden averages all keys, as eager (grads to q, k, v)
HAND_WRITTEN = {"spelling": "hand-written"}


LEARNED_BIAS_RUNS = {  # (world size, heavy): family -> cases, sequence length[, dynamic]
    (2, False): {"t5": (["right-padded"], SEQ), "mpnet-eager": (["labels"], SEQ)},
    (2, True): {
        "t5-eager": (["labels", "right-padded"], SEQ),
        "t5 dynamic": (["right-padded"], SEQ, True),
        "mpnet-eager padded": (["right-padded"], SEQ),
        "mpnet-eager dynamic": (["labels"], SEQ, True),
        "t5 checkpointed": (["right-padded"], SEQ, None, "non-reentrant"),
    },
    (4, True): {"t5": (["right-padded"], SEQ), "mpnet-eager": (["right-padded"], SEQ)},
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "world_size,heavy",
    [
        # suite time: a learned bias table trains through the ring by default in test_backend (learned_bias_padded)
        pytest.param(2, False, marks=pytest.mark.heavy),
        pytest.param(2, True, marks=pytest.mark.heavy),
        pytest.param(4, True, marks=pytest.mark.heavy),
    ],
)
def test_learned_relative_position_biases_train_through_the_ring(world_size, heavy):
    """T5's encoder (SDPA with the bias as its float mask, and eager) and MPNet (eager): a learned table of
    relative-position buckets, looked up per tile from positions and trained tile by tile (no S x S tensor),
    with and without padding, static and dynamic (then also at a second length), with gradient checkpointing."""
    tables = {
        "t5": "transformer.encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
        "mpnet": "mpnet.encoder.relative_attention_bias.weight",
    }
    runs = LEARNED_BIAS_RUNS[world_size, heavy]
    for results in spawn_ranks(hf_workers.training_steps, world_size, (runs,), timeout=850):
        for name, per_case in results.items():
            trained = [f"{tables[name.split('-')[0].split()[0]]} (trained: its gradient summed per tile)"]
            _check(per_case, {case: {"mask_inputs": trained} for case in per_case}, world_size)
            assert all(r.get("longer", 0.0) <= 1e-4 for r in per_case.values()), per_case


@pytest.mark.heavy  # suite time (README, "Heavier cases")
@pytest.mark.parametrize(
    "name,world_size",
    [
        ("llama-eager", 2),
        ("gpt2-eager", 2),
        ("biogpt-eager", 2),
        ("llama-eager", 4),
    ],
)
def test_eager_attention_trains_through_the_ring(name, world_size):
    """Hugging Face's written-out attention (matmul, additive mask, softmax in fp32, dropout p=0, cast,
    matmul; Llama's K/V heads repeated) is found and rewritten. Left padding leaves the padded queries no
    visible key: eager's added finfo.min makes their softmax uniform over every key (the last padded
    position's prediction enters the shifted loss), and the ring gives the same, gradients included. The additive
    mask ``where(kept, 0, finfo.min)`` is read as its boolean ``kept``: causal, or packed documents, no program."""
    cases = ["labels", "packed", "left-padded"] + (["rank-all-padding"] if name.startswith("biogpt") else [])
    program = {"mask": "lifted mask program + causal"}  # BioGPT's mask reads its all-ones attention mask too
    for results in spawn_ranks(hf_workers.training_step, world_size, (name, cases, SEQ), timeout=600):
        _check(
            results,
            {
                "labels": {**HAND_WRITTEN, **(program if name.startswith("biogpt") else CAUSAL)},
                "packed": {**HAND_WRITTEN, **(program if name.startswith("biogpt") else DOCUMENTS)},
                "left-padded": AVERAGES,
                "rank-all-padding": AVERAGES,
            },
            world_size,
        )


@pytest.mark.heavy  # suite time (README, "Heavier cases")
@pytest.mark.parametrize(
    "name,expected",
    [
        (
            "gpt_neo",
            {
                "labels": [{"mask": "causal"}, {"mask": "causal, sliding window 5"}],
                "packed": [{"mask": "packed documents"}, {"mask": "packed documents (position_ids restarting at each) "
                                                                  "+ causal inside each, sliding window 5"}],
            },
        ),
        ("codegen", {"labels": [{"scale": 0.3536, "mask": "causal"}], "left-padded": [{"scale": 0.3536, **AVERAGES}]}),
    ],
)  # fmt: skip
def test_older_eager_spellings_train_through_the_ring(name, expected):
    """GPT-Neo: ``where(buffer, scores, torch.tensor(finfo.min)) + mask``, a second mask inside the first, read
    from a causal buffer (global layers) or a banded one (local layers: a sliding window of 5), the outer one as its
    boolean (causal, or the packed documents). CodeGen: ``(q kᵀ + mask) / sqrt(d)``, the scale applied outside the
    mask (left padding: the scaled finfo.min still averages every key)."""
    for results in spawn_ranks(hf_workers.training_step, 2, (name, list(expected), SEQ), timeout=600):
        _check(results, dict.fromkeys(expected, HAND_WRITTEN), 2)
        for case, fields in ((case, fields) for case, each in expected.items() for fields in each):
            assert _has_attention(results[case]["reports"], **fields), (case, fields, results[case]["reports"])


@pytest.mark.heavy  # suite time (README, "Heavier cases")
def test_two_masks_with_padding_warn_where_eager_averages_fewer_keys():
    """GPT-Neo with left padding: a query whose keys are all hidden averages, in eager, only the keys its buffer
    keeps (keys both masks hide are -inf); the ring gives 0 there, and the report says so."""
    for results in spawn_ranks(hf_workers.training_step, 2, ("gpt_neo", ["left-padded"], SEQ), timeout=600):
        reports = results["left-padded"]["reports"]
        assert _rewrote_two(reports), reports
        assert any(
            "applies two masks: where the mask program hides every key" in difference
            for report in reports
            for difference in report["differs"]
        ), reports


@pytest.mark.heavy  # suite time (README, "Heavier cases")
@pytest.mark.parametrize("name,kv_heads", [("falcon", 2), ("falcon_mqa", 1)])
def test_falcon_trains_through_the_ring(name, kv_heads):
    """Falcon's new decoder (``broadcast_to(key, query.shape)`` repeats each KV head over its query group
    before the rotary embedding: proven repeated, one head of each group travels) and the old multi-query
    one (SDPA with one KV head broadcast against four query heads, no enable_gqa: only that head travels;
    K/V picked with ``[..., [-2], :]``). A KV hop carries 2·B·Hkv·n·D·4 bytes: only the distinct heads."""
    cases = ["labels", "left-padded"]
    for results in spawn_ranks(hf_workers.training_step, 2, (name, cases, SEQ), timeout=600):
        labels = {"spelling": "sdpa", **CAUSAL, "scale": 0.3536, "query_heads": 4, "kv_heads": kv_heads}
        _check(results, {"labels": labels, "left-padded": PROGRAM_AND_CAUSAL}, 2)
        for case, r in results.items():  # batch 2, 8 tokens per rank (13 padded to 16), head dim 8, fp32
            assert r["kv_bytes"] == {2 * 2 * kv_heads * 8 * 8 * 4}, (case, r["kv_bytes"])


ALIBI = {"score_mods": ["ALiBi slopes, computed in-kernel from positions"]}
SOFT_CAP = {"score_mods": ["soft-cap 0.5"]}
SCORE_MODELS = {  # name: {case: what the report says of its attention}
    "bloom": {"labels": ALIBI, "right-padded": {"score_mods": ["lifted bias program, evaluated per tile"]}},
    "mpt": {
        "labels": ALIBI,
        "right-padded": ALIBI,
        "left-padded": {**ALIBI, "fully_masked": "uniform_values"},
    },  # masked_fill(finfo.min): averages, grads to v
    "gemma2": {"labels": SOFT_CAP, "packed": SOFT_CAP, "left-padded": {**SOFT_CAP, **AVERAGES}},
}


@pytest.mark.parametrize(
    "name,world_size",
    [
        pytest.param("bloom", 2, marks=pytest.mark.heavy),  # suite time: ALiBi through the ring runs in test_flex
        pytest.param("mpt", 2, marks=pytest.mark.heavy),
        pytest.param("gemma2", 2, marks=pytest.mark.heavy),  # suite time
        pytest.param("bloom", 4, marks=pytest.mark.heavy),
    ],
)
def test_score_modifiers_train_through_the_ring(name, world_size):
    """ALiBi (BLOOM: ``baddbmm`` over merged batch and heads, slopes times key positions, from the padding
    mask's cumsum when one is passed; MPT: a bias sliced from a max-length table) and logit soft-capping
    (Gemma 2, eager only): the score modifiers go into the ring's kernels, exact against the model run whole."""
    expected = SCORE_MODELS[name]
    for results in spawn_ranks(hf_workers.training_step, world_size, (name, list(expected), SEQ), timeout=600):
        _check(results, {case: {**HAND_WRITTEN, **fields} for case, fields in expected.items()}, world_size)


@pytest.mark.heavy  # suite time (README, "Heavier cases")
@pytest.mark.parametrize(
    "name,world_size",
    [
        ("mixtral", 2),
        ("llama4", 2),
        ("mixtral", 4),
    ],
)
def test_mixture_of_experts_trains_through_the_ring(name, world_size):
    """Mixtral's grouped experts sort this rank's tokens by expert, count them per expert (segment offsets
    of the grouped matmuls) and restore their order: a token-local permutation, no gather of the sequence.
    Llama 4 tiles the tokens once per expert (``hidden.repeat(experts, 1)``: k copies of a shard are the shard
    of k copies), runs the experts on the tiles and sums them back."""
    cases = ["labels", "right-padded"]
    for results in spawn_ranks(hf_workers.training_step, world_size, (name, cases, SEQ), timeout=600):
        labels = CAUSAL if name == "mixtral" else PROGRAM_AND_CAUSAL  # Llama 4: chunks of 5
        _check(results, {"labels": {"spelling": "sdpa", **labels}, "right-padded": PROGRAM_AND_CAUSAL}, world_size)
        for r in results.values():  # no expert op computed whole
            assert not [line for report in r["reports"] for line in report["computed_whole"] if "moe.py" in line], r


@pytest.mark.heavy  # suite time (README, "Heavier cases")
def test_multi_head_latent_attention_trains_through_the_ring():
    """DeepSeek-V3: keys assembled by ``copy_`` into ``new_empty`` slices (in-place writes the rewrite must
    keep), values narrower than keys (padded to travel), a router built with ``scatter_`` / ``gather``."""
    for results in spawn_ranks(
        hf_workers.training_step, 2, ("deepseek_v3", ["labels", "right-padded"], SEQ), timeout=600
    ):
        _check(
            results,
            {
                "labels": {
                    "spelling": "sdpa",
                    **CAUSAL,
                    "scale": 0.2887,
                    "query_heads": 4,
                    "kv_heads": 4,
                    "head_dim": 12,
                },
                "right-padded": PROGRAM_AND_CAUSAL,
            },
            2,
        )


@pytest.mark.heavy  # suite time (README, "Heavier cases")
def test_a_mask_built_with_vmap_is_lifted():
    """Bidirectional Gemma 3 (EmbeddingGemma) builds its mask by vmap over (batch, head, query, key): the
    vmap nest is rewritten into broadcasting and lifted as a mask program."""
    for results in spawn_ranks(
        hf_workers.training_step, 2, ("embeddinggemma", ["labels", "right-padded"], SEQ), timeout=600
    ):
        program = {"spelling": "sdpa", "mask": "lifted mask program"}
        _check(results, {"labels": program, "right-padded": program}, 2)


@pytest.mark.heavy  # suite time (README, "Heavier cases")
@pytest.mark.parametrize("checkpointed", ["non-reentrant", "reentrant"])
def test_gradient_checkpointing_trains_through_the_ring(checkpointed):
    """HF gradient checkpointing puts every layer in an activation-checkpoint region; the regions are
    opened, the layers' attention rewritten, and the backward recomputes the rest of each layer (less is
    saved than without checkpointing) but never a forward ring (the KV hops are the forward's and the
    backward's own: 2 layers x (P-1) each)."""
    cases = ["labels", "left-padded"]
    expected = {"labels": {"spelling": "sdpa", **CAUSAL}, "left-padded": PROGRAM_AND_CAUSAL}
    (plain,) = spawn_ranks(hf_workers.training_step, 2, ("llama", ["labels"], SEQ), timeout=600)[:1]
    for results in spawn_ranks(hf_workers.training_step, 2, ("llama", cases, SEQ, None, checkpointed), timeout=600):
        _check(results, expected, 2)
        assert all(
            any(
                "activation-checkpoint region(s) opened: recomputed" in warning
                for report in r["reports"]
                for warning in report["warnings"]
            )
            for r in results.values()
        ), results
        assert results["labels"]["saved_bytes"] < 0.8 * plain["labels"]["saved_bytes"], (results, plain)


@pytest.mark.parametrize("checkpointed", ["non-reentrant", pytest.param("reentrant", marks=pytest.mark.heavy)])
def test_gradient_checkpointing_without_fullgraph_keeps_the_layers_in_the_ring_graph(checkpointed):
    """Qwen2 with HF gradient checkpointing compiled without ``fullgraph``, as `docs/training.md` says to set it
    up (``skip_fwd_side_effects_in_bwd_under_checkpoint``: with transformers >= 5.25 the `kernels` package's
    attention wrapper sets a context variable in every checkpointed layer, and without the flag Dynamo leaves
    the layers to eager code, outside any ring graph). One graph holds both layers' attention, rewritten; the
    ring ran (2 layers x (P-1) KV hops, forward and backward); loss, logits and every gradient are the
    unsharded model's."""
    for results in spawn_ranks(hf_workers.checkpointed_training_steps, 2, ("qwen2", [checkpointed], SEQ), timeout=600):
        _check(results, {checkpointed: {"spelling": "sdpa", **CAUSAL}}, 2)
        reports = results[checkpointed]["reports"]
        assert len(reports) == 1, reports  # no graph break: the checkpointed layers are in the graph
        assert any("activation-checkpoint region(s) opened" in warning for warning in reports[0]["warnings"]), reports


@pytest.mark.heavy  # ~25 s; test_sharded_lengths keeps one compile serving two lengths in the default suite
def test_one_dynamic_compile_serves_two_lengths():
    cases = ["labels", "packed"]
    # with dynamic shapes only tables computed from the length alone are read as numbers: HF's segment ids (a cumsum)
    # are read as documents, of positions that count up from the length alone (one document: plain causal) or of
    # the position ids given (packed)
    for results in spawn_ranks(hf_workers.training_step, 2, ("llama", cases, SEQ, True), timeout=600):
        _check(results, {"labels": CAUSAL, "packed": DOCUMENTS})
        for case, r in results.items():
            assert r["longer"] <= 1e-4, (case, r)


# ~50 s: three HF families compiled dynamic; the logits_to_keep test below stays in the default suite
@pytest.mark.heavy
def test_dynamic_shapes_in_families_that_spell_sizes_their_own_way():
    """``dynamic=True``, one compile serving two lengths: GPT-2 as shipped, whose loss property logs (a graph
    break), so the resumed frame gets ``logits_to_keep`` as a symbolic int that slices the sequence (read as
    its number, guarded), and whose Conv1D reshapes to ``x.size()[:-1] + (nf,)`` (a ``torch.Size`` of the
    length); BLOOM's merged batch x heads with ALiBi slopes; RoFormer's ``torch.zeros(input_ids.size())``."""
    runs = {
        "gpt2_as_shipped": (["left-padded"], SEQ, True, "", "", False),
        "bloom": (["labels"], SEQ, True),
        "roformer": (["left-padded"], SEQ, True),
    }
    expected = {"gpt2_as_shipped": PROGRAM_AND_CAUSAL, "bloom": ALIBI, "roformer": {"mask": "lifted mask program"}}
    for by_family in spawn_ranks(hf_workers.training_steps, 2, (runs,), timeout=600):
        for name, results in by_family.items():
            _check(results, dict.fromkeys(results, expected[name]), 2)
            assert all(r["longer"] <= 1e-4 for r in results.values()), (name, results)


@pytest.mark.heavy  # suite time (README, "Heavier cases")
def test_a_symbolic_logits_to_keep_is_read_as_its_number_and_guarded():
    """Each value of ``logits_to_keep`` after a ``dynamic=True`` compile gives the whole model's logits: the
    number the slice was compiled for is guarded, so another one compiles again."""
    for results in spawn_ranks(hf_workers.logits_to_keep, 2, ([0, 3, 0, 1],), timeout=300):
        for value, error, length, kv_exchanges in results:
            assert error <= 1e-4 and length == (value or 13), results
            assert kv_exchanges == 2, results  # the ring ran: 2 layers x 1 KV hop at P=2, forward only


@pytest.mark.heavy  # suite time (README, "Heavier cases")
@pytest.mark.parametrize("world_size", [2, 4])
def test_sliding_window_matches_the_unsharded_model(world_size):
    cases = ["labels", "left-padded", "packed"]
    expected = {
        "labels": {"mask": "causal, sliding window 5", "window": 5},
        "left-padded": {"mask": "lifted mask program + causal, sliding window 5", "window": 5},
        "packed": {"mask": f"{DOCUMENTS['mask']}, sliding window 5", "window": 5},
    }
    for results in spawn_ranks(hf_workers.training_step, world_size, ("mistral", cases, SEQ), timeout=600):
        _check(results, expected)


@pytest.mark.parametrize(
    "name,world_size",
    [
        ("llama", 2),
        pytest.param("gpt2", 2, marks=pytest.mark.heavy),  # suite time
        pytest.param("gpt2", 4, marks=pytest.mark.heavy),
        pytest.param("llama", 4, marks=pytest.mark.heavy),
    ],
)
def test_use_cache_forward_in_eval_matches_the_unsharded_model(name, world_size):
    for result in spawn_ranks(hf_workers.generate_prefill, world_size, (name, SEQ), timeout=300):
        assert result["logits"] <= 1e-4 and result["cache"] <= 1e-4, result
        report = result["report"]
        assert (report["status"], len(report["attentions"]), report["world_size"]) == ("rewritten", 2, world_size)
        placements = [output["placement"] for output in report["outputs"]]
        assert placements.count("carried") == 1, report["outputs"]  # the logits leave sharded
        assert placements.count("gathered") > 1, report["outputs"]  # the KV cache is returned whole


@pytest.mark.heavy  # suite time (README, "Heavier cases")
def test_mask_memory_does_not_grow_with_the_sequence():
    """A layer's mask is evaluated in strips of tiles: the largest mask tensor is the same at 600 and 1500
    tokens (one strip of 2 tiles of 64 x 64 per batch row), not S x S or S/P x S."""
    lengths = [600, 1500]
    for largest in spawn_ranks(hf_workers.mask_tiles, 2, (lengths, 64, 2), timeout=600):
        assert largest[600] == largest[1500] == 2 * 64 * 2 * 64, largest


@pytest.mark.heavy  # suite time (README, "Heavier cases")
@pytest.mark.parametrize("world_size", [2, 4])
def test_sequence_classification_picks_the_first_token(world_size):
    """BERT's pooler reads hidden_states[:, 0] of a sharded activation: the rank holding position 0 sends
    that row to every rank (an all-reduce of B x hidden), nothing is gathered."""
    for r in spawn_ranks(hf_workers.classification_step, world_size, (SEQ,), timeout=300):
        assert max(r["loss"], r["logits"], r["grads"]) <= 1e-4, r
        assert _rewrote_two([r["report"]]), r["report"]
        collectives = [(c["kind"], c["what"]) for c in r["report"]["collectives"]]
        assert ("all-reduce", "the token(s) at position(s) [0] picked by every rank") in collectives, collectives
        assert "all-gather" not in [kind for kind, _ in collectives], collectives
        assert r["kv_exchanges"] == 2 * 2 * (world_size - 1), r["kv_exchanges"]


@pytest.mark.heavy  # suite time: a token picked by every rank is covered by default in test_backend (last tokens)
@pytest.mark.parametrize("world_size", [2, 4])
def test_sequence_classification_picks_the_last_non_padding_token(world_size):
    """Llama's classifier reads ``logits[arange(B), last_non_pad]``, positions computed from the ids: each rank
    indexes the rows it holds, the rest are zero, and an all-reduce of B x labels gives every rank all."""
    for r in spawn_ranks(hf_workers.classification_step, world_size, (SEQ, "llama"), timeout=300):
        assert max(r["loss"], r["logits"], r["grads"]) <= 1e-4, r
        collectives = [(c["kind"], c["what"]) for c in r["report"]["collectives"]]
        assert ("all-reduce", "the tokens at data-dependent positions picked by every rank") in collectives, collectives
        assert "all-gather" not in [kind for kind, _ in collectives], collectives
        assert r["kv_exchanges"] == 2 * 2 * (world_size - 1), r["kv_exchanges"]


@pytest.mark.heavy  # suite time (README, "Heavier cases")
@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph-breaks"])
def test_hugging_face_flex_attention_trains_through_the_ring(fullgraph):
    """``attn_implementation="flex_attention"``: HF's block mask (causal, padding, packed documents) becomes a
    mask program evaluated per tile; the same weights with SDPA, run whole, are the reference. (HF's flex mask
    branches on the padding mask's values, ``if not fast_all(attention_mask)``: padding needs graph breaks.)"""
    cases = ["labels", "packed"] + ([] if fullgraph else ["left-padded"])
    for results in spawn_ranks(hf_workers.flex_training_step, 2, (cases, SEQ, fullgraph), timeout=600):
        _check(results, {case: {"spelling": "flex_attention", "mask": "lifted mask program"} for case in cases}, 2)
