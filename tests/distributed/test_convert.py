"""`ringpass.convert`, `save` and `load`: convert once (no process group), save, load in fresh processes and
run on P ranks with the unsharded model's numbers; clear errors for what a converted model cannot run."""

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import backend_workers
import convert_workers
import pytest
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

import ringpass
from lowering.masks import mask_program
from ringpass.cli.launch import spawn_ranks
from ringpass.fx.nodes import example_value

TIMEOUT = 300
TARGETS = str(Path(__file__).parents[1] / "workers" / "inspect_targets.py")


def converted(name: str, world_size: int, seq_len: int, *, dynamic: bool = False):
    """The test model converted in this process, which has no process group (as when converting offline)."""
    assert not dist.is_initialized()
    args, kwargs = convert_workers.call(name, seq_len)
    return ringpass.convert(convert_workers.build(name), kwargs or args, world_size=world_size, dynamic=dynamic)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """Artifacts saved once for the module: {case: path}."""
    folder = tmp_path_factory.mktemp("artifacts")
    cases = {
        "static": ("hand", 2, 16, False),
        "dynamic": ("hand-batch1", 2, 16, True),
        "hf": ("hf", 2, 20, False),
        "other_world_size": ("hand", 3, 16, False),
    }
    paths = {}
    for case, (name, world_size, seq_len, dynamic) in cases.items():
        paths[case] = str(folder / f"{case}.pt2")
        converted(name, world_size, seq_len, dynamic=dynamic).save(paths[case])
    return paths


def check_training(result: dict, tolerance: float, seq_lens: list) -> None:
    assert result["names"]
    assert [s["seq_len"] for s in result["steps"]] == [n for n in seq_lens for _ in range(2)]
    for step in result["steps"]:
        assert step["logits"] < tolerance and step["grads"] < tolerance, step
        assert step["kv_exchanges"] > 0, "the ring did not run"


@pytest.mark.parametrize(
    "case,name,seq_lens,tolerance",
    [
        ("static", "hand", [16], 1e-12),
        ("dynamic", "hand-batch1", [16, 22], 1e-12),  # one artifact, two lengths (batch 1)
        ("hf", "hf", [20], 1e-4),  # a Hugging Face Llama with labels and a left-padded mask, fp32
    ],
)
def test_saved_model_trains_in_fresh_processes_like_the_unsharded_model(artifacts, case, name, seq_lens, tolerance):
    for result in spawn_ranks(convert_workers.train_and_compare, 2, (name, seq_lens, artifacts[case]), timeout=TIMEOUT):
        check_training(result, tolerance, seq_lens)
        if name == "hf":
            assert result["type"] == "CausalLMOutputWithPast"  # the output structure survives save and load


@pytest.mark.heavy
@pytest.mark.parametrize(
    "name,seq_lens,tolerance,dynamic",
    [
        ("hand", [16], 1e-12, False),
        ("hf", [20], 1e-4, False),
        ("hand", [16, 23], 1e-12, True),
        ("hf", [20, 27], 1e-4, True),
    ],
)
def test_saved_model_on_four_ranks(tmp_path, name, seq_lens, tolerance, dynamic):
    path = str(tmp_path / "model.pt2")
    converted(name, 4, seq_lens[0], dynamic=dynamic).save(path)
    for result in spawn_ranks(convert_workers.train_and_compare, 4, (name, seq_lens, path), timeout=TIMEOUT):
        check_training(result, tolerance, seq_lens)


@pytest.mark.heavy  # suite time (README, "Heavier cases")
def test_sharded_inputs_and_outputs_with_local_gradients(tmp_path):
    """Converted with inputs="sharded" (the example is one rank's shard: its shape is what each rank passes),
    outputs="sharded" and grads="local": the reassembled logits equal the model's, and the ranks' gradients
    sum to its gradient."""
    path = str(tmp_path / "sharded.pt2")
    ids = convert_workers.call("hand", 16)[0][0]
    ringpass.convert(
        convert_workers.build("hand"), ids[:, :8], world_size=2, inputs="sharded", outputs="sharded", grads="local"
    ).save(path)
    for result in spawn_ranks(convert_workers.sharded_inputs_local_grads, 2, (path, 16), timeout=TIMEOUT):
        assert result["logits"] < 1e-12 and result["grads"] < 1e-12 and result["kv_exchanges"] > 0, result


