"""ringpass: exact attention over a sequence sharded across processes.

    model = torch.compile(model, backend="ring")      # under torchrun

`backend(**options)` returns a configured backend, `last_report()` what the last compile did. The
runtime (`lowering`: `ring_attention`, `Layout`, `simulate_ring`) is usable on its own.
"""

from lowering.errors import InvalidInputError, NotSupportedError, RingpassError
from ringpass.backend import RingBackend, backend, last_report

__version__ = "0.1.0"
__all__ = ["InvalidInputError", "NotSupportedError", "RingBackend", "RingpassError", "__version__", "backend", "last_report"]
