"""Random model architectures (`random_models`: position scheme, norm, MLP, GQA, attention spelling, padding,
loss) through ``backend="ring"`` against the same model run whole, on 2 gloo ranks (more seeds and 2 to 4 ranks
under ``-m heavy``). The ring's own fuzz, in one process: tests/unit/test_fuzz.py."""

import failure_workers
import pytest

from ringpass.cli.launch import spawn_ranks


def _check_random_architectures(world_size: int, seeds: list, seq_len: int) -> None:
    for per_rank in spawn_ranks(failure_workers.random_architectures, world_size, (seeds, seq_len), timeout=900):
        for seed, result in per_rank.items():
            assert result["error"] is None, (seed, result)
            # every attention rewritten: forward P-1 KV exchanges per layer, backward P-1 KV and P dK/dV
            layers = result["spec"]["layers"]
            assert result["exchanges"] == layers * (3 * world_size - 2), (seed, result)
            assert result["output"] < 1e-10 and result["grads"] < 1e-9, (seed, result)


@pytest.mark.heavy  # suite time (README, "Heavier cases")
@pytest.mark.timeout(900)
def test_random_architectures_match_eager():
    _check_random_architectures(2, list(range(6)), seq_len=11)


@pytest.mark.heavy
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_random_architectures_match_eager_long(world_size):
    _check_random_architectures(world_size, list(range(100, 115)), seq_len=4 * world_size + 1)
