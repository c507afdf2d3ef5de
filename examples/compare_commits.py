"""The same ring call from several commits, in alternating turns on one machine: did a commit make the ring slower?

    python examples/compare_commits.py 78d6882 91a2e41 HEAD --seq-len 8192 --turns 4

Each commit is checked out once (``git worktree add --detach`` in a temporary folder, removed at the end); each turn
runs, for every commit in turn (the order reversed every other turn, so a machine drifting weighs on each alike),
``torchrun --standalone --nproc-per-node 2`` of this file's `time_ring_call` with ``PYTHONPATH`` set to that
checkout: zigzag causal ring attention through its `lowering`, B=1, Hq=8, Hkv=2, D=64, fp32, one thread per rank,
forward+backward, the worst rank's median of ``--calls`` after a warm-up. It prints each commit's seconds turn by turn
and their median. Any commit whose `lowering` has ``Layout`` and ``ring_attention`` can be compared (all of them so
far). docs/performance.md ("The history") has a run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def time_ring_call(seq_len: int, calls: int) -> None:
    """Under torchrun: one rank's calls; rank 0 prints ``RESULT <seconds>``, the worst rank's median."""
    import torch
    import torch.distributed as dist
    from ring_call import ring_inputs, timed_call

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    layout, q, k, v = ring_inputs(rank, dist.get_world_size(), seq_len)
    seconds = [timed_call(layout, q, k, v) for _ in range(calls + 1)]
    worst = torch.tensor([statistics.median(seconds[1:])], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"RESULT {worst.item():.4f}")
    dist.destroy_process_group()


def _turn(checkout: Path, seq_len: int, calls: int) -> float:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__]
    result = subprocess.run(
        [*command, "--time", str(seq_len), str(calls)],
        cwd=checkout,
        env={**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        raise SystemExit(f"{checkout.name}: the ring call failed:\n{result.stderr[-3000:]}")
    return float(lines[0].split()[1])


def compare(revisions: list[str], seq_len: int, turns: int, calls: int) -> dict[str, list[float]]:
    """Seconds per call of each revision, turn by turn."""
    seconds: dict[str, list[float]] = {rev: [] for rev in revisions}
    with tempfile.TemporaryDirectory(prefix="ringpass-compare-") as folder:
        checkouts = {}
        try:
            for i, rev in enumerate(revisions):
                checkouts[rev] = Path(folder) / f"{i}-{rev.replace('/', '_')}"
                subprocess.run(
                    ["git", "worktree", "add", "--detach", str(checkouts[rev]), rev],
                    cwd=ROOT,
                    check=True,
                    capture_output=True,
                )
            for turn in range(turns):
                for rev in revisions if turn % 2 == 0 else revisions[::-1]:
                    seconds[rev].append(_turn(checkouts[rev], seq_len, calls))
        finally:
            for checkout in checkouts.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(checkout)], cwd=ROOT, capture_output=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revisions", nargs="*", help="commits, branches or tags (git rev-parse accepts)")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--calls", type=int, default=3, help="measured calls per turn, after one warm-up")
    parser.add_argument("--time", nargs=2, type=int, metavar=("SEQ_LEN", "CALLS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.time:
        time_ring_call(*args.time)
        return
    if not args.revisions:
        parser.error("give the commits to compare")
    seconds = compare(args.revisions, args.seq_len, args.turns, args.calls)
    print(f"ring zigzag, causal, N={args.seq_len}, P=2, one thread per rank, forward+backward, seconds per call:")
    for rev, values in seconds.items():
        print(f"  {rev:<14} {statistics.median(values):.3f}  (turns: {', '.join(f'{v:.3f}' for v in values)})")


if __name__ == "__main__":
    main()
