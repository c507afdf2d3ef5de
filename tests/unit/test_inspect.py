"""`ringpass.inspect` and `ringpass inspect`: what the ring pass will do to a model, offline.

Numbers are checked against formulas and brute force written here (KV bytes per hop
2·B·Hkv·(N/P)·D·itemsize, tokens per rank, visible pairs counted from every (query, key) position pair),
and the schedule against `lowering.schedule`. No process group may be created.
"""

import json
import re
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import inspect_targets
import models
import networkx as nx
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import transformers

import ringpass
from lowering import Layout, compat
from lowering.costmodel import AttentionShape, ring_cost
from lowering.schedule import schedule_table
from ringpass.cli import main
from ringpass.fx.report import size_text

TARGETS = str(Path(__file__).parents[1] / "workers" / "inspect_targets.py")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "inspect.md"


@pytest.fixture(autouse=True)
def no_process_group(monkeypatch):
    """Inspection must never create a process group (or need one)."""

    def refuse(*args, **kwargs):
        raise AssertionError("inspect created a process group")

    monkeypatch.setattr(dist, "init_process_group", refuse)
    yield
    assert not dist.is_initialized()


def _cli(tmp_path, *args) -> tuple[int, dict]:
    out = tmp_path / "inspect.json"
    code = main(["inspect", *args, "--json", str(out)])
    return code, json.loads(out.read_text()) if out.exists() else {}


