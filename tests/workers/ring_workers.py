"""What each rank runs in the multi-process tests (a module of its own so spawned ranks can import it).

Every worker returns plain numbers; the tests in test_ring_distributed.py assert on them.
"""

from __future__ import annotations

import os
import time
import zlib
from dataclasses import dataclass
from unittest.mock import patch

import torch
import torch.distributed as dist
import torch.nn.functional as F
from reference import lse_fp64, rel_err

import lowering.masks
from lowering import DocumentLayout, InvalidInputError, Layout, RingpassError, record_ring_events, ring_attention
from lowering.masks import register_mask
from lowering.ring_args import RingArgs

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Case:
    kind: str
    causal: bool
    dtype: str
    seq_len: int
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 16
    batch: int = 2
    lse_grad: bool = False

    @property
    def name(self) -> str:
        mask = "causal" if self.causal else "bidir"
        extra = "-lse_grad" if self.lse_grad else ""
        return f"{self.kind}-{mask}-{self.dtype}-N{self.seq_len}-H{self.heads}/{self.kv_heads}-D{self.head_dim}{extra}"


def cases(world_size: int) -> list[Case]:
    awkward = 2 * world_size * 8 + 3  # divides by neither P nor 2P
    found = [
        Case(kind, causal, dtype, awkward)
        for kind in ("contiguous", "zigzag")
        for causal in (False, True)
        for dtype in ("float64", "float32")
    ]
    found += [
        Case("zigzag", True, "float64", awkward, heads=4, kv_heads=1),  # MQA
        Case("contiguous", True, "float64", awkward, heads=5, kv_heads=5, head_dim=8),  # 5 heads, D=8
        Case("zigzag", False, "float32", awkward, heads=4, kv_heads=4, head_dim=96),  # D=96
        Case("zigzag", True, "float64", awkward, lse_grad=True),
        Case("zigzag", True, "bfloat16", 4 * world_size * 16, heads=4, kv_heads=4, head_dim=64, batch=1),
    ]
    if world_size == 3:
        found.append(Case("zigzag", True, "float64", 1000, heads=4, kv_heads=2))
    if world_size == 4:
        found += [
            Case("zigzag", True, "float64", 999, heads=4, kv_heads=2),
            Case("contiguous", True, "float32", 999, heads=4, kv_heads=2),
        ]
    return found


def _broadcast_inputs(case: Case, rank: int):
    shapes = [
        (case.batch, h, case.seq_len, case.head_dim) for h in (case.heads, case.kv_heads, case.kv_heads, case.heads)
    ]
    shapes.append((case.batch, case.heads, case.seq_len))
    if rank == 0:
        generator = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
        tensors = [torch.randn(s, generator=generator, dtype=torch.float64) for s in shapes]
    else:
        tensors = [torch.empty(s, dtype=torch.float64) for s in shapes]
    for t in tensors:
        dist.broadcast(t, 0)
    return tensors


