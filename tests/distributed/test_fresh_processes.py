"""What a user runs in a fresh process: ``import ringpass`` (what it loads and patches), and the ``ringpass``
command (``inspect`` on a Hugging Face config, ``plan``). Each starts an interpreter, so none is a unit test."""

import json
import subprocess
import sys
from pathlib import Path

import inspect_targets

ROOT = Path(__file__).resolve().parents[2]


def test_importing_ringpass_patches_nothing_in_torch():
    """The DDP graph splitter is wrapped when a ring backend is first made or looked up, not at ``import ringpass``."""
    code = (
        "import sys, ringpass, torch._dynamo.backends.distributed as d\n"
        "print(getattr(d.DDPOptimizer.compile_fn, '_ringpass_keeps_ring_graphs_whole', False), "
        "any(type(f).__module__.startswith('ringpass') for f in sys.meta_path))\n"
        "import torch\n"
        "torch.compile(torch.nn.Linear(2, 2), backend='ring')\n"
        "print(getattr(d.DDPOptimizer.compile_fn, '_ringpass_keeps_ring_graphs_whole', False))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False", "False", "True"], done.stdout


def test_importing_ringpass_loads_neither_dynamo_nor_triton():
    """`import ringpass` stays light: Dynamo imports Triton, and Triton reads ``TRITON_INTERPRET`` when it is first
    imported, so a Dynamo import here would fix that setting before the user (or tests/kernels/test_triton_kernels.py)
    sets it. The backend wraps Dynamo's DDP graph splitter when Dynamo loads it
    (`ringpass.frontend.ddp_whole_graph`)."""
    code = "import sys, ringpass; print(sorted(m for m in ('torch._dynamo', 'triton') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr[-2000:]


def test_hugging_face_config_on_the_meta_device_end_to_end(tmp_path):
    """The console script, as a user runs it: a local config, no weights, a long sequence."""
    config = inspect_targets.llama_config_file(tmp_path)
    out = tmp_path / "plan.json"
    result = subprocess.run(
        [
            str(Path(sys.executable).with_name("ringpass")),
            "inspect",
            "--hf-config",
            config,
            "--world-size",
            "8",
            "--labels",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    graph = json.loads(out.read_text())["graphs"][0]
    n, world = 8192, 8  # the config's max_position_embeddings
    assert graph["seq_len"] == n and graph["tokens_per_rank"] == [n // world] * world
    assert [a["module"] for a in graph["attentions"]] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert graph["ring"][0]["kv_bytes_per_hop"] == 2 * 1 * 2 * (n // world) * 32 * 4
    names = {v["name"]: v["placement"] for v in graph["inputs"]}
    assert names == {"input_ids": "sharded", "labels": "whole"}
    assert "2 x model.layers.{0-1}.self_attn: sdpa (causal" in result.stdout  # identical attentions: one line


def test_plan_command_prints_and_writes_json(tmp_path):
    out = tmp_path / "plan.json"
    command = "plan --world-size 2 --seq-len 16384 --heads 4 --head-dim 64 --dtype fp32 --link loopback --device cpu"
    run = subprocess.run(
        [sys.executable, "-m", "ringpass.cli", *command.split(), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "recommendation: ring, layout zigzag" in run.stdout
    data = json.loads(out.read_text())
    assert data["world_size"] == 2 and data["hides"] and data["forward_s"] > 0
