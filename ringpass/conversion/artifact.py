"""`load`: a converted model from the file `ConvertedModel.save` wrote (the file's format:
`ringpass.conversion.archive`), on each rank.

`load` checks format, versions and digest, registers the mask programs under the ids the graph names,
and gives a `ConvertedModel` that runs the program once a process group of the converted world size exists.
"""

from __future__ import annotations

import os

import torch

from lowering.compat import pytree
from lowering.errors import InvalidInputError
from lowering.masks import register_mask
from ringpass.conversion import archive
from ringpass.conversion.runtime import ConvertedModel, GroupSlots
from ringpass.options import RingOptions


def load(path, *, group=None, device=None, checks: str | None = None, timeout: float | None = None) -> ConvertedModel:
    """The converted model saved at ``path``. ``group``: the process group it runs on (default: the default
    group, taken at the first call); ``device``: where to put its parameters and the devices its graph names
    (default: where it was converted); ``checks`` / ``timeout``: as the backend's options (default: as converted)."""
    if not os.path.isfile(path):
        raise InvalidInputError(f"load: no file {path!r}.")
    exported, masks, conversion = archive.read(path)
    tied = _tied_names(exported)
    if device is not None:
        exported = _moved(exported, torch.device(device))
    for mask_id, program in masks.items():
        register_mask(
            (_moved(program, torch.device(device)) if device is not None else program).module(), mask_id=mask_id
        )
    module = exported.module()
    _tie(module, tied)
    given = {k: v for k, v in (("checks", checks), ("timeout", timeout)) if v is not None}
    options = RingOptions.from_dict({**{k: conversion.options[k] for k in ("checks", "timeout")}, **given})
    return ConvertedModel(
        module.model,
        _GuardsSaid(module, [spec.name for spec in conversion.tensor_inputs]),
        GroupSlots(module),
        conversion,
        group=group,
        checks=options.checks,
        timeout=options.timeout,
        report=SavedReport(conversion.report_text, conversion.report_data),
    )


class SavedReport:
    """A loaded model's report: the text and data `ringpass.inspect` gave when it was converted."""

    def __init__(self, text: str, data: dict):
        self.text, self.data = text, data

    def __str__(self) -> str:
        return self.text

    def as_dict(self) -> dict:
        return self.data

    @property
    def status(self) -> str:
        return self.data.get("status", "")


class _GuardsSaid:
    """The loaded program, whose shape guards (what `torch.export` traced it under at save, which can be narrower
    than Dynamo's conditions at conversion: a rank's share of 1 token is specialised) are checked first thing
    in each call: a call they refuse raises `InvalidInputError` naming the arguments, not an `AssertionError`."""

    def __init__(self, module: torch.nn.Module, names: list[str]):
        self.module, self.names = module, names

    def __call__(self, *tensors):
        try:
            return self.module(*tensors)
        except AssertionError as error:
            if not str(error).startswith("Guard failed:"):
                raise
            condition = str(error).removeprefix("Guard failed:").strip()
            for i, name in sorted(enumerate(self.names), reverse=True):  # tensors_12 before tensors_1
                condition = condition.replace(f"tensors_{i}", name)
            shapes = ", ".join(f"{name} {list(t.shape)}" for name, t in zip(self.names, tensors))
            raise InvalidInputError(
                f"The saved program does not run on these inputs ({shapes}): it needs {condition} (a shape "
                "condition torch.export traced it under when it was saved). Call it within its conditions, or "
                "convert and save again with an example of these sizes."
            ) from None


def _tied_names(exported) -> list[list[str]]:
    """Names of the saved parameters and buffers that are one tensor (tied weights: an LM head that is the
    embedding, T5's ``shared`` and ``encoder.embed_tokens``); the file keeps them one storage."""
    groups: dict[tuple, list[str]] = {}
    for name, value in exported.state_dict.items():
        key = (value.untyped_storage().data_ptr(), value.storage_offset(), value.shape, value.stride(), value.dtype)
        groups.setdefault(key, []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _tie(module: torch.nn.Module, tied: list[list[str]]) -> None:
    """Each group of ``tied`` one parameter (or buffer) again: ``ExportedProgram.module()`` gives every name its
    own copy, which would train tied weights apart (each copy getting only its own uses' gradient)."""
    for first, *others in tied:
        value = module.get_parameter(first) if first in dict(module.named_parameters()) else module.get_buffer(first)
        for name in others:
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner), leaf, value)


def _moved(exported, device: torch.device):
    """``exported`` with its state on ``device`` and every device its graph names replaced by it (torch's
    pass rewrites ``device=`` keywords only; the ring ops take the device positionally)."""
    from torch.export.passes import move_to_device_pass

    exported = move_to_device_pass(exported, device)
    for node in exported.graph.nodes:
        node.args, node.kwargs = pytree.tree_map_only(torch.device, lambda _: device, (node.args, node.kwargs))
    exported.graph_module.recompile()
    return exported
