"""Gradients of a mask or bias program's inputs, accumulated tile by tile in the ring's backward.

A score program may read trainable values: a learned table indexed by a function of positions (T5's and
MPNet's relative-position buckets, ``table[bucket(kv_pos - q_pos)]``), learned per-head slopes, or a
materialised mask or bias that a trainable value computed. They train like any weight: for each tile the
backward takes the gradient of the loss with respect to the tile's scores (``ds``, which the block
kernels return with ``score_grads=True``) and pulls it back through the program on the same positions
with autograd, into one accumulator per input. Nothing ``S x S`` is made for a table: the program sees
one tile's positions, and an embedding's backward adds ``ds`` into the table's rows by bucket, per head.

An input the program only reads at the tile's positions (``input.index_select(dim, positions)``, as
lifted programs read per-token vectors and materialised masks) is read as a leaf of the tile's size, and
its gradient is added at those positions: no whole-size temporary per tile. Each rank's accumulators hold
its own queries' share; the graph's usual gradient reduction (``reduce_grads``) sums the shares over the
ring once, on the value that needs it (for a table: the table).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch
import torch.fx as fx

from lowering import compat
from lowering.kernels import accumulation_dtype


class ProgramGrads:
    """The gradients of ``inputs`` (those ``needs`` marks) of ``program(q_pos, kv_pos, *inputs)``."""

    def __init__(self, program: Callable, inputs: Sequence[torch.Tensor], needs: Sequence[bool]):
        self.program, self.inputs, self.needs = program, tuple(inputs), tuple(needs)
        self.grads = [
            torch.zeros_like(x, dtype=accumulation_dtype(x.dtype)) if need else None
            for x, need in zip(self.inputs, self.needs)
        ]

    def add_(self, q_pos: torch.Tensor, kv_pos: torch.Tensor, ds: torch.Tensor) -> None:
        """Add the pull-back of ``ds`` (``[B, Hq, n, m]``: the loss's gradient with respect to the scores at
        these positions) through the program's value on them."""
        with _autograd_on():
            leaves = [x.detach().requires_grad_() if need else x for x, need in zip(self.inputs, self.needs)]
            if isinstance(self.program, fx.GraphModule):
                run = _TileRun(self.program, {id(leaf): i for i, leaf in enumerate(leaves) if self.needs[i]})
                values = run.run(q_pos, kv_pos, *leaves)
                restricted = run.restricted
            else:
                values, restricted = self.program(q_pos, kv_pos, *leaves), []
            if not values.requires_grad:
                return  # the program's value does not depend on a trainable input here (a bool mask)
            grad = ds.sum_to_size((1,) * (4 - values.dim()) + tuple(values.shape)).reshape(values.shape)
            wrt = [leaf for leaf, need in zip(leaves, self.needs) if need] + [leaf for _, _, leaf in restricted]
            found = torch.autograd.grad(values, wrt, grad.to(values.dtype), allow_unused=True)
        whole = iter(found[: len(wrt) - len(restricted)])
        for i, need in enumerate(self.needs):
            g = next(whole) if need else None
            if g is not None:
                self.grads[i].add_(g)
        for (i, chain, _), g in zip(restricted, found[len(wrt) - len(restricted) :]):
            if g is not None:
                self.grads[i].index_put_(_positions_of(chain, g), g.to(self.grads[i].dtype), accumulate=True)

    def result(self) -> list[torch.Tensor]:
        """The gradients of the marked inputs, in their order and dtypes."""
        return [g.to(x.dtype) for x, g in zip(self.inputs, self.grads) if g is not None]


class _TileRun(fx.Interpreter):
    """Runs a lifted program; ``index_select`` on a trainable input (or on its already restricted rows)
    makes a new leaf of the selected values, recorded with the (dim, index) chain that selected it."""

    def __init__(self, program: fx.GraphModule, trainable: dict[int, int]):
        super().__init__(program)
        self.trainable = trainable  # id(leaf) -> input index
        self.chains: dict[int, tuple[int, tuple]] = {}  # id(restricted leaf) -> (input index, chain)
        self.restricted: list[tuple[int, tuple, torch.Tensor]] = []

    def call_method(self, target, args, kwargs):
        source = args[0] if args else None
        found = self._origin(source) if target == "index_select" and not kwargs else None
        if found is None:
            return super().call_method(target, args, kwargs)
        index, chain = found
        dim, positions = args[1] % source.dim(), args[2]
        leaf = source.detach().index_select(dim, positions).requires_grad_()
        chain = chain + ((dim, positions),)
        self.chains[id(leaf)] = (index, chain)
        self.restricted.append((index, chain, leaf))
        return leaf

    def _origin(self, value) -> tuple[int, tuple] | None:
        if not isinstance(value, torch.Tensor):
            return None
        if id(value) in self.trainable:
            return self.trainable[id(value)], ()
        return self.chains.get(id(value))


def _positions_of(chain: tuple, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Index tensors, one per dim of the input, that place ``grad`` (the selected values' gradient) at the
    selected positions: the chain's indices along its dims, every position along the others."""
    selected: dict[int, torch.Tensor] = {}
    for dim, positions in chain:  # a dim selected again picks among the rows selected before
        selected[dim] = selected[dim][positions] if dim in selected else positions
    shape = [1] * grad.dim()
    indices = []
    for dim in range(grad.dim()):
        index = selected[dim] if dim in selected else torch.arange(grad.size(dim), device=grad.device)
        view = list(shape)
        view[dim] = -1
        indices.append(index.to(grad.device).view(view))
    return tuple(indices)


@contextmanager
def _autograd_on():
    """Autograd inside a custom op's kernel (the ring's backward), which the dispatcher runs below autograd:
    its keys are taken out of the thread's excluded set for the duration, and grad mode is on."""
    exclude = compat.dispatch_tls_local_exclude_set()
    for key in ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor", "ADInplaceOrView"):
        exclude = exclude.remove(getattr(compat.DispatchKey, key))
    with compat.ForceDispatchKeyGuard(compat.dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield
