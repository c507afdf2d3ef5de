"""``inputs="per_rank"``: each rank passes its own batch, as a data-parallel loader hands it out.

A data-parallel job gives every rank a batch of its own; its optimizer step follows the mean over the ranks of
each rank's objective (DDP and FSDP2 average the gradients). With the ring, no rank can compute its batch
alone: the sequences are sharded over the ranks of the ring. So every rank takes part in every rank's batch:

1. the ranks agree on the shapes of their inputs (a batch of another length is an error on every rank, before
   any transfer), then all-gather the graph's inputs (token ids, labels, masks, position ids, a token count:
   the small per-sample values). An activation computed before the graph on this rank's batch (between blocks
   compiled one by one, FSDP2 per block, a graph break: `ringpass.passes.exchange_activations`) is not gathered
   but sent by tokens: one all-to-all leaves each rank its tokens of every rank's, as much as its own batch;
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

Between graphs every rank holds its own batch's values whole, as under DDP: code between them runs as it would
there, and each boundary costs one all-to-all of the activation each way. A mask one graph builds and another
uses (padding under FSDP2 per block) crosses as its per-token description (`ringpass.frontend.crossing_masks`, a
`SequenceMask` of this rank's batch): the next ring graph gathers those tensors with the other small inputs and
each run evaluates its rank's mask per tile.

`PerRankGraph` wraps a compiled ring graph so; `refuse_crossings` refuses values that another graph, compiled
without ``per_rank``, carried out sequence-sharded. A graph that updates module state
(BatchNorm's running statistics) updates it once per rank's batch, P times a call.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from lowering import failures
from lowering.errors import InvalidInputError, NotSupportedError
from lowering.groups import group_by_name
from lowering.layout import cached_layout
from lowering.sequence_ops import reduce_grad, scale_grad
from lowering.sequence_tensor import SequenceSharded
from ringpass.frontend.carried import splice_mask_inputs
from ringpass.frontend.crossing_masks import wrap_mask_outputs
from ringpass.fx.context import PassContext
from ringpass.fx.nodes import example_value, is_module_state, nbytes, user_name
from ringpass.fx.report import size_text


def refuse_crossings(ctx: PassContext) -> None:
    """``inputs="per_rank"`` takes each rank's own batch: a value another graph carried out sequence-sharded (a
    graph compiled with ``inputs="full"`` or ``"sharded"``) is refused."""
    carried = [n for n in ctx.carried_inputs if n not in ctx.exchanged_inputs]
    if carried:
        raise NotSupportedError(
            f"inputs='per_rank' takes each rank's own batch, but this graph receives `{user_name(carried[0])}`, a "
            "SequenceSharded value, from a graph compiled with inputs='full' or 'sharded'. Compile every graph of "
            "the model with the same inputs= option."
        )


class PerRankGraph:
    """A compiled ring graph called once per rank of the ring on that rank's inputs (module docstring)."""

    def __init__(self, compiled, ctx: PassContext, tail=None):
        placeholders = [n for n in ctx.gm.graph.nodes if n.op == "placeholder"]
        self.compiled = compiled
        self.tail, self.compiled_tail = ctx.tail, tail  # `ringpass.passes.split_tail`
        self.module_state = {i for i, n in enumerate(placeholders) if is_module_state(n)}
        self.gradients = ctx.gradients
        self.examples = [n.meta.get("example_value") for n in placeholders]
        self.own = [i for i, n in enumerate(placeholders) if _per_rank_input(n)]
        # activations (`ringpass.passes.exchange_activations`): index -> sequence dim, sent by tokens, not gathered
        self.exchanged = {i: ctx.carried_inputs[n] for i, n in enumerate(placeholders) if n in ctx.exchanged_inputs}
        self.layout_kind = ctx.layout_kind
        self.numbers = [i for i, value in enumerate(self.examples) if isinstance(value, torch.SymInt)]
        self.names = [user_name(placeholders[i]) for i in self.own]
        self.dynamic = bool(self.numbers) or any(_symbolic(self.examples[i]) for i in self.own)
        self.group_name, self.world_size = ctx.group_name, ctx.world_size
        self.mask_inputs, self.mask_outputs = dict(ctx.mask_inputs), dict(ctx.mask_outputs)  # `crossing_masks`
        self._guards = None  # the shape guards the graph was compiled under, as a Python expression (lazily)

    def __call__(self, *args):
        args = splice_mask_inputs(args, self.mask_inputs)  # their tensors gathered as the other small inputs
        group = group_by_name(self.group_name)
        rank = dist.get_rank(group)
        failures.begin_call()
        fixed = [_fixed_shape(args[i], self.examples[i]) for i in self.own]
        failures.agree(self.group_name, "per_rank", {"shapes": fixed}, self._difference)
        sizes = self._everyones_sizes(args, group) if self.dynamic else [self._sizes(args)] * self.world_size
        if any(s != sizes[rank] for s in sizes):
            self._check_guards(args, sizes, group)
        runs = []
        shapes = {i: [self._shape_of(s, k) for s in sizes] for k, i in enumerate(self.own)}
        gathered = {
            i: _ToRuns.apply(args[i], self.exchanged[i], self.layout_kind, self.group_name, shapes[i])
            if i in self.exchanged
            else _gather(args[i], shapes[i], self.group_name)
            for i in self.own
        }
        for source in range(self.world_size):  # every rank's batch, in rank order on every rank
            runs.append(list(self.compiled(*self._call(args, gathered, sizes[source], source))))
        own = [_own_output([run[k] for run in runs], rank, self.group_name) for k in range(len(runs[0]))]
        return wrap_mask_outputs(own if self.tail is None else self._run_tail(args, own), self.mask_outputs)

    def _run_tail(self, args, own: list) -> list:
        """The tail (`ringpass.passes.split_tail`) once, on this rank's own arguments and own ring outputs; the
        graph's outputs in Dynamo's order."""
        inputs = [
            own[i] if kind == "output" else self._tail_parameter(args[i]) if i in self.module_state else args[i]
            for kind, i in self.tail.sources
        ]
        values = self.compiled_tail(*inputs)
        return [own[k] if kind == "ring" else values[k] for kind, k in self.tail.outputs]

    def _tail_parameter(self, x):
        """A parameter the tail reads, its gradient made what the ring graph's gradients are (``grads``): the tail
        gives this rank's own batch's, which a wrapper averaging over the ring's ranks takes as it is; without one
        (``reduced``) every rank gets the mean over the ring's ranks, and with ``local`` each its share of it."""
        if not getattr(x, "requires_grad", False) or self.gradients is None or self.gradients.mode == "mean":
            return x
        if self.gradients.mode == "reduced":
            x = reduce_grad(x, self.group_name)
        return scale_grad(x, 1 / self.world_size)

    def _sizes(self, args) -> list[int]:
        """This rank's sizes: every dim of its own inputs, then the graph's symbolic numbers."""
        return [int(d) for i in self.own for d in args[i].shape] + [int(args[i]) for i in self.numbers]

    def _shape_of(self, sizes: list[int], k: int) -> list[int]:
        start = sum(self.examples[i].dim() for i in self.own[:k])
        return sizes[start : start + self.examples[self.own[k]].dim()]

    def _call(self, args, gathered: dict, sizes: list[int], source: int) -> list:
        call = list(args)
        for i, values in gathered.items():
            call[i] = values[source]
        for i, value in zip(self.numbers, sizes[len(sizes) - len(self.numbers) :]):
            call[i] = value
        return call

    def _everyones_sizes(self, args, group) -> list[list[int]]:
        return self._everyones(self._sizes(args), args, group, "the sizes of the ranks' batches")

    def _everyones(self, values: list[int], args, group, what: str) -> list[list[int]]:
        """Every rank's ``values`` (as many on every rank), on the inputs' device (NCCL takes no CPU tensor)."""
        device = args[self.own[0]].device if self.own else torch.device("cpu")
        mine = torch.tensor(values, dtype=torch.int64, device=device)
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        work = dist.all_gather(parts, mine, group=group, async_op=True)
        failures.wait_collective(work, mine, self.group_name, f"all-gathering {what}")
        return [p.tolist() for p in parts]

    def _check_guards(self, args, sizes: list[list[int]], group) -> None:
        """The ranks' batches differ in a dimension the graph holds symbolic: every rank checks that its graph
        was compiled for every rank's sizes (the guards Dynamo checked on its own batch only); any rank's no is an
        error on every rank."""
        if self._guards is None:
            shape_env = next(_shape_env(v) for v in self.examples if _shape_env(v) is not None)
            self._guards = shape_env.produce_guards_expression(self.examples, ignore_static=False) or "True"
            self._shape_env = shape_env
        empty = {
            i: [torch.empty(self._shape_of(s, k), dtype=args[i].dtype) for s in sizes] for k, i in enumerate(self.own)
        }
        accepted = [
            int(bool(self._shape_env.evaluate_guards_expression(self._guards, self._call(args, empty, s, source))))
            for source, s in enumerate(sizes)
        ]
        verdicts = self._everyones(accepted, args, group, "which batches each rank's graph takes")
        refused = [(q, j) for q, verdict in enumerate(verdicts) for j, ok in enumerate(verdict) if not ok]
        if refused:
            q, j = refused[0]
            raise InvalidInputError(
                f"inputs='per_rank': rank {q}'s compiled graph does not take rank {j}'s batch. Rank {q} traced it on "
                f"{self._described(sizes[q])}; it holds the sizes symbolic only within its shape guards (the branches "
                f"its code took on them, e.g. a Python `if` on a length), which rank {j}'s {self._described(sizes[j])} "
                "breaks. Pad every batch to one length, or keep the model's code from branching on the length."
            )

    def _described(self, sizes: list[int]) -> str:
        return ", ".join(f"`{name}` {tuple(self._shape_of(sizes, k))}" for k, name in enumerate(self.names))

    def _difference(self, everyone: list[dict]) -> str:
        for k, name in enumerate(self.names):
            shapes = [f["shapes"][k] for f in everyone]
            if len(set(map(str, shapes))) > 1:
                return (
                    f"With inputs='per_rank' the ranks of the ring may pass batches of different shapes only in the "
                    f"dims the compiled graph holds symbolic ('*'); input `{name}` has shape "
                    f"{failures.by_rank(shapes)}. Compile with dynamic=True (model.compile(backend='ring', "
                    "dynamic=True, options=...)) so every rank's graph takes any length and batch size, or pad every "
                    "batch to one length (a collator's padding='max_length' or pad_to_multiple_of with a fixed "
                    "maximum) and give every rank the same number of sequences (drop_last=True)."
                )
        return ""


