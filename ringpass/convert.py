"""`ringpass.convert`: the ring pass applied once, offline; a module that runs the rewritten graph eagerly.

    converted = ringpass.convert(model, {"input_ids": ids, "labels": labels}, world_size=8)
    converted.save("model.pt2")                        # on any machine, no process group
    ...
    model = ringpass.load("model.pt2")                 # on every rank, under torchrun
    loss = model(input_ids=ids, labels=labels).loss    # the unsharded model's numbers

`convert` captures the model with Dynamo exactly as the ``ring`` backend does (one graph: the whole
forward), runs the same pass pipeline (`ringpass.passes.run_pipeline`) for ``world_size`` ranks and keeps
the rewritten FX graph. The `ConvertedModel` runs it as plain eager PyTorch: no Dynamo at run time, no
recompilation. It binds a call the way the model's ``forward`` does (positional or keyword arguments),
reads the graph's inputs from the arguments and from the model it shares (its parameters *are* the
model's: an optimizer on ``model.parameters()`` keeps working), checks the call against what was
converted (argument names, dtypes, shapes; sequence dims free with ``dynamic=True``), and rebuilds the
model's output structure (a Hugging Face ``ModelOutput`` stays one). Each call goes through
`ringpass.guard` like a compiled ring graph. The process group is taken at the first call (``group=``,
else the default group) and must have ``world_size`` ranks.

`ConvertedModel.save` writes a ``torch.export`` artifact (`ringpass.artifact`); `load` reads it back.
"""

from __future__ import annotations

import functools
import inspect as pyinspect
import keyword
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree

from lowering.errors import InvalidInputError, NotSupportedError
from lowering.sequence_ops import EXPORTABLE
from ringpass.graph import example_value, plain
from ringpass.guard import GraphInput, GuardedGraph, graph_hash
from ringpass.inspection import CapturedGraph, Inspection, _as_call
from ringpass.options import RingOptions
from ringpass.passes import run_pipeline
from ringpass.passes.context import LOCAL, PassContext
from ringpass.passes.sharded_lengths import StaticShardedLengths
from ringpass.report import Report
from ringpass.retrace import release_marks, request_retrace

GROUP = "ringpass:converted-group"  # stands for the run-time process group's name in a converted graph
NOT_CONVERT_OPTIONS = ("compiler", "report", "unsharded")  # eager; reported once; a model without attention is refused


@dataclass
class Argument:
    """One argument of the converted call: its name, the pytree structure of its value, and its leaves:
    `TensorSpec` for tensors, plain values (baked in) else."""

    name: str
    spec: pytree.TreeSpec
    leaves: list


@dataclass
class TensorSpec:
    """A tensor leaf of the call: where it goes in the flat program's inputs, what it must look like
    (``None`` in ``shape``: a dim converted symbolic), and whether each rank passes its own shard."""

    index: int
    name: str
    dtype: torch.dtype
    shape: list
    sharded: bool = False


@dataclass
class Outputs:
    """The model's output structure and where each leaf comes from: ``("graph", i)`` the graph's i-th
    output, ``("input", i)`` the i-th tensor input passed through, ``("constant", value)``."""

    spec: pytree.TreeSpec
    leaves: list


@dataclass
class Conversion:
    """Everything a `ConvertedModel` needs besides its program and parameters (what `ringpass.artifact` saves)."""

    world_size: int
    layout: str
    seq_len: int
    dynamic: bool
    options: dict
    arguments: list[Argument]
    outputs: Outputs
    graph_hash: str
    report_text: str
    report_data: dict
    parameters: list[tuple] = field(default_factory=list)  # the forward's (name, kind, default or NO_DEFAULT)
    signature_text: str = ""  # the forward's signature as its code spells it, for messages
    masks: list[str] = field(default_factory=list)   # ids of the mask programs the graph's ring ops call
    shape_conditions: Optional[dict] = None  # dynamic: what Dynamo assumed of the shapes (`_shape_conditions`)

    @property
    def tensor_inputs(self) -> list[TensorSpec]:
        return [leaf for a in self.arguments for leaf in a.leaves if isinstance(leaf, TensorSpec)]


