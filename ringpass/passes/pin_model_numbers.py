"""Read the model's own Python floats as the numbers they are.

Matches ``x.item()`` on a graph input that Dynamo made from a Python float of the model: under
``dynamic=True`` (``torch._dynamo.config.specialize_float=False``) every float attribute of the model
(``nn.LayerNorm.eps``, ``nn.MultiheadAttention.dropout``, an attention's ``scaling``, a config's
``rope_theta``) and every float global reaches the graph as a 0-dim tensor input read with ``.item()``.
The ring rewrite needs some of them as numbers: a dropout probability must be 0, a scale, a soft-cap or
a mask's fill value is an argument of the ring kernels. Floats passed to ``forward`` as arguments stay
symbolic.

Writes: each such ``.item()`` replaced by the value the input holds in this compile. The input is then
unused, and Dynamo guards its value (``remove_tensorify_specialized_graphargs``): a model whose attribute
changes after compiling is compiled again, never run with the old number
(``test_a_float_attribute_changed_after_a_dynamic_compile_is_recompiled``).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._guards import Source

from ringpass.passes.context import PassContext


def pin_model_numbers(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    for node in [n for n in graph.nodes if n.op == "placeholder"]:
        value = _model_float(node)
        reads = [user for user in node.users if user.op == "call_method" and user.target == "item"]
        if value is None or not reads or len(reads) != len(node.users):
            continue
        for read in reads:
            read.replace_all_uses_with(value)
            graph.erase_node(read)


def _model_float(node: fx.Node) -> float | None:
    """The value of an input Dynamo made from a float attribute or global of the model, else None."""
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if not isinstance(source, Source) or not _from_model(source):
        return None
    example = getattr(grapharg, "example", None)
    if not isinstance(example, torch.Tensor) or example.dim() != 0 or not example.is_floating_point() \
            or example.device.type == "meta":
        return None
    return example.item()


def _from_model(source: Source) -> bool:
    """An attribute of something (``L['self'].scaling``) or a global, not a ``forward`` argument itself."""
    from torch._dynamo.source import AttrSource, GlobalSource

    return isinstance(source, (AttrSource, GlobalSource))
