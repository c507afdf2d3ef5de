"""``ringpass bench --what model``: one training step of a whole model, ring against unsharded.

The model is a Llama-style ``transformers.LlamaForCausalLM`` built from `ModelSize` with random weights
(or any Hugging Face ``config.json``, ``--hf-config``). A step is forward with ``labels`` (the loss),
then backward, with the parameters' gradients cleared before it. Methods (`METHODS`): ``ring``, the model
compiled with ``backend="ring"`` (full token ids on every rank, ``compiler=`` the bench's compiler,
``outputs="sharded"``: a training step needs the loss, which every rank gets, not the logits gathered) on P
ranks, and ``unsharded``, the same model compiled the same way without the ring (``torch.compile`` with
that compiler; ``eager``: not compiled) in one process. Each rank also records its loss (the summary
compares the ring's to the unsharded model's), how many KV blocks it exchanged (the ring ran) and the
seconds it spent inside the ring's steps (the rest of the step is everything but attention). With ``--packed``
the batch's rows are packed from documents (`PACKED_METHODS`), and each rank also counts the pairs its attention
kernels scored and its seconds computing them (the table's balance columns).
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

import torch

import lowering
from lowering import compat
from lowering.events import scored_pairs
from ringpass.cli.bench.measure import PeakMemory, gather_record, seconds_since, start_rank, write_trace

METHODS = ("ring", "unsharded")
# --packed: one row packed from documents (position ids restarting at each, as TRL packs): the ring on zigzag, the ring
# on the documents' layout (``layout="documents"``), the unsharded model
PACKED_METHODS = ("ring", "ring-documents", "unsharded")


@dataclass(frozen=True)
class ModelSize:
    """The Llama-style model's sizes (issue 13's whole-model case by default)."""

    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 704
    vocab: int = 1024


def build_model(config, seq_len: int, device):
    """(model in training mode on ``device``, its vocabulary size)."""
    torch.manual_seed(config.seed)
    if config.hf_config:
        from ringpass.inspection.targets import hf_config_model

        model, _ = hf_config_model(config.hf_config, seq_len, config.batch, labels=True, device=str(device))
        return model, model.config.vocab_size
    import transformers

    size = config.model
    llama = transformers.LlamaConfig(
        vocab_size=size.vocab,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        max_position_embeddings=max(config.seq_lens),
        attn_implementation="sdpa",
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(llama).to(device).train(), size.vocab


def _compiled(model, method: str, compiler: str):
    compat.dynamo_reset()  # each method compiles from scratch, with nothing cached from the other
    if method.startswith("ring"):
        options = {"compiler": compiler, "report": "off", "outputs": "sharded"}
        layout = {"layout": "documents"} if method == "ring-documents" else {}
        return torch.compile(model, backend="ring", options={**options, **layout})
    return model if compiler == "eager" else torch.compile(model, backend=compiler)


def _batch(config, seq_len: int, vocab: int, device) -> dict:
    """The step's keyword arguments: random token ids as labels too; with ``--packed``, position ids restarting at
    each document (HF reads them as the documents' mask)."""
    ids = torch.randint(vocab, (config.batch, seq_len), generator=torch.Generator().manual_seed(config.seed))
    batch = {"input_ids": ids.to(device), "labels": ids.to(device), "use_cache": False}
    if config.packed:
        positions = torch.cat([torch.arange(n) for n in config.packed]).expand(config.batch, -1)
        batch["position_ids"] = positions.contiguous().to(device)
    return batch


def _step(compiled, model, batch: dict, memory: PeakMemory, device) -> dict:
    model.zero_grad(set_to_none=True)
    memory.start()
    with lowering.record_ring_events() as events:
        start = time.perf_counter()
        loss = compiled(**batch).loss
        forward_s = seconds_since(start, device)
        forward_bytes = memory.peak()
        loss.backward()
        total_s = seconds_since(start, device)
        total_bytes = memory.peak()
    exchanges = sum(1 for e in events if e.kind == "exchange")
    ring_s = sum(e.fields["seconds"] for e in events if e.kind == "span")  # inside the ring's steps
    return {
        "forward_s": forward_s,
        "total_s": total_s,
        "forward_bytes": forward_bytes,
        "total_bytes": total_bytes,
        "loss": loss.item(),
        "exchanges": exchanges,
        "ring_s": ring_s,
        "compute_s": sum(e.fields["seconds"] for e in events if e.kind == "span" and e.fields["part"] == "compute"),
        "pairs": scored_pairs(events),
    }


def model_rank(rank: int, world_size: int, config, methods, progress_done: int, progress_total: int) -> list:
    """Every (sequence length, method) case on one rank; rank 0's list of records is the result."""
    import torch.distributed as dist

    device, progress = start_rank(rank, config, progress_done, progress_total)
    memory, records = PeakMemory(device), []
    for seq_len in config.seq_lens:
        model, vocab = build_model(config, seq_len, device)
        batch = _batch(config, seq_len, vocab, device)
        for method in methods:
            threads = torch.get_num_threads()
            progress.advance(f"{method} P={world_size} N={seq_len} ({threads} thread{'s' * (threads > 1)})")
            compiled = _compiled(model, method, config.compiler)
            warmups = [_step(compiled, model, batch, memory, device) for _ in range(config.warmup)]
            samples = []
            for _ in range(config.repeats):
                if world_size > 1:
                    dist.barrier()
                samples.append(_step(compiled, model, batch, memory, device))
            if config.trace:
                write_trace(
                    functools.partial(_step, compiled, model, batch, memory, device),
                    device,
                    os.path.join(config.trace, f"model-{method}-P{world_size}-N{seq_len}-T{threads}-rank{rank}.json"),
                )
            mine = {
                "samples": samples,
                "memory_note": memory.unavailable,
                "first_call_bytes": warmups[0]["total_bytes"] if warmups else None,
            }
            records.append(gather_record(mine, method=method, world_size=world_size, seq_len=seq_len, device=device))
        del model
    return records
