"""Packed rows: a layout that balances the documents' causal triangles over the ranks, not one triangle over the row.

A row packed from documents of lengths ``L_1 .. L_m`` (attention causal inside each document, none across them) costs a
query token its offset in its document plus one key pairs. Zigzag balances one triangle over the whole row; with a few
long documents and many short ones its ranks' pairs differ (2400 + 900 + 500 + 296 tokens at P = 2: 1.49x the mean).
`DocumentLayout` gives every rank ``ceil(N / P)`` slots (no padding of each document, none to 2P) and balances the
pairs: `balance_documents` keeps a short document whole on one rank where the pairs allow it (its key blocks are then
on one rank only: a rank whose queries share no document with a block can skip it), splits each long one by zigzag
over the ranks (``2P`` equal pieces, rank r the r-th from the front and from the back: equal pairs on every rank), and
hands out what is left (each long document's middle, shorter than 2P tokens, and whole documents that did not fit)
heaviest first to the rank with the fewest pairs that has room. Where that is more than `BALANCE` off the mean, fewer
documents are kept whole (`ATTEMPTS`), and at last the leftovers go token by token.

The layout keeps `lowering.layout.Layout`'s invariants and interface (``positions``, ``segments``, ``valid_len``,
``shard``, ``unshard``): a rank's local order increases with position, its real slots come first, padding slots carry
positions >= N; so the ring's planner (`lowering.schedule.plan_block`), its causal tiles and `lowering.simulate_ring`
run on it unchanged, the documents' mask evaluated per tile as any mask program is.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch

from lowering.errors import InvalidInputError
from lowering.layout import DOCUMENTS_KIND, Segment, cached_layout

BALANCE = 1.05  # the most a rank's pairs may exceed the mean: else fewer documents are kept whole
# tried in turn, the first within BALANCE kept: (documents kept whole: at most this share of a rank's mean pairs, the
# split documents' middles handed out as runs (else token by token: balanced finer, in more pieces))
ATTEMPTS = ((0.5, True), (0.125, True), (1 / 32, True), (0.0, True), (0.0, False))


def document_pairs(length: int) -> int:
    """The (query, key) pairs causal attention inside one document of ``length`` tokens scores."""
    return length * (length + 1) // 2


@dataclass(frozen=True)
class DocumentLayout:
    """Which positions of a row packed from documents of ``lengths`` (in order, summing to the row's length) each of
    ``world_size`` ranks holds (`balance_documents`), in increasing order, then padding."""

    lengths: tuple[int, ...]
    world_size: int

    kind = DOCUMENTS_KIND

    def __post_init__(self):
        object.__setattr__(self, "lengths", tuple(self.lengths))  # a list too: the plan is cached by the lengths
        if not self.lengths or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in self.lengths):
            raise InvalidInputError(f"Document lengths must be positive ints, got {self.lengths!r}.")
        if not isinstance(self.world_size, int) or isinstance(self.world_size, bool) or self.world_size < 1:
            raise InvalidInputError(f"DocumentLayout world_size must be a positive int, got {self.world_size!r}.")

    @property
    def seq_len(self) -> int:
        return sum(self.lengths)

    @property
    def local_len(self) -> int:
        """Slots per rank: ``ceil(N / P)``, the same on every rank."""
        return -(-self.seq_len // self.world_size)

    def positions(self, rank: int) -> torch.Tensor:
        """int64 global positions of the rank's local slots, in local order (padding: >= seq_len)."""
        real = self._owned[rank]
        padding = torch.arange(self.seq_len, self.seq_len + self.local_len - len(real))
        return torch.cat([torch.tensor(real, dtype=torch.int64), padding])

    def segments(self, rank: int) -> tuple[Segment, ...]:
        """The rank's real slots as runs of consecutive positions, in local order."""
        return self._segments[rank]

    @cached_property
    def _segments(self) -> tuple[tuple[Segment, ...], ...]:  # the ring plans each block from them: built once
        result = []
        for owned in self._owned:
            segments = []
            for slot, position in enumerate(owned):
                if segments and segments[-1].global_stop == position:
                    last = segments[-1]
                    segments[-1] = Segment(last.local_start, last.global_start, last.length + 1)
                else:
                    segments.append(Segment(slot, position, 1))
            result.append(tuple(segments))
        return tuple(result)

    @classmethod
    def of_ids(cls, ids: torch.Tensor, world_size: int) -> DocumentLayout:
        """The layout of rows whose document ids are ``ids [B, N]`` (host): one document per run of equal ids. Rows
        packed alike: the layout of their documents. Rows packed differently: each row's documents are unions of the
        runs no row's id changes in (`shared_runs`), so the layout of those runs is exact for every row (the ring
        decides the tiles from the ids), but it balances their common pieces, not each row's documents (a row of one
        long document over rows of short ones is then split as contiguous would split it): of it and the layout of
        one document over the row (zigzag's balance), the one whose busiest rank scores fewer pairs summed over the
        rows (`_rows_layout`, cached per packing)."""
        rows = ids.reshape(-1, ids.size(-1))
        if rows_alike(rows):
            return _document_layout(shared_runs(rows), world_size)
        return _rows_layout(tuple(shared_runs(row) for row in rows), world_size)

    def rows_pairs(self, rows: tuple[tuple[int, ...], ...]) -> list[int]:
        """Each rank's pairs summed over rows packed from documents of ``rows`` (each a tuple of lengths)."""
        weights = sum(_key_counts(lengths) for lengths in rows)
        return [int(weights[torch.tensor(owned, dtype=torch.int64)].sum()) for owned in self._owned]

    def valid_len(self, rank: int) -> int:
        return len(self._owned[rank])

    def pairs(self, rank: int) -> int:
        """The unmasked (query, key) pairs of the rank's queries over a whole lap: its share of the attention's work."""
        weights = _weights(self.lengths)
        return sum(weights[position] for position in self._owned[rank])

    def balance(self) -> float:
        """The most pairs a rank scores over the mean (1.0: equal)."""
        pairs = [self.pairs(r) for r in range(self.world_size)]
        return max(pairs) * self.world_size / sum(pairs)

    def document_ids(self) -> torch.Tensor:
        """int64 ``[N]``: each position's document, 0, 1, ... in order."""
        return torch.repeat_interleave(torch.arange(len(self.lengths)), torch.tensor(self.lengths))

    def shard(self, x: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        """The rank's shard of a full tensor: its positions of ``x`` along ``dim``, zero-padded."""
        if x.size(dim) != self.seq_len:
            raise InvalidInputError(
                f"shard expects the full sequence ({self.seq_len} tokens) along dim {dim}, got shape {tuple(x.shape)}."
            )
        mine = x.index_select(dim, torch.tensor(self._owned[rank], dtype=torch.int64, device=x.device))
        shape = list(x.shape)
        shape[dim] = self.local_len - mine.size(dim)
        return torch.cat([mine, x.new_zeros(shape)], dim)

    def unshard(self, shards: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
        """Inverse of sharding every rank: the full tensor in position order, padding dropped."""
        if len(shards) != self.world_size:
            raise InvalidInputError(f"unshard needs one shard per rank ({self.world_size}), got {len(shards)}.")
        if any(s.size(dim) != self.local_len for s in shards):
            raise InvalidInputError(
                f"unshard needs {self.local_len} slots per rank along dim {dim}, got {[s.size(dim) for s in shards]}."
            )
        real = torch.cat([s.narrow(dim, 0, self.valid_len(r)) for r, s in enumerate(shards)], dim)
        order = torch.tensor([p for r in range(self.world_size) for p in self._owned[r]], dtype=torch.int64)
        return real.index_select(dim, torch.argsort(order).to(real.device))

    @cached_property
    def _owned(self) -> tuple[tuple[int, ...], ...]:
        return balance_documents(self.lengths, self.world_size)


@lru_cache(maxsize=64)
def _document_layout(lengths: tuple[int, ...], world_size: int) -> DocumentLayout:
    """One layout per packing, its plan and segments built once however many calls use it."""
    return DocumentLayout(lengths, world_size)


@lru_cache(maxsize=64)
def _rows_layout(rows: tuple[tuple[int, ...], ...], world_size: int) -> DocumentLayout:
    """`DocumentLayout.of_ids` of rows packed differently (their documents' lengths): of the layout of their shared
    runs and that of one document, the one whose busiest rank scores fewer pairs (the shared runs on a tie)."""
    bounds = sorted({end for lengths in rows for end in itertools.accumulate(lengths)})
    shared = tuple(b - a for a, b in zip([0, *bounds], bounds))
    candidates = (_document_layout(shared, world_size), _document_layout((bounds[-1],), world_size))
    return min(candidates, key=lambda layout: max(layout.rows_pairs(rows)))


def rows_alike(ids: torch.Tensor) -> bool:
    """Every row of ``ids [B, N]`` is packed alike (one layout, one plan serves them all)."""
    return bool((ids == ids[:1]).all())


def shared_runs(ids: torch.Tensor) -> tuple[int, ...]:
    """The lengths, in order, of the runs of positions in which no row of ``ids [B, N]`` (or one row ``[N]``) changes
    its id: with every row packed alike, its documents' lengths."""
    rows = ids.reshape(-1, ids.size(-1))
    changes = (rows[:, 1:] != rows[:, :-1]).any(0)
    bounds = [0, *(changes.nonzero().flatten() + 1).tolist(), ids.size(-1)]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


def sequence_layout(kind: str, world_size: int, seq_len: int, documents: torch.Tensor | None = None):
    """The layout a sequence op (`lowering.sequence_ops`) works in: ``kind`` over ``world_size`` ranks, or with the
    documents kind, the `DocumentLayout` of ``documents`` (each token's id ``[B, N]`` on the host: the one
    ``ringpass::documents_on_host`` makes per call), built once per packing."""
    if kind != DOCUMENTS_KIND:
        return cached_layout(kind, world_size, seq_len)
    if documents is None or documents.size(-1) != seq_len:
        raise InvalidInputError(
            f"The documents layout is planned from each token's document id: pass the ids of all {seq_len} tokens "
            f"(documents=), got {None if documents is None else tuple(documents.shape)}."
        )
    return DocumentLayout.of_ids(documents, world_size)


@lru_cache(maxsize=256)
def balance_documents(lengths: tuple[int, ...], world_size: int) -> tuple[tuple[int, ...], ...]:
    """Each rank's positions (sorted) of a row packed from documents of ``lengths``: at most ``ceil(N / P)`` each,
    the pairs balanced as the module docstring says (cached by the lengths: a call's plan is host arithmetic)."""
    for whole, runs in ATTEMPTS:
        owned, load = _assign(lengths, world_size, whole, runs)
        if max(load) * world_size <= BALANCE * sum(load):
            break
    return tuple(tuple(sorted(positions)) for positions in owned)


def _assign(lengths: tuple[int, ...], p: int, whole: float, runs: bool) -> tuple[list[list[int]], list[int]]:
    """(positions, pairs) per rank: documents of at most ``whole`` times a rank's mean pairs kept whole, the
    others split by zigzag into ``2P`` pieces of ``L // 2P`` tokens; then what is left (whole documents, the split
    ones' middles: as runs, or with ``runs=False`` token by token), heaviest first, each to the rank with the fewest
    pairs that has room (a run no rank has room for: in halves)."""
    weights = _weights(lengths)
    capacity = -(-len(weights) // p)
    mean = sum(weights) / p
    owned: list[list[int]] = [[] for _ in range(p)]
    load = [0] * p
    left = []  # (-pairs, first position, tokens)
    start = 0
    for length in lengths:
        if document_pairs(length) <= whole * mean:
            left.append((-document_pairs(length), start, length))
        else:
            piece = length // (2 * p)
            for r in range(p):  # the r-th piece from the front and from the back: equal pairs on every rank
                for first in (start + r * piece, start + length - (r + 1) * piece):
                    owned[r].extend(range(first, first + piece))
                    load[r] += sum(weights[first : first + piece])
            middle = range(start + p * piece, start + length - p * piece)  # fewer than 2P tokens
            if middle and runs:
                left.append((-sum(weights[q] for q in middle), middle.start, len(middle)))
            elif middle:
                left.extend((-weights[q], q, 1) for q in middle)
        start += length
    heapq.heapify(left)
    while left:
        pairs, first, tokens = heapq.heappop(left)
        room = [r for r in range(p) if len(owned[r]) + tokens <= capacity]
        if not room:  # in two halves (single tokens always fit: the slots hold every token)
            for part, count in ((first, tokens // 2), (first + tokens // 2, tokens - tokens // 2)):
                heapq.heappush(left, (-sum(weights[part : part + count]), part, count))
            continue
        r = min(room, key=load.__getitem__)
        owned[r].extend(range(first, first + tokens))
        load[r] -= pairs
    return owned, load


def _key_counts(lengths: tuple[int, ...]) -> torch.Tensor:
    """Each position's key count under causal attention inside its document (its offset in the document plus one),
    int64 ``[sum(lengths)]``."""
    sizes = torch.tensor(lengths)
    starts = torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, sizes)
    return torch.arange(int(sizes.sum())) - starts + 1


@lru_cache(maxsize=16)
def _weights(lengths: tuple[int, ...]) -> tuple[int, ...]:
    """`_key_counts` as Python ints (the balancer's arithmetic), cached per packing."""
    return tuple(_key_counts(lengths).tolist())
