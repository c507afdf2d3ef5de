"""``ringpass bench --what attention``: one attention, forward and forward+backward, by every method.

Methods (`METHODS`): ``sdpa`` (``F.scaled_dot_product_attention`` on the whole sequence in one process,
run once with one thread and once with as many threads as the ranks had together); ``all-gather``
(``lowering.ring_attention(..., strategy="all-gather")``); ``ring-contiguous`` and ``ring-zigzag``
(`lowering.ring_attention`); ``ulysses`` (`lowering.ulysses_attention` over every rank: one all-to-all over heads
each way, no ring); ``auto`` (what ``strategy="auto"`` picks for this shape on the bench's hardware, among those,
Ulysses x ring with smaller groups, and running the attention whole on every rank; the row names the pick);
``context-parallel`` (PyTorch's ``context_parallel``, which shards the buffers itself; where it cannot run the
row says why). Every process builds the same full q, k, v and
output gradient from one seed and takes its shard; each method's output is checked against fp32 SDPA on
the whole sequence (the ``error`` column), so a wrong method shows as wrong, not as fast. Methods run one
after another, or with ``--interleave`` in turns (`measure_methods`).

Each rank returns, per method, sequence length and repeat: forward and forward+backward seconds, peak
memory of the forward and of the whole call (`measure.PeakMemory`), its seconds computing blocks, and,
from the ring's ``span`` events, when it posted each message and how long it waited for each
(``all-gather``: its collectives). The standalone time of each message the ring
sends (`message_seconds`, measured without compute) is what the waits are compared to.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

import lowering
from lowering.comm import RingExchange
from lowering.costmodel import AttentionShape, Strategy, choose_strategies
from lowering.documents import DocumentLayout
from lowering.errors import NotSupportedError
from lowering.events import scored_pairs
from lowering.kernels import accumulation_dtype
from lowering.ulysses import check_heads, ulysses_mesh
from ringpass.cli.bench.measure import PeakMemory, gather_record, seconds_since, start_rank, synchronize, write_trace

METHODS = ("sdpa", "all-gather", "ring-contiguous", "ring-zigzag", "ulysses", "auto", "context-parallel")
# ``--packed``: one row packed from documents, attention inside each (``sdpa``: one call per document, as varlen
# kernels run it; the rings and the all-gather with ``documents=ids``, ``ring-documents`` on a `DocumentLayout`)
PACKED_METHODS = ("sdpa", "all-gather", "ring-contiguous", "ring-zigzag", "ring-documents")
# ``--packed`` on request (``--methods``): the same documents unpacked, each its own row right-padded to the longest,
# causal attention over the batch of rows on zigzag (`unpacked`): what packing saves
UNPACKED_METHODS = ("ring-padded",)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Inputs:
    """The full q, k, v, output gradient (in the benchmark dtype) and fp32 SDPA's output on them."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    reference: torch.Tensor
    documents: torch.Tensor | None = None  # with --packed: each token's document id, [N]


def make_inputs(config, seq_len: int, device: torch.device) -> Inputs:
    generator = torch.Generator().manual_seed(config.seed)
    dtype = DTYPES[config.dtype]

    def rand(heads):
        return torch.randn(config.batch, heads, seq_len, config.head_dim, generator=generator).to(device, dtype)

    q, k, v, dout = rand(config.heads), rand(config.kv_heads), rand(config.kv_heads), rand(config.heads)
    with torch.no_grad():
        reference = per_document_sdpa(q.float(), k.float(), v.float(), config)
    documents = DocumentLayout(config.packed, 1).document_ids().to(device) if config.packed else None
    return Inputs(q, k, v, dout, reference, documents)


def per_document_sdpa(q, k, v, config) -> torch.Tensor:
    """SDPA over the whole sequence, or with ``--packed`` one call per document (attention inside each)."""
    spans = [(start, start + n) for start, n in zip(itertools.accumulate((0, *config.packed)), config.packed)]
    if not spans:
        return F.scaled_dot_product_attention(q, k, v, is_causal=config.causal, enable_gqa=True)
    return torch.cat(
        [
            F.scaled_dot_product_attention(
                q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=config.causal, enable_gqa=True
            )
            for a, b in spans
        ],
        2,
    )