@pytest.mark.heavy
@pytest.mark.parametrize("name", sorted(backend_workers.MODELS))
def test_every_test_model_family_converts_saves_and_loads(tmp_path, name):
    bound = 1e-6 if "float32" in name else 1e-12  # that spelling computes its softmax in fp32 on purpose
    for result in spawn_ranks(convert_workers.family, 2, (name, 13, str(tmp_path)), timeout=TIMEOUT):
        for kind, errors in result.items():
            assert errors["outputs"] < bound and errors["grads"] < bound and errors["ring"] > 0, (kind, errors)


@pytest.mark.heavy  # suite time (README, "Heavier cases")
def test_converted_in_memory_shares_the_models_parameters():
    """Converted in each rank: ``converted.parameters()`` are the model's own, so an optimizer on either trains
    both; two dynamic lengths without recompiling anything."""
    for result in spawn_ranks(convert_workers.train_and_compare, 2, ("hand", [16, 19]), timeout=TIMEOUT):
        assert result["shared"]
        check_training(result, 1e-12, [16, 19])


def test_load_keeps_tied_weights_one_parameter(tmp_path):
    """A model whose output head is its embedding (tied weights) loads with one parameter for both, named as the
    model names it: ``ExportedProgram.module()`` gives each name its own copy, and two copies would train apart
    (each getting only its own uses' gradient). Trained through the ring: `test_score_program_fuzz` (``tied``)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        tie_word_embeddings=True,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 61, (2, 12))
    ringpass.convert(model, {"input_ids": ids, "use_cache": False}, world_size=2).save(str(tmp_path / "tied.pt2"))
    loaded = ringpass.load(str(tmp_path / "tied.pt2")).model
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert [name for name, _ in loaded.named_parameters()] == [name for name, _ in model.named_parameters()]


def test_values_nothing_reads_do_not_decide_a_conversion():
    """A model that computes ``q @ kᵀ`` and then calls SDPA with a float mask instead: Dynamo keeps the unread score
    matrices when `convert` captures it (and drops them when `inspect` does); the first pass removes them, so the
    second layer's, after the first attention, is not refused as mixing sharded tokens."""
    import score_program_fuzz

    case = {"family": "hand", "heads": 1, "causal": False, "buckets": 8, "max_distance": 1, "table": True}
    case.update(slopes=False, spelling="sdpa", seed=0, dtype="float64", padding="none", loss="projection")
    model = score_program_fuzz.ScoreProgramNet(case, dim_per_head=4).double()
    converted = ringpass.convert(model, score_program_fuzz.inputs(case, 8), world_size=2)
    assert "matmul" not in converted._program.gm.code and converted.report.status == "rewritten"


def test_a_saved_artifact_is_an_exported_program_calling_the_ring_ops(artifacts):
    program = torch.export.load(artifacts["hf"])  # plain torch.export reads it
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "ringpass.ring_attention.default" in targets and "ringpass.reduce_grad.default" in targets
    meta = json.loads(
        zipfile.ZipFile(artifacts["hf"]).read(
            next(n for n in zipfile.ZipFile(artifacts["hf"]).namelist() if n.endswith("extra/ringpass.json"))
        )
    )
    assert meta["conversion"]["world_size"] == 2 and meta["conversion"]["layout"] == "zigzag"
    assert meta["torch"] == torch.__version__ and meta["ringpass"] == ringpass.__version__
    assert len(meta["masks"]) == 1  # the left-padded mask: a lifted program, exported with the model
    report = str(ringpass.load(artifacts["hf"]).report)  # the conversion's inspection, kept in the artifact
    assert report.startswith("ringpass convert: every attention becomes ring attention over 2 ranks")
    assert "2 attention(s) rewritten" in report and "lifted mask program" in report


def test_load_moves_parameters_and_the_devices_the_graph_names(artifacts):
    moved = ringpass.load(artifacts["static"], device="meta")  # meta stands in for a GPU on this machine
    assert {p.device.type for p in moved.parameters()} == {"meta"}
    devices = [
        a
        for n in moved._program.module.graph.nodes
        for a in pytree.tree_leaves((n.args, n.kwargs))
        if isinstance(a, torch.device)
    ]
    assert devices and {d.type for d in devices} == {"meta"}


