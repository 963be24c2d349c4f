"""Full-precision collectives among the ranks of one node, for the
hierarchical allreduce's stages 1 and 3: `reduce_scatter(send[K*S], recv[S])`
(sums, in a fixed order per library), `all_gather(send[S], recv[K*S])`, and
`staging(n, device)`, the buffer the caller writes its input into (shm.py's
transport hands out shared memory there)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import collectives

# torch 2.13 deprecates reduce_scatter_tensor in favour of reduce_scatter_single.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class PrivateStaging:
    """A node transport's staging buffers when it has no shared memory:
    one zeroed tensor per size and device, kept."""

    def staging(self, numel: int, device: torch.device) -> torch.Tensor:
        made = self.__dict__.setdefault("_staging", {})
        t = made.get((numel, device))
        if t is None:
            t = made[(numel, device)] = torch.zeros(numel, device=device)
        return t


class TorchNode(PrivateStaging):
    """Full-precision collectives inside a node over a torch.distributed group."""

    def __init__(self, group, timeout_s: Optional[float]) -> None:
        self.group, self.timeout_s = group, timeout_s

    def reduce_scatter(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        collectives.run("hierarchical stage 1 (reduce-scatter inside the node)",
                        lambda: _reduce_scatter_flat(recv, send, group=self.group, async_op=True),
                        self.timeout_s, self.group)

    def all_gather(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        collectives.run("hierarchical stage 3 (all-gather inside the node)",
                        lambda: collectives.all_gather_flat(recv, send, group=self.group,
                                                            async_op=True),
                        self.timeout_s, self.group)


class MpiNode(PrivateStaging):
    """Full-precision collectives inside a node over an MPI communicator
    (device tensors staged through host memory)."""

    def __init__(self, comm) -> None:
        from mpi4py import MPI

        self.comm, self._float, self._byte, self._sum = comm, MPI.FLOAT, MPI.BYTE, MPI.SUM

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.device.type == "cpu" else t.cpu()

    def reduce_scatter(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        out = self._host(recv)
        self.comm.Reduce_scatter_block([self._host(send).numpy(), self._float],
                                       [out.numpy(), self._float], op=self._sum)
        if out is not recv:
            recv.copy_(out)

    def all_gather(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        out = self._host(recv)  # any dtype: moved as bytes
        self.comm.Allgather([self._host(send).view(torch.uint8).numpy(), self._byte],
                            [out.view(torch.uint8).numpy(), self._byte])
        if out is not recv:
            recv.copy_(out)