class Program(torch.nn.Module):
    """The converted graph behind a flat signature: ``program(*tensor_inputs) -> tuple of graph outputs``.
    Each graph input is read from the rebuilt arguments or from ``model`` by the path Dynamo recorded for
    it (``L['self']._modules['embed']._parameters['weight']``). This is the module `save` exports."""

    def __init__(self, model: torch.nn.Module, gm: fx.GraphModule, paths: list[tuple[str, bool]], arguments: list[Argument],
                 global_scope: dict):
        super().__init__()
        self.model = model
        self.gm = gm
        self.paths, self.arguments, self.global_scope = paths, arguments, global_scope

    def forward(self, *tensors):
        scope = {"self": self.model, **{a.name: _rebuild(a, tensors) for a in self.arguments}}
        return tuple(self.gm(*(_read(path, scope, as_tensor, self.global_scope) for path, as_tensor in self.paths)))


class ConvertedModel(torch.nn.Module):
    """A model converted for the ring (see the module docstring). ``report``: what the passes did (an
    `Inspection`; printed, it is ``ringpass inspect``'s report). ``model``: the module holding the parameters
    (the original model, or the loaded artifact's)."""

    def __init__(self, model: torch.nn.Module, program: Callable, slots: GroupSlots, conversion: Conversion, *,
                 group=None, checks: str, timeout: float, report=None, example: tuple = ()):
        super().__init__()
        self.model = model
        self.conversion = conversion
        self.report = report
        self.world_size = conversion.world_size
        vars(self)["_program"] = program  # not a submodule: its parameters are `model`'s
        self._slots = slots
        self._group, self._checks, self._timeout = group, checks, timeout
        self._example = example  # the conversion's tensors, which `save` traces the program with
        self._guarded: Optional[GuardedGraph] = None
        self._signature = _signature_of(conversion.parameters)
        self._defaults = {name: default for name, _, default in conversion.parameters if default != NO_DEFAULT}

    def forward(self, *args, **kwargs):
        c = self.conversion
        call = _canonical_call(self._signature, args, kwargs, where="calling the converted model",
                               defaults=self._defaults, shown=c.signature_text)
        tensors = _flat_tensors(call, c.arguments)
        if c.shape_conditions is not None:
            _check_shapes(c.shape_conditions, tensors, c, self.model, getattr(self._program, "global_scope", {}))
        outputs = self._guarded_program()(*tensors, *self._module_state())
        leaves = [outputs[at] if kind == "graph" else tensors[at] if kind == "input" else at  # at: the constant
                  for kind, at in c.outputs.leaves]
        return pytree.tree_unflatten(leaves, c.outputs.spec)

    def save(self, path) -> None:
        """Write the converted model as a ``torch.export`` artifact (see `ringpass.artifact`)."""
        from ringpass.artifact import save

        save(self, path)

    def extra_repr(self) -> str:
        c = self.conversion
        length = "any length" if c.dynamic else f"sequence {c.seq_len}"
        return f"world_size={c.world_size}, layout={c.layout}, {length}"

    # ---- one call --------------------------------------------------------------------------------------
    def _module_state(self) -> list[torch.Tensor]:
        return [*self.model.parameters(), *self.model.buffers()]

    def _guarded_program(self) -> Callable:
        """The program bound to this run's process group and called through `ringpass.guard`."""
        from lowering import failures
        from ringpass.backend import _resolve_group

        group = _resolve_group(self._group)
        if group is None:
            raise InvalidInputError(
                f"This model was converted for a ring of {self.world_size} ranks and needs a process group to run: "
                "call torch.distributed.init_process_group() first (torchrun sets up the environment), on each of "
                f"the {self.world_size} ranks.")
        size = dist.get_world_size(group)
        if size != self.world_size:
            raise InvalidInputError(
                f"This model was converted for a ring of {self.world_size} ranks, but its process group has {size}. "
                f"Run it on {self.world_size} ranks, or convert again with world_size={size}.")
        if self._guarded is None or self._slots.name != group.group_name:
            failures.configure(group.group_name, timeout=self._timeout)
            self._slots.bind(group.group_name)
            program, n = self._program, len(self.conversion.tensor_inputs)
            inputs = [GraphInput(s.name, s.sharded, False) for s in self.conversion.tensor_inputs]
            names = [f"model.{name}" for name, _ in (*self.model.named_parameters(), *self.model.named_buffers())]
            inputs += [GraphInput(name, False, True) for name in names]
            self._guarded = GuardedGraph(lambda *flat: program(*flat[:n]), inputs, self.conversion.graph_hash, 0,
                                         group.group_name, self._checks)
        return self._guarded


