"""Dynamo's one graph of ``model(call)``, rewritten by the pass pipeline as the ``ring`` backend rewrites it
(`capture`), and what a conversion records of it: the call's arguments as the graph reads them
(`describe_arguments`), the output structure (`describe_outputs`) and, for symbolic shapes, the conditions
Dynamo traced under (`shape_conditions`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from lowering import compat
from lowering.compat import pytree
from lowering.errors import InvalidInputError, NotSupportedError
from ringpass.conversion.calls import read_source
from ringpass.conversion.saved import GROUP, Argument, Outputs, TensorSpec
from ringpass.frontend.rewrite import Retrace, rewrite_graph
from ringpass.fx.context import LOCAL, PassContext
from ringpass.fx.nodes import example_value, plain
from ringpass.fx.report import Report
from ringpass.options import RingOptions


@dataclass
class Captured:
    """The rewritten graph and its pass context, the graph's outputs and the model's result at the capture
    (empty tensors, to learn the output structure) and the capture function's globals (Dynamo's ``G``)."""

    gm: fx.GraphModule
    ctx: PassContext
    graph_outputs: tuple = ()
    result: Any = None
    global_scope: dict = field(default_factory=dict)


def capture(model, call: list, options: RingOptions, world_size: int, dynamic: bool) -> Captured:
    """Dynamo's one graph of ``model(call)``, rewritten by the pipeline; the call runs nothing at full size
    (the graph's outputs are empty tensors, there only to learn the output structure)."""
    found: dict[str, Any] = {}

    def backend(gm: fx.GraphModule, graph_inputs: list, **_: Any):
        output = next(n for n in gm.graph.nodes if n.op == "output")
        like = fx.node.map_arg(output.args[0], example_value)
        sizes = [v for v in pytree.tree_leaves(like) if isinstance(v, torch.SymInt) and not v.node.is_constant()]
        if sizes:
            found["error"] = NotSupportedError(
                "convert: with dynamic=True the model returns a size computed from its inputs' shapes (a Python "
                "int); a converted model would return the size it was converted with. Return a tensor, or compute "
                "the size from the inputs outside the model."
            )
            raise found["error"]
        ctx = PassContext(gm, graph_inputs, options, world_size, GROUP, Report(world_size=world_size))
        for node in gm.graph.nodes:  # where each input comes from (Dynamo drops its record after the compile)
            graph_arg = node.meta.get("grapharg")
            if node.op == "placeholder":
                node.meta["ringpass_source"] = graph_arg.source.name
                node.meta["ringpass_as_tensor"] = bool(graph_arg.pass_arg_as_tensor)
        try:  # the backend's protocol (no boundaries: a converted model is one graph called with whole tensors;
            rewrite_graph(ctx, boundaries=False, static_retrace=False)  # dynamic=True converts for every length)
            gm.graph.lint()
            gm.recompile()
        except Retrace as retrace:
            raise retrace.restart from None
        except Exception as error:
            found["error"] = error
            raise
        found["captured"] = captured = Captured(gm, ctx)

        def run(*_):
            captured.graph_outputs = tuple(pytree.tree_map(_empty_like, like))
            return captured.graph_outputs

        return run

    run_call = _call_function(call)
    try:
        with compat.dynamo_config.patch(specialize_float=True):  # Python floats are baked in (a dropout p, an eps)
            compiled = torch.compile(run_call, backend=backend, fullgraph=True, dynamic=dynamic)
            result = compiled(model, *[v for _, _, v in call])
    except Exception as error:
        if "error" in found:
            raise found["error"] from None
        first_line = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        if isinstance(error, compat.DynamoUnsupported):
            raise NotSupportedError(
                f"convert: Dynamo could not capture the model's forward as one graph ({first_line}). A converted model "
                "is one graph: remove the graph break (the cause's traceback shows where), or use "
                "torch.compile(model, backend='ring'), which runs the code between graphs eagerly."
            ) from error
        raise InvalidInputError(
            f"convert: the model raised on the example inputs ({first_line}); the cause's "
            "traceback shows where. Check that the example inputs are what the model takes."
        ) from error
    captured = found["captured"]
    captured.global_scope = run_call.__globals__
    if captured.ctx.report.runs_whole:
        raise NotSupportedError(
            f"convert: {captured.ctx.report.unchanged}; a converted model runs sharded, so there is nothing to "
            "convert. Convert with strategy='ring' (the default) to shard it anyway, or at the length it will run at."
        )
    if captured.ctx.report.unchanged:
        raise NotSupportedError(
            "convert: no attention found in the model's graph, so there is nothing to run as a ring: the converted "
            "model would run unsharded on every rank. ringpass.inspect(model, inputs, world_size=P) shows what the "
            "pass sees."
        )
    captured.result = result
    return captured


def _call_function(call: list) -> Callable:
    """A fresh function ``f(self, <argument names>) -> self(<the call>)``: Dynamo records each graph input
    by its path from these names (its own code object each time, so no earlier compile is reused)."""
    names = [name for name, _, _ in call]
    passed = [name if how == "positional" else f"{name}={name}" for name, how, _ in call]
    source = f"def converted_call(self, {', '.join(names)}):\n    return self({', '.join(passed)})\n"
    namespace: dict = {}
    exec(compile(source, "<ringpass.convert>", "exec"), namespace)
    return namespace["converted_call"]


def _empty_like(value):
    if isinstance(value, torch.Tensor):
        return torch.empty([plain(s) for s in value.shape], dtype=value.dtype, device=value.device)
    return plain(value) if isinstance(value, torch.SymInt) else value


def describe_arguments(
    call: list, gm: fx.GraphModule, ctx: PassContext
) -> tuple[list[Argument], list[tuple[str, bool]]]:
    """The call's `Argument`s, and for each graph input the path to read it from and whether Dynamo passes it
    as a tensor (a float attribute of a module, made a tensor input under dynamic shapes)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    paths = [(n.meta["ringpass_source"], n.meta["ringpass_as_tensor"]) for n in placeholders]
    by_object = {}  # id(tensor passed in the call) -> the placeholder Dynamo made of it
    scope = {"self": None, **{name: value for name, _, value in call}}
    for node, (path, _) in zip(placeholders, paths):
        is_argument = path.startswith("L[") and not path.startswith("L['self']")
        value = read_source(path, scope, False, {}) if is_argument else None
        if isinstance(value, torch.Tensor):
            by_object[id(value)] = node
    arguments, index = [], 0
    for name, _, value in call:
        keyed, spec = pytree.tree_flatten_with_path(value)
        leaves = [leaf for _, leaf in keyed]
        converted = []
        for (key, _), leaf in zip(keyed, leaves):
            if not isinstance(leaf, torch.Tensor):
                if not isinstance(leaf, (type(None), bool, int, float, str)):
                    raise InvalidInputError(
                        f"convert: argument `{name}` holds a {type(leaf).__name__}; a converted call "
                        "takes tensors, containers of them, and plain numbers or strings."
                    )
                converted.append(leaf)
                continue
            node = by_object.get(id(leaf))
            like = example_value(node) if node is not None else leaf
            shape = [None if isinstance(s, torch.SymInt) and not s.node.is_constant() else plain(s) for s in like.shape]
            sharded = (
                node is not None
                and ctx.options.inputs == "sharded"
                and (ctx.placement.get(node) == LOCAL or node in ctx.gathered_inputs)
            )
            label = name + pytree.keystr(key)  # input_ids, batch['rest'][0]
            converted.append(TensorSpec(index, label, leaf.dtype, shape, sharded))
            index += 1
        arguments.append(Argument(name, spec, converted))
    return arguments, paths


def describe_outputs(captured: Captured, call: list) -> Outputs:
    """The model's output structure, each leaf traced to a graph output, a tensor input passed through, or a
    plain constant."""
    leaves, spec = pytree.tree_flatten(captured.result)
    from_graph = {id(v): i for i, v in enumerate(captured.graph_outputs) if isinstance(v, torch.Tensor)}
    inputs = [leaf for _, _, value in call for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]
    from_inputs = {id(t): i for i, t in enumerate(inputs)}
    found = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if id(leaf) in from_graph:
                found.append(("graph", from_graph[id(leaf)]))
            elif id(leaf) in from_inputs:
                found.append(("input", from_inputs[id(leaf)]))
            else:
                raise NotSupportedError(
                    "convert: the model returns a tensor made outside its graph; please report this model."
                )
        elif isinstance(leaf, (type(None), bool, int, float, str)):
            found.append(("constant", leaf))
        else:
            raise NotSupportedError(
                f"convert: the model returns a {type(leaf).__name__}; a converted model returns tensors, "
                "containers of them (registered with torch.utils._pytree), and plain values."
            )
    return Outputs(spec, found)


def shape_conditions(gm: fx.GraphModule, paths: list, dynamic: bool) -> dict | None:
    """For a dynamic conversion: Dynamo's assumptions about the shapes (its shape guards, e.g. a length of at
    least 2) as an expression over the graph's inputs ``t0, t1, ...``, with the paths of the inputs it reads
    (saved with the artifact: a loaded model checks them too, `ringpass.conversion.calls.check_shapes`)."""
    if not dynamic:
        return None
    placeholders = [example_value(n) for n in gm.graph.nodes if n.op == "placeholder"]
    shape_env = next(v.fake_mode.shape_env for v in placeholders if isinstance(v, torch.Tensor))
    expression = shape_env.produce_guards_expression(placeholders, ignore_static=True)
    if not expression:
        return None
    used = sorted({int(i) for i in re.findall(r"L\['t(\d+)'\]", expression)})
    return {
        "expression": expression,
        "inputs": len(placeholders),
        "read": [[i, paths[i][0], paths[i][1]] for i in used],
    }
