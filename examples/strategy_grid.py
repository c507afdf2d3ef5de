"""Does ``strategy="auto"`` pick the fastest strategy? ``ringpass bench`` on a grid, auto beside the fixed methods.

    python examples/strategy_grid.py --json strategy-grid.json           # the grid of docs/performance.md
    python examples/strategy_grid.py --seq-lens 1024 --world-sizes 2 --repeats 1   # a quick look

For each cell (sequence length N, ranks P, causal or not; 8 query / 2 KV heads, head dim 64, fp32) it runs
the fixed methods (``ring-zigzag``, ``ring-contiguous``, ``all-gather``, ``ulysses``) and ``auto`` (what the
backend's cost model picks on the bench's hardware: the presets of this machine, or ``--hardware FILE``), and
prints the fastest fixed method's forward+backward time, auto's pick, the pick's own fixed row against the fastest
(the strategy auto picks, measured among the others), and auto's row (the same strategy measured again: the
machine's run-to-run spread shows there). N = 32768 runs one warm-up and ``--long-repeats`` measured calls. Each
cell's process first runs ``ring-zigzag`` once more, unrecorded: the first method a fresh process measures ran up
to 25 % slow here (``--no-throwaway`` to see it). ``--rounds K`` runs each cell K times in fresh processes and
keeps each method's least median: other work on the machine only slows a run down. ``--interleave`` warms every
method first and then measures them in turns, each turn starting one method later (``ringpass bench
--interleave``): a drift during the cell's run (a process that ran later methods up to 7 % slower was seen at 32768
tokens) then weighs on every method alike, so neither the unrecorded first method nor running ``ulysses`` last is
needed, and each ratio is also taken turn by turn (``paired``: the median over turns of a method's seconds over the
fastest fixed method's in the same turn), which cancels what the machine drifted between turns.
"""

from __future__ import annotations

import argparse
import json
import statistics

from ringpass.cli.bench import BenchConfig, run_bench
from ringpass.hardware import load_hardware

FIXED = ("ring-zigzag", "ring-contiguous", "all-gather", "ulysses")
PICKED = {"ring (zigzag)": "ring-zigzag", "ring (contiguous)": "ring-contiguous"}  # else by its kind


def fixed_method(picked: str, world_size: int) -> str | None:
    """The fixed method that runs what auto picked (None: no fixed method does, e.g. Ulysses in smaller groups)."""
    if picked in PICKED:
        return PICKED[picked]
    if picked.startswith("all-gather"):
        return "all-gather"
    if picked.startswith(f"ulysses {world_size} "):
        return "ulysses"
    return None


def cell(
    seq_len: int,
    world_size: int,
    causal: bool,
    repeats: int,
    hardware,
    throwaway: bool = True,
    rounds: int = 1,
    interleave: bool = False,
) -> dict:
    config = BenchConfig(
        world_sizes=(world_size,),
        seq_lens=(seq_len,),
        causal=causal,
        # one after another: rows of a repeated method, the last is kept
        methods=(*FIXED, "auto") if interleave else (*FIXED[:throwaway], *FIXED[:3], "auto", "ulysses"),
        repeats=repeats,
        progress=False,
        interleave=interleave,
    )
    runs = [{r["method"]: r for r in run_bench(config, hardware)["rows"] if "total_s" in r} for _ in range(rounds)]

    def least(method: str) -> float:  # interference only slows a run: the least of the rounds' medians
        return min(run[method]["total_s"]["median"] for run in runs)

    def paired(method: str | None) -> float | None:  # turn by turn, over every round's turns (in turns only)
        if not interleave or method is None:
            return None
        each = [(run[method]["total_s"]["each"], run[fastest]["total_s"]["each"]) for run in runs]
        return statistics.median(mine / best for turns in each for mine, best in zip(*turns))

    measured = [m for m in (*FIXED, "auto") if m in runs[0]]
    fixed = {m: least(m) for m in FIXED if m in runs[0]}
    fastest = min(fixed, key=fixed.get)
    picked = runs[0]["auto"]["chosen"]
    as_fixed = fixed_method(picked, world_size)
    return {
        "seq_len": seq_len,
        "world_size": world_size,
        "causal": causal,
        "fixed_s": fixed,
        "fastest": fastest,
        "picked": picked,
        "picked_ratio": fixed[as_fixed] / fixed[fastest] if as_fixed in fixed else None,
        "rounds_s": {m: [run[m]["total_s"]["median"] for run in runs] for m in measured},
        "spread_s": {m: [run[m]["total_s"] for run in runs] for m in measured},  # each round's median, min, max
        "auto_s": least("auto"),
        "auto_ratio": least("auto") / fixed[fastest],
        "picked_paired": paired(as_fixed if as_fixed in fixed else None),
        "auto_paired": paired("auto"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=3, help="measured calls per method below 32768 tokens")
    parser.add_argument("--long-repeats", type=int, default=1, help="measured calls per method at 32768 tokens")
    parser.add_argument("--hardware", metavar="FILE", help="a `ringpass bench --calibrate --json` file")
    parser.add_argument("--masks", nargs="+", choices=["causal", "none"], default=["causal", "none"])
    parser.add_argument("--no-throwaway", action="store_true", help="no unrecorded first method")
    parser.add_argument(
        "--rounds", metavar="K", type=int, default=1, help="each cell K times (fresh processes); each method's least"
    )
    parser.add_argument("--interleave", action="store_true", help="measure the methods in turns (see above)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    hardware = load_hardware(args.hardware) if args.hardware else None
    cells = []
    print(
        f"{'N':>6} {'P':>2} {'mask':<7} {'fastest fixed':<16} {'s':>8}  {'auto picks':<18} "
        f"{'pick/fastest':>12} {'auto/fastest':>12}" + (f" {'paired pick':>11} {'paired auto':>11}" * args.interleave)
    )
    for seq_len in args.seq_lens:
        for world_size in args.world_sizes:
            for causal in [mask == "causal" for mask in args.masks]:
                repeats = args.long_repeats if seq_len >= 32768 else args.repeats
                c = cell(
                    seq_len, world_size, causal, repeats, hardware, not args.no_throwaway, args.rounds, args.interleave
                )
                cells.append(c)
                ratio = "-" if c["picked_ratio"] is None else f"{c['picked_ratio']:.3f}"
                paired = "".join(
                    f" {'-' if c[k] is None else format(c[k], '.3f'):>11}" for k in ("picked_paired", "auto_paired")
                )
                print(
                    f"{seq_len:>6} {world_size:>2} {'causal' if causal else 'none':<7} {c['fastest']:<16} "
                    f"{c['fixed_s'][c['fastest']]:>8.3f}  {c['picked']:<18} {ratio:>12} {c['auto_ratio']:>12.3f}"
                    + (paired if args.interleave else ""),
                    flush=True,
                )
                if args.json:  # after every cell: a run stopped early keeps the cells it finished
                    with open(args.json, "w") as f:
                        json.dump(cells, f, indent=1)


if __name__ == "__main__":
    main()
