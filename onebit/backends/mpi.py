"""MpiBackend: the 1-bit allreduce over mpi4py (Ialltoall and Iallgather per
pipelined piece). Without an asynchronous progress thread (MPICH's default),
MPI moves a nonblocking collective's bytes mostly inside Wait, so pipelining
overlaps less here than over torch.distributed, whose gloo threads progress
on their own; set MPIR_CVAR_ASYNC_PROGRESS=1 for MPICH's progress thread."""
from __future__ import annotations

from typing import Optional

import torch

from .base import DEFAULT_BLOCK_SIZE, DEFAULT_SCALE_DTYPE, CompressedAllreduceBase, Finished

INSTALL_HINT = "install it with: pip install 'onebit[mpi]'  (mpi4py + MPICH from PyPI)"


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError(f"MpiBackend needs mpi4py and an MPI library; {INSTALL_HINT}") from exc
    return MPI


class MpiBackend(CompressedAllreduceBase):
    """compressed_allreduce over an MPI communicator.

    Args:
      cuda_aware: hand device buffers straight to MPI (needs a CUDA-aware MPI).
        Otherwise device tensors are staged through host memory.
      comm: the communicator (default MPI.COMM_WORLD). Chunk k is served by
        rank k of this communicator.
      block_size, scale_dtype, check_finite, piece_size: see CompressedAllreduceBase.
    """

    name = "mpi"

    def __init__(self, cuda_aware: bool = False, comm=None, check_finite: bool = True,
                 block_size: int = DEFAULT_BLOCK_SIZE,
                 scale_dtype: torch.dtype = DEFAULT_SCALE_DTYPE,
                 piece_size: Optional[int] = None) -> None:
        super().__init__(block_size=block_size, scale_dtype=scale_dtype, check_finite=check_finite,
                         piece_size=piece_size)
        MPI = _mpi()
        self._byte = MPI.BYTE
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.cuda_aware = cuda_aware

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def size(self) -> int:
        return self.comm.Get_size()

    def _start(self, collective, send: torch.Tensor, recv: torch.Tensor):
        """Start a nonblocking MPI byte collective on contiguous uint8 tensors;
        returns its request (wait() = MPI_Wait)."""
        if send.device.type == "cpu":
            return _Request(collective([send.numpy(), self._byte], [recv.numpy(), self._byte]))
        if self.cuda_aware:
            # MPI knows nothing of torch streams: finish the producing kernels first.
            torch.cuda.current_stream().synchronize()
            return _Request(collective([send, self._byte], [recv, self._byte]))
        # Staged through host memory: finished here, so recv is complete on return.
        host_recv = torch.empty(recv.shape, dtype=recv.dtype)
        collective([send.cpu().numpy(), self._byte], [host_recv.numpy(), self._byte]).Wait()
        recv.copy_(host_recv)
        return Finished()

    def start_exchange(self, send: torch.Tensor, recv: torch.Tensor):
        return self._start(self.comm.Ialltoall, send, recv)

    def start_gather(self, send: torch.Tensor, recv: torch.Tensor):
        return self._start(self.comm.Iallgather, send, recv)


class _Request:
    def __init__(self, request) -> None:
        self.request = request

    def wait(self) -> None:
        self.request.Wait()