def describe_per_rank(ctx: PassContext) -> None:
    """The report's summary line: what each call all-gathers, and that the graph runs once per rank's batch."""
    own = [n for n in ctx.gm.graph.nodes if n.op == "placeholder" and _per_rank_input(n)]
    exchanged = [n for n in own if n in ctx.exchanged_inputs]
    own = [n for n in own if n not in ctx.exchanged_inputs]
    gathered = sum(nbytes(example_value(n)) for n in own) * ctx.world_size
    ctx.report.notes.append(
        f"inputs='per_rank': each rank's {', '.join(map(user_name, own)) or 'nothing'} all-gathered "
        f"({size_text(gathered)} per call)"
        + (
            f", its {', '.join(map(user_name, exchanged))} (activations) sent by tokens to the ranks (one all-to-all "
            f"each, {size_text(sum(nbytes(example_value(n)) for n in exchanged))} per rank per call)"
            if exchanged
            else ""
        )
        + ", the graph run on each rank's batch, each rank's own outputs returned"
        + (
            f"; the tail from {', '.join(ctx.tail.starts)} runs once on this rank's own batch, on its own values "
            "assembled (split_tail)"
            if ctx.tail
            else ""
        )
    )


def _per_rank_input(node) -> bool:
    """A tensor input of the batch: not a parameter or buffer, and read by the graph (the model's Python floats,
    inputs under ``dynamic=True``, are unused once `pin_model_numbers` has read them as numbers)."""
    value = node.meta.get("example_value")
    return isinstance(value, torch.Tensor) and not is_module_state(node) and bool(node.users)


