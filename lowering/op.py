"""`ring_attention`: the public entry point, and the custom ops a compiled graph calls.

`ring_attention(q, k, v, layout=...)` checks its inputs, then calls ``torch.ops.ringpass.ring_attention``,
a `torch.library.custom_op` that takes the layout as plain values and the process group by name (every
rank compiles the same graph; the rank is read at run time). It has a fake implementation, so
AOTAutograd and Inductor treat it as one opaque call, and an autograd formula whose backward is itself a
custom op (``ringpass::ring_attention_backward``), so the backward ring appears in compiled backward
graphs as one call too.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from lowering.comm import RingExchange
from lowering.errors import InvalidInputError, NotSupportedError
from lowering.failures import ring_work
from lowering.fully_masked import check_fully_masked
from lowering.kernels import accumulation_dtype
from lowering.layout import Layout
from lowering.masks import BlockMask, mask_program, register_mask
from lowering.ring import RingSpec, ring_backward, ring_forward
from lowering.scores import ScoreMod, check_score_options
from lowering.ulysses import group_layout

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: Layout,
    is_causal: bool = False,
    scale: Optional[float] = None,
    group=None,
    return_lse: bool = False,
    window: Optional[int] = None,
    mask: Optional[Callable] = None,
    mask_inputs: Sequence[torch.Tensor] = (),
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Sequence[float]] = None,
    bias: Optional[Callable] = None,
    bias_inputs: Sequence[torch.Tensor] = (),
    fully_masked: str = "zero",
):
    """Exact attention over a sequence sharded across the ranks of ``group``.

    q ``[B, Hq, n, D]`` and k/v ``[B, Hkv, n, D]`` (v may have a smaller head dim: MLA) are this rank's shards in ``layout`` order
    (``layout.shard(x_full, 2, rank)``); Hq must be a multiple of Hkv (GQA/MQA: only the Hkv heads
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
    """
    if not isinstance(layout, Layout):
        raise InvalidInputError(f"layout must be a lowering.Layout, got {type(layout).__name__}.")
    narrower = k.size(-1) - v.size(-1) if isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) else 0
    if narrower > 0:  # MLA: values narrower than keys travel padded with zero columns, cut off again
        out = ring_attention(q, k, torch.nn.functional.pad(v, (0, narrower)), layout=layout, is_causal=is_causal,
                             scale=scale, group=group, return_lse=return_lse, window=window, mask=mask,
                             mask_inputs=mask_inputs, softcap=softcap, alibi_slopes=alibi_slopes, bias=bias,
                             bias_inputs=bias_inputs, fully_masked=fully_masked)
        return (out[0][..., :-narrower], out[1]) if return_lse else out[..., :-narrower]
    check_inputs(q, k, v, layout)
    group_name = _group_name(group, layout)
    if scale is not None and not isinstance(scale, (int, float)):
        raise InvalidInputError(f"scale must be a Python number or None, got {type(scale).__name__}.")
    scale = default_scale(q) if scale is None else float(scale)
    mask_id = register_mask(mask) if mask is not None else ""
    check_score_options(softcap, alibi_slopes)
    check_fully_masked(fully_masked)
    slopes = None if alibi_slopes is None else [float(s) for s in alibi_slopes]
    if slopes is not None and len(slopes) != q.size(1):
        raise InvalidInputError(f"alibi_slopes has {len(slopes)} slopes; q has {q.size(1)} heads: give one per query head.")
    out, lse = torch.ops.ringpass.ring_attention(
        q, k, v, layout.kind, layout.world_size, layout.seq_len, bool(is_causal), scale, group_name,
        window, mask_id, list(mask_inputs), None if softcap is None else float(softcap), slopes,
        register_mask(bias) if bias is not None else "", list(bias_inputs), fully_masked, 1,
    )
    return (out, lse) if return_lse else out


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


def _group_name(group, layout: Layout) -> str:
    """The process group's name, after checking it matches the layout ('' = no group, one process)."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        if layout.world_size != 1:
            raise InvalidInputError(
                f"The layout spans {layout.world_size} ranks but no process group is initialised; "
                "call torch.distributed.init_process_group (e.g. under torchrun) first."
            )
        return ""
    if not (dist.is_available() and dist.is_initialized()):
        raise InvalidInputError("A process group was passed but torch.distributed is not initialised; call init_process_group first.")
    group = dist.group.WORLD if group is None else group
    if dist.get_rank(group) < 0:
        raise InvalidInputError(f"This rank ({dist.get_rank()}) is not a member of the process group passed as `group`.")
    size = dist.get_world_size(group)
    if size != layout.world_size:
        raise InvalidInputError(
            f"The layout is for {layout.world_size} ranks but the process group has {size}; "
            f"build it as Layout(kind, world_size={size}, seq_len=...)."
        )
    return group.group_name


@lru_cache(maxsize=64)
def _layout(kind: str, world_size: int, seq_len: int, ulysses: int = 1):
    """The layout the ring runs over: the sequence's, or with Ulysses groups the groups' (`lowering.ulysses`)."""
    return Layout(kind, world_size, seq_len) if ulysses == 1 else group_layout(kind, world_size, seq_len, ulysses)


def _spec(kind, world_size, seq_len, is_causal, scale, window, mask_id, mask_inputs, softcap, alibi_slopes,
          bias_id, bias_inputs, fully_masked, ulysses=1) -> RingSpec:
    if window is not None and not is_causal:
        raise InvalidInputError(f"window={window} needs is_causal=True (a sliding window looks back from each query).")
    mask = None
    if window is not None or mask_id:
        mask = BlockMask(is_causal, window, mask_program(mask_id) if mask_id else None, tuple(mask_inputs or ()))
    scores = ScoreMod(softcap, None if alibi_slopes is None else tuple(alibi_slopes),
                      mask_program(bias_id) if bias_id else None, tuple(bias_inputs or ()))
    return RingSpec(_layout(kind, world_size, seq_len, ulysses), is_causal, scale, mask, scores, fully_masked)


def _exchange(group_name: str) -> RingExchange:
    if not group_name:
        return RingExchange(None)
    from torch.distributed.distributed_c10d import _resolve_process_group

    return RingExchange(_resolve_process_group(group_name))


@torch.library.custom_op("ringpass::ring_attention", mutates_args=())
def _ring_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout_kind: str, world_size: int,
    seq_len: int, is_causal: bool, scale: float, group_name: str, window: Optional[int], mask_id: str,
    mask_inputs: list[torch.Tensor], softcap: Optional[float], alibi_slopes: Optional[list[float]], bias_id: str,
    bias_inputs: list[torch.Tensor], fully_masked: str, ulysses: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    with ring_work(group_name):
        spec = _spec(layout_kind, world_size, seq_len, is_causal, scale, window, mask_id, mask_inputs, softcap,
                     alibi_slopes, bias_id, bias_inputs, fully_masked, ulysses)
        check_inputs(q, k, v, spec.layout)
        exchange = _exchange(group_name)
        if exchange.world_size != spec.layout.world_size:
            raise InvalidInputError(
                f"The layout is for {spec.layout.world_size} ranks but process group {group_name!r} has {exchange.world_size}."
            )
        return ring_forward(q.contiguous(), k.contiguous(), v.contiguous(), spec, exchange)


@_ring_attention_op.register_fake
def _(q, k, v, layout_kind, world_size, seq_len, is_causal, scale, group_name, window, mask_id, mask_inputs, softcap,
      alibi_slopes, bias_id, bias_inputs, fully_masked, ulysses):
    if isinstance(seq_len, int):  # with a symbolic length the real call checks the shapes
        check_inputs(q, k, v, _layout(layout_kind, world_size, seq_len, ulysses))
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), q.new_empty(q.shape[:-1], dtype=accumulation_dtype(q.dtype))


