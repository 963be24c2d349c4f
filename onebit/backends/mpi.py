"""MpiBackend: the 1-bit allreduce over mpi4py (one Alltoall, one Allgather)."""
from __future__ import annotations

import torch

from .base import DEFAULT_BLOCK_SIZE, DEFAULT_SCALE_DTYPE, CompressedAllreduceBase

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
      block_size, scale_dtype, check_finite: see CompressedAllreduceBase.
    """

    name = "mpi"

    def __init__(self, cuda_aware: bool = False, comm=None, check_finite: bool = True,
                 block_size: int = DEFAULT_BLOCK_SIZE,
                 scale_dtype: torch.dtype = DEFAULT_SCALE_DTYPE) -> None:
        super().__init__(block_size=block_size, scale_dtype=scale_dtype, check_finite=check_finite)
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

    def _run(self, collective, send: torch.Tensor, recv: torch.Tensor) -> None:
        """Run an MPI byte collective on contiguous uint8 tensors."""
        if send.device.type == "cpu":
            collective([send.numpy(), self._byte], [recv.numpy(), self._byte])
        elif self.cuda_aware:
            # MPI knows nothing of torch streams: finish the producing kernels first.
            torch.cuda.current_stream().synchronize()
            collective([send, self._byte], [recv, self._byte])
        else:
            host_recv = torch.empty(recv.shape, dtype=recv.dtype)
            collective([send.cpu().numpy(), self._byte], [host_recv.numpy(), self._byte])
            recv.copy_(host_recv)

    def exchange(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        self._run(self.comm.Alltoall, send, recv)

    def gather(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        self._run(self.comm.Allgather, send, recv)
