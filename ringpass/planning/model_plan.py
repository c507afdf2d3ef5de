"""`ringpass plan` for a whole model: what one training step holds per rank, how long it takes, what to choose.

    ringpass plan --hf-config config.json --seq-len 131072 --world-size 8 --fsdp --gpu-mem 80 --device h100 \\
        --link nvlink

Memory is measured, not modelled: the model runs one training step (forward, backward, optimizer step; a first
step beforehand so the optimizer's states exist) on fake tensors at one rank's share of the sequence (the
layout's slots per rank), under torch's ``MemTracker``, which records what is live at the step's peak by kind:
weights, gradients, optimizer states, activations (and temporaries). That is what a rank of the ring holds: it
computes every op on its own tokens, and ring attention keeps what local attention keeps (q, k, v, out, LSE).
Two things differ from the model run alone, and are accounted for:

- attention runs as the ring runs it: no S x S mask (Hugging Face models get an attention function that calls
  SDPA with the causal flag and no mask, as the ring's lifted masks do), plus what the ring holds at the
  backward's peak beyond what that local attention holds (`lowering.costmodel.strategy_memory` less the out, LSE
  and dq, dk, dv local SDPA keeps, `lowering.costmodel.local_attention_bytes`: the KV blocks in flight and the
  dK/dV accumulators);
- a wrapper shards what the step holds: FSDP2 divides weights, gradients and optimizer states by the ranks and
  adds two units' weights gathered (the one running and the one prefetched); DDP adds its gradient buckets.

A step has two moments that can be its peak: the forward and backward's (activations, the gradients made by then,
the ring's buffers), and the optimizer's step, which holds every gradient, the model's outputs (the caller holds
them to the step's end, as it does through the backward: ``out = model(batch)``) and its own temporaries (AdamW: the
square root of the second moment and its quotient by the bias correction, one parameter at a time as torch runs it
on the CPU, or one temporary as large as all the parameters at once with ``foreach``, torch's default on a GPU:
the plan's optimizer is torch's default for the device it plans for, ``--device cpu`` or a calibration file the
CPU's, any other a GPU's). The plan reports the larger (`Candidate.peak`). With the ring the backward also copies
each parameter's gradient once as it makes it whole over the ring (`ringpass.planning.compiled_memory`). Both weigh with
the parameters, not the tokens: a large vocabulary's embedding and head (vocabulary x hidden each, untied) at a
short slice of the sequence per rank.

With the ring (P > 1) the model is compiled, and AOTAutograd's partitioner saves less than eager autograd keeps:
the activations and the gradients live at the peak are then those of the same step compiled on fake tensors as
the backend compiles it (`ringpass.planning.compiled_memory`: the captured forward and backward graphs walked with every
value freed after its last use), each block of the model's block lists checkpointed for the checkpointed
candidates. At P = 1 (the model alone, eager) they are the eager step's; checkpointing every block is derived from
its per-block numbers (``MemTracker`` under fake tensors over-counts non-reentrant checkpointing): a checkpointed
block keeps its input instead of what its forward saved, so the step's peak is the largest of the eager peak's
moment less what every block no longer keeps, each block's backward (its ``MemTracker`` peak there, recomputing
what it saved, less what the blocks before it no longer keep) and the backward's end (every gradient).
Checkpointing runs the blocks' forward FLOPs again, but not a ring
attention's (the backend saves its output, `MUST_SAVE`: no communication is repeated).

Time: every op of the same fake step outside attention (`OpCosts`), each the longer of its FLOPs (torch's
formulas) at the device's matrix-product rate and the bytes it reads and writes at its memory rate, plus a fixed
cost per op (`Hardware.gemm_flops_per_s`, ``memory_bytes_per_s``, ``op_overhead_s``: presets, or ``ringpass bench
--calibrate``); plus each attention's forward and backward as `lowering.costmodel` predicts them: the ring (compute
against transfer per step), or with ``strategy="auto"`` the fastest of the ring, Ulysses x ring and the all-gather
(`choose_strategies`, its memory by `strategy_memory`); one rank runs the model's own attention whole (at the
SDPA rate where calibrated); every attention at its head dim's rate (`Hardware.attention_flops_per_s`); plus the
gradients' traffic over the link (the wrapper's reduction, or without one the ring's all-reduce of every gradient
over its P ranks, one call per parameter). Checkpointing runs the blocks' forward ops again. The candidates: ring
sizes P dividing the world size (the others data-parallel), checkpointing on or off; the recommendation is the
fastest per batch that fits ``gpu_mem``.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections import Counter
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

from lowering import compat
from lowering.compat import pytree
from lowering.costmodel import (
    Hardware,
    Strategy,
    choose_strategies,
    local_attention_bytes,
    strategy_memory,
    strategy_seconds,
)
from lowering.errors import InvalidInputError, NotSupportedError, RingpassError
from lowering.layout import Layout
from ringpass.fx.op_costs import OpCosts
from ringpass.fx.report import attention_lines

OPTIMIZERS = {"adamw": 2, "sgd": 1, "none": 0}  # optimizer states per parameter (SGD: momentum)
PLAN_ATTENTION = "ringpass_plan"  # the Hugging Face attention function the fake step runs


@dataclass
class Candidate:
    """One way to run the step: ring size, checkpointing, and what it holds and takes per rank."""

    ring_size: int
    checkpointing: bool
    memory_per_rank: dict  # bytes: weights, gradients, optimizer, activations, ring, total
    strategies: str  # how the attentions run ("4 x ring (zigzag)"; strategy="auto": the cost model's picks)
    step_s: float
    batch_s: float  # seconds per batch: the step's, over the W / P batches the data-parallel replicas take at once
    time_parts: dict  # seconds: compute (outside attention), attention (the ring), wrapper (gradient traffic)
    fits: bool | None  # None: no --gpu-mem given
    peak: str = "backward"  # the moment memory_per_rank is taken at: "backward" (forward and backward) or "optimizer"

    def line(self) -> str:
        m = self.memory_per_rank
        fit = "" if self.fits is None else (", fits" if self.fits else ", does NOT fit")
        return (
            f"P={self.ring_size}{' checkpointed' if self.checkpointing else ''} ({self.strategies}): "
            f"{_gib(m['total'])} per rank "
            f"(weights {_gib(m['weights'])}, gradients {_gib(m['gradients'])}, optimizer {_gib(m['optimizer'])}, "
            f"{'activations' if self.peak == 'backward' else 'outputs held and optimizer temporaries'} "
            f"{_gib(m['activations'])}, ring {_gib(m['ring'])}{', at the optimizer step' * (self.peak != 'backward')})"
            f"{fit}; step {self.step_s:.3g} s, "
            f"{self.batch_s:.3g} s per batch (compute {self.time_parts['compute']:.3g}, "
            f"attention {self.time_parts['attention']:.3g}, "
            f"wrapper {self.time_parts['wrapper']:.3g})"
        )


@dataclass
class ModelPlan:
    world_size: int
    seq_len: int
    batch: int
    wrapper: str  # "fsdp" | "ddp" | "none"
    optimizer: str
    attentions: list[str]  # one line per kind of attention, with its count
    asked: Candidate  # the configuration the command line names (P = world size)
    candidates: list[Candidate] = field(default_factory=list)
    recommendation: str = ""

    def as_dict(self) -> dict:
        return {
            "world_size": self.world_size,
            "seq_len": self.seq_len,
            "batch": self.batch,
            "wrapper": self.wrapper,
            "optimizer": self.optimizer,
            "attentions": self.attentions,
            "memory_per_rank": self.asked.memory_per_rank,
            "step_s": self.asked.step_s,
            "time_parts": self.asked.time_parts,
            "fits": self.asked.fits,
            "candidates": [asdict(c) for c in self.candidates],
            "recommendation": self.recommendation,
        }

    def __str__(self) -> str:
        return "\n".join(
            [
                f"ringpass plan: a training step of batch {self.batch} x {self.seq_len} tokens on {self.world_size} "
                f"ranks, {self.wrapper}, optimizer {self.optimizer}",
                *(f"  attention: {a}" for a in self.attentions),
                f"  as asked: {self.asked.line()}",
                "  candidates (ring size P, the other ranks data-parallel):",
                *(f"    - {c.line()}" for c in self.candidates),
                f"  recommendation: {self.recommendation}",
            ]
        )


def plan_model(
    build: Callable[[int], tuple],
    seq_len: int,
    world_size: int,
    hw: Hardware,
    *,
    attentions: list,
    wrapper: str = "none",
    checkpointing: bool = False,
    optimizer: str = "adamw",
    gpu_mem: float | None = None,
    strategy: str = "ring",
) -> ModelPlan:
    """Plan a training step (module docstring). ``build(tokens)`` returns ``(model, inputs)`` at that many tokens
    per sequence, on the current (fake) device; ``attentions``: the report's `AttentionRecord`s of the model at
    ``seq_len`` (what the ring rewrites); ``strategy``: ``ring`` (every attention a ring) or ``auto`` (each
    candidate's attentions by the strategies `lowering.costmodel.choose_strategies` picks in its layout)."""
    if optimizer not in OPTIMIZERS:
        raise InvalidInputError(f"plan: --optimizer {optimizer!r} is not one of {', '.join(OPTIMIZERS)}.")
    if not attentions:
        raise InvalidInputError("plan: the model has no attention the ring rewrites; there is nothing to plan.")
    batch = attentions[0].batch
    sizes = [p for p in range(1, world_size + 1) if world_size % p == 0]
    candidates = []
    for p in sizes:
        layout = Layout(_layout(attentions), p, seq_len)
        step = measure_step(build, layout.local_len, optimizer, compiled=p > 1, foreach=not on_cpu(hw))
        for ckpt in (False, True):
            candidates.append(candidate(step, layout, world_size, hw, attentions, wrapper, ckpt, gpu_mem, strategy))
    asked = next(c for c in candidates if c.ring_size == world_size and c.checkpointing == checkpointing)
    fitting = [c for c in candidates if c.fits is not False]
    if not fitting:
        least = min(candidates, key=lambda c: c.memory_per_rank["total"])
        advice = (
            f"nothing fits {gpu_mem:g} GiB: the least memory is {least.line()}. Use more ranks, a shorter sequence, "
            "or a smaller batch."
        )
    else:
        best = min(fitting, key=lambda c: c.batch_s)
        dp = world_size // best.ring_size
        advice = (
            f"ring over {best.ring_size} rank(s)"
            + (f" x {dp} data-parallel" if dp > 1 else "")
            + (", activation checkpointing" if best.checkpointing else ", no checkpointing")
            + f", layout {_layout(attentions)}, attention by {best.strategies}"
            + (", strategy='auto'" if strategy == "auto" else "")
            + f", outputs='auto' (logits stay sharded): {best.step_s:.3g} s per step"
            + (f" of {dp} batches of {batch} ({best.batch_s:.3g} s per batch)" if dp > 1 else "")
        )
    return ModelPlan(
        world_size, seq_len, batch, wrapper, optimizer, attention_lines(attentions), asked, candidates, advice
    )


def candidate(
    step: dict, layout: Layout, world_size, hw, attentions, wrapper, checkpointing, gpu_mem, strategy: str = "ring"
) -> Candidate:
    """The memory and time of one candidate from the fake step at its tokens per rank (`measure_step`)."""
    ring_size = layout.world_size
    if checkpointing:
        step = {**step, **{k: step[f"{k}_checkpointed"] for k in ("activations", "gradients")}}
    shapes = [a.shape() for a in attentions]
    if ring_size == 1:  # the model's own attention on the whole sequence
        chosen = [Strategy("none")] * len(shapes)
    elif strategy == "auto":
        chosen = choose_strategies(shapes, layout.seq_len, ring_size, hw, layouts=(layout.kind,), none=False).chosen
    else:
        chosen = [Strategy("ring", layout.kind)] * len(shapes)
    n, p = layout.seq_len, ring_size
    local = layout.local_len
    ring_buffers = (
        max(strategy_memory(s, a, n, p) - local_attention_bytes(a, local) for s, a in zip(chosen, shapes))
        if ring_size > 1
        else 0
    )
    weights, optimizer_bytes = step["weights"], step["optimizer"]
    parameter_bytes = step["parameter_bytes"]
    # (activations and temporaries, gradients, ring buffers) at the two moments that can be the peak: the
    # forward and backward's, and the optimizer step's (every gradient and the step's temporaries)
    moments = {
        "backward": [step["activations"], step["gradients"], ring_buffers],
        "optimizer": [step["optimizer_step"], step["all_gradients"], 0],
    }
    if wrapper == "fsdp":  # sharded over every rank, two units gathered (running + prefetched)
        weights = weights // world_size + 2 * step["largest_unit_bytes"]
        optimizer_bytes = optimizer_bytes // world_size
        moments["backward"][1] //= world_size
        moments["optimizer"][:2] = [b // world_size for b in moments["optimizer"][:2]]  # the step runs on shards
    elif wrapper == "ddp":
        for moment in moments.values():
            moment[1] += parameter_bytes  # the buckets: a second copy of every gradient
    peak = max(moments, key=lambda k: sum(moments[k]))
    memory = {"weights": weights, "gradients": moments[peak][1], "optimizer": optimizer_bytes}
    memory["activations"], memory["ring"] = moments[peak][0], moments[peak][2]
    memory["total"] = sum(memory.values())
    compute = step["ops"].seconds(hw, checkpointing)
    attention = sum(  # checkpointing runs the model's own attention again, never a ring (its output is saved)
        strategy_seconds(s, a, n, p, hw)
        + (checkpointing and s.kind == "none") * strategy_seconds(s, a, n, p, hw, backward=False)
        for s, a in zip(chosen, shapes)
    )
    if wrapper == "none":  # without a wrapper the ring makes every gradient whole: an all-reduce over its ranks
        messages = step["parameter_count"] * 2 * (ring_size - 1)  # one call per parameter, a ring's 2 (P-1) hops
        traffic = 2 * (ring_size - 1) / ring_size * parameter_bytes / hw.link_bytes_per_s
        traffic += messages * hw.link_latency_s
    elif world_size == 1:
        traffic = 0.0
    else:  # an all-reduce (DDP) or all-gather + reduce-scatter (FSDP2): 2 (W-1)/W of the gradients each way
        rounds = 2 if wrapper == "ddp" else 3  # FSDP2: forward and backward all-gathers, one reduce-scatter
        traffic = rounds * (world_size - 1) / world_size * parameter_bytes / hw.link_bytes_per_s
    fits = None if gpu_mem is None else memory["total"] <= gpu_mem * 2**30
    step_s = compute + attention + traffic
    counts = Counter(str(s) for s in chosen)
    return Candidate(
        ring_size,
        checkpointing,
        memory,
        ", ".join(f"{count} x {name}" for name, count in counts.items()) if ring_size > 1 else "unsharded",
        step_s,
        step_s * ring_size / world_size,
        {"compute": compute, "attention": attention, "wrapper": traffic},
        fits,
        peak,
    )


def measure_step(
    build: Callable[[int], tuple], tokens: int, optimizer: str, compiled: bool = False, foreach: bool | None = None
) -> dict:
    """One training step of ``build(tokens)`` on fake tensors, after a first one so the optimizer's states exist:
    the bytes of the weights (parameters and buffers) and of the optimizer's states, the ops outside attention
    (`OpCosts`), the parameters' bytes and count and the largest block's bytes (an FSDP unit); the activations and
    gradients live at the peak of the forward and backward, without and with every block checkpointed: the eager
    step's (``MemTracker``), or with ``compiled`` those of the step compiled as the ring backend compiles it (module
    docstring); and the optimizer step's moment: every gradient (``all_gradients``) and beside it
    (``optimizer_step``) the model's outputs, which the caller holds to the step's end as ``out = model(batch)``
    does, and the most bytes the step's temporaries hold at once, with ``foreach`` as given (None: torch's choice
    for the fake tensors' device, the CPU's)."""
    with compat.FakeTensorMode(allow_non_fake_inputs=False), _step_failures(tokens):
        model, inputs = build(tokens)
        model.train()
        states = OPTIMIZERS[optimizer]
        step_optimizer = (
            torch.optim.AdamW(model.parameters(), foreach=foreach)
            if states == 2
            else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=foreach)
            if states == 1
            else None
        )
        _train_step(model, inputs, step_optimizer)  # the optimizer's states exist from the first step on
        blocks = _blocks(model)
        ops = OpCosts(_module_names(model, blocks))
        optimizer_step = OptimizerStep()
        if compiled:
            with ops:
                _train_step(model, inputs, step_optimizer, optimizer_step)
        else:
            live = _eager_memory(model, inputs, step_optimizer, blocks, ops, optimizer_step)
        held = (step_optimizer.state if step_optimizer else {}).values()
        optimizer_states = [t for state in held for t in state.values() if isinstance(t, torch.Tensor)]
    step = {
        "weights": sum(_tensor_bytes(t) for t in (*model.parameters(), *model.buffers())),
        "optimizer": sum(_tensor_bytes(t) for t in optimizer_states),
        "ops": ops,
        "parameter_bytes": _bytes(model),
        "parameter_count": len(list(model.parameters())),
        "largest_unit_bytes": max((_bytes(b) for b in blocks), default=0),
        "all_gradients": optimizer_step.gradients,
        "optimizer_step": optimizer_step.outputs + optimizer_step.peak,
    }
    return {**step, **(_compiled_peak(build, tokens) if compiled else live)}


def _eager_memory(model, inputs, step_optimizer, blocks, ops: OpCosts, optimizer_step: OptimizerStep) -> dict:
    """The activations (and temporaries) and gradients live at the peak of an eager step under ``MemTracker``;
    with every block checkpointed, derived from its per-block numbers (module docstring)."""
    MemRefType, ModState = compat.MemRefType, compat.ModState
    tracker = compat.MemTracker()
    tracker.track_external(model, *([step_optimizer] if step_optimizer else []))
    with tracker, ops:
        _train_step(model, inputs, step_optimizer, optimizer_step)

    def live(snapshot: dict) -> tuple[int, int]:  # (activations and temporaries, gradients)
        kinds = (MemRefType.ACT, MemRefType.TEMP, MemRefType.OTH)
        return sum(snapshot[k] for k in kinds), snapshot[MemRefType.GRAD]

    def at(block, state) -> dict:
        return next(iter(tracker.memory_tracking[block].snapshots[state][0].values()))

    whole, gradients = live(next(iter(tracker.get_tracker_snapshot("peak").values())))
    checkpointed = (whole, gradients)  # without blocks there is nothing to checkpoint
    if blocks:  # checkpointed, a block keeps its input instead of what its forward saved: ``dropped`` is the rest
        saved = [at(b, ModState.POST_FW)[MemRefType.ACT] - at(b, ModState.PRE_FW)[MemRefType.ACT] for b in blocks]
        dropped = [kept - tracker.memory_tracking[b].input_mem for kept, b in zip(saved, blocks)]
        moments = [  # (activations, gradients) live at each moment that can be the step's peak:
            (whole - sum(dropped), gradients),  # the eager peak's
            # each block's backward, recomputing what it saved while the blocks before it (in their list's order,
            # the forward's) hold their inputs only
            *((a - sum(dropped[:i]), g) for i, (a, g) in enumerate(live(at(b, ModState.PEAK_BW)) for b in blocks)),
            (0, _bytes(model)),  # the backward's end: every gradient
        ]
        checkpointed = max(moments, key=sum)
    return {
        "activations": whole,
        "gradients": gradients,
        "activations_checkpointed": checkpointed[0],
        "gradients_checkpointed": checkpointed[1],
    }


def _compiled_peak(build: Callable[[int], tuple], tokens: int) -> dict:
    """The activations and gradients at the peak of a training step of ``build(tokens)`` compiled on fake tensors
    (`ringpass.planning.compiled_memory`), without and with every block checkpointed."""
    from ringpass.planning.compiled_memory import compiled_step_memory

    found = {}
    for checkpointing, suffix in ((False, ""), (True, "_checkpointed")):
        with compat.FakeTensorMode(allow_non_fake_inputs=True):  # a checkpoint's saved RNG state is a real tensor
            model, inputs = build(tokens)
            model.train()
            memory = compiled_step_memory(model, inputs, checkpointing)
        found[f"activations{suffix}"], found[f"gradients{suffix}"] = memory.activations, memory.gradients
    return found


@contextmanager
def _step_failures(tokens: int):
    """A training step on fake tensors that fails says so, and why it may (a `RingpassError` passes as it is)."""
    try:
        yield
    except RingpassError:
        raise
    except Exception as error:
        raise NotSupportedError(
            f"plan: one training step of the model at {tokens} tokens per rank on fake tensors failed "
            f"({type(error).__name__}: {error}). Its code needs real values somewhere (.item(), a data-dependent "
            "branch) or runs an op that fake tensors do not support for these inputs (a dtype it refuses: try "
            "another --dtype); the traceback shows where."
        ) from error


def _train_step(model, inputs, step_optimizer, optimizer_step: OptimizerStep | None = None) -> None:
    out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    loss = getattr(out, "loss", None)
    if loss is None:
        loss = out[0] if isinstance(out, (tuple, list)) else out
    loss.float().sum().backward()
    if optimizer_step is not None:  # what the optimizer steps beside: the gradients, the outputs the caller holds
        optimizer_step.gradients = sum(_tensor_bytes(p.grad) for p in model.parameters() if p.grad is not None)
        optimizer_step.outputs = _storages_bytes(list(out.values()) if isinstance(out, Mapping) else out)
    if step_optimizer is not None:
        with optimizer_step or contextlib.nullcontext():
            step_optimizer.step()
    model.zero_grad(set_to_none=True)


class OptimizerStep(compat.TorchDispatchMode):
    """The most bytes that the tensors made under it hold at once (an optimizer step's temporaries: its in-place
    updates of parameters and states make none); ``gradients`` and ``outputs``, the bytes of the gradients it
    steps with and of the model's outputs held beside them. A tensor's storage is counted from the op that makes it
    until it is freed (a weak reference, as torch's ``MemTracker`` tracks storages)."""

    def __init__(self):
        super().__init__()
        self.gradients = self.outputs = self.peak = self.live = 0
        self._made: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not func.is_view:
            read = {compat.storage_id(t.untyped_storage()) for t in pytree.tree_leaves((args, kwargs)) if _is_tensor(t)}
            for tensor in pytree.tree_leaves(out):
                if not _is_tensor(tensor):
                    continue
                storage = tensor.untyped_storage()
                key = compat.storage_id(storage)
                if key in read or key in self._made:
                    continue
                size = int(storage.nbytes())
                self._made[key] = weakref.ref(storage, functools.partial(self._freed, key, size))
                self.live += size
            self.peak = max(self.peak, self.live)
        return out

    def _freed(self, key: int, size: int, _ref) -> None:
        self._made.pop(key, None)
        self.live -= size


def _is_tensor(value) -> bool:
    return isinstance(value, torch.Tensor)


def _storages_bytes(values) -> int:
    """The bytes of the distinct storages of the tensors in ``values`` (a pytree)."""
    storages = {
        compat.storage_id(t.untyped_storage()): t.untyped_storage().nbytes()
        for t in pytree.tree_leaves(values)
        if _is_tensor(t)
    }
    return int(sum(storages.values()))


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The entries of the model's block lists: what checkpointing and FSDP2 wrap one by one."""
    return [block for module in model.modules() if isinstance(module, torch.nn.ModuleList) for block in module]


def _module_names(model: torch.nn.Module, blocks: list) -> set[str]:
    """``ModuleTracker``'s names of ``blocks`` (the root's class name, then the module path)."""
    paths = {id(m): name for name, m in model.named_modules()}
    return {f"{type(model).__name__}.{paths[id(b)]}" for b in blocks}


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _bytes(module: torch.nn.Module) -> int:
    """The bytes of ``module``'s parameters."""
    return sum(_tensor_bytes(p) for p in module.parameters())


def on_cpu(hw: Hardware) -> bool:
    """Whether ``hw`` is a CPU: the ``cpu`` preset, or a ``ringpass bench --calibrate`` file (it measures the
    CPU's ranks)."""
    return hw.device in ("cpu", "calibrated")


def _layout(attentions) -> str:
    return "zigzag" if any(a.is_causal for a in attentions) else "contiguous"


def hf_plan_attention() -> None:
    """Register `PLAN_ATTENTION` with Hugging Face: SDPA with the causal flag and no mask (the ring lifts masks
    into its tiles, so no S x S tensor exists), on the KV heads as they are (GQA)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        out = torch.nn.functional.scaled_dot_product_attention(
            query,
            key,
            value,
            is_causal=bool(getattr(module, "is_causal", True)) and query.shape[2] > 1,
            scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
        )
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(PLAN_ATTENTION, attend)
    AttentionMaskInterface.register(PLAN_ATTENTION, lambda *args, **kwargs: None)


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB" if n >= 2**30 else f"{n / 2**20:.3g} MiB"
