"""What each rank runs in the conversion tests: a converted model (loaded from an artifact, or converted in
the rank) against the same model unsharded in one process: outputs, every parameter gradient, two SGD steps."""

from __future__ import annotations

import hf_workers
import models
import torch
from reference import grad_error, rel_err

import ringpass
from lowering import record_ring_events


def build(name: str) -> torch.nn.Module:
    """``hand`` (and ``hand-batch1``): the hand-written Llama-style model in fp64; ``hf``: a tiny Hugging Face
    Llama (fp32)."""
    if name == "hf":
        return hf_workers.build("llama")
    torch.manual_seed(0)
    return models.Llama().double()


def call(name: str, seq_len: int):
    """(args, kwargs) of one call: token ids passed positionally (a batch of 2; ``hand-batch1``: of 1, the
    long-context case); for ``hf`` keyword ids, labels and a left-padded attention mask."""
    if name == "hf":
        return (), hf_workers.batch("left-padded", seq_len)
    batch = 1 if name == "hand-batch1" else 2
    return (torch.randint(0, 61, (batch, seq_len), generator=torch.Generator().manual_seed(seq_len)),), {}


def loss_of(output) -> torch.Tensor:
    if isinstance(output, torch.Tensor):  # logits: a fixed random projection, so every logit gets a gradient
        weights = torch.randn(output.shape, dtype=output.dtype, generator=torch.Generator().manual_seed(7))
        return (output * weights).sum()
    return output.loss