def test_a_loaded_mask_program_evaluates_any_tile_as_the_converted_one(tmp_path):
    """The exported mask program gives what the lifted one gives, on tiles of any size (a last tile may be
    one row or one column), for random values of the inputs the ring op passes it."""
    from ringpass.conversion.archive import program_inputs

    original = converted("hf", 2, 20)
    mask_id = original.conversion.masks[0]
    lifted = mask_program(mask_id)
    generator = torch.Generator().manual_seed(0)
    examples = [example_value(n) for n in program_inputs(original._program.gm)[mask_id]]
    inputs = [torch.randint(0, 2, v.shape, generator=generator).to(v.dtype) for v in examples]
    original.save(str(tmp_path / "hf.pt2"))
    ringpass.load(str(tmp_path / "hf.pt2"))
    loaded = mask_program(mask_id)
    assert loaded is not lifted
    for rows, cols in ((1, 1), (1, 7), (5, 20), (20, 20)):
        q_pos, kv_pos = torch.arange(20 - rows, 20), torch.arange(cols)
        assert torch.equal(loaded(q_pos, kv_pos, *inputs), lifted(q_pos, kv_pos, *inputs))


def test_calls_and_setups_a_converted_model_cannot_run_are_refused(artifacts):
    found = spawn_ranks(convert_workers.refusals, 2, (artifacts,), timeout=TIMEOUT)[0]
    assert "converted for a ring of 3 ranks, but its process group has 2" in found["world_size"]
    assert "converted for int64 [2, 16]" in found["length"] and "dynamic=True" in found["length"]
    assert "is int32 [2, 16]" in found["dtype"]
    assert found["keyword"] == found["no_grad"] == found["inference_mode"] == "no error"
    assert (
        "The ranks disagree before call" in found["disagree"]
        and "input `ids` holds different values" in found["disagree"]
    )
    assert "Argument `ids` was given when the model was converted" in found["missing"]
    assert "do not fit the model's forward(ids): got an unexpected keyword argument 'mask'" in found["extra"]
    assert "`use_cache` is True; the model was converted with False" in found["constant"]
    assert "Argument `attention_mask` was given when the model was converted" in found["unconverted_argument"]


def test_a_loaded_dynamic_model_checks_the_shape_conditions_it_was_traced_under(artifacts):
    loaded = ringpass.load(artifacts["dynamic"])  # batch 1, converted at length 16
    assert loaded.conversion.shape_conditions is not None
    with pytest.raises(ringpass.InvalidInputError, match=r"does not fit these inputs \(ids \[1, 1\]\)"):
        loaded(convert_workers.call("hand-batch1", 1)[0][0])


def test_a_loaded_program_refuses_lengths_outside_what_it_was_saved_for(tmp_path):
    """A T5 encoder converted dynamic at length 3 on 2 ranks (contiguous): Dynamo's conditions allow length 2,
    but torch.export, tracing it at save, specialised a rank's share of 2 tokens against a share of 1, so the
    saved program needs 3 or more. Its first step refuses length 2, naming the argument and the condition."""
    import score_program_fuzz

    case = {"family": "t5", "heads": 1, "head_dim": 4, "buckets": 8, "max_distance": 3, "implementation": "sdpa"}
    case.update(seed=0, dtype="float64", padding="none", loss="projection")
    model = score_program_fuzz.build(case)
    converted = ringpass.convert(
        model, score_program_fuzz.inputs(case, 3), world_size=2, dynamic=True, layout="contiguous"
    )
    converted.save(str(tmp_path / "t5.pt2"))
    loaded = ringpass.load(str(tmp_path / "t5.pt2"))
    ids = score_program_fuzz.inputs(case, 2)["input_ids"]
    with pytest.raises(
        ringpass.InvalidInputError, match=r"\(input_ids \[2, 2\]\): it needs input_ids.size\(\)\[1\] >= 3"
    ):
        loaded._program(ids)  # (the program's first step, before any ring op: no process group needed)


@pytest.mark.heavy  # suite time (README, "Heavier cases")
def test_aliased_inputs_defaults_passed_explicitly_and_globals():
    for found in spawn_ranks(convert_workers.edge_calls, 2, (), timeout=TIMEOUT):
        assert found["aliased"] < 1e-12 and found["defaults"] < 1e-12 and found["global"] < 1e-12, found


def test_no_process_group_is_a_clear_error(artifacts):
    loaded = ringpass.load(artifacts["static"])
    with pytest.raises(
        ringpass.InvalidInputError, match="needs a process group to run: call torch.distributed.init_process_group"
    ):
        loaded(convert_workers.call("hand", 16)[0][0])


