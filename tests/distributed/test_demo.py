"""`ringpass demo` end to end on 2 CPU processes, small enough for the suite."""

from ringpass import cli
from ringpass.cli.demo import DemoConfig, run_demo


def test_demo_ring_matches_fp64_reference_and_reports_memory():
    report = run_demo(DemoConfig(seq_len=300, heads=4, kv_heads=2, head_dim=16), timeout=240)
    assert report["layout"] == "zigzag"
    for name, error in report["ring_error"].items():
        assert error < 1e-5, name
    assert len(report["ranks"]) == 2 and all(r["peak_rss_mib"] > 0 for r in report["ranks"])
    assert report["bytes"]["ring_per_rank"] < report["bytes"]["unsharded"]


def test_demo_command_prints_its_table(capsys):
    assert (
        cli.main(
            [
                "demo",
                "--seq-len",
                "64",
                "--heads",
                "2",
                "--kv-heads",
                "1",
                "--head-dim",
                "8",
                "--dtype",
                "float64",
                "--bidirectional",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "bidirectional attention" in printed and "contiguous layout over 2 CPU processes" in printed
    ring_row = next(line for line in printed.splitlines() if line.startswith("ring, 2 ranks"))
    out_error = float(ring_row.split()[-7])
    assert out_error < 1e-12
