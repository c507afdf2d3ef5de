"""Find the sequence mixers other than attention that the ring runs on a shard, by what they compute.

Matches:
- a causal depthwise convolution (Mamba2's, Gated DeltaNet's and Lfm2's short convolutions): ``conv1d(x [B, C, L],
  weight [C, 1, k], bias, stride 1, dilation 1, padding k - 1, groups C)`` whose one reader takes its first L
  positions (``out[..., :L]``, ``out[:, :, :L]`` or ``out[..., :-(k-1)]``);
- a cumulative sum ``cumsum(x, dim)`` of a floating activation (3-D or more: a feature dim besides batch and
  sequence) along a dim as long as the sequence (the length of the attentions' queries, of a convolution above or of
  an input that arrives sequence-sharded). A cumsum of a per-token vector (``[B, N]``: position ids from a padding
  mask, document ids) stays where it is, computed whole on every rank, as per-token vectors are (DESIGN.md); so
  does one accumulated in another dtype (``dtype=``).

Writes ``ctx.mixers``: one `MixerMatch` each. `find_sequence_axes` probes a convolution's output from its input and
checks that each mixer runs along its input's sequence axis (else it is an ordinary token-mixing op again);
`rewrite_sequence_mixers` replaces those whose input is sharded with ``lowering.sequence_mixers``' ops. Ops that mix
tokens in any other way (a chunked scan: a reshape that cuts the sequence into chunks) are not matched: the probe
refuses them, naming the op.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ringpass.fx.context import PassContext
from ringpass.fx.findings import MixerMatch
from ringpass.fx.nodes import example_value
from ringpass.fx.sizes import same, value_of
from ringpass.fx.spellings import op_name

CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
CONV_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}


def find_sequence_mixers(ctx: PassContext) -> None:
    for node in ctx.gm.graph.nodes:
        if node.op == "call_function" and op_name(node) == "conv1d":
            match = _causal_conv(node)
            if match is not None:
                ctx.mixers.append(match)
    lengths = [example_value(m.query).shape[-2] for m in ctx.attention]
    lengths += [example_value(node).shape[dim] for node, dim in ctx.carried_inputs.items()]
    lengths += [example_value(m.input).shape[-1] for m in ctx.mixers]  # (a graph with no attention)
    if not lengths:
        return
    for node in ctx.gm.graph.nodes:
        if node.op in ("call_function", "call_method") and op_name(node) == "cumsum":
            match = _cumsum(node, lengths[0])
            if match is not None:
                ctx.mixers.append(match)


def _causal_conv(conv: fx.Node) -> MixerMatch | None:
    args = dict(CONV_DEFAULTS, **dict(zip(CONV_ARGS, conv.args)), **conv.kwargs)
    x, weight = example_value(args["input"]), example_value(args.get("weight"))
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor) or x.dim() != 3 or weight.dim() != 3:
        return None
    channels, width = x.shape[1], weight.shape[-1]
    if not (
        isinstance(width, int)
        and same(weight.shape[0], channels)
        and weight.shape[1] == 1
        and _one(args["groups"]) == channels
        and _one(args["stride"]) == 1
        and _one(args["dilation"]) == 1
        and _one(args["padding"]) == width - 1
    ):
        return None
    (reader,) = conv.users if len(conv.users) == 1 else (None,)
    if reader is None or not _first_positions(reader, conv, x.shape[-1], width):
        return None
    return MixerMatch("causal_conv1d", reader, args["input"], 2, args["weight"], args["bias"], width, internal=(conv,))


def _one(value):
    """A conv argument given as ``n`` or ``(n,)``: n (None when it is neither)."""
    value = value_of(value)
    if isinstance(value, (tuple, list)):
        return value[0] if len(value) == 1 else None
    return value if isinstance(value, int) else None


def _first_positions(user: fx.Node, conv: fx.Node, length, width: int) -> bool:
    """``user`` is ``conv[..., :length]`` (or ``[:, :, :length]``, ``[..., :-(width-1)]``)."""
    if user.op != "call_function" or user.target is not operator.getitem or user.args[0] is not conv:
        return False
    index = user.args[1] if isinstance(user.args[1], tuple) else (user.args[1],)
    if index and index[0] is Ellipsis:
        index = (slice(None),) * (3 - len(index[1:])) + tuple(index[1:])
    if len(index) != 3 or any(i != slice(None) for i in index[:2]) or not isinstance(index[2], slice):
        return False
    last = index[2]
    stop = value_of(last.stop)
    return (
        value_of(last.start) in (None, 0)
        and last.step in (None, 1)
        and (same(stop, length) or (width > 1 and stop == -(width - 1)))
    )


def _cumsum(node: fx.Node, length) -> MixerMatch | None:
    x = example_value(node.args[0])
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 3 or not isinstance(dim, int):
        return None
    if node.kwargs.get("dtype") is not None or len(node.args) > 2:  # accumulated in another dtype: left to the probe
        return None
    dim %= x.dim()
    if not same(x.shape[dim], length):
        return None
    return MixerMatch("cumsum", node, node.args[0], dim)
