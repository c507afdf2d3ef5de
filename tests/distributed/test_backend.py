"""torch.compile(model, backend="ring") on 2 and 4 gloo ranks against the same model run whole.

Every rank compares the compiled model's outputs and every parameter's gradient with the uncompiled
model on the full sequence in one process (same seed). fp64 runs must agree to 1e-10 (measured ~1e-15),
fp32 runs to 1e-4. The cases run in spawns of up to `CHUNK` (`Matrix`): only those the selected tests read,
and a case that raises, crashes or hangs fails alone. The default suite runs each family once and each mode once
on 2 ranks (`_default_share`); ``-m heavy`` runs every family in every mode, on 2 and on 4 ranks.
"""

import re
import tempfile
from functools import cache
from pathlib import Path

import backend_workers
import models
import pytest
import torch

from ringpass.cli.launch import RankFailure, spawn_ranks

TIMEOUT = 400
MODELS = ("gpt", "llama", "hand_written", "encoder", "gpt_with_loss")
LEARNED = ("learned_bias", "learned_bias_padded")  # trained score biases: fp64 static here, fp32 and dynamic heavy
# every family of backend_workers.MODELS with its inputs passed sharded and its outputs kept sharded (labels
# shifted and padding masks read whole are all-gathered); dynamic shapes on 2 ranks where the family has them
SHARDED_IO = (
    "gpt",
    "llama",
    "hand_written",
    "encoder",
    "gpt_with_loss",
    "llama_repeat_kv",
    "llama_last_tokens",
    "gpt_regions",
    "position_table_pooling",
    "torch_layers",
    "encoder_padded",
    "hand_written_packed",
    "learned_bias_padded",
)
SHARDED_IO_DYNAMIC = ("gpt", "llama", "encoder_padded", "hand_written_packed")  # the rest: HEAVY_CASES (-m heavy)
# suite time: compiler="eager" runs by default in the HF and sharded-length tests, learned biases on the padded family
REPEATED = ("gpt-eager", "learned_bias-static-float64")
OTHER_DYNAMIC = ("gpt_regions", "torch_layers", "llama_last_tokens")  # dynamic with full inputs, beyond MODELS
# torch 2.15's Dynamo cannot trace a nested compile region holding a Python float (LayerNorm's eps) with
# dynamic=True, whatever the backend; specialize_float=True is the way round (docs/backend.md, known limits;
# test_regions_trace_dynamically_with_their_floats_specialised)
REGIONS_TRACE_FLOATS = torch.__version__ < "2.15"
FLOAT32 = ("gpt", "llama", "encoder_padded", "hand_written_packed", "gpt_with_loss", "torch_layers")  # fp32 tolerance
SHARDED_IO_ON_4 = ("gpt", "llama", "gpt_with_loss", "encoder_padded", "hand_written_packed", "learned_bias_padded")


def _heavy_cases() -> list:
    """On 2 ranks: the rest of the 2-rank matrix (`_default_share`), the other families' dynamic shapes with
    sharded inputs and outputs, and the trained score biases in fp32 and dynamic shapes."""
    kept = {case_id for case_id, _ in _default_share(_matrix(2))}
    return (
        [case for case in _matrix(2) if case[0] not in kept]
        + [
            (
                f"{name}-sharded_io-dynamic",
                dict(
                    name=name,
                    seq_len=8,
                    dynamic=True,
                    options={"compiler": "aot_eager", "inputs": "sharded", "outputs": "sharded"},
                ),
            )
            for name in SHARDED_IO
            if name not in SHARDED_IO_DYNAMIC
        ]
        + [
            (
                f"{name}-{mode}",
                dict(name=name, seq_len=11, options={"compiler": "aot_eager"}, dynamic=dynamic, dtype=dtype),
            )
            for name in LEARNED
            for mode, dynamic, dtype in (
                ("static-float32", None, torch.float32),
                ("dynamic-float64", True, torch.float64),
            )
        ]
    )


def _cases(world_size) -> list:
    """The cases a world size's tests read: on 2 ranks `_default_share` of the matrix, on 4 all of it, and for
    ``"heavy"`` `_heavy_cases`."""
    if world_size == "heavy":
        return _heavy_cases()
    return _default_share(_matrix(2)) if world_size == 2 else _matrix(world_size)


