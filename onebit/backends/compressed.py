"""CompressedBackend: the 1-bit allreduce over torch.distributed (gloo, nccl,
xccl -- whatever the process group was initialised with)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .base import CompressedAllreduceBase

# torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CompressedBackend(CompressedAllreduceBase):
    """compressed_allreduce over a torch.distributed process group.

    Args:
      group: the data-parallel process group (default: the world). Chunk k of
        the buffer is served by rank k *of this group*.
      check_finite: see CompressedAllreduceBase.
    """

    name = "compressed"

    def __init__(self, group=None, check_finite: bool = True) -> None:
        super().__init__(check_finite=check_finite)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("CompressedBackend needs torch.distributed initialised "
                               "(dist.init_process_group) before it is created")
        self.group = group
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def exchange(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        if self._size == 1:
            recv.copy_(send)
        else:
            dist.all_to_all_single(recv, send, group=self.group)

    def gather(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        if self._size == 1:
            recv.view(-1).copy_(send.view(-1))
        else:
            _all_gather(recv.view(-1), send.view(-1), group=self.group)
