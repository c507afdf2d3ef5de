"""``ringpass bench`` at tiny sizes: valid JSON, a PNG, traces with the ring's step ranges, a method that
cannot run reported with its reason; the all-gather baseline against fp64 SDPA; how memory is measured;
the calibration fit and the cost model's additions, against hand-computed cases."""

import json
import shlex
import statistics

import bench_workers
import pytest

from lowering.costmodel import AttentionShape, Hardware, all_gather_seconds, ring_cost
from lowering.errors import InvalidInputError
from lowering.layout import Layout
from ringpass import cli
from ringpass.cli.bench import BenchConfig, calibrate
from ringpass.cli.bench.measure import MMAP_THRESHOLD
from ringpass.cli.launch import spawn_ranks
from ringpass.hardware import load_hardware


@pytest.mark.parametrize("kind,causal", [("zigzag", True), ("contiguous", False)])
def test_all_gather_baseline_is_exact_with_gradients(kind, causal):
    for result in spawn_ranks(bench_workers.gathered_matches_fp64_sdpa, 2, (kind, causal), timeout=120):
        assert max(result["errors"].values()) < 1e-5, result["errors"]
        assert result["waits"] == ["kv all-gather", "kv all-gather", "dkv reduce-scatter"]  # forward, backward
        assert result["exchanges"] == 0  # nothing went around the ring