def _default_share(cases: list) -> list:
    """The cases the default suite runs (suite time): each family in the first mode it appears in and each mode
    (options, dynamic shapes, dtype, length) on the first family that has it, but the `REPEATED`; the whole cross
    product runs with ``-m heavy``."""
    families, modes, kept = set(), set(), []
    for case_id, arguments in cases:
        if case_id in REPEATED:
            continue
        options = tuple(sorted(arguments["options"].items()))
        mode = (options, arguments["dynamic"], arguments.get("dtype"), arguments["seq_len"])
        if arguments["name"] not in families or mode not in modes:
            kept.append((case_id, arguments))
        families.add(arguments["name"])
        modes.add(mode)
    return kept


def _matrix(world_size: int) -> list:
    """Every family in every mode on ``world_size`` ranks (fewer modes on 4)."""
    seq_len = 4 * world_size + 3  # padded by the layout: 2P does not divide it
    cases = []
    for name in MODELS:  # float32 static on 2 ranks for FLOAT32; dynamic shapes on 2 ranks, and for the GPT on 4
        for dynamic in (None, True) if world_size == 2 or name == "gpt" else (None,):
            for dtype in (
                (torch.float64, torch.float32)
                if world_size == 2 and not dynamic and name in FLOAT32
                else (torch.float64,)
            ):
                case_id = f"{name}-{'dynamic' if dynamic else 'static'}-{str(dtype)[6:]}"
                cases.append(
                    (
                        case_id,
                        dict(
                            name=name, seq_len=seq_len, options={"compiler": "aot_eager"}, dynamic=dynamic, dtype=dtype
                        ),
                    )
                )
    cases += [
        (f"{name}-static-float64", dict(name=name, seq_len=seq_len, options={"compiler": "aot_eager"}, dynamic=None))
        for name in LEARNED
    ]
    cases += [  # recognition does not depend on the world size: the spellings run on 2 ranks
        (
            f"spelling_{name}",
            dict(name=f"spelling_{name}", seq_len=seq_len, options={"compiler": "aot_eager"}, dynamic=None),
        )
        for name in models.SPELLINGS
        if world_size == 2
    ]
    cases += [  # a sequence as long as the head dim, and as long as the hidden size
        ("gpt-seq_len_is_head_dim", dict(name="gpt", seq_len=8, options={"compiler": "aot_eager"}, dynamic=None)),
        ("gpt-seq_len_is_hidden", dict(name="gpt", seq_len=32, options={"compiler": "aot_eager"}, dynamic=None)),
        (
            "position_table_pooling",
            dict(name="position_table_pooling", seq_len=seq_len, options={"compiler": "aot_eager"}, dynamic=None),
        ),
        ("gpt-eager", dict(name="gpt", seq_len=seq_len, options={"compiler": "eager"}, dynamic=None)),
        ("gpt_regions", dict(name="gpt_regions", seq_len=seq_len, options={"compiler": "aot_eager"}, dynamic=None)),
        ("torch_layers", dict(name="torch_layers", seq_len=seq_len, options={"compiler": "aot_eager"}, dynamic=None)),
        (
            "llama_repeat_kv",
            dict(name="llama_repeat_kv", seq_len=seq_len, options={"compiler": "aot_eager"}, dynamic=None),
        ),
        (
            "llama_last_tokens",
            dict(name="llama_last_tokens", seq_len=seq_len, options={"compiler": "aot_eager"}, dynamic=None),
        ),
    ]
    cases += [  # dynamic shapes: floats of the model (LayerNorm eps, nn.MultiheadAttention's dropout) traced as
        # inputs, nn.Transformer's S x S causal mask, the last tokens picked, nested compile regions
        (
            f"{name}-dynamic",
            dict(
                name=name,
                seq_len=seq_len,
                options={"compiler": "aot_eager"},
                dynamic=True,
                specialize_float=name == "gpt_regions" and not REGIONS_TRACE_FLOATS,
            ),
        )
        for name in OTHER_DYNAMIC
        if world_size == 2
    ]
    cases += [
        (
            "gpt-grads_local",
            dict(name="gpt", seq_len=seq_len, options={"compiler": "aot_eager", "grads": "local"}, dynamic=None),
        ),
        # shares x P for an outer mean; a total fed back into every token (always reduced) and a sliced table
        (
            "position_table_pooling-grads_mean",
            dict(
                name="position_table_pooling",
                seq_len=seq_len,
                options={"compiler": "aot_eager", "grads": "mean"},
                dynamic=None,
            ),
        ),
        ("llama-inductor", dict(name="llama", seq_len=seq_len, options={"compiler": "inductor"}, dynamic=None)),
        (
            "encoder_mask_input-materialize",
            dict(
                name="encoder_mask_input",
                seq_len=seq_len,
                options={"compiler": "aot_eager", "masks": "materialize"},
                dynamic=None,
            ),
        ),
        # a learned S x S bias held whole: its gradient comes back through the tiles the ring read
        (
            "square_bias-materialize",
            dict(
                name="square_bias",
                seq_len=seq_len,
                options={"compiler": "aot_eager", "masks": "materialize"},
                dynamic=None,
            ),
        ),
    ]
    cases += [  # each rank passes its own shard and keeps its own shard of the outputs
        (
            f"{name}-sharded_io-{'dynamic' if dynamic else 'static'}",
            dict(
                name=name,
                seq_len=4 * world_size,
                options={"compiler": "aot_eager", "inputs": "sharded", "outputs": "sharded"},
                dynamic=dynamic,
            ),
        )
        for name in (SHARDED_IO if world_size == 2 else SHARDED_IO_ON_4)
        for dynamic in ((None, True) if world_size == 2 and name in SHARDED_IO_DYNAMIC else (None,))
    ]
    cases += [  # masks read from inputs: lifted programs evaluated per tile (dynamic shapes on 2 ranks only)
        (
            f"{name}-{'dynamic' if dynamic else 'static'}",
            dict(name=name, seq_len=seq_len, options={"compiler": "aot_eager"}, dynamic=dynamic),
        )
        for name in ("encoder_padded", "hand_written_packed")
        for dynamic in ((None, True) if world_size == 2 else (None,))
    ]
    return cases


