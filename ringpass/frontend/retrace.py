"""Have Dynamo trace a frame again with the sharded inputs' sequence dims symbolic.

The compile protocol (`ringpass.frontend.rewrite`) that meets `StaticShardedLengths` (``inputs="sharded"`` under static
shapes: every read of the length was folded into this rank's number) calls `request_retrace`: it marks each sharded
input's sequence dims dynamic (``torch._dynamo.maybe_mark_dynamic`` on the tensor Dynamo traced) and returns the
exception that makes Dynamo trace the frame again from its start (``TensorifyScalarRestartAnalysis``, the restart Dynamo
lets a backend ask for). The new trace sees the length as a symbol and every read of it as graph arithmetic, which
`globalize_sharded_lengths` maps to the whole sequence's length. Only those dims become dynamic (batch, hidden sizes
stay static), whatever ``dynamic=`` says, and one compile then serves every length, as with ``mark_dynamic``.

The marks are the front end's, not the user's: `release_marks` removes them once the next graph arrives
(Dynamo has read them by then, and the compiled code's guards do not ask for them).
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from lowering import compat
from ringpass.fx.nodes import user_name
from ringpass.passes.sharded_lengths import StaticShardedLengths

_added = WeakIdKeyDictionary()  # tensor -> (the dims marked here, whether it had a marking of its own)


def request_retrace(error: StaticShardedLengths) -> BaseException | None:
    """The exception to raise so that Dynamo traces the frame again with ``error.inputs``' sequence dims
    dynamic, or None where that cannot help (an input that is not a tensor Dynamo holds, or one whose dims are
    marked dynamic already: its length came back a number all the same); ``error`` then says what to do."""
    found = []
    for node, dims in error.inputs:
        try:
            tensor = node.meta["grapharg"].example
        except (KeyError, AttributeError, AssertionError):
            return None
        if not isinstance(tensor, torch.Tensor):
            return None
        if compat.dynamic_dims(tensor) & set(dims):
            error.args = (
                f"With inputs='sharded' the sequence dims of `{user_name(node)}` are marked dynamic, "
                f"yet Dynamo traced its length as the number {tuple(tensor.shape)[dims[0]]} "
                "(Dynamo fixes sizes 0 and 1), so every read of it "
                "in the model's code is this rank's length, which the ring cannot correct to the whole sequence's. "
                "Pass full inputs (inputs='full'), or shards of at least 2 tokens.",
            )
            return None
        found.append((tensor, dims))
    for tensor, dims in found:
        added, had_marking = _added.get(tensor, (set(), compat.has_dim_marking(tensor)))
        fresh = set(dims) - compat.weakly_dynamic_dims(tensor)
        compat.maybe_mark_dynamic(tensor, list(dims))
        _added[tensor] = (added | fresh, had_marking)
    return compat.TensorifyScalarRestartAnalysis(
        restart_reason="ringpass: inputs='sharded' traced again with the sequence dims dynamic"
    )


def release_marks() -> None:
    """Removes the marks `request_retrace` added (the user's own stay)."""
    for tensor, (added, had_marking) in list(_added.items()):
        compat.unmark_weakly_dynamic(tensor, added, had_marking)
    _added.clear()
