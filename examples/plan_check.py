"""The whole-model plan against measurement on this machine (docs/performance.md).

    python examples/plan_check.py [--model llama,qwen2,hand] [--seq-len 4096] [--world-sizes 1,2,4] \
        [--hardware FILE]

For each model, ring size P and checkpointing off / on: what one training step (forward + backward, after a warm-up
step) adds to a rank's memory, and how long it takes (the median of three steps). Predicted: `ringpass.model_plan`
as `ringpass plan` computes it (the fake step at the rank's share of the sequence, compiled as the backend
compiles it when P > 1: activations and temporaries + the gradients live at the step's peak + the ring's
buffers; time from the step's ops and the cost model, one rank's attention at the calibrated rate of the model's
own SDPA, no optimizer), on the `cpu` and `loopback` presets or a ``ringpass bench --calibrate --json FILE``
file; with more ranks than cores each rank's rates are its share of a core's (the ranks take turns). Measured:
`ringpass.bench.measure.PeakMemory` (VmHWM above the resident set before the step; MALLOC_MMAP_THRESHOLD_ so freed
tensors leave it) and, in other processes without that setting (it makes every allocation fault its pages in), the
step's wall time, on P gloo ranks of this machine (one thread each; more ranks than the 2
cores share them) with the model compiled by the ring backend (``compiler="aot_eager"``; P = 1: the model alone,
eager), the rank with the higher peak and time. Models: Hugging Face Llama and Qwen2 (hidden 256, 4 layers, 8 query
/ 2 KV heads, vocabulary 1000, fp32), checkpointed by their own ``activation_checkpointing_enable()``, and the
tests' hand-written Llama of the same sizes, checkpointed as a user of a plain module does: every block wrapped by
torch's ``apply_activation_checkpointing`` (non-reentrant ``checkpoint_wrapper``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

MIB = 2**20
ROOT = Path(__file__).resolve().parent.parent


def build(model: str, tokens: int, checkpointing: bool = False):
    """(model, keyword inputs) of ``tokens`` tokens; random weights, on the current device (fake or real)."""
    if model == "hand":
        sys.path.insert(0, str(ROOT / "tests"))
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
    from ringpass.model_plan import PLAN_ATTENTION, candidate, hf_plan_attention, measure_step
    from ringpass.report import AttentionRecord

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
    from ringpass.bench.measure import PeakMemory

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
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--world-sizes", default="1,2,4")
    parser.add_argument("--hardware", metavar="FILE", help="a `ringpass bench --calibrate --json` file")
    args = parser.parse_args()
    from ringpass.hardware import default_hardware, load_hardware
    from ringpass.launch import spawn_ranks

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
