"""The examples run as a user runs them (torchrun), with a timeout."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ring_attention_by_hand_under_torchrun():
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "examples" / "ring_attention_by_hand.py")],
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    errors = [float(e) for e in re.findall(r"max \|ring - sdpa\| = (\S+),", result.stdout)]
    assert len(errors) == 2 and max(errors) < 1e-5, result.stdout