CHUNK = 24  # cases per spawn: each spawn stays well inside TIMEOUT on 2 cores


class CaseFailed(Exception):
    """A case of the matrix raised on a rank, or its spawn crashed or hung while it ran."""


def _cases_read_by(item) -> list[tuple]:
    """The (world size, case id) pairs a collected test of this file reads: its own case, every case of its world
    size, or those its ``backend_cases(world_size, *case_ids)`` mark names."""
    if item.path != Path(__file__):
        return []
    params = item.callspec.params if hasattr(item, "callspec") else {}
    if "case_id" in params:
        return [(params["world_size"], params["case_id"])]
    if "world_size" in params:
        return [(params["world_size"], case_id) for case_id, _ in _cases(params["world_size"])]
    mark = item.get_closest_marker("backend_cases")
    return [(mark.args[0], case_id) for case_id in mark.args[1:]] if mark else []


class Matrix:
    """Every rank's result of each case the selected tests read, each case run once. The first test that asks for
    a case not run yet spawns it with the next of its world size's selected cases still to run (`CHUNK` in all:
    the whole matrix spawns once per chunk, one case selected spawns alone). A case that raised fails alone; a spawn
    that crashes or hangs fails the case it was running, and its cases not yet run wait for a fresh spawn."""

    def __init__(self, items):
        self.to_run: dict = {}  # world size -> the selected case ids no spawn has run yet, in the matrix's order
        for world_size, case_id in (pair for item in items for pair in _cases_read_by(item)):
            if case_id not in self.to_run.setdefault(world_size, []):
                self.to_run[world_size].append(case_id)
        self.done: dict = {}  # (world size, case id) -> every rank's result, or the CaseFailed to raise

    def results(self, world_size, case_id: str) -> list[dict]:
        """Every rank's result of one case (``world_size`` "heavy": the heavy cases, on 2 ranks)."""
        if (world_size, case_id) not in self.done:
            waiting = [c for c in self.to_run.get(world_size, []) if c != case_id]
            self._spawn(world_size, [case_id, *waiting[: CHUNK - 1]])
            self.to_run[world_size] = [c for c in waiting if (world_size, c) not in self.done]
        found = self.done[world_size, case_id]
        if isinstance(found, CaseFailed):
            raise found
        return found

    def _spawn(self, world_size, chunk: list[str]) -> None:
        """Runs ``chunk`` in one spawn and keeps what each case gave; see `backend_workers.run_cases` for the
        records read here."""
        ranks, arguments = 2 if world_size == "heavy" else world_size, dict(_cases(world_size))
        with tempfile.TemporaryDirectory() as record_dir:
            try:
                spawn_ranks(
                    backend_workers.run_cases, ranks, ([(c, arguments[c]) for c in chunk], record_dir), timeout=TIMEOUT
                )
                spawn_failure = None
            except RankFailure as failure:
                spawn_failure = failure
            records = Path(record_dir)
            per_case = [
                [
                    torch.load(f, weights_only=False) if (f := records / f"{index}-{rank}.pt").exists() else None
                    for rank in range(ranks)
                ]
                for index in range(len(chunk))
            ]
            started = {f.read_text() for f in records.glob("started-*")}
        for index, (case_id, per_rank) in enumerate(zip(chunk, per_case)):
            errors = "".join(
                f"\nrank {rank}: {result['error']}"
                for rank, result in enumerate(per_rank)
                if result is not None and "error" in result
            )
            if None not in per_rank:
                self.done[world_size, case_id] = CaseFailed(f"{case_id} raised:{errors}") if errors else per_rank
                continue
            if started.isdisjoint(chunk[index:]):  # the spawn failed before these cases: they all fail
                failures = {c: f"{c}: its spawn failed before the case started\n{spawn_failure}" for c in chunk[index:]}
            else:  # the first case some rank did not finish was running: it fails, the rest run again
                failures = {case_id: f"{case_id} was running when its spawn failed{errors}\n{spawn_failure}"}
            self.done.update({(world_size, c): CaseFailed(message) for c, message in failures.items()})
            break


