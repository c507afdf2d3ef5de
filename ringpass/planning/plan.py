"""`ringpass plan`: whether the ring pays for an attention on given hardware, predicted by `lowering.costmodel`.

    ringpass plan --world-size 8 --seq-len 131072 --heads 32 --kv-heads 8 --head-dim 128 --link nvlink --device h100

From the attention's shape, the world size and the hardware (a link preset or ``--bandwidth`` /
``--latency``; a device preset or ``--tflops``), `make_plan` predicts each ring step's compute and
transfer, whether the transfer hides behind the compute, the fewest tokens per rank at which it would,
per-rank attention memory against one device, and the all-gather alternative's time; then recommends the
ring (with its layout) where its transfers hide, else the most ranks at which they would (or no sequence
parallelism), and for decode — one query per step — no ring at all.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowering.costmodel import (
    AttentionShape,
    DecodeCost,
    Hardware,
    Prediction,
    all_gather_seconds,
    decode_seconds,
    hiding_slice,
    predict,
    ring_cost,
    ulysses_seconds,
)
from lowering.errors import InvalidInputError
from lowering.layout import Layout


@dataclass
class Plan:
    world_size: int
    seq_len: int
    layout: str
    shape: AttentionShape
    hardware: Hardware
    prediction: Prediction
    all_gather_forward_s: float
    hiding_tokens: int
    memory: dict
    memory_unsharded: dict
    recommendation: str
    decode: dict | None = None  # with decode: seconds of one decode attention, cache sharded / whole
    ulysses: dict | None = None  # with ulysses=U: `lowering.costmodel.ulysses_seconds` and U

    def as_dict(self) -> dict:
        p = self.prediction
        return {
            "world_size": self.world_size,
            "seq_len": self.seq_len,
            "layout": self.layout,
            "shape": vars(self.shape),
            "hardware": vars(self.hardware),
            "forward_s": p.forward_s,
            "backward_s": p.backward_s,
            "hides": p.hides,
            "compute_forward_s": p.compute_forward,
            "transfer_forward_s": p.transfer_forward,
            "compute_backward_s": p.compute_backward,
            "transfer_backward_s": p.transfer_backward,
            "all_gather_forward_s": self.all_gather_forward_s,
            "hiding_tokens_per_rank": self.hiding_tokens,
            "memory_per_rank": self.memory,
            "memory_unsharded": self.memory_unsharded,
            "recommendation": self.recommendation,
            "decode_s": self.decode,
            "ulysses": self.ulysses,
        }

    def __str__(self) -> str:
        p, local = self.prediction, Layout(self.layout, self.world_size, self.seq_len).local_len
        h = self.hardware
        lines = [
            f"ringpass plan: {self.world_size} ranks, sequence {self.seq_len} "
            f"({local} tokens per rank, {self.layout}), "
            f"{self.shape.query_heads} query / {self.shape.kv_heads} KV heads, head dim {self.shape.head_dim}, "
            f"batch {self.shape.batch}, {self.shape.itemsize} bytes per element, "
            f"{'causal' if self.shape.is_causal else 'bidirectional'}",
            f"  hardware: link {h.link} ({h.link_bytes_per_s / 1e9:g} GB/s, "
            f"{h.link_latency_s * 1e6:g} us per message), "
            f"device {h.device} ({h.flops_per_s / 1e12:g} TFLOP/s for attention)",
            f"  per step (busiest rank): compute {_ms(p.compute_forward)} ms forward, {_ms(p.compute_backward)} ms "
            f"backward; transfer {p.transfer_forward * 1e3:.3g} ms forward, "
            f"{p.transfer_backward * 1e3:.3g} ms backward",
            f"  transfer hidden behind compute: {'yes' if p.hides else 'no'} "
            f"(it hides from {self.hiding_tokens} tokens per rank)",
            f"  ring: {p.forward_s * 1e3:.3g} ms forward, {p.backward_s * 1e3:.3g} ms backward; all-gather of K/V: "
            f"{self.all_gather_forward_s * 1e3:.3g} ms forward",
            f"  attention memory per rank: {_mib(self.memory['forward'])} forward / {_mib(self.memory['backward'])} "
            f"backward, vs {_mib(self.memory_unsharded['forward'])} / {_mib(self.memory_unsharded['backward'])} on one "
            "device",
            f"  recommendation: {self.recommendation}",
        ]
        if self.ulysses:
            u = self.ulysses
            lines.insert(
                -1,
                f"  Ulysses x ring (groups of {u['ulysses']} over {u['link']}, the ring over "
                f"{self.world_size // u['ulysses']} groups): {u['forward'] * 1e3:.3g} ms forward "
                f"({u['all_to_all_forward'] * 1e3:.3g} ms all-to-all), {u['backward'] * 1e3:.3g} ms backward; "
                f"ring transfers hidden: {'yes' if u['hides'] else 'no'}",
            )
        return "\n".join(lines)


def make_plan(
    shape: AttentionShape,
    world_size: int,
    seq_len: int,
    hw: Hardware,
    *,
    decode: bool = False,
    layout: str = "auto",
    ulysses: int | None = None,
    ulysses_link: Hardware | None = None,
) -> Plan:
    """Predict the ring for ``shape`` over ``world_size`` ranks on ``hw`` and recommend (module docstring)."""
    if world_size < 1 or seq_len < 1:
        raise InvalidInputError(f"plan: world size and sequence length must be positive, got {world_size}, {seq_len}.")
    layout = ("zigzag" if shape.is_causal else "contiguous") if layout == "auto" else layout
    cost = ring_cost(Layout(layout, world_size, seq_len), shape)
    prediction = predict(cost, hw)
    gather = all_gather_seconds(cost, hw)
    tokens = hiding_slice(shape, hw)
    decode_times = None
    if decode:
        sharded = decode_seconds(DecodeCost(shape, seq_len, world_size), hw)
        whole = decode_seconds(DecodeCost(shape, seq_len, 1), hw)
        decode_times = {"sharded": sharded, "whole": whole}
        advice = (
            "no ring: a decode step has one query per sequence, so each hop moves a whole KV block for almost "
            "no compute. Keep the KV cache sharded where it is (ringpass.ShardedCache) and merge each rank's "
            f"partial (out, LSE) in one small all-gather: predicted {sharded['total'] * 1e3:.3g} ms per "
            f"attention ({sharded['compute'] * 1e3:.3g} ms reading 1/{world_size} of the cache, "
            f"{sharded['merge'] * 1e3:.3g} ms merging) against {whole['total'] * 1e3:.3g} ms with the whole cache "
            "on one device (or gathered onto every rank)."
        )
    elif world_size == 1:
        advice = "one rank: no sequence parallelism."
    elif prediction.hides:
        advice = (
            f"ring, layout {layout}: its transfers hide behind compute and it holds 1/{world_size} of the sequence."
        )
    else:
        fits = seq_len // tokens  # ranks at which each still holds a slice that hides its hop
        advice = (
            f"the ring's transfers do not hide ({prediction.transfer_forward * 1e3:.3g} ms per hop vs "
            f"{min(prediction.compute_forward) * 1e3:.3g} ms of compute); they hide from {tokens} tokens per rank. "
            + (
                f"Use at most {fits} ranks for this length, or a faster link. "
                if fits >= 2
                else "No sequence parallelism pays on time here: use the ring only if the sequence does not fit one "
                f"device (it then holds 1/{world_size} of it). "
            )
            + f"Gathering K/V instead (predicted {gather * 1e3:.3g} ms forward) moves the same bytes without "
            "hiding them and holds the whole K/V on every rank."
        )
    two_d = None
    if ulysses and ulysses > 1:
        if world_size % ulysses:
            raise InvalidInputError(f"plan: --ulysses {ulysses} does not divide --world-size {world_size}.")
        two_d = {
            "ulysses": ulysses,
            "link": ulysses_link.link,
            **ulysses_seconds(shape, Layout(layout, world_size, seq_len), ulysses, hw, ulysses_link),
        }
        two_d_s, ring_s = two_d["forward"] + two_d["backward"], prediction.forward_s + prediction.backward_s
        advice += (
            f" Ulysses x ring (groups of {ulysses}) is predicted {'faster' if two_d_s < ring_s else 'slower'}: "
            f"{two_d_s * 1e3:.3g} ms vs {ring_s * 1e3:.3g} ms forward + backward."
        )
    return Plan(
        world_size,
        seq_len,
        layout,
        shape,
        hw,
        prediction,
        gather,
        tokens,
        cost.memory(),
        cost.memory(unsharded=True),
        advice,
        decode_times,
        two_d,
    )


def _ms(seconds: list[float]) -> str:
    low, high = f"{min(seconds) * 1e3:.3g}", f"{max(seconds) * 1e3:.3g}"
    return low if low == high else f"{low}..{high}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
