"""The ``ring`` torch.compile backend.

    model = torch.compile(model, backend="ring")                          # default options
    model = torch.compile(model, backend="ring", options={"layout": "zigzag"})
    model = torch.compile(model, backend=ringpass.backend(layout="zigzag"))

Dynamo hands over each captured graph; the passes (`ringpass.passes.PIPELINE`) rewrite it so that every
attention is ring attention over this rank's tokens, and the result goes to the inner compiler.
With world size 1, or no process group initialised, the graph is compiled unchanged. Rank 0 prints one
line per compiled graph (what was rewritten or refused; ``options={"report": "off"}`` silences it) and
the full report goes to the ``ringpass`` logger at INFO. A graph that runs unsharded on a multi-rank job
(no attention in it, or ``WORLD_SIZE`` > 1 without a process group) gives a `RingpassWarning`, or an
error with ``unsharded="error"``. A rewritten graph is called through `ringpass.frontend.guard` (the ranks agree
on graph and inputs; a failure on one rank reaches the others); a compile that fails on one rank is
posted to the others too (`lowering.failures`). Sequence-sharded outputs leave as `ringpass.SequenceSharded`
(``outputs="auto"``) and such inputs are taken as they are: `ringpass.frontend.carried`; a mask built in one graph and
used in the next crosses as its per-token description: `ringpass.frontend.crossing_masks`.
"""

from __future__ import annotations

import os
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch.distributed as dist
import torch.fx as fx

from lowering import compat, failures
from lowering.errors import InvalidInputError, RingpassError, RingpassWarning
from lowering.groups import resolve_group
from lowering.ulysses import ulysses_mesh
from ringpass.frontend.carried import CarriedGraph, carry_layout_outputs, crosses_boundaries, local_examples
from ringpass.frontend.ddp_whole_graph import NOTE as KEPT_WHOLE_NOTE
from ringpass.frontend.ddp_whole_graph import keep_ring_graphs_whole, kept_whole_under_ddp, unwrap_backend
from ringpass.frontend.guard import guard_graph
from ringpass.frontend.per_rank import PerRankGraph, describe_per_rank, refuse_crossings
from ringpass.frontend.rewrite import Retrace, rewrite_graph
from ringpass.frontend.wrappers import find_wrapper, gradient_mode
from ringpass.fx.context import PassContext, UlyssesGroups
from ringpass.fx.report import Report
from ringpass.options import RingOptions

_reports: deque[Report] = deque(maxlen=100)  # the latest graphs of every backend (bounded: recompiles add more)


