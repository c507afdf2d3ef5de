"""The pipeline runner: its stages, the graph it writes after each pass (``RINGPASS_DEBUG_DIR``), the pass a
refusal names, and the checks that catch a pass leaving a graph that no longer runs (``RINGPASS_CHECK_PASSES``,
on in every test: `conftest.py`). Offline, through `ringpass.inspect` or a backend that runs the pipeline."""

import logging
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ringpass
import ringpass.passes as passes
from ringpass.fx.context import PassContext
from ringpass.fx.report import Report
from ringpass.fx.runner import PassCheckError
from ringpass.options import RingOptions

RING, SDPA = "torch.ops.ringpass.ring_attention.default(", "torch._C._nn.scaled_dot_product_attention("


class Causal(nn.Module):
    """Embedding, one causal SDPA over two heads, a projection; ``mix`` adds a cumprod over the sequence after
    the attention (refused: only attention may mix a sharded activation's tokens)."""

    def __init__(self, mix: bool = False):
        super().__init__()
        self.mix = mix
        self.embed, self.qkv, self.out = nn.Embedding(50, 16), nn.Linear(16, 48), nn.Linear(16, 50)

    def forward(self, ids):
        b, n = ids.shape
        q, k, v = (t.view(b, n, 2, 8).transpose(1, 2) for t in self.qkv(self.embed(ids)).split(16, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, 16)
        return self.out(y.cumprod(1) if self.mix else y)


class DecodeStep(nn.Module):
    """One new token's query against a cache passed whole (``cache="gathered"``: left unsharded)."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, x, k, v):
        q = self.q(x).view(1, 1, 2, 4).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(1, 1, 8)


def _written(folder) -> list[str]:
    return sorted(p.name for p in (folder / "graph_0").iterdir())


def _named(stages) -> list[str]:
    run = [p.__name__ for stage in stages for p in stage.passes]
    return ["00_captured.py"] + [f"{i:02d}_{name}.py" for i, name in enumerate(run, 1)]


def test_the_debug_dir_holds_the_graph_after_each_pass_in_pipeline_order(tmp_path, monkeypatch):
    monkeypatch.setenv("RINGPASS_DEBUG_DIR", str(tmp_path))
    inspection = ringpass.inspect(Causal(), (torch.randint(0, 50, (2, 32)),), world_size=2)
    assert inspection.status == "rewritten"
    assert _written(tmp_path) == _named((passes.PREPARE, *passes.PREFILL, passes.CHECK))
    assert len(_written(tmp_path)) == len(passes.PIPELINE) + 1
    graphs = {name: (tmp_path / "graph_0" / name).read_text() for name in _written(tmp_path)}
    last = graphs[_written(tmp_path)[-1]]
    assert RING in last and SDPA not in last
    assert "shard_sequence" in last and "gather_sequence" not in last  # outputs="auto": the output is carried out
    before = graphs[next(name for name in graphs if name.endswith("_find_attention.py"))]
    assert RING not in before and SDPA in before
    first_ring = next(name for name in sorted(graphs) if RING in graphs[name])
    assert first_ring.endswith("_rewrite_attention.py"), first_ring


def test_a_second_run_of_a_graph_leaves_no_file_of_the_first(tmp_path, monkeypatch):
    monkeypatch.setenv("RINGPASS_DEBUG_DIR", str(tmp_path))
    ringpass.inspect(Causal(), (torch.randint(0, 50, (2, 32)),), world_size=2)
    refused = ringpass.inspect(Causal(mix=True), (torch.randint(0, 50, (2, 32)),), world_size=2)
    assert refused.status == "refused"
    names = _written(tmp_path)
    assert names[-1].endswith("_decide_placements_refused.py")
    assert names[:-1] == _named((passes.PREPARE, *passes.PREFILL, passes.CHECK))[: len(names) - 1]
    refused_graph = (tmp_path / "graph_0" / names[-1]).read_text()
    assert "# NotSupportedError: `cumprod`" in refused_graph and "cumprod" in refused_graph.split("class ", 1)[1]


def test_a_refusal_names_the_pass_that_raised_it():
    refused = ringpass.inspect(Causal(mix=True), (torch.randint(0, 50, (2, 32)),), world_size=2)
    message = refused.reports[0].refusal.message
    assert message.startswith(f"`cumprod` at {__file__}, line"), message
    assert message.endswith("(Refused by the pass `decide_placements`.)"), message


def test_a_decode_graph_runs_the_decode_stage(tmp_path, monkeypatch):
    monkeypatch.setenv("RINGPASS_DEBUG_DIR", str(tmp_path))
    inputs = (torch.randn(1, 1, 8), torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4))
    inspection = ringpass.inspect(DecodeStep(), inputs, world_size=2, cache="gathered")
    report = inspection.reports[0]
    assert report.refusal is None and report.cache.startswith("decode steps against a cache held whole"), report
    assert _written(tmp_path) == _named((passes.PREPARE, passes.DECODE, passes.CHECK))


def test_each_pass_is_logged_at_debug_with_its_stage(caplog):
    with caplog.at_level(logging.DEBUG, logger="ringpass.passes"):
        ringpass.inspect(Causal(), (torch.randint(0, 50, (2, 32)),), world_size=2)
    found = [
        re.match(r"graph 0, pass (\d+) \((\w+)\): (\w+):", r.getMessage()).groups()
        for r in caplog.records
        if r.name == "ringpass.passes"
    ]
    stages = (passes.PREPARE, *passes.PREFILL, passes.CHECK)
    assert found == [
        (str(i), stage, name)
        for i, (stage, name) in enumerate(((s.name, p.__name__) for s in stages for p in s.passes), 1)
    ]


def _run_pipeline_on(model, inputs, caught: list):
    """Compiles ``model`` with a backend that runs the pipeline for 2 ranks (offline) and keeps what it raises;
    the compiled model returns what the captured graph computed."""

    def backend(gm, example_inputs):
        outputs = gm(*example_inputs)  # before the pipeline rewrites the graph
        try:
            passes.run_pipeline(PassContext(gm, example_inputs, RingOptions(), 2, "", Report(world_size=2)))
        except Exception as error:
            caught.append(error)
        return lambda *_: outputs

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(*inputs)


def _wrong_view(ctx):
    """A broken pass: the first ``view`` gets one size too many for its input."""
    view = next(n for n in ctx.gm.graph.nodes if n.op == "call_method" and n.target == "view")
    view.args = (view.args[0], *view.args[1:-1], view.args[-1] * 2)


def test_a_pass_that_leaves_a_graph_that_no_longer_runs_is_caught_at_that_pass(monkeypatch):
    caught = []
    _run_pipeline_on(Causal(), (torch.randint(0, 50, (2, 32)),), caught)
    assert caught == []
    monkeypatch.setattr(passes, "CHECK", passes.Stage("check", (_wrong_view, *passes.CHECK.passes)))
    _run_pipeline_on(Causal(), (torch.randint(0, 50, (2, 32)),), caught)
    (error,) = caught
    assert isinstance(error, PassCheckError)
    assert str(error).startswith(
        f"After the pass `_wrong_view` the graph no longer runs on fake tensors: `view` at {__file__}, line"
    ), error
    monkeypatch.setenv("RINGPASS_CHECK_PASSES", "0")  # the check is what caught it
    caught.clear()
    _run_pipeline_on(Causal(), (torch.randint(0, 50, (2, 32)),), caught)
    assert caught == []


def test_a_pass_that_leaves_a_malformed_graph_is_caught_by_the_lint(monkeypatch):
    def use_before_definition(ctx):  # a broken pass: the graph's last op moved before its first
        ops = [n for n in ctx.gm.graph.nodes if n.op in ("call_function", "call_method")]
        ops[0].prepend(ops[-1])

    caught = []
    monkeypatch.setattr(passes, "CHECK", passes.Stage("check", (use_before_definition, *passes.CHECK.passes)))
    _run_pipeline_on(Causal(), (torch.randint(0, 50, (2, 32)),), caught)
    (error,) = caught
    assert isinstance(error, PassCheckError) and str(error).startswith(
        "After the pass `use_before_definition` the graph is malformed:"
    ), error


@pytest.fixture(autouse=True)
def _reset_dynamo():
    yield
    torch._dynamo.reset()
