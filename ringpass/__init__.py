"""ringpass: exact attention over a sequence sharded across processes.

    model = torch.compile(model, backend="ring")      # under torchrun

`backend(**options)` returns a configured backend, `last_report()` what the last compile did,
`inspect(model, inputs, world_size=P)` what the pass will do to a model, offline; `shard(x, dim)` /
`unshard` prepare sharded inputs and reassemble sharded outputs in the ring's layout; `convert(model,
inputs, world_size=P)` applies the pass once and gives a module that runs eagerly, `save`s and `load`s;
`generate(model, input_ids, max_new_tokens=...)` and `ShardedCache` generate from a long prompt with the KV
cache kept sharded (Hugging Face models; imported on first use). `RingSampler` / `ring_dataloader` /
`shard_collator` give the ranks of one ring the same batch (docs/data.md); with ``inputs="per_rank"`` each rank
passes its own batch instead (docs/training.md). The runtime (`lowering`: `ring_attention`,
`Layout`, `simulate_ring`) is usable on its own.
"""

from lowering.errors import InvalidInputError, NotSupportedError, RingpassError, RingpassWarning
from lowering.failures import PeerFailure
from lowering.implicit_gather import ImplicitGatherWarning, NeedsWholeSequence
from lowering.sequence_mask import SequenceMask
from lowering.sequence_tensor import SequenceSharded
from ringpass.conversion.artifact import load
from ringpass.conversion.converter import ConvertedModel, convert
from ringpass.frontend.ring_backend import RingBackend, backend, last_report
from ringpass.inspection.inspector import Inspection, inspect
from ringpass.integrations.data import RingSampler, ring_dataloader, shard_collator
from ringpass.integrations.sharding import shard, unshard
from ringpass.version import __version__

__all__ = [
    "ConvertedModel",
    "ImplicitGatherWarning",
    "Inspection",
    "InvalidInputError",
    "NeedsWholeSequence",
    "NotSupportedError",
    "PeerFailure",
    "RingBackend",
    "RingSampler",
    "RingpassError",
    "RingpassWarning",
    "SequenceMask",
    "SequenceSharded",
    "__version__",
    "backend",
    "convert",
    "inspect",
    "last_report",
    "load",
    "ring_dataloader",
    "shard",
    "shard_collator",
    "unshard",
    "ShardedCache",
    "generate",
]


def __getattr__(name: str):
    if name in ("ShardedCache", "generate"):  # they need transformers: imported when first asked for
        from ringpass.integrations import generation

        return getattr(generation, name)
    raise AttributeError(f"module 'ringpass' has no attribute {name!r}")
