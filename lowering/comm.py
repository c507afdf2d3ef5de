"""Point-to-point traffic around the ring: send to rank r+1, receive from rank r-1.

`RingExchange.start(t)` posts the send of ``t`` and the receive of the predecessor's tensor of the same
shape together (``batch_isend_irecv``) and returns at once; `Pending.wait()` returns the received tensor.
Either side may be left out (a block no later rank needs is not sent on: `lowering.ring.RingSpec.hops`), and
``to`` / ``source`` name other ranks of the group than the neighbours (a dk/dv accumulator sent straight home).
The ring posts before a block's compute and waits after it, so the transfer runs under the compute:
gloo runs P2P in its own threads; NCCL runs it on its own stream and ``wait`` orders the compute stream
after it. Ranks are the group's ranks; the process group is used as given (a sub-group works).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lowering import events
from lowering.failures import connection_lost, wait_works

KV_TAG, DKV_TAG, DKV_HOME_TAG = 0, 1, 2


class Pending:
    def __init__(self, works, received: torch.Tensor | None, exchange: RingExchange = None, what: str = "", peers=()):
        self._works, self._received = works, received
        self._exchange, self._what, self._peers = exchange, what, peers

    @property
    def receives(self) -> bool:
        return self._received is not None

    def wait(self) -> torch.Tensor | None:
        """The received tensor (None where nothing was received), once the send has left too."""
        if self._exchange is None or self._exchange.on_cuda:
            for work in self._works:
                work.wait()
        else:
            wait_works(self._works, self._exchange.group.group_name, self._what, peers=self._peers)
        return self._received


class RingExchange:
    """The P2P neighbours of this rank in ``group``; ``None`` stands for a single process with no
    process group (a ring of one, which never communicates)."""

    def __init__(self, group=None):
        self.group, self.on_cuda = group, False
        if group is None:
            self.world_size, self.rank = 1, 0
            return
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next_rank = dist.get_global_rank(group, (self.rank + 1) % self.world_size)
        self.prev_rank = dist.get_global_rank(group, (self.rank - 1) % self.world_size)

    def start(
        self,
        tensor: torch.Tensor,
        *,
        payload: str,
        step: int,
        tag: int,
        phase: str = "forward",
        send: bool = True,
        receive: bool = True,
        to: int | None = None,
        source: int | None = None,
    ) -> Pending:
        """Send ``tensor`` to group rank ``to`` (default: the next) and receive one of its shape from group rank
        ``source`` (default: the previous), both posted at once; ``send`` / ``receive`` False leave that side out."""
        if self.world_size == 1:
            return Pending([], tensor)
        ops, peers = [], []
        if send:
            tensor = tensor.contiguous()
            if events.recording():
                events.emit(
                    "exchange", payload=payload, step=step, phase=phase, bytes=tensor.numel() * tensor.element_size()
                )
            peers.append(self.next_rank if to is None else dist.get_global_rank(self.group, to))
            ops.append(dist.P2POp(dist.isend, tensor, peers[-1], self.group, tag))
        received = torch.empty_like(tensor) if receive else None
        if receive:
            peers.append(self.prev_rank if source is None else dist.get_global_rank(self.group, source))
            ops.append(dist.P2POp(dist.irecv, received, peers[-1], self.group, tag))
        if not ops:
            return Pending([], None)
        self.on_cuda = tensor.is_cuda
        what = f"exchanging the {payload} block of {phase} step {step} with ranks {', '.join(map(str, peers))}"
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as error:  # gloo: the connection to a neighbour is already closed
            if tensor.is_cuda:
                raise
            raise connection_lost(self.group.group_name, what, error) from None
        return Pending(works, received, self, what, tuple(peers))