def convert(model: torch.nn.Module, example_inputs: Any = (), *, world_size: Optional[int] = None, group=None,
            dynamic: bool = False, **options: Any) -> ConvertedModel:
    """The ``ring`` backend's passes applied once to ``model`` for a ring of ``world_size`` ranks (taken
    from ``group``, or the default process group, when not given); no process group is needed to convert.
    ``example_inputs``: a tensor, a tuple of positional arguments or a dict of keyword arguments, as every
    rank will pass them: the whole sequence (``inputs="sharded"``: one rank's shard, e.g. ``ids[:, :N // P]``,
    since its shape is what each rank passes). ``dynamic=True`` converts with symbolic shapes, so one
    conversion serves many lengths.
    ``options``: the backend's (layout, inputs, outputs, grads, masks, checks, timeout; docs/backend.md)."""
    for name in NOT_CONVERT_OPTIONS:
        if name in options:
            raise InvalidInputError(f"convert: option `{name}` does not apply (a converted graph runs eagerly, its "
                                    "report is `converted.report`, and a model without attention is refused).")
    world_size = _world_size(world_size, group)
    ring_options = RingOptions.from_dict({**options, "report": "off"})
    if ring_options.ulysses != 1 or getattr(group, "ndim", 1) == 2:
        raise NotSupportedError("convert: Ulysses x ring is not built for converted models yet; compile with "
                                "backend='ring' for it, or convert a plain ring (ulysses=1, a 1-D group).")
    model = getattr(model, "_orig_mod", model)  # a torch.compile'd module: the module it wraps
    signature = pyinspect.signature(model.forward)
    defaults = {p.name: p.default for p in signature.parameters.values() if _plain(p.default)}
    call = _distinct(_canonical_call(signature, *_as_call(example_inputs), where="convert", defaults=defaults))
    captured = _capture(model, call, ring_options, world_size, dynamic)
    gm, ctx = captured.gm, captured.ctx
    dynamic = dynamic or ctx.dynamic  # inputs="sharded": traced with the sequence dims dynamic (ringpass.retrace)
    for node in gm.graph.nodes:  # torch.export keeps these as ops; it would drop an autograd.Function's backward
        if node.target in EXPORTABLE:
            node.target = EXPORTABLE[node.target]
    gm.recompile()
    arguments, placeholders = _arguments(call, gm, ctx)
    conversion = Conversion(
        world_size=world_size, layout=ctx.layout_kind, seq_len=plain(ctx.global_seq_len), dynamic=dynamic,
        options={k: v for k, v in vars(ring_options).items() if k not in ("group", *NOT_CONVERT_OPTIONS)},
        arguments=arguments, outputs=_outputs(captured, call), graph_hash=graph_hash(ctx),
        report_text="", report_data={},
        parameters=[(p.name, p.kind.name, p.default if _plain(p.default) else NO_DEFAULT)
                    for p in signature.parameters.values()],
        signature_text=str(signature),
        masks=sorted({a for n in gm.graph.nodes for a in pytree.tree_leaves((n.args, n.kwargs))
                      if isinstance(a, str) and a.startswith("mask-")}))
    report = Inspection(world_size, conversion.options, [CapturedGraph(gm, ctx.report, ctx.placement, ctx.axes)], "convert")
    conversion.report_text, conversion.report_data = str(report), report.as_dict()
    conversion.shape_conditions = _shape_conditions(gm, placeholders, dynamic)
    program = Program(model, gm, placeholders, arguments, captured.global_scope)
    converted = ConvertedModel(model, program, GroupSlots(gm), conversion, group=group, checks=ring_options.checks,
                               timeout=ring_options.timeout, report=report, example=_flat_tensors(call, arguments))
    return converted


