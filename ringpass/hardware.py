"""What the cost model predicts on: `Hardware` from presets (`lowering.costmodel.LINKS`, `DEVICES`, ...), numbers, a
``ringpass bench --calibrate --json FILE`` file, or the backend's ``hardware`` option. ``ringpass plan``, ``ringpass
bench`` and ``strategy="auto"`` read it from here."""

from __future__ import annotations

import json

import torch

from lowering.costmodel import DEVICES, LINKS, MEMORY, OTHER_WORK, Hardware
from lowering.errors import InvalidInputError


def hardware_option(value) -> Hardware:
    """The ``hardware`` option: None (this machine's kind: NVLink + H100 with CUDA, else loopback + CPU), a
    `Hardware`, ``"link/device"`` preset names, or a calibration file's path."""
    if isinstance(value, Hardware):
        return value
    if value is None:
        return hardware("nvlink", "h100") if torch.cuda.is_available() else hardware("loopback", "cpu")
    if isinstance(value, str) and "/" in value and value.split("/")[0] in LINKS:
        link, device = value.split("/", 1)
        return hardware(link, device)
    if isinstance(value, str):
        return load_hardware(value)
    raise InvalidInputError(
        f"hardware={value!r}: give 'link/device' preset names ({', '.join(LINKS)} / {', '.join(DEVICES)}), a "
        "`ringpass bench --calibrate --json` file or a lowering.costmodel.Hardware."
    )


def hardware(
    link: str | None = None,
    device: str | None = None,
    *,
    bandwidth_gb_s: float | None = None,
    latency_us: float | None = None,
    tflops: float | None = None,
) -> Hardware:
    """`Hardware` from presets (`lowering.costmodel.LINKS`, `DEVICES`), numbers overriding them."""
    if link is not None and link not in LINKS:
        raise InvalidInputError(
            f"plan: link {link!r} is not one of {', '.join(LINKS)}; or give --bandwidth and --latency."
        )
    if device is not None and device not in DEVICES:
        raise InvalidInputError(f"plan: device {device!r} is not one of {', '.join(DEVICES)}; or give --tflops.")
    if link is None and (bandwidth_gb_s is None or latency_us is None):
        raise InvalidInputError("plan: give --link (" + ", ".join(LINKS) + ") or both --bandwidth and --latency.")
    if device is None and tflops is None:
        raise InvalidInputError("plan: give --device (" + ", ".join(DEVICES) + ") or --tflops.")
    bandwidth, latency, _ = LINKS[link] if link else (None, None, None)
    rate = DEVICES[device][0] if device else None
    preset = device if tflops is None else None  # the device's other rates hold only for its own FLOP rate
    return Hardware(
        link_bytes_per_s=bandwidth_gb_s * 1e9 if bandwidth_gb_s is not None else bandwidth,
        link_latency_s=latency_us * 1e-6 if latency_us is not None else latency,
        flops_per_s=tflops * 1e12 if tflops is not None else rate,
        link=link or "custom",
        device=device or "custom",
        memory_bytes_per_s=MEMORY[preset][0] if preset else None,
        gemm_flops_per_s=OTHER_WORK[preset][0] if preset else None,
        op_overhead_s=OTHER_WORK[preset][1] if preset else 0.0,
    )


def default_hardware() -> Hardware:
    """This machine's presets: gloo on loopback and the CPU's measured rates."""
    return hardware("loopback", "cpu")


def load_hardware(path: str) -> Hardware:
    """`Hardware` from a ``ringpass bench --calibrate --json FILE`` file."""
    try:
        with open(path) as f:
            data = json.load(f)
        return Hardware(
            float(data["link_bytes_per_s"]),
            float(data["link_latency_s"]),
            float(data["flops_per_s"]),
            link=str(data.get("link", "calibrated")),
            device=str(data.get("device", "calibrated")),
            memory_bytes_per_s=_optional(data.get("memory_bytes_per_s")),
            gemm_flops_per_s=_optional(data.get("gemm_flops_per_s")),
            op_overhead_s=float(data.get("op_overhead_s", 0.0)),
            sdpa_flops_per_s=_optional(data.get("sdpa_flops_per_s")),
            head_dim_rates=tuple(
                (int(r["head_dim"]), float(r["flops_per_s"]), float(r["sdpa_flops_per_s"]))
                for r in data.get("head_dim_rates", ())
            ),
        )
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise InvalidInputError(
            f"--hardware {path!r}: not a calibration file written by `ringpass bench --calibrate "
            f"--json FILE` ({type(error).__name__}: {error})."
        ) from None


def _optional(value) -> float | None:
    return None if value is None else float(value)
