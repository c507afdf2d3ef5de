"""The runtime's few speed ratios in one run, appended to the history: run it before resolving any issue
that touches the runtime, and compare with the last lines.

    python examples/perf_record.py                      # measure, print the line, append it to docs/bench/history.jsonl
    python examples/perf_record.py --plot docs/bench/history.png    # and draw the history

On CPU, two gloo ranks of one thread each (`ringpass bench`'s spawn), B=1, Hq=8, Hkv=2, D=64, fp32, forward+backward,
zigzag causal ring attention through `lowering`, every case measured in interleaved turns (a machine drifting during
the run weighs on every case alike):

- ``efficiency``: single-process SDPA with one thread over the two ranks' time on two cores, at ``--seq-len``
  (`ringpass bench`'s efficiency column); ``vs_two_threads``: SDPA in one process with two threads over the ring's.
- ``program``, ``padding``, ``documents``: at ``--mask-seq-len``, the ring's time with a mask over its time plain
  causal: a one-document mask program (hides nothing), a left-padding program (hides 1/8 of the keys), and
  ``documents=ids`` of one document (hides nothing). 1.0 is free; the goal is at most 1.05.
- ``sdpa_one_thread_s``: the single-process baseline's seconds, to tell a slow machine (a busy hour) from a slow ring.
- ``ideal_efficiency``, ``vs_ideal``: what the machine allows (`ideal_split`). In one job, in turns: SDPA with one
  thread in one process while the other rank waits (``alone``), SDPA on half the heads in both processes at once
  (``half``: the work split perfectly, nothing exchanged, both processes sharing the machine as the ring's do), and
  the ring. ``ideal_efficiency`` = alone / (2 x half): the efficiency a perfect split reaches here; ``vs_ideal`` =
  half / ring: the ring against it (1.0: the ring costs nothing beyond splitting the work). Records before
  2026-12-07's third lack them.

Each record is one JSON line (`RECORD_KEYS`): the date, the commit (``-dirty`` with uncommitted changes), torch,
the machine, the sizes and the numbers. `check_record` is the format; tests/distributed/test_perf_record.py runs the
command at a tiny size and checks the repository's history.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ring_call import ring_inputs, timed_call

ROOT = Path(__file__).resolve().parents[1]
HISTORY = ROOT / "docs" / "bench" / "history.jsonl"
RATIOS = ("efficiency", "vs_two_threads", "program", "padding", "documents")
RECORD_KEYS = {
    "date": str,
    "commit": str,
    "torch": str,
    "machine": str,
    "seq_len": int,
    "mask_seq_len": int,
    "repeats": int,
    "sdpa_one_thread_s": float,
    **dict.fromkeys(RATIOS, float),
}
IDEAL_KEYS = {"ideal_efficiency": float, "vs_ideal": float}  # (absent from the first records)
MASK_CASES = ("plain", "program", "padding", "documents")


def check_record(record: dict) -> dict:
    """The record, if it has exactly `RECORD_KEYS` with their types (ratios positive), else ValueError."""
    if set(record) - set(IDEAL_KEYS) != set(RECORD_KEYS) or len(set(record) & set(IDEAL_KEYS)) not in (0, 2):
        raise ValueError(
            f"a history record has the keys {sorted(RECORD_KEYS)} (and, since the third, {sorted(IDEAL_KEYS)}), not "
            f"{sorted(record)}"
        )
    for key, kind in {**RECORD_KEYS, **IDEAL_KEYS}.items():
        if key not in record:
            continue
        value = record[key]
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is not str and not value > 0):
            raise ValueError(f"history record field {key!r}: expected a positive {kind.__name__}, got {value!r}")
    datetime.date.fromisoformat(record["date"])
    return record


def read_history(path: Path) -> list[dict]:
    """Every record of a history file, each checked."""
    return [check_record(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def _one_document(q_pos, kv_pos, ids):
    return ids[q_pos][:, None] == ids[kv_pos][None, :]


def _left_padding(q_pos, kv_pos, keep):
    return keep[kv_pos][None, :].expand(len(q_pos), -1)


def mask_ratios(rank: int, world_size: int, seq_len: int, repeats: int) -> dict:
    """This rank's seconds per case (`MASK_CASES`), measured in turns after a warm-up round."""
    torch.set_num_threads(1)
    layout, q, k, v = ring_inputs(rank, world_size, seq_len)
    one = torch.zeros(seq_len, dtype=torch.long)
    keep = torch.arange(seq_len) >= seq_len // 8
    options = {
        "plain": {},
        "program": dict(mask=_one_document, mask_inputs=[one]),
        "padding": dict(mask=_left_padding, mask_inputs=[keep]),
        "documents": dict(documents=one),
    }
    seconds = {case: [] for case in MASK_CASES}
    for turn in range(repeats + 1):
        for case in MASK_CASES[turn % len(MASK_CASES) :] + MASK_CASES[: turn % len(MASK_CASES)]:
            took = timed_call(layout, q, k, v, **options[case])
            if turn:  # the first round warms up
                seconds[case].append(took)
    return seconds


IDEAL_CASES = ("alone", "half", "ring")


