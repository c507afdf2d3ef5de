"""Which ops act on each token separately: the rule that keeps sharded activations honest.

An op on a value with a sequence axis may run on a shard only if it acts on every token by itself. That
is decided from what the op is, never assumed: pointwise aten ops (by their ``pointwise`` tag), ops that
only rearrange or cast (``view``, ``transpose``, ``to``...), per-token layers (``linear``, ``embedding``,
``layer_norm`` over trailing feature dims, ``matmul`` over feature dims, a table indexed by per-token
ids, indexing along other dims than the sequence), custom autograd Functions whose forward does only
such ops (BLOOM's GeLU), and ops with a ``dim`` argument (``softmax``, ``cat``, ``split``, ``sum``,
``gather``...) when that dim is not the sequence. A ``sum`` or ``mean`` over the sequence is a partial sum
to be all-reduced; ``cross_entropy`` with a reduction is a global mean. Everything else that touches the
sequence (sorts, convolutions, cumulative ops, max or norm over the sequence, tensor indexing, ops not
listed) mixes tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ringpass.fx.nodes import example_value
from ringpass.fx.sizes import same, value_of
from ringpass.fx.spellings import PROMPT_SLOTS, REARRANGE, is_pointwise_name, op_name

PER_TOKEN_LAYERS = {
    "linear",
    "embedding",
    "matmul",
    "bmm",
    "mm",
    "addmm",
    "baddbmm",
    "einsum",
    "dropout",
    "scaled_dot_product_attention",
    "flex_attention",
}  # over feature dims; a contraction over the sequence loses the sequence axis and is caught above
TRAILING_NORMS = {"layer_norm", "rms_norm"}  # normalise over trailing (feature) dims
REDUCTIONS = {
    "sum",
    "mean",
    "amax",
    "amin",
    "max",
    "min",
    "norm",
    "var",
    "std",
    "prod",
    "logsumexp",
    "argmax",
    "argmin",
    "all",
    "any",
    "median",
    "nansum",
    "nanmean",
    "var_mean",
    "std_mean",
    "count_nonzero",
}
ALONG_DIM = {
    "softmax",
    "log_softmax",
    "cat",
    "concat",
    "concatenate",
    "split",
    "chunk",
    "unbind",
    "repeat_interleave",
    "sort",
    "argsort",
    "topk",
    "cumsum",
    "cumprod",
    "cummax",
    "cummin",
    "logcumsumexp",
    "flip",
    "roll",
    "gather",
    "take_along_dim",
    "index_select",
    "scatter",
    "scatter_",
    "scatter_add",
    "scatter_add_",
}
# Linear algebra on the last two dims of each operand, batched over the others
MATRIX_BATCHED = {"linalg_solve_triangular", "linalg_solve", "linalg_inv", "inverse", "linalg_cholesky", "cholesky"}
DIM_POSITION = {
    "split": 2,
    "chunk": 2,
    "repeat_interleave": 2,
    "norm": 2,
    "topk": 2,
    "roll": 2,
    "take_along_dim": 2,
}  # else the 2nd


def classify(node: fx.Node, seq_dims: Callable[[fx.Node], set], output_has_seq: bool) -> tuple[str, str | None]:
    """("token", None), a reduction over the sequence ("sum" | "mean" | "cross_entropy", None), or
    ("mixing", why). ``seq_dims(arg)`` gives the sequence dims of an input node."""
    name = op_name(node)
    first = next((a for a in _tensor_args(node) if seq_dims(a)), None)
    if name == "autograd_function_apply":
        return _custom_function(node)
    if node.target in PROMPT_SLOTS:
        return "token", None  # every rank keeps its own tokens' keys (keep_cache_sharded)
    if name == "getitem":
        return _getitem(node, seq_dims, output_has_seq)
    if name == "setitem":
        return _setitem(node, seq_dims)
    if name == "cross_entropy":
        reduction = node.kwargs.get("reduction", "mean")
        return ("token", None) if reduction == "none" else ("cross_entropy", None)
    if name in ("max", "min") and len(node.args) > 1 and isinstance(node.args[1], fx.Node):
        return "token", None  # elementwise maximum / minimum of two tensors
    if name == "tensor_split" and first is not None and split_takes_everything(node):
        return "token", None  # tensor_split(x, [N]): x, then nothing (Mamba2 on transformers 5.25, with no cache)
    if name in REDUCTIONS or name in ALONG_DIM:
        dims = _dims(node, name, first)
        if dims is not None and not (dims & seq_dims(first)):
            return "token", None
        if name in ("sum", "mean"):
            return name, None
        if name in ("cat", "concat", "concatenate") and _only_one_nonempty(node.args[0]):
            return "token", None  # cat([empty, x]) is x (an empty KV cache)
        return "mixing", f"`{name}` runs along the sequence"
    if name in MATRIX_BATCHED:
        matrix_dims = any(
            seq_dims(a) & {value_of(a).dim() - 2, value_of(a).dim() - 1} for a in _tensor_args(node) if seq_dims(a)
        )
        return ("mixing", f"`{name}` solves along the sequence") if matrix_dims else ("token", None)
    if name in TRAILING_NORMS:
        shape = node.kwargs.get("normalized_shape", node.args[1] if len(node.args) > 1 else ())
        rank = value_of(first).dim()
        trailing = set(range(rank - len(shape), rank)) if isinstance(shape, (tuple, list)) else {rank - 1}
        return ("mixing", f"`{name}` normalises over the sequence") if trailing & seq_dims(first) else ("token", None)
    if not output_has_seq and name not in ("size", "dim", "numel", "getattr"):
        return "mixing", f"`{name}` reduces over the sequence"
    if name in PER_TOKEN_LAYERS and _contracts_sequence(node, name, seq_dims):
        return "mixing", f"`{name}` sums over the sequence (a weight as long as the sequence multiplies along it)"
    if name in DTENSOR_CONVERSIONS:
        return _dtensor_conversion(node, first, seq_dims)
    if name in REARRANGE or name in PER_TOKEN_LAYERS or is_pointwise_name(name):
        return "token", None
    return "mixing", f"`{name}` is not known to act on each token separately"


DTENSOR_CONVERSIONS = {"to_local", "from_local", "redistribute"}  # tensor parallel's (parallelize_module)


def split_takes_everything(node: fx.Node) -> bool:
    """``tensor_split(x, [i, ...], dim)`` with every split index at or past the dim's traced length: the first piece
    is all of ``x`` (at any length no longer than the traced one, a shard's too), the others empty."""
    indices = node.args[1] if len(node.args) > 1 else node.kwargs.get("indices_or_sections")
    dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0)
    if not isinstance(indices, (list, tuple)) or not indices or not isinstance(dim, int):
        return False
    length = value_of(node.args[0]).shape[dim]
    return all(statically_known_true(value_of(i) >= length) for i in indices)


