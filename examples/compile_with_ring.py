"""One training step of a small GPT, compiled with the ring backend, against the same model unsharded.

    torchrun --standalone --nproc-per-node 2 examples/compile_with_ring.py

Every rank builds the same model and batch (same seed), compiles it with ``backend="ring"`` and takes
one step; the loss and the gradients equal those of the model run whole on one process.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import ringpass


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.norm1, self.norm2 = heads, nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(self.norm1(x)).split(d, -1))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab=256, dim=64, heads=4, layers=2, max_len=4096):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(dim)

    def forward(self, ids, labels):
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        logits = self.norm(self.blocks(x)) @ self.tokens.weight.T
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = GPT()
    ids = torch.randint(0, 256, (2, 1000))
    labels = torch.roll(ids, -1, dims=1)

    expected = model(ids, labels)  # the whole sequence, one process
    expected.backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    loss = torch.compile(model, backend="ring", options={"compiler": "aot_eager"})(ids, labels)
    loss.backward()
    grad_error = max(
        ((p.grad - g).abs().max() / g.abs().max()).item() for p, g in zip(model.parameters(), expected_grads)
    )
    if dist.get_rank() == 0:
        print(ringpass.last_report())
        print(f"loss {loss.item():.6f} (unsharded {expected.item():.6f}), max relative gradient error {grad_error:.1e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
