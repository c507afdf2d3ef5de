"""`SequenceMask`: a sequence x sequence attention mask that crosses a graph boundary as its per-token description.

A graph the ring backend compiles that returns a mask built from per-token values (a padding mask read as
``attention_mask[b, k]``, document ids or positions compared pairwise, ``k <= q``) returns it as a `SequenceMask`:
the per-token tensors the mask is built from (each at most ``[B, S]``) and the recipe that builds it from them
(the graph's own ops, kept as an `fx.GraphModule` registered under a key). It reports the mask's shape and dtype,
so model code between graphs hands it on as the mask it stands for; a ring graph that receives one writes the
recipe into its own graph (`ringpass.frontend.crossing_masks`), where `lift_masks` evaluates it per tile as it does
a mask the graph built itself: no rank ever holds the S x S values.

    mask.shape            # the whole [B, 1, S, S]
    mask.full_tensor()    # the S x S mask itself, built on this rank (no communication)
    print(mask)           # the description: its per-token tensors, never S x S values

Eager ops on it raise `NeedsWholeSequence`, which says to call ``.full_tensor()``: never a silent materialisation.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.fx as fx

from lowering import compat
from lowering.compat import pytree
from lowering.errors import InvalidInputError
from lowering.implicit_gather import NeedsWholeSequence
from lowering.masks import call_program

aten = torch.ops.aten

Size = tuple[int, int]  # (i, d): the size of dim d of the recipe's i-th tensor


@dataclass(frozen=True)
class MaskRecipe:
    """``program(*tensors, *sizes)`` is the mask, of ``dtype``; a traced length is a size of a tensor it is built
    from: ``sizes`` say which sizes the program takes after the tensors, ``shape`` the mask's shape (ints, and
    `Size`s where it was traced symbolically). ``source``: where the graph that built it builds it."""

    program: fx.GraphModule
    dtype: torch.dtype
    sizes: tuple[Size, ...]
    shape: tuple
    source: str

    def shape_for(self, tensors: list) -> list[int]:
        return [d if isinstance(d, int) else tensors[d[0]].shape[d[1]] for d in self.shape]


_RECIPES: dict[str, MaskRecipe] = {}


def register_recipe(program: fx.GraphModule, dtype: torch.dtype, sizes=(), shape=(), source: str = "") -> str:
    """The recipe's key (by content: the same recipe from another compile has the same key)."""
    sizes, shape = tuple(sizes), tuple(shape)
    key = "seqmask-" + hashlib.sha1(f"{program.code}\n{dtype}\n{sizes}\n{shape}".encode()).hexdigest()[:16]
    _RECIPES.setdefault(key, MaskRecipe(program, dtype, sizes, shape, source))
    return key


def recipe(key: str) -> MaskRecipe:
    if key not in _RECIPES:
        raise InvalidInputError(
            f"SequenceMask recipe {key} is not registered in this process: a SequenceMask is made by a ring graph of "
            "this process and used in it (it cannot be saved or sent to another process; call .full_tensor())."
        )
    return _RECIPES[key]


class SequenceMask(torch.Tensor):
    """A mask of the global shape described by per-token tensors and a recipe; see the module docstring."""

    recipe: str
    count: int

    @staticmethod
    def __new__(cls, inputs: list, key: str, shape=None):
        entry = recipe(key)
        shape = entry.shape_for(inputs) if shape is None else shape
        return compat.make_wrapper_subclass(cls, shape, dtype=entry.dtype, device=inputs[0].device)

    def __init__(self, inputs: list, key: str, shape=None):
        self.recipe, self.count = key, len(inputs)
        for i, tensor in enumerate(inputs):
            setattr(self, f"input_{i}", tensor)

    __torch_function__ = compat.disabled_torch_function_impl

    @property
    def inputs(self) -> list[torch.Tensor]:
        """The per-token tensors the recipe builds the mask from."""
        return [getattr(self, f"input_{i}") for i in range(self.count)]

    def __repr__(self, *, tensor_contents=None) -> str:
        described = ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in self.inputs)
        return (
            f"SequenceMask(shape={tuple(self.shape)}, dtype={str(self.dtype).replace('torch.', '')}, built from "
            f"[{described}] by the mask of {recipe(self.recipe).source})"
        )

    def __tensor_flatten__(self):
        return [f"input_{i}" for i in range(self.count)], (self.recipe, self.count)

    @staticmethod
    def __tensor_unflatten__(inner, context, outer_size, outer_stride):
        key, count = context
        return SequenceMask([inner[f"input_{i}"] for i in range(count)], key, outer_size)

    @classmethod
    @compat.disable_dynamo
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        masks = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, SequenceMask)]
        if any(
            compat.is_fake(t) for m in masks for t in m.inputs
        ):  # traced: the mask its recipe builds from the tracer's
            args, kwargs = pytree.tree_map_only(SequenceMask, _built, (args, kwargs))  # tensors (AOT traces it)
            return func(*args, **kwargs)
        if func in (aten.detach.default, aten.alias.default):
            (mask,) = masks
            return SequenceMask(mask.inputs, mask.recipe, mask.shape)
        raise NeedsWholeSequence(
            f"{func} on a SequenceMask (an attention mask a ring graph returned as its per-token description, so "
            "that no rank holds it S x S). Pass it to the next compiled graph as it is, or call .full_tensor() for "
            "the whole mask (built on this rank from its description). If your code does not touch the mask, an "
            "attention ran outside any compiled graph: Dynamo broke the graph before it (TORCH_LOGS=graph_breaks "
            "says where). With Hugging Face gradient checkpointing and transformers >= 5.25 that is the `kernels` "
            "package's context variable: set torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = "
            "True before the first call (docs/training.md)."
        )

    @compat.disable_dynamo
    def full_tensor(self) -> torch.Tensor:
        """The whole mask, built on this rank by its recipe (no communication)."""
        return _built(self)


def _built(mask: SequenceMask) -> torch.Tensor:
    entry, inputs = recipe(mask.recipe), mask.inputs
    return call_program(entry.program, *inputs, *(inputs[i].shape[d] for i, d in entry.sizes)).expand(mask.shape)
