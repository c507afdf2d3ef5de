"""Have Dynamo trace a frame again with some input dims symbolic, or with some static.

Dynamic (`request_retrace`): the compile protocol (`ringpass.frontend.rewrite`) that meets `StaticShardedLengths`
(``inputs="sharded"`` under static shapes: every read of the length was folded into this rank's number) marks each
sharded input's sequence dims dynamic (``torch._dynamo.maybe_mark_dynamic`` on the tensor Dynamo traced) and returns the
exception that makes Dynamo trace the frame again from its start (``TensorifyScalarRestartAnalysis``, the restart Dynamo
lets a backend ask for). The new trace sees the length as a symbol and every read of it as graph arithmetic, which
`globalize_sharded_lengths` maps to the whole sequence's length. Only those dims become dynamic (batch, hidden sizes
stay static), whatever ``dynamic=`` says, and one compile then serves every length, as with ``mark_dynamic``.

Static (`request_static_retrace`): the protocol that meets `NeedsStaticShapes` (dynamic shapes, ``inputs="full"``,
and a part of the graph that runs at its traced sizes only: a chunked scan whose loop over its chunks Dynamo unrolled,
a call computed whole) marks every symbolic dim of the graph's inputs static (``torch._dynamo.mark_static``) and
restarts the same way: the frame is traced again at this call's sizes, as with ``dynamic=False``, and a call at
another length compiles again (Dynamo's guards; ``torch._dynamo.config.recompile_limit`` counts these compiles).
The graph's report says so (`take_retrace_note`).

The marks are the front end's, not the user's: `release_marks` removes them once the next graph arrives
(Dynamo has read them by then, and the compiled code's guards do not ask for them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils.weak import WeakIdKeyDictionary

from lowering import compat
from ringpass.fx.nodes import user_name
from ringpass.fx.static_shapes import NeedsStaticShapes
from ringpass.passes.sharded_lengths import StaticShardedLengths

_added = WeakIdKeyDictionary()  # tensor -> _Marks: what a retrace changed, put back by `release_marks`
_notes: list[str] = []  # what the next graph's report says of the retrace that made it


def request_retrace(error: StaticShardedLengths) -> BaseException | None:
    """The exception to raise so that Dynamo traces the frame again with ``error.inputs``' sequence dims
    dynamic, or None where that cannot help (an input that is not a tensor Dynamo holds, or one whose dims are
    marked dynamic already: its length came back a number all the same); ``error`` then says what to do."""
    found = _traced_tensors(error.inputs)
    if found is None:
        return None
    for (node, dims), tensor in zip(error.inputs, found):
        if compat.dynamic_dims(tensor) & set(dims):
            error.args = (
                f"With inputs='sharded' the sequence dims of `{user_name(node)}` are marked dynamic, "
                f"yet Dynamo traced its length as the number {tuple(tensor.shape)[dims[0]]} "
                "(Dynamo fixes sizes 0 and 1), so every read of it "
                "in the model's code is this rank's length, which the ring cannot correct to the whole sequence's. "
                "Pass full inputs (inputs='full'), or shards of at least 2 tokens.",
            )
            return None
    for (_, dims), tensor in zip(error.inputs, found):
        _mark(tensor, compat.WEAKLY_DYNAMIC, dims, compat.maybe_mark_dynamic)
    return compat.TensorifyScalarRestartAnalysis(
        restart_reason="ringpass: inputs='sharded' traced again with the sequence dims dynamic"
    )


def request_static_retrace(error: NeedsStaticShapes) -> BaseException | None:
    """The exception to raise so that Dynamo traces the frame again with ``error.inputs``' symbolic dims static, or
    None where that cannot help (an input that is not a tensor Dynamo holds, or a dim the user marked dynamic, which
    wins over a static mark); ``error`` then says what to do."""
    found = _traced_tensors(error.inputs)
    if found is None:
        return None
    for (node, dims), tensor in zip(error.inputs, found):
        marked = set(getattr(tensor, compat.DYNAMIC, ())) | set(getattr(tensor, compat.UNBACKED, ()))
        held = set(dims) & (marked | set(getattr(tensor, compat.STATIC, ())))  # static: traced again, still symbolic
        if held:
            error.args = (
                f"{error}\nDynamo keeps dims {sorted(held)} of `{user_name(node)}` symbolic"
                + (" (marked dynamic: mark_dynamic or mark_unbacked)" if held & marked else "")
                + ", so ringpass cannot have it traced again with static shapes: compile with dynamic=False"
                + (" and take the mark off." if held & marked else "."),
            )
            return None
    for (_, dims), tensor in zip(error.inputs, found):
        for hint in (compat.WEAKLY_DYNAMIC, compat.PROPAGATED):  # hints (maybe_mark_dynamic's, a carried value's):
            _take(tensor, hint, dims)  # they would win over the static mark
        _mark(tensor, compat.STATIC, dims, compat.mark_static)
    _notes.append(
        f"traced again with static shapes: {error.why}; a call at another length compiles again "
        "(torch._dynamo.config.recompile_limit counts these compiles)"
    )
    return compat.TensorifyScalarRestartAnalysis(restart_reason=f"ringpass: static shapes, as {error.why}")


def take_retrace_note() -> str | None:
    """What the graph that arrives after a static retrace says of it in its report (once), or None."""
    return _notes.pop() if _notes else None


def release_marks() -> None:
    """Takes back what `request_retrace` and `request_static_retrace` changed: the marks they added go, the hints
    they took off come back (the user's own marks stay as they were)."""
    for tensor, marks in list(_added.items()):
        for mark, dims in marks.added.items():
            compat.unmark(tensor, mark, dims, marks.had_marking)
        for mark, dims in marks.taken.items():
            compat.remark(tensor, mark, dims)
    _added.clear()
    _notes.clear()


def _traced_tensors(inputs: list) -> list | None:
    """The tensor Dynamo traced for each placeholder of ``inputs`` [(placeholder, dims)], or None if one is not a
    tensor Dynamo holds."""
    found = []
    for node, _ in inputs:
        try:
            tensor = node.meta["grapharg"].example
        except (KeyError, AttributeError, AssertionError):
            return None
        if not isinstance(tensor, torch.Tensor):
            return None
        found.append(tensor)
    return found


@dataclass
class _Marks:
    """What a retrace changed on one tensor: the dims it marked (by mark) and took off, and whether the tensor had
    a marking of its own before."""

    had_marking: bool
    added: dict = field(default_factory=dict)
    taken: dict = field(default_factory=dict)


def _marks(tensor) -> _Marks:
    if tensor not in _added:
        _added[tensor] = _Marks(compat.has_dim_marking(tensor))
    return _added[tensor]


def _mark(tensor, mark: str, dims, marker) -> None:
    """``marker(tensor, dims)``, remembering which of the dims were not marked so before (`release_marks`)."""
    marks = _marks(tensor)
    fresh = set(dims) - set(getattr(tensor, mark, ()))
    marker(tensor, list(dims))
    marks.added[mark] = marks.added.get(mark, set()) | fresh


def _take(tensor, mark: str, dims) -> None:
    """Takes ``mark``'s ``dims`` off ``tensor``, remembering which it had (`release_marks` puts them back)."""
    taken = set(dims) & set(getattr(tensor, mark, ()))
    if taken:
        marks = _marks(tensor)
        compat.unmark(tensor, mark, taken, had_marking=True)
        marks.taken[mark] = marks.taken.get(mark, set()) | taken
