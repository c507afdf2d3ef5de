"""Record which graph inputs train through the captured graph: the first half of the rewrite's safety net.

Matches every graph input whose value can carry a gradient (parameters, trainable buffers, user inputs
with ``requires_grad``). Walks the graph Dynamo captured, before any pass changes it, once backwards from
the outputs: an input *reaches* when a chain of edges that carry a gradient (the rules of
`ringpass.fx.gradient_reach`) leads from it to an output. Writes ``ctx.gradient_paths``
(`CapturedGradients`): those inputs, one such chain for each (a pointer to the next node), and the example
values Dynamo gave the captured nodes (what the check may trust). `check_gradient_paths`, the pipeline's last
pass, requires the same of the rewritten graph.

Inference graphs cost one check: when no output requires grad (``torch.no_grad()``) or no input can
carry a gradient, nothing is recorded and nothing is checked.
"""

from __future__ import annotations

import torch.fx as fx

from ringpass.fx.context import PassContext
from ringpass.fx.gradient_reach import CapturedGradients, GradientRules, gradient_reach, requires_grad
from ringpass.fx.nodes import example_value


def record_gradient_paths(ctx: PassContext) -> None:
    gm = ctx.gm
    ctx.gradient_paths = None
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    if not any(requires_grad(example_value(p)) for p in placeholders) or not any(
        requires_grad(example_value(a)) for a in output.all_input_nodes
    ):
        return  # inference: nothing trains
    record = CapturedGradients(trusted=captured_values(gm))
    live, record.step = gradient_reach(gm, GradientRules(record.trusted))
    record.inputs = [p for p in placeholders if p in live]
    record.targets = {p: p.target for p in record.inputs}
    ctx.gradient_paths = record


def captured_values(gm: fx.GraphModule) -> dict:
    """id(example value) -> (value, {(op, target)}) of the nodes of ``gm`` and of the subgraphs it holds."""
    found, seen, pending = {}, set(), [gm]
    while pending:
        module = pending.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        for node in module.graph.nodes:
            value = example_value(node)
            if value is not None:  # one value may belong to several nodes (x and x.add_(y))
                found.setdefault(id(value), (value, set()))[1].add((node.op, node.target))
            if node.op == "get_attr" and isinstance(getattr(module, node.target, None), fx.GraphModule):
                pending.append(getattr(module, node.target))
    return found
