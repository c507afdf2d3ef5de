"""Every private torch and transformers name ringpass uses, each with the reason, in one place.

Nothing else in `ringpass` or `lowering` reaches a private name (tests/unit/test_compat.py walks the source): a module
reads ``compat.NAME`` for a name below (`SYMBOLS`), resolved on first use and then kept, or calls one of the small
functions at the end for a private attribute of an object. A torch or transformers release that moves a name
raises `TorchInternalMoved` where ringpass needs it, naming it, why ringpass needs it and which releases are
tested; tests/unit/test_compat.py resolves every name, so a new release shows all of them at once
(``./dev test --torch VERSION tests/unit/test_compat.py``). Resolving imports only what the name lives in: reading
``compat.maybe_mark_dynamic`` imports Dynamo, ``import lowering.compat`` imports nothing.

The ATen operators (``aten._softmax``, ``aten._scaled_dot_product_flash_attention_for_cpu``) are not here: they
are the operator set of torch's IR, called through ``torch.ops``, and the operator tests run each one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from lowering.errors import RingpassError

TESTED_TORCH = "2.13.0, 2.14.1 and 2.15.0"
TESTED_TRANSFORMERS = "5.23.0 and 5.25.0"

# Private module paths ringpass names as strings (a logger, an import hook, a module to preload)
DYNAMO_MODULE = "torch._dynamo"
DDP_OPTIMIZER_MODULE = (
    "torch._dynamo.backends.distributed"  # where DDPOptimizer lives: ringpass.frontend.ddp_whole_graph
)
FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"  # logs each failed fake op at ERROR: quiet while probing
VMAP_BOOKKEEPING_MODULE = "torch._functorch.predispatch"  # the module of vmap's level functions in a graph


class TorchInternalMoved(RingpassError, ImportError):
    """A private torch / transformers name ringpass relies on is not where this release keeps it."""


@dataclass(frozen=True)
class Private:
    """``path``: a module, or a module's attribute (``torch._dynamo.source.AttrSource``), or an attribute of a
    class (``torch.nn.parallel.DistributedDataParallel._get_active_ddp_module``); with ``sample``, the attribute
    after the last dot is read from the object ``sample()`` returns (an attribute each instance has).
    ``why``: what ringpass needs it for. ``may_be_none``: None is a value it can have. ``read_by``: for an
    attribute ringpass sets or deletes on an object for torch to read, the module whose code reads it (resolving
    checks that it still does)."""

    path: str
    why: str
    sample: Callable[[], object] | None = None
    may_be_none: bool = False
    read_by: str = ""


def _an_op():
    import torch

    return torch.ops.aten.add.Tensor


def _a_symint_node():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return ShapeEnv().create_unbacked_symint().node


def _an_fx_node():
    import torch

    graph = torch.fx.Graph()
    return graph.placeholder("x")


def _an_op_packet():
    import torch

    return torch.ops.aten.add


def _a_compiled_module():
    import torch

    return torch.compile(torch.nn.Identity())  # nothing compiles until it is called


def _a_config():
    import transformers

    return transformers.PretrainedConfig()


SAMPLES = {"op": _an_op, "symint node": _a_symint_node, "fx node": _an_fx_node}
_DYNAMO_MARKS_READER = "torch._dynamo.decorators"

SYMBOLS: dict[str, Private] = {
    # ---- pytree, tensor subclasses, dispatch -------------------------------------------------------------------
    "pytree": Private("torch.utils._pytree", "flattens nested inputs and outputs (torch has no public pytree)"),
    "make_wrapper_subclass": Private(
        "torch.Tensor._make_wrapper_subclass", "builds SequenceSharded / SequenceMask (tensor subclasses)"
    ),
    "disabled_torch_function_impl": Private(
        "torch._C._disabled_torch_function_impl", "a tensor subclass that handles ops at the dispatch level only"
    ),
    "disable_dynamo": Private("torch._disable_dynamo", "a subclass's dispatch rules run eagerly, never traced"),
    "is_fake": Private("torch._subclasses.fake_tensor.is_fake", "tells a traced (fake) tensor from a real one"),
    "FakeTensorMode": Private("torch._subclasses.fake_tensor.FakeTensorMode", "the plan runs a step on fake tensors"),
    "TorchDispatchMode": Private("torch.utils._python_dispatch.TorchDispatchMode", "the plan counts each op's bytes"),
    "DispatchKey": Private("torch._C.DispatchKey", "names the autocast and autograd dispatch keys"),
    "DispatchKeySet": Private("torch._C.DispatchKeySet", "the ring op's autocast kernel excludes its own key"),
    "dispatch_key_for_device": Private("torch._C._dispatch_key_for_device", "the autocast key of a device type"),
    "ExcludeDispatchKeyGuard": Private("torch._C._ExcludeDispatchKeyGuard", "runs the ring op below autocast"),
    "ForceDispatchKeyGuard": Private(
        "torch._C._ForceDispatchKeyGuard", "autograd inside the ring's backward kernel (program gradients)"
    ),
    "dispatch_tls_local_include_set": Private("torch._C._dispatch_tls_local_include_set", "the same"),
    "dispatch_tls_local_exclude_set": Private("torch._C._dispatch_tls_local_exclude_set", "the same"),
    "dispatch_has_kernel_for_dispatch_key": Private(
        "torch._C._dispatch_has_kernel_for_dispatch_key", "whether a ringpass op has an autograd kernel"
    ),
    "custom_op_defs": Private("torch._library.custom_ops.OPDEFS", "the autograd formula of a ringpass custom op"),
    "OpOverload": Private("torch._ops.OpOverload", "tells an ATen overload from other call targets in a graph"),
    "OpOverloadPacket": Private("torch._ops.OpOverloadPacket", "the same, for an op without its overload"),
    "HigherOrderOperator": Private("torch._ops.HigherOrderOperator", "finds subgraph calls (checkpoint, cond)"),
    "OpOverload._schema": Private(
        "torch._ops.OpOverload._schema", "an op's arguments and what it writes", sample=_an_op
    ),
    "OpOverload._overloadpacket": Private(
        "torch._ops.OpOverload._overloadpacket", "groups an op's overloads", sample=_an_op
    ),
    "vmap_decrement_nesting": Private(
        "torch._C._functorch._vmap_decrement_nesting", "closes the vmap levels a failed probe left open"
    ),
    # ---- functions a graph may call -----------------------------------------------------------------------------
    "sdpa_binding": Private("torch._C._nn.scaled_dot_product_attention", "SDPA as Dynamo may record it"),
    "pad_binding": Private("torch._C._nn.pad", "F.pad as Dynamo may record it"),
    "constant_pad_nd_ref": Private("torch._refs.constant_pad_nd", "pads without specialising symbolic sizes"),
    "transformer_encoder_layer_fwd": Private(
        "torch._transformer_encoder_layer_fwd", "nn.TransformerEncoderLayer's fused path: refused, it hides attention"
    ),
    "native_multi_head_attention": Private(
        "torch._native_multi_head_attention", "nn.MultiheadAttention's fused path: refused, it hides attention"
    ),
    # ---- Dynamo --------------------------------------------------------------------------------------------------
    "dynamo_reset": Private("torch._dynamo.reset", "a fresh capture (inspect, bench, the plan)"),
    "maybe_mark_dynamic": Private("torch._dynamo.maybe_mark_dynamic", "a sequence dim stays symbolic"),
    "dynamo_config": Private("torch._dynamo.config", "convert pins Python floats (specialize_float)"),
    "DynamoUnsupported": Private("torch._dynamo.exc.Unsupported", "convert's capture says what Dynamo refused"),
    "ShortenTraceback": Private("torch._dynamo.exc.ShortenTraceback", "a refusal shows the user's line, not ours"),
    "RestartAnalysis": Private(
        "torch._dynamo.exc.RestartAnalysis", "the inner compiler asks Dynamo to trace the frame again (floats)"
    ),
    "TensorifyScalarRestartAnalysis": Private(
        "torch._dynamo.exc.TensorifyScalarRestartAnalysis", "asks Dynamo to trace a frame again (`frontend.retrace`)"
    ),
    "dynamo_sources": Private("torch._dynamo.source", "where a graph input came from (an attribute, a global)"),
    "Source": Private("torch._guards.Source", "the type of a graph input's origin"),
    "dynamo_closure_vars": Private(
        "torch._dynamo.guards._get_closure_vars", "the getters a loaded program's input paths may call"
    ),
    "get_optimize_ddp_mode": Private("torch._dynamo.utils.get_optimize_ddp_mode", "whether DDPOptimizer splits"),
    "DDPOptimizer": Private(
        "torch._dynamo.backends.distributed.DDPOptimizer", "its split of a graph at DDP's buckets is skipped"
    ),
    "aot_eager": Private("torch._dynamo.backends.debugging.aot_eager", "the compiler='aot_eager' option"),
    "compile_fx": Private("torch._inductor.compile_fx.compile_fx", "the compiler='inductor' option"),
    "aot_autograd": Private("torch._dynamo.backends.common.aot_autograd", "the plan compiles a step's graphs"),
    "make_boxed_func": Private("torch._functorch.aot_autograd.make_boxed_func", "the same"),
    "min_cut_rematerialization_partition": Private(
        "torch._functorch.partitioners.min_cut_rematerialization_partition", "the same partition as the backend"
    ),
    "SymNode._expr": Private(
        "torch.fx.experimental.sym_node.SymNode._expr", "a length before replacements", sample=_a_symint_node
    ),
    "Node._erased": Private("torch.fx.Node._erased", "whether a node was removed from its graph", sample=_an_fx_node),
    # ---- torch.distributed ---------------------------------------------------------------------------------------
    "get_default_store": Private(
        "torch.distributed.distributed_c10d._get_default_store", "ranks meet and beat through the job's store"
    ),
    "resolve_process_group": Private(
        "torch.distributed.distributed_c10d._resolve_process_group", "a compiled graph names its group"
    ),
    "active_ddp_module": Private(
        "torch.nn.parallel.DistributedDataParallel._get_active_ddp_module", "the DDP module being compiled"
    ),
    "module_state_mapping": Private(
        "torch.distributed._composable_state._module_state_mapping", "finds the FSDP2 state of a graph's parameters"
    ),
    "FSDPState": Private("torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState", "the same"),
    "DeviceMesh._flatten": Private(
        "torch.distributed.device_mesh.DeviceMesh._flatten", "one group over a 2-D mesh (ring x Ulysses)"
    ),
    "checkpoint_wrapper": Private(
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper",
        "the plan checkpoints blocks as torch's apply_activation_checkpointing does",
    ),
    "MemTracker": Private("torch.distributed._tools.mem_tracker.MemTracker", "the plan's per-module memory"),
    "MemRefType": Private("torch.distributed._tools.mem_tracker._MemRefType", "the same"),
    "ModState": Private("torch.distributed._tools.mem_tracker._ModState", "the same"),
    # ---- private attributes, read through the functions below -------------------------------------------------
    "Tensor._is_view": Private("torch.Tensor._is_view", "a view's storage is its base's (no copy to free)"),
    "UntypedStorage._cdata": Private("torch.UntypedStorage._cdata", "the plan tells storages apart by address"),
    "Tensor._base": Private(
        "torch.Tensor._base", "an example input that is a view is saved as its own tensor", may_be_none=True
    ),
    "OptimizedModule._orig_mod": Private(
        "torch._dynamo.eval_frame.OptimizedModule._orig_mod",
        "the module torch.compile wraps",
        sample=_a_compiled_module,
    ),
    "WrapBackendDebug._torchdynamo_orig_backend": Private(
        "WrapBackendDebug._torchdynamo_orig_backend",
        "the backend under Dynamo's wrappers",
        read_by="torch._dynamo.eval_frame",
    ),
    "GraphModule.meta[dynamo_compile_id]": Private(
        "torch.fx.GraphModule.dynamo_compile_id",
        "how many times Dynamo compiled the graph's frame (the recompile limit's count)",
        read_by="torch._dynamo.output_graph",
    ),
    "GraphModule.compile_subgraph_reason": Private(
        "torch.fx.GraphModule.compile_subgraph_reason",
        "whether Dynamo's graph ends at a graph break (its outputs flow into the next graph)",
        read_by="torch._dynamo.output_graph",
    ),
    "OpOverloadPacket._qualified_op_name": Private(
        "torch._ops.OpOverloadPacket._qualified_op_name", "an op's namespace::name", sample=_an_op_packet
    ),
    "Node._dynamo_source": Private(
        "torch.fx.Node._dynamo_source",
        "AOTAutograd maps Dynamo's graph inputs by it",
        read_by="torch._functorch._aot_autograd.frontend_utils",
    ),
    "GraphModule._param_name_to_source": Private(
        "torch.fx.GraphModule._param_name_to_source",
        "the same, for parameters",
        read_by="torch._functorch._aot_autograd.frontend_utils",
    ),
    "Tensor._dynamo_weak_dynamic_indices": Private(
        "torch.Tensor._dynamo_weak_dynamic_indices",
        "maybe_mark_dynamic's marks, taken back after a retrace",
        read_by=_DYNAMO_MARKS_READER,
    ),
    "Tensor._dynamo_dynamic_indices": Private(
        "torch.Tensor._dynamo_dynamic_indices", "mark_dynamic's marks", read_by=_DYNAMO_MARKS_READER
    ),
    "Tensor._dynamo_propagated_dynamic_indices": Private(
        "torch.Tensor._dynamo_propagated_dynamic_indices",
        "dims Dynamo marked dynamic from another tensor",
        read_by="torch._dynamo.variables.builder",
    ),
    "Tensor._dynamo_static_indices": Private(
        "torch.Tensor._dynamo_static_indices", "mark_static's marks", read_by=_DYNAMO_MARKS_READER
    ),
    "Tensor._dynamo_unbacked_indices": Private(
        "torch.Tensor._dynamo_unbacked_indices", "mark_unbacked's marks", read_by=_DYNAMO_MARKS_READER
    ),
    "Tensor._has_dynamo_dim_marking": Private(
        "torch.Tensor._has_dynamo_dim_marking", "whether a tensor has any mark", read_by=_DYNAMO_MARKS_READER
    ),
    "FSDPState._fsdp_param_group": Private(
        "FSDPState._fsdp_param_group",
        "the parameters an FSDP2 state owns",
        read_by="torch.distributed.fsdp._fully_shard._fsdp_state",
    ),
    "FSDPParam._unsharded_param": Private(
        "FSDPParam._unsharded_param",
        "the tensor a graph's parameter input was traced from",
        read_by="torch.distributed.fsdp._fully_shard._fsdp_param",
    ),
    "CustomOpDef._backward_fn": Private(
        "CustomOpDef._backward_fn",
        "whether a custom op has an autograd formula",
        read_by="torch._library.custom_ops",
    ),
    # ---- transformers ------------------------------------------------------------------------------------------
    "get_model_class": Private(
        "transformers.models.auto.auto_factory._get_model_class", "the class AutoModel builds for a config"
    ),
    "AutoModel._model_mapping": Private("transformers.AutoModel._model_mapping", "config type -> model class"),
    "PreTrainedModel._supports_sdpa": Private(
        "transformers.PreTrainedModel._supports_sdpa", "a model that can run SDPA"
    ),
    "PreTrainedModel._supports_attention_backend": Private(
        "transformers.PreTrainedModel._supports_attention_backend", "a model that runs transformers' attention"
    ),
    "PretrainedConfig._attn_implementation": Private(
        "transformers.PretrainedConfig._attn_implementation",
        "builds a model with SDPA or eager attention",
        sample=_a_config,
        may_be_none=True,
    ),
    "PreTrainedModel._from_config": Private("transformers.PreTrainedModel._from_config", "a model with random weights"),
}


def resolve(name: str) -> object:
    """The object `SYMBOLS` [``name``] names; `TorchInternalMoved` if this torch / transformers lacks it."""
    symbol = SYMBOLS[name]
    parts = symbol.path.split(".")
    try:
        if symbol.read_by:
            return _still_read(symbol.read_by, parts[-1])
        if symbol.sample is not None:
            return getattr(symbol.sample(), parts[-1])
        for cut in range(len(parts), 0, -1):  # the longest prefix that imports; the rest are attributes
            try:
                value = importlib.import_module(".".join(parts[:cut]))
            except ModuleNotFoundError:
                continue
            for part in parts[cut:]:
                value = getattr(value, part)
            return value
        raise ModuleNotFoundError(parts[0])
    except (ImportError, AttributeError) as error:
        library = "transformers" if parts[0] == "transformers" else "torch"
        installed = installed_version(library)
        tested = TESTED_TRANSFORMERS if library == "transformers" else TESTED_TORCH
        raise TorchInternalMoved(
            f"ringpass uses {symbol.path} ({symbol.why}), which {library} {installed} does not have ({error}). "
            f"ringpass is tested with {library} {tested} (README, 'Tested versions'): install one of those, or "
            f"report this {library} release to ringpass."
        ) from error


def _still_read(module: str, attribute: str) -> bool:
    import inspect

    if attribute not in inspect.getsource(importlib.import_module(module)):
        raise AttributeError(f"{module} no longer reads {attribute}")
    return True


def installed_version(library: str) -> str:
    """``library``'s version as installed (``torch``, ``transformers``), or that it is not installed."""
    try:
        return importlib.import_module(library).__version__
    except ImportError:
        return "(not installed)"


