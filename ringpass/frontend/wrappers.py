"""Which data-parallel wrapper reduces a graph's parameter gradients, and what ``grads=`` must then be.

Each rank of the ring computes only its tokens' share of a parameter's gradient. What the ranks' gradients
must be depends on what happens to them after the backward:

- nothing (no wrapper): every rank needs the whole gradient, so the ring all-reduces the shares (``reduced``);
- FSDP2 (``fully_shard``) or DDP *average* the gradients over their ranks (reduce-scatter / all-reduce, then a
  division). If those ranks include the ring's (the wrapper is on the ring's ranks, or on data x ring ranks
  flattened, as torchtitan does), each rank's gradient is its share times P, and the wrapper's mean is the
  unsharded model's gradient on the global batch with no other reduction (``mean``). If the wrapper is on the
  data-parallel ranks only (one rank of each ring), the ring must still reduce its shares (``reduced``);
- a hand-written ``all_reduce(SUM)`` over the ring: the shares as they are (``local``).

`find_wrapper` reads the wrapper from the running job: DDP is the module Dynamo is compiling under
(``DistributedDataParallel._get_active_ddp_module``); FSDP2 owns the graph's parameters (the unsharded
parameters it registered for the forward). `gradient_mode` turns the ``grads`` option into what the
``reduce_grads`` pass does, or refuses a combination that would give wrong gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx

from lowering import compat
from lowering.errors import InvalidInputError, NotSupportedError
from ringpass.frontend.ddp_whole_graph import kept_whole_under_ddp
from ringpass.fx.context import GradientMode


@dataclass(frozen=True)
class Wrapper:
    """A wrapper that averages gradients: ``kind`` ("FSDP2" | "DDP"), the global ``ranks`` it averages over,
    and the number it divides their sum by."""

    kind: str
    ranks: frozenset
    divide_factor: float

    def describe(self) -> str:
        return f"{self.kind} over ranks {_ranks_text(self.ranks)}"


def find_wrapper(gm: fx.GraphModule) -> Wrapper | None:
    """The DDP module being compiled, or the FSDP2 state that owns this graph's parameters; None if neither."""
    ddp = compat.active_ddp_module()
    if ddp is not None:
        _refuse_graph_splitting()
        group = ddp.process_group
        return Wrapper("DDP", frozenset(_global_ranks(group)), float(dist.get_world_size(group)))
    return _fsdp_wrapper(gm)


def gradient_mode(requested: str, wrapper: Wrapper | None, ring_group) -> GradientMode:
    """The ``reduce_grads`` behaviour for ``grads=requested`` under ``wrapper`` with the ring on ``ring_group``."""
    ring = frozenset(_global_ranks(ring_group))
    p = len(ring)
    covers = wrapper is not None and ring <= wrapper.ranks
    if wrapper is not None and not covers and wrapper.ranks & ring != {dist.get_rank()}:
        raise NotSupportedError(
            f"{wrapper.describe()} shares some but not all of the ring's ranks ({_ranks_text(ring)}): its mean of the "
            "gradients mixes shares of one sequence with whole gradients of others. Put the wrapper on the ring's "
            "ranks, on data-parallel ranks only, or on both flattened (mesh['dp', 'cp']._flatten())."
        )
    if covers and requested in ("auto", "mean") and wrapper.divide_factor != len(wrapper.ranks):
        raise NotSupportedError(
            f"{wrapper.describe()} divides the gradients' sum by {wrapper.divide_factor:g}, "
            f"not by its {len(wrapper.ranks)} ranks (set_gradient_divide_factor): "
            "the ring's shares are scaled for a mean. Leave the divide factor at its default, "
            "or pass grads='reduced' (whole gradients on every rank, then the wrapper's reduction)."
        )
    mean_scale = float(p)
    if requested == "auto":
        if covers:
            return GradientMode(
                "mean",
                mean_scale,
                f"mean: {wrapper.describe()} averages the ring's ranks; each rank's "
                f"parameter gradient is its share x {mean_scale:g}, no other reduction",
            )
        if wrapper is not None:
            return GradientMode(
                "reduced",
                why=f"reduced: {wrapper.describe()} averages data-parallel ranks only; "
                "the ring all-reduces its shares first",
            )
        return GradientMode("reduced")
    if requested == "local" and wrapper is not None:
        raise InvalidInputError(
            f"grads='local' leaves each rank its share of the gradient, which sum to it; {wrapper.describe()} "
            f"averages instead, so the gradients would be 1/{p} of the truth. Use grads='auto' (the default), which "
            "scales the shares for the wrapper."
        )
    if requested == "mean" and wrapper is not None and not covers:
        raise InvalidInputError(
            f"grads='mean' makes gradients for a wrapper that averages over the ring's ranks, but {wrapper.describe()} "
            "does not include them: the ring's shares would never be summed. Use grads='auto' (the default)."
        )
    if requested == "mean":
        return GradientMode(
            "mean",
            mean_scale,
            f"mean: each rank's parameter gradient is its share x {mean_scale:g}, for an "
            "outer mean over the ring's ranks",
        )
    why = ""
    if requested == "reduced" and covers:
        why = (
            f"reduced: every full gradient is all-reduced in the backward, then {wrapper.describe()} reduces it "
            "again; grads='auto' (the default) leaves the one reduction to the wrapper"
        )
    return GradientMode(requested, why=why)


def _fsdp_wrapper(gm: fx.GraphModule) -> Wrapper | None:
    """FSDP2's mesh for the graph's parameters: the unsharded parameters its pre-forward hook registered are
    the tensors the graph's parameter inputs were traced from."""
    try:
        states, FSDPState = compat.module_state_mapping, compat.FSDPState
    except ImportError:  # another torch: no detection, the gradients stay exact through grads="reduced"
        return None
    traced = {
        id(example)
        for node in gm.graph.nodes
        if node.op == "placeholder"
        for example in [getattr(node.meta.get("grapharg"), "example", None)]
        if isinstance(example, torch.nn.Parameter)
    }
    for state_ref in list(states.values()):
        state = state_ref()
        group = compat.fsdp_param_group(state) if isinstance(state, FSDPState) else None
        if group is None:
            continue
        if any(id(compat.fsdp_unsharded_param(param)) in traced for param in group.fsdp_params):
            mesh = group.mesh_info.mesh
            ranks = frozenset(int(r) for r in mesh.mesh.flatten().tolist())
            factor = group.gradient_divide_factor
            return Wrapper("FSDP2", ranks, float(len(ranks) if factor is None else factor))
    return None


def _refuse_graph_splitting() -> None:
    if compat.get_optimize_ddp_mode() == "ddp_optimizer" and not kept_whole_under_ddp():
        raise NotSupportedError(
            "The model is compiled under DistributedDataParallel with torch._dynamo.config.optimize_ddp on: Dynamo "
            "cuts the graph at DDP's bucket boundaries and compiles each piece alone, and the ring needs the whole "
            "graph (its activations stay sharded from input to output). Set torch._dynamo.config.optimize_ddp = False "
            "before the first call; DDP then all-reduces each gradient after the backward."
        )


def _global_ranks(group) -> list[int]:
    return dist.get_process_group_ranks(dist.group.WORLD if group is None else group)


def _ranks_text(ranks) -> str:
    ranks = sorted(ranks)
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))
