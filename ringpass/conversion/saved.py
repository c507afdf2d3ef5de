"""What a conversion records besides its program and parameters: the call's arguments (`Argument`, `TensorSpec`),
the output structure (`Outputs`) and the rest of `Conversion`; `ringpass.conversion.archive` saves it as JSON."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lowering.compat import pytree

GROUP = "ringpass:converted-group"  # stands for the run-time process group's name in a converted graph
NO_DEFAULT = "<no default>"  # a forward parameter without a default, in `Conversion.parameters`


@dataclass
class Argument:
    """One argument of the converted call: its name, the pytree structure of its value, and its leaves:
    `TensorSpec` for tensors, plain values (baked in) else."""

    name: str
    spec: pytree.TreeSpec
    leaves: list


@dataclass
class TensorSpec:
    """A tensor leaf of the call: where it goes in the flat program's inputs, what it must look like
    (``None`` in ``shape``: a dim converted symbolic), and whether each rank passes its own shard."""

    index: int
    name: str
    dtype: torch.dtype
    shape: list
    sharded: bool = False


@dataclass
class Outputs:
    """The model's output structure and where each leaf comes from: ``("graph", i)`` the graph's i-th
    output, ``("input", i)`` the i-th tensor input passed through, ``("constant", value)``."""

    spec: pytree.TreeSpec
    leaves: list


@dataclass
class Conversion:
    """Everything a `ConvertedModel` needs besides its program and parameters (what an artifact saves)."""

    world_size: int
    layout: str
    seq_len: int
    dynamic: bool
    options: dict
    arguments: list[Argument]
    outputs: Outputs
    graph_hash: str
    report_text: str
    report_data: dict
    parameters: list[tuple] = field(default_factory=list)  # the forward's (name, kind, default or NO_DEFAULT)
    signature_text: str = ""  # the forward's signature as its code spells it, for messages
    masks: list[str] = field(default_factory=list)  # ids of the mask programs the graph's ring ops call
    # dynamic: what Dynamo assumed of the shapes (`ringpass.conversion.capture.shape_conditions`)
    shape_conditions: dict | None = None

    @property
    def tensor_inputs(self) -> list[TensorSpec]:
        return [leaf for a in self.arguments for leaf in a.leaves if isinstance(leaf, TensorSpec)]
