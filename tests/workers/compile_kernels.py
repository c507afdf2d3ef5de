"""Compile the Triton block kernels for an sm_90 GPU without one (run by test_heavy in a fresh process):
python tests/workers/compile_kernels.py bf16|fp32"""

import inspect
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from lowering.kernels import triton_attention as kernels


def main(dtype: str) -> None:
    pointers = dict.fromkeys(("Q", "K", "V", "DO"), f"*{dtype}")
    pointers.update(
        QPOS="*i64",
        KVPOS="*i64",
        MASK="*u8",
        TILES="*u8",
        SLOPES="*fp32",
        BIAS="*fp32",
        OUT="*fp32",
        LSE="*fp32",
        DELTA="*fp32",
        DQ="*fp32",
        DK="*fp32",
        DV="*fp32",
        DS="*fp32",
    )
    scalars = {"scale": "fp32", "seq_bound": "i64", "softcap": "fp32"}
    for scores in (False, True):  # without and with the score modifiers (soft-cap, ALiBi, a bias tile, its gradient)
        constexprs = dict(
            D=128,
            BLOCK_D=128,
            BLOCK_M=64,
            BLOCK_N=64,
            UPCAST=False,
            GROUP=2,
            IS_CAUSAL=True,
            HAS_WINDOW=True,
            HAS_MASK=True,
            HAS_SOFTCAP=scores,
            HAS_ALIBI=scores,
            HAS_BIAS=scores,
            STORE_DS=scores,
            MERGE=True,
            PRECISION="ieee" if dtype == "fp32" else "tf32",
        )
        compile_all(constexprs, pointers, scalars)


def compile_all(constexprs: dict, pointers: dict, scalars: dict) -> None:
    for kernel in (kernels._forward_kernel, kernels._dq_kernel, kernels._dkdv_kernel):
        names = list(inspect.signature(kernel.fn).parameters)
        signature = {
            name: "constexpr" if name in constexprs else pointers.get(name, scalars.get(name, "i32")) for name in names
        }
        values = {(names.index(name),): value for name, value in constexprs.items() if name in names}
        compiled = triton.compile(
            ASTSource(fn=kernel, signature=signature, constexprs=values), target=GPUTarget("cuda", 90, 32)
        )
        assert compiled.asm["cubin"], kernel.fn.__name__
        print(kernel.fn.__name__, "compiled")


if __name__ == "__main__":
    main(sys.argv[1])
