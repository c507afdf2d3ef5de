"""The implicit gather: eager code that needs a `SequenceSharded` value's whole sequence gets it, checked.

``logits.numpy()``, ``logits.flip(1)``, ``torch.save(logits, f)`` or an op with no rule of its own needs every
token on every rank. `gather_whole` all-gathers it, as `SequenceSharded.full_tensor` does, but a user did not
write that collective, so the ranks first `meet` at the user's line (the first frame outside torch and ringpass):

- every rank runs the line (SPMD code, the normal case): the gather runs, and `ImplicitGatherWarning` says once
  per line and op what was gathered and how many bytes;
- one rank runs it alone (``if rank == 0: print(logits.tolist())``): that rank raises `NeedsWholeSequence`
  naming the op and the line within seconds (as soon as a peer is seen at a later ring call or at another line,
  else after the group's timeout), and the peers never notice: no hang, no failure posted to them.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import sysconfig
import warnings

import torch

from lowering.errors import InvalidInputError, NotSupportedError, RingpassWarning
from lowering.failures import Unmet, meet
from lowering.sequence_ops import gather_sequence


class NeedsWholeSequence(NotSupportedError):
    """An op on a `SequenceSharded` value that needs the whole sequence, which this rank could not gather."""


class ImplicitGatherWarning(RingpassWarning):
    """Eager code on a `SequenceSharded` value made ringpass all-gather the whole sequence."""


_warned: set[tuple[str, str]] = set()


@functools.cache
def _not_users() -> tuple[str, ...]:
    """The folders of torch, ringpass, lowering and Python's own library."""
    packages = [importlib.util.find_spec(name) for name in ("torch", "ringpass", "lowering")]
    folders = [os.path.dirname(os.path.abspath(p.origin)) for p in packages if p is not None and p.origin]
    return tuple(f + os.sep for f in (*folders, sysconfig.get_paths()["stdlib"]))


def user_site() -> tuple[str, int]:
    """The file and line of the innermost frame outside torch, ringpass and Python's own library."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_not_users()) and not frame.f_code.co_filename.startswith("<frozen"):
            return path, frame.f_lineno
        frame = frame.f_back
    return "<unknown>", 0


def gather_whole(carriers, what: str) -> list[torch.Tensor]:
    """Each of ``carriers`` (`SequenceSharded` values of one process group) whole, in the original token order: a
    checked all-gather, see the module docstring. ``what``: the op, for the warning and the error."""
    groups = {c.spec.group_name for c in carriers}
    if len(groups) != 1:
        raise InvalidInputError(f"{what}: its sequence-sharded operands come from different process groups {groups}.")
    (group_name,) = groups
    path, line = user_site()
    site = f"{path}:{line}"
    if group_name:
        try:
            meet(group_name, "gather", site)
        except Unmet as unmet:
            raise NeedsWholeSequence(
                f"{what} at {site} needs the whole sequence of a SequenceSharded value: an all-gather that every "
                f"rank of the ring must run at this line, but not every rank does ({unmet}). Call .full_tensor() on "
                "every rank and use the whole tensor where you need it (e.g. `whole = logits.full_tensor()` on every "
                "rank, then `if rank == 0: print(whole.tolist())`)."
            ) from None
    wholes = [whole_of(c._local, c.spec) for c in carriers]
    if group_name and (site, what) not in _warned:
        _warned.add((site, what))
        size = sum(w.numel() * w.element_size() for w in wholes)
        warnings.warn_explicit(
            f"ringpass: {what} on a SequenceSharded value all-gathered the whole sequence ({size} bytes per rank). "
            "Every rank ran this line, as it must. Call .full_tensor() on every rank to gather on purpose (no "
            "warning), or keep this work inside the compiled model, where it stays sharded.",
            ImplicitGatherWarning,
            path,
            line,
        )
    return wholes


def whole_of(local: torch.Tensor, s) -> torch.Tensor:
    """The whole value of which ``local`` holds this rank's tokens as `SequenceSpec` ``s`` says: an all-gather."""
    if s.rows > 1:
        local = local.unflatten(s.dim, (s.rows, -1))
    whole = gather_sequence(local, s.dim + (s.rows > 1), *s.layout_args(), **s.layout_kwargs())
    return whole.flatten(s.dim, s.dim + 1) if s.rows > 1 else whole
