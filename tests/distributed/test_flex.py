"""flex_attention through the ring: the mask_mod and score_mod evaluated per tile on global positions
(ring attention for flex, where PyTorch's context parallelism all-gathers K/V), exact against eager flex
run whole."""

import backend_workers
import pytest

from ringpass.cli.launch import spawn_ranks

SEQ = 22  # not a multiple of 2P: the layout's padding is exercised


CASES = {  # the score modifiers the report names
    "document-alibi": ["lifted bias program, evaluated per tile"],
    "softcap": ["soft-cap 2"],
    "plain": [],
}


@pytest.mark.parametrize(
    "case,world_size",
    [
        *((case, 2) for case in CASES if case != "softcap"),
        pytest.param("softcap", 2, marks=pytest.mark.heavy),  # suite time: soft-capping runs by default in test_scores
        *(
            pytest.param(case, 4, marks=pytest.mark.heavy) for case in ("document-alibi", "softcap", "plain")
        ),  # -m heavy
    ],
)
def test_flex_attention_trains_through_the_ring(case, world_size):
    for r in spawn_ranks(backend_workers.flex_training_step, world_size, (case, SEQ), timeout=600):
        assert r["out"] <= 1e-5 and r["grads"] <= 1e-4, r
        (attention,) = r["report"]["attentions"]
        assert attention["spelling"] == "flex_attention", attention
        assert attention["mask"].startswith("lifted mask program"), attention
        assert set(CASES[case]) <= set(attention["score_mods"]), attention
        assert r["kv_exchanges"] == 2 * (world_size - 1)  # the ring ran, forward and backward
