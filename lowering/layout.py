"""Which global token positions each rank owns, and in which local order.

A `Layout` is the single source of truth for positions: sharding, unsharding, the ring's schedule and
(later) position indices and masks all ask it.

- ``"contiguous"``: the (padded) sequence is cut into P chunks; rank r owns chunk r.
- ``"zigzag"``: the sequence is cut into 2P chunks; rank r owns chunks r and 2P-1-r, in that order, so
  every rank holds one early (cheap) and one late (expensive) chunk and causal work is equal on all ranks.

A length that does not divide by the chunk count is padded at the end of the sequence: every rank has
the same local length, padding slots carry positions >= seq_len, the ring never uses them as keys, and
`unshard` drops them. Local order always increases with global position, and a rank's real (non-padding)
slots always form a prefix of its local slots; the ring's planner relies on both.

`GroupLayout` is the ring's view of the same tokens with Ulysses groups (`lowering.ulysses`), and
`cached_layout` the one place the runtime gets either from plain values (what the custom ops take).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch

from lowering.errors import InvalidInputError

LAYOUT_KINDS = ("contiguous", "zigzag")
DOCUMENTS_KIND = "documents"  # `lowering.documents.DocumentLayout`: planned per call from the documents' lengths


@dataclass(frozen=True)
class Segment:
    """A run of consecutive real positions held in consecutive local slots."""

    local_start: int
    global_start: int
    length: int

    @property
    def global_stop(self) -> int:
        return self.global_start + self.length

    @property
    def local_stop(self) -> int:
        return self.local_start + self.length


@dataclass(frozen=True)
class Layout:
    """How a sequence of ``seq_len`` tokens is split over ``world_size`` ranks."""

    kind: str
    world_size: int
    seq_len: int

    def __post_init__(self):
        if self.kind not in LAYOUT_KINDS:
            raise InvalidInputError(
                f"Unknown layout kind {self.kind!r}; use one of {', '.join(map(repr, LAYOUT_KINDS))}."
            )
        for name in ("world_size", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidInputError(f"Layout {name} must be a positive int, got {value!r}.")

    @property
    def num_chunks(self) -> int:
        return self.world_size * (2 if self.kind == "zigzag" else 1)

    @property
    def chunk_len(self) -> int:
        return -(-self.seq_len // self.num_chunks)

    @property
    def padded_len(self) -> int:
        return self.chunk_len * self.num_chunks

    @property
    def local_len(self) -> int:
        """Slots per rank (the same on every rank, padding included)."""
        return local_length(self.kind, self.world_size, self.seq_len)

    def chunks(self, rank: int) -> tuple[int, ...]:
        """The global chunk indices rank ``rank`` holds, in local order."""
        self._check_rank(rank)
        if self.kind == "zigzag":
            return (rank, 2 * self.world_size - 1 - rank)
        return (rank,)

    def positions(self, rank: int) -> torch.Tensor:
        """int64 global positions of the rank's local slots, in local order (padding: >= seq_len)."""
        self._check_rank(rank)
        return self._positions[rank].clone()

    def segments(self, rank: int) -> tuple[Segment, ...]:
        """The rank's real (non-padding) slots as runs of consecutive positions, in local order."""
        segments = []
        for i, chunk in enumerate(self.chunks(rank)):
            start = chunk * self.chunk_len
            length = min(self.chunk_len, self.seq_len - start)
            if length > 0:
                segments.append(Segment(i * self.chunk_len, start, length))
        return tuple(segments)

    def valid_len(self, rank: int) -> int:
        """How many of the rank's local slots hold real tokens (they are its first slots)."""
        return sum(s.length for s in self.segments(rank))

    def shard(self, x: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        """The rank's shard of a full tensor: its chunks of ``x`` along ``dim``, zero-padded."""
        dim = self._check_full(x, dim)
        padded = self._pad(x, dim)
        parts = [padded.narrow(dim, c * self.chunk_len, self.chunk_len) for c in self.chunks(rank)]
        return torch.cat(parts, dim) if len(parts) > 1 else parts[0].clone()

    def unshard(self, shards: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
        """Inverse of sharding every rank: the full tensor in global order, padding dropped."""
        if len(shards) != self.world_size:
            raise InvalidInputError(f"unshard needs one shard per rank ({self.world_size}), got {len(shards)}.")
        dim = _check_dim(dim, shards[0].dim())
        for rank, shard in enumerate(shards):
            if shard.size(dim) != self.local_len:
                raise InvalidInputError(
                    f"Shard of rank {rank} has {shard.size(dim)} slots along dim {dim}; "
                    f"this layout gives every rank {self.local_len}."
                )
        by_chunk = {}
        for rank, shard in enumerate(shards):
            for i, chunk in enumerate(self.chunks(rank)):
                by_chunk[chunk] = shard.narrow(dim, i * self.chunk_len, self.chunk_len)
        full = torch.cat([by_chunk[c] for c in range(self.num_chunks)], dim)
        return full.narrow(dim, 0, self.seq_len)

    @cached_property
    def _positions(self) -> tuple[torch.Tensor, ...]:
        return tuple(
            torch.cat([torch.arange(c * self.chunk_len, (c + 1) * self.chunk_len) for c in self.chunks(r)])
            for r in range(self.world_size)
        )

    def _pad(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        missing = self.padded_len - self.seq_len
        if missing == 0:
            return x
        shape = list(x.shape)
        shape[dim] = missing
        return torch.cat([x, x.new_zeros(shape)], dim)

    def _check_full(self, x: torch.Tensor, dim: int) -> int:
        dim = _check_dim(dim, x.dim())
        if x.size(dim) != self.seq_len:
            raise InvalidInputError(
                f"shard expects the full sequence ({self.seq_len} tokens) along dim {dim}, got shape {tuple(x.shape)}."
            )
        return dim

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise InvalidInputError(f"rank {rank} is outside this layout's world of {self.world_size}.")


class GroupLayout:
    """The layout the ring runs over with Ulysses groups of ``ulysses`` ranks: ``world_size`` groups, each
    holding its ranks' tokens of ``base`` in increasing position order (so real slots lead and padding
    trails, as `lowering.schedule` expects). Answers what `lowering.ring` and `lowering.schedule` ask of a
    `Layout` (positions, segments, valid and local lengths)."""

    def __init__(self, base: Layout, ulysses: int):
        if base.world_size % ulysses:
            raise InvalidInputError(
                f"Ulysses groups of {ulysses} ranks do not divide the {base.world_size} ranks of the sequence."
            )
        self.base, self.ulysses = base, ulysses
        self.kind, self.seq_len = base.kind, base.seq_len
        self.world_size = base.world_size // ulysses
        self.local_len = base.local_len * ulysses

    def members(self, group: int) -> range:
        return range(group * self.ulysses, (group + 1) * self.ulysses)

    def order(self, group: int) -> torch.Tensor:
        """Indices that put the group's tokens, as received (rank by rank), in increasing position order."""
        return self._orders[group][0]

    def inverse_order(self, group: int) -> torch.Tensor:
        return self._orders[group][1]

    def positions(self, group: int) -> torch.Tensor:
        return self._orders[group][2].clone()

    def segments(self, group: int) -> tuple[Segment, ...]:
        runs = sorted((s.global_start, s.length) for r in self.members(group) for s in self.base.segments(r))
        segments: list[Segment] = []
        for start, length in runs:
            last = segments[-1] if segments else None
            if last is not None and last.global_stop == start:
                segments[-1] = Segment(last.local_start, last.global_start, last.length + length)
            else:
                segments.append(Segment(last.local_start + last.length if last else 0, start, length))
        return tuple(segments)

    def valid_len(self, group: int) -> int:
        return sum(self.base.valid_len(r) for r in self.members(group))

    @cached_property
    def _orders(self):
        result = []
        for group in range(self.world_size):
            received = torch.cat([self.base.positions(r) for r in self.members(group)])
            sorted_positions, order = torch.sort(received)
            result.append((order, torch.argsort(order), sorted_positions))
        return result

    def __repr__(self) -> str:
        return f"GroupLayout({self.base}, ulysses={self.ulysses})"


@lru_cache(maxsize=64)
def cached_layout(kind: str, world_size: int, seq_len: int, ulysses: int = 1) -> Layout | GroupLayout:
    """The layout of ``seq_len`` tokens over ``world_size`` ranks, or with Ulysses groups of ``ulysses`` ranks
    the groups' (`GroupLayout`), built once: the custom ops take layouts as plain values on every call."""
    if ulysses == 1:
        return Layout(kind, world_size, seq_len)
    return GroupLayout(cached_layout(kind, world_size, seq_len), ulysses)


def local_length(kind: str, world_size: int, seq_len):
    """`Layout.local_len` (and `DocumentLayout.local_len`) as plain arithmetic, so that it also works on a symbolic
    ``seq_len``."""
    if kind == DOCUMENTS_KIND:
        return (seq_len + world_size - 1) // world_size
    chunks = world_size * (2 if kind == "zigzag" else 1)
    return (seq_len + chunks - 1) // chunks * (chunks // world_size)


def _check_dim(dim: int, rank: int) -> int:
    if not -rank <= dim < rank:
        raise InvalidInputError(f"dim {dim} is out of range for a {rank}-D tensor.")
    return dim % rank