def _dtensor_conversion(node: fx.Node, first, seq_dims) -> tuple[str, str | None]:
    """A DTensor made from a local tensor, turned back into one, or redistributed over another mesh (tensor
    parallel): per token unless a placement shards the sequence dim (sequence parallel, which the ring
    replaces)."""
    placements = list(node.kwargs.get("placements") or ())
    placements += [a for arg in node.args if isinstance(arg, (list, tuple)) for a in arg]
    for value in (value_of(first), example_value(node)):
        placements += list(getattr(value, "placements", ()))
    dims = seq_dims(first) if first is not None else set()
    rank = value_of(first).dim() if first is not None else 0
    if any(getattr(p, "dim", None) is not None and p.dim % max(rank, 1) in dims for p in placements):
        return "mixing", (
            "a DTensor placement shards the sequence dim (sequence parallel); the ring shards the "
            "sequence already: keep tensor parallel's activations replicated along it"
        )
    return "token", None


CONTRACTED = {  # the operands a matrix product sums over, and the dim it sums over in each
    "linear": ((0, -1), (1, -1)),
    "matmul": ((0, -1), (1, -2)),
    "mm": ((0, -1), (1, -2)),
    "bmm": ((0, -1), (1, -2)),
    "addmm": ((1, -1), (2, -2)),
    "baddbmm": ((1, -1), (2, -2)),
}


