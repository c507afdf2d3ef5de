"""What the passes share: the graph, the options, the layout, and each analysis pass's findings."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

import torch
import torch.fx as fx

from lowering.layout import DOCUMENTS_KIND, local_length
from ringpass.fx.findings import AttentionMatch, MaskFindings, MixerMatch, SequenceFindings
from ringpass.fx.gradient_reach import CapturedGradients
from ringpass.fx.nodes import example_value
from ringpass.fx.report import Report
from ringpass.hardware import hardware_option
from ringpass.options import RingOptions


class Placement(str, Enum):
    """Where a value lives (DESIGN.md, "Placements"). A str: outside the passes it reads as its value
    (`ringpass.inspection.graph_view` names placements by it)."""

    LOCAL = "local"  # this rank's tokens, in the layout's order (Sharded along the sequence)
    FULL = "full"  # the whole sequence, computed on every rank
    PARTIAL = "partial"  # this rank's share of a sum over the sequence: made whole by an all-reduce
    NOSEQ = "noseq"  # no sequence axis: the same on every rank (Replicated)
    HEADS = "heads"  # every token of this rank's share of the heads (a function call split by heads)


LOCAL, FULL, PARTIAL, NOSEQ, HEADS = (
    Placement.LOCAL,
    Placement.FULL,
    Placement.PARTIAL,
    Placement.NOSEQ,
    Placement.HEADS,
)


class UlyssesGroups(NamedTuple):
    """Ulysses x ring: all-to-all over heads inside groups of ``size`` ranks, the ring across the groups."""

    size: int
    ulysses_group: str  # this rank's Ulysses group, by name
    ring_group: str  # the ring this rank is on, by name


@dataclass(frozen=True)
class GradientMode:
    """What ``reduce_grads`` does: ``mode`` "reduced" | "mean" | "local"; with "mean", parameter shares are
    multiplied by ``scale``; ``why`` is the report's line."""

    mode: str
    scale: float = 1.0
    why: str = ""


