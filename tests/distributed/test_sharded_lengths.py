"""inputs="sharded": a model that reads the sequence length as a number sees the whole sequence's length.

Each rank passes its shard, so Dynamo traces the model at N/P tokens. Under static shapes it folds every
``x.shape[1]`` into that number; the backend has Dynamo trace again with the sequence dims dynamic
(`ringpass.frontend.retrace`), and `globalize_sharded_lengths` gives every read of the length as a value N. ESM's
token dropout (issue 27: logits 11% off before) and a hand-written model, static and ``dynamic=True``, on 2
ranks (one spawn: ESM static and the hand-written model dynamic; the others with -m heavy): logits equal the
unsharded model's, the ring ran, one compile serves a second length.
A length fixed while tracing, and a read that is neither a size nor a number, are refused with the op, the
line and what to do.
"""

from functools import cache

import pytest
import sharded_length_workers as workers
import torch

import ringpass
from ringpass.cli.launch import spawn_ranks

TIMEOUT = 240
CASES = [
    *[
        (f"scaled-{mode}", dict(name="scaled", dynamic=dynamic, lengths=(16, 24)))
        for mode, dynamic in (("static", None), ("dynamic", True))
    ],
    *[
        (f"esm-{mode}", dict(name="esm", dynamic=dynamic, lengths=(32,)))
        for mode, dynamic in (("static", None), ("dynamic", True))
    ],
    ("scaled-static-false", dict(name="scaled", dynamic=False, lengths=(16,))),  # dynamic=False: the same retrace
    ("specialized-static", dict(name="specialized", dynamic=None, lengths=(16,))),
    ("specialized-dynamic", dict(name="specialized", dynamic=True, lengths=(16,))),
    ("shift-static", dict(name="shift", dynamic=None, lengths=(16,))),
]


# suite time: each mode runs by default on one family (static: ESM; dynamic: scaled), the rest with -m heavy
HEAVY = ("esm-dynamic", "scaled-static", "scaled-static-false")


@cache
def results(heavy: bool = False) -> list[dict]:
    """Every rank's results of the default cases (one spawn), or of the heavy ones."""
    return spawn_ranks(workers.run_cases, 2, ([c for c in CASES if (c[0] in HEAVY) == heavy],), timeout=TIMEOUT)


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize(
    "case_id",
    [
        pytest.param(c, marks=[pytest.mark.heavy] if c in HEAVY else [])
        for c, _ in CASES
        if not c.startswith(("specialized", "shift"))
    ],
)
def test_a_length_read_as_a_number_is_the_whole_sequences(case_id):
    for rank, per_rank in enumerate(results(case_id in HEAVY)):
        result = per_rank[case_id]
        assert "refused" not in result, (rank, result["refused"])
        assert max(result["errors"]) <= 1e-5 and max(result["gathered"]) <= 1e-5, (rank, result)
        assert all(kv > 0 for kv in result["kv"]), (rank, result["kv"])  # the ring ran
        # one backend call (the static trace Dynamo traced again leaves no compile); a second length compiles nothing
        assert set(result["compiles"]) == {1}, (rank, result["compiles"])
        assert result["marks"] == [[]] * len(result["marks"]), result["marks"]  # no mark left on the user's tensor
        assert any("sequence length read by" in line for line in result["positions"]), result["positions"]


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize("case_id", ["specialized-static", "specialized-dynamic"])
def test_a_length_fixed_while_tracing_is_refused(case_id):
    for per_rank in results():
        kind, is_refusal, message = per_rank[case_id]["refused"]
        assert is_refusal, (kind, message)
        assert "fixes the sequence length to this rank's 8" in message, message
        assert "sharded_length_workers.py" in message and "x.shape[1] == 8" in message, message  # where
        assert "inputs='full'" in message, message  # what to do


@pytest.mark.timeout(TIMEOUT + 60)
def test_a_length_read_neither_as_size_nor_as_number_is_refused():
    for per_rank in results():
        kind, is_refusal, message = per_rank["shift-static"]["refused"]
        assert is_refusal, (kind, message)
        assert "`roll`" in message and "sharded_length_workers.py" in message, message
        assert "reads the sequence length" in message and "inputs='full'" in message, message


def test_inspect_traces_sharded_inputs_again_and_reports_the_reads():
    """Offline: `ringpass.inspect` does what the backend does (no process group)."""
    shard = torch.randint(3, workers.VOCAB, (2, 8))
    found = ringpass.inspect(workers.ScaledByLength(), (shard,), world_size=2, inputs="sharded")
    assert found.status == "rewritten", found.reports[0].refusal
    reads = [line for line in found.reports[0].positions if "sequence length read by" in line]
    assert len(reads) == 2 and all("sharded_length_workers.py" in line for line in reads), found.reports[0].positions
    assert not [k for k in vars(shard) if k.startswith("_dynamo")]
