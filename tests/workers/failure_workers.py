"""What each rank runs in the failure-injection tests: a small GPT compiled with the ring backend, and
one rank (the victim) that raises, dies or disagrees with the others. Every rank returns the error it
raised and the seconds from the start of the failing step to that error."""

from __future__ import annotations

import os
import signal
import time

import models
import torch
import torch.distributed as dist

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
    except Exception as error:
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


class CumprodAfterGPT(torch.nn.Module):
    """The GPT with a running product over the sequence after it: the backend refuses it."""

    def __init__(self):
        super().__init__()
        self.gpt = models.GPT()

    def forward(self, ids):
        return self.gpt(ids).cumprod(1)


def disagree(rank: int, world_size: int, victim: int) -> dict:
    """Each case compiles afresh; the victim passes another length, other options, a model the backend
    refuses, or another batch (at once, or on the third call: a loader that drifts). The last case has every rank
    agree (the group is still usable)."""
    mine = rank == victim
    cases = {
        "length": lambda: _step(_compiled(), _ids(SEQ_LEN + 2 if mine else SEQ_LEN)),
        "options": lambda: _step(_compiled(layout="contiguous" if mine else "zigzag"), _ids(SEQ_LEN)),
        "refused": lambda: _step(_compiled(CumprodAfterGPT if mine else models.GPT), _ids(SEQ_LEN)),
        "batch": lambda: _step(_compiled(), _ids(SEQ_LEN, seed=rank if mine else 0)),
        "weights": lambda: _step(_compiled(seed=rank if mine else 0), _ids(SEQ_LEN)),
        "drift": lambda: _drifting(_compiled(), mine),
        "agree": lambda: _step(_compiled(), _ids(SEQ_LEN)),
    }
    return {name: _outcome(case) for name, case in cases.items()}


def _drifting(model, mine: bool) -> None:
    """Two steps on the same batch everywhere, then the victim's loader drifts: another batch on the third."""
    for call in range(3):
        _step(model, _ids(SEQ_LEN, seed=1 if mine and call == 2 else 0))


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
            got = torch.compile(model, backend=ringpass.backend(compiler="aot_eager", report="off"), fullgraph=True)(
                ids
            )
    results["autocast"] = {
        "dtype": str(got.dtype),
        "error": rel_err(got.float(), expected.float()),
        "exchanges": sum(e.kind == "exchange" for e in events),
    }
    return results


def random_architectures(rank: int, world_size: int, seeds: list, seq_len: int) -> dict:
    """Each seed's random model (tests/workers/random_models.py) compiled with the ring backend against itself
    run whole: the relative errors of the output and the gradients, and the ring exchanges it made."""
    import random_models
    from reference import grad_error, rel_err

    results = {}
    for seed in seeds:
        spec = random_models.draw(seed)
        torch.manual_seed(seed)
        model = random_models.RandomModel(spec).double()
        args = random_models.inputs(spec, seq_len, seed)
        weights = None
        expected = model(*args)
        if expected.dim():
            weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(seed), dtype=expected.dtype)
        (expected * weights if weights is not None else expected).sum().backward()
        expected_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        model.zero_grad()
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=ringpass.backend(compiler="aot_eager", report="off"), fullgraph=True)
        try:
            with record_ring_events() as events:
                got = compiled(*args)
                (got * weights if weights is not None else got).sum().backward()
        except Exception as error:
            results[seed] = {"spec": spec, "error": f"{type(error).__name__}: {error}"}
            continue
        results[seed] = {
            "spec": spec,
            "error": None,
            "output": rel_err(got.detach(), expected.detach()),
            "grads": grad_error({k: p.grad for k, p in model.named_parameters()}, expected_grads),
            "exchanges": sum(e.kind == "exchange" for e in events),
        }
    return results


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def edges(rank: int, world_size: int) -> dict:
    """Edges that must hold: NaN in an input propagates as it does unsharded; no_grad and inference_mode
    forwards; 50 training steps over three lengths (three compiles) equal the same steps unsharded, with
    no growth of reports, mask programs or memory after the compiles."""
    from reference import rel_err

    from lowering import masks
    from ringpass.frontend.ring_backend import _reports as every_report

    results = {}
    torch.manual_seed(0)
    encoder = models.Encoder().double()
    x = torch.randn(2, SEQ_LEN, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    x[0, 5, 3] = float("nan")
    expected, _ = encoder(x)
    torch._dynamo.reset()
    with record_ring_events() as events:
        got, _ = torch.compile(encoder, backend=ringpass.backend(compiler="aot_eager", report="off"), fullgraph=True)(x)
    got = got.full_tensor()  # the whole output (it leaves the graph sharded): boolean indexing needs it
    finite = ~expected.isnan()
    results["nan"] = {
        "same_nans": torch.equal(got.isnan(), expected.isnan()),
        "nan_rows": int(expected.isnan().any(-1).sum()),
        "finite_error": rel_err(got[finite], expected[finite]),
        "exchanges": sum(e.kind == "exchange" for e in events),
    }

    gpt = models.GPT().double()
    ids = _ids(SEQ_LEN)
    with torch.no_grad():
        expected = gpt(ids)
    for mode, context in (("no_grad", torch.no_grad), ("inference_mode", torch.inference_mode)):
        torch._dynamo.reset()
        with context(), record_ring_events() as events:
            got = torch.compile(gpt, backend=ringpass.backend(compiler="aot_eager", report="off"), fullgraph=True)(ids)
            got = got.full_tensor()
        results[mode] = {"error": rel_err(got, expected), "exchanges": sum(e.kind == "exchange" for e in events)}

    torch.manual_seed(0)
    reference, trained = models.WithLoss(models.GPT()).double(), models.WithLoss(models.GPT()).double()
    trained.load_state_dict(reference.state_dict())
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, trained)]
    backend = ringpass.backend(compiler="aot_eager", report="off")
    compiled = torch.compile(trained, backend=backend, fullgraph=True)
    sizes = {}
    for step in range(50):
        seq_len = (9, 12, 15)[step % 3]
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 61, (2, seq_len), generator=gen)
        labels = ids.clone()
        for model, optimizer in zip((reference, compiled), optimizers):
            optimizer.zero_grad()
            model(ids, labels)[0].backward()
            optimizer.step()
        if step in (9, 49):
            sizes[step] = {
                "reports": len(backend.reports),
                "all_reports": len(every_report),
                "mask_programs": len(masks._programs),
                "resident": _resident_bytes(),
            }
    results["training"] = {
        "sizes": sizes,
        "error": max(rel_err(p, q) for p, q in zip(trained.parameters(), reference.parameters())),
    }
    return results