def _visible_pairs_brute_force(layout: Layout, q_rank: int, kv_rank: int, window=None) -> int:
    q = layout.positions(q_rank)[: layout.valid_len(q_rank)]
    k = layout.positions(kv_rank)[: layout.valid_len(kv_rank)]
    visible = k[None, :] <= q[:, None]
    if window is not None:
        visible &= q[:, None] - k[None, :] < window
    return int(visible.sum())


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_factory_through_the_cli(tmp_path, capsys, layout):
    world, n, batch = 4, 64, 2
    code, data = _cli(
        tmp_path,
        f"{TARGETS}:llama",
        "--world-size",
        str(world),
        "--seq-len",
        str(n),
        "--batch",
        str(batch),
        "--layout",
        layout,
    )
    assert code == 0 and data["status"] == "rewritten" and data["schema_version"] == 1
    (graph,) = data["graphs"]
    assert len(graph["attentions"]) == 2 and graph["status"] == "rewritten"
    assert [a["module"] for a in graph["attentions"]] == ["blocks.0", "blocks.1"]
    first = graph["attentions"][0]
    assert (first["query_heads"], first["kv_heads"], first["head_dim"], first["mask"]) == (4, 2, 8, "causal")
    assert graph["layout"] == layout and graph["seq_len"] == n
    assert graph["tokens_per_rank"] == [n // world] * world
    (ring,) = graph["ring"]
    assert ring["attentions"] == [0, 1]
    assert ring["kv_bytes_per_hop"] == 2 * batch * 2 * (n // world) * 8 * 4
    assert ring["exchanges"] == {"forward_kv": world - 1, "backward_kv": world - 1, "backward_dkv": world}
    assert ring["schedule"] == schedule_table(Layout(layout, world, n), True)
    assert ring["contiguous_schedule"] == schedule_table(Layout("contiguous", world, n), True)
    pairs = [
        [_visible_pairs_brute_force(Layout(layout, world, n), r, (r - s) % world) for s in range(world)]
        for r in range(world)
    ]
    assert ring["pairs"] == pairs and sum(map(sum, pairs)) == n * (n + 1) // 2
    assert ring["flops_forward"] == [[4 * batch * 4 * 8 * p for p in row] for row in pairs]
    if layout == "zigzag":  # balanced: every rank scores the same number of pairs
        assert len({sum(row) for row in pairs}) == 1
    inputs = {v["name"]: v for v in graph["inputs"]}
    assert inputs["ids"]["placement"] == "sharded" and inputs["ids"]["dim"] == 1
    (output,) = graph["outputs"]
    assert output["placement"] == "carried" and output["nbytes"] == batch * n * 61 * 4  # left sharded: 0 gathered
    assert graph["activations"]["per_rank"] * world == graph["activations"]["unsharded"]
    text = capsys.readouterr().out  # the report as printed for people
    assert "2 x blocks.{0-1}: sdpa (causal" in text and "ids [2, 64] int64" in text
    assert "L_" not in text and "l_ids" not in text  # the user's names, never Dynamo's


def test_json_keys_are_the_documented_ones(tmp_path):
    _, data = _cli(tmp_path, f"{TARGETS}:llama_with_loss", "--world-size", "2")
    documented = DOCS.read_text()
    graph = data["graphs"][0]
    _, refused = _cli(tmp_path, f"{TARGETS}:refused", "--world-size", "2")
    _, mixers = _cli(tmp_path, f"{TARGETS}:conv_mixers", "--world-size", "2")
    ring = graph["ring"][0]
    keys = (
        set(data)
        | set(graph)
        | set(graph["attentions"][0])
        | set(graph["inputs"][0])
        | set(ring)
        | set(graph["collectives"][0])
        | set(graph["activations"])
        | set(ring["exchanges"])
        | set(ring["memory_per_rank"])
        | set(refused["graphs"][0]["refusal"])
        | set(mixers["graphs"][0]["mixers"][0])
    )
    missing = sorted(k for k in keys if f"`{k}`" not in documented)
    assert not missing, f"keys not documented in docs/inspect.md: {missing}"


def test_per_gpu_totals_by_hand(tmp_path, capsys):
    """The per-rank memory of a training step: parameters and buffers, a gradient and two AdamW states per
    parameter, the graphs' activations per rank and whole, the ring's backward buffers; their total, printed."""
    code, data = _cli(tmp_path, f"{TARGETS}:llama_with_loss", "--world-size", "2")
    model, _ = inspect_targets.llama_with_loss()
    params = sum(p.numel() * 4 for p in model.parameters())
    memory = data["memory_per_rank"]
    graph = data["graphs"][0]
    assert memory["weights"] == params + sum(b.numel() * b.element_size() for b in model.buffers())
    assert memory["gradients"] == params and memory["optimizer"] == 2 * params
    assert memory["activations"] == graph["activations"]["per_rank"] + graph["activations"]["whole"] > 0
    working = ring_cost(Layout("zigzag", 2, 64), AttentionShape(2, 4, 2, 8, 4, True)).working_memory()
    assert memory["ring"] == working["backward"] > 0
    assert memory["total"] == sum(v for k, v in memory.items() if k != "total")
    assert f"per GPU, one training step with AdamW, no FSDP: {size_text(memory['total'])}" in capsys.readouterr().out
    # the all-gather over 4 ranks holds every rank's KV block (16 tokens: 2 x B 2 x 2 KV heads x 16 x D 8 x 4 bytes =
    # 4096 bytes) and its dK/dV (fp32, as large) before the reduce-scatter: 2 more of each than the ring's two
    code, data = _cli(tmp_path, f"{TARGETS}:llama_with_loss", "--world-size", "4", "--strategy", "all-gather")
    ring = ring_cost(Layout("zigzag", 4, 64), AttentionShape(2, 4, 2, 8, 4, True)).working_memory()["backward"]
    assert data["memory_per_rank"]["ring"] == ring + 2 * (4096 + 4096)


def test_placements_and_collectives_of_a_model_with_its_loss(tmp_path):
    code, data = _cli(tmp_path, f"{TARGETS}:llama_with_loss", "--world-size", "2", "--seq-len", "30")
    graph = data["graphs"][0]
    inputs = {v["name"]: v for v in graph["inputs"]}
    assert inputs["ids"]["placement"] == "sharded"
    assert inputs["labels"]["placement"] == "whole" and "pad" in inputs["labels"]["why"]  # the label shift
    placements = sorted(o["placement"] for o in graph["outputs"])
    assert placements == ["carried", "replicated"]  # logits carried out sharded, the loss a replicated scalar
    kinds = [(c["phase"], c["kind"]) for c in graph["collectives"]]
    assert ("forward", "all-reduce") in kinds and ("forward", "all-gather") not in kinds
    gradients = [c for c in graph["collectives"] if c["phase"] == "backward"]
    model, _ = inspect_targets.llama_with_loss()
    params = {name: p.numel() * 4 for name, p in model.named_parameters()}
    assert {c["what"].replace("the gradient of ", ""): c["nbytes"] for c in gradients} == params


def test_graphml_loads_back_with_placements(tmp_path):
    path = tmp_path / "graph.graphml"
    assert main(["inspect", f"{TARGETS}:llama", "--world-size", "2", "--graphml", str(path)]) == 0
    graph = nx.read_graphml(path)
    rings = [d for _, d in graph.nodes(data=True) if d["ring"]]
    assert len(rings) == 2 and all(d["placement"] == "sharded" and d["module"].startswith("blocks.") for d in rings)
    linears = [d for _, d in graph.nodes(data=True) if d["target"] == "linear"]
    assert linears and all(d["placement"] == "sharded" and d["sequence_dim"] == 1 for d in linears)
    assert {d["collective"] for _, d in graph.nodes(data=True)} >= {"shard", "all-reduce (backward)"}
    ids = [d for _, d in graph.nodes(data=True) if d["op"] == "placeholder" and d["name"] == "ids"]
    assert ids and ids[0]["shape"] == "[2, 64]"


def test_pictures_are_valid_png_and_svg(tmp_path):
    png, svg = tmp_path / "plan.png", tmp_path / "plan.svg"
    assert main(["inspect", f"{TARGETS}:llama", "--world-size", "4", "--picture", str(png), "--picture", str(svg)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert ElementTree.parse(svg).getroot().tag.endswith("svg")


def test_picture_without_matplotlib_names_the_extra(monkeypatch, tmp_path):
    inspection = ringpass.inspect(*inspect_targets.llama(), world_size=2)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ringpass.RingpassError, match=r"ringpass\[viz\]"):
        inspection.write_picture(str(tmp_path / "plan.png"))


def test_refused_model_exits_2_with_the_op_its_line_and_the_chain(tmp_path, capsys):
    code, data = _cli(tmp_path, f"{TARGETS}:refused", "--world-size", "2")
    assert code == 2 and data["status"] == "refused"
    refusal = data["graphs"][0]["refusal"]
    lines = Path(TARGETS).read_text().splitlines()
    attention, blocking = (
        next(i + 1 for i, line in enumerate(lines) if code in line)
        for code in ("y = F.scaled_dot_product_attention(q, q, q", "cumprod(dim=1)")
    )
    assert refusal["op"] == "cumprod" and refusal["source"] == f"inspect_targets.py:{blocking}"
    chain = refusal["chain"]
    assert chain[0].startswith("`scaled_dot_product_attention`") and f"inspect_targets.py:{attention}" in chain[0]
    assert chain[1:-1] == ["transpose", "reshape", "linear"] and chain[-1].startswith("`cumprod`")
    text = capsys.readouterr().out  # the refusal as printed for people
    assert "REFUSED" in text and "cannot run on a sequence-sharded activation" in text
    assert "-> transpose -> reshape -> linear -> `cumprod`" in text


def test_no_attention_is_stated_loudly(tmp_path, capsys):
    code, data = _cli(tmp_path, "inspect_targets:no_attention", "--world-size", "2")  # module:factory
    assert code == 3 and data["status"] == "no attention"
    assert "NO ATTENTION FOUND" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args,message",
    [
        (["--seq-len", "8"], "takes no `seq_len`"),
        ([], "must return \\(model, example_inputs\\)"),
    ],
)
def test_bad_targets_exit_1_with_a_reason(capsys, args, message):
    target = "no_attention" if args else "not_a_pair"
    assert main(["inspect", f"{TARGETS}:{target}", "--world-size", "2", *args]) == 1
    assert re.search(message, capsys.readouterr().err)


def test_model_weights_stay_untouched_and_nothing_runs_at_full_size():
    model, (ids,) = inspect_targets.llama(seq_len=48)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seen = []
    model.blocks[0].register_forward_pre_hook(lambda module, args: seen.append(args[0].device.type))
    inspection = ringpass.inspect(model, (ids,), world_size=3)
    assert inspection.status == "rewritten" and seen and set(seen) == {"meta"}
    assert all(torch.equal(before[k], v) and v.device.type == "cpu" for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_causal_buffer_is_read_from_the_real_buffer():
    """A registered tril buffer is meta inside inspect; its real values decide that the mask is causal."""
    import models

    inspection = ringpass.inspect(
        models.Spellings("bmm_mT_tril_buffer_where"), torch.zeros(2, 12, dtype=torch.long), world_size=2
    )
    assert inspection.status == "rewritten" and inspection.reports[0].attention[0].mask == "causal"


def test_a_hugging_face_config_whose_class_has_no_sdpa_runs_its_own_attention(tmp_path, capsys):
    """GPT-J has no SDPA path before transformers 5.25: `--hf-config` builds it with its eager attention (raised
    "does not support an attention implementation through SDPA" before), which the ring rewrites; `ringpass plan`
    refuses it, saying why (it cannot run that attention without its S x S scores). From 5.25 on it is an SDPA
    model like the others, which the plan plans."""
    transformers.GPTJConfig(
        n_embd=32, n_layer=1, n_head=4, rotary_dim=8, vocab_size=64, n_positions=256, architectures=["GPTJForCausalLM"]
    ).save_pretrained(tmp_path)
    config = str(tmp_path / "config.json")
    assert main(["inspect", "--hf-config", config, "--world-size", "2", "--seq-len", "64"]) == 0
    printed = capsys.readouterr().out
    sdpa = compat.supports_sdpa(transformers.GPTJForCausalLM)
    how = "sdpa" if sdpa else "hand-written"
    assert "1 attention(s) rewritten to ring attention" in printed and f"transformer.h.0.attn: {how}" in printed
    plan = ["plan", "--world-size", "2", "--seq-len", "64", "--device", "cpu", "--link", "loopback", "--hf-config"]
    assert main([*plan, config]) == (0 if sdpa else 1)
    assert sdpa or "GPTJForCausalLM runs its own attention code" in capsys.readouterr().err


def test_hugging_face_padding_mask_is_a_lifted_program(tmp_path):
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(inspect_targets.llama_config_file(tmp_path))
        )
    ids = torch.zeros(2, 96, dtype=torch.long)
    inspection = ringpass.inspect(
        model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}, world_size=4
    )
    attention = inspection.reports[0].attention[0]
    assert attention.mask.startswith("lifted mask program + causal") and "attention_mask" in attention.mask_inputs
    assert {v.name: v.placement for v in inspection.reports[0].inputs}["attention_mask"] == "whole"


def test_sliding_window_schedule_skips_blocks_outside_the_window(tmp_path):
    config = transformers.MistralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        sliding_window=100,
    )
    with torch.device("meta"):
        model = transformers.MistralForCausalLM(config)
    n, world = 1024, 4
    inspection = ringpass.inspect(
        model, {"input_ids": torch.zeros(1, n, dtype=torch.long), "use_cache": False}, world_size=world
    )
    ring = inspection.as_dict()["graphs"][0]["ring"][0]
    layout = Layout("zigzag", world, n)
    pairs = [
        [_visible_pairs_brute_force(layout, r, (r - s) % world, window=100) for s in range(world)] for r in range(world)
    ]
    assert ring["pairs"] == pairs
    assert all(
        (word == "skipped") == (count == 0)
        for row, counts in zip(ring["schedule"], pairs)
        for word, count in zip(row, counts)
    )
    assert sum(row.count("skipped") for row in ring["schedule"]) > sum(
        row.count("skipped") for row in schedule_table(layout, True)
    )


