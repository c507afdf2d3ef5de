"""The ring op's arguments after q, k, v, spelled once: `RingArgs`.

``ringpass::ring_attention(q, k, v, *args)`` and ``ringpass::ring_attention_backward(dout, q, k, v, out, lse,
dlse, *args, trained)`` take them positionally, in the order of `RingArgs`' fields (compiled graphs and saved
``torch.export`` programs call the ops so). Everything else is derived from the fields: the ops' schemas
(`ring_schema`), every caller's argument list (`RingArgs.op_args`), every reader's view of a call
(`RingArgs.of_call`), and where the tensor lists the mask and bias programs read sit (`PROGRAM_INPUTS`).
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Sequence
from typing import NamedTuple

import torch

# The fields that are lists of tensors the mask and bias programs read: differentiable like q, k, v.
PROGRAM_INPUTS = ("mask_inputs", "bias_inputs")
_LISTS = (*PROGRAM_INPUTS, "alibi_slopes")  # the op takes these as lists
_LEADING = 3  # q, k, v


class RingArgs(NamedTuple):
    """What a ring call says besides q, k, v: the layout as plain values (``ulysses`` > 1: the ring runs across
    Ulysses groups, `lowering.layout.GroupLayout`), the causal flag and scale, the process group by name ("" for
    one process), a sliding ``window``, the mask and bias programs (`lowering.masks` ids) with the tensors each
    reads, the other score modifiers (`lowering.scores`), what a fully masked query gives
    (`lowering.fully_masked`) and how K/V reach the queries: ``strategy`` ``"ring"`` (passed around the ring) or
    ``"all-gather"`` (gathered at once: `lowering.all_gather`). The annotations are the schema's types."""

    layout_kind: str
    world_size: int
    seq_len: int
    is_causal: bool
    scale: float
    group_name: str
    window: int | None = None
    mask_id: str = ""
    mask_inputs: list[torch.Tensor] = ()
    softcap: float | None = None
    alibi_slopes: list[float] | None = None
    bias_id: str = ""
    bias_inputs: list[torch.Tensor] = ()
    fully_masked: str = "zero"
    ulysses: int = 1
    strategy: str = "ring"

    def op_args(self) -> tuple:
        """The ring ops' positional arguments after q, k, v (the tensor lists and the slopes as lists)."""
        return tuple(
            list(value) if name in _LISTS and value is not None else value for name, value in zip(self._fields, self)
        )

    @classmethod
    def of_call(cls, args: Sequence, kwargs: dict | None = None) -> RingArgs:
        """The arguments of a call of ``ringpass::ring_attention`` given its ``args`` (q, k, v first) and
        ``kwargs``: an FX node's ``(node.args, node.kwargs)``, or an op call's."""
        kwargs = {name: value for name, value in (kwargs or {}).items() if name in cls._fields}
        return cls(*args[_LEADING:], **kwargs)

    @classmethod
    def position(cls, field: str) -> int:
        """Where ``field`` sits among ``ringpass::ring_attention``'s arguments (q is 0)."""
        return _LEADING + cls._fields.index(field)

    def program_inputs(self) -> list:
        """Every tensor the mask and bias programs read, in `PROGRAM_INPUTS` order (the backward op numbers
        its ``trained`` inputs so)."""
        return [t for field in PROGRAM_INPUTS for t in getattr(self, field)]

    def programs(self) -> dict[str, list]:
        """The mask and bias programs this call evaluates (`lowering.masks` ids) -> the tensors each reads."""
        programs = {self.mask_id: list(self.mask_inputs), self.bias_id: list(self.bias_inputs)}
        return {program_id: inputs for program_id, inputs in programs.items() if program_id}

    def with_program_inputs(self, tensors: Sequence) -> RingArgs:
        """These arguments with `program_inputs` replaced by ``tensors`` (as many, in the same order)."""
        tensors, replaced = list(tensors), {}
        for field in PROGRAM_INPUTS:
            count = len(getattr(self, field))
            replaced[field], tensors = tensors[:count], tensors[count:]
        return self._replace(**replaced)


def ring_schema(leading: dict, trailing: dict, returns) -> str:
    """The schema of an op that takes ``leading`` arguments, `RingArgs`' fields, then ``trailing`` ones
    (dicts of name -> annotation) and returns ``returns``, as `torch.library` infers it from annotations."""
    fields = typing.get_type_hints(RingArgs)
    parameters = [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotation)
        for name, annotation in {**leading, **fields, **trailing}.items()
    ]

    def prototype():
        pass

    prototype.__signature__ = inspect.Signature(parameters, return_annotation=returns)
    return torch.library.infer_schema(prototype, mutates_args=())