def unpacked(t: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
    """``t [B, H, N, D]`` of rows packed from documents of ``lengths``: each document its own row, right-padded with
    zeros to the longest (``[len(lengths) * B, H, max(lengths), D]``). Causal attention over those rows is each
    document's attention at its real tokens (they never see the padding after them), and scores every padded pair."""
    longest = max(lengths)
    return torch.cat([F.pad(piece, (0, 0, 0, longest - piece.size(2))) for piece in t.split(list(lengths), 2)], 0)


def attention_shape(config) -> AttentionShape:
    return AttentionShape(
        config.batch, config.heads, config.kv_heads, config.head_dim, DTYPES[config.dtype].itemsize, config.causal
    )


def layout_kind(method: str, causal: bool) -> str:
    """The layout a distributed method shards in: its own for the rings, else zigzag under a causal mask."""
    own = {
        "ring-contiguous": "contiguous",
        "ring-zigzag": "zigzag",
        "ring-padded": "zigzag",
        "ring-documents": DocumentLayout.kind,
    }
    return own.get(method, "zigzag" if causal else "contiguous")


def _error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return ((out.float() - reference).abs().max() / reference.abs().max()).item()


class _Unavailable(Exception):
    """The method cannot run here; the message says why."""


class _Step:
    """One method ready to call on this rank: ``forward()`` gives (output, the reference's rows for it),
    ``backward(out)`` runs the backward."""

    def __init__(self, method: str, inputs: Inputs, config, rank: int, world_size: int):
        self.causal, self.config, self.documents = config.causal, config, inputs.documents
        self.strategy = (
            Strategy("none") if method == "sdpa" else _strategy(method, config, world_size, inputs.q.size(2))
        )
        rows = (inputs.q, inputs.k, inputs.v, inputs.reference, inputs.dout)
        if method in UNPACKED_METHODS:
            rows, self.documents = self._unpacked(inputs, config), None
        self.layout = None
        if self.strategy.layout == DocumentLayout.kind:
            self.layout = DocumentLayout(config.packed, world_size)
        elif self.strategy.kind != "none":  # each rank its shard; else every rank the whole sequence
            self.layout = lowering.Layout(self.strategy.layout, world_size, rows[0].size(2))
        if self.layout is not None:
            rows = tuple(self.layout.shard(t, 2, rank) for t in rows)
        if self.strategy.kind == "ulysses":
            mesh = ulysses_mesh(world_size // self.strategy.ulysses, self.strategy.ulysses)
            self.groups = {"ulysses_group": mesh.get_group(1), "ring_group": mesh.get_group(0)}
        self.q, self.k, self.v = (t.detach().clone().requires_grad_() for t in rows[:3])
        self.reference, self.dout = rows[3], rows[4]
        self.rows = rows[0].size(0)  # (the batch: the pairs its kernels score count once per row)

    @staticmethod
    def _unpacked(inputs: Inputs, config) -> tuple:
        """q, k, v, their reference (fp32 SDPA on the padded rows: its padding rows are what causal attention gives
        them) and the output gradient (zero at padding) of `UNPACKED_METHODS`."""
        if not config.causal or not config.packed:
            raise _Unavailable("the padded rows are for --packed causal attention (padding hides behind the mask)")
        q, k, v = (unpacked(t, config.packed) for t in (inputs.q, inputs.k, inputs.v))
        with torch.no_grad():
            reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
        return q, k, v, reference, unpacked(inputs.dout, config.packed)

    def reset(self) -> None:
        """Free the previous call's gradients (before memory is measured: freeing them is not the call's)."""
        for t in (self.q, self.k, self.v):
            t.grad = None

    def forward(self):
        kind, q, k, v = self.strategy.kind, self.q, self.k, self.v
        if kind == "none":
            out = per_document_sdpa(q, k, v, self.config)
        elif kind == "ulysses":
            out = lowering.ulysses_attention(q, k, v, layout=self.layout, is_causal=self.causal, **self.groups)
        else:
            out = lowering.ring_attention(
                q, k, v, layout=self.layout, is_causal=self.causal, strategy=kind, documents=self.documents
            )
        return out, self.reference

    def backward(self, out) -> None:
        out.backward(self.dout)


def _strategy(method: str, config, world_size: int, seq_len: int) -> Strategy:
    """The strategy a distributed method runs (``auto``: the cost model's pick on ``config.hardware``)."""
    layout = layout_kind(method, config.causal)
    if method == "auto":
        layouts = ("zigzag", "contiguous") if config.causal else ("contiguous", "zigzag")
        return choose_strategies(
            [attention_shape(config)], seq_len, world_size, config.hardware, layouts=layouts
        ).chosen[0]
    if method == "ulysses":
        try:
            check_heads(config.heads, config.kv_heads, world_size)
        except NotSupportedError as error:
            raise _Unavailable(str(error)) from None
        return Strategy("ulysses", layout, world_size)
    return Strategy("all-gather" if method == "all-gather" else "ring", layout)


class _ContextParallelStep:
    """PyTorch's ``context_parallel``: it shards full-length buffers in place on entering its context, so
    every call starts from fresh full copies and runs inside the context."""

    def __init__(self, inputs: Inputs, config, world_size: int):
        try:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.experimental import context_parallel
        except ImportError as error:
            raise _Unavailable(f"this torch has no context_parallel ({error})") from None
        self.inputs, self.causal, self.rows = inputs, config.causal, inputs.q.size(0)
        self.mesh, self.context_parallel = init_device_mesh(inputs.q.device.type, (world_size,)), context_parallel

    def reset(self) -> None:
        pass

    def forward(self):
        buffers = [
            t.clone() for t in (self.inputs.q, self.inputs.k, self.inputs.v, self.inputs.dout, self.inputs.reference)
        ]
        self.context = self.context_parallel(self.mesh, buffers=buffers, buffer_seq_dims=[2] * len(buffers))
        self.context.__enter__()
        try:
            q, k, v = (t.detach().requires_grad_() for t in buffers[:3])
            out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=True)
        except BaseException:
            self.context.__exit__(None, None, None)
            raise
        self.dout = buffers[3]
        return out, buffers[4]

    def backward(self, out) -> None:
        try:
            out.backward(self.dout)
        finally:
            self.context.__exit__(None, None, None)


def _run_once(step, memory: PeakMemory, device) -> dict:
    """One measured forward+backward: seconds and peak bytes of the forward and of the whole call; the
    ring's posts (``{"forward kv 0": start}``) and waits (``(message, start, seconds)``) for `results`."""
    step.reset()
    memory.start()
    with lowering.record_ring_events() as events:
        start = time.perf_counter()
        out, reference = step.forward()
        forward_s = seconds_since(start, device)
        forward_bytes = memory.peak()
        forward_events = len(events)
        step.backward(out)
        total_s = seconds_since(start, device)
        total_bytes = memory.peak()
    spans = [e.fields for e in events if e.kind == "span"]
    compute = sum(s["seconds"] for s in spans if s["part"] == "compute")
    skipped = sum(e.fields["pairs"] for e in events[:forward_events] if e.kind == "document_skip")
    return {
        "started_s": start,  # perf_counter: the order of calls within this process
        "forward_s": forward_s,
        "total_s": total_s,
        "forward_bytes": forward_bytes,
        "total_bytes": total_bytes,
        "compute_s": compute,
        "pairs": scored_pairs(events) * step.rows,
        "sent_bytes": sum(e.fields["bytes"] for e in events if e.kind == "exchange"),  # the ring's P2P sends
        "unsent_bytes": sum(e.fields["bytes"] for e in events if e.kind == "send_skip"),  # blocks no rank needed
        "skipped_pairs": skipped * step.rows,  # the forward's pairs of the causal plan documents leave out
        "error": _error(out.detach(), reference),
        "posts": {f"{s['phase']} {s['message']}": s["start"] for s in spans if s["part"] == "post"},
        "waits": [(f"{s['phase']} {s['message']}", s["start"], s["seconds"]) for s in spans if s["part"] == "wait"],
    }


class _Prepared:
    """One method set up on this rank, its warm-up calls made; ``call()`` measures one more call."""

    def __init__(self, method: str, step, memory: PeakMemory, device, warmup: int, world_size: int):
        self.method, self.step, self.memory, self.device = method, step, memory, device
        self.world_size = world_size
        self.chosen = str(step.strategy) if method == "auto" else None
        first = self.call_once()  # a warm-up call, or the first measured one with --warmup 0
        warmups, self.samples = ([first], []) if warmup else ([], [first])
        warmups += [self.call_once() for _ in range(warmup - 1)]
        self.first_call_bytes = warmups[0]["total_bytes"] if warmups else None

    def call_once(self) -> dict:
        return _run_once(self.step, self.memory, self.device)

    def call(self) -> None:
        if self.world_size > 1:
            dist.barrier()
        self.samples.append(self.call_once())

    def result(self, config, rank: int, seq_len: int) -> dict:
        if config.trace:
            write_trace(
                self.call_once,
                self.device,
                os.path.join(
                    config.trace,
                    f"{self.method}-P{self.world_size}-N{seq_len}-T{torch.get_num_threads()}-rank{rank}.json",
                ),
            )
        return {
            "samples": self.samples,
            "memory_note": self.memory.unavailable,
            "first_call_bytes": self.first_call_bytes,
            "chosen": self.chosen,
        }


def prepare_method(method: str, inputs: Inputs, config, rank: int, world_size: int, device) -> _Prepared | dict:
    """``method`` ready to measure on this rank (``{"unavailable": reason}`` where it cannot run)."""
    try:
        step = (
            _ContextParallelStep(inputs, config, world_size)
            if method == "context-parallel"
            else _Step(method, inputs, config, rank, world_size)
        )
        return _Prepared(method, step, PeakMemory(device), device, config.warmup, world_size)
    except _Unavailable as error:
        return {"unavailable": str(error)}
    except (NotImplementedError, RuntimeError) as error:
        if method != "context-parallel":
            raise
        first_line = (str(error).strip().splitlines() or [""])[0]
        return {"unavailable": f"{type(error).__name__}: {first_line}"}


def measure_methods(methods, inputs: Inputs, config, rank: int, world_size: int, device, progress) -> dict:
    """This rank's measurements of each method, by name. One after another, each method's calls together;
    with ``config.interleave`` every method is set up and warmed first, then the measured calls go round the
    methods, each round starting one method later, so that a machine slowing down or speeding up during the
    run (or a process that grows slower as it ages) weighs on every method alike."""
    seq_len = inputs.q.size(2)

    def prepare(method):
        threads = torch.get_num_threads()
        progress.advance(f"{method} P={world_size} N={seq_len} ({threads} thread{'s' * (threads > 1)})")
        return prepare_method(method, inputs, config, rank, world_size, device)

    def result(prepared):  # a method's step is dropped with its _Prepared once this is taken
        return prepared.result(config, rank, seq_len) if isinstance(prepared, _Prepared) else prepared

    if not config.interleave:
        measured = {}
        for method in methods:
            prepared = prepare(method)
            while isinstance(prepared, _Prepared) and len(prepared.samples) < config.repeats:
                prepared.call()
            measured[method] = result(prepared)
        return measured
    prepared = {method: prepare(method) for method in methods}
    runnable = [p for p in prepared.values() if isinstance(p, _Prepared)]
    for turn in range(config.repeats if runnable else 0):
        for ready in runnable[turn % len(runnable) :] + runnable[: turn % len(runnable)]:
            if len(ready.samples) < config.repeats:
                ready.call()
    return {method: result(p) for method, p in prepared.items()}


def message_seconds(config, seq_len: int, world_size: int, device, repeats: int = 3) -> dict:
    """Standalone seconds of one ring hop without compute: a KV block, and a dK/dV accumulator."""
    if world_size == 1:
        return {"kv": 0.0, "dkv": 0.0}
    exchange = RingExchange(dist.group.WORLD)
    local = lowering.Layout("contiguous", world_size, seq_len).local_len
    shape = (2, config.batch, config.kv_heads, local, config.head_dim)
    dtype = DTYPES[config.dtype]
    result = {}
    for name, dt in (("kv", dtype), ("dkv", accumulation_dtype(dtype))):
        block = torch.zeros(shape, dtype=dt, device=device)
        times = []
        for _ in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            exchange.start(block, payload=name, step=0, tag=0).wait()
            synchronize(device)
            times.append(time.perf_counter() - start)
        result[name] = sorted(times[1:])[len(times[1:]) // 2]
    return result


def attention_rank(rank: int, world_size: int, config, methods, progress_done: int, progress_total: int) -> list:
    """Every (sequence length, method) case on one rank of a ``world_size`` job; rank 0's list of records
    (one per case, with every rank's measurements) is the result."""
    device, progress = start_rank(rank, config, progress_done, progress_total)
    records = []
    for seq_len in config.seq_lens:
        inputs = make_inputs(config, seq_len, device)
        messages = message_seconds(config, seq_len, world_size, device) if world_size > 1 else None
        for method, mine in measure_methods(methods, inputs, config, rank, world_size, device, progress).items():
            records.append(
                gather_record(
                    mine, method=method, world_size=world_size, seq_len=seq_len, device=device, messages=messages
                )
            )
        del inputs
    return records
