"""`ringpass.inspect`: what the ring pass will do to a model, on any machine, before it runs.

    inspection = ringpass.inspect(model, (input_ids,), world_size=8)
    print(inspection)                       # the readable report
    inspection.write_json("plan.json")      # the same facts as data (docs/inspect.md)

The model is captured by Dynamo as the ``ring`` backend would capture it and the same pass pipeline
(`ringpass.passes.run_pipeline`) rewrites each graph for ``world_size`` ranks, offline: no process group,
no communication, and no arithmetic at full size. Parameters, buffers and inputs are replaced by meta
tensors first (a model built on the ``meta`` device is used as it is; the real values of buffers stay
readable for mask analysis), so capture and passes only propagate shapes, and the compiled graphs
return meta tensors of the right shapes instead of running.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from lowering import compat
from lowering.compat import pytree
from lowering.errors import InvalidInputError, NotSupportedError
from ringpass.frontend.crossing_masks import wrap_mask_outputs
from ringpass.frontend.rewrite import Retrace, rewrite_graph
from ringpass.fx.context import PassContext, UlyssesGroups
from ringpass.fx.nodes import example_value, plain
from ringpass.fx.report import Report, size_text
from ringpass.options import RingOptions
from ringpass.passes.sharded_lengths import StaticShardedLengths

SCHEMA_VERSION = 1
EXIT_REWRITTEN, EXIT_REFUSED, EXIT_NO_ATTENTION = 0, 2, 3


@dataclass
class CapturedGraph:
    """One graph Dynamo captured, rewritten for the ring, with the placements the passes decided."""

    gm: fx.GraphModule
    report: Report
    placement: dict = field(default_factory=dict)
    axes: dict = field(default_factory=dict)
    blocking: fx.Node | None = None  # the op a refusal names


@dataclass
class Inspection:
    """What `inspect` found: one `Report` per captured graph. ``str()`` is the readable report."""

    world_size: int
    options: dict
    graphs: list[CapturedGraph]
    front_end: str = "inspect"  # the command the report's first line names
    # bytes per rank: weights, gradients, optimizer (AdamW), activations, ring, total (`memory_per_rank`)
    memory: dict = field(default_factory=dict)

    @property
    def reports(self) -> list[Report]:
        return [g.report for g in self.graphs]

    @property
    def status(self) -> str:
        """ "rewritten" (every attention rewritten), "refused" (a graph was refused), "whole" (``strategy="auto"``
        runs every graph with attention whole) or "no attention"."""
        statuses = {r.status for r in self.reports}
        if "refused" in statuses:
            return "refused"
        return next((s for s in ("rewritten", "whole") if s in statuses), "no attention")

    @property
    def exit_code(self) -> int:
        codes = {"rewritten": EXIT_REWRITTEN, "whole": EXIT_REWRITTEN, "refused": EXIT_REFUSED}
        return codes.get(self.status, EXIT_NO_ATTENTION)

    def __str__(self) -> str:
        head = {
            "rewritten": f"ringpass {self.front_end}: every attention becomes ring attention "
            f"over {self.world_size} ranks",
            "refused": f"ringpass {self.front_end}: REFUSED - the ring backend would stop on this model "
            "(see 'refused' below)",
            "whole": f"ringpass {self.front_end}: strategy='auto' runs this model whole on every rank: no "
            "sequence parallelism is predicted to pay at this length (see each graph's line)",
            "no attention": f"ringpass {self.front_end}: NO ATTENTION FOUND - the ring backend would run this model "
            "unchanged and unsharded on every rank",
        }[self.status]
        parts = [head]
        if len(self.graphs) > 1:
            parts.append(
                f"(Dynamo captured {len(self.graphs)} graphs: the model has graph breaks; each graph is "
                "rewritten on its own; each boundary's cost is in its report: sharded values cross it for 0 "
                "bytes, masks for their per-token description, gathered outputs are counted as all-gathers)"
            )
        if not self.graphs:
            parts.append("(Dynamo captured no graph: nothing in the model's forward runs tensor ops)")
        return "\n".join(parts + [str(r) for r in self.reports] + self._memory_lines())

    def _memory_lines(self) -> list[str]:
        m = self.memory
        if not m or self.status != "rewritten":
            return []
        parts = ", ".join(f"{name} {size_text(m[name])}" for name in ("weights", "gradients", "optimizer", "ring"))
        return [
            f"per GPU, one training step with AdamW, no FSDP: {size_text(m['total'])} ({parts}, activations "
            f"{size_text(m['activations'])}: every value the graphs compute on a rank, counted once, an upper bound; "
            "`ringpass plan` measures the step's peak, with FSDP2 / DDP, checkpointing and other optimizers)"
        ]

    def as_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "status": self.status,
            "world_size": self.world_size,
            "options": self.options,
            "graphs": [r.as_dict() for r in self.reports],
            "memory_per_rank": self.memory or None,
        }

    def write_json(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.as_dict(), f, indent=1)

    def to_networkx(self):
        """All graphs as one networkx ``DiGraph`` (node names ``g<graph>:<fx name>``; see `graph_view`)."""
        import networkx as nx

        from ringpass.inspection.graph_view import to_networkx

        graphs = [to_networkx(g.gm, g.placement, g.axes, f"g{i}:", g.blocking) for i, g in enumerate(self.graphs)]
        return nx.compose_all(graphs) if graphs else nx.DiGraph()

    def write_graphml(self, path) -> None:
        import networkx as nx

        nx.write_graphml(self.to_networkx(), path)

    def write_picture(self, path) -> None:
        """A PNG or SVG (by the file's extension): the condensed graph and the ring schedule."""
        from ringpass.inspection.picture import draw

        draw(self, path)

    def code(self) -> str:
        """The rewritten FX code of every graph."""
        return "\n".join(f"# graph {i} ({g.report.status})\n{g.gm.code.strip()}\n" for i, g in enumerate(self.graphs))


def inspect(model: torch.nn.Module, example_inputs: Any = (), *, world_size: int, **options: Any) -> Inspection:
    """What ``torch.compile(model, backend="ring", options=options)`` does on ``world_size`` ranks, found
    offline. ``example_inputs``: a tensor, a tuple of positional arguments or a dict of keyword arguments
    (tensors of the full sequence, as every rank would pass them). Nothing of the model is computed at full
    size and no process group is needed. Like ``compat.dynamo_reset()``, it clears Dynamo's caches (models
    compiled before recompile on their next call)."""
    if not isinstance(world_size, int) or world_size < 2:
        raise InvalidInputError(f"inspect: world_size must be an int >= 2 (the ranks in the ring), got {world_size!r}.")
    ring_options = RingOptions.from_dict({**options, "report": "off"})
    if ring_options.group is not None:
        raise InvalidInputError("inspect: `group` has no meaning offline; pass world_size instead.")
    if ring_options.ulysses != 1:
        raise NotSupportedError(
            "inspect: Ulysses x ring is not described offline yet; inspect the plain ring "
            "(ulysses=1), and see `ringpass plan --ulysses U` for its cost."
        )
    args, kwargs = as_call(example_inputs)

    def _named_groups(size: int) -> UlyssesGroups:  # strategy="auto" may choose Ulysses: the groups by role
        return UlyssesGroups(size, f"<ulysses group of {size}>", f"<ring over {world_size // size} groups>")

    model = compat.compiled_module_inner(model)  # a torch.compile'd module: the module it wraps
    twin, host_values = meta_twin(model)
    args, kwargs = _to_meta((args, kwargs))
    graphs: list[CapturedGraph] = []

    def capture(gm: fx.GraphModule, graph_inputs: list, **_: Any):
        report = Report(world_size=world_size, graph_index=len(graphs))
        ctx = PassContext(
            gm, graph_inputs, ring_options, world_size, "", report, host_values=host_values, ulysses_for=_named_groups
        )
        found = {}
        blocking = None
        try:  # the backend's protocol: boundaries, pipeline, retrace; the outputs' sizes read before the passes
            rewrite_graph(ctx, before_passes=lambda c: found.setdefault("outputs", _meta_outputs(c.gm)))
        except Retrace as retrace:
            raise retrace.restart from None
        except StaticShardedLengths:  # refused, in the report
            pass
        except NotSupportedError as error:  # a pass's refusal: recorded in the report with its chain of ops
            if "outputs" not in found:  # refused at the boundaries, before any pass: inspect raises it
                raise
            blocking = getattr(error, "node", None)
        outputs = found["outputs"]
        graphs.append(CapturedGraph(ctx.gm, report, ctx.placement, ctx.sequence.axes, blocking))
        return lambda *_: wrap_mask_outputs(outputs(), ctx.mask_outputs)

    compat.dynamo_reset()  # a fresh capture: cached graphs of this code (other backends) would hide it
    try:
        torch.compile(twin, backend=capture, dynamic=False)(*args, **kwargs)
    except Exception as error:  # the model's own Python on meta tensors: data-dependent code, wrong inputs
        raise NotSupportedError(
            f"inspect: the model could not run on meta tensors ({type(error).__name__}: {error}). Its code needs "
            "real values somewhere (.item(), a data-dependent branch: the backend would break the graph there and "
            "run that part eagerly, which inspect cannot do without values), builds a tensor on another device, or "
            "the example inputs do not fit it. The cause's traceback shows where."
        ) from error
    finally:
        compat.dynamo_reset()
    shown = {k: v for k, v in ring_options.__dict__.items() if k not in ("group", "report")}
    if dataclasses.is_dataclass(shown["hardware"]):
        shown["hardware"] = dataclasses.asdict(shown["hardware"])
    return Inspection(world_size, shown, graphs, memory=memory_per_rank(model, [g.report for g in graphs]))


def memory_per_rank(model: torch.nn.Module, reports: list[Report]) -> dict:
    """What one rank holds for a training step with AdamW and no FSDP, from the model and the graphs' reports:
    every parameter and buffer; a gradient and two AdamW states per trainable parameter; the activations, every
    value the graphs compute on this rank's tokens or whole, counted once (an upper bound of what is live at
    once); the ring's buffers at the backward's peak (the largest attention's; with ``strategy="auto"`` or
    ``"all-gather"``, what the chosen strategy holds). Bytes, with their ``total``."""
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    memory = {
        "weights": sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())),
        "gradients": trainable,
        "optimizer": 2 * trainable,
        "activations": sum(r.activation_bytes.get("per_rank", 0) + r.activation_bytes.get("whole", 0) for r in reports),
        "ring": max(
            [c.working_memory()["backward"] for r in reports for _, c in r.ring_costs()]
            + [a.working_bytes for r in reports for a in r.attention],
            default=0,
        ),
    }
    memory["total"] = sum(memory.values())
    return memory