def test_meta_device_large_config_stays_fast_and_small():
    """A Llama-3-8B-shaped layer pair at 16k tokens on 8 ranks (the 128k target is in test_heavy)."""
    config = transformers.LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=16384,
    )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    ids = torch.zeros(1, 16384, dtype=torch.long)
    inspection = ringpass.inspect(model, {"input_ids": ids, "labels": ids.clone(), "use_cache": False}, world_size=8)
    ring = inspection.as_dict()["graphs"][0]["ring"][0]
    n, q, kv = 2048, 32 * 2048 * 128, 8 * 2048 * 128  # slots per rank, query and KV elements per rank
    assert ring["kv_bytes_per_hop"] == 2 * kv * 2
    # docs/inspect.md: q, out, k, v, the stacked and the arriving KV block (bf16); fp32 out and LSE accumulators
    assert ring["memory_per_rank"]["forward"] == (2 * q + 6 * kv) * 2 + (q + 32 * n) * 4
    assert ring["memory_unsharded"]["forward"] == (2 * q + 2 * kv) * 8 * 2 + 32 * 8 * n * 4


def test_backend_summary_line_and_silencing(capsys):
    model, (ids,) = inspect_targets.llama(seq_len=16)
    torch._dynamo.reset()
    torch.compile(model, backend=ringpass.backend(compiler="eager"))(ids)
    assert "ringpass: graph 0: one rank (or no process group)" in capsys.readouterr().err
    torch._dynamo.reset()
    torch.compile(model, backend=ringpass.backend(compiler="eager", report="off"))(ids)
    assert "ringpass" not in capsys.readouterr().err
    report = ringpass.inspect(model, (ids,), world_size=2).reports[0]
    report.log(rank=1)
    assert capsys.readouterr().err == ""
    report.log(rank=0)
    assert capsys.readouterr().err.strip() == report.summary()
    assert report.summary().startswith("ringpass: graph 0: 2 attention(s) rewritten")