def _world_size(world_size: Optional[int], group) -> int:
    if world_size is None:
        if group is None and not (dist.is_available() and dist.is_initialized()):
            raise InvalidInputError("convert: give world_size= (the ranks the converted model will run on); no process "
                                    "group is needed to convert.")
        from ringpass.backend import _resolve_group

        world_size = dist.get_world_size(_resolve_group(group))
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise InvalidInputError(f"convert: world_size must be an int >= 2 (the ranks in the ring), got {world_size!r}.")
    return world_size


# ---- capture -------------------------------------------------------------------------------------------
@dataclass
class _Captured:
    gm: fx.GraphModule
    ctx: PassContext
    graph_outputs: tuple = ()
    result: Any = None
    global_scope: dict = field(default_factory=dict)  # the capture function's globals (Dynamo's G)


def _capture(model, call: list, options: RingOptions, world_size: int, dynamic: bool) -> _Captured:
    """Dynamo's one graph of ``model(call)``, rewritten by the pipeline; the call runs nothing at full size
    (the graph's outputs are empty tensors, there only to learn the output structure)."""
    found: dict[str, Any] = {}

    def backend(gm: fx.GraphModule, graph_inputs: list, **_: Any):
        output = next(n for n in gm.graph.nodes if n.op == "output")
        like = fx.node.map_arg(output.args[0], example_value)
        sizes = [v for v in pytree.tree_leaves(like) if isinstance(v, torch.SymInt) and not v.node.is_constant()]
        if sizes:
            found["error"] = NotSupportedError(
                "convert: with dynamic=True the model returns a size computed from its inputs' shapes (a Python int); a "
                "converted model would return the size it was converted with. Return a tensor, or compute the size "
                "from the inputs outside the model.")
            raise found["error"]
        ctx = PassContext(gm, graph_inputs, options, world_size, GROUP, Report(world_size=world_size))
        for node in gm.graph.nodes:  # where each input comes from (Dynamo drops its record after the compile)
            graph_arg = node.meta.get("grapharg")
            if node.op == "placeholder":
                node.meta["ringpass_source"] = graph_arg.source.name
                node.meta["ringpass_as_tensor"] = bool(graph_arg.pass_arg_as_tensor)
        try:
            run_pipeline(ctx)
            gm.graph.lint()
            gm.recompile()
        except StaticShardedLengths as error:  # as the backend: traced again with the sequence dims dynamic
            retrace = request_retrace(error)
            if retrace is not None:
                raise retrace from None
            found["error"] = error
            release_marks()
            raise
        except Exception as error:
            found["error"] = error
            release_marks()
            raise
        release_marks()
        found["captured"] = captured = _Captured(gm, ctx)

        def run(*_):
            captured.graph_outputs = tuple(pytree.tree_map(_empty_like, like))
            return captured.graph_outputs

        return run

    run_call = _call_function(call)
    try:
        with torch._dynamo.config.patch(specialize_float=True):  # Python floats are baked in (a dropout p, an eps)
            result = torch.compile(run_call, backend=backend, fullgraph=True, dynamic=dynamic)(model, *[v for _, _, v in call])
    except Exception as error:
        if "error" in found:
            raise found["error"] from None
        first_line = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        if isinstance(error, torch._dynamo.exc.Unsupported):
            raise NotSupportedError(
                f"convert: Dynamo could not capture the model's forward as one graph ({first_line}). A converted model "
                "is one graph: remove the graph break (the cause's traceback shows where), or use "
                "torch.compile(model, backend='ring'), which runs the code between graphs eagerly.") from error
        raise InvalidInputError(f"convert: the model raised on the example inputs ({first_line}); the cause's "
                                "traceback shows where. Check that the example inputs are what the model takes.") from error
    captured = found["captured"]
    captured.global_scope = run_call.__globals__
    if captured.ctx.report.unchanged:
        raise NotSupportedError(
            "convert: no attention found in the model's graph, so there is nothing to run as a ring: the converted "
            "model would run unsharded on every rank. ringpass.inspect(model, inputs, world_size=P) shows what the "
            "pass sees.")
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


