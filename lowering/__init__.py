"""lowering: the runtime side of ringpass.

Exact attention over a sequence sharded across processes (`ring_attention`), decode steps against a KV
cache that stays sharded (`decode_attention`; the cache's slots: `lowering.sharded_cache`), Ulysses x ring
(`ulysses_attention`: all-to-all over heads inside groups, the ring across them), causal convolutions and cumulative
sums along a sharded sequence (`sharded_conv1d`, `sharded_cumsum`: each chunk gets the state before it), chunked scans
passed the state before each chunk (`sharded_scan`, with `lowering.state_passing`'s `gated_delta_rule` or `ssd`), the
layouts that say which tokens each rank holds (`Layout`; `DocumentLayout` balances a row packed from documents), a
one-process simulation of the ring (`simulate_ring`), and opt-in event recording (`record_ring_events`). Usable on its
own by anyone who shards by hand.
"""

from lowering.decode import decode_attention
from lowering.documents import DocumentLayout
from lowering.errors import InvalidInputError, NotSupportedError, RingpassError
from lowering.events import RingEvent, record_ring_events
from lowering.layout import Layout
from lowering.op import ring_attention
from lowering.schedule import BlockTask, plan_block, schedule_table
from lowering.sequence_mixers import sharded_conv1d, sharded_cumsum
from lowering.sharded_cache import append_slots, decode_over_slots, prompt_slots, whole_cache
from lowering.simulate import SimulatedRing, simulate_ring
from lowering.state_passing import sharded_scan
from lowering.ulysses import ulysses_attention

__all__ = [
    "BlockTask",
    "DocumentLayout",
    "InvalidInputError",
    "Layout",
    "NotSupportedError",
    "RingEvent",
    "RingpassError",
    "append_slots",
    "SimulatedRing",
    "decode_attention",
    "decode_over_slots",
    "plan_block",
    "prompt_slots",
    "record_ring_events",
    "ring_attention",
    "schedule_table",
    "sharded_conv1d",
    "sharded_cumsum",
    "sharded_scan",
    "simulate_ring",
    "ulysses_attention",
    "whole_cache",
]
