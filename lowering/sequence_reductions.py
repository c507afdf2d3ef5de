"""Reductions over the sequence of a `SequenceSharded` value, combined across the ring.

Each rank reduces its own tokens, its padding slots filled with the reduction's identity (0 for a sum, -inf for a
max, True for `all`), and the partial results are all-reduced: every rank gets the whole result, a plain tensor,
as exact as the op on the whole value (a sum's terms are added in another order). What takes two passes does two:
`var` / `std` all-reduce the mean first and then the squared deviations from it (not the sum of squares, which
cancels), `logsumexp` the maximum first. The combiners, by op or overload (`ACROSS`), take the op, its arguments by name
with this rank's tokens in place of every sequence-sharded operand (`bound`), the value's `SequenceSpec`, the
reduced dimensions (a set that holds the sequence dimension) and ``keepdim``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from lowering.failures import wait_collective
from lowering.groups import group_by_name
from lowering.sequence_ops import all_reduce_sum

aten = torch.ops.aten


def all_reduce(total: torch.Tensor, spec, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """``total`` (this rank's part) combined by ``op`` over the ranks of ``spec``'s group."""
    if op == dist.ReduceOp.SUM:
        return all_reduce_sum(total, spec.group_name)
    total = total.clone()
    work = dist.all_reduce(total, op=op, group=group_by_name(spec.group_name), async_op=True)
    wait_collective(work, total, spec.group_name, f"all-reducing a {tuple(total.shape)} {op} over the sequence")
    return total


def _filled(local: torch.Tensor, spec, fill) -> torch.Tensor:
    """``local`` with ``fill`` at the padding slots."""
    return torch.where(spec.valid(local), local, torch.tensor(fill, dtype=local.dtype, device=local.device))


def _extreme(dtype: torch.dtype, largest: bool):
    if dtype == torch.bool:
        return largest
    if dtype.is_floating_point or dtype.is_complex:
        return math.inf if largest else -math.inf
    info = torch.iinfo(dtype)
    return info.max if largest else info.min


def _count(local: torch.Tensor, spec, dims: set) -> int:
    """How many real elements the reduction over ``dims`` takes per result."""
    return math.prod(spec.rows * spec.seq_len if d == spec.dim else local.size(d) for d in dims)


def _squeezed(total: torch.Tensor, dims: set, keepdim: bool) -> torch.Tensor:
    return total if keepdim else total.squeeze(tuple(sorted(dims)))


def _dtype(bound: dict) -> dict:
    return {"dtype": bound["dtype"]} if bound.get("dtype") is not None else {}


def _sum(func, bound, spec, dims, keepdim):
    local = _filled(bound["self"], spec, 0)
    total = all_reduce(local.sum(tuple(sorted(dims)), keepdim=keepdim, **_dtype(bound)), spec)
    return total / _count(bound["self"], spec, dims) if func.overloadpacket is aten.mean else total


def _nansum(func, bound, spec, dims, keepdim):
    local = _filled(bound["self"], spec, 0)
    return all_reduce(local.nansum(tuple(sorted(dims)), keepdim=keepdim, **_dtype(bound)), spec)


def _extremum(func, bound, spec, dims, keepdim):
    """amax / amin over some dimensions; max / min of everything."""
    largest = func.overloadpacket in (aten.amax, aten.max)
    local = _filled(bound["self"], spec, _extreme(bound["self"].dtype, not largest))
    op = dist.ReduceOp.MAX if largest else dist.ReduceOp.MIN
    if func in (aten.max.default, aten.min.default):
        return all_reduce(func(local), spec, op)
    return all_reduce(func(local, tuple(sorted(dims)), keepdim), spec, op)


def _any_all(func, bound, spec, dims, keepdim):
    """any / all: each rank's answer over its tokens, then the ranks' largest (any) or smallest (all)."""
    anything = func.overloadpacket is aten.any
    local = _filled(bound["self"] != 0, spec, not anything)
    part = local.any(tuple(sorted(dims)), keepdim=keepdim) if anything else local.all(tuple(sorted(dims)), keepdim)
    op = dist.ReduceOp.MAX if anything else dist.ReduceOp.MIN
    answer = all_reduce(part.to(torch.uint8), spec, op)
    return answer if bound["self"].dtype == torch.uint8 else answer.bool()


def _count_nonzero(func, bound, spec, dims, keepdim):
    return all_reduce(_filled(bound["self"], spec, 0).count_nonzero(tuple(sorted(dims))), spec)


def _prod(func, bound, spec, dims, keepdim):
    local = _filled(bound["self"], spec, 1)
    if bound.get("dim") is None:  # prod of everything
        return all_reduce(local.prod(**_dtype(bound)), spec, dist.ReduceOp.PRODUCT)
    return all_reduce(local.prod(bound["dim"], keepdim=keepdim, **_dtype(bound)), spec, dist.ReduceOp.PRODUCT)


def _logsumexp(func, bound, spec, dims, keepdim):
    local = _filled(bound["self"], spec, -math.inf)
    dims_ = tuple(sorted(dims))
    top = all_reduce(local.amax(dims_, keepdim=True), spec, dist.ReduceOp.MAX)
    top = torch.where(top.isfinite(), top, torch.zeros((), dtype=top.dtype))
    total = all_reduce(torch.exp(local - top).sum(dims_, keepdim=True), spec)
    return _squeezed(total.log() + top, dims, keepdim)


def _vector_norm(func, bound, spec, dims, keepdim):
    """linalg_vector_norm of any order: the largest / smallest magnitude (inf / -inf), the count of nonzeros (0),
    else the ranks' sums of ``|x| ** ord`` added, to the power ``1 / ord``."""
    order = float(bound.get("ord", 2))
    local = bound["self"].abs()
    if bound.get("dtype") is not None:
        local = local.to(bound["dtype"])
    dims_ = tuple(sorted(dims))
    if math.isinf(order):
        largest = order > 0
        local = _filled(local, spec, 0.0 if largest else math.inf)
        op = dist.ReduceOp.MAX if largest else dist.ReduceOp.MIN
        return all_reduce(local.amax(dims_, keepdim) if largest else local.amin(dims_, keepdim), spec, op)
    local = _filled(local, spec, 0.0)
    if order == 0:
        return all_reduce((local != 0).sum(dims_, keepdim=keepdim).to(local.dtype), spec)
    return all_reduce(local.pow(order).sum(dims_, keepdim=keepdim), spec).pow(1 / order)


def _moments(func, bound, spec, dims, keepdim):
    """var / std / var_mean / std_mean: the mean all-reduced first, then the squared deviations from it."""
    local, dims_ = bound["self"], tuple(sorted(dims))
    correction = bound.get("correction")
    if correction is None:
        correction = 1 if bound.get("unbiased", True) else 0
    count = _count(local, spec, dims)
    mean = all_reduce(_filled(local, spec, 0).sum(dims_, keepdim=True), spec) / count
    deviation = _filled(local - mean, spec, 0).abs()
    variance = all_reduce(deviation.mul(deviation).sum(dims_, keepdim=True), spec) / max(count - correction, 0)
    packet = func.overloadpacket
    spread = variance.sqrt() if packet in (aten.std, aten.std_mean) else variance
    if packet in (aten.var_mean, aten.std_mean):
        return _squeezed(spread, dims, keepdim), _squeezed(mean, dims, keepdim)
    return _squeezed(spread, dims, keepdim)


def _allclose(func, bound, spec, dims, keepdim) -> bool:
    close = torch.isclose(
        bound["self"],
        bound["other"],
        rtol=bound.get("rtol", 1e-5),
        atol=bound.get("atol", 1e-8),
        equal_nan=bound.get("equal_nan", False),
    )
    return bool(all_reduce(_filled(close, spec, True).all().to(torch.uint8), spec, dist.ReduceOp.MIN))


def _equal(func, bound, spec, dims, keepdim) -> bool:
    a, b = bound["self"], bound["other"]
    if a.shape != b.shape:
        return False
    same = _filled(a == b, spec, True).all()
    return bool(all_reduce(same.to(torch.uint8), spec, dist.ReduceOp.MIN))


def _pointwise_loss(func, bound, spec, dims, keepdim):
    """mse / smooth-l1 / huber / soft-margin / binary cross-entropy with a sum or mean: each token's loss
    (padding left out) summed over the ranks, the mean over the whole value's elements."""
    reduction = bound.get("reduction", 1)
    losses = func(**{**bound, "reduction": 0})
    total = all_reduce(_filled(losses, spec, 0).sum(), spec)
    return total / _count(losses, spec, set(range(losses.dim()))) if reduction == 1 else total


POINTWISE_LOSSES = (
    aten.mse_loss,
    aten.smooth_l1_loss,
    aten.huber_loss,
    aten.soft_margin_loss,
    aten.binary_cross_entropy,
    aten.binary_cross_entropy_with_logits,
)

ACROSS = {
    **dict.fromkeys((aten.sum, aten.mean), _sum),
    aten.nansum: _nansum,
    **dict.fromkeys((aten.amax, aten.amin, aten.max.default, aten.min.default), _extremum),  # max.dim: an index
    **dict.fromkeys((aten.any, aten.all), _any_all),
    aten.count_nonzero: _count_nonzero,
    aten.prod: _prod,
    aten.logsumexp: _logsumexp,
    aten.linalg_vector_norm: _vector_norm,
    **dict.fromkeys((aten.var, aten.std, aten.var_mean, aten.std_mean), _moments),
    aten.allclose: _allclose,
    aten.equal.default: _equal,  # tagged pointwise: by overload, as the ops' rules look them up first
    **dict.fromkeys(POINTWISE_LOSSES, _pointwise_loss),
}