def meta_twin(model: torch.nn.Module) -> tuple[torch.nn.Module, dict]:
    """The model with parameters, buffers and plain tensor attributes on the meta device (a copy; ``model``
    is untouched and no weight is copied), and ``id(meta tensor) -> real tensor`` for reading buffer values
    later. A model already on meta is returned as it is."""
    attributes = [v for m in model.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)]  # plain tensors
    state = list(model.parameters()) + list(model.buffers()) + attributes
    if all(t.device.type == "meta" for t in state):
        return model, {}
    memo, host_values = {}, {}
    for t in state:
        twin = t.detach().to("meta")
        if isinstance(t, torch.nn.Parameter):
            twin = torch.nn.Parameter(twin, requires_grad=t.requires_grad)
        else:
            host_values[id(twin)] = t
        memo[id(t)] = twin
    try:
        return copy.deepcopy(model, memo), host_values
    except Exception as error:
        raise InvalidInputError(
            f"inspect: could not make a meta-device copy of the model ({type(error).__name__}: {error}). Build the "
            "model on the meta device instead (`with torch.device('meta'): model = ...`) and pass that."
        ) from None


def as_call(example_inputs) -> tuple[tuple, dict]:
    """Example inputs as ``(args, kwargs)``: a dict is keyword arguments, a tuple or list positional ones, anything
    else the one positional argument."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def _to_meta(inputs):
    """The inputs with every tensor on the meta device; one tensor passed twice stays one tensor (Dynamo
    then sees one input, as the backend does)."""
    twins: dict[int, torch.Tensor] = {}

    def twin(x):
        if not isinstance(x, torch.Tensor) or x.device.type == "meta":
            return x
        if id(x) not in twins:
            twins[id(x)] = x.detach().to("meta").requires_grad_(x.requires_grad)
        return twins[id(x)]

    return pytree.tree_map(twin, inputs)


def _meta_outputs(gm: fx.GraphModule):
    """A function making fresh meta tensors shaped like the graph's outputs (read before any pass runs)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    like = fx.node.map_arg(output.args[0], example_value)

    def make():
        return pytree.tree_map(
            lambda v: (
                torch.empty(tuple(map(plain, v.shape)), dtype=v.dtype, device="meta").requires_grad_(
                    v.requires_grad and v.is_floating_point()
                )
                if isinstance(v, torch.Tensor)
                else v
            ),
            like,
        )

    return make
