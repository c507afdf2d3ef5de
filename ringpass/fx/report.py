"""What one compile found and did, pass by pass, as data (`Report`) and as text for people.

The passes append records; `ringpass.inspect` and the backend read the same report. ``str(report)`` is the
full report (logged at INFO by the backend), `Report.summary` the one line the backend prints per graph,
`Report.as_dict` the data behind ``ringpass inspect --json`` (keys documented in docs/inspect.md).
"""

from __future__ import annotations

import logging
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field, replace

from lowering.costmodel import BACKWARD_FLOPS_RATIO, AttentionShape, RingCost, ring_cost, ulysses_shape
from lowering.layout import DOCUMENTS_KIND, GroupLayout, Layout

logger = logging.getLogger("ringpass")
summary_logger = logging.getLogger("ringpass.summary")


@dataclass
class MixerRecord:
    """One sequence mixer other than attention (`ringpass.passes.find_sequence_mixers`) and how it runs."""

    module: str  # the user's module path, "" at the top level
    source: str  # file, line and code of the op
    kind: str  # "causal depthwise conv1d, width 4, 80 channels" | "cumulative sum along dim 1"
    strategy: str  # how it runs on the ranks ("state passing: ...", or computed whole and why)
    bytes_per_call: int = 0  # what each rank sends in the forward


@dataclass
class AttentionRecord:
    """One attention and what became of it."""

    module: str  # the user's module path ("model.layers.0.self_attn"), "" at the top level
    source: str  # file, line and code of the attention call
    spelling: str  # "sdpa" | "hand-written"
    mask: str  # "none" | "causal" | "causal, window W" | "program" | "program + causal" ...
    is_causal: bool
    window: int | None
    mask_inputs: list[str]  # per-token values a lifted mask program reads (kept whole on every rank)
    batch: int
    query_heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    itemsize: int
    scale: float
    score_mods: list[str] = field(default_factory=list)  # soft-cap, ALiBi slopes, a lifted bias program
    fully_masked: str = "zero"  # what a query whose keys are all hidden gives (lowering.fully_masked)
    # strategy="auto" / "all-gather": how it runs and, for auto, every alternative's predicted time ("" = the ring)
    strategy: str = ""
    # with a strategy: the bytes it holds on a rank at the backward's peak beyond q, k, v and the output gradient
    # (`lowering.costmodel.strategy_memory`: the all-gather's P KV blocks, Ulysses' exchanged heads)
    working_bytes: int = 0

    def shape(self) -> AttentionShape:
        return AttentionShape(
            self.batch, self.query_heads, self.kv_heads, self.head_dim, self.itemsize, self.is_causal, self.window
        )


@dataclass
class ValueRecord:
    """A graph input, an output, or a value computed whole: where it lives after the rewrite."""

    name: str  # argument name, module state path, or "output 0"
    shape: list
    dtype: str
    # "sharded" | "whole" | "replicated" | "gathered" | "partial" | "carried" (a `SequenceSharded` in or out);
    # inputs="per_rank": "exchanged" (an activation sent by tokens) | "assembled" (an output sent to its owner)
    placement: str
    dim: int | None = None  # the sequence dimension, when it has one
    why: str = ""  # for values kept whole: the op that needs them; for outputs: where they come from
    nbytes: int = 0


@dataclass
class CollectiveRecord:
    """Communication the rewrite inserted, with its size per call."""

    kind: str  # "all-gather" | "all-reduce" | "ring"
    phase: str  # "forward" | "backward"
    what: str
    source: str
    nbytes: int


@dataclass
class Refusal:
    """Why the pass refused the graph: the message, the blocking op, and the chain of ops to it."""

    message: str
    op: str = ""  # the blocking op ("cumsum")
    source: str = ""  # its file and line ("model.py:88")
    chain: list[str] = field(default_factory=list)


