"""The ``ring`` backend's options, checked once, with errors that say what is allowed."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from lowering.errors import InvalidInputError

CHOICES = {
    "layout": ("auto", "zigzag", "contiguous", "documents"),
    "inputs": ("full", "sharded", "per_rank"),
    "outputs": ("auto", "gathered", "sharded"),
    "compiler": ("inductor", "aot_eager", "eager"),
    "grads": ("auto", "reduced", "mean", "local"),
    "masks": ("lift", "materialize"),
    "report": ("summary", "off"),
    "checks": ("every", "first", "off"),
    "unsharded": ("warn", "error"),
    "cache": ("sharded", "gathered"),
    "strategy": ("ring", "auto", "all-gather"),
    "scans": (None, "heads", "whole", "state", "auto"),
}


@dataclass(frozen=True)
class RingOptions:
    """``group``: a process group, its name, or a one-dimensional `DeviceMesh` (default: the default group); a
    2-D mesh (``mesh["cp", "sp"]``) runs Ulysses x ring: the ring over its first dimension, all-to-all over heads
    inside its second. ``ulysses``: U, for Ulysses x ring over the default group (groups of U consecutive ranks).
    ``layout``: ``auto`` = documents where every attention masks packed documents and outputs leave as
    SequenceSharded (`ringpass.passes.choose_layout`), else zigzag when any attention is causal or masked, or the
    inputs are sharded, else contiguous (the report's summary line names the layout); ``documents``: packed rows
    balanced by their documents (`lowering.DocumentLayout`, planned per call from the document ids the attentions'
    mask reads; inputs='full' or 'per_rank', strategy='ring').
    ``inputs``: ``full`` (every rank passes the whole batch), ``per_rank`` (each rank passes its own batch, as a
    data-parallel loader gives it: the ranks' batches are all-gathered, each rank computes its share of every
    sequence and gets its own batch's outputs and a data-parallel job's gradients: `ringpass.frontend.per_rank`)
    or ``sharded`` (each passes its layout shard,
    made with ``ringpass.shard(x, dim)``; ``ringpass.unshard`` reassembles sharded outputs). With ``sharded``
    the inputs' sequence dims are traced symbolically whatever ``dynamic=`` says (Dynamo traces a static graph
    again with them dynamic: `ringpass.frontend.retrace`), so a read of the length as a number (``x.shape[1]``) is the
    whole sequence's; a length the model fixes while traced (``if n == 64``) is refused.
    ``outputs``: ``auto`` (sequence-sharded outputs leave as `ringpass.SequenceSharded`: the global shape, this
    rank's tokens inside, nothing gathered until ``.full_tensor()``; a graph that receives one takes it as sharded;
    with ``cache="gathered"`` outputs are gathered, caches included),
    ``gathered`` (full outputs on every rank: an all-gather per call) or ``sharded`` (plain local shards, for
    ``ringpass.unshard``).
    ``compiler``: what compiles the rewritten graph. ``grads``: ``auto`` (``mean`` under an FSDP2 / DDP whose
    ranks include the ring's, else ``reduced``; `ringpass.frontend.wrappers`), ``reduced`` (every rank ends with the
    unsharded model's gradient: the ring all-reduces), ``mean`` (each rank's share times P, for an outer mean
    over the ring's ranks) or ``local`` (each rank's share, for an outer sum).
    ``masks``: ``lift`` (masks are evaluated per tile from per-token vectors; a mask that needs a
    sequence x sequence tensor is refused) or ``materialize`` (such a tensor is allowed: every rank
    holds it whole, S x S memory, and the ring reads its tiles).
    ``report``: ``summary`` (rank 0 prints one line per compiled graph to stderr) or ``off``; the full
    report is logged at INFO on the ``ringpass`` logger either way.
    ``checks``: before each call the ranks agree on the graph and the input shapes; ``every`` (inputs that
    must be equal on every rank are also checksummed on every call, parameters and buffers on the first call
    of each graph: under 0.5% of a training step, docs/reliability.md), ``first`` (inputs too only on the
    first call) or ``off`` (no agreement). ``timeout``: seconds a wait may last while
    every peer waits inside ringpass too (a deadlock) before every rank raises.
    ``unsharded``: a graph that runs unsharded on a multi-rank job (no attention found, or no process group
    under a multi-process launch) gives a `RingpassWarning` (``warn``) or an error (``error``).
    ``cache``: ``sharded`` (a `ringpass.ShardedCache` keeps the prefill's keys and values on the ranks that
    hold their tokens and decode steps attend to every rank's part; a decode step against a cache held
    whole on every rank is refused) or ``gathered`` (caches are gathered whole and decode steps run
    unsharded on every rank, as the model does on one device).
    ``strategy``: how each attention runs over the ranks: ``ring`` (K/V around the ring, as ``layout`` and
    ``ulysses`` say), ``all-gather`` (every rank gathers K/V at once) or ``auto`` (per attention the fastest the
    cost model predicts on ``hardware`` among the ring, Ulysses x ring, the all-gather and, for a whole graph,
    none: `ringpass.passes.choose_strategy`; the report lists each alternative's predicted time).
    ``scans``: how a function call that cannot run on a shard (a chunked scan: Mamba2's SSD, Gated DeltaNet) runs:
    ``heads`` (on every token of H / P of its heads on each rank, all-to-all in and out, where it keeps its heads
    apart and they divide by P; else whole, the report saying why), ``whole`` (on the whole sequence on every rank,
    its inputs all-gathered: the unsharded call's memory on every rank) or ``state`` (a call of a scan ringpass knows,
    Hugging Face's ``torch_chunk_gated_delta_rule`` or ``mamba2_chunk_scan``, runs on this rank's chunks only, each
    from the state the chunks before it leave: O(state) bytes, any P, two scans per chunk; other calls as ``heads``)
    or ``auto`` (per call, the faster of ``heads`` and ``state`` as the cost model predicts on ``hardware``; the report
    gives both predictions); docs/backend.md, "Chunked scans". Not given: ``auto`` with ``strategy="auto"``, else
    ``heads`` (`scan_strategy`).
    ``hardware``: what ``auto`` predicts on: None (this machine's kind: NVLink + H100 presets with CUDA, else the
    loopback + CPU calibration), ``"link/device"`` preset names (``"infiniband/h100"``), a ``ringpass bench
    --calibrate --json`` file, or a `lowering.costmodel.Hardware`."""

    group: Any = None
    layout: str = "auto"
    inputs: str = "full"
    outputs: str = "auto"
    compiler: str = "inductor"
    grads: str = "auto"
    masks: str = "lift"
    report: str = "summary"
    checks: str = "every"
    timeout: float = 30.0
    unsharded: str = "warn"
    cache: str = "sharded"
    ulysses: int = 1
    strategy: str = "ring"
    scans: str | None = None
    hardware: Any = None

    @property
    def scan_strategy(self) -> str:
        """``scans``, or where not given what ``strategy`` implies: ``auto`` chooses for the scans too."""
        return self.scans or ("auto" if self.strategy == "auto" else "heads")

    @classmethod
    def from_dict(cls, options: dict | None) -> RingOptions:
        options = dict(options or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidInputError(
                f"Unknown ring backend option(s) {', '.join(unknown)}; the options are {', '.join(sorted(known))}."
            )
        result = cls(**options)
        for name, allowed in CHOICES.items():
            value = getattr(result, name)
            if value not in allowed:
                raise InvalidInputError(
                    f"Ring backend option {name}={value!r} is not one of {', '.join(map(repr, allowed))}."
                )
        if result.inputs == "per_rank" and result.outputs == "sharded":
            raise InvalidInputError(
                "inputs='per_rank' returns each rank its own batch's outputs, whole; outputs='sharded' (plain local "
                "shards of every rank's batch) does not apply. Use outputs='auto' (the default) or 'gathered'."
            )
        if result.strategy != "ring" and (result.ulysses != 1 or getattr(result.group, "ndim", 1) == 2):
            asked = f"ulysses={result.ulysses}" if result.ulysses != 1 else "a 2-D DeviceMesh as group"
            raise InvalidInputError(
                f"strategy={result.strategy!r} chooses how attention runs itself; {asked} asks for Ulysses x ring: "
                "give one of them (strategy='ring' with Ulysses, or strategy='auto' over a 1-D group)."
            )
        if result.layout == "documents" and (
            result.inputs == "sharded" or result.strategy != "ring" or result.ulysses != 1 or result.cache == "gathered"
        ):
            raise InvalidInputError(
                "layout='documents' plans each call's layout from the whole batch's document ids, and runs the plain "
                "ring: it needs inputs='full' or 'per_rank', strategy='ring', no Ulysses and cache='sharded' (the "
                f"defaults); got inputs={result.inputs!r}, strategy={result.strategy!r}, ulysses={result.ulysses}, "
                f"cache={result.cache!r}. Use layout='zigzag' for the others."
            )
        if isinstance(result.timeout, bool) or not isinstance(result.timeout, (int, float)) or not result.timeout > 0:
            raise InvalidInputError(
                f"Ring backend option timeout={result.timeout!r} must be a positive number of seconds."
            )
        return result