def test_graph_breaks_are_reported_graph_by_graph(tmp_path, capsys):
    code, data = _cli(tmp_path, f"{TARGETS}:graph_break", "--world-size", "2", "--code")
    assert code == 0 and [g["status"] for g in data["graphs"]] == ["rewritten", "rewritten"]
    assert [[a["module"] for a in g["attentions"]] for g in data["graphs"]] == [["first"], ["second"]]
    text = capsys.readouterr().out
    assert "Dynamo captured 2 graphs" in text and "# graph 1 (rewritten)" in text
    assert text.count("torch.ops.ringpass.ring_attention.default") == 2  # --code: the rewritten FX code


def test_a_large_ring_is_summarised_and_counted_exactly(capsys):
    n, world = 512, 64
    inspection = ringpass.inspect(*inspect_targets.llama(seq_len=n, batch=1), world_size=world)
    ring = inspection.as_dict()["graphs"][0]["ring"][0]
    assert sum(map(sum, ring["pairs"])) == n * (n + 1) // 2
    assert ring["schedule"] == schedule_table(Layout("zigzag", world, n), True)
    assert f"blocks over {world} ranks x {world} steps" in str(inspection)


def test_attention_output_returned_directly_is_carried_with_its_shape(tmp_path, capsys):
    """Regression: the ring's output had no example value, so a returned attention was not recorded whole."""
    code, data = _cli(tmp_path, f"{TARGETS}:attention_out", "--world-size", "2", "--code")
    assert code == 0
    (graph,) = data["graphs"]
    assert [(o["name"], o["shape"], o["dtype"], o["placement"], o["dim"], o["nbytes"]) for o in graph["outputs"]] == [
        ("output 0", [2, 2, 16, 4], "float32", "carried", 2, 1024)
    ]
    code = capsys.readouterr().out  # --code: the rewritten FX code
    assert "torch.ops.ringpass.ring_attention.default" in code and "gather_sequence" not in code
    # a plain tensor attribute, named as the model's code names it
    assert ("me.gain", [8], "float32") in [(v["name"], v["shape"], v["dtype"]) for v in graph["inputs"]]
    names = [v["name"] for v in graph["inputs"] + graph["outputs"]] + [c["what"] for c in graph["collectives"]]
    assert "the gradient of proj.weight" in names
    assert not [name for name in names if "L_me" in name or "me_modules" in name], names