@pytest.fixture(scope="session")
def matrix(request) -> Matrix:
    return Matrix(request.session.items)


def _params():  # 4 ranks: heavy (the composition tests compile on 4 ranks in the default suite)
    return [
        pytest.param(p, case_id, id=f"P{p}-{case_id}", marks=[pytest.mark.heavy] if p == 4 else [])
        for p in (2, 4)
        for case_id, _ in _cases(p)
    ] + [pytest.param("heavy", case_id, id=f"P2-{case_id}", marks=pytest.mark.heavy) for case_id, _ in _heavy_cases()]


@pytest.mark.timeout(TIMEOUT + 60)  # a case not run yet runs in a spawn of one chunk
@pytest.mark.parametrize("world_size,case_id", _params())
def test_compiled_model_matches_the_unsharded_model(matrix, world_size, case_id):
    bound = 1e-4 if "float32" in case_id else 1e-10
    for rank, result in enumerate(matrix.results(world_size, case_id)):
        assert max(result["outputs"]) <= bound, f"rank {rank}: outputs {result['outputs']}"
        assert result["grads"] <= bound, f"rank {rank}: gradients {result['grads']:.2e}"


@pytest.mark.timeout(4 * (TIMEOUT + 60))  # run alone, every chunk's spawn
@pytest.mark.parametrize(
    "world_size", [2, pytest.param(4, marks=pytest.mark.heavy), pytest.param("heavy", marks=pytest.mark.heavy)]
)
def test_graph_has_one_ring_op_per_attention_and_no_sdpa(matrix, world_size):
    for case_id, _ in _cases(world_size):
        ops = matrix.results(world_size, case_id)[0]["ops"]
        layers = (
            1
            if case_id.startswith(("hand_written", "spelling", "position_table", "learned_bias", "square_bias"))
            else 2
        )
        assert ops.get("ring_attention.default") == layers, (case_id, ops)
        assert not any("scaled_dot_product" in op or op == "softmax" for op in ops), (case_id, ops)


@pytest.mark.backend_cases(
    2, "gpt-static-float64", "gpt_with_loss-static-float64", "encoder-static-float64", "gpt-sharded_io-static"
)
def test_expected_collectives_in_the_graph(matrix):
    gpt = matrix.results(2, "gpt-static-float64")[0]["ops"]
    assert gpt["shard_sequence.default"] == 1 and "gather_sequence.default" not in gpt  # ids in; logits carried out
    assert gpt["local_positions.default"] == 1 and "all_reduce_sum.default" not in gpt
    loss = matrix.results(2, "gpt_with_loss-static-float64")[0]["ops"]
    assert loss["all_reduce_sum.default"] == 2  # sum of token losses, count of counted tokens
    assert loss["shard_sequence.default"] == 2  # ids, and the shifted labels after the shift
    encoder = matrix.results(2, "encoder-static-float64")[0]["ops"]
    assert encoder["all_reduce_sum.default"] == 1  # the mean over tokens
    sharded = matrix.results(2, "gpt-sharded_io-static")[0]["ops"]
    assert "gather_sequence.default" not in sharded and "shard_sequence.default" not in sharded


