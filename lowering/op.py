"""`ring_attention`: the public entry point, and the custom ops a compiled graph calls.

`ring_attention(q, k, v, layout=...)` checks its inputs, then calls ``torch.ops.ringpass.ring_attention``,
a `torch.library.custom_op` that takes the layout as plain values and the process group by name (every
rank compiles the same graph; the rank is read at run time). It has a fake implementation, so
AOTAutograd and Inductor treat it as one opaque call, and an autograd formula whose backward is itself a
custom op (``ringpass::ring_attention_backward``), so the backward ring appears in compiled backward
graphs as one call too. Both take their arguments after the tensors as `lowering.ring_args.RingArgs` spells them.

A call by hand agrees with its peers first: the first time a rank makes a call of a given layout, options and
shapes, every rank of the group compares them (`lowering.failures.agree_once`), so ranks that disagree all raise
an `InvalidInputError` naming the difference instead of crashing in the ring's traffic. Later calls of the same
kind cost a set lookup. (Compiled graphs agree on each call, `ringpass.frontend.guard`.)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch

from lowering import compat
from lowering.all_gather import gathered_backward, gathered_forward
from lowering.comm import RingExchange
from lowering.documents import DocumentLayout
from lowering.errors import InvalidInputError, NotSupportedError
from lowering.failures import agree_once, by_rank, ring_work
from lowering.fully_masked import check_fully_masked
from lowering.groups import checked_group, group_by_name
from lowering.kernels import accumulation_dtype
from lowering.layout import Layout, cached_layout
from lowering.masks import DOCUMENTS, BlockMask, document_ids, documents_mask, mask_program, register_mask
from lowering.ring import RingSpec, ring_backward, ring_forward
from lowering.ring_args import PROGRAM_INPUTS, RingArgs, ring_schema
from lowering.scores import ScoreMod, check_score_options

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: Layout,
    is_causal: bool = False,
    scale: float | None = None,
    group=None,
    return_lse: bool = False,
    window: int | None = None,
    mask: Callable | None = None,
    mask_inputs: Sequence[torch.Tensor] = (),
    softcap: float | None = None,
    alibi_slopes: Sequence[float] | None = None,
    bias: Callable | None = None,
    bias_inputs: Sequence[torch.Tensor] = (),
    fully_masked: str = "zero",
    strategy: str = "ring",
    documents: torch.Tensor | None = None,
):
    """Exact attention over a sequence sharded across the ranks of ``group``.

    q ``[B, Hq, n, D]`` and k/v ``[B, Hkv, n, D]`` (v may have a smaller head dim: MLA) are this rank's shards
    in ``layout`` order (``layout.shard(x_full, 2, rank)``); Hq must be a multiple of Hkv (GQA/MQA: only the Hkv heads
    travel). Returns this rank's rows of full-sequence ``softmax(q kᵀ · scale [+ causal mask]) v``, and
    with ``return_lse=True`` also their log-sum-exp ``[B, Hq, n]`` (fp32; fp64 for fp64 inputs). Padding
    slots of the layout get out 0 and lse -inf. ``group=None`` is the default process group (or a single
    process when none is initialised). Differentiable in q, k, v (and through the LSE).

    ``window=W`` (with ``is_causal``): a key is visible from queries at most ``W - 1`` positions after it.
    ``mask(q_pos, kv_pos, *mask_inputs) -> bool`` (True = visible, broadcastable to ``[B, Hq, n, m]``) is
    evaluated on global positions, one tile of at most `lowering.masks.MASK_TILE` squared pairs at a time;
    ``mask_inputs`` are the (replicated, small) tensors it reads. Rows with no visible key get out 0
    (unless ``fully_masked`` says otherwise).

    Score modifiers (`lowering.scores`), applied to ``scale · q kᵀ`` before masking: ``softcap=c`` gives
    ``c·tanh(s/c)``; ``alibi_slopes`` (one float per query head) adds ``slope·(kv_pos − q_pos)``, computed in
    the kernels; ``bias(q_pos, kv_pos, *bias_inputs) -> float`` (broadcastable to ``[B, Hq, n, m]``) is added
    after the soft-cap, evaluated per tile like ``mask``.

    Differentiable in ``mask_inputs`` and ``bias_inputs`` too: a program that reads a trainable tensor (a
    learned bias table) gives it its gradient, accumulated tile by tile (`lowering.program_grads`).

    ``fully_masked``: what a query whose keys are all hidden gives (`lowering.fully_masked`): ``"zero"``
    (as SDPA with a bool mask), ``"uniform"`` (the mean of every key's value, with the gradients eager
    attention adding a finite mask such as ``finfo.min`` computes), ``"uniform_values"`` (that mean with
    gradients into the values only, as eager ``masked_fill`` with a finite value). Their lse stays -inf.

    ``documents``: each token's document id, int ``[N]`` or ``[B, N]`` over the whole sequence (the same tensor on every
    rank): a key is visible only from queries of its document (with ``is_causal``: causal inside each), as in a
    row packed from several documents. With one packing (every row alike, each id one run of tokens) the ring plans
    each document's pairs (`lowering.schedule.plan_documents`: no pair of two documents computed, no mask); otherwise
    it reads the ids' range per tile: tiles of two different documents are skipped, tiles inside one document run as
    plain (or causal) attention, and ids are compared only on the rest. Use it in place of an equivalent ``mask``
    program (not with one). ``layout`` may then be a `lowering.DocumentLayout` of the same documents, which balances
    their pairs over the ranks.

    ``strategy``: ``"ring"`` (K/V blocks travel around the ring, each transfer overlapped with a block's compute)
    or ``"all-gather"`` (every rank gathers all K/V at once and reduce-scatters dK/dV: `lowering.all_gather`).
    """
    if not isinstance(layout, (Layout, DocumentLayout)):
        raise InvalidInputError(f"layout must be a lowering.Layout or DocumentLayout, got {type(layout).__name__}.")
    narrower = k.size(-1) - v.size(-1) if isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) else 0
    if narrower > 0:  # MLA: values narrower than keys travel padded with zero columns, cut off again
        out = ring_attention(
            q,
            k,
            torch.nn.functional.pad(v, (0, narrower)),
            layout=layout,
            is_causal=is_causal,
            scale=scale,
            group=group,
            return_lse=return_lse,
            window=window,
            mask=mask,
            mask_inputs=mask_inputs,
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            bias=bias,
            bias_inputs=bias_inputs,
            fully_masked=fully_masked,
            strategy=strategy,
            documents=documents,
        )
        return (out[0][..., :-narrower], out[1]) if return_lse else out[..., :-narrower]
    check_inputs(q, k, v, layout)
    group = checked_group(group, layout.world_size)
    if scale is not None and not isinstance(scale, (int, float)):
        raise InvalidInputError(f"scale must be a Python number or None, got {type(scale).__name__}.")
    scale = default_scale(q) if scale is None else float(scale)
    if documents is not None:
        if mask is not None:
            raise NotSupportedError(
                "ring_attention takes documents or a mask program, not both: add the documents to your program "
                "(`ids[q_pos][:, None] == ids[kv_pos][None, :]`), or pass documents alone."
            )
        ids = document_ids((documents,), layout.seq_len, q.size(0))
        if isinstance(layout, DocumentLayout) and DocumentLayout.of_ids(ids.cpu(), layout.world_size) != layout:
            raise InvalidInputError(
                f"documents= holds documents of other lengths than the layout's {layout.lengths}: pass the ids of "
                "the documents the layout was built from (DocumentLayout(lengths, P).document_ids())."
            )
        mask_inputs = (documents,)
    elif isinstance(layout, DocumentLayout):
        raise InvalidInputError(
            "A DocumentLayout needs documents=ids (its document_ids()): the ring plans its blocks from the documents."
        )
    mask_id = DOCUMENTS if documents is not None else register_mask(mask) if mask is not None else ""
    check_score_options(softcap, alibi_slopes)
    check_fully_masked(fully_masked)
    check_strategy(strategy)
    slopes = None if alibi_slopes is None else [float(s) for s in alibi_slopes]
    if slopes is not None and len(slopes) != q.size(1):
        raise InvalidInputError(
            f"alibi_slopes has {len(slopes)} slopes; q has {q.size(1)} heads: give one per query head."
        )
    args = RingArgs(
        layout.kind,
        layout.world_size,
        layout.seq_len,
        bool(is_causal),
        scale,
        "" if group is None else group.group_name,
        window,
        mask_id,
        list(mask_inputs),
        None if softcap is None else float(softcap),
        slopes,
        register_mask(bias) if bias is not None else "",
        list(bias_inputs),
        fully_masked,
        strategy=strategy,
    )
    agree_on_call("ring_attention", args.group_name, layout, (q, k, v), args, mask, bias)
    out, lse = torch.ops.ringpass.ring_attention(q, k, v, *args.op_args())
    return (out, lse) if return_lse else out


def agree_on_call(function: str, group_name: str, layout: Layout, qkv, args: RingArgs, mask=None, bias=None) -> None:
    """Before a by-hand call of ``function`` (``ring_attention``, ``ulysses_attention``, ``gathered_attention``),
    the ranks of ``group_name`` agree on its layout, shapes and options, once per distinct call: ranks that
    disagree all raise the same `InvalidInputError` instead of deadlocking (or aborting) in a collective. A
    compiled caller's graph agrees on its own calls (`ringpass.frontend.guard`); one process ("" group) has no peers."""
    if group_name and not torch.compiler.is_compiling():
        fingerprint = _fingerprint(layout, qkv, args, mask, bias)
        agree_once(group_name, function, fingerprint, functools.partial(_difference, function))


def _fingerprint(layout: Layout, qkv, args: RingArgs, mask, bias) -> dict:
    """What the ranks of one ring must agree on in a call, as plain values: the programs by their Python
    names (their ids, and the group's name, are each process's own)."""

    def shapes(tensors):
        return ", ".join(f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}" for t in tensors)

    def name(program):
        return None if program is None else getattr(program, "__qualname__", type(program).__name__)

    return {
        "layout": str(layout),
        "q, k, v": shapes(qkv),
        "is_causal": args.is_causal,
        "scale": args.scale,
        "window": args.window,
        "mask": name(mask),
        "mask_inputs": shapes(args.mask_inputs),
        "softcap": args.softcap,
        "alibi_slopes": args.alibi_slopes,
        "bias": name(bias),
        "bias_inputs": shapes(args.bias_inputs),
        "fully_masked": args.fully_masked,
    }


def _difference(function: str, everyone: list[dict]) -> str:
    """The first argument the ranks' `_fingerprint`s differ in, by rank, for people."""
    for field in everyone[0]:
        values = [fingerprint[field] for fingerprint in everyone]
        if len({str(value) for value in values}) > 1:
            return (
                f"The ranks disagree on a {function} call: its {field} is {by_rank(values)}. Every rank of "
                f"the ring must make the same {function} calls, in the same order: the same layout and options, "
                "on shards of the same shape."
            )
    return ""


def default_scale(q: torch.Tensor) -> float:
    return 1.0 / math.sqrt(q.size(-1))


def check_inputs(q, k, v, layout: Layout) -> None:
    """Raise `InvalidInputError` / `NotSupportedError` unless q, k, v are shards the ring can use."""
    tensors = {"q": q, "k": k, "v": v}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise InvalidInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
        if t.dim() != 4:
            raise InvalidInputError(
                f"{name} must be 4-D [batch, heads, local_seq, head_dim], got shape {tuple(t.shape)}."
            )
        if t.dtype not in SUPPORTED_DTYPES:
            raise InvalidInputError(
                f"{name} has dtype {t.dtype}; ring attention needs a floating dtype "
                f"(float16, bfloat16, float32 or float64). Cast it first."
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise InvalidInputError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}.")
    if not (q.device == k.device == v.device):
        raise InvalidInputError(
            f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}. Move them with .to()."
        )
    if k.shape != v.shape:
        if k.shape[:-1] == v.shape[:-1]:
            raise NotSupportedError(
                f"k has head dim {k.size(-1)} but v has {v.size(-1)}; values wider than keys are not supported "
                "(ring_attention pads narrower values itself)."
            )
        raise InvalidInputError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}.")
    if q.size(0) != k.size(0) or q.size(3) != k.size(3):
        raise InvalidInputError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch (dim 0) and head dim (dim 3)."
        )
    if min(q.shape) == 0 or min(k.shape) == 0:
        raise InvalidInputError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} must not have an empty dimension.")
    if q.size(1) % k.size(1) != 0:
        raise InvalidInputError(
            f"q has {q.size(1)} heads, k/v have {k.size(1)}: the query heads must be a multiple of the "
            "key/value heads (GQA/MQA)."
        )
    for name, t in tensors.items():
        if t.size(2) != layout.local_len:
            raise InvalidInputError(
                f"{name} has {t.size(2)} tokens on this rank but {layout} gives every rank "
                f"{layout.local_len}; pass each rank's shard, made with layout.shard(x_full, 2, rank)."
            )