# ---- the call's structure ---------------------------------------------------------------------------------
def _canonical_call(signature: pyinspect.Signature, args: tuple, kwargs: dict, *, where: str, defaults: dict,
                    shown: Optional[str] = None) -> list:
    """The call as ``[(name, "positional" | "keyword", value)]`` in the order of the signature, however it was
    spelled (``model(ids)`` and ``model(input_ids=ids)`` are the same call); ``**kwargs`` entries sorted; an
    argument passed as its own default (``attention_mask=None``) is left out, as if not passed."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:
        raise InvalidInputError(f"{where}: the arguments do not fit the model's forward{shown or signature}: {error}.") from None
    var_positional = any(p.kind == p.VAR_POSITIONAL and bound.arguments.get(p.name) for p in signature.parameters.values())
    call = []
    for name, parameter in signature.parameters.items():
        if name not in bound.arguments:
            continue
        value = bound.arguments[name]
        if parameter.kind == parameter.VAR_POSITIONAL:
            call += [(f"{name}_{i}", "positional", v) for i, v in enumerate(value)]
        elif parameter.kind == parameter.VAR_KEYWORD:
            call += [(key, "keyword", value[key]) for key in sorted(value)]
        elif name in defaults and _same_plain(value, defaults[name]):
            continue
        else:
            positional = parameter.kind == parameter.POSITIONAL_ONLY or (
                parameter.kind == parameter.POSITIONAL_OR_KEYWORD and var_positional)
            call.append((name, "positional" if positional else "keyword", value))
    for name, _, _ in call:
        if not name.isidentifier() or keyword.iskeyword(name) or name == "self":
            raise InvalidInputError(f"{where}: argument name {name!r} cannot be converted (not a plain identifier).")
    return call


def _distinct(call: list) -> list:
    """The call with a tensor passed under two names (``labels=ids``) copied for its second name: Dynamo would
    make them one graph input, and a later call passing two different tensors would read only the first."""
    seen: set[int] = set()

    def own(leaf):
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if id(leaf) in seen:
            return leaf.clone()
        seen.add(id(leaf))
        return leaf

    return [(name, how, pytree.tree_map(own, value)) for name, how, value in call]


def _plain(value) -> bool:
    return value is None or type(value) in (bool, int, float, str)


def _same_plain(value, default) -> bool:
    return _plain(value) and type(value) is type(default) and value == default


NO_DEFAULT = "<no default>"


def _signature_of(parameters: list[tuple]) -> pyinspect.Signature:
    """The model's forward signature from (name, kind, default) triples, every parameter optional: binding
    then spells a call as the forward would, and `_flat_tensors` reports what is missing against what was
    converted."""
    return pyinspect.Signature([
        pyinspect.Parameter(name, getattr(pyinspect.Parameter, kind),
                            default=pyinspect.Parameter.empty if kind.startswith("VAR_") else _MISSING)
        for name, kind, _ in parameters])


class _Missing:
    def __repr__(self):
        return "<not given>"


_MISSING = _Missing()


def _flat_tensors(call: list, arguments: list[Argument]) -> tuple:
    """The call's tensors in the flat program's order, after checking its structure against the conversion:
    same arguments, same containers, same non-tensor values (they were baked into the graph)."""
    given = {name: value for name, _, value in call if value is not _MISSING}
    converted = ", ".join(a.name for a in arguments)
    extra = set(given) - {a.name for a in arguments}
    if extra:
        raise InvalidInputError(f"Argument(s) {', '.join(sorted(extra))} were not given when the model was converted "
                                f"(it takes {converted}); convert again with them.")
    tensors = []
    for a in arguments:
        value = given.get(a.name, _MISSING)
        if value is _MISSING:
            raise InvalidInputError(f"Argument `{a.name}` was given when the model was converted and must be given "
                                    f"each call (the converted call takes {converted}).")
        leaves, spec = pytree.tree_flatten(value)
        if spec != a.spec:
            raise InvalidInputError(f"Argument `{a.name}` has structure {spec}, converted with {a.spec}.")
        for leaf, converted_leaf in zip(leaves, a.leaves):
            if isinstance(converted_leaf, TensorSpec):
                if not isinstance(leaf, torch.Tensor):
                    raise InvalidInputError(f"Argument `{converted_leaf.name}` must be a tensor (it was converted with one), "
                                            f"got {type(leaf).__name__}.")
                _check_tensor(leaf, converted_leaf)
                tensors.append(leaf)
            elif isinstance(leaf, torch.Tensor) or leaf != converted_leaf:
                given = f"a tensor {list(leaf.shape)}" if isinstance(leaf, torch.Tensor) else repr(leaf)
                raise InvalidInputError(f"Argument `{a.name}` is {given}; the model was converted with {converted_leaf!r}, "
                                        "which is baked into the converted graph. Convert again with this value.")
    return tuple(tensors)


def _check_tensor(value: torch.Tensor, spec: TensorSpec) -> None:
    fits = value.dtype == spec.dtype and value.dim() == len(spec.shape) and all(
        s is None or s == v for s, v in zip(spec.shape, value.shape))
    if not fits:
        shape = "[" + ", ".join("*" if s is None else str(s) for s in spec.shape) + "]"
        hint = "" if any(s is None for s in spec.shape) else " Convert with dynamic=True for other sizes."
        raise InvalidInputError(f"Argument `{spec.name}` is {str(value.dtype)[6:]} {list(value.shape)}; the model was "
                                f"converted for {str(spec.dtype)[6:]} {shape} (* = any size).{hint}")


def _arguments(call: list, gm: fx.GraphModule, ctx: PassContext) -> tuple[list[Argument], list[tuple[str, bool]]]:
    """The call's `Argument`s, and for each graph input the path to read it from and whether Dynamo passes it
    as a tensor (a float attribute of a module, made a tensor input under dynamic shapes)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    paths = [(n.meta["ringpass_source"], n.meta["ringpass_as_tensor"]) for n in placeholders]
    by_object = {}  # id(tensor passed in the call) -> the placeholder Dynamo made of it
    scope = {"self": None, **{name: value for name, _, value in call}}
    for node, (path, _) in zip(placeholders, paths):
        value = _read(path, scope, False, {}) if path.startswith("L[") and not path.startswith("L['self']") else None
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
                    raise InvalidInputError(f"convert: argument `{name}` holds a {type(leaf).__name__}; a converted call "
                                            "takes tensors, containers of them, and plain numbers or strings.")
                converted.append(leaf)
                continue
            node = by_object.get(id(leaf))
            like = example_value(node) if node is not None else leaf
            shape = [None if isinstance(s, torch.SymInt) and not s.node.is_constant() else plain(s) for s in like.shape]
            sharded = node is not None and ctx.options.inputs == "sharded" and (
                ctx.placement.get(node) == LOCAL or node in ctx.gathered_inputs)
            label = name + pytree.keystr(key)  # input_ids, batch['rest'][0]
            converted.append(TensorSpec(index, label, leaf.dtype, shape, sharded))
            index += 1
        arguments.append(Argument(name, spec, converted))
    return arguments, paths