def run_case(case: Case, rank: int, world_size: int) -> dict:
    """Ring vs unsharded fp64 attention on this rank's rows: relative errors, and event counts."""
    q, k, v, dout, dlse = _broadcast_inputs(case, rank)
    layout = Layout(case.kind, world_size, case.seq_len)

    # reference: unsharded fp64, gradients of sum(out * dout) [+ sum(lse * dlse)]
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = F.scaled_dot_product_attention(*ref, is_causal=case.causal, enable_gqa=True)
    with torch.set_grad_enabled(case.lse_grad):
        ref_lse = lse_fp64(ref[0], ref[1], is_causal=case.causal)
    ref_loss = (ref_out * dout).sum()
    if case.lse_grad:
        ref_loss = ref_loss + (ref_lse * dlse).sum()
    ref_loss.backward()

    # the ring, on this rank's shards in the working dtype
    dtype = DTYPES[case.dtype]
    local = [layout.shard(t, 2, rank).to(dtype).requires_grad_() for t in (q, k, v)]
    real = layout.positions(rank) < case.seq_len
    with record_ring_events() as forward_events:
        out, lse = ring_attention(*local, layout=layout, is_causal=case.causal, return_lse=True)
    loss = (out * layout.shard(dout, 2, rank).to(dtype)).sum()
    if case.lse_grad:
        loss = loss + (lse.masked_fill(~real, 0) * layout.shard(dlse, 2, rank)).sum()
    with record_ring_events() as backward_events:
        loss.backward()

    def mine(t):
        return layout.shard(t, 2, rank)[:, :, real]

    errors = {
        "out": rel_err(out[:, :, real], mine(ref_out)),
        "lse": rel_err(lse[:, :, real], mine(ref_lse)),
        "dq": rel_err(local[0].grad[:, :, real], mine(ref[0].grad)),
        "dk": rel_err(local[1].grad[:, :, real], mine(ref[1].grad)),
        "dv": rel_err(local[2].grad[:, :, real], mine(ref[2].grad)),
    }
    result = {
        "errors": errors,
        "dtypes": (str(out.dtype), str(lse.dtype)),
        "padding_ok": bool((out[:, :, ~real] == 0).all() and torch.isneginf(lse[:, :, ~real]).all()),
        "finite": all(bool(t.isfinite().all()) for t in (out, local[0].grad, local[1].grad, local[2].grad)),
        "forward": _count(forward_events, case, layout),
        "backward": _count(backward_events, case, layout),
    }
    if case.dtype == "bfloat16":  # the same attention unsharded in bf16, for a relative bound
        low = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        unsharded = F.scaled_dot_product_attention(*low, is_causal=case.causal, enable_gqa=True)
        (unsharded * dout.to(dtype)).sum().backward()
        result["unsharded_errors"] = {
            name: rel_err(mine(got), mine(want))
            for name, got, want in zip(
                ("out", "dq", "dk", "dv"), (unsharded, *(t.grad for t in low)), (ref_out, *(t.grad for t in ref))
            )
        }
    return result


def _count(events, case: Case, layout: Layout) -> dict:
    counts = {"kv": 0, "dkv": 0, "blocks": 0, "masked_blocks": 0}
    for event in events:
        if event.kind == "exchange":
            counts[event.fields["payload"]] += 1
        elif event.kind.startswith("block_"):
            counts["blocks"] += 1
            q_pos, kv_pos = event.fields["q_pos"], event.fields["kv_pos"]
            visible = (q_pos[:, None] < case.seq_len) & (kv_pos[None, :] < case.seq_len)
            if case.causal:
                visible &= kv_pos[None, :] <= q_pos[:, None]
            counts["masked_blocks"] += int(not visible.any())
    return counts


def run_cases(rank: int, world_size: int, selected: list[Case]) -> dict:
    return {case.name: run_case(case, rank, world_size) for case in selected}


def all_cases(rank: int, world_size: int) -> dict:
    return run_cases(rank, world_size, cases(world_size))


def wrong_world_size(rank: int, world_size: int) -> str:
    """A layout for one more rank than the group has: every rank must refuse before communicating."""
    layout = Layout("zigzag", world_size + 1, 64)
    q = torch.randn(1, 2, layout.local_len, 8)
    try:
        ring_attention(q, q, q, layout=layout)
    except InvalidInputError as error:
        return str(error)
    return "no error"


def one_rank_dies(rank: int, world_size: int) -> None:
    """Rank 1 dies before the ring starts; the others wait in the ring for blocks that never come. (After a barrier:
    gloo may still be connecting rank 0's mesh when rank 1's init returns, and would fail there instead.)"""
    dist.barrier()
    if rank == 1:
        os._exit(3)
    layout = Layout("zigzag", world_size, 64)
    q = torch.randn(1, 2, layout.local_len, 8)
    ring_attention(q, q, q, layout=layout, is_causal=True)