def test_inputs_sharded_report_the_global_sizes():
    model, (x,) = inspect_targets.attention_out(seq_len=12)  # one rank's shard of 48 tokens on 4 ranks
    report = ringpass.inspect(model, (x,), world_size=4, inputs="sharded").reports[0]
    (output,) = report.outputs
    assert report.seq_len == 48 and output.shape == [2, 2, 48, 4] and output.nbytes == 2 * 2 * 48 * 4 * 4


def test_a_compiled_module_is_inspected_through_to_the_model():
    model, inputs = inspect_targets.llama(seq_len=16)
    assert ringpass.inspect(torch.compile(model), inputs, world_size=2).status == "rewritten"


def test_one_tensor_passed_twice_stays_one_input():
    model, inputs = inspect_targets.llama_with_loss(seq_len=16)
    inputs["labels"] = inputs["ids"]  # labels=input_ids, as HF users pass them
    report = ringpass.inspect(model, inputs, world_size=2).reports[0]
    assert [v.name for v in report.inputs] == ["ids"] and report.inputs[0].placement == "whole"


def test_window_blocks_are_named_from_their_visible_pairs():
    from lowering.costmodel import AttentionShape, ring_cost

    layout, world = Layout("contiguous", 4, 64), 4
    cost = ring_cost(layout, AttentionShape(1, 1, 1, 8, 4, is_causal=True, window=20))
    for r in range(world):
        for s in range(world):
            kv = (r - s) % world
            pairs = _visible_pairs_brute_force(layout, r, kv, window=20)
            word = cost.schedule[r][s]
            assert cost.pairs[r][s] == pairs
            assert word == (
                "skipped" if pairs == 0 else "diagonal" if kv == r else "full" if pairs == 16 * 16 else "partial"
            )
    assert cost.schedule[3][3] == "skipped" and cost.pairs[3][2] == 6 and cost.schedule[3][2] == "partial"  # not "full"


def test_a_meta_buffer_mask_says_why_it_cannot_be_read():
    import models

    with torch.device("meta"):
        model = models.Spellings("bmm_mT_tril_buffer_where")
    inspection = ringpass.inspect(model, torch.zeros(2, 12, dtype=torch.long), world_size=2)
    assert inspection.status == "refused"
    assert "The mask reads causal, on the meta device" in inspection.reports[0].refusal.message


