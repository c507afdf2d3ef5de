"""Convert a small Llama-style model once, save it, load it on every rank and train two steps.

    torchrun --standalone --nproc-per-node 2 examples/convert_and_run.py

Rank 0 converts (an offline step: `ringpass.convert` needs no process group, and `ringpass convert` does
the same from the command line) and saves the artifact; every rank then loads it with `ringpass.load`,
runs it as plain eager PyTorch (no torch.compile) and takes two SGD steps. The loss and the gradients of
each step equal those of the original model trained whole on one process.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import ringpass


class Block(nn.Module):
    """RMSNorm, rotary positions, grouped-query causal attention, a SwiGLU MLP."""

    def __init__(self, dim=64, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.q, self.kv = nn.Linear(dim, dim, bias=False), nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.gate, self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x, cos, sin):
        b, n, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(b, n, 2 * self.kv_heads, self.head_dim).transpose(1, 2).chunk(2, dim=1)
        q, k = (t * cos + rotate_half(t) * sin for t in (q, k))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, n, -1))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def rotate_half(t):
    first, second = t.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Llama(nn.Module):
    def __init__(self, vocab=256, dim=64, layers=2):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab, bias=False)
        self.blocks, self.norm = nn.ModuleList(Block(dim) for _ in range(layers)), nn.RMSNorm(dim)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 16, 2) / 16), persistent=False)

    def forward(self, input_ids, labels):
        angles = torch.arange(input_ids.shape[1], device=input_ids.device)[:, None] * self.inv_freq
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def main() -> None:
    torch.manual_seed(0)
    model = Llama()
    ids = torch.randint(0, 256, (2, 1000))
    batch = {"input_ids": ids, "labels": torch.roll(ids, -1, dims=1)}

    dist.init_process_group("gloo")
    path = os.path.join(tempfile.gettempdir(), f"ringpass-example-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}.pt2")
    if dist.get_rank() == 0:  # the offline step; any machine could do it, before the job starts
        converted = ringpass.convert(model, batch, world_size=dist.get_world_size())
        converted.save(path)
        print(converted.report.reports[0].summary())
    dist.barrier()

    loaded = ringpass.load(path)  # every rank: the saved graph and weights, run eagerly
    optimizer = torch.optim.SGD(loaded.parameters(), lr=0.1)
    expected_optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        expected = model(**batch)  # the whole sequence, one process
        expected.backward()
        loss = loaded(**batch)
        loss.backward()
        grad_error = max(
            ((p.grad - g.grad).abs().max() / g.grad.abs().max()).item()
            for p, g in zip(loaded.model.parameters(), model.parameters())
        )
        if dist.get_rank() == 0:
            print(
                f"step {step}: loss {loss.item():.6f} (unsharded {expected.item():.6f}), "
                f"max relative gradient error {grad_error:.2e}"
            )
        optimizer.step(), expected_optimizer.step()
        optimizer.zero_grad(), expected_optimizer.zero_grad()
    dist.barrier()
    if dist.get_rank() == 0:
        os.remove(path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
