"""Keep a ring graph whole under DistributedDataParallel with Dynamo's default ``optimize_ddp``.

Under DDP, Dynamo's default (``torch._dynamo.config.optimize_ddp = True``) hands each captured graph to its
``DDPOptimizer``, which cuts the graph at DDP's gradient-bucket boundaries and compiles every piece alone, so
that each bucket's all-reduce can start while the backward of the earlier pieces runs. The ring needs the
whole graph: its activations stay sequence-sharded from input to output, and a piece without an attention
would run replicated on every rank.

`keep_ring_graphs_whole` wraps ``DDPOptimizer.compile_fn`` once, before any compile: when a ring backend is first
made or looked up (``torch.compile(model, backend="ring")``; ``import ringpass`` changes nothing in torch), then if
Dynamo's module for it is loaded, else as soon as it is (an import hook: making a backend does not load Dynamo):
when the backend it would hand the pieces to is a ring backend, the whole graph goes to that backend instead,
as Dynamo itself does when a graph fills one bucket. DDP then all-reduces the gradients after the backward
(its own hooks, as with ``optimize_ddp = False``): no bucket overlaps the backward. The graph's report says so
(`kept_whole_under_ddp`). Every other backend is split as before. On a torch without ``DDPOptimizer`` nothing is
wrapped, and `ringpass.frontend.wrappers` refuses a split graph with what to set.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable

from lowering import compat

_state = threading.local()  # .active: a ring backend is being called with a graph DDPOptimizer did not split

NOTE = (
    "DDP: kept whole (Dynamo's optimize_ddp cuts graphs at DDP's buckets), DDP all-reduces the gradients after "
    "the backward (no bucket overlaps it)"
)


def keep_ring_graphs_whole(is_ring_backend: Callable[[object], bool]) -> None:
    """Wraps ``DDPOptimizer.compile_fn`` so that graphs for a backend ``is_ring_backend`` accepts are not split:
    now if Dynamo's module is loaded, else when it is."""
    module = sys.modules.get(compat.DDP_OPTIMIZER_MODULE)
    if module is not None:
        _wrap(module, is_ring_backend)
    elif not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(lambda loaded: _wrap(loaded, is_ring_backend)))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds Dynamo's DDP module as Python would, and runs ``then(module)`` once it is executed."""

    def __init__(self, then: Callable):
        self.then = then

    def find_spec(self, name, path, target=None):
        if name != compat.DDP_OPTIMIZER_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        execute, then = spec.loader.exec_module, self.then

        def exec_module(module):
            execute(module)
            then(module)

        spec.loader.exec_module = exec_module
        return spec


def _wrap(module, is_ring_backend: Callable[[object], bool]) -> None:
    DDPOptimizer = getattr(module, "DDPOptimizer", None)
    if DDPOptimizer is None:  # another torch: the split is refused by `ringpass.frontend.wrappers`
        return
    split = DDPOptimizer.compile_fn
    if getattr(split, "_ringpass_keeps_ring_graphs_whole", False):
        return

    def compile_fn(self, gm, example_inputs, **configs):
        if not is_ring_backend(self.backend_compile_fn):
            return split(self, gm, example_inputs, **configs)
        previous, _state.active = kept_whole_under_ddp(), True
        try:
            return self.backend_compile_fn(gm, example_inputs, **configs)
        finally:
            _state.active = previous

    compile_fn._ringpass_keeps_ring_graphs_whole = True
    DDPOptimizer.compile_fn = compile_fn


def kept_whole_under_ddp() -> bool:
    """Whether the graph being compiled now is one DDPOptimizer would have split and the ring kept whole."""
    return getattr(_state, "active", False)


def unwrap_backend(fn: object) -> object:
    """The backend under Dynamo's wrappers (``WrapBackendDebug``) and torch.compile's (``_TorchCompileWrapper``)."""
    for _ in range(8):
        inner = compat.backend_inner(fn)
        if inner is None:
            return fn
        fn = inner
    return fn
