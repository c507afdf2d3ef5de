"""The file a converted model is saved as: `write` writes it, `read` reads and checks it
(`ringpass.conversion.artifact.load` makes a `ConvertedModel` of what it reads).

The file is a ``torch.export`` archive (``torch.export.load`` reads it as it is): the
`ringpass.conversion.runtime.Program` exported with ``torch.export`` (its graph calls the ``ringpass`` custom ops;
dims converted symbolic are ``Dim.AUTO``), its parameters and buffers, and two extra files:

- ``extra/ringpass.json``: what a `ConvertedModel` needs besides its program (`Conversion`: world size,
  layout, sequence length, options, the call's arguments and output structure as pytree specs, the graph
  hash the ranks compare, the report), the ``ringpass`` / ``torch`` versions and format version it was
  written with, and each mask program the ring ops call, itself exported with ``torch.export`` (base64);
- ``extra/ringpass.sha256``: the SHA-256 of every other member, so a changed file is refused at load.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import io
import json
import zipfile
from typing import Any

import torch
import torch.fx as fx
from torch.export import Dim, ExportedProgram

from lowering import compat
from lowering.compat import pytree
from lowering.errors import InvalidInputError, NotSupportedError
from lowering.masks import DOCUMENTS, mask_program
from lowering.ring_args import RingArgs
from ringpass.conversion.saved import Argument, Conversion, Outputs, TensorSpec
from ringpass.fx.nodes import example_value, plain
from ringpass.version import __version__

FORMAT = "ringpass.converted-model"
FORMAT_VERSION = 2  # 2: the ring ops take `RingArgs.strategy` (programs saved at 1 call them without it)
META, DIGEST = "ringpass.json", "ringpass.sha256"


def write(path, program: torch.nn.Module, conversion: Conversion, example: tuple) -> None:
    """Export ``program`` (a `Program`, its graph naming the group by its stand-in) traced with the conversion's
    ``example`` tensors, and write it with its mask programs and ``conversion`` to ``path`` (a ``.pt2`` file)."""
    c = conversion
    dynamic_shapes = (
        (tuple({d: Dim.AUTO for d, size in enumerate(s.shape) if size is None} or None for s in c.tensor_inputs),)
        if c.dynamic
        else None
    )  # one entry: forward(*tensors)
    try:
        # a view example (ids[:, :8]) would have export guard its base's size too (`_base.size()[1] != ...`)
        example = tuple(
            t.clone() if isinstance(t, torch.Tensor) and compat.view_base(t) is not None else t for t in example
        )
        exported = torch.export.export(program, example, dynamic_shapes=dynamic_shapes, strict=False)
        masks = {mask_id: _export_mask(program.gm, mask_id, c.dynamic) for mask_id in c.masks}
    except Exception as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise NotSupportedError(
            f"save: torch.export could not export the converted graph ({type(error).__name__}: {first_line}); "
            "please report this model. The converted model itself runs."
        ) from error
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "ringpass": __version__,
        "torch": torch.__version__,
        "conversion": _conversion_to_json(c),
        "masks": masks,
    }
    torch.export.save(exported, path, extra_files={META: json.dumps(meta)})
    with zipfile.ZipFile(path, "a") as archive:
        root = _root(archive)
        archive.writestr(f"{root}extra/{DIGEST}", _digest(archive, root))


def read(path) -> tuple[ExportedProgram, dict[str, ExportedProgram], Conversion]:
    """The program, the mask programs by id and the `Conversion` saved at ``path``, after checking its format,
    the versions it was written with and its digest."""
    meta = _read_checked(path)
    _check_versions(meta)
    masks = {mask_id: torch.export.load(io.BytesIO(base64.b64decode(blob))) for mask_id, blob in meta["masks"].items()}
    return torch.export.load(path), masks, _conversion_from_json(meta["conversion"])


# ---- mask programs ---------------------------------------------------------------------------------------
def _export_mask(gm: fx.GraphModule, mask_id: str, dynamic: bool) -> str:
    """The mask program ``mask_id``, exported on positions of any length and the inputs the ring op passes it."""
    inputs = [example_value(t) for t in program_inputs(gm)[mask_id]]
    device = inputs[0].device if inputs else torch.device("cpu")
    positions = torch.arange(3, device=device)
    examples = (
        positions,
        positions.clone(),
        *(torch.zeros([plain(s) for s in v.shape], dtype=v.dtype, device=v.device) for v in inputs),
    )
    shapes = [{0: Dim.AUTO}, {0: Dim.AUTO}]
    shapes += [
        {d: Dim.AUTO for d, s in enumerate(v.shape) if isinstance(s, torch.SymInt)} or None if dynamic else None
        for v in inputs
    ]
    exported = torch.export.export(mask_program(mask_id), examples, dynamic_shapes=tuple(shapes), strict=False)
    buffer = io.BytesIO()
    torch.export.save(exported, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def program_inputs(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """Each mask and bias program the graph's ring ops call (`RingArgs.programs`) -> the nodes a call passes it; the
    documents mask is the runtime's own (`lowering.masks.DOCUMENTS`), not saved."""
    return {
        program_id: inputs
        for node in gm.graph.nodes
        if node.target is torch.ops.ringpass.ring_attention.default
        for program_id, inputs in RingArgs.of_call(node.args, node.kwargs).programs().items()
        if program_id != DOCUMENTS
    }