@pytest.mark.backend_cases(2, "llama_repeat_kv")
def test_repeated_kv_heads_travel_unrepeated(matrix):
    result = matrix.results(2, "llama_repeat_kv")[0]
    assert {(a["query_heads"], a["kv_heads"]) for a in result["report"]["attentions"]} == {(4, 2)}
    assert "expand" not in str(result["ops"])


@pytest.mark.backend_cases(2, "llama_last_tokens")
def test_last_tokens_are_picked_not_gathered(matrix):
    report = matrix.results(2, "llama_last_tokens")[0]["report"]
    n = 4 * 2 + 3
    picked = f"the token(s) at position(s) {list(range(n - 3, n))} picked by every rank"
    assert ("all-reduce", "forward", picked) in [(c["kind"], c["phase"], c["what"]) for c in report["collectives"]]
    assert "gathered" not in [output["placement"] for output in report["outputs"]], report["outputs"]


@pytest.mark.backend_cases(2, "gpt-static-float64")
def test_report_names_what_was_rewritten(matrix):
    """The full report as people read it (logged at INFO, printed by ``ringpass inspect``): the test of its text."""
    report = matrix.results(2, "gpt-static-float64")[0]["report_text"]
    assert "2 attention(s) rewritten to ring attention over 2 ranks, layout zigzag" in report
    assert "sdpa (causal" in report and "models.py" in report
    assert "arange -> this rank's positions" in report
    assert "backward: all-reduce of the gradients of" in report


@pytest.mark.heavy  # suite time (README, "Heavier cases")
def test_dynamic_compile_serves_other_lengths_without_recompiling():
    for result in spawn_ranks(backend_workers.several_lengths, 2, ("gpt_with_loss", (13, 16, 21)), timeout=TIMEOUT):
        first, *later = result["compiles"]  # backend calls after each length
        assert first >= 1 and all(n == first for n in later), result["compiles"]
        assert max(result["errors"]) <= 1e-10


@pytest.mark.heavy  # suite time (README, "Heavier cases")
def test_a_float_attribute_changed_after_a_dynamic_compile_is_recompiled():
    for result in spawn_ranks(backend_workers.changed_float_attribute, 2, timeout=TIMEOUT):
        assert max(result["errors"]) <= 1e-10 and result["changed"] <= 1e-10, result
        first, after_change = result["compiles"]
        assert after_change > first, result  # the new value is compiled in, not the old one used
        report = result["report"]
        assert (report["status"], len(report["attentions"]), report["world_size"]) == ("rewritten", 1, 2), report


def test_backend_by_its_registered_name_with_options():
    for result in spawn_ranks(backend_workers.by_registered_name, 2, timeout=TIMEOUT):
        assert result["error"] <= 1e-10
        assert result["report"]["layout"] == "contiguous"


def test_bad_options_are_refused_with_the_choices():
    import ringpass
    from lowering import InvalidInputError

    with pytest.raises(InvalidInputError, match="layout='diagonal' is not one of 'auto', 'zigzag', 'contiguous'"):
        ringpass.backend(layout="diagonal")
    with pytest.raises(InvalidInputError, match="Unknown ring backend option\\(s\\) shards"):
        ringpass.backend(shards=2)
    with pytest.raises(InvalidInputError, match="checks='sometimes' is not one of 'every', 'first', 'off'"):
        ringpass.backend(checks="sometimes")
    with pytest.raises(InvalidInputError, match="timeout=0 must be a positive number of seconds"):
        ringpass.backend(timeout=0)


def test_one_process_compiles_unchanged():
    import models

    import ringpass

    model = models.GPT()
    ids = torch.randint(0, 61, (2, 8))
    backend = ringpass.backend(compiler="eager")
    torch.testing.assert_close(torch.compile(model, backend=backend)(ids), model(ids))
    assert backend.reports[-1].as_dict()["status"] == "unchanged"


@pytest.mark.heavy  # suite time (README, "Heavier cases")
def test_two_data_parallel_replicas_of_two_rank_rings():
    for result in spawn_ranks(backend_workers.data_parallel_rings, 4, ("llama", 11), timeout=TIMEOUT):
        assert max(result["outputs"]) <= 1e-10 and result["grads"] <= 1e-10


