"""MpiBackend: the 1-bit allreduce over mpi4py (Ialltoall and Iallgather per
pipelined piece). Without an asynchronous progress thread (MPICH's default),
MPI moves a nonblocking collective's bytes mostly inside Wait, so pipelining
overlaps less here than over torch.distributed, whose gloo threads progress
on their own; set MPIR_CVAR_ASYNC_PROGRESS=1 for MPICH's progress thread."""
from __future__ import annotations

from typing import Optional

import torch

from ..wire import DEFAULT_BLOCK_SIZE, DEFAULT_SCALE_DTYPE
from .base import CompressedAllreduceBase

INSTALL_HINT = "install it with: pip install 'onebit[mpi]'  (mpi4py + MPICH from PyPI)"


def mpi_cuda_support(MPI) -> bool:
    """Whether the MPI library under mpi4py says it takes CUDA device
    pointers: MPIX_Query_cuda_support (Open MPI, MPICH >= 4), called on
    the library mpi4py loaded. An MPI without the query is taken to have no
    support: handing it device pointers would crash the process."""
    import ctypes

    try:
        query = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return False
    query.restype = ctypes.c_int
    return bool(query())


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
        if cuda_aware and not mpi_cuda_support(MPI):
            raise ValueError(
                f"cuda_aware=True, but this MPI ({MPI.Get_library_version().splitlines()[0]}) "
                "does not report CUDA support (MPIX_Query_cuda_support), and would crash on a "
                "device pointer. Use cuda_aware=False (device tensors are staged through pinned "
                "host memory), or an MPI built with CUDA support (Open MPI or MPICH configured "
                "--with-cuda, e.g. the one your cluster provides), not the [mpi] extra's MPICH")
        self._byte = MPI.BYTE
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.cuda_aware = cuda_aware
        self._host_twins: dict = {}  # (send, recv) device buffers -> pinned host buffers

    @property
    def communication_device(self) -> torch.device:
        """A CUDA-aware MPI takes the accelerator's tensors; else the host."""
        if self.cuda_aware:
            from ..accelerator import get_accelerator

            acc = get_accelerator()
            return torch.device(acc.name, acc.current_device()) if acc.name != "cpu" else \
                torch.device("cpu")
        return torch.device("cpu")

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
        from ..accelerator import get_accelerator

        # MPI knows nothing of torch streams: the producing kernels (and the
        # copy to the host) must finish before MPI reads.
        stream = get_accelerator().current_stream(send.device.index)
        if self.cuda_aware:
            stream.synchronize()
            return _Request(collective([send, self._byte], [recv, self._byte]))
        # Staged through pinned host twins of the piece's buffers, made once:
        # the collective stays nonblocking, so pieces pipeline as on the host.
        host_send, host_recv = self._staging(send, recv)
        host_send.copy_(send, non_blocking=True)
        stream.synchronize()
        request = collective([host_send.numpy(), self._byte], [host_recv.numpy(), self._byte])
        return _Request(request, lambda: recv.copy_(host_recv, non_blocking=True))

    def _staging(self, send: torch.Tensor, recv: torch.Tensor):
        """Pinned host buffers for this device send/recv pair, kept: the
        backend reuses each piece's message buffers every call."""
        from ..accelerator import get_accelerator

        key = (send.data_ptr(), send.shape, recv.data_ptr(), recv.shape)
        made = self._host_twins.get(key)
        if made is None:
            pin = get_accelerator().pin_memory
            made = self._host_twins[key] = (pin(torch.empty(send.shape, dtype=send.dtype)),
                                            pin(torch.empty(recv.shape, dtype=recv.dtype)))
        return made

    def start_exchange(self, send: torch.Tensor, recv: torch.Tensor):
        return self._start(self.comm.Ialltoall, send, recv)

    def start_gather(self, send: torch.Tensor, recv: torch.Tensor):
        return self._start(self.comm.Iallgather, send, recv)


class _Request:
    def __init__(self, request, then=None) -> None:
        self.request, self.then = request, then

    def wait(self) -> None:
        self.request.Wait()
        if self.then is not None:
            self.then()
