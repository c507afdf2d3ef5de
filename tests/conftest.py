"""Every test runs the pass pipeline with its checks on: after each pass the graph is linted and, where it
computes its values, run on fake tensors (`ringpass.fx.runner`). Ranks spawned by a test inherit it."""

import os

os.environ.setdefault("RINGPASS_CHECK_PASSES", "1")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "backend_cases(world_size, *case_ids): the cases of tests/test_backend.py's "
        "matrix a test reads, spawned with the selected ones",
    )
