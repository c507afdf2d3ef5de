"""`ringpass.planning.compiled_memory`: a graph walked by hand, and a compiled step's predicted peak against the peak
measured in a process that runs it."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

MEASURE = textwrap.dedent(
    """
    import json, sys, torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from ringpass.cli.bench.measure import PeakMemory
    sys.path.insert(0, {tests!r})
    from test_compiled_memory import Blocks

    torch.manual_seed(0)
    found = {{}}
    for checkpointing in (False, True):
        net, x = Blocks(), torch.randn(4096, 256)
        if checkpointing:  # as a user checkpoints blocks
            net.blocks = torch.nn.ModuleList(checkpoint_wrapper(b) for b in net.blocks)
        run = torch.compile(net, backend="aot_eager")
        run(x).backward()  # compiles
        net.zero_grad(set_to_none=True)
        memory = PeakMemory(torch.device("cpu"))
        memory.start()
        run(x).backward()
        found[str(checkpointing)] = memory.peak()
        torch._dynamo.reset()
    print(json.dumps(found))
    """
)


class Blocks(torch.nn.Module):
    """Three residual MLP blocks in a block list and a loss: 4 MiB per hidden state at 4096 x 256 (fp32)."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
            for _ in range(3)
        )

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x.square().mean()


def test_a_graph_walked_by_hand():
    """x * 2 (4000 bytes), a view of it, + 1 (4000; the first freed after it), a sum (4 bytes), * 3 (4000; its
    input freed after it): the peak is 8004 bytes when the last product exists beside its input and the sum, the
    end is what the graph returns (4004); an input counts only when named, until its last reader."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from ringpass.planning.compiled_memory import walk

    def f(x):
        c = (x * 2).view(10, 100) + 1
        return c.sum(), c * 3

    gm = make_fx(f)(torch.randn(1000))
    memory = walk(gm, counted_inputs=set())
    assert (memory.peak, memory.end) == (8004, 4004)
    assert sorted(memory.returned.values()) == [4, 4000] and memory.returned_at_peak == 4004
    # a counted input (a backward's saved value) lives until its last reader, then is freed
    gm = make_fx(lambda x: x * 2 + x)(torch.randn(1000))
    x = next(n.name for n in gm.graph.nodes if n.op == "placeholder")
    assert walk(gm, counted_inputs=set()).peak == 8000
    counted = walk(gm, counted_inputs={x})
    assert (counted.peak, counted.end) == (12000, 4000)


@pytest.mark.heavy  # a process compiling and measuring two steps (~12 s)
def test_a_compiled_step_against_its_measured_peak():
    """What a compiled step (AOTAutograd's partition, ``aot_eager``) adds at its peak, measured (peak RSS above
    the start, ``MALLOC_MMAP_THRESHOLD_`` set), against `compiled_step_memory` on fake tensors: within 5 %,
    with checkpointing and without; checkpointing holds less."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ringpass.planning.compiled_memory import compiled_step_memory

    tests = os.path.dirname(__file__)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-c", MEASURE.format(tests=tests)], capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    measured = json.loads(run.stdout.splitlines()[-1])
    for checkpointing in (False, True):
        with FakeTensorMode(allow_non_fake_inputs=True):
            net, x = Blocks(), torch.randn(4096, 256)
            predicted = compiled_step_memory(net, (x,), checkpointing)
        total = predicted.activations + predicted.gradients
        assert total / measured[str(checkpointing)] == pytest.approx(1.0, abs=0.05), (checkpointing, total, measured)
    assert measured["True"] < measured["False"]