@dataclass
class Report:
    """Filled in by the passes (see the record types); ``str(report)`` is the human summary."""

    world_size: int = 1
    graph_index: int = 0
    layout: str = ""
    seq_len: int | None = None
    attention: list[AttentionRecord] = field(default_factory=list)
    mixers: list[MixerRecord] = field(default_factory=list)  # sequence mixers other than attention
    positions: list[str] = field(default_factory=list)
    inputs: list[ValueRecord] = field(default_factory=list)
    outputs: list[ValueRecord] = field(default_factory=list)
    computed_whole: list[str] = field(default_factory=list)
    masks: list[str] = field(default_factory=list)  # masks crossing the boundary as per-token descriptions
    collectives: list[CollectiveRecord] = field(default_factory=list)
    gradients: str = ""  # "reduced" | "mean" | "local"
    gradients_why: str = ""  # the wrapper grads="auto" found, or why the choice costs traffic
    ulysses: int = 1  # Ulysses x ring: the ranks of each all-to-all group
    activation_bytes: dict = field(default_factory=dict)  # {"per_rank": .., "unsharded": .., "whole": ..}
    warnings: list[str] = field(default_factory=list)
    differs: list[str] = field(default_factory=list)  # where the numbers can differ from the model's
    refusal: Refusal | None = None
    unchanged: str = ""  # why the graph runs unchanged (one rank, no attention, strategy="auto" chose so)
    runs_whole: bool = False  # strategy="auto" chose no sequence parallelism for the graph (``unchanged`` says why)
    unchanged_runs: str = "(replicated) on every rank"  # where such a graph runs (inputs="per_rank": each rank's batch)
    decode: int = 0  # decode attentions rewritten to attend to a sharded KV cache where it lies
    cache: str = ""  # what became of the KV cache in this graph
    notes: list[str] = field(default_factory=list)  # how the graph was taken, ended on the summary line

    # ---- derived -------------------------------------------------------------------------------------
    @property
    def status(self) -> str:
        """ "rewritten", "refused", "whole" (``strategy="auto"`` chose so), "no attention" or "unchanged" (one
        rank)."""
        if self.refusal is not None:
            return "refused"
        if self.runs_whole:
            return "whole"
        if self.attention or self.mixers or self.decode or self.carried():
            return "rewritten"
        return "no attention" if self.world_size > 1 else "unchanged"

    @property
    def layout_object(self) -> Layout | None:
        """The layout (None under dynamic shapes, or with documents: `lowering.DocumentLayout` is planned per call)."""
        if not self.layout or self.layout == DOCUMENTS_KIND or not isinstance(self.seq_len, int):
            return None
        return Layout(self.layout, self.world_size, self.seq_len)

    def ring_costs(self) -> list[tuple[list[int], RingCost]]:
        """(indices of the attentions, their cost) for each distinct attention shape the ring runs (not those
        ``strategy`` gives to Ulysses or the all-gather: their predicted times are in their lines); with Ulysses x
        ring, the ring across the groups on each rank's share of the heads."""
        layout = self.layout_object
        if layout is not None and self.ulysses > 1:
            layout = GroupLayout(layout, self.ulysses)
        groups: dict[AttentionShape, list[int]] = {}
        for i, a in enumerate(self.attention):
            if a.strategy and not a.strategy.startswith("ring"):  # strategy="auto" chose Ulysses or the all-gather
                continue
            shape = a.shape() if self.ulysses == 1 else ulysses_shape(a.shape(), self.ulysses)
            groups.setdefault(shape, []).append(i)
        return [] if layout is None else [(idx, ring_cost(layout, shape)) for shape, idx in groups.items()]

    def carried(self) -> int:
        """How many inputs and outputs cross the graph's boundary sharded (`SequenceSharded`: nothing gathered)."""
        return sum(v.placement == "carried" for v in (*self.inputs, *self.outputs))

    def gathered_bytes(self) -> int:
        """Bytes of the forward all-gathers (gathered outputs) per call."""
        return sum(c.nbytes for c in self.collectives if c.kind == "all-gather" and c.phase == "forward")

    # ---- text ----------------------------------------------------------------------------------------
    def summary(self) -> str:
        """One line: what happened to this graph."""
        head = f"ringpass: graph {self.graph_index}:"
        if self.status == "refused":
            blocking = f" at {self.refusal.op} ({self.refusal.source})" if self.refusal.op else ""
            return f"{head} REFUSED{blocking}: the ring backend raises NotSupportedError (reason below)"
        if self.status != "rewritten":
            return (
                f"{head} {self.unchanged or self.cache or 'no attention found'}: "
                f"the graph runs unchanged {self.unchanged_runs}"
                + (f", {len(self.masks)} mask(s) crossing as per-token descriptions" if self.masks else "")
            )
        if self.decode:
            return (
                f"{head} {self.decode} decode attention(s) against a KV cache sharded over {self.world_size} ranks "
                f"({self.cache}), {size_text(self.gathered_bytes())} all-gathered per call"
            )
        over = (
            f"{self.world_size} ranks"
            if self.ulysses == 1
            else f"{self.world_size} ranks (Ulysses x ring: all-to-all over heads in groups of {self.ulysses}, "
            f"the ring over {self.world_size // self.ulysses} groups)"
        )
        what = (
            f"{len(self.attention)} attention(s) rewritten to ring attention over {over}"
            if self.attention
            else f"no attention, sharded over {over}"
        )
        passing = sum(m.strategy.startswith("state passing") for m in self.mixers)
        if passing:
            what += f", {passing} sequence mixer(s) passing state between ranks"
        chosen = Counter(a.strategy.split(",")[0] for a in self.attention if a.strategy)
        what += "".join(f", {count} by {strategy}" for strategy, count in chosen.items())
        carried = f", {self.carried()} value(s) carried sharded across its boundaries" if self.carried() else ""
        carried += f", {len(self.masks)} mask(s) crossing as per-token descriptions" if self.masks else ""
        notes = "".join(f"; {note}" for note in self.notes)
        return (
            f"{head} {what}, layout {self.layout}, sequence {self.seq_len}, "
            f"{size_text(self.gathered_bytes())} all-gathered per call{carried}{notes}"
        )

    def __str__(self) -> str:
        lines = [self.summary()]
        if self.refusal is not None:
            lines += _section(
                "refused",
                [self.refusal.message]
                + (
                    ["chain of ops between the attention and the blocking op: " + " -> ".join(self.refusal.chain)]
                    if len(self.refusal.chain) > 1
                    else []
                ),
            )
        lines += _section("attention", attention_lines(self.attention))
        lines += _section("sequence mixers", [_mixer_text(m) for m in self.mixers])
        lines += _section("positions", self.positions)
        for title, placement in (
            ("inputs sharded (each rank gets its tokens)", "sharded"),
            ("inputs carried in sharded (SequenceSharded from another graph: 0 bytes at the boundary)", "carried"),
            ("inputs sent by tokens (inputs='per_rank': each rank's own activation, one all-to-all)", "exchanged"),
            ("inputs kept whole on every rank", "whole"),
            ("inputs replicated (no sequence axis)", "replicated"),
        ):
            lines += _section(title, [_value_text(v) for v in self.inputs if v.placement == placement])
        lines += _section("values computed whole on every rank", self.computed_whole)
        for title, placement in (
            ("outputs gathered", "gathered"),
            ("outputs left sharded", "sharded"),
            ("outputs carried out sharded (SequenceSharded: 0 bytes until .full_tensor())", "carried"),
            (
                "outputs assembled whole for the rank whose batch they are (inputs='per_rank': one all-to-all)",
                "assembled",
            ),
            ("outputs replicated", "replicated"),
        ):
            lines += _section(title, [_value_text(v) for v in self.outputs if v.placement == placement])
        lines += _section("masks crossing as their per-token description (SequenceMask: no S x S)", self.masks)
        lines += _section("KV cache", [self.cache] if self.cache else [])
        lines += _section("collectives inserted (per call)", _collectives_text(self.collectives))
        if self.gradients_why or self.gradients in ("local", "mean"):
            lines += _section("gradients", [self.gradients_why or GRADIENTS_TEXT[self.gradients]])
        if self.activation_bytes:
            a = self.activation_bytes
            lines += _section(
                "sequence-sharded activations",
                [
                    f"{size_text(a['per_rank'])} per rank at P={self.world_size} vs {size_text(a['unsharded'])} at P=1 "
                    f"(every sharded value the graph computes, counted once); "
                    f"{size_text(a['whole'])} computed whole on every rank"
                ],
            )
        for indices, cost in self.ring_costs():
            across = (
                ""
                if self.ulysses == 1
                else f" (across the Ulysses groups, as ranks; 1/{self.ulysses} of the heads each)"
            )
            lines += _section(f"ring, per call of each of attention(s) {_ranges(indices)}{across}", ring_text(cost))
        lines += _section("where the results can differ from the model's", self.differs)
        lines += _section("warnings", self.warnings)
        return "\n".join(lines)

    def log(self, rank: int = 0, print_summary: bool = True) -> None:
        """The full report at INFO on the ``ringpass`` logger; the summary line on rank 0 (stderr), and a
        WARNING line for each place where the results can differ from the model's."""
        logger.info("%s", self)
        if print_summary and rank == 0:
            if not summary_logger.handlers:
                summary_logger.addHandler(_StderrHandler())
                summary_logger.setLevel(logging.INFO)
                summary_logger.propagate = False
            summary_logger.info("%s", self.summary())
            for difference in self.differs:
                summary_logger.warning("ringpass: graph %d: WARNING: %s", self.graph_index, difference)

    # ---- data ----------------------------------------------------------------------------------------
    def as_dict(self) -> dict:
        layout = self.layout_object
        data = {
            "index": self.graph_index,
            "status": self.status,
            "world_size": self.world_size,
            "layout": self.layout or None,
            "seq_len": self.seq_len,
            "local_len": layout.local_len if layout else None,
            "tokens_per_rank": [layout.valid_len(r) for r in range(self.world_size)] if layout else None,
            "attentions": [asdict(a) for a in self.attention],
            "mixers": [asdict(m) for m in self.mixers],
            "positions": self.positions,
            "inputs": [asdict(v) for v in self.inputs],
            "outputs": [asdict(v) for v in self.outputs],
            "computed_whole": self.computed_whole,
            "masks": self.masks,
            "collectives": [asdict(c) for c in self.collectives],
            "gradients": self.gradients or None,
            "gradients_why": self.gradients_why or None,
            "ulysses": self.ulysses,
            "activations": self.activation_bytes or None,
            "ring": [ring_dict(indices, cost) for indices, cost in self.ring_costs()],
            "refusal": asdict(self.refusal) if self.refusal else None,
            "decode_attentions": self.decode,
            "cache": self.cache or None,
            "warnings": self.warnings,
            "differs": self.differs,
            "notes": self.notes,
        }
        return data