class RingBackend:
    """A configured ``ring`` backend; ``reports`` holds one `Report` per compiled graph."""

    def __init__(self, **options: Any):
        self.options = RingOptions.from_dict(options)
        self.reports: list[Report] = []
        keep_ring_graphs_whole(_is_ring_backend)  # the backend's first use: DDP's graph splitter leaves it whole

    def __call__(self, gm: fx.GraphModule, example_inputs: list, **kwargs: Any) -> Callable:
        """Dynamo's call for each captured graph: the graph rewritten (`ringpass.frontend.rewrite`), compiled by
        the inner compiler, and wrapped for the run (guard, carried values, per-rank batches)."""
        options = self._options(kwargs)
        group = resolve_group(options.group)
        world_size = dist.get_world_size(group) if group is not None else 1
        report = self._new_report(world_size, options)
        if world_size == 1:
            return self._unchanged_on_one_rank(gm, example_inputs, options, group, report)
        ctx = self._context(gm, example_inputs, options, world_size, group, report)
        captured = _copy(gm) if options.strategy == "auto" else None  # what runs if auto chooses no parallelism
        failures.configure(group.group_name, timeout=options.timeout)
        failures.set_state(f"compiling graph {report.graph_index}")
        try:
            self._rewrite(ctx, options, group)
            _warn_at_recompile_limit(gm, report)
            return self._compile(ctx, captured, options)
        except (Retrace, compat.RestartAnalysis) as restart:  # Dynamo traces the frame again: this graph never
            self.reports.remove(report)  # existed (ours, or the inner compiler's: AOT's specialised a float)
            _reports.remove(report)
            raise (restart.restart if isinstance(restart, Retrace) else restart) from None
        except Exception as error:  # the peers stop with this rank's error instead of waiting for it
            # the call this compile was for counts, as it does on the peers that compiled and called it
            failures.post_failure(group.group_name, error, call=failures.begin_call())
            if isinstance(error, RingpassError):
                raise _past_dynamo(error) from None
            raise

    def _options(self, kwargs: dict) -> RingOptions:
        """This backend's options, with ``torch.compile(..., options={...})`` on top."""
        if kwargs.get("options"):
            return RingOptions.from_dict({**_as_dict(self.options), **kwargs["options"]})
        return self.options

    def _new_report(self, world_size: int, options: RingOptions) -> Report:
        """The graph's report, kept by this backend and in `last_report`'s list."""
        report = Report(world_size=world_size, graph_index=len(self.reports))
        if options.inputs == "per_rank":
            report.unchanged_runs = "on each rank's own batch (inputs='per_rank', as under DDP)"
        if kept_whole_under_ddp():
            report.notes.append(KEPT_WHOLE_NOTE)
        self.reports.append(report)
        _reports.append(report)
        return report

    def _unchanged_on_one_rank(self, gm, example_inputs, options: RingOptions, group, report: Report) -> Callable:
        """One rank, or no process group: the graph compiled as it is (a warning where the job has more ranks)."""
        report.unchanged = "one rank (or no process group)"
        report.warnings.append("one rank (or no process group): the graph runs unchanged")
        report.log(rank=dist.get_rank() if group is not None else 0, print_summary=options.report == "summary")
        launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if group is None and launched > 1:
            _unsharded(
                options,
                f"graph {report.graph_index}: WORLD_SIZE={launched} but no process group is initialised, so "
                "the ring has one rank and the graph runs unsharded on every process. Call "
                "torch.distributed.init_process_group() before the first forward.",
            )
        return _inner_compile(options.compiler, gm, example_inputs)

    @staticmethod
    def _context(gm, example_inputs, options: RingOptions, world_size: int, group, report: Report) -> PassContext:
        """What the passes share; with ``inputs="per_rank"`` they see one rank's batch, passed whole."""
        per_rank = options.inputs == "per_rank"
        return PassContext(
            gm,
            example_inputs,
            replace(options, inputs="full") if per_rank else options,
            world_size,
            group.group_name,
            report,
            ulysses=ulysses_groups(options.group, options.ulysses),
            ulysses_for=_ulysses_maker(options.group),
            per_rank=per_rank,
        )

    @staticmethod
    def _rewrite(ctx: PassContext, options: RingOptions, group) -> None:
        """The compile protocol, then what only the backend adds: the gradients' reduction under the job's
        wrapper, a sequence length handed to the next graph, and the per-rank batches' crossings. The report is
        logged whether the graph was rewritten or refused (not when Dynamo traces it again)."""
        ctx.gradients = gradient_mode(options.grads, find_wrapper(ctx.gm), group)
        retraced = False
        try:
            rewrite_graph(ctx)
            carry_layout_outputs(ctx)
            if ctx.per_rank and not ctx.report.unchanged:  # a graph without attention runs on this rank's batch
                refuse_crossings(ctx)
                describe_per_rank(ctx)
            ctx.gm.graph.lint()
            ctx.gm.recompile()
        except Retrace:
            retraced = True
            raise
        finally:
            if not retraced:
                ctx.report.log(rank=dist.get_rank(group), print_summary=options.report == "summary")

    @staticmethod
    def _compile(ctx: PassContext, captured: fx.GraphModule | None, options: RingOptions) -> Callable:
        """The rewritten graph through the inner compiler, called through the guard, its carried values and
        per-rank batches wrapped; a graph left unchanged compiled as captured."""
        report = ctx.report
        if report.unchanged and ctx.strategy is not None:  # auto chose to run it whole: the report says why
            return _inner_compile(options.compiler, captured, ctx.example_inputs)
        if report.unchanged:
            _unsharded(
                options,
                f"graph {report.graph_index}: no attention found, so it runs unchanged {report.unchanged_runs}, "
                f"not sharded ({report.unchanged}). If the model has attention, "
                "ringpass.inspect(model, inputs) shows why it was not found.",
            )
            compiled = _inner_compile(options.compiler, ctx.gm, ctx.example_inputs)
        else:
            compiled = _inner_compile(options.compiler, ctx.gm, local_examples(ctx.example_inputs, ctx))
            compiled = guard_graph(compiled, ctx, report.graph_index)
        runs_per_rank = ctx.per_rank and not report.unchanged  # `PerRankGraph` splices and wraps the masks
        compiled = CarriedGraph(compiled, ctx, masks=not runs_per_rank) if crosses_boundaries(ctx) else compiled
        if not runs_per_rank:
            return compiled
        tail = _inner_compile(options.compiler, ctx.tail.gm, ctx.tail.examples()) if ctx.tail else None
        return PerRankGraph(compiled, ctx, tail)


