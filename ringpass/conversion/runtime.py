"""The converted model at run time: `Program` (the rewritten graph behind a flat signature, what is exported),
`ConvertedModel` (binds each call, runs the program through `ringpass.frontend.guard` on the run's process group,
rebuilds the model's output structure, saves itself) and `GroupSlots` (where the graph names its process group)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.fx as fx

from lowering import failures
from lowering.compat import pytree
from lowering.errors import InvalidInputError, NotSupportedError
from lowering.groups import resolve_group
from ringpass.conversion import archive
from ringpass.conversion.calls import (
    canonical_call,
    check_shapes,
    flat_tensors,
    read_source,
    rebuild_argument,
    signature_of,
)
from ringpass.conversion.saved import GROUP, NO_DEFAULT, Argument, Conversion
from ringpass.frontend.guard import GraphInput, GuardedGraph


class Program(torch.nn.Module):
    """The converted graph behind a flat signature: ``program(*tensor_inputs) -> tuple of graph outputs``.
    Each graph input is read from the rebuilt arguments or from ``model`` by the path Dynamo recorded for
    it (``L['self']._modules['embed']._parameters['weight']``). This is the module `ConvertedModel.save` exports."""

    def __init__(
        self,
        model: torch.nn.Module,
        gm: fx.GraphModule,
        paths: list[tuple[str, bool]],
        arguments: list[Argument],
        global_scope: dict,
    ):
        super().__init__()
        self.model = model
        self.gm = gm
        self.paths, self.arguments, self.global_scope = paths, arguments, global_scope

    def forward(self, *tensors):
        scope = {"self": self.model, **{a.name: rebuild_argument(a, tensors) for a in self.arguments}}
        inputs = (read_source(path, scope, as_tensor, self.global_scope) for path, as_tensor in self.paths)
        return tuple(self.gm(*inputs))


class GroupSlots:
    """The places a converted graph names its process group; `bind` writes a group's name there (the
    stand-in `GROUP` when saving, the run-time group's name before running)."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.slots = [(node, i) for node in gm.graph.nodes for i, a in enumerate(node.args) if a == GROUP]
        self.name = GROUP

    def bind(self, name: str) -> None:
        if name != self.name:
            for node, i in self.slots:
                node.update_arg(i, name)
            self.gm.recompile()
            self.name = name


class ConvertedModel(torch.nn.Module):
    """A model converted for the ring (see `ringpass.convert`). ``report``: what the passes did (an
    `Inspection`; printed, it is ``ringpass inspect``'s report). ``model``: the module holding the parameters
    (the original model, or the loaded artifact's)."""

    def __init__(
        self,
        model: torch.nn.Module,
        program: Callable,
        slots: GroupSlots,
        conversion: Conversion,
        *,
        group=None,
        checks: str,
        timeout: float,
        report=None,
        example: tuple = (),
    ):
        super().__init__()
        self.model = model
        self.conversion = conversion
        self.report = report
        self.world_size = conversion.world_size
        vars(self)["_program"] = program  # not a submodule: its parameters are `model`'s
        self._slots = slots
        self._group, self._checks, self._timeout = group, checks, timeout
        self._example = example  # the conversion's tensors, which `save` traces the program with
        self._guarded: GuardedGraph | None = None
        self._signature = signature_of(conversion.parameters)
        self._defaults = {name: default for name, _, default in conversion.parameters if default != NO_DEFAULT}

    def forward(self, *args, **kwargs):
        c = self.conversion
        call = canonical_call(
            self._signature,
            args,
            kwargs,
            where="calling the converted model",
            defaults=self._defaults,
            shown=c.signature_text,
        )
        tensors = flat_tensors(call, c.arguments)
        if c.shape_conditions is not None:
            check_shapes(c.shape_conditions, tensors, c, self.model, getattr(self._program, "global_scope", {}))
        outputs = self._guarded_program()(*tensors, *self._module_state())
        leaves = [
            outputs[at] if kind == "graph" else tensors[at] if kind == "input" else at  # at: the constant
            for kind, at in c.outputs.leaves
        ]
        return pytree.tree_unflatten(leaves, c.outputs.spec)

    def save(self, path) -> None:
        """Write the converted model as a ``torch.export`` artifact (`ringpass.conversion.archive`; `ringpass.load`
        reads it back)."""
        if not isinstance(self._program, Program):  # a loaded model: its own archive holds the same program
            raise NotSupportedError(
                "save: this model was loaded from an artifact; copy that file instead of saving it again."
            )
        self._slots.bind(GROUP)  # the artifact names the group by its stand-in; each run binds its own
        archive.write(path, self._program, self.conversion, self._example)

    def extra_repr(self) -> str:
        c = self.conversion
        length = "any length" if c.dynamic else f"sequence {c.seq_len}"
        return f"world_size={c.world_size}, layout={c.layout}, {length}"

    # ---- one call --------------------------------------------------------------------------------------
    def _module_state(self) -> list[torch.Tensor]:
        return [*self.model.parameters(), *self.model.buffers()]

    def _guarded_program(self) -> Callable:
        """The program bound to this run's process group and called through `ringpass.frontend.guard`."""
        group = resolve_group(self._group)
        if group is None:
            raise InvalidInputError(
                f"This model was converted for a ring of {self.world_size} ranks and needs a process group to run: "
                "call torch.distributed.init_process_group() first (torchrun sets up the environment), on each of "
                f"the {self.world_size} ranks."
            )
        size = dist.get_world_size(group)
        if size != self.world_size:
            raise InvalidInputError(
                f"This model was converted for a ring of {self.world_size} ranks, but its process group has {size}. "
                f"Run it on {self.world_size} ranks, or convert again with world_size={size}."
            )
        if self._guarded is None or self._slots.name != group.group_name:
            failures.configure(group.group_name, timeout=self._timeout)
            self._slots.bind(group.group_name)
            program, n = self._program, len(self.conversion.tensor_inputs)
            inputs = [GraphInput(s.name, s.sharded, False) for s in self.conversion.tensor_inputs]
            names = [f"model.{name}" for name, _ in (*self.model.named_parameters(), *self.model.named_buffers())]
            inputs += [GraphInput(name, False, True) for name in names]
            self._guarded = GuardedGraph(
                lambda *flat: program(*flat[:n]), inputs, self.conversion.graph_hash, 0, group.group_name, self._checks
            )
        return self._guarded