def __getattr__(name: str) -> object:
    if name not in SYMBOLS or not name.isidentifier():  # "Class._attribute": read through a function below
        raise AttributeError(f"module 'lowering.compat' has no attribute {name!r}")
    value = resolve(name)
    globals()[name] = value  # resolved once
    return value


# ---- private attributes of objects (their `SYMBOLS` entries: "Class._attribute") ----------------------------------
def schema_of(op):
    """An ATen / custom op overload's schema: its arguments, what it writes."""
    return op._schema


def overload_packet(op):
    """``torch.ops.aten.add`` for ``torch.ops.aten.add.Tensor``."""
    return op._overloadpacket


def unreplaced_expr(symnode):
    """A SymInt's expression as traced, before the shape environment's replacements."""
    return getattr(symnode, "_expr", symnode.expr)


def erased(node) -> bool:
    """Whether an fx node was erased from its graph."""
    return getattr(node, "_erased", False)


def flattened_mesh(mesh):
    """A 2-D DeviceMesh as one dimension (its group spans both)."""
    return mesh._flatten()


def is_view(tensor) -> bool:
    """Whether ``tensor`` is a view of another tensor's storage."""
    return tensor._is_view()


def storage_id(storage) -> int:
    """The address of ``storage`` (an UntypedStorage): equal for every tensor sharing it, while it lives."""
    return storage._cdata


