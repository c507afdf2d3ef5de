"""The ``ring`` torch.compile backend, and what every front end (backend, inspect, convert) shares at run time.

- `ring_backend`: `RingBackend`, the backend Dynamo calls per graph, and ``ring`` (the entry point).
- `guard`: every rank runs the same ring graph on agreeing inputs, or every rank hears why not.
- `retrace`: Dynamo traces a frame again with the sharded inputs' sequence dims symbolic.
- `wrappers`: which data-parallel wrapper reduces the gradients (DDP, FSDP2), and ``grads=``.
- `ddp_whole_graph`: ring graphs kept whole under DDP's Dynamo optimizer.
- `carried`, `crossing_masks`: `SequenceSharded` values and `SequenceMask` masks crossing graph boundaries.
- `per_rank`: ``inputs="per_rank"``, each rank passing its own batch.
"""