def one_rank_hangs(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(600)


def bucket_bias(q_pos, kv_pos, table):
    """A learned table of relative-position buckets per head (a T5-style bias program)."""
    return table[(kv_pos[None, :] - q_pos[:, None]).clamp(-4, 3) + 4].permute(2, 0, 1)[None]


def opcheck_on_ranks(rank: int, world_size: int) -> dict:
    """torch.library.opcheck of both ring ops on a real group, contiguous and non-contiguous inputs."""
    layout = Layout("zigzag", world_size, 40)
    n = layout.local_len
    torch.manual_seed(0)  # every rank must run the same checks in the same order
    results = {}
    for name, (q, k, v) in {
        "contiguous": [torch.randn(2, h, n, 8, dtype=torch.float64) for h in (4, 2, 2)],
        "non-contiguous": [torch.randn(2, n, h, 8, dtype=torch.float64).transpose(1, 2) for h in (4, 2, 2)],
    }.items():
        config = RingArgs("zigzag", world_size, 40, True, 0.35, dist.group.WORLD.group_name)
        args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), *config.op_args())
        checks = torch.library.opcheck(torch.ops.ringpass.ring_attention.default, args)
        out, lse = torch.ops.ringpass.ring_attention(*args)
        tensors = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), None)
        checks.update(
            torch.library.opcheck(
                torch.ops.ringpass.ring_attention_backward.default,
                (*tensors, *config.op_args(), []),
                test_utils=("test_schema", "test_faketensor"),
            )
        )
        # a trained bias program's input: its gradient is the backward op's fourth result
        table = torch.randn(8, 4, dtype=torch.float64)
        trained = config._replace(bias_id=register_mask(bucket_bias, source="opcheck bucket bias"), bias_inputs=[table])
        checks.update(
            {
                f"trained {check}": result
                for check, result in torch.library.opcheck(
                    torch.ops.ringpass.ring_attention_backward.default,
                    (*tensors, *trained.op_args(), [0]),
                    test_utils=("test_schema", "test_faketensor"),
                ).items()
            }
        )
        results[name] = checks
    return results


def compiled_call(rank: int, world_size: int) -> dict:
    """ring_attention inside torch.compile(fullgraph=True): same numbers as eager, one ring op in the graph."""
    layout = Layout("zigzag", world_size, 48)
    torch.manual_seed(0)
    q, k, v = (layout.shard(torch.randn(1, 4, 48, 8, dtype=torch.float64), 2, rank).requires_grad_() for _ in range(3))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(q, k, v):
        return ring_attention(q.sin(), k, v, layout=layout, is_causal=True) * 2

    eager = f(q, k, v)
    eager.sum().backward()
    expected = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    compiled = torch.compile(f, backend=backend, fullgraph=True)(q, k, v)
    compiled.sum().backward()
    ops = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    ring_op = torch.ops.ringpass.ring_attention
    return {
        "out": rel_err(compiled, eager),
        "grads": max(rel_err(t.grad, e) for t, e in zip((q, k, v), expected)),
        "ring_ops": sum(1 for t in ops if t in (ring_op, ring_op.default)),
    }


