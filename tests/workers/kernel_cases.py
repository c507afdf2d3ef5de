"""Block-kernel cases shared by the Triton interpreter tests and the GPU check (examples/gpu_check.py):
each runs the Triton kernels against fp64 math attention (out, LSE, and gradients by fp64 autograd).

Tolerances, relative to the largest reference value: fp32 1e-5; fp16 5e-3; bf16 3e-2 (the inputs'
rounding; gradients get twice that); fp64 (the torch kernels) 1e-12. Score-modifier cases (soft-cap,
ALiBi slopes, a dense bias) check against the modifiers applied in fp64 by `reference`.
"""

from __future__ import annotations

import torch
from reference import masked_attention_fp64, masked_lse_fp64, rel_err

from lowering.kernels import accumulation_dtype, block_attention, block_attention_backward

TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float64: 1e-12}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def visible(q_pos, kv_pos, is_causal=False, window=None, mask=None, seq_bound=None):
    """The dense visibility the options describe, for the reference."""
    result = torch.ones(len(q_pos), len(kv_pos), dtype=torch.bool)[None, None]
    if is_causal:
        result = result & (kv_pos[None, :] <= q_pos[:, None])
    if window is not None:
        result = result & (q_pos[:, None] - kv_pos[None, :] < window)
    if seq_bound is not None:
        result = result & (kv_pos < seq_bound)[None, :]
    return result if mask is None else result & mask


def inputs(n, m, heads, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads[0], n, d, generator=g).to(dtype)
    k, v = (torch.randn(2, heads[1], m, d, generator=g).to(dtype) for _ in range(2))
    return q, k, v


ZIGZAG = torch.cat([torch.arange(0, 9), torch.arange(40, 49)])  # two chunks of a zigzag shard
CASES = {
    # name: (n, m, (Hq, Hkv), D, q_pos, kv_pos, options)
    "full-GQA": (18, 23, (4, 2), 16, torch.arange(30, 48), torch.arange(0, 23), {}),
    "causal-zigzag": (18, 18, (4, 2), 16, ZIGZAG, ZIGZAG, dict(is_causal=True)),
    "causal-offset-MQA": (20, 33, (4, 1), 16, torch.arange(20, 40), torch.arange(10, 43), dict(is_causal=True)),
    "window": (24, 24, (2, 2), 16, torch.arange(24), torch.arange(24), dict(is_causal=True, window=5)),
    "dense-mask": (17, 21, (4, 2), 16, torch.arange(17), torch.arange(21), dict(mask="random")),
    "padding-bound": (16, 20, (2, 1), 16, torch.arange(16), torch.arange(20), dict(seq_bound=13)),
    "rows-without-keys": (16, 16, (2, 2), 16, torch.arange(16), torch.arange(8, 24), dict(is_causal=True)),
    "head-dim-64": (9, 12, (2, 1), 64, torch.arange(9), torch.arange(12), dict(is_causal=True)),
    "head-dim-128": (9, 12, (2, 2), 128, torch.arange(9), torch.arange(12), {}),
    "softcap": (18, 23, (4, 2), 16, torch.arange(30, 48), torch.arange(0, 23), dict(softcap=0.7)),
    "alibi-causal-zigzag": (18, 18, (4, 2), 16, ZIGZAG, ZIGZAG, dict(is_causal=True, alibi_slopes="per-head")),
    "bias+softcap+mask": (
        17,
        21,
        (4, 2),
        16,
        torch.arange(17),
        torch.arange(21),
        dict(mask="random", softcap=1.5, bias="random"),
    ),
}
SCORE_CASES = ["softcap", "alibi-causal-zigzag", "bias+softcap+mask"]


def _materialised(options: dict, n: int, m: int, heads: tuple) -> dict:
    """The case's random mask, slopes and bias as tensors."""
    g = torch.Generator().manual_seed(3)
    if options.get("mask") == "random":
        options = {**options, "mask": torch.rand(2, 1, n, m, generator=g) > 0.4}
    if options.get("alibi_slopes") == "per-head":
        options = {**options, "alibi_slopes": 2.0 ** -torch.arange(1.0, heads[0] + 1)}
    if options.get("bias") == "random":
        options = {**options, "bias": torch.randn(1, heads[0], n, m, generator=g)}
    return options


def _reference_scores(options: dict, q_pos, kv_pos) -> dict:
    """The score modifiers as the fp64 reference applies them: soft-cap, then ALiBi and bias as one bias."""
    bias = options.get("bias")
    if options.get("alibi_slopes") is not None:
        alibi = options["alibi_slopes"].double()[:, None, None] * (kv_pos[None, :] - q_pos[:, None]).double()
        bias = alibi if bias is None else bias.double() + alibi
    return dict(softcap=options.get("softcap"), bias=bias)


def case_inputs(case: str, dtype: torch.dtype) -> tuple:
    """(q, k, v, q_pos, kv_pos, the kernels' options, the dense visibility, the fp64 reference's score
    modifiers) of one case."""
    n, m, heads, d, q_pos, kv_pos, options = CASES[case]
    options = _materialised(options, n, m, heads)
    visibility = {key: options[key] for key in ("is_causal", "window", "mask", "seq_bound") if key in options}
    return (
        *inputs(n, m, heads, d, dtype),
        q_pos,
        kv_pos,
        options,
        visible(q_pos, kv_pos, **visibility),
        _reference_scores(options, q_pos, kv_pos),
    )


def check_case(case: str, dtype: torch.dtype, device: str = "cpu", backend: str = "triton") -> dict:
    """Run one case with ``backend`` on ``device``; returns the relative errors and asserts them."""
    q, k, v, q_pos, kv_pos, options, seen, scores = case_inputs(case, dtype)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    expected = masked_attention_fp64(*leaves, seen, **scores)
    on_device = {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in options.items()}
    args = [t.to(device) for t in (q, k, v, q_pos, kv_pos)]
    out, lse = block_attention(*args, backend=backend, **on_device)
    expected_lse = masked_lse_fp64(q, k, seen, **scores)
    out, lse = out.cpu(), lse.cpu()
    assert out.dtype == lse.dtype == accumulation_dtype(dtype)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(expected_lse))  # rows without keys: -inf
    assert bool((out[torch.isneginf(lse)] == 0).all())
    finite = torch.isfinite(expected_lse)
    errors = {"out": rel_err(out, expected), "lse": rel_err(lse[finite], expected_lse[finite])}
    dout = torch.randn(expected.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    expected.backward(dout.double())
    q_, k_, v_, q_pos_, kv_pos_ = args
    grads = block_attention_backward(
        dout.to(device), q_, k_, v_, out.to(device), lse.to(device), q_pos_, kv_pos_, backend=backend, **on_device
    )
    for name, got, leaf in zip(("dq", "dk", "dv"), grads, leaves):
        assert got.dtype == accumulation_dtype(dtype) and got.shape == leaf.shape
        errors[name] = rel_err(got.cpu(), leaf.grad)
    bound = TOLERANCE[dtype]
    assert errors["out"] <= bound and errors["lse"] <= min(bound, 1e-5), (case, dtype, errors)
    assert max(errors["dq"], errors["dk"], errors["dv"]) <= 2 * bound, (case, dtype, errors)
    return errors
