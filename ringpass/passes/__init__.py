"""The ring backend's passes, in the order they run. Each is one file and one function
``(PassContext) -> None`` whose docstring says what it matches and what it writes."""

from ringpass.passes.find_attention import find_attention
from ringpass.passes.insert_boundaries import insert_boundaries
from ringpass.passes.lift_masks import lift_masks
from ringpass.passes.localize_shapes import localize_shapes
from ringpass.passes.placements import decide_placements
from ringpass.passes.reduce_grads import reduce_grads
from ringpass.passes.rewrite_attention import rewrite_attention
from ringpass.passes.rewrite_positions import rewrite_positions
from ringpass.passes.sequence_axes import find_sequence_axes

PIPELINE = (
    find_attention,
    lift_masks,
    find_sequence_axes,
    decide_placements,
    rewrite_positions,
    localize_shapes,
    rewrite_attention,
    insert_boundaries,
    reduce_grads,
)