def _rewritten(path: str, tmp_path: Path, change, digest: bool = False) -> str:
    """A copy of the artifact whose ringpass.json was changed by ``change(meta)``; ``digest``: with the digest made
    to match the change, as anyone crafting a file can (it is stored in the same file)."""
    out = str(tmp_path / "changed.pt2")
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(out, "w") as target:
        for item in source.infolist():
            data = source.read(item.filename)
            if item.filename.endswith("extra/ringpass.json"):
                data = json.dumps(change(json.loads(data))).encode()
            if not (digest and item.filename.endswith("extra/ringpass.sha256")):
                target.writestr(item, data)
    if digest:
        from ringpass.conversion import archive

        with zipfile.ZipFile(out, "a") as target:
            root = archive._root(target)
            target.writestr(f"{root}extra/{archive.DIGEST}", archive._digest(target, root))
    return out


def test_the_expressions_a_loaded_model_evaluates_are_a_closed_grammar():
    """What Dynamo writes evaluates as `eval` would; every way from a value to code is refused, naming it."""
    from ringpass.conversion.expressions import evaluate

    x = torch.zeros(2, 7)
    scope = {"L": {"t0": 7, "t1": x, "self": torch.nn.Linear(2, 3)}, "G": {"scale": 0.5}}
    allowed = {
        "L['t1'].size()[1] == L['t0'] and L['t1'].stride()[0] == L['t0'] and 2 <= L['t0']": True,
        "(L['t0'] // 2) % 3 + max(L['t0'], 9) - -1": 10,
        "L['self']._parameters['weight'].size()[0]": 3,
        "math.floor(G['scale'] * L['t0']) == 4 or not True": False,
    }
    for text, value in allowed.items():
        assert evaluate(text, scope) == value == eval(text, {"math": __import__("math")}, scope), text
    refused = {
        "__import__('os')": "the name '__import__'",
        "L['t1'].__class__": "the attribute '__class__'",
        "L['self'].register_buffer('b', None)": "a call of \"L['self'].register_buffer\"",
        "getattr(L['t1'], 'size')": "the name 'getattr'",
        "[t for t in L]": "a ListComp",
        "(lambda: 1)()": "a Lambda",
        "L[G['scale']]": "a subscript that is not a constant",
        "torch.load('x')": "a call of 'torch.load'",
    }
    for text, what in refused.items():
        with pytest.raises(ringpass.InvalidInputError, match="with " + re.escape(what)):
            evaluate(text, scope)


def test_loading_runs_no_code_from_the_file(artifacts, tmp_path):
    """Artifacts crafted to run code when a loaded model is called, their digests made to match: a shape condition
    that imports a module, paths that reach ``__globals__`` or call a method. Each is refused with what it holds, and
    nothing ran: a loaded model evaluates the file's expressions in a closed grammar, never with ``eval``."""
    marker = tmp_path / "ran"
    ids = convert_workers.call("hand-batch1", 16)[0][0]
    attacks = {
        "expression": (f"__import__('pathlib').Path({str(marker)!r}).touch() or 2 <= L['t0']", None),
        "reaching __globals__": (None, "L['ids'].__class__.__init__.__globals__"),
        "calling a method": (None, f"L['self'].register_buffer({str(marker)!r}, None)"),
    }
    for attack, (expression, path) in attacks.items():

        def change(meta, expression=expression, path=path):
            conditions = dict(meta["conversion"]["shape_conditions"])
            conditions["expression"] = expression or conditions["expression"]
            conditions["read"] = [[i, path or p, t] for i, p, t in conditions["read"]]
            return {**meta, "conversion": {**meta["conversion"], "shape_conditions": conditions}}

        loaded = ringpass.load(_rewritten(artifacts["dynamic"], tmp_path, change, digest=True))
        with pytest.raises(ringpass.InvalidInputError, match="Loading evaluates no code from a file") as refused:
            loaded(ids)
        assert ("__import__" if expression else path.split("(")[0].split(".")[-1]) in str(refused.value), attack
        assert not marker.exists() and str(marker) not in dict(loaded.model.named_buffers()), attack


