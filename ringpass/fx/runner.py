"""Running passes in stages, so that a refusal or a wrong rewrite is found at the pass that caused it.

`PassRunner` runs each `Stage`'s passes on ``ctx.gm`` in order, numbered from 1 across the stages it runs,
and logs each on the ``ringpass.passes`` logger at DEBUG (its number, stage, node count and time). A refusal
(`NotSupportedError`) raised inside a pass has the pass's name added to its message. When asked, after
each pass:

- ``RINGPASS_CHECK_PASSES=1``: the graph is linted (`torch.fx.Graph.lint`) and, where its stage leaves it
  computing its values (`Stage.runs_between_passes`; always after a stage's last pass), run on fake tensors
  made from the inputs' example values (`run_on_fake_values`; nothing is written into the graph). A graph
  that ran before and no longer runs raises `PassCheckError`, naming the pass (or the stage) and the node: a
  ringpass bug. The graph as captured may hold calls a plain run cannot replay (an opaque
  ``nn.MultiheadAttention`` call under symbolic shapes, ``.item()`` inside a subgraph's body): the prepare
  passes write them out, and checking starts once the graph runs.
- ``RINGPASS_DEBUG_DIR=dir``: the graph's code is written to ``dir/graph_<i>/<nn>_<pass>.py`` (``<nn>``: the
  pass's number; ``00_captured.py``: the graph as captured; ``<nn>_<pass>_refused.py``, or ``_raised.py`` for
  an error other than a refusal: the graph as the pass left it, with the error on top), under
  ``dir/rank_<r>/`` when a process group is initialised. Files of an earlier run of the same graph index
  are removed first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F

from lowering import compat
from lowering.errors import NotSupportedError
from ringpass.fx.context import PassContext
from ringpass.fx.nodes import describe, example_value, is_vmap_bookkeeping

log = logging.getLogger("ringpass.passes")
CHECK_PASSES = "RINGPASS_CHECK_PASSES"
DEBUG_DIR = "RINGPASS_DEBUG_DIR"
WRITTEN = re.compile(r"\d\d_\w+\.py")  # the files a run writes into a graph's folder
READS_DATA = ("item", "tolist")  # a tensor's numbers as Python values
VMAP_LEVELS = {"_vmap_increment_nesting": 1, "_vmap_decrement_nesting": -1}  # functorch's global state


@dataclass(frozen=True)
class Stage:
    """A named run of passes. ``runs_between_passes``: the graph computes its values after each of them (a stage
    that rewrites the graph from the whole sequence to this rank's tokens does so only after its last)."""

    name: str
    passes: tuple[Callable[[PassContext], None], ...]
    runs_between_passes: bool = True


class PassCheckError(RuntimeError):
    """A pass left a graph that no longer runs (``RINGPASS_CHECK_PASSES=1``): a bug in that pass."""


class PassRunner:
    """Runs stages of passes on one graph (``ctx.gm``), numbering the passes across them."""

    def __init__(self, ctx: PassContext):
        self.ctx = ctx
        self.done = 0  # passes run so far
        self.check = os.environ.get(CHECK_PASSES, "") not in ("", "0")
        self.checked: list = []  # the graph as last run on fake values (`_state`): unchanged, it is not run again
        self.runs = False  # whether it ran then
        if self.check:
            self._run_on_fake_values("the graph as captured")
        self.folder = _graph_folder(ctx.report.graph_index)
        if self.folder is not None:
            for old in self.folder.iterdir():
                if WRITTEN.fullmatch(old.name):
                    old.unlink()
            self._write("captured")

    def run(self, stage: Stage) -> None:
        for i, run_pass in enumerate(stage.passes):
            self.done += 1
            name, nodes, started = run_pass.__name__, len(self.ctx.gm.graph.nodes), time.perf_counter()
            try:
                run_pass(self.ctx)
            except Exception as error:
                refused = isinstance(error, NotSupportedError)
                if self.folder is not None:
                    self._write(f"{name}_{'refused' if refused else 'raised'}", error)
                if refused:
                    error.args = (f"{error}\n(Refused by the pass `{name}`.)",)
                raise
            log.debug(
                "graph %d, pass %d (%s): %s: %d nodes (%+d), %.3f s",
                self.ctx.report.graph_index,
                self.done,
                stage.name,
                name,
                len(self.ctx.gm.graph.nodes),
                len(self.ctx.gm.graph.nodes) - nodes,
                time.perf_counter() - started,
            )
            if self.folder is not None:
                self._write(name)
            if self.check:
                self._check(f"the pass `{name}`", stage, last=i == len(stage.passes) - 1)

    def _check(self, where: str, stage: Stage, last: bool) -> None:
        try:
            self.ctx.gm.graph.lint()
        except Exception as error:
            raise PassCheckError(f"After {where} the graph is malformed: {error}") from error
        if stage.runs_between_passes:
            self._run_on_fake_values(where)
        elif last:
            passes = ", ".join(p.__name__ for p in stage.passes)
            self._run_on_fake_values(f"the stage `{stage.name}` ({passes}: the graph runs again after the last)")

    def _run_on_fake_values(self, where: str) -> None:
        """Runs the graph on fake values unless it is unchanged since the last run; raises when it ran then."""
        if _same_state(self.checked, _state(self.ctx.gm.graph)):
            return
        self.checked = _state(self.ctx.gm.graph)
        node, error = run_on_fake_values(self.ctx.gm)
        ran, self.runs = self.runs, error is None
        if error is not None and ran:
            raise PassCheckError(
                f"After {where} the graph no longer runs on fake tensors: {describe(node)} raised "
                f"{type(error).__name__}: {error}"
            ) from error

    def _write(self, name: str, error: BaseException | None = None) -> None:
        header = (
            f"# graph {self.ctx.report.graph_index}, after pass {self.done}: {name}\n"
            "# (shapes in annotations are the traced values: `PassContext`, on example values)\n"
        )
        if error is not None:
            header += "".join(f"# {line}\n" for line in f"{type(error).__name__}: {error}".splitlines())
        try:
            code = self.ctx.gm.print_readable(print_output=False)
        except Exception as unreadable:  # a graph a pass left broken: say so rather than hide the pass's error
            code = f"# the graph could not be written: {type(unreadable).__name__}: {unreadable}\n"
        (self.folder / f"{self.done:02d}_{name}.py").write_text(header + code)


def _state(graph: fx.Graph) -> list:
    """What a pass changes when it rewrites the graph: its nodes, and each node's target and arguments (new
    objects when a pass sets them)."""
    return [(node, node.target, node.args, node.kwargs) for node in graph.nodes]


def _same_state(before: list, after: list) -> bool:
    return len(before) == len(after) and all(x is y for old, new in zip(before, after) for x, y in zip(old, new))


def _graph_folder(index: int) -> Path | None:
    root = os.environ.get(DEBUG_DIR)
    if not root:
        return None
    folder = Path(root)
    if dist.is_available() and dist.is_initialized():
        folder /= f"rank_{dist.get_rank()}"
    folder /= f"graph_{index}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _pad(x, pad, mode="constant", value=None):
    """``F.pad`` through its Python reference, which keeps symbolic sizes symbolic (the C++ op on fake
    tensors makes them concrete, or fails on a symbolic pad)."""
    if mode != "constant":
        return F.pad(x, pad, mode, value)
    return compat.constant_pad_nd_ref(x, pad, 0 if value is None else value)


FAKE_EQUIVALENTS = {compat.pad_binding: _pad, F.pad: _pad}  # on fake values: same shapes, sizes kept symbolic


def run_on_fake_values(gm: fx.GraphModule) -> tuple[fx.Node | None, Exception | None]:
    """Runs every node of ``gm`` on fake tensors: copies of the inputs' example values, in the graph's own fake
    mode, without guards and without touching the graph or the example values (a read of a tensor's numbers,
    ``.item()``, gives the value Dynamo traced). Returns (None, None), or the first node that raised and its
    error. A graph without tensor inputs is not run."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = next((example_value(n).fake_mode for n in inputs if hasattr(example_value(n), "fake_mode")), None)
    if fake_mode is None:
        return None, None
    shape_env = fake_mode.shape_env
    vmap_levels, env = 0, {}
    node = None
    with contextlib.ExitStack() as stack:
        stack.enter_context(fake_mode)
        # shapes only (flex_attention's autograd would trace in a fake mode of its own); on leaving, the grad mode
        # is what it was, whatever the graph's own _set_grad_enabled calls set
        stack.enter_context(torch.no_grad())
        if shape_env is not None:
            stack.enter_context(shape_env.suppress_guards())
            stack.enter_context(shape_env.ignore_fresh_unbacked_symbols())
        try:
            for node in gm.graph.nodes:
                if node.op == "placeholder":
                    value = example_value(node)
                    env[node] = value.clone() if isinstance(value, torch.Tensor) else value
                elif node.op == "get_attr":
                    env[node] = _attribute(gm, node.target)
                elif node.op == "call_method" and node.target in READS_DATA and example_value(node) is not None:
                    env[node] = example_value(node)  # fake tensors hold no numbers: what Dynamo read
                elif node.op != "output":
                    env[node] = _call(gm, node, env)
                    if is_vmap_bookkeeping(node):
                        vmap_levels += VMAP_LEVELS.get(node.target.__name__, 0)
        except Exception as error:
            return node, error
        finally:
            for _ in range(vmap_levels):  # a failure inside a vmap nest: close its levels
                compat.vmap_decrement_nesting()
    return None, None


def _call(gm: fx.GraphModule, node: fx.Node, env: dict):
    args = fx.node.map_arg(node.args, env.__getitem__)
    kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    if node.op == "call_module":
        return gm.get_submodule(node.target)(*args, **kwargs)
    return FAKE_EQUIVALENTS.get(node.target, node.target)(*args, **kwargs)


def _attribute(gm: fx.GraphModule, target: str):
    value = gm
    for name in target.split("."):
        value = getattr(value, name)
    return value