def _past_dynamo(error: RingpassError) -> RingpassError:
    """``error`` as its own type that Dynamo passes on as it is instead of wrapping it in
    ``BackendCompilerFailed`` ("backend='<ringpass.frontend.ring_backend.RingBackend object at 0x7f...>' raised: ..."):
    a subclass of its type and of Dynamo's ``ShortenTraceback``, with its name, message and attributes, so
    ``except ringpass.NotSupportedError`` catches it and the message reads as ringpass wrote it."""
    try:
        ShortenTraceback = compat.ShortenTraceback
    except ImportError:  # another torch: the error arrives wrapped
        return error
    kind = type(error)
    if kind not in _PASSING:
        _PASSING[kind] = type(
            kind.__name__, (kind, ShortenTraceback), {"__module__": kind.__module__, "__qualname__": kind.__qualname__}
        )
    passing = _PASSING[kind].__new__(_PASSING[kind], *error.args)
    passing.args, passing.first_useful_frame = error.args, None
    passing.__dict__.update(error.__dict__)
    return passing.with_traceback(error.__traceback__)


_PASSING: dict[type, type] = {}


def backend(**options: Any) -> RingBackend:
    """A ``ring`` backend with options (see `RingOptions`), to pass as ``torch.compile(backend=...)``."""
    return RingBackend(**options)


def _ring(gm: fx.GraphModule, example_inputs: list, **kwargs: Any) -> Callable:
    """The backend registered as ``"ring"``; ``options=`` from torch.compile configure it."""
    return RingBackend(**(kwargs.get("options") or {}))(gm, example_inputs)


_ring.__name__ = _ring.__qualname__ = "ring"


def __getattr__(name: str) -> object:
    """``ring``, the backend ``torch.compile(backend="ring")`` looks up (the entry point
    ``ringpass.frontend.ring_backend:ring``): looking it up, like making a `RingBackend`, is the backend's first use,
    when it starts keeping ring graphs whole under DDP (`keep_ring_graphs_whole`); ``import ringpass`` changes nothing
    in torch."""
    if name == "ring":
        keep_ring_graphs_whole(_is_ring_backend)
        return _ring
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _is_ring_backend(fn: object) -> bool:
    inner = unwrap_backend(fn)
    return inner is _ring or isinstance(inner, RingBackend)


def last_report() -> Report | None:
    """The report of the most recent graph compiled by any ring backend in this process."""
    return _reports[-1] if _reports else None


