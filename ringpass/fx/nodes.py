"""Small helpers over Dynamo's FX graphs: where a node came from, its example value, what kind of input,
and the names a user knows it by (argument names, module paths, source lines; never Dynamo's)."""

from __future__ import annotations

import contextlib
import logging
import operator
import os
import re

import torch
import torch.fx as fx

from lowering import compat
from lowering.errors import NotSupportedError

TORCH_DIR = os.path.dirname(torch.__file__)


def source_line(node: fx.Node) -> str:
    """The user's source line that produced ``node`` ("file:line: code"): the innermost frame outside
    torch itself (``F.pad`` is reported where the model calls it), or the node's name."""
    trace = node.meta.get("stack_trace") or ""
    frames = [line.strip() for line in trace.strip().splitlines()]
    files = [i for i, f in enumerate(frames) if f.startswith("File ")]
    if not files:
        return f"node {node.name}"
    i = ([i for i in files if TORCH_DIR not in frames[i]] or files)[-1]
    where = frames[i].replace("File ", "").replace('"', "")
    code = frames[i + 1] if i + 1 < len(frames) and not frames[i + 1].startswith("File ") else ""
    return f"{where}: {code}".strip()


def short_source(node: fx.Node) -> str:
    """``file.py:88`` (the base name and line of `source_line`), or "" when the node has no trace."""
    match = re.match(r"(?P<file>.*?), line (?P<line>\d+)", source_line(node))
    return f"{match['file'].rsplit('/', 1)[-1]}:{match['line']}" if match else ""


def refresh_example_values(graph: fx.Graph, changed, fake_mode=None) -> None:
    """Compute the example values of the ``changed`` nodes (inserted or rewritten), in graph order, on the
    fake tensors of the graph's own FakeTensorMode (``fake_mode``, or its first input's)."""
    fake_mode = fake_mode or next(
        example_value(n).fake_mode
        for n in graph.nodes
        if n.op == "placeholder" and isinstance(example_value(n), torch.Tensor)
    )
    with fake_mode:
        for node in graph.nodes:
            if node not in changed:
                continue
            args = fx.node.map_arg(node.args, example_value)
            kwargs = fx.node.map_arg(node.kwargs, example_value)
            if node.op == "call_method":
                node.meta["example_value"] = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                node.meta["example_value"] = node.target(*args, **kwargs)


def numbers_in(node: fx.Node) -> list:
    """The Python numbers among a node's (nested) arguments and keyword arguments."""
    found = []
    fx.node.map_aggregate(
        (node.args, tuple(node.kwargs.values())),
        lambda a: found.append(a) if isinstance(a, (int, float)) and not isinstance(a, bool) else a,
    )
    return found


def op_label(node: fx.Node) -> str:
    """The op a node calls, as a user would write it (``cumsum``, ``view``, ``scaled_dot_product_attention``)."""
    if node.op in ("placeholder", "output"):
        return node.op
    if node.op == "get_attr":
        return str(node.target)
    if isinstance(node.target, compat.OpOverload):  # torch.ops.ringpass.ring_attention.default
        return node.target.__name__.split(".")[0]
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return target.split(".")[-1]


def describe(node: fx.Node) -> str:
    """The op, its module and the source line, for error messages."""
    if node.op == "placeholder":
        return f"input `{user_name(node)}`"
    where = module_path(node)
    return f"`{op_label(node)}`{' in ' + where if where else ''} at {source_line(node)}"


def user_name(node: fx.Node) -> str:
    """A placeholder's argument name (``input_ids``) or module state path (``model.layers.0.q_proj.weight``);
    for other nodes the op with its module and short source (`cumsum` in model.embed at model.py:88)."""
    if node.op != "placeholder":
        where, line = module_path(node), short_source(node)
        return f"`{op_label(node)}`" + (f" in {where}" if where else "") + (f" at {line}" if line else "")
    source = getattr(node.meta.get("grapharg"), "source", None)
    if source is not None and re.match(r"L\['\w+'\]", source.name):  # L['self']._modules['embed']._parameters['weight']
        root = re.match(r"L\['(\w+)'\]", source.name)
        path = re.sub(r"\._(modules|parameters|buffers)\['([^']*)'\]", r".\2", source.name[root.end() :])
        path = re.sub(r"\['([^']*)'\]|\[(\d+)\]", lambda m: "." + (m.group(1) or m.group(2)), path)
        dropped = root.group(1) in ("self", "kwargs") or is_module_state(node)  # the model, or the ** dict
        return path.lstrip(".") if dropped and path else root.group(1) + path
    name = re.sub(r"^[lL]_", "", str(node.target)).rstrip("_")
    state = re.search(r"_(modules|parameters|buffers)_", name)
    if state is not None and is_module_state(node):  # <forward's first argument>_modules_layers_modules_0_...
        return re.sub(r"_(modules|parameters|buffers)_", ".", name[state.start() :]).lstrip(".")
    return re.sub(r"^(kwargs|args|self)_", "", name)


