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
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch

from lowering.errors import InvalidInputError

LAYOUT_KINDS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Segment:
    """A run of consecutive real positions held in consecutive local slots."""

    local_start: int
    global_start: int
    length: int

    @property
    def global_stop(self) -> int:
        return self.global_start + self.length


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
            raise InvalidInputError(
                f"unshard needs one shard per rank ({self.world_size}), got {len(shards)}."
            )
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
            torch.cat(
                [torch.arange(c * self.chunk_len, (c + 1) * self.chunk_len) for c in self.chunks(r)]
            )
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
                f"shard expects the full sequence ({self.seq_len} tokens) along dim {dim}, "
                f"got shape {tuple(x.shape)}."
            )
        return dim

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise InvalidInputError(f"rank {rank} is outside this layout's world of {self.world_size}.")


def local_length(kind: str, world_size: int, seq_len):
    """`Layout.local_len` as plain arithmetic, so that it also works on a symbolic ``seq_len``."""
    chunks = world_size * (2 if kind == "zigzag" else 1)
    return (seq_len + chunks - 1) // chunks * (chunks // world_size)


def _check_dim(dim: int, rank: int) -> int:
    if not -rank <= dim < rank:
        raise InvalidInputError(f"dim {dim} is out of range for a {rank}-D tensor.")
    return dim % rank
