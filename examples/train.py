"""Train with the ring: a recipe to copy (data x ring mesh, FSDP2, bf16, checkpointing, DCP save and resume).

    torchrun --standalone --nproc-per-node 4 examples/train.py --dp 2 --cp 2 --steps 4 --check
    torchrun --standalone --nproc-per-node 4 examples/train.py --dp 2 --cp 2 --steps 4 --resume   # continues

- A (dp, cp) DeviceMesh: the ring runs over ``cp``; the ranks of one ring read the same batch
  (`ringpass.RingSampler` over ``dp``), the data-parallel groups different ones.
- The model: a Hugging Face Llama from a config (``--model hf``) or the hand-written GPT of
  ``compile_with_ring.py`` (``--model gpt``), random weights; ``--checkpointing`` recomputes each block in the
  backward.
- FSDP2 on every block and on the root over all ranks (dp x cp flattened, as torchtitan does); the whole model
  compiled in place with ``backend="ring"`` over ``cp``: FSDP2's hooks break the graph at every block, and the
  activations cross those boundaries sequence-sharded; the logits stay sharded (``outputs="auto"``) and the
  loss is computed in the model. ``grads="auto"`` scales each rank's share for FSDP2's mean.
- ``--bf16``: autocast; AdamW; a DCP checkpoint (model and optimizer, sharded as they are) in ``--ckpt`` after
  the last step, and ``--resume`` loads it and goes on.
- ``--check``: the first step is compared with the unsharded model on the global batch (every data-parallel
  group's batch, one process): the loss and every gradient, printed as a verdict.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from compile_with_ring import GPT  # this folder's small GPT (the script's folder is on sys.path)
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint

import ringpass

VOCAB = 256


def build(kind: str, checkpointing: bool):
    """The model (same weights on every rank: same seed) and its blocks, each an FSDP2 unit."""
    torch.manual_seed(0)
    if kind == "hf":
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
        )
        model = transformers.LlamaForCausalLM(config)
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        return model, list(model.model.layers)
    model = GPT(vocab=VOCAB)
    if checkpointing:
        for block in model.blocks:
            block.forward = _checkpointed(block.forward)
    return model, list(model.blocks)


def _checkpointed(forward):
    return lambda x: checkpoint(forward, x, use_reentrant=False)


def loss_of(model, kind: str, ids, labels):
    if kind == "hf":
        return model(input_ids=ids, labels=labels, use_cache=False).loss
    return model(ids, labels)


class Tokens(torch.utils.data.Dataset):
    """Random token sequences (no download): ``count`` of ``length`` tokens, the labels the next token."""

    def __init__(self, count: int, length: int):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (count, length + 1), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return self.ids[i, :-1], self.ids[i, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp", type=int, default=1, help="data-parallel groups")
    parser.add_argument("--cp", type=int, default=2, help="ranks of each ring")
    parser.add_argument("--model", choices=("hf", "gpt"), default="hf")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1, help="sequences per data-parallel group and step")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--bf16", action="store_true", help="autocast to bfloat16")
    parser.add_argument("--checkpointing", action="store_true", help="recompute each block in the backward")
    parser.add_argument("--ckpt", default="ringpass-train-ckpt", help="DCP checkpoint folder")
    parser.add_argument("--resume", action="store_true", help="load --ckpt first")
    parser.add_argument("--check", action="store_true", help="compare the first step with the unsharded model")
    args = parser.parse_args()
    if args.check and args.resume:
        parser.error("--check compares with a freshly initialised model: leave out --resume")

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    mesh = init_device_mesh(device, (args.dp, args.cp), mesh_dim_names=("dp", "cp"))
    dataset = Tokens(count=args.dp * args.batch * 8, length=args.seq_len)  # 8 steps an epoch
    loader = ringpass.ring_dataloader(dataset, mesh, batch_size=args.batch, drop_last=True)

    model, blocks = build(args.model, args.checkpointing)
    model.to(device)
    reference = build(args.model, args.checkpointing)[0].to(device) if args.check else None
    everyone = mesh["dp", "cp"]._flatten("dp_cp")
    for block in blocks:
        fully_shard(block, mesh=everyone)
    fully_shard(model, mesh=everyone)
    ring = ringpass.backend(group=mesh["cp"])  # its .reports: what each compiled graph became
    model.compile(backend=ring)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    start = 0
    if args.resume:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state, "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=args.ckpt)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        start = int(state["step"])
    batches = batches_from(loader, start)
    for step in range(start, start + args.steps):
        ids, labels = (t.to(device) for t in next(batches))
        with torch.autocast(device, dtype=torch.bfloat16, enabled=args.bf16):
            loss = loss_of(model, args.model, ids, labels)
        loss.backward()
        if args.check and step == start:
            check(model, reference, args, mesh, ids, labels, loss)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh["dp"].get_group())  # the global batch's loss: the groups' mean
        if dist.get_rank() == 0:
            print(f"step {step}: loss {mean.item() / args.dp:.6f}")
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "step": torch.tensor(start + args.steps)}
    dcp.save(state, checkpoint_id=args.ckpt)
    if dist.get_rank() == 0:
        attentions = sum(len(report.attention) for report in ring.reports)
        print(f"ring: {attentions} attention(s) rewritten in {len(ring.reports)} graph(s) over {args.cp} ranks")
        print(f"saved step {start + args.steps} to {args.ckpt}")
    dist.destroy_process_group()


def batches_from(loader, start: int):
    """The loader's batches from step ``start`` on, epoch after epoch (``set_epoch`` for each, as a
    DistributedSampler wants): a resumed run reads the batches the uninterrupted run would have read."""
    epoch, skip = divmod(start, len(loader))
    while True:
        loader.sampler.set_epoch(epoch)
        for i, batch in enumerate(loader):
            if i >= skip:
                yield batch
        epoch, skip = epoch + 1, 0


def check(model, reference, args, mesh, ids, labels, loss) -> None:
    """The unsharded model on the global batch (every group's batch, gathered here), in one process: the mean over
    the groups of their losses, and its gradients, against the ring's loss and FSDP2's gradients."""
    group = mesh["dp"].get_group()
    every_ids = [torch.empty_like(ids) for _ in range(args.dp)]
    every_labels = [torch.empty_like(labels) for _ in range(args.dp)]
    dist.all_gather(every_ids, ids, group=group)
    dist.all_gather(every_labels, labels, group=group)
    expected = 0.0
    for group_ids, group_labels in zip(every_ids, every_labels):
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=args.bf16):
            part = loss_of(reference, args.model, group_ids, group_labels) / args.dp
        part.backward()
        expected += part.item()
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=group)
    loss_error = abs(mean.item() / args.dp - expected) / abs(expected)
    wanted = dict(reference.named_parameters())
    grad_error = max(
        ((p.grad.full_tensor() - wanted[n].grad).abs().max() / wanted[n].grad.abs().max()).item()
        for n, p in model.named_parameters()
    )
    tolerance = 5e-2 if args.bf16 else 1e-4
    verdict = "OK" if loss_error <= tolerance and grad_error <= tolerance else "MISMATCH"
    if dist.get_rank() == 0:
        print(
            f"check: loss {mean.item() / args.dp:.6f} (unsharded {expected:.6f}, relative error {loss_error:.1e}), "
            f"max relative gradient error {grad_error:.1e}: {verdict} (tolerance {tolerance:g})"
        )


if __name__ == "__main__":
    main()