STRATEGIES = ("ring", "all-gather")  # how the ring op moves K/V (`RingArgs.strategy`)


def check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise InvalidInputError(f"strategy={strategy!r} is not one of {', '.join(map(repr, STRATEGIES))}.")


def _spec(args: RingArgs, batch: int) -> RingSpec:
    if args.window is not None and not args.is_causal:
        raise InvalidInputError(
            f"window={args.window} needs is_causal=True (a sliding window looks back from each query)."
        )
    mask, layout = None, None
    if args.mask_id == DOCUMENTS:
        mask = documents_mask(args.is_causal, args.window, args.mask_inputs, args.seq_len, batch)
        if args.layout_kind == DocumentLayout.kind:
            layout = DocumentLayout.of_ids(mask.documents_on_host, args.world_size)
    elif args.window is not None or args.mask_id:
        mask = BlockMask(
            args.is_causal,
            args.window,
            mask_program(args.mask_id) if args.mask_id else None,
            tuple(args.mask_inputs or ()),
        )
    scores = ScoreMod(
        args.softcap,
        None if args.alibi_slopes is None else tuple(args.alibi_slopes),
        mask_program(args.bias_id) if args.bias_id else None,
        tuple(args.bias_inputs or ()),
    )
    layout = layout or cached_layout(args.layout_kind, args.world_size, args.seq_len, args.ulysses)
    return RingSpec(layout, args.is_causal, args.scale, mask, scores, args.fully_masked)


