"""Keep a ring graph whole under DistributedDataParallel with Dynamo's default ``optimize_ddp``.

Under DDP, Dynamo's default (``torch._dynamo.config.optimize_ddp = True``) hands each captured graph to its
``DDPOptimizer``, which cuts the graph at DDP's gradient-bucket boundaries and compiles every piece alone, so
that each bucket's all-reduce can start while the backward of the earlier pieces runs. The ring needs the
whole graph: its activations stay sequence-sharded from input to output, and a piece without an attention
would run replicated on every rank.

`keep_ring_graphs_whole` wraps ``DDPOptimizer.compile_fn`` once (at the backend's import, before any compile):
when the backend it would hand the pieces to is a ring backend, the whole graph goes to that backend instead,
as Dynamo itself does when a graph fills one bucket. DDP then all-reduces the gradients after the backward
(its own hooks, as with ``optimize_ddp = False``): no bucket overlaps the backward. The graph's report says so
(`kept_whole_under_ddp`). Every other backend is split as before. On a torch without ``DDPOptimizer`` nothing is
wrapped, and `ringpass.wrappers` refuses a split graph with what to set.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

_state = threading.local()  # .active: a ring backend is being called with a graph DDPOptimizer did not split

NOTE = (
    "DDP: kept whole (Dynamo's optimize_ddp cuts graphs at DDP's buckets), DDP all-reduces the gradients after "
    "the backward (no bucket overlaps it)"
)


def keep_ring_graphs_whole(is_ring_backend: Callable[[object], bool]) -> None:
    """Wraps ``DDPOptimizer.compile_fn`` so that graphs for a backend ``is_ring_backend`` accepts are not split."""
    try:
        from torch._dynamo.backends.distributed import DDPOptimizer
    except ImportError:  # another torch: the split is refused by `ringpass.wrappers`
        return
    split = DDPOptimizer.compile_fn
    if getattr(split, "_ringpass_keeps_ring_graphs_whole", False):
        return

    def compile_fn(self, gm, example_inputs, **configs):
        if not is_ring_backend(self.backend_compile_fn):
            return split(self, gm, example_inputs, **configs)
        _state.active = True
        try:
            return self.backend_compile_fn(gm, example_inputs, **configs)
        finally:
            _state.active = False

    compile_fn._ringpass_keeps_ring_graphs_whole = True
    DDPOptimizer.compile_fn = compile_fn


def kept_whole_under_ddp() -> bool:
    """Whether the graph being compiled now is one DDPOptimizer would have split and the ring kept whole."""
    return getattr(_state, "active", False)


def unwrap_backend(fn: object) -> object:
    """The backend under Dynamo's wrappers (``WrapBackendDebug``) and torch.compile's (``_TorchCompileWrapper``)."""
    for _ in range(8):
        inner = getattr(fn, "_torchdynamo_orig_backend", None) or getattr(fn, "compiler_fn", None)
        if inner is None:
            return fn
        fn = inner
    return fn
