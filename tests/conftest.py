"""Every test runs the pass pipeline with its checks on: after each pass the graph is linted and, where it
computes its values, run on fake tensors (`ringpass.fx.runner`). Ranks spawned by a test inherit it.

The tests by kind: tests/unit (one file per pass or module, no processes), tests/distributed (spawned ranks),
tests/models (Hugging Face families), tests/kernels (Triton kernels, interpreted). What they and their ranks import by
name (`models`, `reference`, `hf_workers`, ...) is in tests/workers, put on sys.path here with examples/ (whose
`model_coverage` holds tiny configs of many Hugging Face families), before pytest imports any test module: the server
the ranks are forked from (`ringpass/cli/launch.py`) copies sys.path when it starts."""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("RINGPASS_CHECK_PASSES", "1")
WORKERS = str(Path(__file__).resolve().parent / "workers")
EXAMPLES = str(Path(__file__).resolve().parent.parent / "examples")  # model_coverage's tiny configs, for hf_workers
for folder in (EXAMPLES, WORKERS):
    if folder not in sys.path:
        sys.path.insert(0, folder)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "backend_cases(world_size, *case_ids): the cases of tests/distributed/test_backend.py's "
        "matrix a test reads, spawned with the selected ones",
    )


@pytest.fixture(scope="module")
def pools():
    """Ranks kept alive for a test module's spawns (`rank_pools.RankPools`), closed after its last test."""
    from rank_pools import RankPools

    found = RankPools()
    yield found
    found.close()