def logits_of(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.logits


def train_and_compare(rank: int, world_size: int, name: str, seq_lens: list, path: str = "") -> dict:
    """The converted model (``ringpass.load(path)``, or ``ringpass.convert`` here when ``path`` is empty)
    and the unsharded model, each trained two SGD steps per length: errors per step, whether the ring ran,
    and whether the converted model's parameters are the ones the optimizer steps."""
    reference = build(name)
    if path:
        converted = ringpass.load(path)
        shared = None
    else:
        model = build(name)
        args, kwargs = call(name, seq_lens[0])
        converted = ringpass.convert(model, kwargs or args, world_size=world_size, dynamic=len(seq_lens) > 1)
        shared = all(a is b for a, b in zip(converted.parameters(), model.parameters())) and converted.model is model
    # in memory: the optimizer on the model's own parameters, as a user's training loop has it
    optimizer = torch.optim.SGD(converted.parameters() if path else model.parameters(), lr=1e-3)
    expected_optimizer = torch.optim.SGD(reference.parameters(), lr=1e-3)
    result = {
        "steps": [],
        "shared": shared,
        "type": "",
        "names": sorted(n for n, _ in converted.model.named_parameters())
        == sorted(n for n, _ in reference.named_parameters()),
    }
    for seq_len in seq_lens:
        args, kwargs = call(name, seq_len)
        for _ in range(2):
            expected = reference(*args, **kwargs)
            loss_of(expected).backward()
            with record_ring_events() as events:
                got = converted(*args, **kwargs)
                loss_of(got).backward()
            result["type"] = type(got).__name__
            result["steps"].append(
                {
                    "seq_len": seq_len,
                    "logits": rel_err(logits_of(got).detach(), logits_of(expected).detach()),
                    "grads": grad_error(
                        {n: p.grad for n, p in converted.model.named_parameters()},
                        {n: p.grad for n, p in reference.named_parameters()},
                    ),
                    "kv_exchanges": sum(e.kind == "exchange" and e.fields["payload"] == "kv" for e in events),
                }
            )
            optimizer.step(), expected_optimizer.step()
            optimizer.zero_grad(), expected_optimizer.zero_grad()
    return result


def refusals(rank: int, world_size: int, paths: dict) -> dict:
    """The errors a converted model gives for calls and setups it cannot run: {case: message}."""
    found = {}

    def attempt(case, fn):
        try:
            fn()
            found[case] = "no error"
        except ringpass.RingpassError as error:
            found[case] = str(error)

    other_ranks = ringpass.load(paths["other_world_size"])
    attempt("world_size", lambda: other_ranks(*call("hand", 16)[0]))
    static = ringpass.load(paths["static"])
    ids = call("hand", 16)[0][0]
    attempt("length", lambda: static(ids[:, :12]))
    attempt("dtype", lambda: static(ids.int()))
    attempt("keyword", lambda: static(ids=ids))  # the same call spelled another way: runs
    for case, mode in (("no_grad", torch.no_grad), ("inference_mode", torch.inference_mode)):  # runs, no backward
        attempt(case, lambda mode=mode: _checked(static, ids, mode))
    fresh = ringpass.load(paths["static"])  # every call is checksummed (checks="every")
    attempt("disagree", lambda: fresh((ids + rank) % 61))  # each rank its own batch
    attempt("missing", lambda: static())
    attempt("extra", lambda: static(ids, mask=ids))
    hf = ringpass.load(paths["hf"])
    kwargs = hf_workers.batch("left-padded", 20)
    attempt("constant", lambda: hf(**{**kwargs, "use_cache": True}))
    attempt("unconverted_argument", lambda: hf(**{k: v for k, v in kwargs.items() if k != "attention_mask"}))
    return found


def sharded_inputs_local_grads(rank: int, world_size: int, path: str, seq_len: int) -> dict:
    """A model converted with ``inputs="sharded", outputs="sharded", grads="local"``: each rank passes its
    `ringpass.shard` of the ids, gets its shard of the logits (`ringpass.unshard` reassembles them) and keeps
    its share of the gradients; the ranks' losses and gradients sum to the unsharded model's."""
    import torch.distributed as dist

    reference, converted = build("hand"), ringpass.load(path)
    ids = call("hand", seq_len)[0][0]
    expected = reference(ids)
    loss_of(expected).backward()
    weights = torch.randn(expected.shape, dtype=expected.dtype, generator=torch.Generator().manual_seed(7))
    with record_ring_events() as events:
        got = converted(ringpass.shard(ids, 1))
        (got * ringpass.shard(weights, 1)).sum().backward()
    grads = {}
    for name, parameter in converted.model.named_parameters():
        dist.all_reduce(parameter.grad)
        grads[name] = parameter.grad
    return {
        "logits": rel_err(ringpass.unshard(got.detach(), 1, seq_len=seq_len), expected.detach()),
        "grads": grad_error(grads, {n: p.grad for n, p in reference.named_parameters()}),
        "kv_exchanges": sum(e.kind == "exchange" and e.fields["payload"] == "kv" for e in events),
    }


def _checked(converted, ids, mode) -> None:
    with mode():
        got = converted(ids)
    expected = build("hand")(ids)
    if got.requires_grad or rel_err(got, expected.detach()) > 1e-12:
        raise ringpass.RingpassError(
            f"under {mode.__name__}: requires_grad={got.requires_grad}, error {rel_err(got, expected.detach())}"
        )


def family(rank: int, world_size: int, name: str, seq_len: int, folder: str) -> dict:
    """A test-model family (`backend_workers.MODELS`) converted in the rank, saved and loaded again: the
    outputs and parameter gradients of both against the model run whole (fp64)."""
    import backend_workers

    torch.manual_seed(0)
    model = backend_workers.MODELS[name]().double()
    torch.manual_seed(0)
    reference = backend_workers.MODELS[name]().double()
    inputs = backend_workers._inputs(name, seq_len, batch=2, seed=0)
    expected = reference(*inputs)
    backend_workers._loss(expected, _weights(expected)).backward()
    expected_grads = {n: p.grad for n, p in reference.named_parameters()}
    materialized = ("encoder_mask_input", "square_bias")  # an S x S mask input, an S x S learned bias table
    options = {"masks": "materialize"} if name in materialized else {}
    converted = ringpass.convert(model, inputs, world_size=world_size, **options)
    path = f"{folder}/{name}-{rank}.pt2"
    converted.save(path)
    result = {}
    for kind, runs in (("in memory", converted), ("loaded", ringpass.load(path))):
        with record_ring_events() as events:
            got = runs(*inputs)
            backend_workers._loss(got, _weights(expected)).backward()
        got, want = (got, expected) if isinstance(got, tuple) else ((got,), (expected,))
        result[kind] = {
            "outputs": max(rel_err(g.detach(), e.detach()) for g, e in zip(got, want)),
            "grads": grad_error({n: p.grad for n, p in runs.model.named_parameters()}, expected_grads),
            "ring": sum(e.kind == "exchange" for e in events),
        }
    return result


def _weights(expected) -> list:
    outputs = expected if isinstance(expected, tuple) else (expected,)
    return [torch.randn(e.shape, generator=torch.Generator().manual_seed(7)).to(e.dtype) for e in outputs]


GLOBAL_SCALE = torch.tensor(0.5, dtype=torch.float64)  # a module-level tensor the model below reads (Dynamo's G)


class ReadsAGlobal(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = models.Llama().double()

    def forward(self, ids):
        return self.inner(ids) * GLOBAL_SCALE


def edge_calls(rank: int, world_size: int) -> dict:
    """Conversions in the rank, each run against the model whole (fp64): {case: relative error}.
    ``aliased``: converted with ``labels`` the very tensor of ``ids``, run with other labels; ``defaults``:
    converted without ``keep``/``mask``, called passing them as None; ``global``: a model reading a module-level
    tensor."""
    ids = call("hand", 16)[0][0]
    other = torch.randint(0, 61, ids.shape, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(0)
    with_loss = models.WithLoss(models.GPT()).double()
    aliased = ringpass.convert(with_loss, (ids, ids), world_size=world_size)
    found = {"aliased": rel_err(aliased(ids, other)[0].detach(), with_loss(ids, other)[0].detach())}  # the loss
    torch.manual_seed(0)
    encoder = models.Encoder().double()
    x = torch.randn(2, 16, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    converted = ringpass.convert(encoder, (x,), world_size=world_size)
    found["defaults"] = max(
        rel_err(converted(x, keep=None)[0].detach(), encoder(x)[0].detach()),
        rel_err(converted(x, None, None)[1].detach(), encoder(x)[1].detach()),
    )
    torch.manual_seed(0)
    reads = ReadsAGlobal()
    found["global"] = rel_err(ringpass.convert(reads, (ids,), world_size=world_size)(ids).detach(), reads(ids).detach())
    return found
