"""Every rank runs the same compiled ring graph on agreeing inputs, or every rank hears why not.

`guard_graph(compiled, ctx)` wraps what the inner compiler returned for a rewritten graph. Each call:

1. numbers the call (`lowering.failures.begin_call`) and posts this rank's fingerprint of it to the
   peers: the rewritten graph's hash (its code and the options), the shapes of its inputs, and (on every
   call; on the first call of the graph only with ``checks="first"``) checksums of the inputs that must be
   equal on every rank — everything with ``inputs="full"``; with ``inputs="sharded"`` all but the
   per-token inputs each rank passes its own shard of. Parameters and buffers are checksummed on the
   first call only.
2. reads every peer's fingerprint of the same call; a difference raises the same `InvalidInputError`
   on every rank, naming the input (by the user's argument name) and the ranks, before any ring traffic.
3. runs the compiled graph; an error it raises is posted to the peers (`lowering.failures`), who stop
   with a `PeerFailure` that names this rank and the error instead of waiting for it.

``checks="off"`` skips 1 and 2 (waits stay bounded and failures are still posted).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import torch

from lowering import failures
from lowering.masks import mask_program
from ringpass.fx.context import LOCAL, PassContext
from ringpass.fx.nodes import is_module_state, user_name


@dataclass(frozen=True)
class GraphInput:
    """A graph input as the user knows it: its name, whether each rank passes its own shard of it,
    whether it is a parameter or buffer of the model."""

    name: str
    sharded: bool
    module_state: bool


class GuardedGraph:
    """The compiled graph of one rewritten graph, called through the checks of the module docstring."""

    def __init__(self, compiled, inputs: list[GraphInput], graph_hash: str, index: int, group_name: str, checks: str):
        self.compiled, self.inputs, self.graph_hash = compiled, inputs, graph_hash
        self.index, self.group_name, self.checks = index, group_name, checks
        self.calls = 0

    def __call__(self, *args):
        call = failures.begin_call()
        failures.set_state(f"{failures.INSIDE}: graph {self.index}, call {call}")
        try:
            if self.checks != "off":
                failures.agree(self.group_name, "call", self._fingerprint(args), self._difference)
            self.calls += 1
            with failures.ring_work(self.group_name):
                return self.compiled(*args)
        finally:
            failures.set_state(f"outside ringpass, after call {call} (graph {self.index})")

    def _fingerprint(self, args) -> dict:
        fingerprint = {"graph": self.graph_hash, "index": self.index, "shapes": [_shape(a) for a in args]}
        if self.calls == 0 or self.checks == "every":
            checked = [
                i
                for i, (a, spec) in enumerate(zip(args, self.inputs))
                if isinstance(a, torch.Tensor) and not spec.sharded and (self.calls == 0 or not spec.module_state)
            ]
            sums = _checksums([args[i] for i in checked], [self.inputs[i].module_state for i in checked])
            fingerprint["sums"] = dict(zip(map(str, checked), sums))
        return fingerprint

    def _difference(self, everyone: list[dict]) -> str:
        """What differs between the ranks' fingerprints ('' when nothing does), for people."""
        where = f"before call {failures.current_call()} of a ring graph"
        for i, spec in enumerate(self.inputs):
            shapes = [f["shapes"][i] if i < len(f["shapes"]) else None for f in everyone]
            if len(set(map(str, shapes))) > 1:
                return f"The ranks disagree {where}: input `{spec.name}` has shape {_by_rank(shapes)}. " + (
                    "Every rank passes its own shard, of the same length: make them with ringpass.shard(x, dim)."
                    if spec.sharded
                    else "Every rank of the ring must pass the same whole batch (same sequence length)."
                )
        if len({(f["graph"], f["index"]) for f in everyone}) > 1:
            graphs = [f"graph {f['index']} ({f['graph'][:8]})" for f in everyone]
            return (
                f"The ranks disagree {where}: they run different compiled graphs: {_by_rank(graphs)}. The model "
                "code, the backend options (layout, inputs, outputs, ...) or the input shapes differ between the "
                "ranks, or one rank compiled a graph the others did not."
            )
        if all("sums" in f for f in everyone):
            for key in everyone[0]["sums"]:
                sums = [f["sums"].get(key) for f in everyone]
                if len(set(sums)) > 1:
                    spec = self.inputs[int(key)]
                    return (
                        f"The ranks disagree {where}: input `{spec.name}` holds different values on "
                        f"{_ranks_differing(sums)} (checksums). " + _why_equal(spec)
                    )
        return ""