def test_picture_of_a_model_with_no_graph(tmp_path):
    inspection = ringpass.inspect(torch.nn.Identity(), torch.zeros(1, 4), world_size=2)
    assert inspection.status == "no attention" and not inspection.graphs
    inspection.write_picture(str(tmp_path / "none.png"))
    assert (tmp_path / "none.png").read_bytes()[:4] == b"\x89PNG"


def test_an_attention_it_cannot_read_is_refused_not_run_unsharded(tmp_path):
    """A bias under the soft-cap is no form the kernels compute: refused, never run unsharded."""
    code, data = _cli(tmp_path, f"{TARGETS}:bias_under_the_cap", "--world-size", "2")
    assert code == 2
    refusal = data["graphs"][0]["refusal"]
    assert refusal["op"] == "softmax" and "does not recognise" in refusal["message"]


def test_soft_capped_scores_with_a_distance_bias_are_rewritten(tmp_path):
    code, data = _cli(tmp_path, f"{TARGETS}:soft_capped_scores", "--world-size", "2")
    assert code == 0
    (attention,) = data["graphs"][0]["attentions"]
    assert attention["score_mods"] == ["soft-cap 30", "lifted bias program, evaluated per tile"]
    assert attention["scale"] == 0.5


def test_a_learned_sequence_by_sequence_bias_is_refused(tmp_path):
    code, data = _cli(tmp_path, f"{TARGETS}:learned_bias_table", "--world-size", "2")
    assert code == 2
    assert "score bias" in data["graphs"][0]["refusal"]["message"]
    assert "sequence x sequence tensor" in data["graphs"][0]["refusal"]["message"]


def test_a_sort_of_this_ranks_tokens_that_is_undone_is_token_local(tmp_path):
    code, data = _cli(tmp_path, f"{TARGETS}:sorted_experts", "--world-size", "2")
    assert code == 0 and not data["graphs"][0]["computed_whole"]
    code, data = _cli(tmp_path, f"{TARGETS}:sorted_rows_leak", "--world-size", "2")
    assert code == 2 and "getitem" in data["graphs"][0]["refusal"]["op"]


def test_dropout_is_refused_on_attention_probabilities_only(tmp_path):
    code, data = _cli(tmp_path, f"{TARGETS}:dropout_in_attention", "--world-size", "2")
    assert code == 2 and "dropout inside ring attention is not supported" in data["graphs"][0]["refusal"]["message"]
    code, data = _cli(tmp_path, f"{TARGETS}:dropout_in_mlp", "--world-size", "2")  # dropout(y) @ W is no attention
    assert code == 0 and data["graphs"][0]["attentions"][0]["spelling"] == "hand-written"


