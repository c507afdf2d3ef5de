"""The ring with FSDP2 and with tensor parallel on a 2 x 2 DeviceMesh, each step against the unsharded model.

    torchrun --standalone --nproc-per-node 4 examples/fsdp_tp_ring.py

A tiny Hugging Face Llama from a config (random weights, no download), causal LM loss on a global batch of 4
sequences. Two setups (docs/composition.md):

1. mesh ``dp x cp``: each data-parallel replica takes 2 of the 4 sequences, the ring runs over ``cp``, FSDP2
   shards the parameters over all four ranks (``dp x cp`` flattened, as torchtitan does). ``grads="auto"`` finds
   FSDP2 and makes each rank's gradient its share x 2, so FSDP2's mean is the gradient of the global batch and
   its reduce-scatter is the only gradient communication.
2. mesh ``cp x tp``: attention and MLP sharded over ``tp`` (``parallelize_module``), the ring over ``cp`` on the
   whole batch: each rank rotates only its own heads' keys and values.
"""

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import ringpass

CONFIG = transformers.LlamaConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    attn_implementation="sdpa",
)
TP_PLAN = {
    "self_attn.q_proj": ColwiseParallel(),
    "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(),
    "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(),
    "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(),
}


def fresh_model():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(CONFIG)


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def compare(name, model, loss, expected, expected_grads):
    errors = [
        ((full(p.grad) - expected_grads[n]).abs().max() / expected_grads[n].abs().max()).item()
        for n, p in model.named_parameters()
    ]
    if dist.get_rank() == 0:
        print(ringpass.last_report().summary())
        print(
            f"{name}: loss {loss.item():.6f} (unsharded {expected.item():.6f}), "
            f"max relative gradient error {max(errors):.2e}"
        )


def main() -> None:
    dist.init_process_group("gloo")
    ids = torch.randint(0, 128, (4, 256), generator=torch.Generator().manual_seed(1))  # the global batch
    reference = fresh_model()
    expected = loss_of(reference, ids)
    expected.backward()
    expected_grads = {n: p.grad for n, p in reference.named_parameters()}

    # 1. FSDP2 over data x ring, the ring over cp
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    model = fresh_model()
    fully_shard(model, mesh=mesh["dp", "cp"]._flatten())
    replica = mesh.get_local_rank("dp")
    compiled = torch.compile(model, backend=ringpass.backend(group=mesh["cp"], compiler="aot_eager", report="off"))
    loss = loss_of(compiled, ids[2 * replica : 2 * replica + 2])
    loss.backward()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss, group=mesh["dp"].get_group())
    compare("FSDP2 x ring", model, mean_loss / 2, expected, expected_grads)

    # 2. tensor parallel x ring
    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    model = fresh_model()
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], TP_PLAN)
    compiled = torch.compile(model, backend=ringpass.backend(group=mesh["cp"], compiler="aot_eager", report="off"))
    loss = loss_of(compiled, ids)
    loss.backward()
    compare("tensor parallel x ring", model, loss, expected, expected_grads)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
