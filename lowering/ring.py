"""The ring schedule: one rank's forward and backward laps.

At step s rank r holds the KV block of rank (r - s) mod P. Forward: the send of the current block to
r+1 and the receive from r-1 are posted before the block's tasks run and waited after them (P-1
exchanges in all); the kernel merges each tile's partial (out, lse) into fp32 accumulators (fp64
for fp64 inputs) with the log-sum-exp identity. Backward: dq accumulates locally; the dk/dv accumulator of a KV
block travels one hop behind the block itself and arrives home after the lap (P-1 KV exchanges, P dk/dv
exchanges). Each step's post, compute and wait are profiler ranges (``ringpass forward step 0: wait``),
so a ``torch.profiler`` trace shows where a rank waits. `RankForward` / `RankBackward` hold one rank's state
and are shared with the single-process simulation (`lowering.simulate`) and the all-gather alternative
(`lowering.all_gather`), which only change how blocks move.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

import torch

from lowering import events, masks
from lowering.comm import DKV_HOME_TAG, DKV_TAG, KV_TAG, RingExchange
from lowering.fully_masked import FullyMaskedGrads, check_fully_masked, fill_fully_masked_, value_sum
from lowering.kernels import accumulation_dtype, block_attention_backward, block_attention_merge_, kernel_applies_window
from lowering.layout import Layout
from lowering.masks import BlockMask, Tile, mask_tiles, work_tiles
from lowering.program_grads import ProgramGrads
from lowering.schedule import kv_source, plan_block, plan_documents
from lowering.scores import ScoreMod

WORK_TILE_MIN = 2048  # below this a kernel call's fixed costs show on the CPU (docs/performance.md, "The history")


@dataclass(frozen=True)
class RingSpec:
    """What every rank agrees on for one call: ``mask`` adds a sliding window or a mask program to the
    causal flag (its ``is_causal`` must equal ``is_causal``); ``scores`` modifies the scores (soft-cap,
    ALiBi, a bias program); ``fully_masked`` says what a query whose keys are all hidden gives
    (`lowering.fully_masked`)."""

    layout: Layout
    is_causal: bool
    scale: float
    mask: BlockMask | None = None
    scores: ScoreMod = ScoreMod()
    fully_masked: str = "zero"

    def __post_init__(self):
        check_fully_masked(self.fully_masked)

    def positions(self, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every rank's global positions, (on the host, on ``device``): built once per call, so no ring step
        copies positions to the device or reads them back."""
        host = [self.layout.positions(r) for r in range(self.layout.world_size)]
        return [(h, h.to(device)) for h in host]

    def tiles(self, q_rank: int, kv_rank: int, q, positions, split: bool = False) -> list[Tile]:
        """The kernel calls of rank ``q_rank`` against the KV block of ``kv_rank``: the planned tasks, cut
        into tiles where a window (unless the kernel applies it), a mask program or a bias program hides
        part of them (`lowering.masks.mask_tiles`; empty tiles left out). ``split``: every tile its own
        call, as with a bias program (a backward that trains a program's inputs takes each tile's ``ds``)."""
        block_mask = self.mask or BlockMask(self.is_causal)
        (q_host, q_pos), (kv_host, kv_pos) = positions[q_rank], positions[kv_rank]
        split = split or self.scores.per_tile
        starts = self._document_starts(block_mask, split)
        if starts is not None:
            tasks = plan_documents(self.layout, q_rank, kv_rank, self.is_causal, starts)
            if events.recording():
                planned = sum(t.area for t in plan_block(self.layout, q_rank, kv_rank, self.is_causal))
                events.emit("document_skip", pairs=planned - sum(t.area for t in tasks))
            return [tile for task in tasks for tile in work_tiles(task, self.work_tile)]
        return [
            tile
            for task in plan_block(self.layout, q_rank, kv_rank, self.is_causal)
            for tile in mask_tiles(
                task,
                q_host,
                kv_host,
                block_mask,
                q.size(0),
                q.size(1),
                q_pos=q_pos,
                kv_pos=kv_pos,
                split=split,
                window_in_kernel=self._window_in_kernel(q),
                work=self.work_tile,
            )
        ]

    @staticmethod
    def _document_starts(block_mask: BlockMask, split: bool) -> tuple[int, ...] | None:
        """The documents' starts where they alone (with causality) decide the pairs and calls may be merged: the
        pairs are then planned per document (`lowering.schedule.plan_documents`), no tile evaluated."""
        if block_mask.documents is None or block_mask.window is not None or block_mask.program is not None or split:
            return None
        return block_mask.document_starts

    def hops(self) -> tuple[int, ...]:
        """Per rank ``b``, how far its KV block travels: the last step at which a rank needs it (a pair of its is
        visible there: `_hops`), 0 when only ``b`` does. A block goes no further, and its dk/dv accumulator goes
        straight home from there. Every block travels the whole lap (P - 1) where tiles are decided per call (a
        window, a mask program, documents whose ids recur apart in a row) or a fully masked query reads every
        value. Rows packed differently are planned per packing: a block goes as far as one of them needs it."""
        p, block_mask = self.layout.world_size, self.mask or BlockMask(self.is_causal)
        if self.fully_masked != "zero" or block_mask.window is not None or block_mask.program is not None:
            return (p - 1,) * p
        rows = (None,) if block_mask.documents is None else block_mask.rows_document_starts
        if rows is None:
            return (p - 1,) * p
        return _hops(self.layout, self.is_causal, rows)

    def programs(self) -> list[tuple]:
        """(program, inputs) of the mask program and the bias program, in the ring op's argument order
        (absent ones as (None, ())): the values whose inputs a backward may train."""
        mask = self.mask or BlockMask(self.is_causal)
        return [(mask.program, mask.inputs), (self.scores.bias, self.scores.bias_inputs)]

    @property
    def work_tile(self) -> tuple[int, int]:
        """(query rows, keys) one kernel call covers at most: an eighth of a rank's slots by half of them
        (each at least `WORK_TILE_MIN`, a multiple of ``MASK_TILE``). A call's output and dq are then an
        eighth of the accumulators and its dK/dV half a block's, which bounds what the ring holds beyond
        its accumulators and blocks (by a constant below 16384 slots per rank, where the smallest calls
        keep the kernels' fixed costs from showing: 7 % of the ring's time at 512 rows on the CPU)."""

        def part(fraction: int) -> int:
            slots = -(-self.layout.local_len // fraction)
            return max(WORK_TILE_MIN, -(-slots // masks.MASK_TILE) * masks.MASK_TILE)

        return part(8), part(2)

    def _window_in_kernel(self, q) -> bool:
        return self.mask is not None and self.mask.window is not None and kernel_applies_window(q)

    def kernel_options(self, tile: Tile, q, q_pos, kv_pos) -> dict:
        """What the block kernels take for one tile besides q, k, v and positions."""
        rows, cols = q_pos[tile.rows], kv_pos[tile.cols]
        options = self.scores.kernel_options(rows, cols, q.size(0), q.size(1), q.device)
        if tile.bias is not None:  # an additive mask's bias adds to the bias program's
            options["bias"] = tile.bias if options["bias"] is None else options["bias"] + tile.bias
        window = self.mask.window if self._window_in_kernel(q) else None
        return dict(scale=self.scale, is_causal=tile.causal, mask=tile.mask, window=window, **options)


@lru_cache(maxsize=64)
def _hops(layout: Layout, is_causal: bool, rows: tuple[tuple[int, ...] | None, ...]) -> tuple[int, ...]:
    """`RingSpec.hops` from the plan alone: per rows' packing (each row's documents' starts, or None for no
    documents: `plan_block`, else per document `plan_documents`), a rank needs a block where one of them plans a
    task; host arithmetic, once per layout and packing."""
    p = layout.world_size

    def needs(q_rank: int, kv_rank: int) -> bool:
        return any(
            plan_block(layout, q_rank, kv_rank, is_causal)
            if starts is None
            else plan_documents(layout, q_rank, kv_rank, is_causal, starts)
            for starts in rows
        )

    return tuple(max((t for t in range(1, p) if needs((b + t) % p, b)), default=0) for b in range(p))


class RankForward:
    """One rank's running output and LSE over the KV blocks it has seen so far."""

    def __init__(self, q: torch.Tensor, spec: RingSpec, rank: int):
        self.q, self.spec, self.rank = q, spec, rank
        self.positions = spec.positions(q.device)
        self.q_pos = self.positions[rank][1]
        acc = accumulation_dtype(q.dtype)
        self.out = torch.zeros(q.shape, dtype=acc, device=q.device)
        self.lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        self.values = None  # the sum of every key's value, when fully masked rows average them

    def add_block(self, k: torch.Tensor, v: torch.Tensor, kv_rank: int) -> None:
        kv_pos = self.positions[kv_rank][1]
        if self.spec.fully_masked != "zero":
            block_sum = value_sum(v, kv_pos, self.spec.layout.seq_len, self.out.dtype)
            self.values = block_sum if self.values is None else self.values + block_sum
        for t in self.spec.tiles(self.rank, kv_rank, self.q, self.positions):
            rows, cols = t.rows, t.cols
            block_attention_merge_(
                self.q[:, :, rows],
                k[:, :, cols],
                v[:, :, cols],
                self.q_pos[rows],
                kv_pos[cols],
                self.out[:, :, rows],
                self.lse[:, :, rows],
                **self.spec.kernel_options(t, self.q, self.q_pos, kv_pos),
            )

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.values is not None:
            fill_fully_masked_(self.out, self.lse, self.values, self.q_pos, self.spec.layout.seq_len)
        return self.out.to(self.q.dtype), self.lse


class RankBackward:
    """One rank's dq, and the dk/dv contribution of its queries to each KV block it sees."""

    def __init__(
        self,
        dout,
        q,
        out,
        lse,
        dlse: torch.Tensor | None,
        spec: RingSpec,
        rank: int,
        trained: Sequence[Sequence[bool]] = (),
    ):
        self.dout, self.q, self.out, self.lse, self.dlse = dout, q, out, lse, dlse
        self.spec, self.rank = spec, rank
        self.positions = spec.positions(q.device)
        self.q_pos = self.positions[rank][1]
        self.dq = torch.zeros(q.shape, dtype=accumulation_dtype(q.dtype), device=q.device)
        self.fully_masked = FullyMaskedGrads(spec.fully_masked, lse, self.q_pos, spec.layout.seq_len)
        # the mask and bias programs whose inputs this backward trains (``trained``: per program, per input)
        self.program_grads = [
            ProgramGrads(program, inputs, needs)
            for (program, inputs), needs in zip(spec.programs(), trained)
            if any(needs)
        ]

    def block_grads(self, k, v, kv_rank: int) -> torch.Tensor:
        """``stack((dk, dv))`` of this block from this rank's queries, in the accumulation dtype; the
        trained programs' inputs get this block's share of their gradients."""
        acc = self.dq.dtype
        dkv = torch.zeros((2, *k.shape), dtype=acc, device=k.device)
        kv_pos = self.positions[kv_rank][1]
        train = bool(self.program_grads)
        for t in self.spec.tiles(self.rank, kv_rank, self.q, self.positions, split=train):
            rows, cols = t.rows, t.cols
            dq, dk, dv, *ds = block_attention_backward(
                self.dout[:, :, rows],
                self.q[:, :, rows],
                k[:, :, cols],
                v[:, :, cols],
                self.out[:, :, rows],
                self.lse[:, :, rows],
                self.q_pos[rows],
                kv_pos[cols],
                **self.spec.kernel_options(t, self.q, self.q_pos, kv_pos),
                dlse=None if self.dlse is None else self.dlse[:, :, rows],
                score_grads=train,
            )
            self.dq[:, :, rows] += dq.to(acc)
            dkv[0, :, :, cols] += dk.to(acc)
            dkv[1, :, :, cols] += dv.to(acc)
            for grads in self.program_grads:
                grads.add_(self.q_pos[rows], kv_pos[cols], ds[0])
        self.fully_masked.add_(
            self.dout,
            self.q,
            k,
            v,
            self.out,
            kv_pos,
            self.spec.scale,
            self.spec.scores.softcap,
            self.dq,
            dkv,
            self.program_grads,
        )
        return dkv

    def program_results(self) -> list[torch.Tensor]:
        """The trained programs' input gradients (this rank's queries' share), mask program's first."""
        return [g for grads in self.program_grads for g in grads.result()]


@contextmanager
def span(phase: str, step: int, part: str, message: str = ""):
    """A profiler range (``ringpass forward step 0: compute``): traces show where a step waits. While ring
    events are recorded, each range is also a ``span`` event with its ``start`` (``time.perf_counter``,
    one clock for every process on a machine) and ``seconds`` of host wall time, and for a post or a wait
    the ``message`` it sends or waits for (``"kv 0"``: the KV block its sender posted at step 0), so
    ``ringpass bench`` can tell a transfer still in flight from a neighbour that posted late. (On CUDA
    these are launch times, not kernel times.)"""
    with torch.profiler.record_function(f"ringpass {phase} step {step}: {part}"):
        if not events.recording():
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            events.emit(
                "span",
                phase=phase,
                step=step,
                part=part,
                message=message,
                start=start,
                seconds=time.perf_counter() - start,
            )


def ring_forward(q, k, v, spec: RingSpec, exchange: RingExchange):
    """This rank's (out, lse) of exact full-sequence attention. A block goes on only while a later rank needs it
    (`RingSpec.hops`); a rank computes on the blocks it holds."""
    rank, p = exchange.rank, exchange.world_size
    state, hops = RankForward(q, spec, rank), spec.hops()
    kv, held = torch.stack((k, v)), True
    for step in range(p):
        arriving = None
        if step < p - 1:
            arriving = _pass_on(exchange, kv, hops, rank, step, "forward")
        if held:
            with span("forward", step, "compute"):
                state.add_block(kv[0], kv[1], kv_source(rank, step, p))
        else:
            _count_unheld(spec, rank, kv_source(rank, step, p))
        kv, held = _arrived(arriving, kv, "forward", step)
    return state.result()


def _count_unheld(spec: RingSpec, rank: int, kv_rank: int) -> None:
    """A block that never reaches this rank (the documents leave no pair of it visible here): the pairs the causal
    plan had for it count as skipped, as `RingSpec.tiles` counts a held block's (a ``document_skip`` event)."""
    if events.recording() and spec.mask is not None and spec.mask.documents is not None:
        events.emit("document_skip", pairs=sum(t.area for t in plan_block(spec.layout, rank, kv_rank, spec.is_causal)))


def _arrived(arriving, kv, phase: str, step: int) -> tuple[torch.Tensor, bool]:
    """(the block for the next step, whether this rank holds one there: a block arrives or it holds none)."""
    if arriving is None:
        return kv, False
    with span(phase, step, "wait", f"kv {step}" if arriving.receives else f"kv {step} sent"):
        received = arriving.wait()
    return (received, True) if received is not None else (kv, False)


def _pass_on(exchange: RingExchange, kv, hops: tuple[int, ...], rank: int, step: int, phase: str):
    """Post step ``step``'s KV exchange: this rank's block on to the next rank if a later rank needs it, the previous
    rank's in if it comes (each side skipped where not: a ``send_skip`` event counts the bytes not sent)."""
    p = exchange.world_size
    send = hops[kv_source(rank, step, p)] > step
    receive = hops[kv_source(rank, step + 1, p)] > step
    if not send and events.recording():
        events.emit("send_skip", payload="kv", step=step, phase=phase, bytes=kv.numel() * kv.element_size())
    if not (send or receive):
        return None
    with span(phase, step, "post", f"kv {step}"):
        return exchange.start(kv, payload="kv", step=step, tag=KV_TAG, phase=phase, send=send, receive=receive)


def ring_backward(
    dout, q, k, v, out, lse, dlse, spec: RingSpec, exchange: RingExchange, trained: Sequence[Sequence[bool]] = ()
):
    """This rank's (dq, dk, dv, the trained program inputs' gradients), given the forward's final out and
    lse. ``trained``: per program of `RingSpec.programs`, which of its inputs need a gradient; each gets
    this rank's queries' share of it. The blocks travel as in the forward; a block's dk/dv accumulator follows it
    one hop behind, and from the last rank that needs the block (`RingSpec.hops`) goes straight home."""
    rank, p = exchange.rank, exchange.world_size
    state, hops = RankBackward(dout, q, out, lse, dlse, spec, rank, trained), spec.hops()
    kv, held = torch.stack((k, v)), True
    like = torch.empty((2, *k.shape), dtype=state.dq.dtype, device=k.device)  # a dk/dv accumulator's shape
    own = dkv_arriving = home = None  # own: this rank's block's dk/dv
    sending: list = []
    for step in range(p):
        block = kv_source(rank, step, p)
        kv_arriving = _pass_on(exchange, kv, hops, rank, step, "backward") if step < p - 1 else None
        dkv = None
        if held:
            with span("backward", step, "compute"):
                dkv = state.block_grads(kv[0], kv[1], block)
            if dkv_arriving is not None:
                with span("backward", step, "wait", f"dkv {step - 1}"):
                    dkv += dkv_arriving.wait()
            own = dkv if hops[block] == 0 else own  # (step 0: no other rank needs this rank's block)
        else:
            _count_unheld(spec, rank, block)
        with span("backward", step, "wait", f"dkv {step - 1} sent"):
            for pending in sending:
                pending.wait()
        with span("backward", step, "post", f"dkv {step}"):
            dkv_arriving, arriving_home, sending = _dkv_post(exchange, dkv, like, hops, rank, step)
            home = arriving_home or home
        kv, held = _arrived(kv_arriving, kv, "backward", step)
    with span("backward", p - 1, "wait", "dkv home"):
        own = home.wait() if home is not None else own
    with span("backward", p - 1, "wait", f"dkv {p - 1} sent"):
        for pending in sending:
            pending.wait()
    # copies: dk and dv must not be views of one buffer (custom ops may not return aliases)
    return (state.dq.to(q.dtype), own[0].to(k.dtype, copy=True), own[1].to(v.dtype, copy=True), state.program_results())


def _dkv_post(exchange: RingExchange, dkv, like, hops: tuple[int, ...], rank: int, step: int):
    """Post step ``step``'s dk/dv traffic: the accumulator of the block this rank holds (``dkv``; None: it holds
    none) on to the next rank while the block goes on, or home from the last rank that needs it; the receive of the
    accumulator of the block that arrives next; and, at the step its last holder sends it, the receive of this rank's
    own block's. Returns (next step's accumulator, this rank's own, the sends), as `Pending`s (or None)."""
    p = exchange.world_size
    block = kv_source(rank, step, p)
    sends = []
    if dkv is not None and step < hops[block]:
        sends.append(exchange.start(dkv, payload="dkv", step=step, tag=DKV_TAG, phase="backward", receive=False))
    elif dkv is not None and 0 < step == hops[block]:
        to_home = dict(tag=DKV_HOME_TAG, phase="backward", receive=False, to=block)
        sends.append(exchange.start(dkv, payload="dkv", step=step, **to_home))
    if not sends and p > 1 and events.recording():  # (the whole lap sends one accumulator per step)
        events.emit("send_skip", payload="dkv", step=step, phase="backward", bytes=like.numel() * like.element_size())
    arriving = home = None
    if step < p - 1 and hops[kv_source(rank, step + 1, p)] > step:
        arriving = exchange.start(like, payload="dkv", step=step, tag=DKV_TAG, phase="backward", send=False)
    if 0 < step == hops[rank]:  # this rank's block's last holder sends its accumulator home now
        source = (rank + step) % p
        home = exchange.start(
            like, payload="dkv", step=step, tag=DKV_HOME_TAG, phase="backward", send=False, source=source
        )
    return arriving, home, sends
