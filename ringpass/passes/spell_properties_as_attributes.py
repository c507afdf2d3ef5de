"""Write the tensor properties that Dynamo calls as aten ops as the attribute reads the other passes match.

Matches ``call_function`` nodes whose target is ``torch.ops.aten.mT``, ``mH``, ``numpy_T`` or ``matrix_H`` (the
packet or an overload of it): Dynamo on torch 2.15 traces ``k.mT`` as ``torch.ops.aten.mT(k)`` (``k.T`` as
``numpy_T``, ``k.H`` as ``matrix_H``) where torch 2.13 wrote ``getattr(k, "mT")``. Writes each as
``getattr(x, "mT" / "mH" / "T" / "H")``: the same value, its example value kept, so every later pass reads one
spelling whichever torch captured the graph.
"""

from __future__ import annotations

from lowering import compat
from ringpass.fx.context import PassContext

ATTRIBUTES = {"mT": "mT", "mH": "mH", "numpy_T": "T", "matrix_H": "H"}  # aten op -> the tensor attribute


def spell_properties_as_attributes(ctx: PassContext) -> None:
    for node in ctx.gm.graph.nodes:
        name = _aten_name(node.target) if node.op == "call_function" else None
        if name in ATTRIBUTES and len(node.args) == 1 and not node.kwargs:
            node.target, node.args = getattr, (node.args[0], ATTRIBUTES[name])
    ctx.gm.recompile()


def _aten_name(target) -> str | None:
    if isinstance(target, compat.OpOverload):
        target = target.overloadpacket
    if isinstance(target, compat.OpOverloadPacket) and compat.qualified_op_name(target).startswith("aten::"):
        return target.__name__
    return None