def _contracts_sequence(node: fx.Node, name: str, seq_dims) -> bool:
    """A matrix product that sums over a sequence dim of an operand (``y.mT @ W`` with ``W`` [S, S]): its
    output can keep a sequence axis (W's other dim), so losing one is not enough to tell. ``einsum``: a
    letter of a sequence dim missing from the output."""
    if name == "einsum" and isinstance(node.args[0], str):
        inputs, _, output = node.args[0].replace(" ", "").partition("->")
        tensors = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
        for letters, tensor in zip(inputs.split(","), tensors):
            if (
                isinstance(tensor, fx.Node)
                and "." not in letters
                and any(letters[d] not in output for d in seq_dims(tensor) if d < len(letters))
            ):
                return True
        return False
    for position, dim in CONTRACTED.get(name, ()):
        operand = node.args[position] if position < len(node.args) else None
        value = value_of(operand) if isinstance(operand, fx.Node) else None
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            contracted = (dim if value.dim() >= 2 else -1) % value.dim()
            if contracted in seq_dims(operand):
                return True
    return False


def _custom_function(node: fx.Node) -> tuple[str, str | None]:
    """A custom autograd Function (Dynamo's ``autograd_function_apply``) acts per token when every op of its
    forward does: pointwise or rearranging ops (its backward is the Function's own, computed per token too)."""
    for op in custom_forward(node).graph.nodes:
        if op.op not in ("call_function", "call_method"):
            continue
        name = op_name(op)
        if not (name in REARRANGE or is_pointwise_name(name) or name == "_set_grad_enabled"):
            return "mixing", f"a custom autograd Function runs `{name}`, not known to act on each token separately"
    return "token", None


def custom_forward(node: fx.Node) -> fx.GraphModule:
    """The forward body of an ``autograd_function_apply`` node."""
    return getattr(node.graph.owning_module, node.args[0].target)


def _getitem(node: fx.Node, seq_dims, output_has_seq: bool) -> tuple[str, str | None]:
    """Per token; a "pick" of a few tokens at fixed positions (``x[:, 0]``, ``x[:, -4:]``: the owning ranks'
    rows reach every rank, see `pick_index`); or token mixing."""
    source, index = node.args
    if not isinstance(value_of(source), torch.Tensor):
        return "token", None  # an item of a tuple
    index = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, fx.Node) and seq_dims(i) for i in index):
        if not seq_dims(source):
            return "token", None  # a table (a parameter) looked up with per-token ids: an embedding
        return "mixing", "indexing with a tensor picks tokens"  # which tokens depends on per-token data
    if not output_has_seq and positions_index(node, seq_dims) is not None:
        return "pick", None  # x[arange(B), last_non_padding]: a few tokens at positions given as data
    addressed = {d: i for d, i in zip(index_dims(index, value_of(source).dim()), index) if d is not None}
    for d in seq_dims(source):  # (``x[:, -N:]`` takes every token: OLMo-Hybrid cuts its convolution's tail so)
        if d in addressed and not takes_every_element(addressed[d], value_of(source).shape[d]):
            if not output_has_seq and pick_index(node, seq_dims) is not None:
                return "pick", None
            picks = isinstance(addressed[d], (fx.Node, torch.Tensor, list))
            return "mixing", "indexing with a tensor picks tokens" if picks else "it picks or slices tokens"
    return "token", None  # a list or tensor index along another dim (heads, features) stays per token


def _setitem(node: fx.Node, seq_dims) -> tuple[str, str | None]:
    """``x[index] = y`` writes into every token alike where ``index`` takes every element of ``x``'s sequence dims
    (``out[:, :, i] = y``: a chunk of each token's features) and holds no per-token tensor."""
    target, index = node.args[0], node.args[1]
    index = index if isinstance(index, tuple) else (index,)
    addressed = dict(zip(index_dims(index, value_of(target).dim()), index))
    picks = any(d in addressed and not takes_every_element(addressed[d]) for d in seq_dims(target))
    if picks or any(isinstance(i, fx.Node) and seq_dims(i) for i in index):
        return "mixing", "it writes into some tokens only"
    return "token", None


