"""The whole-model plan against measurement on this machine (docs/performance.md).

    python examples/plan_check.py [--model llama,qwen2,hand] [--seq-len 4096] [--world-sizes 1,2,4] \
        [--hardware FILE]
    python examples/plan_check.py --spread [--rows 0,3] [--row VOCAB,HIDDEN,LAYERS,N,P[,DTYPE]] \
        [--seq-len N] [--world-sizes 1,2]

For each model, ring size P and checkpointing off / on: what one training step (forward + backward, after a warm-up
step) adds to a rank's memory, and how long it takes (the median of three steps). Predicted:
`ringpass.planning.model_plan` as `ringpass plan` computes it (the fake step at the rank's share of the sequence,
compiled as the backend compiles it when P > 1: activations and temporaries + the gradients live at the step's peak +
the ring's buffers; time from the step's ops and the cost model, one rank's attention at the calibrated rate of the
model's own SDPA, no optimizer), on the `cpu` and `loopback` presets or a ``ringpass bench --calibrate --json FILE``
file; with more ranks than cores each rank's rates are its share of a core's (the ranks take turns). Measured:
`ringpass.cli.bench.measure.PeakMemory` (VmHWM above the resident set before the step; MALLOC_MMAP_THRESHOLD_ so freed
tensors leave it) and, in other processes without that setting (it makes every allocation fault its pages in), the
step's wall time, on P gloo ranks of this machine (one thread each; more ranks than the 2
cores share them) with the model compiled by the ring backend (``compiler="aot_eager"``; P = 1: the model alone,
eager), the rank with the higher peak and time. Models: Hugging Face Llama and Qwen2 (hidden 256, 4 layers, 8 query
/ 2 KV heads, vocabulary 1000, fp32), checkpointed by their own ``activation_checkpointing_enable()``, and the
tests' hand-written Llama of the same sizes, checkpointed as a user of a plain module does: every block wrapped by
torch's ``apply_activation_checkpointing`` (non-reentrant ``checkpoint_wrapper``).

``--spread``: the memory of a training step with AdamW over a spread of shapes (`SPREAD`: vocabulary 4k-152k,
hidden 128-1024, 2-8 layers, N 2k-32k, P 1-4, fp32 and bf16), each a Qwen2 config written to a file: predicted by
``ringpass plan --hf-config FILE --optimizer adamw`` itself (the user's command: activations + gradients at the peak
+ the ring's buffers, what a step adds to the weights and optimizer states a rank holds already), measured as above
on P ranks (one step after a warm-up step that compiles and makes the optimizer's states; forward, backward,
``optimizer.step()``; P = 1: the model alone, eager). ``--rows`` picks rows of `SPREAD` by index, ``--row`` adds one
(repeatable), ``--seq-len`` / ``--world-sizes`` set every row's N / keep the rows of those P (a quick run).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

MIB = 2**20
ROOT = Path(__file__).resolve().parent.parent


def build(model: str, tokens: int, checkpointing: bool = False):
    """(model, keyword inputs) of ``tokens`` tokens; random weights, on the current device (fake or real)."""
    if model == "hand":
        sys.path.insert(0, str(ROOT / "tests" / "workers"))
        from models import Llama, LlamaBlock, WithLoss
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        net = WithLoss(Llama(vocab=1000, dim=256, heads=8, kv_heads=2, layers=4))
        if checkpointing:
            apply_activation_checkpointing(net, check_fn=lambda module: isinstance(module, LlamaBlock))
        ids = torch.zeros(1, tokens, dtype=torch.long)
        return net, (ids, ids)
    import transformers

    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[model]
    config = config_class(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=tokens,
    )
    net = model_class(config)
    if checkpointing:
        net.activation_checkpointing_enable()
    ids = torch.zeros(1, tokens, dtype=torch.long)
    return net, {"input_ids": ids, "labels": ids, "use_cache": False}


def predicted(model: str, seq_len: int, world_size: int, checkpointing: bool, hw) -> tuple[int, float]:
    """(bytes the step adds, seconds it takes) as `ringpass plan` predicts them for this configuration."""
    from lowering.layout import Layout
    from ringpass.fx.report import AttentionRecord
    from ringpass.planning.model_plan import PLAN_ATTENTION, candidate, hf_plan_attention, measure_step

    layout = Layout("zigzag", world_size, seq_len)

    def fake_build(tokens):
        net, inputs = build(model, tokens)
        if model != "hand":
            net.config._attn_implementation = PLAN_ATTENTION
        return net, inputs

    hf_plan_attention()
    step = measure_step(fake_build, layout.local_len, "none", compiled=world_size > 1)
    attention = AttentionRecord("", "", "sdpa", "causal", True, None, [], 1, 8, 2, 32, "float32", 4, 32**-0.5)
    plan = candidate(step, layout, world_size, hw, [attention] * 4, "none", checkpointing, None)
    memory = plan.memory_per_rank
    return memory["activations"] + memory["gradients"] + memory["ring"], plan.step_s


def measure(
    rank: int, world_size: int, model: str, seq_len: int, checkpointing: bool, steps: int
) -> tuple[float, float]:
    """(MiB the first step adds to this rank (None in a process without ``MALLOC_MMAP_THRESHOLD_``), the median
    seconds of ``steps`` steps)."""
    import ringpass
    from ringpass.cli.bench.measure import PeakMemory

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net, inputs = build(model, seq_len, checkpointing)
    net.train()
    backend = ringpass.backend(compiler="aot_eager", report="off")
    run = net if world_size == 1 else torch.compile(net, backend=backend)

    def step():
        out = run(**inputs) if isinstance(inputs, dict) else run(*inputs)
        loss = out.loss if hasattr(out, "loss") else out[0]
        loss.backward()

    step()  # compiles; the first call's one-time memory is not the step's
    net.zero_grad(set_to_none=True)
    memory = PeakMemory(torch.device("cpu"))
    memory.start()
    seconds, peaks = [], []
    for _ in range(steps):  # the memory of the first, the median time
        started = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - started)
        peaks.append(memory.peak())
        net.zero_grad(set_to_none=True)
    return (None if peaks[0] is None else peaks[0] / MIB), statistics.median(seconds)  # None: no MMAP threshold


@dataclass(frozen=True)
class Row:
    """One Qwen2-style model and run of the spread: ``heads`` query heads of ``hidden / heads`` (64 unless given),
    a quarter as many KV heads, an MLP twice the hidden size, untied embeddings (Qwen2's default)."""

    vocab: int
    hidden: int
    layers: int
    seq_len: int
    world_size: int
    dtype: str = "fp32"
    heads: int = 0  # 0: hidden / 64

    def config(self) -> dict:
        heads = self.heads or max(2, self.hidden // 64)
        return {
            "model_type": "qwen2",
            "architectures": ["Qwen2ForCausalLM"],
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": 2 * self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": heads,
            "num_key_value_heads": max(1, heads // 4),
            "max_position_embeddings": self.seq_len,
            "tie_word_embeddings": False,
        }


# Each row's ranks together hold about N x vocabulary x 20 bytes at the peak (the logits, the zeros of their output
# gradient, the log-softmax and two gradients of that size; fp32) beside what the model needs: with P processes on this
# machine (24 GiB, shared), the largest vocabularies run at 2048 tokens and the longest sequences with small
# vocabularies. The last two rows are short slices of a large vocabulary x hidden, where the parameters' gradients
# set the peak: the gradients' copies the ring's reduction makes and the optimizer step's temporaries.
SPREAD = (
    Row(4096, 256, 4, 8192, 2, heads=8),  # issue 4's case: 8 / 2 heads of 32
    Row(4096, 256, 4, 8192, 2, "bf16", heads=8),
    Row(4096, 128, 2, 32768, 2),
    Row(4096, 128, 2, 32768, 4),
    Row(8192, 256, 4, 12288, 3),
    Row(8192, 512, 6, 16384, 4),
    Row(16384, 1024, 8, 4096, 1),
    Row(32768, 256, 4, 4096, 2),
    Row(32768, 1024, 4, 4096, 4, "bf16"),
    Row(65536, 256, 4, 4096, 2),
    Row(65536, 512, 2, 4096, 1, "bf16"),
    Row(151936, 128, 2, 2048, 2),
    Row(151936, 128, 2, 2048, 4, "bf16"),
    Row(65536, 1024, 2, 512, 2, "bf16"),
    Row(151936, 512, 2, 256, 1),
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def plan_row(row: Row, config: str) -> dict:
    """``ringpass plan --hf-config`` on the row (AdamW, its P), as the user runs it: its JSON."""
    from ringpass import cli

    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "plan.json")
        argv = ["plan", "--hf-config", config, "--world-size", str(row.world_size), "--seq-len", str(row.seq_len)]
        argv += ["--dtype", row.dtype, "--optimizer", "adamw", "--link", "loopback", "--device", "cpu"]
        with contextlib.redirect_stdout(io.StringIO()):
            if cli.main([*argv, "--json", out]) != 0:
                raise SystemExit(f"ringpass plan failed on {row}")
        with open(out) as f:
            return json.load(f)


def measure_row(rank: int, world_size: int, config: str, seq_len: int, dtype: str) -> float:
    """MiB one AdamW training step (forward, backward, ``optimizer.step()``) adds to this rank, after a warm-up step;
    compiled by the ring backend (``aot_eager``) when P > 1, the model alone (eager) at P = 1."""
    import ringpass
    from ringpass.cli.bench.measure import PeakMemory
    from ringpass.inspection.targets import hf_config_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net, inputs = hf_config_model(config, seq_len, 1, True, "cpu", "sdpa", DTYPES[dtype])
    run = net if world_size == 1 else torch.compile(net, backend=ringpass.backend(compiler="aot_eager", report="off"))
    optimizer = torch.optim.AdamW(net.parameters())

    def step():
        out = run(**inputs)  # held through the backward, as `loss = model(**batch).loss` keeps its output
        out.loss.backward()
        optimizer.step()
        net.zero_grad(set_to_none=True)

    step()  # compiles and makes the optimizer's states: what the rank holds before every later step
    memory = PeakMemory(torch.device("cpu"))
    memory.start()
    step()
    return memory.peak() / MIB


def spread(rows: list[Row]) -> None:
    """The plan's memory against the measured step for each row (module docstring), as a table."""
    from ringpass.cli.launch import spawn_ranks

    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # freed tensors leave the resident set (PeakMemory)
    print("One AdamW training step after a warm-up: MiB it adds per rank (the rank with the higher peak)")
    print(
        "| vocab | hidden | layers | N | P | dtype | peak at | activations / temporaries | gradients | ring "
        "| predicted MiB | measured MiB | ratio |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        for row in rows:
            config = os.path.join(folder, "config.json")
            with open(config, "w") as f:
                json.dump(row.config(), f)
            plan = plan_row(row, config)
            memory = plan["memory_per_rank"]
            asked = next(c for c in plan["candidates"] if c["ring_size"] == row.world_size and not c["checkpointing"])
            parts = [memory[k] / MIB for k in ("activations", "gradients", "ring")]
            guess = sum(parts)
            real = max(spawn_ranks(measure_row, row.world_size, (config, row.seq_len, row.dtype), timeout=1800))
            print(
                f"| {row.vocab} | {row.hidden} | {row.layers} | {row.seq_len} | {row.world_size} | {row.dtype} | "
                f"{asked['peak']} | "
                + " | ".join(f"{part:.0f}" for part in parts)
                + f" | {guess:.0f} | {real:.0f} | {guess / real:.2f} |",
                flush=True,
            )
    print(f"{len(rows)} rows in {(time.perf_counter() - started) / 60:.1f} minutes")


def sharing_cores(hw, ranks: int):
    """``hw`` for one of ``ranks`` ranks on this machine's cores: with more ranks than cores, each computes at its
    share of a core's rates."""
    share = min(1.0, (os.cpu_count() or 1) / ranks)
    if share == 1.0:
        return hw
    return replace(
        hw,
        flops_per_s=hw.flops_per_s * share,
        sdpa_flops_per_s=hw.sdpa_flops_per_s and hw.sdpa_flops_per_s * share,
        head_dim_rates=tuple((d, ring * share, sdpa * share) for d, ring, sdpa in hw.head_dim_rates),
        gemm_flops_per_s=(hw.gemm_flops_per_s or hw.flops_per_s) * share,
        memory_bytes_per_s=hw.memory_bytes_per_s and hw.memory_bytes_per_s * share,
        op_overhead_s=hw.op_overhead_s / share,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama,qwen2,hand")
    parser.add_argument("--seq-len", type=int, help="default 4096; with --spread: every row's N (default its own)")
    parser.add_argument("--world-sizes", help="default 1,2,4; with --spread: only the rows of these P")
    parser.add_argument("--hardware", metavar="FILE", help="a `ringpass bench --calibrate --json` file")
    parser.add_argument("--spread", action="store_true", help="the memory of an AdamW step over SPREAD's shapes")
    parser.add_argument("--rows", help="with --spread: SPREAD's rows by index (0,3,5)")
    parser.add_argument(
        "--row", action="append", default=[], metavar="VOCAB,HIDDEN,LAYERS,N,P[,DTYPE]", help="with --spread: a row"
    )
    args = parser.parse_args()
    if args.spread:
        rows = [SPREAD[int(i)] for i in args.rows.split(",")] if args.rows else list(SPREAD if not args.row else ())
        for text in args.row:
            *numbers, dtype = text.split(",") if text.count(",") == 5 else (*text.split(","), "fp32")
            rows.append(Row(*map(int, numbers), dtype))
        if args.seq_len:
            rows = [replace(row, seq_len=args.seq_len) for row in rows]
        if args.world_sizes:
            rows = [row for row in rows if str(row.world_size) in args.world_sizes.split(",")]
        spread(rows)
        return
    args.seq_len, args.world_sizes = args.seq_len or 4096, args.world_sizes or "1,2,4"
    from ringpass.cli.launch import spawn_ranks
    from ringpass.hardware import default_hardware, load_hardware

    calibrated = load_hardware(args.hardware) if args.hardware else default_hardware()
    print(f"N={args.seq_len}, one training step (forward + backward) after a warm-up; MiB and seconds per rank")
    print(
        "| model | P | checkpointing | predicted MiB | measured MiB | ratio | predicted s | measured s | ratio |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    for model in args.model.split(","):
        for world_size in map(int, args.world_sizes.split(",")):
            for checkpointing in (False, True):
                hw = sharing_cores(calibrated, world_size)
                guess, guess_s = predicted(model, args.seq_len, world_size, checkpointing, hw)
                case = (model, args.seq_len, checkpointing)
                os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # freed tensors leave the resident set (PeakMemory)
                real = max(mib for mib, _ in spawn_ranks(measure, world_size, (*case, 1), timeout=1800))
                del os.environ["MALLOC_MMAP_THRESHOLD_"]  # the time in plain processes: it slows every allocation
                real_s = max(s for _, s in spawn_ranks(measure, world_size, (*case, 3), timeout=1800))
                guess /= MIB
                print(
                    f"| {model} | {world_size} | {'on' if checkpointing else 'off'} | {guess:.0f} | {real:.0f} | "
                    f"{guess / real:.2f} | {guess_s:.2f} | {real_s:.2f} | {guess_s / real_s:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
