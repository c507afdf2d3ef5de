"""Process groups: the one place that turns what a user or a graph passes into a `ProcessGroup`.

Users pass a group, a group's name, a `DeviceMesh` (1-D, or 2-D for ring x Ulysses) or ``None`` (the default
group); compiled graphs carry the group by name, ``""`` standing for one process with no process group.
"""

from __future__ import annotations

import torch.distributed as dist

from lowering import compat
from lowering.errors import InvalidInputError


def resolve_group(group):
    """The process group of the whole sequence: ``group`` itself, the default group for None, or a DeviceMesh's
    (a 2-D mesh's dimensions flattened: ring x Ulysses); None when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if group is None:
        return dist.group.WORLD
    if isinstance(group, str):
        return group_by_name(group)
    if hasattr(group, "get_group"):  # a DeviceMesh
        if group.ndim == 2:
            return compat.flattened_mesh(group).get_group()
        if group.ndim != 1:
            raise InvalidInputError(
                f"group: pass one dimension of the DeviceMesh (mesh['cp']), or two (mesh['cp', 'sp']: "
                f"the ring, then Ulysses), not a {group.ndim}-D mesh."
            )
        return group.get_group()
    return group


def group_by_name(group_name: str):
    """The process group a compiled graph names; None for "" (one process, no process group)."""
    if not group_name:
        return None
    return compat.resolve_process_group(group_name)


def world_of(group_name: str) -> tuple[int, int, dist.ProcessGroup | None]:
    """(world size, this rank, the group) of the process group named ``group_name``; "" is one process alone."""
    group = group_by_name(group_name)
    if group is None:
        return 1, 0, None
    return dist.get_world_size(group), dist.get_rank(group), group


def rank_in(group_name: str) -> int:
    """This rank in the process group named ``group_name`` (0 for "": one process alone)."""
    return world_of(group_name)[1]


def checked_group(group, world_size: int):
    """``group`` resolved (`resolve_group`) for a ring over ``world_size`` ranks, after checking that this rank
    is a member and the sizes match; None for one process with no process group (a ring of one)."""
    resolved = resolve_group(group)
    if resolved is None:
        if group is not None:
            raise InvalidInputError(
                "A process group was passed but torch.distributed is not initialised; call init_process_group first."
            )
        if world_size != 1:
            raise InvalidInputError(
                f"The layout spans {world_size} ranks but no process group is initialised; "
                "call torch.distributed.init_process_group (e.g. under torchrun) first."
            )
        return None
    if dist.get_rank(resolved) < 0:
        raise InvalidInputError(
            f"This rank ({dist.get_rank()}) is not a member of the process group passed as `group`."
        )
    size = dist.get_world_size(resolved)
    if size != world_size:
        raise InvalidInputError(
            f"The layout is for {world_size} ranks but the process group has {size}; "
            f"build it as Layout(kind, world_size={size}, seq_len=...)."
        )
    return resolved
