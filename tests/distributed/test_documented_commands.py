"""Every command line README.md and docs/*.md show in a ``` block runs as a user would type it, made small.

The lines are read from the pages, so a newly documented line is tested without editing this file; one whose
command no table names fails, asking for a rule. SHRINK runs a command in the default suite with options that
make it take seconds; HEAVY runs it the same way under ``-m heavy`` (it takes minutes even made small); SKIP
says why a line is not run here. ``ringpass`` lines run in this process (``ringpass.cli.main``, what the console
script calls), the others as subprocesses; every one must exit 0, in a folder holding the files the lines
name (``my_model.py``, ``config.json``, ``path/to/config.json``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ringpass import cli

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", re.M | re.S)
# what a user types: VAR=value assignments, then ringpass <subcommand>, python examples/<x>.py, torchrun or ./dev
COMMAND = re.compile(r"^(?:[A-Z_]+=\S*\s+)*(?:ringpass [a-z-]+|python examples/\S+\.py|torchrun|\./dev)(?:\s|$)")

# command (the longest key that starts the line) -> what is added to it; an added option replaces its documented
# value(s), and VAR=value words set the environment
SHRINK = {
    "ringpass demo": "--seq-len 64",
    "ringpass inspect": "",  # on meta tensors: any length takes seconds
    "ringpass convert": "--seq-len 64",
    "ringpass plan": "",  # arithmetic only
    "ringpass plan --hf-config": "--seq-len 256",  # fake training steps of the 1-layer config.json
    "ringpass bench": "--seq-len 64 --repeats 1",
    "ringpass bench --packed": "--packed 300 20x6 7 --world-size 2 --repeats 1 --warmup 0",
    "ringpass bench --what model": "--seq-len 64 --repeats 1 --hidden 32 --layers 1 --intermediate 64 --vocab 64",
    "ringpass bench --what model --packed": "--packed 40 13 11 --repeats 1 --warmup 0 --hidden 32 --layers 1 "
    "--intermediate 64 --vocab 64 --compiler aot_eager",
    "python examples/model_coverage.py": "llama --no-write",  # one family; the page is not rewritten
    "python examples/gpu_check.py": "TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=",  # its tiny CPU run
    "python examples/boundary_memory.py": "--seq-len 64 --hidden 32 --layers 2",
    "python examples/mask_crossing_memory.py": "--seq-len 64 --hidden 32",
    "python examples/mixer_cost.py": "--seq-lens 64 --world-sizes 2 --hidden 32",
    "python examples/scan_strategies.py": "--seq-lens 64 --world-sizes 2",
    "python examples/plan_check.py": "--model llama --seq-len 512 --world-sizes 1,2",
    "python examples/plan_check.py --spread": "--rows 0,13 --seq-len 512",  # the issue's row and an optimizer peak
    "python examples/perf_record.py": "--seq-len 128 --mask-seq-len 128 --repeats 1 --no-write",
    "python examples/compare_commits.py": "--seq-len 64 --turns 1 --calls 1",
    "python examples/causal_split.py": "--sizes 256 --repeats 1",
    "python examples/strategy_grid.py": "--seq-lens 256 --world-sizes 2 --masks causal --repeats 1 --long-repeats 1",
}
HEAVY = {  # why each runs only with -m heavy (times measured on 2 busy cores)
    "ringpass bench": "fresh processes for every method: 12-40 s a line",
    "python examples/model_coverage.py": "compiles a Hugging Face model on 2 ranks: 1-2 minutes",
    "python examples/gpu_check.py": "the Triton kernels in the interpreter: 2 minutes idle, 11 on busy cores",
    "python examples/boundary_memory.py": "six spawns of fresh processes, each compiling: about a minute made small",
    "python examples/mask_crossing_memory.py": "three spawns of fresh processes compiling a Hugging Face model: 30 s",
    "python examples/mixer_cost.py": "two spawns of fresh processes compiling a Hugging Face model: 30 s",
    "python examples/scan_strategies.py": "six spawns of fresh processes: 19 s made small",
    "python examples/plan_check.py": "four spawns of fresh processes training a Hugging Face model: a minute",
    "python examples/plan_check.py --spread": "a plan and a measured step per row, each spawning its ranks",
    "python examples/strategy_grid.py": "a spawn measuring five methods: about 20 s made small",
    "python examples/compare_commits.py": "a checkout and a torchrun launch per commit: 10 s a commit made small",
    "python examples/perf_record.py": "a bench spawn and a spawn of the mask cases: 20 s made small",
    "ringpass plan --hf-config": "fake steps at four ring sizes, three compiled (~20 s): test_plan checks by hand",
}
SKIP = {
    "./dev test": "the test suite itself, this file included",
    "./dev lint": "ruff over the repository: a CI step of its own (.ci/run)",
    "torchrun": "the examples, under torchrun in tests/distributed/test_examples.py (checked below: every such script)",
}
RUN_AS = {"./dev demo": "ringpass demo"}  # ./dev installs the project, then runs this: the install is not repeated


def documented_lines() -> list[tuple[str, str]]:
    """(page:line number, command) for every command line inside a ``` block; a line shown on several pages
    once, where it is first shown."""
    found = {}
    for page in PAGES:
        text = page.read_text()
        for block in FENCE.finditer(text):
            first = text.count("\n", 0, block.start(1)) + 1
            for number, line in enumerate(block.group(1).splitlines(), first):
                if COMMAND.match(line.strip()):
                    found.setdefault(line.strip(), f"{page.relative_to(ROOT)}:{number}")
    return [(where, line) for line, where in found.items()]


def rule(words: list[str], table: dict) -> str | None:
    """The longest key of ``table`` that the command ``words`` starts with (whole words), or None."""
    keys = [key for key in table if words[: len(key.split())] == key.split()]
    return max(keys, key=len, default=None)


def split_environment(words: list[str]) -> tuple[dict, list[str]]:
    """(the leading VAR=value words as a dict, the rest)."""
    environment = {}
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        name, value = words.pop(0).split("=", 1)
        environment[name] = value
    return environment, words


def command_of(line: str) -> tuple[dict, list[str]]:
    """The line's environment and words, with RUN_AS applied."""
    environment, words = split_environment(shlex.split(line, comments=True))
    alias = rule(words, RUN_AS)
    return environment, shlex.split(RUN_AS[alias]) + words[len(alias.split()) :] if alias else words


def shrunk(words: list[str], added: list[str]) -> list[str]:
    """``words`` with ``added`` appended, each option in ``added`` removed first with its documented values."""
    replaced = {word for word in added if word.startswith("--")}
    kept, dropping = [], False
    for word in words:
        if word.startswith("-"):
            dropping = word in replaced
        if not dropping:
            kept.append(word)
    return kept + added


def _param(where: str, line: str):
    """The line as a test case: skipped with SKIP's reason, marked heavy, or in the default suite."""
    words = command_of(line)[1]
    skip = rule(words, SKIP)
    if skip:
        return pytest.param(line, id=where, marks=pytest.mark.skip(reason=SKIP[skip]))
    heavy = [pytest.mark.heavy, pytest.mark.timeout(900)] if rule(words, HEAVY) else []
    return pytest.param(line, id=where, marks=heavy)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A folder with the files the documented lines name: a small attention model, a tiny Llama config and a
    calibration file."""
    folder = tmp_path_factory.mktemp("documented")
    (folder / "my_model.py").write_text("""
import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalAttention(nn.Module):
    def __init__(self, vocab=32, hidden=16, heads=2):
        super().__init__()
        self.heads, self.embed = heads, nn.Embedding(vocab, hidden)
        self.qkv, self.out = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)

    def forward(self, ids):
        x = self.embed(ids)
        b, n, h = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, h))


def build(seq_len=64, batch=1):
    return CausalAttention(), (torch.randint(0, 32, (batch, seq_len)),)
""")
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
    }
    (folder / "path" / "to").mkdir(parents=True)
    for path in ("config.json", "path/to/config.json"):
        (folder / path).write_text(json.dumps(config))
    calibration = {  # what `ringpass bench --calibrate --json hw.json` writes, at this machine's rates
        "link_bytes_per_s": 1e9,
        "link_latency_s": 1e-3,
        "flops_per_s": 4.7e10,
        "head_dim_rates": [{"head_dim": 64, "flops_per_s": 4.7e10, "sdpa_flops_per_s": 5.3e10}],
        "gemm_flops_per_s": 8e10,
        "memory_bytes_per_s": 3e10,
        "op_overhead_s": 2e-6,
    }
    (folder / "hw.json").write_text(json.dumps(calibration))
    return folder


@pytest.mark.parametrize("line", [_param(where, line) for where, line in documented_lines()])
def test_documented_command_runs(line, workdir, monkeypatch, capsys):
    environment, words = command_of(line)
    key = rule(words, SHRINK)
    assert key is not None, f"{line!r}: add its command to SHRINK (how to run it small), HEAVY or SKIP"
    added_environment, added = split_environment(shlex.split(SHRINK[key]))
    argv = shrunk(words, added)
    monkeypatch.chdir(workdir)
    if argv[0] == "ringpass":
        try:
            code = cli.main(argv[1:])
        except SystemExit as bad_command_line:  # argparse's exit
            code = bad_command_line.code
        output = capsys.readouterr()
        assert code == 0, f"{argv}: exit {code}\n{output.out[-3000:]}\n{output.err[-3000:]}"
        return
    argv = [
        sys.executable if word == "python" else str(ROOT / word) if word.startswith("examples/") else word
        for word in argv
    ]
    done = subprocess.run(
        argv, env={**os.environ, **environment, **added_environment}, capture_output=True, text=True, timeout=800
    )
    assert done.returncode == 0, f"{argv}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def test_documented_torchrun_examples_are_run_by_the_example_tests():
    """SKIP's reason for torchrun lines holds: tests/distributed/test_examples.py runs each script they name."""
    example_tests = (ROOT / "tests" / "distributed" / "test_examples.py").read_text()
    scripts = {
        word.removeprefix("examples/")
        for _, line in documented_lines()
        for word in shlex.split(line, comments=True)
        if line.startswith("torchrun") and word.startswith("examples/")
    }
    assert scripts, "no torchrun line found in the pages: the extraction is broken"
    assert {s for s in scripts if f'"{s}"' not in example_tests} == set()


def test_the_extraction_finds_commands_and_leaves_output_alone():
    """The pages' known lines are found (the first README block, a docs page's), and report lines that start
    with ``ringpass`` (``ringpass inspect: every attention ...``, ``ringpass: graph 0 ...``) are not commands."""
    lines = [line for _, line in documented_lines()]
    assert any(line.startswith("./dev demo") for line in lines)
    assert any(line.startswith("ringpass plan ") and "--ulysses" in line for line in lines)
    assert not [line for line in lines if re.match(r"ringpass( [a-z]+)?:", line)]


def test_no_page_names_an_issue_number():
    """The pages describe the product as it is; where a feature came from is the history's business (git log)."""
    found = [
        f"{page.relative_to(ROOT)}:{number}: {line.strip()}"
        for page in PAGES
        for number, line in enumerate(page.read_text().splitlines(), 1)
        if re.search(r"\bissues? \d+|\(#\d+\)", line, re.I)
    ]
    assert not found, "\n".join(found)
