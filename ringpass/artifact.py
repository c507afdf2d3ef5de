"""A converted model on disk: `save` writes it, `load` reads it back on each rank.

The file is a ``torch.export`` archive (``torch.export.load`` reads it as it is): the `ringpass.convert.Program`
exported with ``torch.export`` (its graph calls the ``ringpass`` custom ops; dims converted symbolic are
``Dim.AUTO``), its parameters and buffers, and two extra files:

- ``extra/ringpass.json``: what a `ConvertedModel` needs besides its program (`Conversion`: world size,
  layout, sequence length, options, the call's arguments and output structure as pytree specs, the graph
  hash the ranks compare, the report), the ``ringpass`` / ``torch`` versions and format version it was
  written with, and each mask program the ring ops call, itself exported with ``torch.export`` (base64);
- ``extra/ringpass.sha256``: the SHA-256 of every other member, so a changed file is refused at load.

`load` checks format, versions and digest, registers the mask programs under the ids the graph names,
and gives a `ConvertedModel` that runs the program once a process group of the converted world size exists.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import io
import json
import os
import zipfile
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.export import Dim

from lowering.errors import InvalidInputError, NotSupportedError
from lowering.masks import mask_program, register_mask
from ringpass.convert import GROUP, Argument, Conversion, ConvertedModel, GroupSlots, Outputs, Program, TensorSpec
from ringpass.graph import example_value, plain
from ringpass.options import RingOptions

FORMAT = "ringpass.converted-model"
FORMAT_VERSION = 1
META, DIGEST = "ringpass.json", "ringpass.sha256"


def save(converted: ConvertedModel, path) -> None:
    """Write ``converted`` to ``path`` (a ``.pt2`` file; see the module docstring)."""
    from ringpass import __version__

    program = converted._program
    if not isinstance(program, Program):  # a loaded model: its own archive holds the same program
        raise NotSupportedError("save: this model was loaded from an artifact; copy that file instead of saving it again.")
    converted._slots.bind(GROUP)  # the artifact names the group by its stand-in; each run binds its own
    c = converted.conversion
    dynamic_shapes = (tuple({d: Dim.AUTO for d, size in enumerate(s.shape) if size is None} or None
                            for s in c.tensor_inputs),) if c.dynamic else None  # one entry: forward(*tensors)
    try:
        # a view example (ids[:, :8]) would have export guard its base's size too (`_base.size()[1] != ...`)
        example = tuple(t.clone() if isinstance(t, torch.Tensor) and t._base is not None else t for t in converted._example)
        exported = torch.export.export(program, example, dynamic_shapes=dynamic_shapes, strict=False)
        masks = {mask_id: _export_mask(program.gm, mask_id, c.dynamic) for mask_id in c.masks}
    except Exception as error:
        raise NotSupportedError(f"save: torch.export could not export the converted graph ({type(error).__name__}: "
                                f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}); please report "
                                "this model. The converted model itself runs.") from error
    meta = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "ringpass": __version__, "torch": torch.__version__,
        "conversion": _conversion_to_json(c), "masks": masks,
    }
    torch.export.save(exported, path, extra_files={META: json.dumps(meta)})
    with zipfile.ZipFile(path, "a") as archive:
        root = _root(archive)
        archive.writestr(f"{root}extra/{DIGEST}", _digest(archive, root))


def load(path, *, group=None, device=None, checks: Optional[str] = None, timeout: Optional[float] = None) -> ConvertedModel:
    """The converted model saved at ``path``. ``group``: the process group it runs on (default: the default
    group, taken at the first call); ``device``: where to put its parameters and the devices its graph names
    (default: where it was converted); ``checks`` / ``timeout``: as the backend's options (default: as converted)."""
    from ringpass import __version__

    if not os.path.isfile(path):
        raise InvalidInputError(f"load: no file {path!r}.")
    meta = _read_checked(path)
    _check_versions(meta, __version__)
    exported = torch.export.load(path)
    if device is not None:
        exported = _moved(exported, torch.device(device))
    for mask_id, blob in meta["masks"].items():
        program = torch.export.load(io.BytesIO(base64.b64decode(blob)))
        register_mask((_moved(program, torch.device(device)) if device is not None else program).module(), mask_id=mask_id)
    conversion = _conversion_from_json(meta["conversion"])
    module = exported.module()
    given = {k: v for k, v in (("checks", checks), ("timeout", timeout)) if v is not None}
    options = RingOptions.from_dict({**{k: conversion.options[k] for k in ("checks", "timeout")}, **given})
    return ConvertedModel(module.model, module, GroupSlots(module), conversion, group=group, checks=options.checks,
                          timeout=options.timeout, report=SavedReport(conversion.report_text, conversion.report_data))


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