def _outputs(captured: _Captured, call: list) -> Outputs:
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
                raise NotSupportedError("convert: the model returns a tensor made outside its graph; please report this model.")
        elif isinstance(leaf, (type(None), bool, int, float, str)):
            found.append(("constant", leaf))
        else:
            raise NotSupportedError(f"convert: the model returns a {type(leaf).__name__}; a converted model returns tensors, "
                                    "containers of them (registered with torch.utils._pytree), and plain values.")
    return Outputs(spec, found)


def _shape_conditions(gm: fx.GraphModule, paths: list, dynamic: bool) -> Optional[dict]:
    """For a dynamic conversion: Dynamo's assumptions about the shapes (its shape guards, e.g. a length of at
    least 2) as an expression over the graph's inputs ``t0, t1, ...``, with the paths of the inputs it reads
    (saved with the artifact: a loaded model checks them too). Static shapes are checked by `_flat_tensors`."""
    if not dynamic:
        return None
    placeholders = [example_value(n) for n in gm.graph.nodes if n.op == "placeholder"]
    shape_env = next(v.fake_mode.shape_env for v in placeholders if isinstance(v, torch.Tensor))
    expression = shape_env.produce_guards_expression(placeholders, ignore_static=True)
    if not expression:
        return None
    used = sorted({int(i) for i in re.findall(r"L\['t(\d+)'\]", expression)})
    return {"expression": expression, "inputs": len(placeholders),
            "read": [[i, paths[i][0], paths[i][1]] for i in used]}


