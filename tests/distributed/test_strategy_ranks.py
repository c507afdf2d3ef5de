"""``strategy="auto"`` on 2 gloo ranks: the backend running every choice the cost model can make, forced by
hardware, exactly (fp64 against the model run whole), with the report naming the choice and its alternatives and
the events showing what moved. The choices themselves, by hand: tests/unit/test_strategy.py."""

import backend_workers
import pytest

from lowering.costmodel import Hardware
from ringpass.cli.launch import spawn_ranks

# tests/unit/test_strategy.py's hardware: each makes one strategy the fastest at 64 tokens on 2 ranks (checked there)
COMPUTE_BOUND = Hardware(1e15, 0.0, 1e6)  # transfers free: the ring hides them and holds least
BANDWIDTH_BOUND = Hardware(1e8, 0.0, 1e9)  # MHA: one all-to-all each way moves less than a KV block and its dK/dV
LATENCY_BOUND = Hardware(1e3, 1e-3, 1e9)  # slow messages: one gather beats the ring; nothing sent beats both


@pytest.mark.timeout(400)
def test_the_backend_runs_every_strategy_auto_can_choose_exactly():
    """Two ranks, fp64, 64 tokens: each choice forced by hardware, the model's outputs and gradients against the
    model run whole, the report's choice and alternatives, what moved between the ranks."""
    cases = [
        ("ring", "llama", {"strategy": "auto", "hardware": COMPUTE_BOUND}),
        ("ulysses", "gpt", {"strategy": "auto", "hardware": BANDWIDTH_BOUND}),
        ("all-gather", "llama", {"strategy": "auto", "hardware": LATENCY_BOUND, "outputs": "sharded"}),
        ("none", "llama", {"strategy": "auto", "hardware": LATENCY_BOUND}),
        ("all-gather masks", "encoder_padded", {"strategy": "all-gather"}),  # a lifted padding mask program
        ("default hardware", "llama", {"strategy": "auto"}),
    ]
    cases = [(case, name, {"compiler": "aot_eager", **options}) for case, name, options in cases]
    expected_moved = {
        "ring": ["exchange"],
        "ulysses": ["heads_exchange"],
        "all-gather": ["kv all-gather"],
        "none": [],
        "all-gather masks": ["kv all-gather"],
        "default hardware": None,  # whatever this machine's calibration says: exact either way
    }
    for rank_results in spawn_ranks(backend_workers.strategy_cases, 2, (cases,), timeout=380):
        for case, result in rank_results.items():
            assert max(result["outputs"]) < 1e-10 and result["grads"] < 1e-10, (case, result)
            assert result["warnings"] == [], (case, result["warnings"])
            if expected_moved[case] is not None:
                assert result["moved"] == expected_moved[case], (case, result["moved"])
            report = result["report"]
            if case == "default hardware":  # whatever it chose, something moved exactly when it sharded
                assert (result["moved"] == []) == (report["status"] == "whole"), (report["status"], result["moved"])
            if report["status"] == "whole":  # this machine's calibration, at 64 tokens, also runs it whole
                assert case in ("none", "default hardware") and report["attentions"] == [], case
                assert "strategy='auto' chose no sequence parallelism" in result["report_text"]
                continue
            strategies = [a["strategy"] for a in report["attentions"]]
            assert len(strategies) == 2, case  # both blocks' attentions
            if case in ("all-gather masks",):
                assert strategies == ["all-gather (zigzag)"] * 2
                continue
            for text in strategies:
                chosen = text.split(",")[0]
                assert case == "default hardware" or chosen.startswith(case), (case, text)
                assert "predicted" in text and "none" in text and "ring (contiguous)" in text, text
            assert f"by {strategies[0].split(',')[0]}" in result["report_text"].splitlines()[0]
