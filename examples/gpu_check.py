"""The GPU check for the Triton block kernels: correctness on CUDA, then speed against PyTorch's flash SDPA.

    python examples/gpu_check.py                     # on a CUDA machine, under 8 minutes on one GPU
    TRITON_INTERPRET=1 python examples/gpu_check.py  # a tiny CPU smoke run of the same script

1. The kernel cases of the test suite (tests/workers/kernel_cases.py), compiled on CUDA, fp32/fp16/bf16,
   against fp64 math attention; plus one long causal bf16 case against fp32 SDPA.
2. bf16 forward and forward+backward for N in {4k, 16k, 32k}, D in {64, 128}, causal and not (B=1,
   H=16): milliseconds, TFLOP/s (forward 4·N²·D·H, halved when causal; backward 2.5x forward) and the
   ratio to `F.scaled_dot_product_attention` restricted to the flash backend on the same inputs.
3. The ring simulated on one GPU (zigzag, P=4 and 8, causal) against one full-sequence kernel call:
   time and the largest difference.
Prints markdown tables (paste them into docs/performance.md with the date and the card).
"""

from __future__ import annotations

import functools
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "workers"))

from lowering import Layout, simulate_ring
from lowering.kernels import block_attention, block_attention_backward

SMOKE = not torch.cuda.is_available()
DEVICE = "cpu" if SMOKE else "cuda"


def main() -> None:
    if SMOKE and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("No CUDA device: run on a GPU, or set TRITON_INTERPRET=1 for a tiny CPU smoke run.")
    started = time.time()
    name = "CPU (Triton interpreter smoke run)" if SMOKE else torch.cuda.get_device_name()
    print(f"# ringpass GPU check on {name}, torch {torch.__version__}\n")
    check_kernels()
    print(f"\n(correctness done at {time.time() - started:.0f} s)\n")
    time_kernels()
    print(f"\n(kernel timings done at {time.time() - started:.0f} s)\n")
    time_simulated_ring()
    print()
    time_masks()
    print(f"\n(all done in {time.time() - started:.0f} s)")


