"""Workers of tests/distributed/test_boundaries.py: training recipes that make several graphs, against the
unsharded model.

Each recipe trains one step of `models.Llama` (fp64) the way a user's stack runs it (per-block compile, FSDP2 per
block and root, a graph break, checkpointing, dynamic shapes) and returns the loss's and every gradient's relative
error against the same model run unsharded, the ring's KV exchanges and the all-gathers of sequence values the step
made (`lowering.record_ring_events`), and what a shape audit saw allocated.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import EncoderBlock, Llama
from reference import grad_error, rel_err
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.checkpoint import checkpoint

import ringpass
from lowering import record_ring_events
from ringpass import SequenceSharded

VOCAB, HIDDEN = 61, 32


class ShapeAudit(TorchDispatchMode):
    """Records every plain tensor an op makes that has both the whole sequence and the hidden size in its shape
    (an activation of full length x hidden). `SequenceSharded` results (their data is this rank's tokens) are not
    such tensors; the ops inside their rules and inside compiled graphs are seen as they allocate."""

    def __init__(self, seq_len: int):
        super().__init__()
        self.seq_len, self.found = seq_len, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if type(tensor) is torch.Tensor and self.seq_len in tensor.shape and HIDDEN in tensor.shape:
                self.found.append(f"{func}: {tuple(tensor.shape)}")
        return out


class _Paused(nn.Module):
    """Calls a compiled block with the audit off (Dynamo does not compile under a dispatch mode); the backend's
    callable (`_audited`) turns it on again while the graph runs."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, *args):
        with _disable_current_modes():
            return self.block(*args)


def _audited(audit: ShapeAudit, compiles: list):
    """The ring backend, its graphs run under ``audit``; each compile appended to ``compiles``."""
    backend = ringpass.backend(compiler="aot_eager")

    def compile_graph(gm, example_inputs):
        compiled = backend(gm, example_inputs)
        compiles.append(gm)

        def run(*args):
            with audit:
                return compiled(*args)

        return run

    return compile_graph


class LlamaWithGraphBreak(Llama):
    """`models.Llama` (two blocks) with a graph break after each block (a logging call, an ``.item()``)."""

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        freqs = pos[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        x = self.blocks[0](self.embed(ids), cos, sin)
        torch._dynamo.graph_break()  # not inside the loop over blocks: Dynamo would run the whole frame eagerly
        x = self.blocks[1](x, cos, sin)
        torch._dynamo.graph_break()
        return self.head(self.norm(x))


class MaskAcrossABreak(nn.Module):
    """Builds a causal padding mask, attends with it, breaks the graph, and attends with it again."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB)
        self.blocks = nn.ModuleList(EncoderBlock(HIDDEN, 4) for _ in range(2))

    def forward(self, ids, keep):
        idx = torch.arange(ids.shape[1], device=ids.device)
        mask = (idx[None, :] <= idx[:, None])[None, None] & keep[:, None, None, :]
        x = self.blocks[0](self.embed(ids), mask)
        torch._dynamo.graph_break()
        return self.head(self.blocks[1](x, mask))


def mask_across_a_break(rank: int, world_size: int, seq_len: int) -> dict:
    """`MaskAcrossABreak` (fp64, right padding) compiled whole: the first graph attends with the mask it built
    and hands it on described; its loss and gradients against the model unsharded."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = MaskAcrossABreak().double()
    ids, labels = _batch(seq_len)
    keep = torch.ones(2, seq_len, dtype=torch.bool)
    keep[0, -4:] = False  # row 0 padded on the right: every query still sees a key
    expected = _loss(model(ids, keep), labels)
    expected.backward()
    expected_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    backend = ringpass.backend(compiler="aot_eager")
    with record_ring_events() as events:
        loss = _loss(torch.compile(model, backend=backend)(ids, keep), labels)
        loss.backward()
    return {
        "loss": rel_err(loss, expected),
        "grads": grad_error({k: p.grad for k, p in model.named_parameters()}, expected_grads),
        "kv_exchanges": sum(e.kind == "exchange" and e.fields["payload"] == "kv" for e in events),
        "all_gathers": [e.fields["shape"] for e in events if e.kind == "all_gather"],
        "reports": [(len(r.attention), r.masks) for r in backend.reports],
    }


class CheckpointedBlock(nn.Module):
    def __init__(self, block, reentrant: bool):
        super().__init__()
        self.block, self.reentrant = block, reentrant

    def forward(self, x, cos, sin):
        return checkpoint(self.block, x, cos, sin, use_reentrant=self.reentrant)


def _loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def _batch(seq_len: int):
    generator = torch.Generator().manual_seed(seq_len)
    ids = torch.randint(0, VOCAB, (2, seq_len), generator=generator)
    labels = torch.randint(0, VOCAB, (2, seq_len), generator=generator)
    labels[:, ::5] = -100
    return ids, labels


def _expected(model, ids, labels):
    """The unsharded step's loss, logits and gradients."""
    logits = model(ids)
    loss = _loss(logits, labels)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    return loss.detach(), logits.detach(), grads


def recipes(rank: int, world_size: int, names: tuple, seq_len: int) -> dict:
    """Each named recipe's result (``"eager"``: `eager_rules`; ``"hf_<family>_<how>[_<variant>]"``: `hf_recipe`)."""
    results = {}
    for name in names:
        if name == "eager":
            results[name] = eager_rules(rank, world_size, seq_len)
        elif name == "mask_across_a_break":
            results[name] = mask_across_a_break(rank, world_size, seq_len)
        elif name.startswith("hf_"):
            family, how, variant = (name[3:].split("_") + [""])[:3]
            results[name] = hf_recipe(rank, world_size, family, how, variant, seq_len)
        else:
            results[name] = recipe(rank, world_size, name, seq_len)
    return results


def hf_recipe(rank: int, world_size: int, family: str, how: str, variant: str, seq_len: int) -> dict:
    """A Hugging Face model (fp32, token ids sharded) trained one step against the same model unsharded.
    ``how``: ``layers`` (each decoder layer compiled on its own; the model's forward runs eagerly), ``fsdp2``
    (`fully_shard` on every layer and the root, the model compiled: a graph per layer), ``break`` (the model
    compiled, a graph break at the start of every layer). ``variant``: ``+``-joined ``checkpointed`` (HF's
    gradient checkpointing, non-reentrant), ``left-padded`` or ``packed`` (`hf_workers.batch`), ``dynamic``
    (compiled with ``dynamic=True``, a step at ``seq_len`` then one at ``seq_len + 4``: the worst errors count).
    A refusal is returned as ``{"refused": message}``."""
    import hf_workers

    torch._dynamo.reset()
    model = hf_workers.build(family)
    variants = set(variant.split("+"))
    if "checkpointed" in variants:
        hf_workers.enable_checkpointing(model, "non-reentrant")
    (case,) = (variants & {"left-padded", "packed"}) or {"labels"}
    batches = [hf_workers.batch(case, n) for n in ((seq_len, seq_len + 4) if "dynamic" in variants else (seq_len,))]
    expected = [_hf_step(model, kwargs) for kwargs in batches]  # before FSDP2 wraps the model
    backend, dynamic = ringpass.backend(compiler="aot_eager"), "dynamic" in variants
    with _graph_break_in(type(model.model.layers[0])) if how == "break" else contextlib.nullcontext():
        if how == "layers":
            for layer in model.model.layers:
                layer.compile(backend=backend, dynamic=dynamic)
            run = model
        else:
            if how == "fsdp2":
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.fsdp import fully_shard

                mesh = init_device_mesh("cpu", (world_size,))
                for layer in model.model.layers:
                    fully_shard(layer, mesh=mesh)
                fully_shard(model, mesh=mesh)
            run = torch.compile(model, backend=backend, dynamic=dynamic)
        steps = []
        for kwargs, (loss, logits, grads) in zip(batches, expected):
            kwargs = {**kwargs, "input_ids": SequenceSharded.distribute(kwargs["input_ids"], 1)}
            with record_ring_events() as events:
                try:
                    got = _hf_step(run, kwargs, model)
                except ringpass.RingpassError as error:
                    return {"refused": str(error)}
            steps.append(
                {
                    "loss": rel_err(got[0], loss),
                    "logits": rel_err(got[1].full_tensor(), logits),
                    "grads": grad_error(got[2], grads),
                    "logits_type": type(got[1]).__name__,
                    "kv_exchanges": sum(e.kind == "exchange" and e.fields["payload"] == "kv" for e in events),
                    "all_gathers": [e.fields["shape"] for e in events if e.kind == "all_gather"],
                }
            )
    worst = {key: max(step[key] for step in steps) for key in ("loss", "logits", "grads")}
    return {
        **worst,
        "logits_type": {step["logits_type"] for step in steps}.pop() if len(steps) else None,
        "kv_exchanges": min(step["kv_exchanges"] for step in steps),
        "all_gathers": [shape for step in steps for shape in step["all_gathers"]],
        "masks": [line for report in backend.reports for line in report.masks],
        "summaries": [report.summary() for report in backend.reports],
    }


def _whole(grad: torch.Tensor) -> torch.Tensor:
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad.clone()  # FSDP2's are DTensors


def _hf_step(run, kwargs: dict, model=None) -> tuple:
    """(loss, logits, every parameter's gradient, whole) of one step of ``run`` (``model``'s parameters)."""
    model = model or run
    out = run(**kwargs)
    out.loss.backward()
    grads = {n: _whole(p.grad) for n, p in model.named_parameters()}
    model.zero_grad()
    return out.loss.detach(), out.logits.detach(), grads


@contextlib.contextmanager
def _graph_break_in(layer_class):
    """Every call of ``layer_class`` breaks the graph first (as a data-dependent branch in a model would)."""
    forward = layer_class.forward

    def broken(self, *args, **kwargs):
        torch._dynamo.graph_break()
        return forward(self, *args, **kwargs)

    layer_class.forward = broken
    try:
        yield
    finally:
        layer_class.forward = forward


def recipe(rank: int, world_size: int, name: str, seq_len: int) -> dict:
    """One recipe's step (see the module docstring); ``name`` says which."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = (LlamaWithGraphBreak if name == "graph_break" else Llama)().double()
    ids, labels = _batch(seq_len)
    expected_loss, expected_logits, expected_grads = _expected(model, ids, labels)
    longer_ids, longer_labels = _batch(seq_len + 3)
    with torch.no_grad():
        longer_loss = _loss(model(longer_ids), longer_labels)
    audit, compiles = ShapeAudit(seq_len), []
    carried_ids = SequenceSharded.distribute(ids, 1)
    if name == "dynamic":  # a user's input is static unless marked, as a plain tensor is
        torch._dynamo.mark_dynamic(carried_ids, 1)
    params = dict(model.named_parameters())  # by the names of the unwrapped model
    if name in ("per_block", "per_block_plain_ids", "dynamic", "checkpoint", "checkpoint_reentrant"):
        backend = _audited(audit, compiles)  # one for every block: they share their code, so Dynamo's cache
        for i, block in enumerate(model.blocks):
            compiled = _Paused(torch.compile(block, backend=backend, dynamic=name == "dynamic" or None))
            if name.startswith("checkpoint"):  # the recompute in the backward calls the compiled block again
                compiled = CheckpointedBlock(compiled, name == "checkpoint_reentrant")
            model.blocks[i] = compiled
        run = model
        inputs = ids if name == "per_block_plain_ids" else carried_ids
    elif name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        params = dict(model.named_parameters())  # FSDP2's sharded parameters, same names
        run, inputs = torch.compile(model, backend=_audited(audit, compiles)), carried_ids
    elif name == "graph_break":
        run, inputs = torch.compile(model, backend=_audited(audit, compiles)), ids
    else:
        raise ValueError(name)
    # Dynamo does not compile a frame under a dispatch mode: a compiled model's graphs run under the audit alone
    with record_ring_events() as events, audit if run is model else contextlib.nullcontext():
        logits = run(inputs)
        loss = _loss(logits, labels)
        loss.backward()
    grads = {k: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for k, p in params.items()}
    result = {
        "loss": rel_err(loss, expected_loss),
        "grads": grad_error(grads, expected_grads),
        "logits_type": type(logits).__name__,
        "kv_exchanges": sum(e.kind == "exchange" and e.fields["payload"] == "kv" for e in events),
        "all_gathers": [e.fields["shape"] for e in events if e.kind == "all_gather"],
        "audit": audit.found[:5],
        "logits": rel_err(logits.full_tensor(), expected_logits),
    }
    if name == "dynamic":  # the same compiled blocks serve another length
        with audit:  # as the step ran
            longer_carried = SequenceSharded.distribute(longer_ids, 1)
            torch._dynamo.mark_dynamic(longer_carried, 1)
            longer = _loss(model(longer_carried), longer_labels)
        result["longer"] = rel_err(longer, longer_loss)
        result["compiles"] = len(compiles)
    return result


def eager_rules(rank: int, world_size: int, seq_len: int) -> dict:
    """The type's eager rules on a value with padding slots, against the same code on whole tensors."""
    torch.manual_seed(0)
    x = torch.randn(2, seq_len, 6, dtype=torch.float64, requires_grad=True)
    head = nn.Linear(6, 5).double()
    labels = torch.randint(0, 5, (2, seq_len))
    labels[0, 2] = -100
    scale = torch.randn(6, dtype=torch.float64)

    def step(h):
        h = h * 2 + scale
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        logits = head(h)
        loss = F.cross_entropy(logits.view(-1, 5), labels.view(-1)) + logits.sum() * 0.01 + logits.amax()
        return loss, logits

    expected_loss, expected_logits = step(x)
    expected_loss.backward()
    expected = {"x": x.grad.clone(), **{k: p.grad.clone() for k, p in head.named_parameters()}}
    x.grad = None
    head.zero_grad()
    loss, logits = step(SequenceSharded.distribute(x, 1))
    loss.backward()
    got = {"x": x.grad, **{k: p.grad for k, p in head.named_parameters()}}
    picked = logits[:, -1]  # every rank gets the last token's row
    with pytest.warns(ringpass.ImplicitGatherWarning, match="aten.cumsum.default on a SequenceSharded value"):
        summed = torch.cumsum(logits, 1)  # along the sequence: gathered first
    shown = repr(logits) if rank == 0 else ""  # on one rank only: it must not communicate
    return {
        "type": type(logits).__name__,
        "shape": list(logits.shape),
        "local": list(logits.to_local().shape),
        "loss": rel_err(loss, expected_loss),
        "logits": rel_err(logits.full_tensor(), expected_logits),
        "grads": grad_error(got, expected),
        "picked": rel_err(picked, expected_logits[:, -1]),
        "argmax": torch.equal(logits.argmax(-1).full_tensor(), expected_logits.argmax(-1)),
        "cumsum": rel_err(summed, expected_logits.cumsum(1)) if type(summed) is torch.Tensor else "not plain",
        "repr": shown,
        "dtensor": _dtensor_round_trip(world_size),
    }


def _dtensor_round_trip(world_size: int) -> float:
    """contiguous SequenceSharded -> DTensor -> SequenceSharded keeps the value."""
    from torch.distributed.device_mesh import init_device_mesh

    whole = torch.arange(2 * 4 * world_size * 3, dtype=torch.float64).view(2, 4 * world_size, 3)
    carried = SequenceSharded.distribute(whole, 1, layout="contiguous")
    dtensor = carried.to_dtensor(init_device_mesh("cpu", (world_size,)))
    back = SequenceSharded.from_dtensor(dtensor)
    return rel_err(dtensor.full_tensor(), whole) + rel_err(back.full_tensor(), whole)
