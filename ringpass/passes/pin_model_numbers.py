"""Read the model's own Python floats, and ints that cut the sequence, as the numbers they are.

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

Also matches an int argument that Dynamo made symbolic (under ``dynamic=True``, or once it changed
between calls) and that a slice or an index of a tensor reads: Hugging Face's ``logits_to_keep`` in
``hidden_states[:, -logits_to_keep:]`` when a graph break hands it to a resumed frame. Whether such a slice
keeps the whole sequence, cuts it, or picks its last tokens depends on the number, so the rewrite needs
it. Writes: the number, guarded (``guard_int``): a call with another value compiles again.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import guard_int

from lowering import compat
from ringpass.fx.context import PassContext


def pin_model_numbers(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    for node in [n for n in graph.nodes if n.op == "placeholder"]:
        if _int_argument(node) and _cuts_a_tensor(node):
            _replace_by_number(node, guard_int(node.meta["example_value"]))
            continue
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
    if not isinstance(source, compat.Source) or not _from_model(source):
        return None
    example = getattr(grapharg, "example", None)
    if (
        not isinstance(example, torch.Tensor)
        or example.dim() != 0
        or not example.is_floating_point()
        or example.device.type == "meta"
    ):
        return None
    return example.item()


def _from_model(source: compat.Source) -> bool:
    """An attribute of something (``L['self'].scaling``) or a global, not a ``forward`` argument itself; Dynamo
    wraps an attribute of a module in a source that says how it treats the module (FSDP2's, an unspecialised
    module's), which reads the same value."""
    sources = compat.dynamo_sources
    module_wrappers = tuple(
        getattr(sources, name)
        for name in ("NNModuleSource", "FSDPNNModuleSource", "UnspecializedNNModuleSource")
        if hasattr(sources, name)
    )
    while isinstance(source, module_wrappers):
        source = source.base
    return isinstance(source, (sources.AttrSource, sources.GlobalSource))


def _int_argument(node: fx.Node) -> bool:
    """A SymInt input that is a Python int of the call (or of the model), not a size of an input tensor."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    return (
        isinstance(node.meta.get("example_value"), torch.SymInt)
        and isinstance(source, compat.Source)
        and not isinstance(source, compat.dynamo_sources.TensorPropertySource)
    )


def _replace_by_number(node: fx.Node, number: int) -> None:
    """Every use of ``node`` reads ``number``; int arithmetic on it (``-logits_to_keep``) is computed."""
    for user in list(node.users):
        user.replace_input_with(node, number)
        if (
            isinstance(user.meta.get("example_value"), torch.SymInt)
            and not user.all_input_nodes
            and user.op == "call_function"
            and not user.kwargs
        ):
            _replace_by_number(user, user.target(*user.args))
    if node.op != "placeholder":
        node.graph.erase_node(node)


def _cuts_a_tensor(node: fx.Node) -> bool:
    """``node``, or int arithmetic on it, is a bound of a slice or an index in ``tensor[...]``."""
    seen, todo = set(), [node]
    while todo:
        current = todo.pop()
        for user in current.users:
            if user in seen:
                continue
            seen.add(user)
            if user.target is operator.getitem and isinstance(user.args[0].meta.get("example_value"), torch.Tensor):
                return True
            if isinstance(user.meta.get("example_value"), torch.SymInt):
                todo.append(user)
    return False
