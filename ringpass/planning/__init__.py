"""``ringpass plan``: whether the ring pays, predicted by `lowering.costmodel`.

- `plan`: one attention on given hardware; `model_plan`: a whole model's training step (memory per rank, time,
  ring size and checkpointing); `compiled_memory`: what a compiled step holds at its peak, on fake tensors.
"""
