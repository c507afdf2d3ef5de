"""``ringpass demo``: ring attention on P CPU processes against unsharded SDPA.

Every rank gets the same full q/k/v (broadcast from rank 0), takes its shard with the layout, and runs
`lowering.ring_attention` forward and backward. Rank 0 gathers the shards, runs
``F.scaled_dot_product_attention`` on the whole sequence in one process, and the demo prints the error
of both against an fp64 reference, the wall time of each, and per-rank memory.
"""

from __future__ import annotations

import resource
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

import lowering
from ringpass.cli.launch import spawn_ranks

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class DemoConfig:
    world_size: int = 2
    batch: int = 1
    heads: int = 8
    kv_heads: int = 2
    seq_len: int = 4096
    head_dim: int = 64
    dtype: str = "float32"
    causal: bool = True
    layout: str = "auto"
    seed: int = 0

    @property
    def layout_kind(self) -> str:
        if self.layout != "auto":
            return self.layout
        return "zigzag" if self.causal else "contiguous"


def run_demo(config: DemoConfig, timeout: float = 600.0) -> dict:
    """Run the demo and return rank 0's report (see `format_report`)."""
    return spawn_ranks(_demo_rank, config.world_size, (config,), timeout=timeout)[0]


def _full_inputs(config: DemoConfig):
    generator = torch.Generator().manual_seed(config.seed)

    def rand(heads):
        return torch.randn(
            config.batch, heads, config.seq_len, config.head_dim, generator=generator, dtype=torch.float64
        )

    return rand(config.heads), rand(config.kv_heads), rand(config.kv_heads), rand(config.heads)


def _demo_rank(rank: int, world_size: int, config: DemoConfig) -> dict:
    dtype = DTYPES[config.dtype]
    q, k, v, dout = _full_inputs(config) if rank == 0 else (None,) * 4
    q, k, v, dout = _broadcast(rank, config, q, k, v, dout)
    layout = lowering.Layout(config.layout_kind, world_size, config.seq_len)
    local = [layout.shard(t, 2, rank).to(dtype).requires_grad_(t is not dout) for t in (q, k, v, dout)]
    lq, lk, lv, ldout = local

    def ring_step():
        out = lowering.ring_attention(lq, lk, lv, layout=layout, is_causal=config.causal)
        forward_s = time.perf_counter() - start
        out.backward(ldout.detach())
        return out, forward_s

    start = time.perf_counter()
    ring_step()  # warm-up: first calls pay for lazy initialisation and gloo connections
    for t in local[:3]:
        t.grad = None
    dist.barrier()
    start = time.perf_counter()
    out, forward_s = ring_step()
    ring = {"forward_s": forward_s, "total_s": time.perf_counter() - start, "peak_rss_mib": _peak_rss_mib()}

    shards = {
        name: _gather(t, world_size)
        for name, t in (("out", out.detach()), ("dq", lq.grad), ("dk", lk.grad), ("dv", lv.grad))
    }
    per_rank = [None] * world_size
    dist.all_gather_object(per_rank, ring)
    if rank != 0:
        return {}
    full_ring = {name: layout.unshard(s, 2).double() for name, s in shards.items()}
    report = {"config": asdict(config), "layout": layout.kind, "ranks": per_rank, "threads": torch.get_num_threads()}
    report["sdpa"], sdpa_results = _time_sdpa(config, dtype, q, k, v, dout)
    reference = _reference(config, q, k, v, dout)
    report["ring_error"] = _errors(full_ring, reference)
    report["sdpa_error"] = _errors(sdpa_results, reference)
    report["bytes"] = _attention_bytes(config, layout, dtype)
    return report


def _broadcast(rank, config, *tensors):
    shapes = [
        (config.batch, h, config.seq_len, config.head_dim)
        for h in (config.heads, config.kv_heads, config.kv_heads, config.heads)
    ]
    out = []
    for t, shape in zip(tensors, shapes):
        t = t if rank == 0 else torch.empty(shape, dtype=torch.float64)
        dist.broadcast(t, 0)
        out.append(t)
    return out


def _gather(t: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(parts, t.contiguous())
    return parts


def _time_sdpa(config, dtype, q, k, v, dout):
    q, k, v = (t.to(dtype, copy=True).requires_grad_() for t in (q, k, v))
    for _ in range(2):  # the first run warms up
        q.grad = k.grad = v.grad = None
        start = time.perf_counter()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=config.causal, enable_gqa=True)
        forward_s = time.perf_counter() - start
        out.backward(dout.to(dtype))
        total_s = time.perf_counter() - start
    results = {"out": out.detach().double(), "dq": q.grad.double(), "dk": k.grad.double(), "dv": v.grad.double()}
    return {"forward_s": forward_s, "total_s": total_s}, results


def _reference(config, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=config.causal, enable_gqa=True)
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _errors(results, reference) -> dict:
    return {name: ((results[name] - ref).abs().max() / ref.abs().max()).item() for name, ref in reference.items()}


def _attention_bytes(config, layout, dtype) -> dict:
    """Bytes of attention inputs and outputs (q, k, v, out) per rank under the ring, and on one device."""
    item = torch.empty((), dtype=dtype).element_size()
    per_token = config.batch * config.head_dim * (2 * config.heads + 2 * config.kv_heads) * item
    kv_block = 2 * config.batch * config.kv_heads * layout.local_len * config.head_dim * item
    return {"ring_per_rank": per_token * layout.local_len + kv_block, "unsharded": per_token * config.seq_len}


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def format_report(report: dict) -> str:
    c = report["config"]
    mib = 1024 * 1024
    lines = [
        f"ringpass demo: {'causal' if c['causal'] else 'bidirectional'} attention, B={c['batch']} "
        f"Hq={c['heads']} Hkv={c['kv_heads']} N={c['seq_len']} D={c['head_dim']} {c['dtype']}, "
        f"{report['layout']} layout over {c['world_size']} CPU processes (gloo, {report['threads']} thread(s) each)",
        "",
        f"{'':28}{'forward':>10}{'fwd+bwd':>10}   max rel. error vs fp64 (out / dq / dk / dv)",
    ]
    slowest = max(report["ranks"], key=lambda r: r["total_s"])
    rows = [
        (f"ring, {c['world_size']} ranks (slowest)", slowest, report["ring_error"]),
        ("SDPA, unsharded, 1 process", report["sdpa"], report["sdpa_error"]),
    ]
    for name, t, err in rows:
        errors = " / ".join(f"{err[k]:.1e}" for k in ("out", "dq", "dk", "dv"))
        lines.append(f"{name:28}{t['forward_s']:>9.3f}s{t['total_s']:>9.3f}s   {errors}")
    lines += [
        "",
        f"attention q/k/v/out + one KV block in flight: {report['bytes']['ring_per_rank'] / mib:.1f} MiB per rank "
        f"(unsharded: {report['bytes']['unsharded'] / mib:.1f} MiB on one device)",
        "peak RSS per rank: "
        + ", ".join(f"rank {i} {r['peak_rss_mib']:.0f} MiB" for i, r in enumerate(report["ranks"]))
        + " (includes the torch runtime and the full inputs every rank received)",
    ]
    return "\n".join(lines)