class _StderrHandler(logging.Handler):
    """Writes to whatever ``sys.stderr`` is when a line is logged (so redirections and pytest see it)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stderr)


def ring_dict(indices: list[int], cost: RingCost) -> dict:
    contiguous = ring_cost(Layout("contiguous", cost.layout.world_size, cost.layout.seq_len), cost.shape)
    return {
        "attentions": indices,
        "kv_bytes_per_hop": cost.kv_bytes_per_hop,
        "dkv_bytes_per_hop": cost.dkv_bytes_per_hop,
        "exchanges": cost.exchanges,
        "schedule": cost.schedule,
        "contiguous_schedule": contiguous.schedule,
        "pairs": cost.pairs,
        "flops_forward": cost.flops_forward,
        "backward_flops_ratio": BACKWARD_FLOPS_RATIO,
        "memory_per_rank": cost.memory(),
        "memory_unsharded": cost.memory(unsharded=True),
    }


def ring_text(cost: RingCost) -> list[str]:
    p, s = cost.layout.world_size, cost.shape
    flops = cost.flops_forward
    busiest = [max(row[step] for row in flops) for step in range(p)]
    per_rank = [sum(row) for row in flops]
    mine, whole = cost.memory(), cost.memory(unsharded=True)
    lines = [
        f"one KV block on the wire: {size_text(cost.kv_bytes_per_hop)} (2 x B {s.batch} x {s.kv_heads} KV heads x "
        f"{cost.layout.local_len} slots x D {s.head_dim} x {s.itemsize} bytes); {p - 1} hops forward, "
        f"{p - 1} KV + {cost.exchanges['backward_dkv']} dK/dV hops ({size_text(cost.dkv_bytes_per_hop)} each) backward",
        f"forward FLOPs per rank: {_flops(min(per_rank))} .. {_flops(max(per_rank))} "
        f"(balance {min(per_rank) / max(max(per_rank), 1):.2f}); "
        f"busiest rank per step: {', '.join(_flops(f) for f in busiest)}",
        f"attention state per rank: {size_text(mine['forward'])} forward / {size_text(mine['backward'])} backward, "
        f"vs {size_text(whole['forward'])} / {size_text(whole['backward'])} unsharded (P=1)",
        f"schedule ({cost.layout.kind}; rank x step; D diagonal, F full, P partial, . skipped):",
    ]
    if p <= SCHEDULE_ROWS_SHOWN:
        lines += [f"  rank {r}: {' '.join(_LETTER[w] for w in row)}" for r, row in enumerate(cost.schedule)]
    else:
        words = [w for row in cost.schedule for w in row]
        lines.append("  " + ", ".join(f"{words.count(w)} {w}" for w in _LETTER) + f" blocks over {p} ranks x {p} steps")
    if isinstance(cost.layout, Layout) and cost.layout.kind != "contiguous" and s.is_causal:
        other = ring_cost(Layout("contiguous", p, cost.layout.seq_len), s)
        skipped = sum(row.count("skipped") for row in other.schedule)
        worst = max(sum(row) for row in other.flops_forward)
        lines.append(
            f"contiguous would skip {skipped} blocks and leave the busiest rank {_flops(worst)} "
            f"(vs {_flops(max(per_rank))} here)"
        )
    return lines


SCHEDULE_ROWS_SHOWN = 32  # larger rings are summarised (the JSON has every block)
_LETTER = {"diagonal": "D", "full": "F", "partial": "P", "skipped": "."}


GRADIENTS_TEXT = {
    "local": "local: each rank keeps its share (a sum over the ring's ranks completes them); replicated "
    "gradients are scaled by 1/P",
    "mean": "mean: each rank's parameter gradient is its share x P, for an outer mean over the ring's ranks",
}
FULLY_MASKED_TEXT = {
    "uniform": "a query with every key hidden averages all keys, as eager (gradients to q, k, v)",
    "uniform_values": "a query with every key hidden averages all keys, as eager (gradients to v)",
}


def attention_lines(attention: list[AttentionRecord]) -> list[str]:
    """One line per kind of attention: attentions that differ only in the numbers of their module paths
    (``model.layers.0.self_attn`` ... ``model.layers.31.self_attn``) share a line with the numbers as ranges."""
    groups: dict[str, list[AttentionRecord]] = {}
    for a in attention:
        pattern = ".".join("#" if part.isdigit() else part for part in a.module.split("."))
        groups.setdefault(_attention_text(replace(a, module=pattern)), []).append(a)
    lines = []
    for members in groups.values():
        if len(members) == 1:
            lines.append(_attention_text(members[0]))
            continue
        paths = list(zip(*(a.module.split(".") for a in members)))
        module = ".".join(
            parts[0] if len(set(parts)) == 1 else "{" + _ranges(sorted(set(map(int, parts)))) + "}" for parts in paths
        )
        lines.append(f"{len(members)} x {_attention_text(replace(members[0], module=module))}")
    return lines


def _attention_text(a: AttentionRecord) -> str:
    average = [FULLY_MASKED_TEXT[a.fully_masked]] if a.fully_masked in FULLY_MASKED_TEXT else []
    mask = "; ".join(
        [a.mask + (f" reading {', '.join(a.mask_inputs)}" if a.mask_inputs else ""), *a.score_mods, *average]
    )
    where = a.module or "top level"
    return (
        f"{where}: {a.spelling} ({mask}, scale {a.scale:.4g}, {a.query_heads} query / {a.kv_heads} key-value heads, "
        f"head dim {a.head_dim}, {a.dtype}) -> ringpass::ring_attention at {a.source}"
        + (f"; strategy {a.strategy}" if a.strategy else "")
    )


def _mixer_text(m: MixerRecord) -> str:
    where = f"{m.module}: " if m.module else ""
    sent = f", {size_text(m.bytes_per_call)} sent per rank per call" if m.bytes_per_call else ""
    return f"{where}{m.kind}: {m.strategy}{sent} ({m.source})"


def _value_text(v: ValueRecord) -> str:
    dim = f", sequence dim {v.dim}" if v.dim is not None else ""
    size = f", {size_text(v.nbytes)} per call" if v.placement == "gathered" else ""
    why = f" ({v.why})" if v.why else ""
    return f"{v.name} {list(v.shape)} {v.dtype}{dim}{size}{why}"


def _collectives_text(collectives: list[CollectiveRecord]) -> list[str]:
    """One line per collective; the backward all-reduces of gradients summed into one line."""
    gradients = [c for c in collectives if c.phase == "backward" and c.kind == "all-reduce"]
    lines = [
        f"{c.phase}: {c.kind} of {c.what}, {size_text(c.nbytes)}" + (f" at {c.source}" if c.source else "")
        for c in collectives
        if c not in gradients
    ]
    if gradients:
        names = [c.what.replace("the gradient of ", "") for c in gradients]
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        lines.append(
            f"backward: all-reduce of the gradients of {len(gradients)} value(s) ({shown}), "
            f"{size_text(sum(c.nbytes for c in gradients))} in all"
        )
    return lines


def _section(title: str, items: list[str]) -> list[str]:
    """A heading and its items; an item starting with spaces continues the one before it."""
    return (
        [f"  {title}:"] + [f"     {item}" if item.startswith(" ") else f"    - {item}" for item in items]
        if items
        else []
    )


def _ranges(indices: list[int]) -> str:
    return (
        f"{indices[0]}"
        if len(indices) == 1
        else (
            f"{indices[0]}-{indices[-1]}"
            if indices == list(range(indices[0], indices[-1] + 1))
            else ", ".join(map(str, indices))
        )
    )


def size_text(nbytes) -> str:
    if not isinstance(nbytes, int):
        return f"{nbytes} bytes"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} bytes"


def _flops(n: int) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} FLOP"
