"""What each rank runs in the failure-injection tests: a small GPT compiled with the ring backend, and
one rank (the victim) that raises, dies or disagrees with the others. Every rank returns the error it
raised and the seconds from the start of the failing step to that error."""

from __future__ import annotations

import os
import signal
import time

import torch

import models
import ringpass
from lowering import record_ring_events

SEQ_LEN = 12


def _ids(seq_len: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 61, (2, seq_len), generator=torch.Generator().manual_seed(seed))


def _compiled(make=models.GPT, seed: int = 0, **options):
    torch.manual_seed(seed)
    torch._dynamo.reset()
    model = make().double()
    return torch.compile(model, backend=ringpass.backend(compiler="eager", report="off", **options), fullgraph=True)


def _step(model, ids) -> None:
    model(ids).square().mean().backward()


def _outcome(step, linger: float = 0.0) -> dict:
    """The error ``step`` raised (None if none) and the seconds it took. After an error the process stays
    ``linger`` seconds: here rank 0 hosts the rendezvous store, which under torchrun its agent hosts, so
    a survivor leaving at once would take the store from the ranks still finding out."""
    start = time.monotonic()
    try:
        step()
    except Exception as error:  # noqa: BLE001 -- the test asserts which error
        seconds = time.monotonic() - start
        time.sleep(linger)
        return {"error": f"{type(error).__name__}: {error}", "seconds": seconds}
    return {"error": None, "seconds": time.monotonic() - start}


def fail_in_the_ring(rank: int, world_size: int, how: str, victim: int, phase: str) -> dict:
    """One clean training step, then one in which the victim raises (``how="raise"``) or is killed with
    SIGKILL (``how="kill"``) at its first KV exchange of the ``phase`` ring."""
    model = _compiled()
    _step(model, _ids(SEQ_LEN))

    def inject(event):
        if rank == victim and event.kind == "exchange" and event.fields["phase"] == phase:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected failure on rank {rank}")

    with record_ring_events(on_event=inject):
        return _outcome(lambda: _step(model, _ids(SEQ_LEN)), linger=2.0)


class CumsumAfterGPT(torch.nn.Module):
    """The GPT with a running sum over the sequence after it: the backend refuses it."""

    def __init__(self):
        super().__init__()
        self.gpt = models.GPT()

    def forward(self, ids):
        return self.gpt(ids).cumsum(1)


def disagree(rank: int, world_size: int, victim: int) -> dict:
    """Each case compiles afresh; the victim passes another length, other options, a model the backend
    refuses, or another batch. The last case has every rank agree (the group is still usable)."""
    mine = rank == victim
    cases = {
        "length": lambda: _step(_compiled(), _ids(SEQ_LEN + 2 if mine else SEQ_LEN)),
        "options": lambda: _step(_compiled(layout="contiguous" if mine else "zigzag"), _ids(SEQ_LEN)),
        "refused": lambda: _step(_compiled(CumsumAfterGPT if mine else models.GPT), _ids(SEQ_LEN)),
        "batch": lambda: _step(_compiled(), _ids(SEQ_LEN, seed=rank if mine else 0)),
        "weights": lambda: _step(_compiled(seed=rank if mine else 0), _ids(SEQ_LEN)),
        "agree": lambda: _step(_compiled(), _ids(SEQ_LEN)),
    }
    return {name: _outcome(case) for name, case in cases.items()}



class NoAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(61, 8)

    def forward(self, ids):
        return self.embed(ids).relu()


def unsharded_and_autocast(rank: int, world_size: int) -> dict:
    """A graph without attention warns (or, with unsharded="error", raises); a Llama under
    ``torch.autocast(bfloat16)`` runs through the ring as it runs whole under autocast."""
    import warnings

    from reference import rel_err

    results = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _compiled(NoAttention)(_ids(SEQ_LEN))
    results["warnings"] = [str(w.message) for w in caught if w.category is ringpass.RingpassWarning]
    results["error"] = _outcome(lambda: _compiled(NoAttention, unsharded="error")(_ids(SEQ_LEN)))["error"]

    torch.manual_seed(0)
    model = models.Llama()
    ids = _ids(SEQ_LEN)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(ids)
        torch._dynamo.reset()
        with record_ring_events() as events:
            got = torch.compile(model, backend=ringpass.backend(compiler="aot_eager", report="off"), fullgraph=True)(ids)
    results["autocast"] = {"dtype": str(got.dtype), "error": rel_err(got.float(), expected.float()),
                           "exchanges": sum(e.kind == "exchange" for e in events)}
    return results