def pick_index(node: fx.Node, seq_dims) -> tuple[int, object] | None:
    """(sequence dim, its int or slice index) when ``node`` indexes one sequence dim of its source with a
    constant and keeps every other dim whole, else None."""
    source, index = node.args
    index = index if isinstance(index, tuple) else (index,)
    if any(i is None for i in index):
        return None
    entries = [(d, i) for d, i in zip(index_dims(index, value_of(source).dim()), index) if d is not None]
    picked = [(d, i) for d, i in entries if not takes_every_element(i)]
    if len(picked) != 1 or picked[0][0] not in seq_dims(source) or not isinstance(picked[0][1], (int, slice)):
        return None
    d, i = picked[0]
    if isinstance(i, slice) and not all(isinstance(b, (int, type(None))) for b in (i.start, i.stop, i.step)):
        return None
    return d, i


def positions_index(node: fx.Node, seq_dims) -> int | None:
    """Which entry of a pure tensor index (``x[arange(B), last]``, every entry a tensor without a sequence
    axis) addresses the one sequence dim of the source, else None."""
    source, index = node.args
    index = index if isinstance(index, tuple) else (index,)
    if not all(isinstance(i, fx.Node) and isinstance(value_of(i), torch.Tensor) and not seq_dims(i) for i in index):
        return None
    if any(value_of(i).dtype in (torch.bool, torch.uint8) for i in index):
        return None  # a boolean mask selects a data-dependent number of rows
    addressed = [d for d in range(len(index)) if d in seq_dims(source)]
    return addressed[0] if len(addressed) == 1 and len(seq_dims(source)) == 1 else None


def index_dims(index: tuple, rank: int) -> list[int | None]:
    """The source dim each entry of a getitem index addresses; None for an entry that addresses none (``None`` and
    ``True``/``False`` add a dim, ``...`` stands for the dims no other entry addresses)."""
    addressing = sum(1 for i in index if not _addresses_no_dim(i))
    dims, d = [], 0
    for i in index:
        if _addresses_no_dim(i):
            dims.append(None)
            d += rank - addressing if i is Ellipsis else 0
        else:
            dims.append(d)
            d += 1
    return dims


def _addresses_no_dim(item) -> bool:
    return item is None or item is Ellipsis or item is True or item is False


def whole_slices_spelled(index, shape, axes) -> object:
    """A getitem's ``index`` into a tensor of ``shape`` whose sequence ``axes`` (its `SeqDim` list) are given, with each
    slice that takes a whole sequence dim at that length (``x[:, -N:]``, ``x[..., :N]``) spelled ``:``, which takes it
    at any length (a shard's, a probe's)."""
    seq_dims = {axis.dim for axis in axes if axis.aligned and axis.inner == 1}
    items = index if isinstance(index, tuple) else (index,)
    dims = [None] * len(items) if any(isinstance(i, fx.Node) for i in items) else index_dims(items, len(shape))
    spelled = tuple(
        slice(None) if dims[i] in seq_dims and takes_every_element(item, shape[dims[i]]) else item
        for i, item in enumerate(items)
    )
    return spelled if isinstance(index, tuple) else spelled[0]


def takes_every_element(item, length=None) -> bool:
    """A slice that takes every element in order: ``:``, ``0:``, ``::1``; and, given the dim's ``length``, also
    ``-length:`` and ``:length``."""
    if not isinstance(item, slice) or item.step not in (None, 1):
        return False
    start, stop = value_of(item.start), value_of(item.stop)
    if length is None:
        return start in (None, 0) and stop is None
    return (start is None or same(start, 0) or same(start, -length)) and (stop is None or same(stop, length))


def _dims(node: fx.Node, name: str, first: fx.Node | None) -> set | None:
    position = DIM_POSITION.get(name, 1)
    dim = node.kwargs.get("dim", node.args[position] if len(node.args) > position else None)
    if name == "norm" and "dim" not in node.kwargs and len(node.args) == 2:
        dim = None  # x.norm(p)
    if dim is None or first is None:
        return None
    rank = value_of(first).dim()
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    if not all(isinstance(d, int) for d in dims):
        return None
    return {d % rank for d in dims}


def _only_one_nonempty(tensors) -> bool:
    return sum(not same(value_of(t).numel(), 0) for t in tensors) == 1


def _tensor_args(node: fx.Node):
    args = list(node.args)
    if args and isinstance(args[0], (list, tuple)):
        args = list(args[0]) + args[1:]
    return [a for a in args if isinstance(a, fx.Node) and isinstance(value_of(a), torch.Tensor)]