def view_base(tensor):
    """The tensor ``tensor`` is a view of, or None."""
    return tensor._base


def ends_at_graph_break(gm) -> bool:
    """Whether Dynamo cut ``gm`` at a graph break (what it returns goes on into the code after the break)."""
    return bool(getattr(getattr(gm, "compile_subgraph_reason", None), "graph_break", False))


def dynamo_compile_id(gm):
    """Dynamo's ``CompileId`` of the graph (``frame_compile_id``: how many times its frame compiled before), or None."""
    return gm.meta.get("dynamo_compile_id")


def compiled_module_inner(model):
    """The module ``torch.compile(module)`` wraps, or ``model`` itself."""
    return getattr(model, "_orig_mod", model)


def backend_inner(fn) -> object:
    """The backend under Dynamo's wrapper (``WrapBackendDebug``) or torch.compile's (``_TorchCompileWrapper``)."""
    return getattr(fn, "_torchdynamo_orig_backend", None) or getattr(fn, "compiler_fn", None)


def dynamo_source(node):
    """The Dynamo source of a graph placeholder (AOTAutograd maps Dynamo's inputs by it), or None."""
    return getattr(node, "_dynamo_source", None)


def set_dynamo_source(node, source) -> None:
    node._dynamo_source = source


def copy_parameter_sources(copy, gm) -> None:
    """Dynamo's parameter name -> source map, which AOTAutograd reads from the graph module, onto ``copy``."""
    if hasattr(gm, "_param_name_to_source"):
        copy._param_name_to_source = gm._param_name_to_source