@dataclass
class PassContext:
    """The graph being rewritten and what the passes found in it, grouped below by the pass that writes it.

    Example values: ``node.meta["example_value"]`` (read with `ringpass.fx.nodes.example_value`) is the value
    Dynamo traced, at the traced sequence length ``sequence.seq_len`` (the whole sequence with ``inputs="full"``, this
    rank's shard with ``inputs="sharded"``). A node a pass inserts in place of a traced one (the ring's output,
    ``local_positions`` for an ``arange``, ``shard_sequence`` or ``gather_sequence`` of an input, an all-reduced
    total) carries that node's example value, and a node whose sizes a pass rewrites to this rank's length
    keeps its own: example values tell the traced shape, dtype and ``requires_grad`` (later passes find
    sequence dims by comparing sizes with it), never the shape the rewritten graph computes at run
    time. Inserted nodes that stand for no traced value (the ring call itself, arithmetic on lengths, token
    masks) have none; nodes written out before anything is sharded (`expand_multi_head_attention`,
    `devectorize_vmaps`) get theirs computed on fake tensors, as Dynamo would have."""

    gm: fx.GraphModule
    example_inputs: list
    options: RingOptions
    world_size: int
    group_name: str
    report: Report = field(default_factory=Report)
    host_values: dict = field(default_factory=dict)  # id(meta tensor of module state) -> its real value (inspect)
    ulysses: UlyssesGroups | None = None  # Ulysses x ring (None: a plain ring)
    # the backend, strategy="auto": the Ulysses groups of U ranks (made on first ask, on every rank alike); None where
    # none can be made (a sub-group, no process group)
    ulysses_for: Any = None
    per_rank: bool = False  # the backend: inputs="per_rank" (``options.inputs`` reads "full": one rank's batch)
    # the backend: what reduce_grads does for the wrapper it found (None: from options.grads alone)
    gradients: GradientMode | None = None
    # the backend: SequenceSharded inputs (placeholder -> sequence dim), which arrive as this rank's tokens, and
    # their layout kind ("" without any); `ringpass.frontend.carried`
    carried_inputs: dict[fx.Node, int] = field(default_factory=dict)
    carried_layout: str = ""
    # choose_layout: inputs that arrived sharded in the documents layout for a graph that cannot run in it: all-gathered
    # by `CarriedGraph` before the call, then sharded as whole inputs
    whole_carried: set[fx.Node] = field(default_factory=set)
    # exchange_activations, inputs="per_rank": carried inputs that arrive whole, this rank's own batch's activation
    # (`ringpass.frontend.per_rank.PerRankGraph` sends each rank its tokens of every rank's)
    exchanged_inputs: set[fx.Node] = field(default_factory=set)
    # the backend: masks crossing as their per-token description (`ringpass.frontend.crossing_masks`): for each
    # SequenceMask input, its index among the call's arguments -> how many tensors describe it; for each mask output,
    # its index -> `MaskOutput` (the outputs that describe it leave whole)
    mask_inputs: dict[int, int] = field(default_factory=dict)
    mask_outputs: dict = field(default_factory=dict)
    # record_gradient_paths: the inputs that train through the captured graph (check_gradient_paths checks them)
    gradient_paths: CapturedGradients | None = None
    attention: list[AttentionMatch] = field(default_factory=list)  # find_attention
    mixers: list[MixerMatch] = field(default_factory=list)  # find_sequence_mixers
    masks: MaskFindings = field(default_factory=MaskFindings)  # lift_masks
    sequence: SequenceFindings = field(default_factory=SequenceFindings)  # find_sequence_axes
    # choose_strategy: each attention's strategy (None: the ring as the options say) and the Ulysses group sizes used
    strategy: Any = None
    ulysses_used: list[int] = field(default_factory=list)
    # choose_layout
    layout_kind: str = ""
    # choose_layout, layout="documents": the ids value the documents masks read; read_document_ids: its host copy
    document_ids: fx.Node | None = None
    tail: Any = None  # split_tail (inputs="per_rank"): the tail that runs on this rank's own batch (a `Tail`)
    # decide_placements
    placement: dict[fx.Node, Placement] = field(default_factory=dict)
    gathered_inputs: set[fx.Node] = field(default_factory=set)  # inputs="sharded": inputs a mask program reads whole
    # insert_boundaries: all-reduced totals of partial sums (their gradient must be made whole)
    totals: set[fx.Node] = field(default_factory=set)
    # insert_boundaries, outputs="auto": outputs left as this rank's tokens, to be wrapped (output index -> seq dim)
    carried_outputs: dict[int, int] = field(default_factory=dict)
    # rewrite_decode_attention: inputs every rank holds its own of (a sharded KV cache's slots)
    rank_own_inputs: set[fx.Node] = field(default_factory=set)

    _length_args: dict = field(default_factory=dict)  # "global" / "local" / "size" -> what insert_length gave

    @property
    def hardware(self):
        """The `lowering.costmodel.Hardware` ``strategy="auto"`` predicts on (the ``hardware`` option)."""
        return hardware_option(self.options.hardware)

    @property
    def dynamic(self) -> bool:
        return isinstance(self.sequence.seq_len, torch.SymInt)

    def has_sequence(self, node: fx.Node) -> bool:
        """The node's value (or, for a tuple, one of its items) has a sequence axis."""
        if self.sequence.axes.get(node):
            return True
        if not isinstance(example_value(node), (tuple, list)):
            return False
        return any(u.target is operator.getitem and self.sequence.axes.get(u) for u in node.users)

    def layout_args(self) -> tuple[Any, ...]:
        """(kind, world_size, seq_len, group_name): what every sequence op takes (inserts the global length
        node with dynamic shapes: `insert_length`)."""
        return (self.layout_kind, self.world_size, self.insert_length("global"), self.group_name)

    def layout_kwargs(self) -> dict[str, Any]:
        """With the documents layout, the host copy of the document ids (``documents=``) every sequence op plans the
        layout from (`read_document_ids`); else nothing."""
        return {"documents": self.document_ids} if self.layout_kind == DOCUMENTS_KIND else {}

    def insert_length(self, which: str):
        """The ``"global"`` sequence length or this rank's ``"local"`` one, as an argument of a node a pass
        inserts. Static shapes: an int (nothing is inserted). Dynamic shapes: a node computing it from the
        graph's length, inserted before the graph's first op the first time it is asked for (the local
        length by `lowering.layout.local_length`, the runtime's own definition)."""
        if which not in self._length_args:
            self._length_args[which] = self._symbolic_length(which) if self.dynamic else self._static_length(which)
        return self._length_args[which]

    def length_of_input(self):
        """The ``input.size(dim)`` node `insert_length` measured the length with, if it made one."""
        return self._length_args.get("size")

    def _static_length(self, which: str) -> int:
        n = self.sequence.global_seq_len
        return n if which == "global" else local_length(self.layout_kind, self.world_size, n)

    def _symbolic_length(self, which: str) -> fx.Node:
        graph = self.gm.graph
        n = self._length_node()
        with graph.inserting_before(self._first_op()):
            if self.options.inputs == "sharded":  # the graph's length is this rank's
                return n if which == "local" else graph.call_function(operator.mul, (n, self.world_size))
            if which == "global":
                return n
            return graph.call_function(local_length, (self.layout_kind, self.world_size, n))

    def _length_node(self) -> fx.Node:
        """A node whose value is the graph's sequence length: a SymInt input, else ``input.size(dim)``
        (inserted once)."""
        if self.sequence.length_nodes:  # the first in graph order: every rank picks the same one
            return next(n for n in self.gm.graph.nodes if n in self.sequence.length_nodes)
        if "size" not in self._length_args:
            source = next(  # a carried input holds this rank's tokens: its size is not the length
                n for n, kind in self.sequence.sources.items() if kind == "input" and n not in self.carried_inputs
            )
            with self.gm.graph.inserting_before(self._first_op()):
                self._length_args["size"] = self.gm.graph.call_method(
                    "size", (source, self.sequence.axes[source][0].dim)
                )
        return self._length_args["size"]

    def _first_op(self) -> fx.Node:
        return next(node for node in self.gm.graph.nodes if node.op != "placeholder")