_TENSORS = {"q": torch.Tensor, "k": torch.Tensor, "v": torch.Tensor}


@torch.library.custom_op(
    "ringpass::ring_attention", mutates_args=(), schema=ring_schema(_TENSORS, {}, tuple[torch.Tensor, torch.Tensor])
)
def _ring_attention_op(q, k, v, *config):
    args = RingArgs(*config)
    with ring_work(args.group_name):
        spec = _spec(args, q.size(0))
        check_inputs(q, k, v, spec.layout)
        exchange = RingExchange(group_by_name(args.group_name))
        if exchange.world_size != spec.layout.world_size:
            raise InvalidInputError(
                f"The layout is for {spec.layout.world_size} ranks but process group "
                f"{args.group_name!r} has {exchange.world_size}."
            )
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if _gathers(args, exchange, spec):
            return gathered_forward(q, k, v, spec, exchange.group)
        return ring_forward(q, k, v, spec, exchange)


def _gathers(args: RingArgs, exchange: RingExchange, spec: RingSpec) -> bool:
    """The call gathers K/V at once. Not where nothing needs to move: a ring of one rank, or a call whose every
    block only its own rank needs (`RingSpec.hops`: packed documents each on one rank), which runs the ring's lap
    and sends nothing (every rank computes the same hops, so all take the same path)."""
    check_strategy(args.strategy)
    return args.strategy == "all-gather" and exchange.world_size > 1 and any(spec.hops())