def ideal_split(rank: int, world_size: int, seq_len: int, repeats: int) -> dict:
    """This rank's seconds per case (`IDEAL_CASES`), one thread each, in turns after a warm-up round: SDPA on the
    whole attention on rank 0 while the others wait (``alone``), SDPA on 1/P of the heads on every rank at once
    (``half``), the ring; each forward+backward, started together after a barrier."""
    torch.set_num_threads(1)
    layout, q, k, v = ring_inputs(rank, world_size, seq_len)
    generator = torch.Generator().manual_seed(rank)
    whole = [torch.randn(1, h, seq_len, 64, generator=generator).requires_grad_() for h in (8, 2, 2)]
    split = [t.detach()[:, : t.size(1) // world_size].clone().requires_grad_() for t in whole]

    def sdpa(tensors, runs: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        if runs:
            F.scaled_dot_product_attention(*tensors, is_causal=True, enable_gqa=True).sum().backward()
        took = time.perf_counter() - start
        dist.barrier()  # the others wait while rank 0 runs alone
        return took

    calls = {
        "alone": lambda: sdpa(whole, rank == 0),
        "half": lambda: sdpa(split, True),
        "ring": lambda: timed_call(layout, q, k, v),
    }
    seconds = {case: [] for case in IDEAL_CASES}
    for turn in range(repeats + 1):
        for case in IDEAL_CASES[turn % len(IDEAL_CASES) :] + IDEAL_CASES[: turn % len(IDEAL_CASES)]:
            took = calls[case]()
            if turn:  # the first round warms up
                seconds[case].append(took)
    return seconds


def rank_turns(rank: int, world_size: int, mask_seq_len: int, seq_len: int, repeats: int) -> dict:
    """This rank's `mask_ratios` and `ideal_split` seconds, in one spawn."""
    return {
        "masks": mask_ratios(rank, world_size, mask_seq_len, repeats),
        "ideal": ideal_split(rank, world_size, seq_len, repeats),
    }


def measure(seq_len: int, mask_seq_len: int, repeats: int) -> dict:
    """The record's numbers: the ring's efficiency by `ringpass bench`, the masks' ratios by `mask_ratios`."""
    from ringpass.cli.bench import BenchConfig, run_bench
    from ringpass.cli.launch import spawn_ranks

    config = BenchConfig(
        world_sizes=(2,),
        seq_lens=(seq_len,),
        methods=("sdpa", "ring-zigzag"),
        repeats=repeats,
        threads_per_rank=1,
        interleave=True,
        progress=False,
    )
    rows = run_bench(config)["rows"]
    ring = next(r for r in rows if r["method"] == "ring-zigzag")
    one_thread = next(r for r in rows if r["method"] == "sdpa" and r["threads"] == 1)
    ranks = spawn_ranks(rank_turns, 2, (mask_seq_len, seq_len, repeats), timeout=3600)
    ideal_ranks, ranks = [r["ideal"] for r in ranks], [r["masks"] for r in ranks]
    slowest = {case: [max(turn) for turn in zip(*(r[case] for r in ranks))] for case in MASK_CASES}
    plain = statistics.median(slowest["plain"])
    ideal = {
        case: statistics.median(max(turn) for turn in zip(*(r[case] for r in ideal_ranks))) for case in IDEAL_CASES
    }
    return {
        "sdpa_one_thread_s": one_thread["total_s"]["median"],
        "efficiency": ring["efficiency"],
        "vs_two_threads": ring["vs_same_cores"],
        **{case: statistics.median(slowest[case]) / plain for case in MASK_CASES[1:]},
        "ideal_efficiency": ideal["alone"] / (2 * ideal["half"]),
        "vs_ideal": ideal["half"] / ideal["ring"],
    }


def _commit() -> str:
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def record(seq_len: int, mask_seq_len: int, repeats: int) -> dict:
    numbers = measure(seq_len, mask_seq_len, repeats)
    return check_record(
        {
            "date": datetime.date.today().isoformat(),
            "commit": _commit(),
            "torch": torch.__version__,
            "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.system()}",
            "seq_len": seq_len,
            "mask_seq_len": mask_seq_len,
            "repeats": repeats,
            **{key: float(value) for key, value in numbers.items()},
        }
    )


def plot(history: list[dict], path: str) -> None:
    """Each ratio against the record's number (dated, with its commit): a line per ratio, the goals dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (efficiency, masks) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    x = range(len(history))
    for name in ("efficiency", "vs_two_threads", "ideal_efficiency", "vs_ideal"):
        efficiency.plot(x, [r.get(name, float("nan")) for r in history], marker="o", label=name)
    efficiency.axhline(0.95, linestyle="--", color="gray", label="goal 0.95")
    for name in ("program", "padding", "documents"):
        masks.plot(x, [r[name] for r in history], marker="o", label=f"{name} / plain causal")
    masks.axhline(1.05, linestyle="--", color="gray", label="goal 1.05")
    masks.set_xticks(list(x), [f"{r['date'][5:]}\n{r['commit'][:7]}" for r in history], fontsize=7)
    efficiency.set_ylabel(f"ring vs SDPA, N={history[-1]['seq_len']}")
    masks.set_ylabel(f"masked / plain, N={history[-1]['mask_seq_len']}")
    for axis in (efficiency, masks):
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192, help="the efficiency's sequence length")
    parser.add_argument("--mask-seq-len", type=int, default=16384, help="the masks' sequence length")
    parser.add_argument("--repeats", type=int, default=5, help="measured turns")
    parser.add_argument("--history", default=str(HISTORY), help="the JSON-lines file the record is appended to")
    parser.add_argument("--no-write", action="store_true", help="print the record only")
    parser.add_argument("--plot", metavar="PNG", help="draw the whole history (with this record) into PNG")
    args = parser.parse_args()
    line = json.dumps(record(args.seq_len, args.mask_seq_len, args.repeats))
    print(line)
    history = Path(args.history)
    if not args.no_write:
        with history.open("a") as f:
            f.write(line + "\n")
    if args.plot:
        plot(read_history(history) if history.exists() else [json.loads(line)], args.plot)


if __name__ == "__main__":
    main()