def _symbolic(value) -> bool:
    return any(isinstance(d, torch.SymInt) for d in value.shape)


def _fixed_shape(value: torch.Tensor, example: torch.Tensor) -> list:
    """What must match on every rank: the dtype, and each dim the graph holds fixed ('*': symbolic)."""
    return [
        str(value.dtype),
        *("*" if isinstance(e, torch.SymInt) else int(d) for d, e in zip(value.shape, example.shape)),
    ]


def _shape_env(value):
    if isinstance(value, torch.SymInt):
        return value.node.shape_env
    fake_mode = getattr(value, "fake_mode", None)
    return getattr(fake_mode, "shape_env", None)


def _gather(x: torch.Tensor, shapes: list, group_name: str) -> list[torch.Tensor]:
    """Every rank's ``x`` (rank q's of shape ``shapes[q]``), in rank order: one all-gather of the flattened values,
    each padded to the largest (inputs that train are refused: `refuse_crossings`)."""
    numels = [math.prod(shape) for shape in shapes]
    flat = x.new_zeros(max(numels))
    flat[: x.numel()] = x.reshape(-1)
    parts = [torch.empty_like(flat) for _ in shapes]
    work = dist.all_gather(parts, flat, group=group_by_name(group_name), async_op=True)
    failures.wait_collective(work, flat, group_name, f"all-gathering the ranks' {tuple(x.shape)} inputs")
    return [part[:n].view(shape) for part, n, shape in zip(parts, numels, shapes)]


def _own_output(values: list, rank: int, group_name: str):
    """This rank's output from the runs' ``values`` (one per rank's batch)."""
    first = values[0]
    if isinstance(first, SequenceSharded):
        spec = values[rank].spec
        if spec.rows != 1:
            raise NotSupportedError(
                f"inputs='per_rank': an output of shape {tuple(first.shape)} holds {spec.rows} sequences one after "
                "the other along its sequence dim; return it as [batch, sequence, ...]."
            )
        return _OwnSharded.apply(spec, *[v.to_local() for v in values])
    if isinstance(first, torch.Tensor):
        return _OwnWhole.apply(group_name, *values)
    return values[rank]  # a number (a size of this rank's batch)


