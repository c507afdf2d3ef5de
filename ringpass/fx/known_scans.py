"""The chunked scans whose state the ring backend can pass (`lowering.state_passing`), by the function a model calls.

A `KnownScan` says, for a function name, which adapter of ``lowering.state_passing.ADAPTERS`` calls it, the keyword
constants a call may have been traced with (a flag's values, the chunk sizes and limits the call's ops spell), and how
to draw a value for each argument that keeps the recurrence finite over any length (a decay's log at most 0, a
learning rate in [0, 1]): `find_scan_states` tries the call's values as those arguments and keeps what computes the
call's output. Hugging Face's ``torch_chunk_gated_delta_rule`` (Qwen3-Next, Qwen3.5, OLMo-Hybrid),
``chunk_kimi_delta_attention`` (Kimi-Linear) and ``mamba2_chunk_scan`` (Mamba2, Bamba, Falcon-H1, Zamba2, Nemotron-H,
GraniteMoeHybrid) are known.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from lowering.state_passing import ARGUMENTS
from ringpass.fx.call_regions import frames
from ringpass.fx.sizes import is_size_op
from ringpass.fx.spellings import op_name


def _normal(shape, generator, dtype, device):
    return torch.randn(shape, generator=generator, dtype=dtype).to(device)


def _unit(shape, generator, dtype, device):  # in [0, 1): a learning rate, a gate
    return torch.rand(shape, generator=generator, dtype=dtype).to(device)


def _non_positive(shape, generator, dtype, device):  # in (-1, 0]: a decay's log, Mamba's A
    return -_unit(shape, generator, dtype, device)


def _chunk_sizes(nodes) -> tuple:
    """The sizes the call's reshapes, views and unflattens spell: its chunk size among them."""
    spelled = [a for n in nodes if is_size_op(n) for a in n.args[1:]]
    spelled += [a for n in nodes if op_name(n) == "unflatten" for a in (n.args[2] if len(n.args) > 2 else ())]
    return tuple(sorted({a for a in spelled if isinstance(a, int) and a > 1}, reverse=True))


def _clamp_limits(nodes) -> tuple:
    """(min, max) of each clamp in the call with a lower limit (given by keyword or position), in graph order, then no
    limit: Mamba2's ``dt_limit``. The call's own limits come first: drawn values the clamp does not reach tie with no
    limit, and the limits the call spells are what it computes."""
    limits = []
    for n in nodes:
        if n.target in (torch.clamp, "clamp"):
            low, high = (n.args[i] if len(n.args) > i else n.kwargs.get(k) for i, k in ((1, "min"), (2, "max")))
            if isinstance(low, (int, float)):
                limits.append((float(low), float(high) if isinstance(high, (int, float)) else float("inf")))
    return tuple(dict.fromkeys([*limits, (0.0, float("inf"))]))


@dataclass(frozen=True)
class KnownScan:
    """``adapter``: a key of ``lowering.state_passing.ADAPTERS`` (and ``ARGUMENTS``); ``draws``: each argument's
    value drawer (``(shape, generator, dtype, device) -> tensor``; the rest normal); ``constants``: each keyword
    constant's candidates, from the call's nodes."""

    adapter: str
    draws: dict[str, Callable]
    constants: Callable[[list[fx.Node]], dict[str, tuple]]

    @property
    def tokens(self) -> tuple[str, ...]:
        return ARGUMENTS[self.adapter][0]

    @property
    def weights(self) -> tuple[str, ...]:
        return ARGUMENTS[self.adapter][1]

    def draw(self, name: str) -> Callable:
        return self.draws.get(name, _normal)


DELTA_RULE = KnownScan(
    "delta rule",
    draws={"g": _non_positive, "beta": _unit},
    constants=lambda nodes: {"chunk_size": _chunk_sizes(nodes), "use_qk_l2norm_in_kernel": (True, False)},
)
KNOWN_SCANS = {
    "torch_chunk_gated_delta_rule": DELTA_RULE,
    # Kimi Delta Attention: the delta rule with a decay per key channel (``g [B, N, H, dk]``), the same signature
    "chunk_kimi_delta_attention": DELTA_RULE,
    "mamba2_chunk_scan": KnownScan(
        "ssd",
        draws={"A": _non_positive},
        constants=lambda nodes: {
            "chunk_size": _chunk_sizes(nodes),
            "dt_softplus": (True, False),
            "dt_limit": _clamp_limits(nodes),
        },
    ),
}


def function_module(nodes: list[fx.Node], function: str) -> str | None:
    """The name of the module that defines ``function``, read from the frames the call's nodes were traced in."""
    for node in nodes:
        for file, _, name in reversed(frames(node)):
            if name == function:
                return next(
                    (m for m, module in list(sys.modules.items()) if getattr(module, "__file__", None) == file), None
                )
    return None