class KeyPadding(torch.nn.Module):
    """Causal attention under a [B, S] key-padding mask passed as an input."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 24)

    def forward(self, x, keep):
        q, k, v = self.proj(x).view(x.shape[0], x.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4)
        i = torch.arange(x.shape[1], device=x.device)
        mask = keep[:, None, None, :] & (i[None, :] <= i[:, None])
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class RunningSumOfInput(torch.nn.Module):
    """Attention over a running sum of its [B, S, D] input: the input is needed whole."""

    def forward(self, x):
        q = x.cumprod(1).view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)


def test_a_sharded_padding_mask_is_gathered_and_a_sharded_activation_needed_whole_is_refused():
    """The mask program reads the padding of every key: a [B, S] vector passed sharded is all-gathered
    (its bytes in the report); a [B, S, D] input a cumprod needs whole is refused, naming it."""
    x, keep = torch.randn(2, 8, 8), torch.ones(2, 8, dtype=torch.bool)
    report = ringpass.inspect(KeyPadding(), (x, keep), world_size=2, inputs="sharded").reports[0]
    assert report.status == "rewritten", report.refusal
    gathered = [c for c in report.collectives if c.what == "input keep (passed sharded, needed whole)"]
    assert len(gathered) == 1 and gathered[0].kind == "all-gather" and gathered[0].nbytes == 2 * 8 * 2, (
        report.collectives
    )
    refusal = ringpass.inspect(RunningSumOfInput(), (x,), world_size=2, inputs="sharded").reports[0].refusal
    assert refusal is not None and "Input x is passed sharded (inputs='sharded') but `cumprod`" in refusal.message, (
        refusal
    )


@pytest.mark.parametrize(
    "fill,plan,warned",
    [
        (float("-inf"), "zero", False),
        (torch.finfo(torch.float32).min, "uniform_values", False),
        (-1e4, "uniform_values", True),
    ],
)
def test_what_a_query_with_every_key_hidden_gives_follows_the_fill(fill, plan, warned, capsys):
    """A -inf fill gives 0 there (eager: NaN); finfo.min makes eager's softmax uniform, and the ring averages
    too; -1e4 does not swamp the scores (eager still weighs them): averaged, and rank 0 prints a WARNING. (Float
    document ids: integer ones are read as the documents mask, which never hides every key of a query.)"""
    model = models.HandWritten(fill=fill)
    ids = torch.randint(0, 61, (2, 12))
    doc = torch.tensor([[0.0] * 5 + [1.0] * 7, [0.0] * 12])
    inspection = ringpass.inspect(model, (ids, doc), world_size=2)
    (report,) = inspection.reports
    assert report.attention[0].mask.startswith("lifted mask program")
    assert report.attention[0].fully_masked == plan
    assert any("still weighs those keys" in w for w in report.differs) == warned
    capsys.readouterr()
    report.log(rank=0)
    assert ("WARNING: " in capsys.readouterr().err) == warned


@pytest.mark.parametrize(
    "target,words",
    [
        ("mask_given_whole", "a sequence x sequence tensor"),  # and why it arrives whole
        ("attention_in_a_cond", "holds an attention in its body"),
        ("einsum_with_heads_last", "an attention the ring backend does not recognise"),
        ("scores_copied_first", "an attention the ring backend does not recognise"),
    ],
)
def test_what_the_ring_cannot_rewrite_is_refused_saying_why_not_run_unsharded(tmp_path, target, words):
    code, data = _cli(tmp_path, f"{TARGETS}:{target}", "--world-size", "2")
    assert code == 2, data
    message = data["graphs"][-1]["refusal"]["message"]
    assert words in message
    if target == "mask_given_whole":
        assert "built outside the graphs the ring compiles" in message


def test_a_mask_built_before_a_graph_break_crosses_it_as_its_per_token_description(tmp_path):
    """The graph that builds the mask returns its [B, S] padding mask instead of the [B, 1, S, S] mask; the next
    graph evaluates the mask per tile from it."""
    code, data = _cli(tmp_path, f"{TARGETS}:mask_before_a_break", "--world-size", "2")
    assert code == 0, data
    built, used = data["graphs"]
    assert len(built["masks"]) == 1 and "[2, 1, 16, 16] mask" in built["masks"][0], built["masks"]
    assert "per-token description (SequenceMask of 1 tensor(s), 256 bytes instead of 512)" in built["masks"][0]
    assert len(used["masks"]) == 1 and "arrives as its per-token description" in used["masks"][0]
    assert used["attentions"][0]["mask"].startswith("lifted mask program"), used["attentions"][0]
    whole = [(v["name"], v["shape"]) for v in used["inputs"] if v["placement"] == "whole"]
    assert whole == [("mask__input_0", [2, 16])], used["inputs"]  # the padding mask, not [2, 1, 16, 16]


def test_soft_capped_scores_without_a_mask_are_rewritten(tmp_path):
    code, data = _cli(tmp_path, f"{TARGETS}:capped_without_mask", "--world-size", "2")
    assert code == 0, data
    (attention,) = data["graphs"][0]["attentions"]
    assert attention["score_mods"] == ["soft-cap 3"] and attention["scale"] == 0.5


def test_a_sliced_and_expanded_buffer_becomes_this_ranks_positions(tmp_path):
    code, data = _cli(tmp_path, f"{TARGETS}:sliced_type_ids", "--world-size", "2")
    assert code == 0, data
    assert any("slice of" in p for p in data["graphs"][0]["positions"])


def test_torch_attention_modules_are_written_out_and_their_limits_refused():
    """nn.MultiheadAttention and nn.TransformerEncoderLayer become SDPA; what cannot be sharded is refused: the
    attention weights read back (need_weights=True), bias_k, and the fused eval fast path."""
    torch.manual_seed(0)
    ids, keep = torch.randint(0, 61, (2, 16)), torch.ones(2, 16, dtype=torch.bool)
    inspection = ringpass.inspect(models.TorchLayers(), (ids, keep), world_size=2)
    assert inspection.status == "rewritten" and len(inspection.reports[0].attention) == 2

    class Weights(torch.nn.Module):
        def __init__(self, **options):
            super().__init__()
            self.embed, self.attn = (
                torch.nn.Embedding(61, 32),
                torch.nn.MultiheadAttention(32, 4, batch_first=True, **options),
            )

        def forward(self, ids):
            x = self.embed(ids)
            y, weights = self.attn(x, x, x)
            return y, weights

    for options, words in (({}, "need_weights=False"), ({"add_bias_kv": True}, "bias_k")):
        refused = ringpass.inspect(Weights(**options), (ids,), world_size=2)
        assert refused.status == "refused" and words in refused.reports[0].refusal.message

    from ringpass.fx.context import PassContext
    from ringpass.fx.report import Report
    from ringpass.options import RingOptions
    from ringpass.passes import run_pipeline

    messages = []

    def pipeline(gm, example_inputs):  # the backend's pipeline on the real tensors of an eval, no-grad call
        ctx = PassContext(gm, example_inputs, RingOptions(), 2, "", Report(world_size=2))
        with pytest.raises(ringpass.NotSupportedError) as refused:
            run_pipeline(ctx)
        messages.append(str(refused.value))
        return gm.forward

    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).eval()
    with torch.no_grad():
        torch.compile(layer, backend=pipeline, fullgraph=True)(torch.randn(2, 16, 32))
    assert "set_fastpath_enabled(False)" in messages[0]


def test_attentions_alike_but_for_their_layer_numbers_share_a_line():
    """32 layers alternating two kinds (a sliding window on the even ones) and one cross-attention: three lines,
    each with its count and its layers; the JSON keeps every attention."""
    from ringpass.fx.report import AttentionRecord, Report

    def record(module: str, window: int | None) -> AttentionRecord:
        mask = f"causal, window {window}" if window else "causal"
        return AttentionRecord(module, "model.py:10", "sdpa", mask, True, window, [], 1, 8, 2, 64, "bf16", 2, 0.125)

    layers = [record(f"model.layers.{i}.self_attn", 4096 if i % 2 == 0 else None) for i in range(32)]
    report = Report(world_size=4, layout="zigzag", seq_len=8192, attention=[*layers, record("cross.0.attn", None)])
    lines = [line for line in str(report).splitlines() if "-> ringpass::ring_attention" in line]
    assert len(lines) == 3, lines
    assert lines[0].startswith(
        "    - 16 x model.layers.{" + ", ".join(map(str, range(0, 32, 2))) + "}.self_attn: sdpa (causal, window 4096"
    )
    assert lines[1].startswith(
        "    - 16 x model.layers.{" + ", ".join(map(str, range(1, 32, 2))) + "}.self_attn: sdpa (causal, scale"
    )
    assert lines[2].startswith("    - cross.0.attn: sdpa (causal, scale 0.125"), lines[2]
    assert len(report.as_dict()["attentions"]) == 33


class SortThenFlip(nn.Module):
    """A per-token sort whose indices a flip along the sequence reads (computed whole, before the attention) and
    whose values the attention reads: both elements of the sort's tuple are whole, the values sharded where they meet
    the attention (Qwen3-Next's MoE on torch 2.15 crashed here: `KeyError: sort`)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 4)

    def forward(self, ids):
        values, indices = torch.sort(self.embed(ids), dim=-1)
        q = (values + indices.flip(1).float()).unsqueeze(1)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)


