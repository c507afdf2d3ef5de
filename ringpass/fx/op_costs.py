"""`OpCosts`: every op a piece of a step runs, priced (its FLOPs, the bytes it reads and writes, whether a block's
forward runs it), for the cost models that predict a step (`ringpass.planning.model_plan`) or a scan's strategies
(`ringpass.passes.find_scan_states`)."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import flop_registry
from torch.utils.module_tracker import ModuleTracker

from lowering import compat
from lowering.compat import pytree
from lowering.costmodel import Hardware


class OpCosts(compat.TorchDispatchMode):
    """Every op a step runs outside attention that makes a tensor (the ring's cost model prices attention): its
    FLOPs (torch's formulas: matrix products), the bytes of the tensors it reads and writes (none for a view) and
    whether it runs in a block's forward (what checkpointing runs again)."""

    def __init__(self, blocks: set[str]):
        super().__init__()
        self.blocks, self.modules = blocks, ModuleTracker()
        self.ops: list[tuple[int, int, bool]] = []

    def __enter__(self):
        self.modules.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.modules.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = compat.overload_packet(func)
        computes = any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(out))  # not a query (`x.device`)
        if computes and "attention" not in packet.__name__:
            flops = flop_registry[packet](*args, **kwargs, out_val=out) if packet in flop_registry else 0
            tensors = [t for t in pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            moved = 0 if func.is_view else sum(t.numel() * t.element_size() for t in tensors)
            self.ops.append(
                (int(flops), int(moved), not self.modules.is_bw and bool(self.modules.parents & self.blocks))
            )
        return out

    def seconds(self, hw: Hardware, checkpointing: bool) -> float:
        """The ops on ``hw``: each the longer of its FLOPs at the matrix-product rate and its bytes at the memory
        rate, plus the cost of one op; with checkpointing the blocks' forward ops twice."""
        gemm = hw.gemm_flops_per_s or hw.flops_per_s
        total = 0.0
        for flops, moved, in_block_forward in self.ops:
            memory = moved / hw.memory_bytes_per_s if hw.memory_bytes_per_s else 0.0
            total += (hw.op_overhead_s + max(flops / gemm, memory)) * (2 if checkpointing and in_block_forward else 1)
        return total