def guard_graph(compiled, ctx: PassContext, index: int):
    """``compiled`` called through the checks of the module docstring (``ctx`` after the pipeline ran)."""
    placeholders = [n for n in ctx.gm.graph.nodes if n.op == "placeholder"]
    sharded = {n for n in placeholders if ctx.placement.get(n) == LOCAL} | ctx.gathered_inputs
    own = (sharded if ctx.options.inputs == "sharded" else set()) | ctx.rank_own_inputs | set(ctx.carried_inputs)
    inputs = [GraphInput(user_name(n), n in own, is_module_state(n)) for n in placeholders]
    return GuardedGraph(compiled, inputs, graph_hash(ctx), index, ctx.group_name, ctx.options.checks)


def graph_hash(ctx: PassContext) -> str:
    """What the ranks compare to know they run the same graph: its code and the options that shaped it."""
    options = {k: v for k, v in vars(ctx.options).items() if k not in ("group", "report", "timeout", "checks")}
    code = _canonical(ctx.gm.code)
    chosen = [ctx.ulysses_for(size) for size in ctx.ulysses_used]  # strategy="auto"'s Ulysses groups
    for groups in [ctx.ulysses] * bool(ctx.ulysses) + chosen:  # each rank's groups have their own names
        for name, role in zip((groups.ulysses_group, groups.ring_group), ("ulysses", "ring")):
            code = re.sub(rf"'{re.escape(name)}'", f"<{role} group of {groups.size}>", code)
    return hashlib.sha1(f"{code}{sorted(options.items())}{ctx.world_size}".encode()).hexdigest()


def _canonical(code: str) -> str:
    """The graph's code with each mask or bias program's id replaced by the program's own code, and the
    shape symbols (``s27``, ``u3``: numbered by each process's history) renamed in order of appearance,
    so that ranks that compiled the same graph hash it alike."""
    code = re.sub(r"mask-[0-9a-f]{16}", lambda m: f"<{getattr(mask_program(m.group(0)), 'code', '')}>", code)
    names: dict[str, str] = {}
    return re.sub(r"\b(?:s|u|zuf|zf)\d+\b", lambda m: names.setdefault(m.group(0), f"sym{len(names)}"), code)


def _shape(value):
    if isinstance(value, torch.Tensor):
        return [str(value.dtype)[6:], *value.shape]
    return value if isinstance(value, (int, float, bool)) else type(value).__name__


def _checksums(tensors: list[torch.Tensor], module_state: list[bool]) -> list[str]:
    """Two sums per tensor, computed on its device and read back at once: plain and absolute sums for
    parameters and buffers; plain and position-weighted sums for inputs (a reordered batch differs). A DTensor
    (tensor parallel) is summed on its local shard: the ranks of one ring hold the same shard."""
    if not tensors:
        return []
    sums = []
    for t, state in zip(tensors, module_state):
        t = t.to_local() if hasattr(t, "to_local") else t
        flat = t.detach().reshape(-1)
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        if state and flat.is_floating_point():
            sums.append(torch.stack((flat.sum(dtype=torch.float64), flat.abs().sum(dtype=torch.float64))))
        else:
            values = flat.to(torch.float64)
            weights = torch.arange(values.numel(), device=values.device, dtype=torch.float64).remainder_(8191).add_(1)
            sums.append(torch.stack((values.sum(), values.dot(weights))))
    return [repr(pair) for pair in torch.stack(sums).cpu().tolist()]


def _by_rank(values: list) -> str:
    return ", ".join(f"{value} on {ranks}" for value, ranks in failures.ranks_by_value(values).items())


def _ranks_differing(sums: list) -> str:
    return " vs ".join(failures.ranks_by_value(sums).values())


def _why_equal(spec: GraphInput) -> str:
    if spec.module_state:
        return (
            "Parameters and buffers must be equal on every rank of the ring: initialise the model with the same "
            "seed on every rank, or load the same checkpoint."
        )
    return (
        "With inputs='full' every rank of the ring passes the same whole batch and the ring shards it; a "
        "data-parallel loader that gives each rank its own batch must give the ranks of one ring the same one "
        "(or use inputs='sharded' and pass ringpass.shard(batch, dim) of the one batch on each rank)."
    )