DYNAMIC, WEAKLY_DYNAMIC, PROPAGATED = (  # mark_dynamic's, maybe_mark_dynamic's, what Dynamo propagated from another
    "_dynamo_dynamic_indices",  # tensor
    "_dynamo_weak_dynamic_indices",
    "_dynamo_propagated_dynamic_indices",
)
STATIC, UNBACKED = "_dynamo_static_indices", "_dynamo_unbacked_indices"
DYNAMIC_MARKS, OTHER_MARKS = (DYNAMIC, WEAKLY_DYNAMIC, PROPAGATED), (STATIC, UNBACKED)


def dynamic_dims(tensor) -> set[int]:
    """The dims of ``tensor`` marked dynamic (mark_dynamic, maybe_mark_dynamic, or propagated by Dynamo)."""
    return set().union(*(getattr(tensor, mark, ()) for mark in DYNAMIC_MARKS))


def mark_static(tensor, dims) -> None:
    """``torch._dynamo.mark_static(tensor, dims)`` from inside a backend (where Dynamo's own call would specialise a
    traced size instead): the marks its next trace of ``tensor`` reads."""
    indices = getattr(tensor, STATIC, None)
    if indices is None:
        indices = set()
        setattr(tensor, STATIC, indices)
    indices.update(dims)
    tensor._has_dynamo_dim_marking = True


