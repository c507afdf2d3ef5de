"""A Hugging Face Llama training step with the ring backend: a left-padded batch, labels, no changes.

    torchrun --standalone --nproc-per-node 2 examples/hf_llama_with_padding.py

A tiny Llama from a config (random weights, no download). HF builds its attention mask from the
padding mask in the compiled graph; the ring backend lifts it out and evaluates it one tile at a time
on each rank's positions. Every rank checks the loss and the gradients against the model run whole.
"""

import torch
import torch.distributed as dist
import transformers

import ringpass


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (2, 500))
    attention_mask = torch.ones_like(ids)
    attention_mask[0, :120] = 0  # the first sequence is shorter: padded on the left
    labels = ids.masked_fill(attention_mask == 0, -100)
    batch = dict(input_ids=ids, attention_mask=attention_mask, labels=labels, use_cache=False)

    expected = model(**batch).loss  # the whole sequence, one process
    expected.backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    loss = torch.compile(model, backend="ring", options={"compiler": "aot_eager"})(**batch).loss
    loss.backward()
    grad_error = max(
        ((p.grad - g).abs().max() / g.abs().max()).item() for p, g in zip(model.parameters(), expected_grads)
    )
    if dist.get_rank() == 0:
        print(ringpass.last_report())
        print(f"loss {loss.item():.6f} (unsharded {expected.item():.6f}), max relative gradient error {grad_error:.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