def check_kernels() -> None:
    from kernel_cases import CASES, DTYPES, check_case
    from reference import rel_err

    print("## Correctness (relative to fp64 math; gradients vs fp64 autograd)\n")
    print("| case | dtype | out | lse | dq | dk | dv |\n| --- | --- | --- | --- | --- | --- | --- |")
    for case in CASES:
        for dtype_name, dtype in DTYPES.items():
            errors = check_case(case, dtype, DEVICE)
            print(
                f"| {case} | {dtype_name} | "
                + " | ".join(f"{errors[k]:.1e}" for k in ("out", "lse", "dq", "dk", "dv"))
                + " |"
            )
    n = 256 if SMOKE else 4096
    q, k, v = (torch.randn(1, 8, n, 128, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    pos = torch.arange(n, device=DEVICE)
    out, _ = block_attention(q, k, v, pos, pos, is_causal=True, backend="triton")
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    error = rel_err(out, expected)
    print(f"\nlong causal bf16 (N={n}, D=128) vs fp32 SDPA: {error:.1e}")
    assert error < 3e-2, error


def _timed(fn, repeats: int) -> float:
    """Median milliseconds of ``fn`` after one warm-up call."""
    fn()
    if not SMOKE:
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if not SMOKE:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def _tflops(flops: float, ms: float) -> float:
    return flops / ms / 1e9


def _flash_sdpa(q, k, v, causal):
    if SMOKE:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _kernel_fns(q, k, v, pos, dout, causal):
    """The four timed calls of one ``time_kernels`` case: ours and SDPA, forward and forward+backward."""

    def ours_forward():
        return block_attention(q.detach(), k.detach(), v.detach(), pos, pos, is_causal=causal, backend="triton")

    def ours_both():
        out, lse = ours_forward()
        return block_attention_backward(
            dout, q.detach(), k.detach(), v.detach(), out, lse, pos, pos, is_causal=causal, backend="triton"
        )

    def sdpa_forward():
        with torch.no_grad():
            return _flash_sdpa(q, k, v, causal)

    def sdpa_both():
        return torch.autograd.grad(_flash_sdpa(q, k, v, causal), (q, k, v), dout)

    return ours_forward, ours_both, sdpa_forward, sdpa_both


def time_kernels() -> None:
    print("## bf16 kernels vs flash SDPA (B=1, H=16)\n")
    print(
        "| N | D | causal | ours fwd ms | TFLOP/s | SDPA fwd ms | ratio "
        "| ours fwd+bwd ms | TFLOP/s | SDPA fwd+bwd ms | ratio |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    lengths = (128, 256) if SMOKE else (4096, 16384, 32768)
    heads, repeats = (2, 1) if SMOKE else (16, 5)
    for n in lengths:
        for d in (64, 128):
            for causal in (False, True):
                q, k, v = (
                    torch.randn(1, heads, n, d, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
                    for _ in range(3)
                )
                pos = torch.arange(n, device=DEVICE)
                dout = torch.randn_like(q)
                forward_flops = 4 * heads * n * n * d * (0.5 if causal else 1.0)

                ours_forward, ours_both, sdpa_forward, sdpa_both = _kernel_fns(q, k, v, pos, dout, causal)
                t_ours, t_sdpa = _timed(ours_forward, repeats), _timed(sdpa_forward, repeats)
                b_ours, b_sdpa = _timed(ours_both, repeats), _timed(sdpa_both, repeats)
                print(
                    f"| {n} | {d} | {causal} | {t_ours:.2f} | {_tflops(forward_flops, t_ours):.0f} | {t_sdpa:.2f} | "
                    f"{t_sdpa / t_ours:.2f} | {b_ours:.2f} | {_tflops(3.5 * forward_flops, b_ours):.0f} | "
                    f"{b_sdpa:.2f} | {b_sdpa / b_ours:.2f} |"
                )
                del q, k, v, dout, ours_forward, ours_both, sdpa_forward, sdpa_both
    print("\nratio = SDPA time / our time (above 1: ours is faster).")


def _ring_inputs():
    """(N, bf16 q/k/v of B=1, H=16, D=128) for the simulated-ring tables (tiny in the smoke run)."""
    n, heads = (256, 2) if SMOKE else (16384, 16)
    return n, tuple(torch.randn(1, heads, n, 128, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))


def time_simulated_ring() -> None:
    print("## The ring simulated on one GPU (zigzag, causal, bf16, H=16, D=128) vs one full kernel call\n")
    print("| N | P | ring fwd ms | one call fwd ms | max abs difference |\n| --- | --- | --- | --- | --- |")
    n, (q, k, v) = _ring_inputs()
    pos = torch.arange(n, device=DEVICE)
    whole = _timed(lambda: block_attention(q, k, v, pos, pos, is_causal=True, backend="triton"), 1 if SMOKE else 3)
    expected, _ = block_attention(q, k, v, pos, pos, is_causal=True, backend="triton")
    for p in (4, 8):
        layout = Layout("zigzag", p, n)
        ring = _timed(functools.partial(simulate_ring, q, k, v, layout=layout, is_causal=True), 1 if SMOKE else 3)
        got = simulate_ring(q, k, v, layout=layout, is_causal=True).out.float()
        print(f"| {n} | {p} | {ring:.2f} | {whole:.2f} | {(got - expected).abs().max().item():.1e} |")
    print(
        "\n(one GPU runs every rank's blocks one after another: the ring's time here is the whole work plus the "
        "per-block overheads; on P GPUs each rank does 1/P of it.)"
    )


def _documents(q_pos, kv_pos, document):
    return document[q_pos][:, None] == document[kv_pos][None, :]


def time_masks() -> None:
    """Issue 13, item 4: a window or a mask program that hides nothing must cost what plain causal costs."""
    print("## Windows and mask programs in the simulated ring (zigzag, P=4, causal, bf16, H=16, D=128, forward)\n")
    print("| case | ring fwd ms | vs plain causal |\n| --- | --- | --- |")
    n, (q, k, v) = _ring_inputs()
    layout = Layout("zigzag", 4, n)
    cases = {
        "plain causal": {},
        f"window={n} (hides nothing)": dict(window=n),
        "one-document program (hides nothing)": dict(
            mask=_documents, mask_inputs=[torch.zeros(n, dtype=torch.long, device=DEVICE)]
        ),
        f"window={n // 4}": dict(window=n // 4),
        "four packed documents": dict(mask=_documents, mask_inputs=[torch.arange(n, device=DEVICE) * 4 // n]),
    }
    plain = None
    for name, options in cases.items():
        ms = _timed(
            functools.partial(simulate_ring, q, k, v, layout=layout, is_causal=True, **options), 1 if SMOKE else 3
        )
        plain = plain or ms
        print(f"| {name} | {ms:.2f} | {100 * (ms / plain - 1):+.1f}% |")


if __name__ == "__main__":
    main()