def rings_on_subgroups(rank: int, world_size: int) -> float:
    """Two independent 2-rank rings ({0, 1} and {2, 3}), each on its own data: the ring on a sub-group."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group, replica, ring_rank = groups[rank // 2], rank // 2, rank % 2
    layout = Layout("zigzag", 2, 30)
    generator = torch.Generator().manual_seed(replica)
    q, k, v = (torch.randn(1, 4, 30, 8, dtype=torch.float64, generator=generator) for _ in range(3))
    out = ring_attention(
        *(layout.shard(t, 2, ring_rank) for t in (q, k, v)), layout=layout, is_causal=True, group=group
    )
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return rel_err(out, layout.shard(expected, 2, ring_rank))


def _left_padded(q_pos, kv_pos, keep):
    return keep[:, kv_pos][:, None, None, :] & (kv_pos[None, :] <= q_pos[:, None])[None, None]


def fully_masked_on_ranks(rank: int, world_size: int) -> dict:
    """Left-padded queries (no visible key) through ring_attention on real ranks, for each fully_masked
    mode, against fp64 attention hiding keys as the mode's model does: out, dq, dk, dv of this rank's rows."""
    from reference import masked_attention_fp64

    seq_len = 4 * world_size + 5
    layout = Layout("zigzag", world_size, seq_len)
    generator = torch.Generator().manual_seed(3)  # every rank draws the same full tensors
    q, k, v = (torch.randn(2, h, seq_len, 8, dtype=torch.float64, generator=generator) for h in (4, 2, 2))
    dout = torch.randn(2, 4, seq_len, 8, dtype=torch.float64, generator=generator)
    keep = torch.ones(2, seq_len, dtype=torch.bool)
    keep[0, :6] = False
    pos, real = torch.arange(seq_len), layout.positions(rank) < seq_len
    errors = {}
    for mode in ("zero", "uniform", "uniform_values"):
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = masked_attention_fp64(*ref, _left_padded(pos, pos, keep), fully_masked=mode)
        (expected * dout).sum().backward()
        local = [layout.shard(t, 2, rank).requires_grad_() for t in (q, k, v)]
        out = ring_attention(
            *local, layout=layout, is_causal=True, mask=_left_padded, mask_inputs=[keep], fully_masked=mode
        )
        (out * layout.shard(dout, 2, rank)).sum().backward()
        errors[mode] = max(
            rel_err(got[:, :, real], layout.shard(want, 2, rank)[:, :, real])
            for got, want in zip((out, *(t.grad for t in local)), (expected, *(t.grad for t in ref)))
        )
    return errors


def documents_on_ranks(
    rank: int, world_size: int, balanced: bool, lengths: tuple = (1, 7, 155, 178), strategy: str = "ring"
) -> dict:
    """Two rows packed from documents (of ``lengths``; the other row of 3, 160 and 178, or with ``balanced`` packed
    alike on a `DocumentLayout`), else zigzag, causal inside each document, through ``ring_attention(documents=ids,
    strategy=strategy)`` on real ranks: out, dq, dk, dv of this rank's rows against fp64 attention under the dense
    documents mask, the tiles the documents let the ring skip (tiles of 16: a tile is skipped where neither row's
    documents meet), the exchanges this rank sent, the bytes it did not send (blocks no later rank needs) and the
    all-gathers it waited for."""
    from reference import masked_attention_fp64

    seq_len, packings = sum(lengths), (lengths, lengths if balanced else (3, 160, 178))
    layout = DocumentLayout(packings[0], world_size) if balanced else Layout("zigzag", world_size, seq_len)
    generator = torch.Generator().manual_seed(5)  # every rank draws the same full tensors
    q, k, v = (torch.randn(2, h, seq_len, 8, dtype=torch.float64, generator=generator) for h in (4, 2, 2))
    dout = torch.randn(2, 4, seq_len, 8, dtype=torch.float64, generator=generator)
    ids = torch.stack([DocumentLayout(lengths, 1).document_ids() for lengths in packings])
    pos, real = torch.arange(seq_len), layout.positions(rank) < seq_len
    visible = (ids[:, :, None] == ids[:, None, :])[:, None] & (pos[None, :] <= pos[:, None])
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = masked_attention_fp64(*ref, visible)
    (expected * dout).sum().backward()
    local = [layout.shard(t, 2, rank).requires_grad_() for t in (q, k, v)]
    with patch.object(lowering.masks, "MASK_TILE", 16), record_ring_events() as events:
        out = ring_attention(*local, layout=layout, is_causal=True, documents=ids, strategy=strategy)
        (out * layout.shard(dout, 2, rank)).sum().backward()
    error = max(
        rel_err(got[:, :, real], layout.shard(want, 2, rank)[:, :, real])
        for got, want in zip((out, *(t.grad for t in local)), (expected, *(t.grad for t in ref)))
    )
    skipped = sum(e.fields["pairs"] for e in events if e.kind == "document_skip")
    sends = [e.fields["payload"] for e in events if e.kind == "exchange"]
    unsent = sum(e.fields["bytes"] for e in events if e.kind == "send_skip")
    gathers = sum(e.kind == "span" and e.fields["message"] == "kv all-gather" for e in events)
    return {"error": error, "skipped": skipped, "sends": sends, "unsent_bytes": unsent, "gathers": gathers}


def profiled_ring(rank: int, world_size: int) -> list:
    """The profiler ranges one causal ring forward and backward records on this rank (names, in order)."""
    layout = Layout("zigzag", world_size, 32)
    q, k, v = (
        torch.randn(1, 2, layout.local_len, 8, generator=torch.Generator().manual_seed(rank + i)).requires_grad_()
        for i in range(3)
    )
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        ring_attention(q, k, v, layout=layout, is_causal=True).sum().backward()
    return [e.name for e in profiler.events() if e.name.startswith("ringpass ")]


def disagreeing_layouts(rank: int, world_size: int) -> dict:
    """Rank 0 passes a layout of 192 tokens, the others one of 96 (twice as long shards on rank 0): every rank
    must refuse before the ring's traffic. Then calls that agree: each new (layout, options, shapes) is agreed
    on once (agreements counted), the rest cost nothing, and the numbers are the unsharded fp64 attention's."""
    from lowering import failures

    agreements = []
    agree = failures.agree

    def counted(group_name, topic, mine, describe):
        agreements.append(mine["layout"])
        agree(group_name, topic, mine, describe)

    failures.agree = counted  # agree_once looks it up at each call
    layout = Layout("zigzag", world_size, 192 if rank == 0 else 96)
    q = torch.randn(1, 2, layout.local_len, 8, dtype=torch.float64)
    try:
        ring_attention(q, q, q, layout=layout, is_causal=True)
        refused = "no error"
    except RingpassError as error:
        refused = f"{type(error).__name__}: {error}"
    errors = []
    for seq_len in (96, 96, 40, 96, 40):
        layout = Layout("zigzag", world_size, seq_len)
        generator = torch.Generator().manual_seed(seq_len)  # every rank draws the same full tensors
        full = [torch.randn(1, h, seq_len, 8, dtype=torch.float64, generator=generator) for h in (4, 2, 2)]
        out = ring_attention(*(layout.shard(t, 2, rank) for t in full), layout=layout, is_causal=True)
        expected = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
        real = layout.positions(rank) < seq_len
        errors.append(rel_err(out[:, :, real], layout.shard(expected, 2, rank)[:, :, real]))
    return {"refused": refused, "agreements": agreements, "errors": errors}


