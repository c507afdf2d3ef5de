"""What the passes share: the graph, the options, the layout, and each analysis pass's findings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    # find_attention
    attention: list = field(default_factory=list)
    # sequence_axes
    seq_len: int = 0            # the sequence length as the graph sees it (local length for inputs="sharded")
    global_seq_len: int = 0     # the sequence length of the whole model input
    layout_kind: str = ""
    axes: dict[fx.Node, tuple[SeqDim, ...]] = field(default_factory=dict)
    mixing: dict[fx.Node, str] = field(default_factory=dict)      # node -> why it mixes tokens
    reductions: dict[fx.Node, str] = field(default_factory=dict)  # node -> "sum" | "mean" | "cross_entropy"
    sources: dict[fx.Node, str] = field(default_factory=dict)     # node -> "input" | "positions" | "created" | "sliced"
    # placements
    placement: dict[fx.Node, str] = field(default_factory=dict)

    @property
    def local_len(self) -> int:
        from lowering.layout import Layout

        return Layout(self.layout_kind, self.world_size, self.global_seq_len).local_len

    def layout_args(self) -> tuple[Any, ...]:
        """(kind, world_size, seq_len, group_name): what every sequence op takes."""
        return (self.layout_kind, self.world_size, self.global_seq_len, self.group_name)