def test_an_element_of_a_tuple_computed_whole_is_whole():
    report = ringpass.inspect(SortThenFlip(), torch.randint(0, 11, (2, 16)), world_size=2).reports[0]
    assert report.status == "rewritten", report.refusal
    whole = " ".join(report.computed_whole)
    assert all(f"`{op}`" in whole for op in ("sort", "getitem", "flip")), report.computed_whole


class PickFromFlattenedTokens(nn.Module):
    """Attention, then rows picked by index from its output flattened to ``[B * N, D]`` (JetMoE's routing): the
    indices are no sequence positions, so the pick is refused, not answered (it once gave other rows)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 4)

    def forward(self, ids, rows):
        q = self.embed(ids).unsqueeze(1)
        y = F.scaled_dot_product_attention(q, q, q, is_causal=True).squeeze(1)
        return y.reshape(-1, y.shape[-1])[rows]


def test_a_pick_by_index_from_flattened_batch_and_sequence_is_refused():
    ids, rows = torch.randint(0, 11, (2, 16)), torch.tensor([0, 5, 17])
    report = ringpass.inspect(PickFromFlattenedTokens(), (ids, rows), world_size=2).reports[0]
    assert report.status == "refused" and report.refusal.op.startswith("getitem"), report.refusal
    assert "merged with others (batch x sequence)" in report.refusal.message
