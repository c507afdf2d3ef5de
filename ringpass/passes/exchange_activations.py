"""With ``inputs="per_rank"``, take an activation from code before the graph as each batch's tokens of this rank.

Matches (only with ``inputs="per_rank"``, in a graph with attention) the inputs that train: activations computed
before the graph on this rank's own batch (the hidden states between blocks compiled one by one, between graphs
of a model that FSDP2's per-block hooks or a graph break cut, or an eager embedding's output). Gathering one would
put every rank's whole sequences on every rank. Each has a dimension of the attentions' length (batch-first: dim 1
when it fits): `ringpass.frontend.per_rank.PerRankGraph` sends each rank its tokens of it (one all-to-all: every rank
ends with its share of every rank's batch, as much memory as its own batch), and the graph takes it as it takes a
value carried in sequence-sharded from another graph.

Writes ``ctx.carried_inputs`` (placeholder -> sequence dim) and ``ctx.exchanged_inputs``; refuses an input that
trains and has no dimension of the sequence's length (a pooled vector, a value of another length).
"""

from __future__ import annotations

from lowering.errors import NotSupportedError
from ringpass.fx.context import PassContext
from ringpass.fx.nodes import example_value, is_module_state, user_name
from ringpass.fx.sizes import same


def exchange_activations(ctx: PassContext) -> None:
    if not ctx.per_rank:
        return
    length = example_value(ctx.attention[0].query).shape[-2]
    for node in (n for n in ctx.gm.graph.nodes if n.op == "placeholder"):
        value = example_value(node)
        if not getattr(value, "requires_grad", False) or is_module_state(node) or not node.users:
            continue
        dims = [d for d, size in enumerate(value.shape) if same(size, length)]
        if not dims:
            raise NotSupportedError(
                f"inputs='per_rank': input `{user_name(node)}` of shape {tuple(value.shape)} requires grad (an "
                f"activation computed before this graph) but has no dimension of the sequence's length {length}, so "
                "it cannot be split by tokens among the ranks of the ring. Compute it inside the compiled graph, or "
                "compile the model as one graph."
            )
        ctx.carried_inputs[node] = 1 if 1 in dims else dims[0]
        ctx.exchanged_inputs.add(node)
