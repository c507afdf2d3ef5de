"""Opt-in recording of what the ring does: KV exchanges and block-kernel calls.

    with lowering.record_ring_events() as events:
        out = lowering.ring_attention(q, k, v, layout=layout)
    exchanges = [e for e in events if e.kind == "exchange"]

Nothing is recorded (and nothing costs anything) outside the context manager. Tests use it to count
communication and kernel calls; tools use it to show a schedule.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

_recorders: list[list["RingEvent"]] = []


@dataclass(frozen=True)
class RingEvent:
    """``kind`` is ``"exchange"`` (fields: payload, step) or ``"block_forward"`` /
    ``"block_backward"`` (fields: q_pos, kv_pos, causal)."""

    kind: str
    fields: dict[str, Any] = field(default_factory=dict)


def recording() -> bool:
    return bool(_recorders)


def emit(kind: str, **fields: Any) -> None:
    for events in _recorders:
        events.append(RingEvent(kind, fields))


@contextmanager
def record_ring_events() -> Iterator[list[RingEvent]]:
    events: list[RingEvent] = []
    _recorders.append(events)
    try:
        yield events
    finally:
        _recorders.remove(events)
