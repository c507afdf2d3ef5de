"""Opt-in recording of what the ring does: KV exchanges and block-kernel calls.

    with lowering.record_ring_events() as events:
        out = lowering.ring_attention(q, k, v, layout=layout)
    exchanges = [e for e in events if e.kind == "exchange"]

Nothing is recorded (and nothing costs anything) outside the context manager. Tests use it to count
communication and kernel calls (and, with ``on_event``, to inject failures at a given step); tools use
it to show a schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

_recorders: list[tuple[list[RingEvent], Callable | None]] = []


@dataclass(frozen=True)
class RingEvent:
    """``kind`` is ``"exchange"`` (fields: payload, step, phase, bytes) or ``"block_forward"`` /
    ``"block_backward"`` (fields: q_pos, kv_pos, causal) or ``"span"`` (a ring step's post, compute or wait:
    phase, step, part, message, start, seconds; see `lowering.ring`) or ``"all_reduce"`` (a sum over the
    ring's ranks: a partial total in the forward, a gradient in the backward; fields: bytes, shape) or
    ``"heads_exchange"`` (Ulysses' all-to-all over heads; fields: direction, bytes) or one of the
    decode events (``decode_merge``, ``cache_gather``) and mask / bias tile events."""

    kind: str
    fields: dict[str, Any] = field(default_factory=dict)


def recording() -> bool:
    return bool(_recorders)


def emit(kind: str, **fields: Any) -> None:
    event = RingEvent(kind, fields)
    for events, on_event in list(_recorders):
        events.append(event)
        if on_event is not None:
            on_event(event)


@contextmanager
def record_ring_events(on_event: Callable[[RingEvent], None] | None = None) -> Iterator[list[RingEvent]]:
    """The events of the block, in order; ``on_event(event)`` is also called as each happens."""
    events: list[RingEvent] = []
    entry = (events, on_event)
    _recorders.append(entry)
    try:
        yield events
    finally:  # by identity: two recorders nested from the start hold equal lists
        del _recorders[next(i for i, recorder in enumerate(_recorders) if recorder is entry)]


def scored_pairs(events: list[RingEvent]) -> int:
    """The (query, key) pairs the forward's kernel calls among ``events`` scored: a causal call its triangle, any
    other its whole tile (a masked call scores every pair, hidden ones too)."""
    blocks = [e.fields for e in events if e.kind == "block_forward"]
    return sum(
        len(b["q_pos"]) * (len(b["q_pos"]) + 1) // 2 if b["causal"] else len(b["q_pos"]) * len(b["kv_pos"])
        for b in blocks
    )