@pytest.mark.heavy  # suite time (README, "Heavier cases")
def test_masks_that_only_look_causal_match_eager_at_every_length():
    """Tables equal to arange only below some length, negative indices, alpha=, -1e300 fills, S x S masks made
    from the length alone (nn.Transformer's, a causal buffer's prefix, a band): a static compile at 10 tokens,
    then a dynamic one at 12 that must hold at 80 (automatic dynamic shapes). A band whose width is computed
    from the length cannot be read once the length is symbolic: Dynamo traces it again with static shapes, a graph
    per length (its report says so), each exact."""
    for results in spawn_ranks(backend_workers.mask_readings, 2, ([10, 12, 80],), timeout=TIMEOUT):
        for name, result in results.items():
            notes = result["report"]["notes"]
            retraced = any("traced again with static shapes: the attention mask" in n for n in notes)
            assert retraced == (name == "window_from_length"), (name, result["report"])
            assert max(result["errors"]) <= 1e-10, (name, result)
            assert (result["report"]["status"], result["report"]["world_size"]) == ("rewritten", 2), (name, result)
        assert [a["window"] for a in results["window_from_sizes"]["report"]["attentions"]] == [5]
        assert [a["mask"] for a in results["square_subsequent_mask"]["report"]["attentions"]] == ["causal"]


REFUSALS = {  # case -> what its error must say
    "cumprod": (
        r"`cumprod`.*backend_workers.py.*cannot run on a sequence-sharded activation.*Chain of ops between the "
        r"attention and the blocking op: `scaled_dot_product_attention` at backend_workers.py:\d+ -> `cumprod`"
    ),
    "dropout": r"dropout_p=0.1.*dropout inside ring attention is not supported",
    "lengths": r"16 queries but 4 keys",
    "reshape": r"`view`.*backend_workers.py.*splits the sequence axis",
    "sort": r"`sort`.*cannot run on a sequence-sharded activation: `sort` runs along the sequence",
    "max": r"`max`.*`max` runs along the sequence",
    "conv1d": r"`conv1d`.*is not known to act on each token separately",
    "token_mixing_linear": (
        r"`linear` .* cannot run on a sequence shard: RuntimeError: a and b must have same reduction dim"
    ),
    "sequence_long_weight": r"`linear` .* `linear` sums over the sequence",
    # the dynamic probe runs the vmap nest and fails at `view` (its levels closed again); traced again with static
    # shapes, the query is refused
    "vmap_dynamic": r"Attention `scaled_dot_product_attention` at .*backend_workers.py.*does not carry the sequence",
    "sxs_mask": r"attention mask of .*backend_workers.py.*needs `matmul`.*sequence x sequence tensor"
    r".*'masks': 'materialize'",
    "float_mask": r"is a boolean mask cast to a float.*backend_workers.py.*Pass the boolean mask itself",
    "flex": r"The score_mod of `flex_attention` at .* computes `mul` .* from the score",
}


@cache
def refusal_errors() -> list[dict]:
    """Every rank's error for each case of `REFUSALS`, from one spawn."""
    return spawn_ranks(backend_workers.refusals, 2, (list(REFUSALS),), timeout=TIMEOUT)


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_name_the_op_and_the_source_line(case):
    for errors in refusal_errors():
        error = errors[case]
        assert error.startswith("NotSupportedError: "), error  # ringpass's own type and message, unwrapped
        assert re.search(REFUSALS[case], error, re.S), error
        assert "logged:" not in error, error  # no fake-tensor tracebacks from the backend's probe
        assert "left open" not in error, error  # the probe closes the vmap levels it opens (Jamba's scan)


def test_regions_trace_dynamically_with_their_floats_specialised():
    """The way round torch 2.15's failure the matrix takes (``REGIONS_TRACE_FLOATS``): with ``specialize_float``
    Dynamo traces the nested compile regions with dynamic shapes (the plain ``eager`` backend, no ringpass); without
    it torch 2.15 fails ("Freevar has no source"). When a release fixes that, this fails: drop the way round."""
    ids = torch.randint(0, 61, (2, 16))
    for specialize_float in (True, False):
        torch._dynamo.reset()
        model = models.GPT(regions=True)
        with torch._dynamo.config.patch(specialize_float=specialize_float):
            compiled = torch.compile(model, backend="eager", fullgraph=True, dynamic=True)
            if specialize_float:
                torch.testing.assert_close(compiled(ids), model(ids))
            elif not REGIONS_TRACE_FLOATS:
                with pytest.raises(AssertionError, match="Freevar has no source"):
                    compiled(ids)
