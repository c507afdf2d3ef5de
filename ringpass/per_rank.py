"""``inputs="per_rank"``: each rank passes its own batch, as a data-parallel loader hands it out.

A data-parallel job gives every rank a batch of its own; its optimizer step follows the mean over the ranks of
each rank's objective (DDP and FSDP2 average the gradients). With the ring, no rank can compute its batch
alone: the sequences are sharded over the ranks of the ring. So every rank takes part in every rank's batch:

1. the ranks agree on the shapes of their inputs (a batch of another length is an error on every rank, before
   any transfer), then all-gather the graph's inputs (token ids, labels, masks, position ids, a token count:
   the small per-sample values, never activations);
2. the compiled graph (traced on one rank's batch, a plain ``inputs="full"`` ring graph) runs once per rank of
   the ring on that rank's batch: each rank computes its share of every sequence of every batch;
3. each rank gets the outputs of its own batch: values every rank holds whole (the loss, pooled logits) are
   taken from its own run; values left sequence-sharded (the logits, ``outputs="auto"``) are assembled whole
   for their owner by one all-to-all;
4. in the backward, each rank's upstream gradient of its own outputs goes to every rank (an all-gather of the
   loss's gradient; an all-to-all of the logits' gradients), divided by the ring's size P: the ranks backpropagate
   the mean over the ring's ranks of each rank's objective, which is what a data-parallel job optimises.
   ``grads="auto"`` then gives DDP's result: under a wrapper averaging over the ring's ranks the shares are
   scaled for its mean, without one every rank ends with the mean's gradient.

Each rank's loss is its own batch's (the model's own reduction, whatever its token count), so a job logs the same
losses and reaches the same weights as the same job without the ring, also where the ranks' token counts differ
and where the loss is normalised by a count over all ranks (the HF Trainer's ``average_tokens_across_devices``).
The cost: P ring calls of one batch each per step (the same FLOPs and bytes as one call on P batches).

`PerRankGraph` wraps a compiled ring graph so; `refuse_crossings` refuses what it cannot take yet (activations
from code before the graph: values that require grad, values carried in sharded, masks crossing as
descriptions). A graph that updates module state (BatchNorm's running statistics) updates it once per rank's
batch, P times a call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lowering import failures
from lowering.errors import InvalidInputError, NotSupportedError
from lowering.groups import group_by_name
from lowering.layout import cached_layout
from lowering.sequence_tensor import SequenceSharded
from ringpass.graph import example_value, is_module_state, nbytes, user_name
from ringpass.graph_utils.context import PassContext
from ringpass.report import size_text


def refuse_crossings(ctx: PassContext) -> None:
    """``inputs="per_rank"`` gathers each rank's small inputs; a value from another graph or from eager code that
    trains (an activation: it requires grad) or is carried in sharded would gather every rank's whole sequences
    onto every rank, and is refused."""
    placeholders = [n for n in ctx.gm.graph.nodes if n.op == "placeholder"]
    training = [n for n in placeholders if _per_rank_input(n) and n.meta["example_value"].requires_grad]
    if ctx.carried_inputs or ctx.mask_inputs or training:
        what = f"`{user_name(training[0])}`, which requires grad" if training else "a sequence-sharded value"
        raise NotSupportedError(
            f"inputs='per_rank' gathers each rank's inputs (token ids, labels, masks), but this graph receives {what}: "
            "an activation computed before it (a graph break inside the model, per-block compile, an eager module, "
            "trainable input embeddings). Gathering it would put every rank's whole sequences on every rank. "
            "Compile the model as one graph (one torch.compile around it, no graph break inside), or compile with "
            "inputs='full' and feed each ring the same batch (ringpass.RingSampler)."
        )


class PerRankGraph:
    """A compiled ring graph called once per rank of the ring on that rank's inputs (module docstring)."""

    def __init__(self, compiled, ctx: PassContext):
        placeholders = [n for n in ctx.gm.graph.nodes if n.op == "placeholder"]
        self.compiled = compiled
        self.own = [i for i, n in enumerate(placeholders) if _per_rank_input(n)]
        self.names = [user_name(placeholders[i]) for i in self.own]
        self.group_name, self.world_size = ctx.group_name, ctx.world_size

    def __call__(self, *args):
        group = group_by_name(self.group_name)
        rank = dist.get_rank(group)
        mine = {"shapes": [_shape(args[i]) for i in self.own]}
        failures.begin_call()
        failures.agree(self.group_name, "per_rank", mine, self._difference)
        gathered = {i: _gather(args[i], group, self.group_name) for i in self.own}
        runs = []
        for source in range(self.world_size):  # every rank's batch, in rank order on every rank
            call = list(args)
            for i, values in gathered.items():
                call[i] = values[source]
            runs.append(list(self.compiled(*call)))
        return [_own_output([run[k] for run in runs], rank, self.group_name) for k in range(len(runs[0]))]

    def _difference(self, everyone: list[dict]) -> str:
        for k, name in enumerate(self.names):
            shapes = [f["shapes"][k] for f in everyone]
            if len(set(map(str, shapes))) > 1:
                return (
                    f"With inputs='per_rank' every rank of the ring passes a batch of the same shape; input `{name}` "
                    f"has shape {failures.by_rank(shapes)}. Pad every batch to one length (a collator's "
                    "padding='max_length' or pad_to_multiple_of with a fixed maximum, or packing to a fixed length), "
                    "and give every rank the same number of sequences (drop_last=True)."
                )
        return ""


