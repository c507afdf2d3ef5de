"""A call of a converted model: bound as the model's ``forward`` binds it (`canonical_call`), checked against what
was converted (`flat_tensors`, `check_shapes`), and the graph's inputs read from it by the paths Dynamo recorded
(`read_source`)."""

from __future__ import annotations

import functools
import inspect as pyinspect
import keyword

import torch

from lowering import compat
from lowering.compat import pytree
from lowering.errors import InvalidInputError
from ringpass.conversion.expressions import evaluate
from ringpass.conversion.saved import Argument, Conversion, TensorSpec


def canonical_call(
    signature: pyinspect.Signature, args: tuple, kwargs: dict, *, where: str, defaults: dict, shown: str | None = None
) -> list:
    """The call as ``[(name, "positional" | "keyword", value)]`` in the order of the signature, however it was
    spelled (``model(ids)`` and ``model(input_ids=ids)`` are the same call); ``**kwargs`` entries sorted; an
    argument passed as its own default (``attention_mask=None``) is left out, as if not passed."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:
        raise InvalidInputError(
            f"{where}: the arguments do not fit the model's forward{shown or signature}: {error}."
        ) from None
    var_positional = any(
        p.kind == p.VAR_POSITIONAL and bound.arguments.get(p.name) for p in signature.parameters.values()
    )
    call = []
    for name, parameter in signature.parameters.items():
        if name not in bound.arguments:
            continue
        value = bound.arguments[name]
        if parameter.kind == parameter.VAR_POSITIONAL:
            call += [(f"{name}_{i}", "positional", v) for i, v in enumerate(value)]
        elif parameter.kind == parameter.VAR_KEYWORD:
            call += [(key, "keyword", value[key]) for key in sorted(value)]
        elif name in defaults and _same_plain_value(value, defaults[name]):
            continue
        else:
            positional = parameter.kind == parameter.POSITIONAL_ONLY or (
                parameter.kind == parameter.POSITIONAL_OR_KEYWORD and var_positional
            )
            call.append((name, "positional" if positional else "keyword", value))
    for name, _, _ in call:
        if not name.isidentifier() or keyword.iskeyword(name) or name == "self":
            raise InvalidInputError(f"{where}: argument name {name!r} cannot be converted (not a plain identifier).")
    return call


def distinct(call: list) -> list:
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


def is_plain_value(value) -> bool:
    """Whether ``value`` is a default a converted call can compare and save: None, a bool, int, float or str."""
    return value is None or type(value) in (bool, int, float, str)


def _same_plain_value(value, default) -> bool:
    return is_plain_value(value) and type(value) is type(default) and value == default


def signature_of(parameters: list[tuple]) -> pyinspect.Signature:
    """The model's forward signature from (name, kind, default) triples, every parameter optional: binding
    then spells a call as the forward would, and `flat_tensors` reports what is missing against what was
    converted."""
    return pyinspect.Signature(
        [
            pyinspect.Parameter(
                name,
                getattr(pyinspect.Parameter, kind),
                default=pyinspect.Parameter.empty if kind.startswith("VAR_") else _MISSING,
            )
            for name, kind, _ in parameters
        ]
    )


class _Missing:
    def __repr__(self):
        return "<not given>"


_MISSING = _Missing()


def flat_tensors(call: list, arguments: list[Argument]) -> tuple:
    """The call's tensors in the flat program's order, after checking its structure against the conversion:
    same arguments, same containers, same non-tensor values (they were baked into the graph)."""
    given = {name: value for name, _, value in call if value is not _MISSING}
    converted = ", ".join(a.name for a in arguments)
    extra = set(given) - {a.name for a in arguments}
    if extra:
        raise InvalidInputError(
            f"Argument(s) {', '.join(sorted(extra))} were not given when the model was converted "
            f"(it takes {converted}); convert again with them."
        )
    tensors = []
    for a in arguments:
        value = given.get(a.name, _MISSING)
        if value is _MISSING:
            raise InvalidInputError(
                f"Argument `{a.name}` was given when the model was converted and must be given "
                f"each call (the converted call takes {converted})."
            )
        leaves, spec = pytree.tree_flatten(value)
        if spec != a.spec:
            raise InvalidInputError(f"Argument `{a.name}` has structure {spec}, converted with {a.spec}.")
        for leaf, converted_leaf in zip(leaves, a.leaves):
            if isinstance(converted_leaf, TensorSpec):
                if not isinstance(leaf, torch.Tensor):
                    raise InvalidInputError(
                        f"Argument `{converted_leaf.name}` must be a tensor (it was converted with one), "
                        f"got {type(leaf).__name__}."
                    )
                _check_tensor(leaf, converted_leaf)
                tensors.append(leaf)
            elif isinstance(leaf, torch.Tensor) or leaf != converted_leaf:
                given = f"a tensor {list(leaf.shape)}" if isinstance(leaf, torch.Tensor) else repr(leaf)
                raise InvalidInputError(
                    f"Argument `{a.name}` is {given}; the model was converted with {converted_leaf!r}, "
                    "which is baked into the converted graph. Convert again with this value."
                )
    return tuple(tensors)


def _check_tensor(value: torch.Tensor, spec: TensorSpec) -> None:
    fits = (
        value.dtype == spec.dtype
        and value.dim() == len(spec.shape)
        and all(s is None or s == v for s, v in zip(spec.shape, value.shape))
    )
    if not fits:
        shape = "[" + ", ".join("*" if s is None else str(s) for s in spec.shape) + "]"
        hint = "" if any(s is None for s in spec.shape) else " Convert with dynamic=True for other sizes."
        raise InvalidInputError(
            f"Argument `{spec.name}` is {str(value.dtype)[6:]} {list(value.shape)}; the model was "
            f"converted for {str(spec.dtype)[6:]} {shape} (* = any size).{hint}"
        )


def check_shapes(conditions: dict, tensors: tuple, conversion: Conversion, model, global_scope: dict) -> None:
    """Refuse ``tensors`` when they break the conditions Dynamo traced a dynamic conversion under
    (`ringpass.conversion.capture.shape_conditions`); static shapes are checked by `flat_tensors`."""
    # contiguous: Dynamo also guards on strides, which eager ops do not need (they work or raise on their own)
    tensors = tuple(t.contiguous() for t in tensors)
    scope = {"self": model, **{a.name: rebuild_argument(a, tensors) for a in conversion.arguments}}
    values: list = [None] * conditions["inputs"]
    for i, path, as_tensor in conditions["read"]:
        values[i] = read_source(path, scope, as_tensor, global_scope)
    if not evaluate(conditions["expression"], {"L": {f"t{i}": v for i, v in enumerate(values)}}):
        shapes = ", ".join(f"{s.name} {list(t.shape)}" for s, t in zip(conversion.tensor_inputs, tensors))
        raise InvalidInputError(
            f"The converted graph does not fit these inputs ({shapes}): Dynamo traced it with symbolic shapes under "
            "conditions they break. Sizes 0 and 1 are specialized, so a dim converted at 2 or more must stay at 2 or "
            "more (convert with batch 1 to run batch 1). The conditions, over the graph's inputs t0, t1, ...: "
            f"{conditions['expression']}."
        )


# ---- reading the graph's inputs --------------------------------------------------------------------------
def rebuild_argument(argument: Argument, tensors: tuple):
    """The argument's value, its tensors taken from the flat program's ``tensors``."""
    leaves = [tensors[leaf.index] if isinstance(leaf, TensorSpec) else leaf for leaf in argument.leaves]
    return pytree.tree_unflatten(leaves, argument.spec)


def read_source(path: str, scope: dict, as_tensor: bool, global_scope: dict):
    """The value at a Dynamo source path (``L['input_ids'].size()[1]``, ``G['scale']``) in ``scope`` (the call's
    frame) and ``global_scope`` (its globals, where Dynamo puts the modules and globals the model reads), read in
    the closed grammar of `ringpass.conversion.expressions` (a loaded path is the file's data, never run)."""
    value = evaluate(path, {"L": scope, "G": global_scope}, _dynamo_getters())
    return torch.as_tensor(value) if as_tensor else value


@functools.cache
def _dynamo_getters() -> dict:
    """The getters Dynamo's paths may call (``___tuple_iterator_getitem(L['it'], 0)``); torch has no public name
    for them."""
    helpers = compat.dynamo_closure_vars()
    return {name: helpers[name] for name in ("___tuple_iterator_getitem", "___odict_getitem") if name in helpers}