class _ToRuns(torch.autograd.Function):
    """This rank's activation (of its own batch, whole) sent by tokens: rank q gets its tokens of it, and this rank
    its tokens of every rank's (one all-to-all); returns them in rank order, one per run. Backward: the reverse,
    times the ring's size: the runs backpropagate the mean over the ranks of each rank's objective, the code before
    the graph this rank's own objective (as under DDP, before its mean)."""

    @staticmethod
    def forward(ctx, x, dim: int, kind: str, group_name: str, shapes: list):
        world_size = len(shapes)
        layout = cached_layout(kind, world_size, x.shape[dim])
        received = [list(shape) for shape in shapes]
        for shape in received:
            shape[dim] = cached_layout(kind, world_size, shape[dim]).local_len
        ctx.dim, ctx.layout, ctx.group_name = dim, layout, group_name
        what = "the ranks' activations to the ranks holding their tokens"
        return tuple(_split_by_tokens(x, layout, dim, received, group_name, what))

    @staticmethod
    def backward(ctx, *grads):
        what = "the activations' gradients to the ranks whose batches they are"
        whole = _assemble_by_tokens(list(grads), ctx.layout, ctx.dim, ctx.group_name, what)
        return whole * len(grads), None, None, None, None


class _OwnWhole(torch.autograd.Function):
    """Of values every rank holds whole (one per rank's batch), this rank's. Backward: every rank's gradient of
    its own, divided by the ring's size (the mean over the ranks of each rank's objective)."""

    @staticmethod
    def forward(ctx, group_name: str, *values):
        group = group_by_name(group_name)
        ctx.group_name, ctx.shapes = group_name, [v.shape for v in values]
        return values[dist.get_rank(group)].clone()

    @staticmethod
    def backward(ctx, grad):
        parts = _gather(grad.contiguous(), ctx.shapes, ctx.group_name)
        return (None, *(g / len(parts) for g in parts))


class _OwnSharded(torch.autograd.Function):
    """Of sequence-sharded values (one per rank's batch, each rank holding its tokens of each), this rank's, whole:
    rank q sends its tokens of batch j to rank j (one all-to-all). Backward: the reverse, divided by the ring's size."""

    @staticmethod
    def forward(ctx, spec, *locals_):
        ctx.spec, ctx.shapes = spec, [x.shape for x in locals_]
        layout = spec.layout()  # (with the documents layout: this rank's batch's packing)
        what = "the ranks' tokens of each rank's outputs"
        return _assemble_by_tokens(list(locals_), layout, spec.dim, spec.group_name, what).contiguous()

    @staticmethod
    def backward(ctx, grad):
        spec = ctx.spec
        layout = spec.layout()
        what = "each rank's output gradients to the ranks holding its tokens"
        received = _split_by_tokens(grad, layout, spec.dim, ctx.shapes, spec.group_name, what)
        return (None, *(g / spec.world_size for g in received))


def _split_by_tokens(x: torch.Tensor, layout, dim: int, shapes: list, group_name: str, what: str) -> list:
    """This rank's batch ``x``, whole, sent by tokens: rank q gets its layout shard of it; returns this rank's tokens
    of every rank's batch (rank q's of shape ``shapes[q]``), in rank order (one all-to-all)."""
    return _all_to_all([layout.shard(x, dim, q) for q in range(len(shapes))], shapes, group_name, what)


def _assemble_by_tokens(parts: list, layout, dim: int, group_name: str, what: str) -> torch.Tensor:
    """The inverse of `_split_by_tokens`: ``parts[q]`` (this rank's tokens of rank q's batch) goes to rank q, and
    this rank's batch comes back whole from every rank's tokens of it (one all-to-all)."""
    mine = parts[dist.get_rank(group_by_name(group_name))].shape
    return layout.unshard(_all_to_all(parts, [mine] * len(parts), group_name, what), dim)


def _all_to_all(send: list[torch.Tensor], shapes: list, group_name: str, what: str) -> list[torch.Tensor]:
    """``send[q]`` goes to rank q; returns what every rank q sent this one (of shape ``shapes[q]``), in rank order."""
    flat = torch.cat([x.reshape(-1) for x in send])
    numels = [math.prod(shape) for shape in shapes]
    received = flat.new_empty(sum(numels))
    work = dist.all_to_all_single(
        received, flat, numels, [x.numel() for x in send], group=group_by_name(group_name), async_op=True
    )
    failures.wait_collective(work, received, group_name, f"the all-to-all of {what}")
    return [part.view(shape) for part, shape in zip(received.split(numels), shapes)]
