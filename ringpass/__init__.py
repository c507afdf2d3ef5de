"""ringpass: exact attention over a sequence sharded across processes.

The runtime (`lowering`: `ring_attention`, `Layout`, `simulate_ring`) works today. The
``torch.compile(model, backend="ring")`` backend is being built (see the README's status section);
until it lands, shard by hand and call `lowering.ring_attention`.
"""

from lowering.errors import InvalidInputError, NotSupportedError, RingpassError

__version__ = "0.1.0"
__all__ = ["InvalidInputError", "NotSupportedError", "RingpassError", "__version__"]
