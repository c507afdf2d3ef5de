"""examples/perf_record.py: the command appends one record a user can read back, in the history's format; the
repository's history (docs/bench/history.jsonl) keeps that format. Times are never asserted, only that each
number is there, positive, and of its kind."""

import json
import subprocess
import sys
from pathlib import Path

import perf_record
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_the_record_command_appends_one_checked_line_and_draws_the_history(tmp_path):
    """One run at a tiny size after a record already there: the file keeps it and gains the printed line; the plot
    draws both. (``--no-write`` runs in the documented-commands test.)"""
    history, png = tmp_path / "history.jsonl", tmp_path / "history.png"
    earlier = perf_record.HISTORY.read_text().splitlines()[0]
    history.write_text(earlier + "\n")
    command = [
        sys.executable,
        str(ROOT / "examples" / "perf_record.py"),
        *("--seq-len", "128", "--mask-seq-len", "128", "--repeats", "1", "--history", str(history)),
    ]
    result = subprocess.run([*command, "--plot", str(png)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    records = perf_record.read_history(history)
    assert len(records) == 2 and records[0] == json.loads(earlier)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == records[1]
    assert records[1]["seq_len"] == records[1]["mask_seq_len"] == 128 and records[1]["repeats"] == 1
    assert records[1]["commit"] and records[1]["torch"] == torch.__version__
    assert set(perf_record.IDEAL_KEYS) <= set(records[1])  # what the machine allows, beside the ring's numbers
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_repository_history_is_in_the_record_format():
    records = perf_record.read_history(perf_record.HISTORY)
    assert records, "docs/bench/history.jsonl has no record"
    assert [r["date"] for r in records] == sorted(r["date"] for r in records)  # appended in time order


@pytest.mark.parametrize(
    "change,words",
    [
        (lambda r: r.pop("documents"), "has the keys"),
        (lambda r: r.pop("vs_ideal"), "has the keys"),  # both or neither (the first records have neither)
        (lambda r: r.update(extra=1), "has the keys"),
        (lambda r: r.update(efficiency=-0.5), "'efficiency': expected a positive float"),
        (lambda r: r.update(seq_len=8192.0), "'seq_len': expected a positive int"),
        (lambda r: r.update(date="07.12.2026"), "Invalid isoformat"),
    ],
)
def test_a_malformed_record_is_refused_naming_the_field(change, words):
    record = perf_record.read_history(perf_record.HISTORY)[-1]
    change(record)
    with pytest.raises(ValueError, match=words):
        perf_record.check_record(record)


@pytest.mark.heavy  # two checkouts, two torchrun launches each: ~30 s
def test_comparing_commits_times_each_checkout_and_removes_them():
    """examples/compare_commits.py on HEAD and its parent at a tiny size: a time per turn for each, the checkouts
    gone afterwards."""
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True).stdout
    command = [sys.executable, str(ROOT / "examples" / "compare_commits.py"), "HEAD", "HEAD~1"]
    result = subprocess.run(
        [*command, "--seq-len", "64", "--turns", "2", "--calls", "1"], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    for rev in ("HEAD", "HEAD~1"):
        (line,) = [line for line in lines if line.split()[:1] == [rev]]
        assert len(line.split("turns: ")[1].split(", ")) == 2 and float(line.split()[1]) > 0, line
    assert subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True).stdout == worktrees
