"""Where a graph with symbolic sizes has a part that runs at its traced sizes only: `needs_static_shapes` is the
error a pass raises there. Under whole inputs it is `NeedsStaticShapes`, which the front ends answer by having Dynamo
trace the frame again with those sizes static (`ringpass.frontend.retrace`: one graph per length, the report says
why); with ``inputs="sharded"`` (whose length must stay symbolic) or no symbolic input size, the plain refusal."""

from __future__ import annotations

import torch
import torch.fx as fx

from lowering.errors import NotSupportedError
from ringpass.fx.context import PassContext
from ringpass.fx.nodes import example_value, is_module_state, refusal


class NeedsStaticShapes(NotSupportedError):
    """A part of the graph runs at its traced sizes only (a chunked scan whose loop over its chunks Dynamo unrolled, a
    call computed whole, an op that fails at another length): the front ends have Dynamo trace the frame again with
    the symbolic dims of ``inputs`` [(placeholder, dims)] static; ``why`` is what needed it, for the next graph's
    report. Where that cannot help, it is the refusal."""

    def __init__(self, message: str, inputs: list, why: str):
        super().__init__(message)
        self.inputs, self.why = inputs, why


def needs_static_shapes(ctx: PassContext, message: str, why: str, node: fx.Node) -> NotSupportedError:
    """`NeedsStaticShapes` about ``node`` where a user input has a symbolic size and the inputs are whole; else the
    refusal ``message``."""
    inputs = []
    for placeholder in ctx.gm.graph.find_nodes(op="placeholder"):
        value = example_value(placeholder)
        if isinstance(value, torch.Tensor) and not is_module_state(placeholder):
            dims = tuple(d for d, size in enumerate(value.shape) if isinstance(size, torch.SymInt))
            if dims:
                inputs.append((placeholder, dims))
    error = refusal(message, node)
    if ctx.options.inputs != "sharded" and inputs:
        error = NeedsStaticShapes(message, inputs, why)
        error.node = node
    return error