def describe_per_rank(ctx: PassContext) -> None:
    """The report's summary line: what each call all-gathers, and that the graph runs once per rank's batch."""
    own = [n for n in ctx.gm.graph.nodes if n.op == "placeholder" and _per_rank_input(n)]
    gathered = sum(nbytes(example_value(n)) for n in own) * ctx.world_size
    ctx.report.notes.append(
        f"inputs='per_rank': each rank's {', '.join(map(user_name, own)) or 'nothing'} all-gathered "
        f"({size_text(gathered)} per call), the graph run on each rank's batch, each rank's own outputs returned"
    )


def _per_rank_input(node) -> bool:
    value = node.meta.get("example_value")
    return isinstance(value, torch.Tensor) and not is_module_state(node)


def _shape(value) -> list:
    return [str(value.dtype), *map(int, value.shape)]


def _gather(x: torch.Tensor, group, group_name: str) -> list[torch.Tensor]:
    """Every rank's ``x``, in rank order (inputs that train are refused: `refuse_crossings`)."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(parts, x, group=group, async_op=True)
    failures.wait_collective(work, x, group_name, f"all-gathering the ranks' {tuple(x.shape)} inputs")
    return parts


def _own_output(values: list, rank: int, group_name: str):
    """This rank's output from the runs' ``values`` (one per rank's batch)."""
    first = values[0]
    if isinstance(first, SequenceSharded):
        spec = first.spec
        if spec.rows != 1:
            raise NotSupportedError(
                f"inputs='per_rank': an output of shape {tuple(first.shape)} holds {spec.rows} sequences one after "
                "the other along its sequence dim; return it as [batch, sequence, ...]."
            )
        return _OwnSharded.apply(spec, *[v.to_local() for v in values])
    if isinstance(first, torch.Tensor):
        return _OwnWhole.apply(group_name, *values)
    if len({repr(v) for v in values}) > 1:
        raise InvalidInputError(
            f"inputs='per_rank': the graph returns a number that differs between the ranks' batches "
            f"({', '.join(map(repr, values))}); return it as a tensor."
        )
    return values[rank]


class _OwnWhole(torch.autograd.Function):
    """Of values every rank holds whole (one per rank's batch), this rank's. Backward: every rank's gradient of
    its own, divided by the ring's size (the mean over the ranks of each rank's objective)."""

    @staticmethod
    def forward(ctx, group_name: str, *values):
        group = group_by_name(group_name)
        ctx.group_name, ctx.world_size = group_name, dist.get_world_size(group)
        return values[dist.get_rank(group)].clone()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        parts = [torch.empty_like(grad) for _ in range(ctx.world_size)]
        work = dist.all_gather(parts, grad, group=group_by_name(ctx.group_name), async_op=True)
        failures.wait_collective(work, grad, ctx.group_name, "all-gathering the ranks' output gradients")
        return (None, *(g / ctx.world_size for g in parts))


class _OwnSharded(torch.autograd.Function):
    """Of sequence-sharded values (one per rank's batch, each rank holding its tokens of each), this rank's, whole:
    rank q sends its tokens of batch j to rank j (one all-to-all). Backward: the reverse, divided by the ring's size."""

    @staticmethod
    def forward(ctx, spec, *locals_):
        ctx.spec = spec
        layout = cached_layout(spec.kind, spec.world_size, spec.seq_len)
        received = _all_to_all(torch.stack(locals_), spec.group_name, "the ranks' tokens of each rank's outputs")
        return layout.unshard(list(received), spec.dim).contiguous()

    @staticmethod
    def backward(ctx, grad):
        spec = ctx.spec
        layout = cached_layout(spec.kind, spec.world_size, spec.seq_len)
        shards = torch.stack([layout.shard(grad, spec.dim, q) for q in range(spec.world_size)])
        received = _all_to_all(shards, spec.group_name, "each rank's output gradients to the ranks holding its tokens")
        return (None, *(received / spec.world_size).unbind(0))


def _all_to_all(x: torch.Tensor, group_name: str, what: str) -> torch.Tensor:
    """``x[q]`` goes to rank q; returns what every rank q sent this one, stacked the same way."""
    x = x.contiguous()
    received = torch.empty_like(x)
    work = dist.all_to_all_single(received, x, group=group_by_name(group_name), async_op=True)
    failures.wait_collective(work, received, group_name, f"the all-to-all of {what}")
    return received