@_ring_attention_op.register_fake
def _(q, k, v, *config):
    args = RingArgs(*config)
    if isinstance(args.seq_len, int) and args.layout_kind != DocumentLayout.kind:  # else the real call checks
        check_inputs(q, k, v, cached_layout(args.layout_kind, args.world_size, args.seq_len, args.ulysses))
    lse = q.new_empty(q.shape[:-1], dtype=accumulation_dtype(q.dtype))
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), lse


@torch.library.custom_op(
    "ringpass::ring_attention_backward",
    mutates_args=(),
    schema=ring_schema(
        {"dout": torch.Tensor, **_TENSORS, "out": torch.Tensor, "lse": torch.Tensor, "dlse": torch.Tensor | None},
        {"trained": list[int]},
        tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]],
    ),
)
def _ring_attention_backward_op(dout, q, k, v, out, lse, dlse, *config_and_trained):
    """(dq, dk, dv, the gradients of the program inputs ``trained`` numbers: `RingArgs.program_inputs`,
    counted together; this rank's queries' share of each)."""
    *config, trained = config_and_trained
    args = RingArgs(*config)
    with ring_work(args.group_name):
        spec = _spec(args, q.size(0))
        if dlse is not None and not bool(dlse.any()):
            dlse = None  # autograd hands zeros for an unused LSE; the fused kernels need no LSE gradient
        first = len(args.mask_inputs)
        per_program = [
            [i in trained for i in range(first)],
            [first + i in trained for i in range(len(args.bias_inputs))],
        ]
        exchange = RingExchange(group_by_name(args.group_name))
        tensors = [t.contiguous() for t in (dout, q, k, v, out, lse)] + [None if dlse is None else dlse.contiguous()]
        if _gathers(args, exchange, spec):
            return gathered_backward(*tensors, spec, exchange.group, per_program)
        return ring_backward(*tensors, spec, exchange, per_program)