def test_a_changed_or_foreign_artifact_is_refused(artifacts, tmp_path):
    changed = _rewritten(
        artifacts["static"], tmp_path, lambda meta: {**meta, "conversion": {**meta["conversion"], "world_size": 4}}
    )
    with pytest.raises(ringpass.InvalidInputError, match="was changed after it was saved"):
        ringpass.load(changed)
    foreign = str(tmp_path / "plain.pt2")
    torch.export.save(torch.export.export(torch.nn.Linear(2, 2), (torch.ones(1, 2),)), foreign)
    with pytest.raises(ringpass.InvalidInputError, match="is not a ringpass converted model"):
        ringpass.load(foreign)
    with pytest.raises(ringpass.InvalidInputError, match="no file"):
        ringpass.load(str(tmp_path / "missing.pt2"))


def test_an_artifact_from_another_version_is_refused(artifacts, tmp_path, monkeypatch):
    import ringpass.conversion.artifact as artifact

    written = re.escape(".".join(torch.__version__.split(".")[:2]))
    monkeypatch.setattr(torch, "__version__", "2.99.0")  # as if this process had another torch
    with pytest.raises(
        ringpass.InvalidInputError, match=rf"written with torch {written}.*this process has torch 2\.99"
    ):
        artifact.load(artifacts["static"])


def test_convert_refuses_what_it_cannot_convert():
    import inspect_targets

    with pytest.raises(ringpass.InvalidInputError, match="give world_size="):
        ringpass.convert(convert_workers.build("hand"), convert_workers.call("hand", 16)[0])
    with pytest.raises(ringpass.InvalidInputError, match="option `compiler` does not apply"):
        ringpass.convert(
            convert_workers.build("hand"), convert_workers.call("hand", 16)[0], world_size=2, compiler="eager"
        )
    with pytest.raises(ringpass.NotSupportedError, match="layout='documents' .* is not built for converted models"):
        ringpass.convert(
            convert_workers.build("hand"), convert_workers.call("hand", 16)[0], world_size=2, layout="documents"
        )
    dynamic = converted("hand", 2, 16, dynamic=True)  # checked before any process group is needed
    with pytest.raises(
        ringpass.InvalidInputError, match=r"does not fit these inputs \(ids \[2, 1\]\).*Sizes 0 and 1 are specialized"
    ):
        dynamic(convert_workers.call("hand", 1)[0][0])
    with pytest.raises(ringpass.InvalidInputError, match="the model raised on the example inputs"):
        ringpass.convert(convert_workers.build("hand"), convert_workers.call("hand", 16)[0][0].double(), world_size=2)

    class ReturnsItsLength(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = convert_workers.build("hand")

        def forward(self, ids):
            return self.inner(ids), ids.shape[1]

    with pytest.raises(ringpass.NotSupportedError, match="returns a size computed from its inputs' shapes"):
        ringpass.convert(ReturnsItsLength(), convert_workers.call("hand", 16)[0], world_size=2, dynamic=True)
    model, inputs = inspect_targets.no_attention()
    with pytest.raises(ringpass.NotSupportedError, match="no attention found"):
        ringpass.convert(model, inputs, world_size=2)
    model, inputs = inspect_targets.graph_break()
    with pytest.raises(ringpass.NotSupportedError, match="as one graph"):
        ringpass.convert(model, inputs, world_size=2)


def test_convert_command_writes_a_loadable_artifact(tmp_path):
    out = tmp_path / "llama.pt2"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "ringpass.cli",
            "convert",
            f"{TARGETS}:llama",
            "--world-size",
            "2",
            "--seq-len",
            "16",
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert run.returncode == 0, run.stderr
    assert (
        "ringpass convert: every attention becomes ring attention over 2 ranks" in run.stdout
        and f"wrote {out}" in run.stdout
    )
    assert ringpass.load(str(out)).conversion.world_size == 2


@pytest.mark.heavy
def test_convert_command_from_a_hugging_face_config(tmp_path):
    import transformers

    transformers.LlamaConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(tmp_path / "config")
    out = tmp_path / "llama.pt2"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "ringpass.cli",
            "convert",
            "--hf-config",
            str(tmp_path / "config"),
            "--labels",
            "--world-size",
            "4",
            "--seq-len",
            "32",
            "--dynamic",
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert run.returncode == 0, run.stderr
    loaded = ringpass.load(str(out))
    assert loaded.conversion.world_size == 4 and loaded.conversion.dynamic
    assert [a.name for a in loaded.conversion.arguments] == ["input_ids", "labels", "use_cache"]
