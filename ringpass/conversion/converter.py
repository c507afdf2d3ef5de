"""`ringpass.convert`: the ring pass applied once, offline; a module that runs the rewritten graph eagerly.

    converted = ringpass.convert(model, {"input_ids": ids, "labels": labels}, world_size=8)
    converted.save("model.pt2")                        # on any machine, no process group
    ...
    model = ringpass.load("model.pt2")                 # on every rank, under torchrun
    loss = model(input_ids=ids, labels=labels).loss    # the unsharded model's numbers

`convert` captures the model with Dynamo exactly as the ``ring`` backend does (one graph: the whole
forward), runs the same pass pipeline (`ringpass.passes.run_pipeline`) for ``world_size`` ranks and keeps
the rewritten FX graph (`ringpass.conversion.capture`). The `ConvertedModel` (`ringpass.conversion.runtime`)
runs it as plain eager PyTorch: no Dynamo at run time, no recompilation. It binds a call the way the model's
``forward`` does (positional or keyword arguments), reads the graph's inputs from the arguments and from the
model it shares (its parameters *are* the model's: an optimizer on ``model.parameters()`` keeps working), checks
the call against what was converted (argument names, dtypes, shapes; sequence dims free with ``dynamic=True``;
`ringpass.conversion.calls`), and rebuilds the model's output structure (a Hugging Face ``ModelOutput`` stays
one). Each call goes through `ringpass.frontend.guard` like a compiled ring graph. The process group is taken at the
first call (``group=``, else the default group) and must have ``world_size`` ranks.

`ConvertedModel.save` writes a ``torch.export`` artifact (`ringpass.conversion.archive`); `ringpass.load`
(`ringpass.conversion.artifact`) reads it back.
"""

from __future__ import annotations

import inspect as pyinspect
from typing import Any

import torch
import torch.distributed as dist

from lowering import compat
from lowering.errors import InvalidInputError, NotSupportedError
from lowering.groups import resolve_group
from lowering.sequence_ops import EXPORTABLE
from ringpass.conversion.archive import program_inputs
from ringpass.conversion.calls import canonical_call, distinct, flat_tensors, is_plain_value
from ringpass.conversion.capture import capture, describe_arguments, describe_outputs, shape_conditions
from ringpass.conversion.runtime import ConvertedModel, GroupSlots, Program
from ringpass.conversion.saved import NO_DEFAULT, Conversion
from ringpass.frontend.guard import graph_hash
from ringpass.fx.nodes import plain
from ringpass.inspection.inspector import CapturedGraph, Inspection, as_call
from ringpass.options import RingOptions

__all__ = ["ConvertedModel", "convert"]

NOT_CONVERT_OPTIONS = ("compiler", "report", "unsharded")  # eager; reported once; a model without attention is refused


def convert(
    model: torch.nn.Module,
    example_inputs: Any = (),
    *,
    world_size: int | None = None,
    group=None,
    dynamic: bool = False,
    **options: Any,
) -> ConvertedModel:
    """The ``ring`` backend's passes applied once to ``model`` for a ring of ``world_size`` ranks (taken
    from ``group``, or the default process group, when not given); no process group is needed to convert.
    ``example_inputs``: a tensor, a tuple of positional arguments or a dict of keyword arguments, as every
    rank will pass them: the whole sequence (``inputs="sharded"``: one rank's shard, e.g. ``ids[:, :N // P]``,
    since its shape is what each rank passes). ``dynamic=True`` converts with symbolic shapes, so one
    conversion serves many lengths.
    ``options``: the backend's (layout, inputs, outputs, grads, masks, checks, timeout; docs/backend.md); outputs
    are gathered unless ``outputs="sharded"``."""
    for name in NOT_CONVERT_OPTIONS:
        if name in options:
            raise InvalidInputError(
                f"convert: option `{name}` does not apply (a converted graph runs eagerly, its "
                "report is `converted.report`, and a model without attention is refused)."
            )
    world_size = _world_size(world_size, group)
    if options.get("outputs") == "auto":
        raise NotSupportedError(
            "convert: outputs='auto' (SequenceSharded outputs) is not built for converted models; a converted "
            "model's outputs are gathered (the default here) or plain local shards (outputs='sharded')."
        )
    ring_options = RingOptions.from_dict({"outputs": "gathered", **options, "report": "off"})
    if ring_options.ulysses != 1 or getattr(group, "ndim", 1) == 2:
        raise NotSupportedError(
            "convert: Ulysses x ring is not built for converted models yet; compile with "
            "backend='ring' for it, or convert a plain ring (ulysses=1, a 1-D group)."
        )
    if ring_options.layout == "documents":
        raise NotSupportedError(
            "convert: layout='documents' (planned per call from the document ids) is not built for converted models "
            "yet; compile with backend='ring' for it, or convert with layout='zigzag' (exact on packed rows too)."
        )
    model = compat.compiled_module_inner(model)  # a torch.compile'd module: the module it wraps
    signature = pyinspect.signature(model.forward)
    defaults = {p.name: p.default for p in signature.parameters.values() if is_plain_value(p.default)}
    call = distinct(canonical_call(signature, *as_call(example_inputs), where="convert", defaults=defaults))
    captured = capture(model, call, ring_options, world_size, dynamic)
    gm, ctx = captured.gm, captured.ctx
    dynamic = (
        dynamic or ctx.dynamic
    )  # inputs="sharded": traced with the sequence dims dynamic (ringpass.frontend.retrace)
    for node in gm.graph.nodes:  # torch.export keeps these as ops; it would drop an autograd.Function's backward
        if node.target in EXPORTABLE:
            node.target = EXPORTABLE[node.target]
    gm.recompile()
    arguments, placeholders = describe_arguments(call, gm, ctx)
    conversion = Conversion(
        world_size=world_size,
        layout=ctx.layout_kind,
        seq_len=plain(ctx.sequence.global_seq_len),
        dynamic=dynamic,
        options={k: v for k, v in vars(ring_options).items() if k not in ("group", *NOT_CONVERT_OPTIONS)},
        arguments=arguments,
        outputs=describe_outputs(captured, call),
        graph_hash=graph_hash(ctx),
        report_text="",
        report_data={},
        parameters=[
            (p.name, p.kind.name, p.default if is_plain_value(p.default) else NO_DEFAULT)
            for p in signature.parameters.values()
        ],
        signature_text=str(signature),
        masks=sorted(program_inputs(gm)),
    )
    report = Inspection(
        world_size, conversion.options, [CapturedGraph(gm, ctx.report, ctx.placement, ctx.sequence.axes)], "convert"
    )
    conversion.report_text, conversion.report_data = str(report), report.as_dict()
    conversion.shape_conditions = shape_conditions(gm, placeholders, dynamic)
    program = Program(model, gm, placeholders, arguments, captured.global_scope)
    return ConvertedModel(
        model,
        program,
        GroupSlots(gm),
        conversion,
        group=group,
        checks=ring_options.checks,
        timeout=ring_options.timeout,
        report=report,
        example=flat_tensors(call, arguments),
    )


def _world_size(world_size: int | None, group) -> int:
    if world_size is None:
        if group is None and not (dist.is_available() and dist.is_initialized()):
            raise InvalidInputError(
                "convert: give world_size= (the ranks the converted model will run on); no process "
                "group is needed to convert."
            )
        world_size = dist.get_world_size(resolve_group(group))
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise InvalidInputError(f"convert: world_size must be an int >= 2 (the ranks in the ring), got {world_size!r}.")
    return world_size
