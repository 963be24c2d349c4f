"""Full-precision collectives among the K ranks of one node, for the
hierarchical allreduce's stages 1 and 3:

  staging(n, device)          where the caller writes its input (n = K*S);
  reduce_scatter(staging, S)  this rank's shard of the sum over the node's
                              ranks (a fixed order per library), a tensor
                              the caller may change until all_gather;
  all_gather(shard, out)      out = every rank's shard in local-rank order,
                              cut at out.numel().

shm.py's transport hands out shared memory as staging and sums in place
there; these two move the data over a torch group or an MPI communicator.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import collectives

# torch 2.13 deprecates reduce_scatter_tensor in favour of reduce_scatter_single.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class PrivateStaging:
    """Staging and shard buffers of a transport without shared memory: one
    zeroed tensor per purpose, size and device, kept."""

    def _kept(self, name: str, numel: int, device: torch.device) -> torch.Tensor:
        made = self.__dict__.setdefault("_kept_buffers", {})
        t = made.get((name, numel, device))
        if t is None:
            t = made[(name, numel, device)] = torch.zeros(numel, device=device)
        return t

    def staging(self, numel: int, device: torch.device) -> torch.Tensor:
        return self._kept("staging", numel, device)

    def reduce_scatter(self, staging: torch.Tensor, shard_numel: int) -> torch.Tensor:
        shard = self._kept("shard", shard_numel, staging.device)
        self._reduce_scatter(staging, shard)
        return shard

    def all_gather(self, shard: torch.Tensor, out: torch.Tensor) -> None:
        full = shard.numel() * self.size
        if out.numel() == full:
            self._all_gather(shard, out)
            return
        staging = self._kept("gathered", full, shard.device)
        self._all_gather(shard, staging)
        out.copy_(staging[:out.numel()])


class TorchNode(PrivateStaging):
    """Full-precision collectives inside a node over a torch.distributed group."""

    def __init__(self, group, timeout_s: Optional[float]) -> None:
        self.group, self.timeout_s = group, timeout_s
        self.size = dist.get_world_size(group)

    def _reduce_scatter(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        collectives.run("hierarchical stage 1 (reduce-scatter inside the node)",
                        lambda: _reduce_scatter_flat(recv, send, group=self.group, async_op=True),
                        self.timeout_s, self.group)

    def _all_gather(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        collectives.run("hierarchical stage 3 (all-gather inside the node)",
                        lambda: collectives.all_gather_flat(recv, send, group=self.group,
                                                            async_op=True),
                        self.timeout_s, self.group)


class MpiNode(PrivateStaging):
    """Full-precision collectives inside a node over an MPI communicator
    (device tensors staged through host memory)."""

    def __init__(self, comm, timeout_s: Optional[float] = None) -> None:
        from mpi4py import MPI

        self.comm, self._float, self._byte, self._sum = comm, MPI.FLOAT, MPI.BYTE, MPI.SUM
        self.size = comm.Get_size()
        self.timeout_s = timeout_s

    def _finish(self, phase: str, request) -> None:
        from .mpi import BoundedWait

        BoundedWait(phase, self.timeout_s, self.comm.Get_rank(), self.size).finish(request)

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.device.type == "cpu" else t.cpu()

    def _reduce_scatter(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        out = self._host(recv)
        self._finish("hierarchical stage 1 (MPI reduce-scatter inside the node)",
                     self.comm.Ireduce_scatter_block([self._host(send).numpy(), self._float],
                                                     [out.numpy(), self._float], op=self._sum))
        if out is not recv:
            recv.copy_(out)

    def _all_gather(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        out = self._host(recv)  # any dtype: moved as bytes
        self._finish("hierarchical stage 3 (MPI all-gather inside the node)",
                     self.comm.Iallgather([self._host(send).view(torch.uint8).numpy(), self._byte],
                                          [out.view(torch.uint8).numpy(), self._byte]))
        if out is not recv:
            recv.copy_(out)