@torch.library.custom_op("ringpass::ring_attention_backward", mutates_args=())
def _ring_attention_backward_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, dlse: Optional[torch.Tensor], layout_kind: str, world_size: int, seq_len: int,
    is_causal: bool, scale: float, group_name: str, window: Optional[int], mask_id: str,
    mask_inputs: list[torch.Tensor], softcap: Optional[float], alibi_slopes: Optional[list[float]], bias_id: str,
    bias_inputs: list[torch.Tensor], fully_masked: str, ulysses: int, trained: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(dq, dk, dv, the gradients of the program inputs ``trained`` numbers: mask inputs, then bias inputs,
    counted together; this rank's queries' share of each)."""
    with ring_work(group_name):
        spec = _spec(layout_kind, world_size, seq_len, is_causal, scale, window, mask_id, mask_inputs, softcap,
                     alibi_slopes, bias_id, bias_inputs, fully_masked, ulysses)
        if dlse is not None and not bool(dlse.any()):
            dlse = None  # autograd hands zeros for an unused LSE; the fused kernels need no LSE gradient
        first = len(mask_inputs)
        per_program = [[i in trained for i in range(first)], [first + i in trained for i in range(len(bias_inputs))]]
        return ring_backward(
            dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse.contiguous(),
            None if dlse is None else dlse.contiguous(), spec, _exchange(group_name), per_program,
        )


@_ring_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, dlse, layout_kind, world_size, seq_len, is_causal, scale, group_name, window,
      mask_id, mask_inputs, softcap, alibi_slopes, bias_id, bias_inputs, fully_masked, ulysses, trained):
    program_inputs = [*mask_inputs, *bias_inputs]
    return (*(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)),
            [torch.empty_like(program_inputs[i]) for i in trained])


# The ring op's lists of tensors its mask and bias programs read: differentiable like q, k, v.
PROGRAM_INPUTS = ("mask_inputs", "bias_inputs")


def program_input_positions() -> tuple[int, ...]:
    """Where `PROGRAM_INPUTS` sit among ``ringpass::ring_attention``'s arguments (q is 0)."""
    names = [argument.name for argument in torch.ops.ringpass.ring_attention.default._schema.arguments]
    return tuple(names.index(name) for name in PROGRAM_INPUTS)


