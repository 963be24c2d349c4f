"""CompressedBackend: the 1-bit allreduce over torch.distributed (gloo, nccl,
xccl -- whatever the process group was initialised with)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import collectives
from ..wire import DEFAULT_BLOCK_SIZE, DEFAULT_SCALE_DTYPE
from .base import CompressedAllreduceBase, Finished
from .codecs import SignCodec


class CompressedBackend(CompressedAllreduceBase):
    """compressed_allreduce over a torch.distributed process group.

    Args:
      group: the data-parallel process group (default: the world). Chunk k of
        the buffer is served by rank k *of this group*.
      block_size, scale_dtype, check_finite, piece_size, codec, agree_every_call: see
        CompressedAllreduceBase.
      timeout_s: deadline of each collective (default $ONEBIT_TIMEOUT_S or
        300 s); past it, or when a peer dies, CommunicationError names the phase.
    """

    name = "compressed"

    def __init__(self, group=None, check_finite: bool = True,
                 timeout_s: Optional[float] = None, block_size: int = DEFAULT_BLOCK_SIZE,
                 scale_dtype: torch.dtype = DEFAULT_SCALE_DTYPE,
                 piece_size: Optional[int] = None, codec=SignCodec,
                 agree_every_call: bool = True) -> None:
        super().__init__(block_size=block_size, scale_dtype=scale_dtype, check_finite=check_finite,
                         piece_size=piece_size, codec=codec, agree_every_call=agree_every_call)
        self.timeout_s = collectives.check_timeout(timeout_s)
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

    @property
    def communication_device(self) -> torch.device:
        return collectives.communication_device(self.group)

    def start_exchange(self, send: torch.Tensor, recv: torch.Tensor):
        if self._size == 1:
            recv.copy_(send)
            return Finished()
        return collectives.start("compressed_allreduce phase 1 (all-to-all of worker signs)",
                                 lambda: dist.all_to_all_single(recv, send, group=self.group,
                                                                async_op=True),
                                 self.timeout_s, self.group)

    def start_gather(self, send: torch.Tensor, recv: torch.Tensor):
        if self._size == 1:
            recv.view(-1).copy_(send.view(-1))
            return Finished()
        return collectives.start("compressed_allreduce all-gather (server signs / sizes)",
                                 lambda: collectives.all_gather_flat(
                                     recv.view(-1), send.view(-1), group=self.group, async_op=True),
                                 self.timeout_s, self.group)