def has_dim_marking(tensor) -> bool:
    """Whether ``tensor`` carries any of Dynamo's dim marks (its own flag)."""
    return hasattr(tensor, "_has_dynamo_dim_marking")


def unmark(tensor, mark: str, dims: set[int], had_marking: bool) -> None:
    """Takes the ``dims`` of ``mark`` (one of `DYNAMIC_MARKS` or `OTHER_MARKS`) off ``tensor``; the tensor's marking
    flag goes when no mark is left and it had none before."""
    indices = getattr(tensor, mark, None)
    if indices is not None:
        indices -= dims
        if not indices:
            delattr(tensor, mark)
    if not had_marking and not any(hasattr(tensor, m) for m in DYNAMIC_MARKS + OTHER_MARKS) and has_dim_marking(tensor):
        del tensor._has_dynamo_dim_marking


def remark(tensor, mark: str, dims: set[int]) -> None:
    """Puts the ``dims`` of ``mark`` back on ``tensor`` (what `unmark` took off)."""
    if dims:
        setattr(tensor, mark, set(getattr(tensor, mark, ())) | dims)
        tensor._has_dynamo_dim_marking = True


def fsdp_param_group(state):
    """An FSDP2 state's parameter group, or None."""
    return getattr(state, "_fsdp_param_group", None)