def _setup_context(ctx, inputs, output):
    """Saves q, k, v, out, lse and the program inputs; the other arguments are plain values."""
    q, k, v, *ctx.config = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *(t for i in _CONFIG_PROGRAM_INPUTS for t in ctx.config[i]))


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, *saved = ctx.saved_tensors
    config = list(ctx.config)
    for i in _CONFIG_PROGRAM_INPUTS:  # the program inputs as autograd unpacks them
        config[i], saved = list(saved[:len(config[i])]), saved[len(config[i]):]
    needs = [need for i in _CONFIG_PROGRAM_INPUTS for need in ctx.needs_input_grad[3 + i]]
    dq, dk, dv, program_grads = torch.ops.ringpass.ring_attention_backward(
        dout, q, k, v, out, lse, dlse, *config, [i for i, need in enumerate(needs) if need])
    trained = iter(program_grads)
    return (dq, dk, dv, *([next(trained) if ctx.needs_input_grad[3 + i][j] else None for j in range(len(arg))]
                          if i in _CONFIG_PROGRAM_INPUTS else None for i, arg in enumerate(config)))


def _no_double_backward(ctx, *grads):
    raise NotSupportedError("Differentiating ring attention twice (double backward) is not supported.")


def _autocast_kernel(device_type: str):
    """Under ``torch.autocast``, the ring op casts q, k, v as autocast casts SDPA's (to the autocast
    dtype; float64 stays), then runs with autocast off: a model whose rotary embedding left q in float32
    and v in bfloat16 runs as it does unsharded."""
    key = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, "Autocast" + torch._C._dispatch_key_for_device(device_type)))

    def kernel(_, q, k, v, *rest):
        dtype = torch.get_autocast_dtype(device_type)
        cast = [t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 and t.device.type == device_type else t
                for t in (q, k, v)]
        with torch._C._ExcludeDispatchKeyGuard(key):
            return torch.ops.ringpass.ring_attention.default(*cast, *rest)

    return kernel


_autocast_library = torch.library.Library("ringpass", "IMPL")
for _device_type in ("cpu", "cuda"):
    _autocast_library.impl("ring_attention", _autocast_kernel(_device_type),
                           "Autocast" + torch._C._dispatch_key_for_device(_device_type), with_keyset=True)
_CONFIG_PROGRAM_INPUTS = tuple(i - 3 for i in program_input_positions())  # after q, k, v
_ring_attention_op.register_autograd(_backward, setup_context=_setup_context)
_ring_attention_backward_op.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)
