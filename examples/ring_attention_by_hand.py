"""Shard a sequence by hand and run exact ring attention on it.

    torchrun --standalone --nproc-per-node 2 examples/ring_attention_by_hand.py

Each rank builds the same full q/k/v (same seed), keeps its zigzag shard, runs `lowering.ring_attention`
forward and backward, and checks its rows against unsharded SDPA. gloo on CPU, NCCL when CUDA is there.
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import lowering


def main() -> None:
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    )
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()

    batch, heads, kv_heads, seq_len, head_dim = 1, 8, 2, 2000, 64
    torch.manual_seed(0)
    q = torch.randn(batch, heads, seq_len, head_dim, device=device)
    k = torch.randn(batch, kv_heads, seq_len, head_dim, device=device)
    v = torch.randn(batch, kv_heads, seq_len, head_dim, device=device)

    layout = lowering.Layout("zigzag", world_size, seq_len)  # pads to a multiple of 2P when needed
    q_local, k_local, v_local = (layout.shard(t, 2, rank).requires_grad_() for t in (q, k, v))
    out_local = lowering.ring_attention(q_local, k_local, v_local, layout=layout, is_causal=True)
    out_local.sum().backward()

    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    real = layout.positions(rank) < seq_len  # padding slots hold zeros
    error = (out_local[:, :, real] - layout.shard(expected, 2, rank)[:, :, real]).abs().max().item()
    print(
        f"rank {rank}/{world_size}: {real.sum().item()} tokens, max |ring - sdpa| = {error:.2e}, "
        f"dq norm {q_local.grad.norm().item():.3f}"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