@_ring_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, dlse, *config_and_trained):
    *config, trained = config_and_trained
    program_inputs = RingArgs(*config).program_inputs()
    return (
        *(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)),
        [torch.empty_like(program_inputs[i]) for i in trained],
    )


def _setup_context(ctx, inputs, output):
    """Saves q, k, v, out, lse and the program inputs; the other arguments are plain values."""
    q, k, v, *config = inputs
    ctx.args = RingArgs(*config)
    ctx.save_for_backward(q, k, v, *output, *ctx.args.program_inputs())


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, *saved = ctx.saved_tensors
    args = ctx.args.with_program_inputs(saved)  # the program inputs as autograd unpacks them
    needs = {field: ctx.needs_input_grad[RingArgs.position(field)] for field in PROGRAM_INPUTS}
    trained = [i for i, need in enumerate(need for field in PROGRAM_INPUTS for need in needs[field]) if need]
    dq, dk, dv, program_grads = torch.ops.ringpass.ring_attention_backward(
        dout, q, k, v, out, lse, dlse, *args.op_args(), trained
    )
    grads = iter(program_grads)
    none = RingArgs(*[None] * len(RingArgs._fields))  # no gradient for the plain values
    return (
        dq,
        dk,
        dv,
        *none._replace(**{field: [next(grads) if need else None for need in needs[field]] for field in PROGRAM_INPUTS}),
    )


def _no_double_backward(ctx, *grads):
    raise NotSupportedError("Differentiating ring attention twice (double backward) is not supported.")


def _autocast_kernel(device_type: str):
    """Under ``torch.autocast``, the ring op casts q, k, v as autocast casts SDPA's (to the autocast
    dtype; float64 stays), then runs with autocast off: a model whose rotary embedding left q in float32
    and v in bfloat16 runs as it does unsharded."""
    key = compat.DispatchKeySet(getattr(compat.DispatchKey, "Autocast" + compat.dispatch_key_for_device(device_type)))

    def kernel(_, q, k, v, *rest):
        dtype = torch.get_autocast_dtype(device_type)
        cast = [
            t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 and t.device.type == device_type else t
            for t in (q, k, v)
        ]
        with compat.ExcludeDispatchKeyGuard(key):
            return torch.ops.ringpass.ring_attention.default(*cast, *rest)

    return kernel


_autocast_library = torch.library.Library("ringpass", "IMPL")
for _device_type in ("cpu", "cuda"):
    _autocast_library.impl(
        "ring_attention",
        _autocast_kernel(_device_type),
        "Autocast" + compat.dispatch_key_for_device(_device_type),
        with_keyset=True,
    )
_ring_attention_op.register_autograd(_backward, setup_context=_setup_context)
_ring_attention_backward_op.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)
