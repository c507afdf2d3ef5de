"""A TRL SFTTrainer job with packing as a user writes it, launched by the tests with torchrun (2 CPU processes, gloo).

    torchrun --standalone --nproc-per-node 2 tests/workers/trl_job.py OUT [--ring] [--model-loss]
    torchrun --standalone --nproc-per-node 1 tests/workers/trl_job.py OUT --accum 2

A tiny Llama (random weights) is fine-tuned 6 optimizer steps on 80 prompt-completion pairs of varied lengths (a
word-level tokenizer built in code; completion-only loss). ``SFTConfig(packing=True)`` packs them best-fit into
rows of at most 64 tokens, and its padding-free collator flattens each batch of 2 rows into one row
(``input_ids`` of shape ``[1, total]``, no ``attention_mask``) whose ``position_ids`` restart at 0 at every packed
sequence: Hugging Face's SDPA path reads them as a block-diagonal (packed-document) causal mask. The ranks' batches
differ in length. With ``--ring`` the only change to the job is one line,
``model.compile(backend="ring", dynamic=True, options={"inputs": "per_rank"})`` (``dynamic=True``: each rank's
batch at its own length). Rank 0 writes ``OUT/log.json``: the Trainer's log history, the ring's summary lines and
what the collator gave each rank (per batch: its length and the lengths of the sequences its position ids
delimit), and the trained model (``save_model``) to ``OUT/model``. test_training compares the ring job with the
job without the ring on 1 process accumulating 2 batches a step (``--accum 2``): accelerate hands batch i of the
one shuffled order to rank i mod 2, so the 1-process job steps on the same batches.

TRL 1.16's ``SFTTrainer.compute_loss`` calls ``model(**inputs, fused_lm_head=True)``: ``SFTTrainer`` patches the
model's ``forward`` (``trl.trainer.utils.add_fused_lm_head``) to shift the hidden states (``[:, :-1]``), flatten
them to ``[tokens, hidden]`` and score them in a ``torch.autograd.Function`` (chunked log-probabilities, entropy,
top-1) instead of building the logits. ``--model-loss`` replaces that ``compute_loss`` with
``transformers.Trainer``'s (the model's own cross-entropy, the same numbers): the rest of the job unchanged.
"""

import argparse
import json
import os

import datasets
import torch
import torch.distributed as dist
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from trainer_job import ring_summaries, tiny_llama  # this script's folder is on the path
from trl import SFTConfig, SFTTrainer

WORDS = [f"w{i}" for i in range(58)]
SPECIAL = ["<pad>", "<eos>", "<unk>"]


def build_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over ``WORDS``, built offline: 61 tokens."""
    vocab = {token: i for i, token in enumerate([*SPECIAL, *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def dataset(count: int = 80) -> datasets.Dataset:
    """Prompts of 2-11 words and completions of 3-29 (TRL appends EOS to each completion)."""
    g = torch.Generator().manual_seed(5)

    def text(low: int, high: int) -> str:
        length = int(torch.randint(low, high, (1,), generator=g))
        return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (length,), generator=g).tolist())

    pairs = [(text(2, 12), " " + text(3, 30)) for _ in range(count)]
    return datasets.Dataset.from_dict({"prompt": [p for p, _ in pairs], "completion": [c for _, c in pairs]})


def build_model():
    return tiny_llama(vocab_size=len(SPECIAL) + len(WORDS))


class Recorder:
    """The trainer's collator, unchanged, noting what each batch it makes holds: its shape and the lengths of the
    sequences its ``position_ids`` delimit (each restart at 0 begins one)."""

    def __init__(self, collator):
        self.collator = collator
        self.batches = []

    def __call__(self, examples):
        batch = self.collator(examples)
        (positions,) = batch["position_ids"].tolist()  # padding-free: one row
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
        self.batches.append(
            {
                "shape": list(batch["input_ids"].shape),
                "attention_mask": "attention_mask" in batch,
                "sequences": [b - a for a, b in zip(starts, starts[1:])],
                "positions_count_up": all(
                    positions[i] == positions[i - 1] + 1 for i in range(1, len(positions)) if positions[i]
                ),
            }
        )
        return batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--ring", action="store_true")
    parser.add_argument("--model-loss", action="store_true")
    parser.add_argument("--accum", type=int, default=1)
    args = parser.parse_args()
    transformers.set_seed(0)
    model = build_model()
    summaries = []
    if args.ring:
        model.compile(backend="ring", dynamic=True, options={"inputs": "per_rank", "compiler": "eager"})
        summaries = ring_summaries()
    config = SFTConfig(
        output_dir=os.path.join(args.out, "trainer"),
        packing=True,  # best-fit decreasing: padding-free batches, position ids restarting per sequence
        max_length=64,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=args.accum,
        max_steps=6,
        logging_steps=1,
        learning_rate=1e-3,
        bf16=False,  # TRL's default is bf16; the comparison is fp32
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
    )
    trainer_class = ModelLossSFTTrainer if args.model_loss else SFTTrainer
    trainer = trainer_class(model=model, args=config, train_dataset=dataset(), processing_class=build_tokenizer())
    recorder = trainer.data_collator = Recorder(trainer.data_collator)
    trainer.train()
    trainer.save_model(os.path.join(args.out, "model"))
    batches = [None] * dist.get_world_size()
    dist.all_gather_object(batches, recorder.batches)
    if trainer.is_world_process_zero():
        log = {"history": trainer.state.log_history, "summaries": summaries, "batches": batches}
        with open(os.path.join(args.out, "log.json"), "w") as f:
            json.dump(log, f)


class ModelLossSFTTrainer(SFTTrainer):
    """``SFTTrainer`` with the model's own loss (``transformers.Trainer.compute_loss``), not TRL's fused LM head."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return transformers.Trainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)


if __name__ == "__main__":
    main()