def disagreeing_strategies(rank: int, world_size: int) -> dict:
    """``ring_attention(strategy="all-gather")`` and `ulysses_attention` by hand (Ulysses over all the ranks, a ring
    of one group): rank 0 passes a 192-token layout, the others a 96-token one, and every rank must refuse before any
    collective; then a call that agrees gives the unsharded fp64 attention."""
    from torch.distributed.device_mesh import init_device_mesh

    from lowering import ulysses_attention

    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("ring", "ulysses"))
    calls = {
        "ring_attention": lambda q, k, v, layout: ring_attention(
            q, k, v, layout=layout, is_causal=True, strategy="all-gather"
        ),
        "ulysses_attention": lambda q, k, v, layout: ulysses_attention(
            q,
            k,
            v,
            layout=layout,
            ring_group=mesh["ring"].get_group(),
            ulysses_group=mesh["ulysses"].get_group(),
            is_causal=True,
        ),
    }
    results = {}
    for name, call in calls.items():
        layout = Layout("zigzag", world_size, 192 if rank == 0 else 96)
        q = torch.randn(1, 2 * world_size, layout.local_len, 8, dtype=torch.float64)
        try:
            call(q, q, q, layout)
            refused = "no error"
        except RingpassError as error:
            refused = f"{type(error).__name__}: {error}"
        layout = Layout("zigzag", world_size, 48)
        generator = torch.Generator().manual_seed(48)
        full = [torch.randn(1, 2 * world_size, 48, 8, dtype=torch.float64, generator=generator) for _ in range(3)]
        out = call(*(layout.shard(t, 2, rank) for t in full), layout)
        expected = F.scaled_dot_product_attention(*full, is_causal=True)
        results[name] = {"refused": refused, "error": rel_err(out, layout.shard(expected, 2, rank))}
    return results