def fsdp_unsharded_param(param):
    """The unsharded parameter FSDP2's pre-forward registered for an FSDP parameter, or None."""
    return getattr(param, "_unsharded_param", None)


def custom_op_backward(opdef):
    """The backward a custom op registered with ``register_autograd``, or None."""
    return getattr(opdef, "_backward_fn", None)


def qualified_op_name(packet) -> str:
    """``aten::add`` for ``torch.ops.aten.add``."""
    return packet._qualified_op_name


def supports_sdpa(model_class) -> bool:
    return bool(model_class._supports_sdpa)


def supports_attention_backend(model) -> bool:
    """Whether a transformers model runs its attention through transformers' attention interface."""
    return bool(getattr(model, "_supports_attention_backend", False))


def set_attention_implementation(config, name: str) -> None:
    """The attention implementation a config builds its model with (before the model is built)."""
    config._attn_implementation = name


def model_from_config(model_class, config, **kwargs):
    """A transformers model of ``config`` with random weights, as ``AutoModel.from_config`` builds it."""
    return model_class._from_config(config, **kwargs)


def auto_model_class(config, auto_class) -> type:
    """The class ``auto_class`` (``AutoModelForCausalLM``) builds for ``config``; KeyError when it has none."""
    return __getattr__("get_model_class")(config, auto_class._model_mapping)
