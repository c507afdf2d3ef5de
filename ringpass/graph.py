"""Small helpers over Dynamo's FX graphs: where a node came from, its example value, what kind of input."""

from __future__ import annotations

import torch
import torch.fx as fx


def source_line(node: fx.Node) -> str:
    """The user's source line that produced ``node`` ("file:line: code"), or the node's name."""
    trace = node.meta.get("stack_trace") or ""
    frames = [line.strip() for line in trace.strip().splitlines()]
    for i in range(len(frames) - 1, -1, -1):
        if frames[i].startswith("File "):
            where = frames[i].replace("File ", "").replace('"', "")
            code = frames[i + 1] if i + 1 < len(frames) and not frames[i + 1].startswith("File ") else ""
            return f"{where}: {code}".strip()
    return f"node {node.name}"


def describe(node: fx.Node) -> str:
    """The op and the source line, for error messages."""
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return f"`{target}` ({node.name}) at {source_line(node)}"


def example_value(node: fx.Node):
    return node.meta.get("example_value", node.meta.get("val"))


def is_module_state(node: fx.Node) -> bool:
    """A placeholder that holds a parameter or buffer of the model (not a user input)."""
    arg = node.meta.get("grapharg")
    name = arg.source.name if arg is not None and getattr(arg, "source", None) is not None else node.name
    return "_parameters" in name or "_buffers" in name or isinstance(example_value(node), torch.nn.Parameter)