def _moved(exported, device: torch.device):
    """``exported`` with its state on ``device`` and every device its graph names replaced by it (torch's
    pass rewrites ``device=`` keywords only; the ring ops take the device positionally)."""
    from torch.export.passes import move_to_device_pass

    exported = move_to_device_pass(exported, device)
    for node in exported.graph.nodes:
        node.args, node.kwargs = pytree.tree_map_only(torch.device, lambda _: device, (node.args, node.kwargs))
    exported.graph_module.recompile()
    return exported


# ---- mask programs ---------------------------------------------------------------------------------------
def _export_mask(gm: fx.GraphModule, mask_id: str, dynamic: bool) -> str:
    """The mask program ``mask_id``, exported on positions of any length and the inputs the ring op passes it."""
    inputs = next(_mask_inputs(node, mask_id) for node in gm.graph.nodes if mask_id in node.args)
    device = inputs[0].device if inputs else torch.device("cpu")
    positions = torch.arange(3, device=device)
    examples = (positions, positions.clone(), *(torch.zeros([plain(s) for s in v.shape], dtype=v.dtype, device=v.device)
                                                for v in inputs))
    shapes = [{0: Dim.AUTO}, {0: Dim.AUTO}]
    shapes += [{d: Dim.AUTO for d, s in enumerate(v.shape) if isinstance(s, torch.SymInt)} or None if dynamic else None
               for v in inputs]
    exported = torch.export.export(mask_program(mask_id), examples, dynamic_shapes=tuple(shapes), strict=False)
    buffer = io.BytesIO()
    torch.export.save(exported, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def _mask_inputs(node: fx.Node, mask_id: str) -> list:
    """The example values of the tensors a ring op passes to mask program ``mask_id`` (the argument after it)."""
    i = list(node.args).index(mask_id)
    return [example_value(n) for n in node.args[i + 1]]


# ---- the archive -----------------------------------------------------------------------------------------
def _root(archive: zipfile.ZipFile) -> str:
    """The folder torch.export writes the archive's members under (``model/``)."""
    meta = next((n for n in archive.namelist() if n.endswith(f"extra/{META}")), None)
    if meta is None:
        raise InvalidInputError(f"load: {archive.filename!r} is not a ringpass converted model (no {META} in it); "
                                "make one with ringpass.convert(...).save(path) or `ringpass convert`.")
    return meta[: -len(f"extra/{META}")]


def _digest(archive: zipfile.ZipFile, root: str) -> str:
    sha = hashlib.sha256()
    for name in sorted(n for n in archive.namelist() if n != f"{root}extra/{DIGEST}"):
        sha.update(name.encode() + b"\0" + archive.read(name))
    return sha.hexdigest()


def _read_checked(path) -> dict:
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise InvalidInputError(f"load: {path!r} is not a converted model (not a torch.export archive).") from None
    with archive:
        root = _root(archive)
        try:
            recorded = archive.read(f"{root}extra/{DIGEST}").decode()
        except KeyError:
            raise InvalidInputError(f"load: {path!r} has no digest; it was not written by ringpass, or was rewritten.") from None
        if _digest(archive, root) != recorded:
            raise InvalidInputError(f"load: {path!r} was changed after it was saved (its contents do not match the "
                                    "digest written with them). Convert and save the model again.")
        return json.loads(archive.read(f"{root}extra/{META}"))


def _check_versions(meta: dict, ringpass_version: str) -> None:
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise InvalidInputError(f"load: the artifact's format is {meta.get('format')} version {meta.get('format_version')}; "
                                f"this ringpass ({ringpass_version}) reads {FORMAT} version {FORMAT_VERSION}. Convert "
                                "the model again with this ringpass.")
    for name, saved, here in (("ringpass", meta["ringpass"], ringpass_version), ("torch", meta["torch"], torch.__version__)):
        if saved.split(".")[:2] != here.split(".")[:2]:
            raise InvalidInputError(f"load: the artifact was written with {name} {saved}; this process has {name} {here}. "
                                    f"Converted graphs call {name}'s ops by their schema, which can change between "
                                    f"versions: convert the model again with {name} {here}, or run {name} {saved}.")


# ---- the conversion as JSON --------------------------------------------------------------------------------
def _conversion_to_json(c: Conversion) -> dict:
    try:
        arguments = [{"name": a.name, "spec": pytree.treespec_dumps(a.spec),
                      "leaves": [_leaf_to_json(leaf) for leaf in a.leaves]} for a in c.arguments]
        outputs = {"spec": pytree.treespec_dumps(c.outputs.spec), "leaves": [list(leaf) for leaf in c.outputs.leaves]}
    except Exception as error:
        raise NotSupportedError(f"save: the model's inputs or outputs hold a type torch's pytree cannot write "
                                f"({error}); register it with torch.utils._pytree.register_pytree_node(..., "
                                "serialized_type_name=...).") from None
    return {"world_size": c.world_size, "layout": c.layout, "seq_len": c.seq_len, "dynamic": c.dynamic,
            "options": c.options, "parameters": c.parameters, "arguments": arguments, "outputs": outputs,
            "graph_hash": c.graph_hash, "report_text": c.report_text, "report_data": c.report_data, "masks": c.masks,
            "signature_text": c.signature_text, "shape_conditions": c.shape_conditions}


def _leaf_to_json(leaf) -> Any:
    if isinstance(leaf, TensorSpec):
        return {"tensor": leaf.index, "name": leaf.name, "dtype": str(leaf.dtype)[6:], "shape": leaf.shape,
                "sharded": leaf.sharded}
    return {"constant": leaf}


def _conversion_from_json(data: dict) -> Conversion:
    arguments = [Argument(a["name"], _spec(a["spec"]),
                          [TensorSpec(leaf["tensor"], leaf["name"], getattr(torch, leaf["dtype"]), leaf["shape"], leaf["sharded"])
                           if "tensor" in leaf else leaf["constant"] for leaf in a["leaves"]]) for a in data["arguments"]]
    outputs = Outputs(_spec(data["outputs"]["spec"]), [tuple(leaf) for leaf in data["outputs"]["leaves"]])
    return Conversion(data["world_size"], data["layout"], data["seq_len"], data["dynamic"], data["options"], arguments,
                      outputs, data["graph_hash"], data["report_text"], data["report_data"],
                      parameters=[tuple(p) for p in data["parameters"]], masks=data["masks"],
                      signature_text=data["signature_text"], shape_conditions=data["shape_conditions"])


def _spec(text: str) -> pytree.TreeSpec:
    """A pytree spec from its JSON, after importing the modules of the types it names (a Hugging Face
    ``ModelOutput`` registers itself when its module is imported)."""
    for name in set(_type_names(json.loads(text))):
        module = name.rpartition(".")[0]
        if module:
            try:
                importlib.import_module(module)
            except ImportError:
                raise InvalidInputError(f"load: the model's inputs or outputs are {name}, and {module} cannot be imported "
                                        "here; install it.") from None
    return pytree.treespec_loads(text)


def _type_names(node) -> list[str]:
    if isinstance(node, list):
        return [n for item in node for n in _type_names(item)]
    if isinstance(node, dict):
        found = [node["type"]] if isinstance(node.get("type"), str) and "." in node["type"] else []
        return found + [n for child in node.get("children_spec", []) for n in _type_names(child)]
    return []