def ancestors(node: fx.Node) -> list[fx.Node]:
    """``node`` and every node it is computed from, once each."""
    seen, stack, found = set(), [node], []
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.add(current)
            found.append(current)
            stack += current.all_input_nodes
    return found


def is_vmap_bookkeeping(node: fx.Node) -> bool:
    """A call Dynamo records for ``vmap`` (``torch._functorch.predispatch``: nesting levels, batch dims)."""
    return node.op == "call_function" and getattr(node.target, "__module__", "") == compat.VMAP_BOOKKEEPING_MODULE


def remove_dead_code(graph: fx.Graph) -> None:
    """FX's dead-code elimination of tensors nobody reads, keeping what may change something: in-place
    method calls (``x[..., :8].copy_(y)``, ``m.scatter_(...)``: FX counts every method call as pure),
    ``setitem``, functions torch marks impure, every call that returns no tensor, and ``vmap``'s bookkeeping
    (its nesting counters open and close a level; an unused batch dim still belongs to its nest)."""
    graph.eliminate_dead_code(is_impure_node=_may_change_something)


def _may_change_something(node: fx.Node) -> bool:
    if node.op == "call_method" and node.target.endswith("_") and not node.target.startswith("__"):
        return True
    if (
        node.target is operator.setitem
        or not isinstance(example_value(node), torch.Tensor)
        or is_vmap_bookkeeping(node)
    ):
        return True
    return node.is_impure()


def placeholders_of(node: fx.Node) -> list[fx.Node]:
    """The graph inputs (user inputs and module state) ``node`` is computed from."""
    return [n for n in ancestors(node) if n.op == "placeholder"]


def inputs_read(node: fx.Node) -> list[str]:
    """The names of the user inputs ``node`` is computed from (``attention_mask``); none for values
    computed from the sequence length alone (positions)."""
    return sorted(
        user_name(p)
        for p in placeholders_of(node)
        if isinstance(example_value(p), torch.Tensor) and not is_module_state(p)
    )


def module_path(node: fx.Node) -> str:
    """The user's module that computed ``node`` (``model.layers.3.self_attn``), or "" at the top level."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    path = re.sub(r"^L\['\w+'\](\[\d+\])?\.?", "", path)  # the root module: L['self'] (torch 2.15: L['args'][0])
    path = re.sub(r"\._modules\['([^']*)'\]", r".\1", path)
    return re.sub(r"\[(\d+)\]", r".\1", path).lstrip(".")


def copy_origin(new: fx.Node, origin: fx.Node) -> fx.Node:
    """Give an inserted node the source line and module of the node it stands for."""
    for key in ("stack_trace", "nn_module_stack"):
        if key in origin.meta:
            new.meta[key] = origin.meta[key]
    return new


def refusal(message: str, node: fx.Node) -> NotSupportedError:
    """A `NotSupportedError` about ``node``: the pipeline adds the chain of ops from the attention to it."""
    error = NotSupportedError(message)
    error.node = node
    return error


def example_value(node: fx.Node):
    return node.meta.get("example_value", node.meta.get("val"))


def plain(size) -> int:
    """A size as a Python int (a symbolic size: its value in the example being compiled)."""
    return size.node.hint if isinstance(size, torch.SymInt) else int(size)


def nbytes(value) -> int:
    """Bytes of a tensor (sizes as in the example being compiled)."""
    return plain(value.numel()) * value.element_size()


def is_module_state(node: fx.Node) -> bool:
    """A placeholder that holds a parameter or buffer of the model (not a user input)."""
    arg = node.meta.get("grapharg")
    name = arg.source.name if arg is not None and getattr(arg, "source", None) is not None else node.name
    return "_parameters" in name or "_buffers" in name or isinstance(example_value(node), torch.nn.Parameter)


@contextlib.contextmanager
def probing(graph: fx.Graph):
    """Run ops on the graph's fake tensors at hypothetical sizes (a probe): in the fake mode of its inputs, adding no
    guards to the real graph, and not logging the ops that fail there (fake tensors log each at ERROR): such a
    failure is an answer, not an error."""
    fake_mode = next(
        example_value(n).fake_mode
        for n in graph.nodes
        if n.op == "placeholder" and isinstance(example_value(n), torch.Tensor)
    )
    shape_env = fake_mode.shape_env
    fake_log = logging.getLogger(compat.FAKE_TENSOR_LOGGER)
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        with fake_mode, shape_env.suppress_guards() if shape_env is not None else contextlib.nullcontext():
            yield
    finally:
        fake_log.setLevel(level)
