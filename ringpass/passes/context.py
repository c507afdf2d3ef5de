"""What the passes share: the graph, the options, the layout, and each analysis pass's findings."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ringpass.options import RingOptions
from ringpass.report import Report

FULL, LOCAL, PARTIAL, NOSEQ = "full", "local", "partial", "noseq"


@dataclass(frozen=True)
class SeqDim:
    """Dimension ``dim`` of a value holds the sequence: its size is outer x seq x ``inner`` (a reshape can
    merge neighbours into it); ``aligned`` is False when its length is not the sequence length
    (``x[:, 1:]``, a concatenation) and it cannot be sharded."""

    dim: int
    inner: int = 1
    aligned: bool = True


@dataclass
class PassContext:
    gm: fx.GraphModule
    example_inputs: list
    options: RingOptions
    world_size: int
    group_name: str
    report: Report = field(default_factory=Report)
    host_values: dict = field(default_factory=dict)  # id(meta tensor of module state) -> its real value (inspect)
    ulysses: Any = None  # Ulysses x ring: (U, the Ulysses group's name, the ring's group name)
    # find_attention
    attention: list = field(default_factory=list)
    # lift_masks
    masks: dict = field(default_factory=dict)             # attention output -> MaskPlan
    lifted: set = field(default_factory=set)              # mask nodes the ring evaluates instead
    whole_values: set = field(default_factory=set)        # mask program inputs: kept whole on every rank
    # sequence_axes
    seq_len: int = 0            # the sequence length as the graph sees it (local length for inputs="sharded")
    global_seq_len: int = 0     # the sequence length of the whole model input
    layout_kind: str = ""
    axes: dict[fx.Node, tuple[SeqDim, ...]] = field(default_factory=dict)
    mixing: dict[fx.Node, str] = field(default_factory=dict)      # node -> why it mixes tokens
    reductions: dict[fx.Node, str] = field(default_factory=dict)  # node -> "sum" | "mean" | "cross_entropy" | "pick"
    sources: dict[fx.Node, str] = field(default_factory=dict)     # node -> "input" | "positions" | "created" | "sliced"
    # placements
    placement: dict[fx.Node, str] = field(default_factory=dict)
    gathered_inputs: set = field(default_factory=set)  # inputs="sharded": inputs a mask program reads whole
    # insert_boundaries: all-reduced totals of partial sums (their gradient must be made whole)
    totals: set = field(default_factory=set)
    # rewrite_decode_attention: inputs every rank holds its own of (a sharded KV cache's slots)
    rank_own_inputs: set = field(default_factory=set)
    # record_gradient_paths: the inputs that train through the captured graph (check_gradient_paths checks them)
    gradient_paths: Any = None
    # the backend: what reduce_grads does for the wrapper it found (None: from options.grads alone)
    gradients: Any = None

    length_nodes: set = field(default_factory=set)  # SymInt inputs whose value is the sequence length
    _graph_lengths: dict = field(default_factory=dict)

    @property
    def dynamic(self) -> bool:
        return isinstance(self.seq_len, torch.SymInt)

    def layout_args(self) -> tuple[Any, ...]:
        """(kind, world_size, seq_len, group_name): what every sequence op takes."""
        return (self.layout_kind, self.world_size, self.graph_length("global"), self.group_name)

    def graph_length(self, which: str):
        """The ``"global"`` sequence length or this rank's ``"local"`` one, as the rewritten graph
        should compute it: an int for static shapes, a node of SymInt arithmetic for dynamic ones."""
        if which not in self._graph_lengths:
            self._graph_lengths[which] = self._static_length(which) if not self.dynamic else self._symbolic_length(which)
        return self._graph_lengths[which]

    def _static_length(self, which: str) -> int:
        from lowering.layout import Layout

        layout = Layout(self.layout_kind, self.world_size, self.global_seq_len)
        return layout.seq_len if which == "global" else layout.local_len

    def _symbolic_length(self, which: str):
        graph = self.gm.graph
        n = self._length_node()
        chunks = self.world_size * (2 if self.layout_kind == "zigzag" else 1)
        first_op = next(node for node in graph.nodes if node.op != "placeholder")
        with graph.inserting_before(first_op):
            if self.options.inputs == "sharded":
                return n if which == "local" else graph.call_function(operator.mul, (n, self.world_size))
            if which == "global":
                return n
            rounded_up = graph.call_function(operator.floordiv, (graph.call_function(operator.add, (n, chunks - 1)), chunks))
            return graph.call_function(operator.mul, (rounded_up, chunks // self.world_size))

    def length_of_input(self):
        """The ``input.size(dim)`` node that measures the full length, if one was made."""
        return self._graph_lengths.get("size")

    def _length_node(self) -> fx.Node:
        """A node whose value is the graph's sequence length: a SymInt input, else ``input.size(dim)``."""
        if self.length_nodes:  # the first in graph order: every rank picks the same one
            return next(n for n in self.gm.graph.nodes if n in self.length_nodes)
        if "size" not in self._graph_lengths:
            source = next(n for n, kind in self.sources.items() if kind == "input")
            first_op = next(node for node in self.gm.graph.nodes if node.op != "placeholder")
            with self.gm.graph.inserting_before(first_op):
                self._graph_lengths["size"] = self.gm.graph.call_method("size", (source, self.axes[source][0].dim))
        return self._graph_lengths["size"]
