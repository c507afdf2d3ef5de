"""The one compile protocol every front end (the ``ring`` backend, `ringpass.inspect`, `ringpass.convert`) runs on a
graph Dynamo captured: the boundaries in, the pass pipeline, and a retrace where the pipeline asks for one.

1. Boundaries (with ``boundaries=True``): masks that crossed from another graph as their per-token description
   become the tensors that describe them (`crossing_masks.rebuild_mask_inputs`), `SequenceSharded` inputs are taken
   as this rank's tokens (`carried.take_carried_inputs`), and masks the graph returns are described
   (`crossing_masks.describe_mask_outputs`). A converted model is one graph called with whole tensors: none.
2. The pipeline (`ringpass.passes.run_pipeline`), which rewrites ``ctx.gm`` or records why not in ``ctx.report``.
3. ``inputs="sharded"`` under static shapes (`StaticShardedLengths`): the exception that has Dynamo trace the frame
   again with the sequence dims dynamic is raised (`retrace.request_retrace`; the caller lets it through to Dynamo);
   where a retrace cannot help, the refusal is written into the report and raised.
The dynamic-dim marks a retrace added are released once a graph got through (`retrace.release_marks`).
"""

from __future__ import annotations

from collections.abc import Callable

from ringpass.frontend.carried import take_carried_inputs
from ringpass.frontend.crossing_masks import describe_mask_outputs, rebuild_mask_inputs
from ringpass.frontend.retrace import release_marks, request_retrace
from ringpass.fx.context import PassContext
from ringpass.passes import run_pipeline
from ringpass.passes.sharded_lengths import StaticShardedLengths


class Retrace(Exception):
    """Raised by `rewrite_graph` around the exception Dynamo restarts on (``restart``): the caller drops what it
    recorded of this graph and raises ``restart`` from its Dynamo backend."""

    def __init__(self, restart: BaseException):
        super().__init__("ringpass: traced again with the sequence dims dynamic")
        self.restart = restart


def rewrite_graph(
    ctx: PassContext, boundaries: bool = True, before_passes: Callable[[PassContext], None] | None = None
) -> None:
    """Runs the protocol (module docstring) on ``ctx``: `Retrace` when Dynamo must trace again, a `RingpassError`
    when the graph is refused (also in ``ctx.report``), else ``ctx.gm`` rewritten (or recorded as left unchanged).
    ``before_passes`` reads the graph as the boundaries left it, before the pipeline (inspect: its outputs' sizes)."""
    retrace = None
    try:
        if boundaries:
            rebuild_mask_inputs(ctx)
            take_carried_inputs(ctx)
            describe_mask_outputs(ctx)
        if before_passes is not None:
            before_passes(ctx)
        try:
            run_pipeline(ctx)
        except StaticShardedLengths as error:
            retrace = request_retrace(error)
            if retrace is None:
                ctx.report.refusal.message = str(error)
                raise
            raise Retrace(retrace) from None
    finally:
        if retrace is None:
            release_marks()