# ---- the archive -----------------------------------------------------------------------------------------
def _root(archive: zipfile.ZipFile) -> str:
    """The folder torch.export writes the archive's members under (``model/``)."""
    meta = next((n for n in archive.namelist() if n.endswith(f"extra/{META}")), None)
    if meta is None:
        raise InvalidInputError(
            f"load: {archive.filename!r} is not a ringpass converted model (no {META} in it); "
            "make one with ringpass.convert(...).save(path) or `ringpass convert`."
        )
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
            raise InvalidInputError(
                f"load: {path!r} has no digest; it was not written by ringpass, or was rewritten."
            ) from None
        if _digest(archive, root) != recorded:
            raise InvalidInputError(
                f"load: {path!r} was changed after it was saved (its contents do not match the "
                "digest written with them). Convert and save the model again."
            )
        return json.loads(archive.read(f"{root}extra/{META}"))


def _check_versions(meta: dict) -> None:
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise InvalidInputError(
            f"load: the artifact's format is {meta.get('format')} version {meta.get('format_version')}; "
            f"this ringpass ({__version__}) reads {FORMAT} version {FORMAT_VERSION}. Convert "
            "the model again with this ringpass."
        )
    for name, saved, here in (("ringpass", meta["ringpass"], __version__), ("torch", meta["torch"], torch.__version__)):
        if saved.split(".")[:2] != here.split(".")[:2]:
            raise InvalidInputError(
                f"load: the artifact was written with {name} {saved}; this process has {name} {here}. "
                f"Converted graphs call {name}'s ops by their schema, which can change between "
                f"versions: convert the model again with {name} {here}, or run {name} {saved}."
            )


# ---- the conversion as JSON --------------------------------------------------------------------------------
def _conversion_to_json(c: Conversion) -> dict:
    try:
        arguments = [
            {
                "name": a.name,
                "spec": pytree.treespec_dumps(a.spec),
                "leaves": [_leaf_to_json(leaf) for leaf in a.leaves],
            }
            for a in c.arguments
        ]
        outputs = {"spec": pytree.treespec_dumps(c.outputs.spec), "leaves": [list(leaf) for leaf in c.outputs.leaves]}
    except Exception as error:
        raise NotSupportedError(
            f"save: the model's inputs or outputs hold a type torch's pytree cannot write "
            f"({error}); register it with torch.utils._pytree.register_pytree_node(..., "
            "serialized_type_name=...)."
        ) from None
    return {
        "world_size": c.world_size,
        "layout": c.layout,
        "seq_len": c.seq_len,
        "dynamic": c.dynamic,
        "options": c.options,
        "parameters": c.parameters,
        "arguments": arguments,
        "outputs": outputs,
        "graph_hash": c.graph_hash,
        "report_text": c.report_text,
        "report_data": c.report_data,
        "masks": c.masks,
        "signature_text": c.signature_text,
        "shape_conditions": c.shape_conditions,
    }


def _leaf_to_json(leaf) -> Any:
    if isinstance(leaf, TensorSpec):
        return {
            "tensor": leaf.index,
            "name": leaf.name,
            "dtype": str(leaf.dtype)[6:],
            "shape": leaf.shape,
            "sharded": leaf.sharded,
        }
    return {"constant": leaf}


def _leaf_from_json(leaf: dict) -> Any:
    if "tensor" in leaf:
        return TensorSpec(leaf["tensor"], leaf["name"], getattr(torch, leaf["dtype"]), leaf["shape"], leaf["sharded"])
    return leaf["constant"]


def _conversion_from_json(data: dict) -> Conversion:
    arguments = [
        Argument(a["name"], _spec(a["spec"]), [_leaf_from_json(leaf) for leaf in a["leaves"]])
        for a in data["arguments"]
    ]
    outputs = Outputs(_spec(data["outputs"]["spec"]), [tuple(leaf) for leaf in data["outputs"]["leaves"]])
    return Conversion(
        data["world_size"],
        data["layout"],
        data["seq_len"],
        data["dynamic"],
        data["options"],
        arguments,
        outputs,
        data["graph_hash"],
        data["report_text"],
        data["report_data"],
        parameters=[tuple(p) for p in data["parameters"]],
        masks=data["masks"],
        signature_text=data["signature_text"],
        shape_conditions=data["shape_conditions"],
    )


def _spec(text: str) -> pytree.TreeSpec:
    """A pytree spec from its JSON, after importing the modules of the types it names (a Hugging Face
    ``ModelOutput`` registers itself when its module is imported)."""
    for name in set(_type_names(json.loads(text))):
        module = name.rpartition(".")[0]
        if module:
            try:
                importlib.import_module(module)
            except ImportError:
                raise InvalidInputError(
                    f"load: the model's inputs or outputs are {name}, and {module} cannot be imported here; install it."
                ) from None
    return pytree.treespec_loads(text)


def _type_names(node) -> list[str]:
    if isinstance(node, list):
        return [n for item in node for n in _type_names(item)]
    if isinstance(node, dict):
        found = [node["type"]] if isinstance(node.get("type"), str) and "." in node["type"] else []
        return found + [n for child in node.get("children_spec", []) for n in _type_names(child)]
    return []