def out_of_step(rank: int, world_size: int) -> dict:
    """After a clean call by hand (call 1: every rank agrees on it) and one of the compiled model (call 2),
    rank 0 calls `lowering.ring_attention` by hand again (agreed already: straight into the ring) while the
    others call the compiled model (call 3): each waits inside ringpass for the other (a deadlock). With
    ``timeout=3`` every rank raises within seconds."""
    from lowering import Layout, ring_attention

    model = _compiled(timeout=3.0)
    layout = Layout("zigzag", world_size, 16)
    q = torch.randn(1, 2, layout.local_len, 4, dtype=torch.float64)
    ring_attention(q, q, q, layout=layout, is_causal=True)
    _step(model, _ids(SEQ_LEN))
    if rank == 0:
        return _outcome(lambda: ring_attention(q, q, q, layout=layout, is_causal=True), linger=2.0)
    return _outcome(lambda: _step(model, _ids(SEQ_LEN)), linger=2.0)


def freeze_in_the_ring(rank: int, world_size: int, victim: int) -> dict:
    """After a clean step the victim stops itself (SIGSTOP) at its first forward exchange: alive to the
    operating system, silent to its peers. With dead_after=3 the others raise; then they kill it."""

    from lowering import failures

    pids = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    model = _compiled()
    _step(model, _ids(SEQ_LEN))
    failures.configure(dist.group.WORLD.group_name, dead_after=3.0)

    def inject(event):
        if rank == victim and event.kind == "exchange" and event.fields["phase"] == "forward":
            os.kill(os.getpid(), signal.SIGSTOP)

    with record_ring_events(on_event=inject):
        outcome = _outcome(lambda: _step(model, _ids(SEQ_LEN)), linger=2.0)
    os.kill(pids[victim], signal.SIGKILL)
    return outcome


def slow_but_alive(rank: int, world_size: int, slow: int, seconds: float) -> dict:
    """Plain `ring_attention` (no backend) where rank ``slow`` spends ``seconds`` (several times
    ``dead_after``) inside the ring before its first exchange: its peers wait that long, alive and well."""
    from lowering import Layout, failures, ring_attention

    failures.configure(dist.group.WORLD.group_name, dead_after=1.0)
    layout = Layout("zigzag", world_size, 32)
    q, k, v = (torch.randn(1, 2, layout.local_len, 8) for _ in range(3))

    def dawdle(event):
        if rank == slow and event.kind == "exchange" and event.fields["step"] == 0:
            time.sleep(seconds)

    with record_ring_events(on_event=dawdle):
        return _outcome(lambda: ring_attention(q, k, v, layout=layout, is_causal=True))
