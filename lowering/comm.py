"""Point-to-point traffic around the ring: send to rank r+1, receive from rank r-1.

`RingExchange.start(t)` posts the send of ``t`` and the receive of the predecessor's tensor of the same
shape together (``batch_isend_irecv``) and returns at once; `Pending.wait()` returns the received tensor.
The ring posts before a block's compute and waits after it, so the transfer runs under the compute:
gloo runs P2P in its own threads; NCCL runs it on its own stream and ``wait`` orders the compute stream
after it. Ranks are the group's ranks; the process group is used as given (a sub-group works).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lowering import events
from lowering.failures import connection_lost, wait_works

KV_TAG, DKV_TAG = 0, 1


class Pending:
    def __init__(self, works, received: torch.Tensor, exchange: RingExchange = None, what: str = ""):
        self._works = works
        self._received = received
        self._exchange, self._what = exchange, what

    def wait(self) -> torch.Tensor:
        if self._received.is_cuda or self._exchange is None:
            for work in self._works:
                work.wait()
        else:
            wait_works(
                self._works,
                self._exchange.group.group_name,
                self._what,
                peers=(self._exchange.next_rank, self._exchange.prev_rank),
            )
        return self._received


class RingExchange:
    """The P2P neighbours of this rank in ``group``; ``None`` stands for a single process with no
    process group (a ring of one, which never communicates)."""

    def __init__(self, group=None):
        self.group = group
        if group is None:
            self.world_size, self.rank = 1, 0
            return
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next_rank = dist.get_global_rank(group, (self.rank + 1) % self.world_size)
        self.prev_rank = dist.get_global_rank(group, (self.rank - 1) % self.world_size)

    def start(self, tensor: torch.Tensor, *, payload: str, step: int, tag: int, phase: str = "forward") -> Pending:
        if self.world_size == 1:
            return Pending([], tensor)
        tensor = tensor.contiguous()
        if events.recording():
            events.emit(
                "exchange", payload=payload, step=step, phase=phase, bytes=tensor.numel() * tensor.element_size()
            )
        received = torch.empty_like(tensor)
        what = (
            f"exchanging the {payload} block of {phase} step {step} "
            f"with ranks {self.next_rank} (next) and {self.prev_rank} (previous)"
        )
        try:
            works = dist.batch_isend_irecv(
                [
                    dist.P2POp(dist.isend, tensor, self.next_rank, self.group, tag),
                    dist.P2POp(dist.irecv, received, self.prev_rank, self.group, tag),
                ]
            )
        except RuntimeError as error:  # gloo: the connection to a neighbour is already closed
            if tensor.is_cuda:
                raise
            raise connection_lost(self.group.group_name, what, error) from None
        return Pending(works, received, self, what)
