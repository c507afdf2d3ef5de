"""A Hugging Face Trainer job as a user writes it, launched by the tests with torchrun (2 CPU processes, gloo).

    torchrun --standalone --nproc-per-node 2 tests/workers/trainer_job.py OUT [--ring] [--accum N] [--bf16]
        [--checkpointing]
    torchrun --standalone --nproc-per-node 2 tests/workers/trainer_job.py OUT --accelerate [--ring]
    torchrun --standalone --nproc-per-node 2 tests/workers/trainer_job.py OUT [--ring] ... --stop-after K
        | --resume CHECKPOINT

A tiny Llama trains 6 optimizer steps on 16 random sequences of 48 tokens, each rank its own batches from the
Trainer's DistributedSampler (the ranks' label counts differ: some labels are -100). With ``--ring`` the only
change to the job is one line, ``model.compile(backend="ring", options={"inputs": "per_rank"})``. Rank 0
writes ``OUT/log.json`` (the Trainer's log history and the ring's summary lines) and the trained model
(``save_model``) to ``OUT/model``. With ``--accelerate`` the job is a plain loop on accelerate's ``Accelerator``
(``prepare`` of model, AdamW and a shuffled DataLoader; ``accelerator.backward``) instead of the Trainer.
``--stop-after K`` saves a checkpoint at step K (``OUT/trainer/checkpoint-K``: model, optimizer, scheduler, RNG
states) and stops there, as a job killed after its checkpoint; ``--resume CHECKPOINT`` trains on from it
(``trainer.train(resume_from_checkpoint=...)``) to step 6.
test_training compares the ring job with the same job without the ring.
"""

import argparse
import json
import logging
import os

import torch
import transformers


def dataset(count: int = 16, length: int = 48, vocab: int = 97) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(count):
        ids = torch.randint(0, vocab, (length,), generator=g)
        labels = ids.clone()
        labels[: (i * 5) % 17] = -100  # a prompt the loss skips: token counts differ between the ranks' batches
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def build_model():
    return tiny_llama(vocab_size=97)


def tiny_llama(vocab_size: int):
    """The tiny Llama the training jobs train (random weights)."""
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return transformers.LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--ring", action="store_true")
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--accelerate", action="store_true")
    parser.add_argument("--stop-after", type=int, help="save a checkpoint at this step and stop")
    parser.add_argument("--resume", help="a checkpoint folder to train on from")
    args = parser.parse_args()
    transformers.set_seed(0)
    model = build_model()
    if args.checkpointing:  # docs/training.md: transformers >= 5.25's attention wrapper under checkpointing
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    summaries = []
    if args.ring:
        model.compile(backend="ring", options={"inputs": "per_rank", "compiler": "eager"})
        summaries = ring_summaries()
    if args.accelerate:
        history = accelerate_loop(model, os.path.join(args.out, "model"))
        if int(os.environ["RANK"]) == 0:
            with open(os.path.join(args.out, "log.json"), "w") as f:
                json.dump({"history": history, "summaries": summaries}, f)
        return
    training = transformers.TrainingArguments(
        output_dir=os.path.join(args.out, "trainer"),
        per_device_train_batch_size=1,
        gradient_accumulation_steps=args.accum,
        max_steps=6,
        logging_steps=1,
        learning_rate=1e-3,
        bf16=args.bf16,
        gradient_checkpointing=args.checkpointing,
        save_strategy="steps" if args.stop_after else "no",
        save_steps=args.stop_after or 500,
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
    )
    callbacks = [_StopAtCheckpoint()] if args.stop_after else None
    trainer = transformers.Trainer(model=model, args=training, train_dataset=dataset(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=args.resume)
    trainer.save_model(os.path.join(args.out, "model"))
    if trainer.is_world_process_zero():
        with open(os.path.join(args.out, "log.json"), "w") as f:
            json.dump({"history": trainer.state.log_history, "summaries": summaries}, f)


def accelerate_loop(model, out: str) -> list[dict]:
    """6 steps of a loop on accelerate's Accelerator; each step's loss (the mean over the ranks) and gradient norm."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=1, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    history = []
    for _, batch in zip(range(6), loader):
        loss = model(**batch).loss
        accelerator.backward(loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), 1e9)
        optimizer.step()
        optimizer.zero_grad()
        history.append({"loss": accelerator.gather(loss.detach()).mean().item(), "grad_norm": float(norm)})
    accelerator.unwrap_model(model).save_pretrained(out)
    return history


class _StopAtCheckpoint(transformers.TrainerCallback):
    """Ends training once the first checkpoint is written: the job is interrupted there."""

    def on_save(self, args, state, control, **kwargs):
        control.should_training_stop = True
        return control


def ring_summaries() -> list[str]:
    """A list that fills with the ring's summary lines (the ``ringpass.summary`` logger) as graphs compile."""
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("ringpass.summary").addHandler(handler)
    logging.getLogger("ringpass.summary").setLevel(logging.INFO)
    return lines


if __name__ == "__main__":
    main()