def test_peak_memory_counts_what_the_call_held_not_what_was_freed_before(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", MMAP_THRESHOLD)
    result = spawn_ranks(bench_workers.peak_of_a_freed_allocation, 1, timeout=60)[0]
    assert result["unavailable"] is None
    mib = 2**20  # the kernel's resident-set counters lag by up to 64 pages per thread: 1 MiB of slack
    assert 63 * mib <= result["peak"] < 72 * mib  # the freed 128 MiB before it is not counted
    assert 0.5 * mib <= result["small"] < 4 * mib  # nor the 64 MiB freed inside the previous call


def test_interleave_measures_the_methods_in_turns_each_turn_starting_one_later():
    """``ringpass bench --interleave`` (docs/performance.md, "Choosing a strategy"): after every method's warm-up
    call, measured calls go round the methods, turn t starting with method t; without it each method's calls run
    together. Every call exact against fp32 SDPA either way."""
    z, g, u = "ring-zigzag", "all-gather", "ulysses"
    for result in spawn_ranks(bench_workers.methods_in_turns_or_one_after_another, 2, timeout=120):
        assert result[False]["order"] == [z, z, z, g, g, g, u, u, u]
        assert result[True]["order"] == [z, g, u, g, u, z, u, z, g]
        assert result[False]["error"] < 1e-5 and result[True]["error"] < 1e-5


def test_interleave_is_refused_outside_the_attention_bench():
    with pytest.raises(InvalidInputError, match="--interleave is for --what attention"):
        BenchConfig(what="decode", methods=("sdpa",), interleave=True)


def test_working_memory_and_all_gather_time_by_hand():
    """P=2, N=8, one head of dim 1, fp32: n=4 tokens per rank, q/out 16 B, one of k/v 16 B, lse 16 B."""
    shape = AttentionShape(batch=1, query_heads=1, kv_heads=1, head_dim=1, itemsize=4)
    cost = ring_cost(Layout("contiguous", 2, 8), shape)
    # forward: out acc 16 + lse 16 + two stacked KV blocks 2 x 32; backward: out 16 + lse 16 + dq 16 +
    # three dK/dV accumulators 3 x 32 + two KV blocks 2 x 32 + returned dk, dv 32
    assert cost.working_memory() == {"forward": 96, "backward": 240}
    hw = Hardware(link_bytes_per_s=32, link_latency_s=0.0, flops_per_s=64)
    # backward: gather one 32-byte block (1 s), 2 steps x 1 s x 2.5, reduce-scatter one fp32 block (1 s)
    assert all_gather_seconds(cost, hw, backward=True) == 1.0 + 5.0 + 1.0


def test_calibration_fits_latency_and_bandwidth():
    points = [(b, 2e-4 + b / 1.5e9) for b in calibrate.SIZES]
    bandwidth, latency = calibrate.fit_link(points)
    assert bandwidth == pytest.approx(1.5e9, rel=1e-9) and latency == pytest.approx(2e-4, rel=1e-6)


def test_bench_attention_writes_json_png_and_traces(tmp_path, capsys):
    """With ``--warmup 0`` the first call is measured, and a method that cannot run here still gets its reason (it
    crashed on CPU before: only warm-up calls were checked for context_parallel's availability)."""
    out, png, traces = tmp_path / "bench.json", tmp_path / "bench.png", tmp_path / "traces"
    assert (
        cli.main(
            shlex.split(
                "bench --world-size 2 --seq-len 64 --heads 4 --kv-heads 2 --head-dim 8 --repeats 2 --warmup 0 "
                f"--json {out} --plot {png} --trace {traces} --no-progress"
            )
        )
        == 0
    )
    table = capsys.readouterr().out
    summary = json.loads(out.read_text())
    rows = {(r["method"], r["world_size"], r["threads"]): r for r in summary["rows"]}
    unavailable = rows[("context-parallel", 2, 1)]
    assert "unavailable" in unavailable and unavailable["unavailable"]  # never a number, always a reason
    assert "unavailable: " + unavailable["unavailable"] in table
    for method in ("ring-zigzag", "ring-contiguous", "all-gather"):
        row = rows[(method, 2, 1)]
        assert row["error"] < 1e-5  # checked against SDPA on the whole sequence
        assert row["total_s"]["min"] <= row["total_s"]["median"] <= row["total_s"]["max"]
        each = row["total_s"]["each"]  # every repeat's time, in the order measured
        assert len(each) == 2 and row["total_s"]["median"] == statistics.median(each)
        assert row["forward_s"]["median"] < row["total_s"]["median"]
        assert 0.0 <= row["hidden"] <= 1.0 and row["balance"] >= 1.0
        assert row["predicted"]["total_s"] > 0 and row["efficiency"] > 0 and row["vs_same_cores"] > 0
        assert row["total_mib"] is not None and row["total_mib"] >= 0
    assert rows[("ring-zigzag", 2, 1)]["need_mib"]["backward"] > rows[("ring-zigzag", 2, 1)]["need_mib"]["forward"]
    assert rows[("all-gather", 2, 1)]["hidden"] == 0.0
    assert rows[("sdpa", 1, 1)]["efficiency"] == 1.0 and ("sdpa", 1, 2) in rows  # one thread, and the ranks' two
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {"sdpa-P1-N64-T1-rank0.json", "sdpa-P1-N64-T2-rank0.json"} <= {p.name for p in traces.iterdir()}
    for rank in (0, 1):
        trace = json.loads((traces / f"ring-zigzag-P2-N64-T1-rank{rank}.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        for part in ("post", "compute", "wait"):
            assert f"ringpass forward step 0: {part}" in names and f"ringpass backward step 1: {part}" in names


def test_bench_packed_documents_counts_each_ranks_pairs(tmp_path, capsys):
    """``--packed``: the issue's row (2400, 900, 500 and 296 tokens); every method exact against SDPA run per
    document; the documents layout's ranks score pairs within 5 % of each other, zigzag's over the row do not (1.44:
    counted from the kernel calls, not timed); a long document split over the ranks makes every block travel, ten
    documents of 50 tokens and two of 20 send nothing on the documents' layout (each whole on one rank), where zigzag
    cuts some; the same documents unpacked (``ring-padded``: a row each, padded to the longest) score the padded rows'
    triangles. The pairs the documents skip and the bytes not sent are counted.
    Unknown spellings and --seq-len with it are refused."""
    out = tmp_path / "packed.json"
    command = "bench --world-size 2 --packed 2400 900 500 296 --heads 2 --kv-heads 1 --head-dim 8 --repeats 1"
    assert cli.main(shlex.split(f"{command} --warmup 0 --json {out} --no-progress")) == 0
    assert "one row packed from 4 documents (1 x 2400 + 1 x 900 + 1 x 500 + 1 x 296)" in capsys.readouterr().out
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"] if r["world_size"] == 2}
    assert set(rows) == {"all-gather", "ring-contiguous", "ring-zigzag", "ring-documents"}
    for method, row in rows.items():
        assert row["error"] < 1e-5, (method, row["error"])
        assert "predicted" not in row  # the cost model prices one triangle, not documents
    assert rows["ring-documents"]["pairs_balance"] <= 1.05 < 1.3 < rows["ring-zigzag"]["pairs_balance"]
    assert rows["ring-documents"]["sent_mib"] == rows["ring-zigzag"]["sent_mib"] > 0  # a long document: the whole lap
    short = "bench --world-size 2 --packed 50x10 20x2 --heads 2 --kv-heads 1 --head-dim 8 --repeats 1 --warmup 0"
    methods = "ring-documents ring-zigzag ring-padded"
    assert cli.main(shlex.split(f"{short} --methods {methods} --json {out} --no-progress")) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"] if r["world_size"] == 2}
    assert rows["ring-documents"]["sent_mib"] == 0 < rows["ring-zigzag"]["sent_mib"]  # zigzag cuts documents
    assert rows["ring-documents"]["pairs_scored"] == 10 * (50 * 51 // 2) + 2 * (20 * 21 // 2)  # each document's
    assert rows["ring-padded"]["pairs_scored"] == 12 * (50 * 51 // 2)  # twelve rows of 50, the short ones padded
    documents = rows["ring-documents"]["pairs_scored"]
    for method in ("ring-documents", "ring-zigzag"):  # the row's causal triangle less its documents' pairs, skipped
        assert rows[method]["pairs_skipped"] == 540 * 541 // 2 - documents, (method, rows[method])
    assert rows["ring-padded"]["pairs_skipped"] == 0 and rows["ring-padded"]["unsent_mib"] == 0
    assert rows["ring-documents"]["unsent_mib"] > 0 == rows["ring-documents"]["sent_mib"]  # the whole lap, unsent
    assert max(row["error"] for row in rows.values()) < 1e-5
    for word, words in (("20y6", "give lengths as 512 or 512x16"), ("0", "give lengths")):
        assert cli.main(["bench", "--packed", word]) == 1 and words in capsys.readouterr().err
    assert cli.main(["bench", "--packed", "64", "--seq-len", "64"]) == 1
    assert "drop --seq-len" in capsys.readouterr().err


@pytest.mark.heavy  # three compiles on two ranks and two in one process: ~60 s
def test_bench_model_packed_rows_balance_the_documents(tmp_path, capsys):
    """``--what model --packed``: position ids restarting at each document; the ring on zigzag and on the documents'
    layout match the unsharded loss, and the documents' layout balances the pairs the ranks' kernels score."""
    out = tmp_path / "model-packed.json"
    command = (
        "bench --what model --world-size 2 --packed 200 60 40 --hidden 32 --layers 1 --heads 4 --kv-heads 2 "
        f"--intermediate 64 --vocab 61 --compiler aot_eager --repeats 1 --warmup 0 --json {out} --no-progress"
    )
    assert cli.main(shlex.split(command)) == 0
    assert "bal pairs" in capsys.readouterr().out
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"] if r["world_size"] == 2}
    assert set(rows) == {"ring", "ring-documents"}
    for row in rows.values():
        assert row["exchanges"] > 0 and row["loss_error"] < 1e-5, row
    assert rows["ring-documents"]["pairs_balance"] <= 1.05 < 1.2 < rows["ring"]["pairs_balance"], rows


@pytest.mark.heavy  # two compiles on two ranks and two in one process: ~40 s
def test_bench_model_runs_the_ring_and_matches_the_unsharded_loss(tmp_path, capsys):
    out, traces = tmp_path / "model.json", tmp_path / "traces"
    assert (
        cli.main(
            shlex.split(
                "bench --what model --world-size 2 --seq-len 32 --hidden 32 --layers 1 --heads 4 --kv-heads 2 "
                f"--intermediate 64 --vocab 61 --compiler aot_eager --repeats 1 --json {out} --trace {traces} "
                "--no-progress"
            )
        )
        == 0
    )
    rows = {(r["method"], r["threads"]): r for r in json.loads(out.read_text())["rows"]}
    ring = rows[("ring", 1)]
    assert ring["exchanges"] > 0  # the ring ran
    assert ring["loss_error"] < 1e-5 and ring["tokens_per_s"] > 0
    assert ("unsharded", 1) in rows and ("unsharded", 2) in rows
    assert "ring" in capsys.readouterr().out
    names = {e.get("name") for e in json.loads((traces / "model-ring-P2-N32-T1-rank1.json").read_text())["traceEvents"]}
    assert "ringpass backward step 1: compute" in names


@pytest.mark.heavy  # suite time; the decode attention itself is checked in test_decode
def test_bench_decode_reads_each_rank_s_part_of_the_cache_and_merges_once(tmp_path, capsys):
    out = tmp_path / "decode.json"
    assert (
        cli.main(shlex.split(f"bench --what decode --world-size 2 --seq-len 64 --repeats 2 --json {out} --no-progress"))
        == 0
    )
    rows = {(r["method"], r["world_size"], r["threads"]): r for r in json.loads(out.read_text())["rows"]}
    sharded, gathered, whole = rows[("sharded", 2, 1)], rows[("gathered", 2, 1)], rows[("sdpa", 1, 1)]
    assert all(r["error"] < 1e-5 for r in rows.values())
    assert sharded["merges"] == 1 and sharded["kv_exchanges"] == 0 and gathered["merges"] == 0
    assert sharded["cache_mib"] == pytest.approx(whole["cache_mib"] / 2) and gathered["cache_mib"] == whole["cache_mib"]
    assert sharded["predicted"]["merge_s"] > 0 and whole["predicted"]["merge_s"] == 0
    assert "ringpass bench --what decode" in capsys.readouterr().out


@pytest.mark.heavy  # compiles a prefill and decode steps by three methods (~45 s)
def test_bench_generate_keeps_the_cache_sharded_and_the_tokens_the_model_s(tmp_path, capsys):
    out = tmp_path / "generate.json"
    assert (
        cli.main(
            shlex.split(
                "bench --what generate --world-size 2 --seq-len 40 --hidden 32 --layers 1 --heads 4 "
                "--kv-heads 2 --intermediate 64 --vocab 61 --compiler aot_eager --repeats 2 --warmup 3 "
                f"--json {out} --no-progress"
            )
        )
        == 0
    )
    rows = {(r["method"], r["world_size"], r["threads"]): r for r in json.loads(out.read_text())["rows"]}
    sharded, gathered = rows[("sharded", 2, 1)], rows[("gathered", 2, 1)]
    for row in (sharded, gathered):
        assert row["same_tokens"] and row["same_on_every_rank"], row
    assert sharded["merges"] == 5 and sharded["cache_gathers"] == 0 and gathered["merges"] == 0  # 1 layer, 5 steps
    assert sharded["cache_mib"] < gathered["cache_mib"] == rows[("unsharded", 1, 1)]["cache_mib"]
    assert "ringpass bench --what generate" in capsys.readouterr().out


@pytest.mark.heavy  # a compile on two ranks
def test_bench_model_takes_a_hugging_face_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(tmp_path / "cfg")
    out = tmp_path / "model.json"
    assert (
        cli.main(
            [
                "bench",
                "--what",
                "model",
                "--hf-config",
                str(tmp_path / "cfg"),
                "--world-size",
                "2",
                "--seq-len",
                "32",
                "--methods",
                "ring",
                "--compiler",
                "aot_eager",
                "--repeats",
                "1",
                "--json",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    (ring,) = json.loads(out.read_text())["rows"]
    assert ring["exchanges"] > 0 and "cfg" in json.loads(out.read_text())["config"]["hf_config"]


@pytest.mark.heavy  # the calibration measures every rate on two ranks (~45 s); its fit is checked above
def test_calibrate_then_plan_with_it(tmp_path, capsys):
    hardware = tmp_path / "hardware.json"
    assert cli.main(["bench", "--calibrate", "--json", str(hardware)]) == 0
    data = json.loads(hardware.read_text())
    assert data["link_bytes_per_s"] > 0 and data["flops_per_s"] > 0
    assert data["gemm_flops_per_s"] > 0 and data["memory_bytes_per_s"] > 0 and 0 < data["op_overhead_s"] < 1e-3
    loaded = load_hardware(str(hardware))  # what `ringpass plan --hardware` prices a step's other work with
    assert (loaded.gemm_flops_per_s, loaded.op_overhead_s) == (data["gemm_flops_per_s"], data["op_overhead_s"])
    assert [d for d, _, _ in loaded.head_dim_rates] == [32, 64, 128]  # the attention kernels by head dim
    assert loaded.attention_flops_per_s(64) == data["flops_per_s"] > 0
    assert loaded.attention_flops_per_s(64, kernel="sdpa") == data["sdpa_flops_per_s"] > 0
    assert (
        cli.main(
            shlex.split(
                "plan --world-size 2 --seq-len 16384 --heads 8 --kv-heads 2 --head-dim 64 --dtype fp32 "
                f"--hardware {hardware}"
            )
        )
        == 0
    )
    assert "link calibrated" in capsys.readouterr().out


def test_bench_refuses_unknown_methods_and_bad_calibration_files(tmp_path, capsys):
    assert cli.main(["bench", "--methods", "ring-spiral"]) == 1
    assert "unknown method(s) ring-spiral" in capsys.readouterr().err
    assert cli.main(["bench", "--world-size", "1"]) == 1  # a ring of one would run nothing distributed: refused
    assert "world sizes must be at least 2" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert (
        cli.main(
            ["plan", "--world-size", "2", "--seq-len", "64", "--heads", "1", "--head-dim", "8", "--hardware", str(bad)]
        )
        == 1
    )
    assert "not a calibration file" in capsys.readouterr().err


@pytest.mark.heavy  # torchrun starts two processes: ~15 s
def test_bench_under_torchrun_measures_the_launched_ranks(tmp_path):
    """Under torchrun the bench runs in the launched ranks (gloo on CPU here; NCCL on GPUs), the single-process
    baseline on rank 0; peak memory needs MALLOC_MMAP_THRESHOLD_ exported, as the docs say."""
    import os
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "ringpass.cli",
            "bench",
            "--seq-len",
            "64",
            "--methods",
            "sdpa",
            "ring-zigzag",
            "--repeats",
            "1",
            "--json",
            str(out),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    rows = {(r["method"], r["world_size"]): r for r in json.loads(out.read_text())["rows"]}
    ring = rows[("ring-zigzag", 2)]
    assert ring["error"] < 1e-5 and ring["total_mib"] is not None and ring["hidden"] is not None, ring
    assert ("sdpa", 1) in rows


@pytest.mark.heavy  # two spawns of six methods (~40 s)
@pytest.mark.parametrize("order", [[], ["--interleave"]])
def test_the_strategy_grid_script_at_a_tiny_size(tmp_path, order):
    """`examples/strategy_grid.py` (docs/performance.md, "Choosing a strategy") on one tiny cell, two rounds, the
    methods one after another or in turns: every fixed method measured, each the least of its rounds, auto's pick
    named, and the ratios taken against the fastest fixed method (in turns also turn by turn, over both rounds)."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "grid.json"
    argv = ["--seq-lens", "256", "--world-sizes", "2", "--masks", "causal", "--repeats", "1", "--rounds", "2", *order]
    argv += ["--json"]
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "examples/strategy_grid.py", *argv, str(out)], cwd=root, check=True, timeout=600)
    (cell,) = json.loads(out.read_text())
    assert set(cell["fixed_s"]) == {"ring-zigzag", "ring-contiguous", "all-gather", "ulysses"}
    assert cell["fastest"] == min(cell["fixed_s"], key=cell["fixed_s"].get)
    for method, seconds in cell["fixed_s"].items():
        assert len(cell["rounds_s"][method]) == 2 and seconds == min(cell["rounds_s"][method])
    assert cell["picked"] and cell["auto_ratio"] == cell["auto_s"] / cell["fixed_s"][cell["fastest"]]
    if not order:  # one method after another: no turns to pair
        assert cell["auto_paired"] is None and cell["picked_paired"] is None
        return
    turns = [
        mine / best
        for auto, fastest in zip(cell["spread_s"]["auto"], cell["spread_s"][cell["fastest"]])
        for mine, best in zip(auto["each"], fastest["each"], strict=True)
    ]
    assert len(turns) == 2 and cell["auto_paired"] == statistics.median(turns)