def _check_shapes(conditions: dict, tensors: tuple, c: Conversion, model, global_scope: dict) -> None:
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    # contiguous: Dynamo also guards on strides, which eager ops do not need (they work or raise on their own)
    tensors = tuple(t.contiguous() for t in tensors)
    scope = {"self": model, **{a.name: _rebuild(a, tensors) for a in c.arguments}}
    values: list = [None] * conditions["inputs"]
    for i, path, as_tensor in conditions["read"]:
        values[i] = _read(path, scope, as_tensor, global_scope)
    if not eval(conditions["expression"], SYMPY_INTERP, {"L": {f"t{i}": v for i, v in enumerate(values)}}):
        shapes = ", ".join(f"{s.name} {list(t.shape)}" for s, t in zip(c.tensor_inputs, tensors))
        raise InvalidInputError(
            f"The converted graph does not fit these inputs ({shapes}): Dynamo traced it with symbolic shapes under "
            "conditions they break. Sizes 0 and 1 are specialized, so a dim converted at 2 or more must stay at 2 or "
            "more (convert with batch 1 to run batch 1). The conditions, over the graph's inputs t0, t1, ...: "
            f"{conditions['expression']}.")


# ---- reading the graph's inputs --------------------------------------------------------------------------
def _rebuild(argument: Argument, tensors: tuple):
    leaves = [tensors[leaf.index] if isinstance(leaf, TensorSpec) else leaf for leaf in argument.leaves]
    return pytree.tree_unflatten(leaves, argument.spec)


def _read(path: str, scope: dict, as_tensor: bool, global_scope: dict):
    """The value at a Dynamo source path (``L['input_ids'].size()[1]``, ``G['scale']``) in ``scope`` (the call's
    frame) and ``global_scope`` (its globals, where Dynamo puts the modules and globals the model reads)."""
    from torch._dynamo.guards import _get_closure_vars

    value = eval(_compiled_path(path), {**_get_closure_vars(), "L": scope, "G": global_scope})  # Dynamo's own paths
    return torch.as_tensor(value) if as_tensor else value


@functools.lru_cache(maxsize=4096)
def _compiled_path(path: str):
    return compile(path, "<dynamo source>", "eval")


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