def _warn_at_recompile_limit(gm: fx.GraphModule, report: Report) -> None:
    """A `RingpassWarning` (and a report warning) when this is the last compile Dynamo allows the frame: a later call
    that no compiled graph serves (another length, under static shapes or a static retrace) runs it eagerly, which is
    unsharded on every rank, with no word from ringpass."""
    compile_id, limit = compat.dynamo_compile_id(gm), compat.dynamo_config.recompile_limit
    if compile_id is None or compile_id.frame_compile_id is None or compile_id.frame_compile_id + 1 < limit:
        return
    message = (
        f"graph {report.graph_index} is compile {compile_id.frame_compile_id + 1} of its frame, "
        f"torch._dynamo.config.recompile_limit = {limit}: Dynamo runs a call that no compiled graph serves (another "
        "length) eagerly, unsharded on every rank. Raise the limit, pad batches to a few lengths, or set "
        "torch._dynamo.config.fail_on_recompile_limit_hit = True to make it an error."
    )
    report.warnings.append(message)
    warnings.warn(message, RingpassWarning, stacklevel=3)


def _unsharded(options: RingOptions, message: str) -> None:
    if options.unsharded == "error":
        raise InvalidInputError(f"{message} (unsharded='error' makes this an error; 'warn' a warning)")
    warnings.warn(message, RingpassWarning, stacklevel=2)


def _as_dict(options: RingOptions) -> dict:
    return {name: getattr(options, name) for name in options.__dataclass_fields__}


def _ulysses_maker(group) -> Callable[[int], UlyssesGroups] | None:
    """``strategy="auto"``'s maker of Ulysses groups of U consecutive ranks, over the default group only."""
    if group is not None and group != dist.group.WORLD:
        return None
    return lambda size: ulysses_groups(None, size)


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A graph module with its own copy of ``gm``'s graph (the passes rewrite ``gm``'s in place)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


def ulysses_groups(group, ulysses) -> UlyssesGroups | None:
    """(U, the Ulysses group's name, the ring's group name) for Ulysses x ring, or None for a plain ring.
    ``group`` a 2-D DeviceMesh: the ring over its first dimension, all-to-all inside its second; ``ulysses=U``
    with the default group: a (P / U, U) mesh of consecutive ranks (Ulysses groups of neighbours)."""
    if isinstance(ulysses, bool) or not isinstance(ulysses, int) or ulysses < 1:
        raise InvalidInputError(
            f"Ring backend option ulysses={ulysses!r} must be a positive int (the ranks of a Ulysses group)."
        )
    mesh = group if hasattr(group, "get_group") and group.ndim == 2 else None
    if mesh is None and ulysses == 1:
        return None
    if mesh is None:
        if group is not None and group != dist.group.WORLD:
            raise InvalidInputError(
                f"ulysses={ulysses} with a sub-group: pass the ring and Ulysses dimensions as a 2-D DeviceMesh "
                "instead, group=mesh['cp', 'sp'] (the ring over 'cp', all-to-all inside 'sp')."
            )
        world = dist.get_world_size()
        if world % ulysses:
            raise InvalidInputError(f"ulysses={ulysses} does not divide the {world} ranks.")
        mesh = ulysses_mesh(world // ulysses, ulysses)
    elif ulysses not in (1, mesh.size(1)):
        raise InvalidInputError(f"ulysses={ulysses} but the mesh's Ulysses dimension has {mesh.size(1)} ranks.")
    ring, inner = mesh.get_group(0), mesh.get_group(1)
    return UlyssesGroups(mesh.size(1), inner.group_name, ring.group_name)


def _inner_compile(compiler: str, gm: fx.GraphModule, example_inputs: list) -> Callable:
    if compiler == "eager":
        return gm.forward
    if compiler == "aot_eager":
        return compat.aot_eager(gm, example_inputs)
    return compat.compile_fx(gm, example_inputs)
