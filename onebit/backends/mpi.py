"""MpiBackend: the 1-bit allreduce over mpi4py (Ialltoall and Iallgather per
pipelined piece). Without an asynchronous progress thread (MPICH's default),
MPI moves a nonblocking collective's bytes mostly inside Wait, so pipelining
overlaps less here than over torch.distributed, whose gloo threads progress
on their own; set MPIR_CVAR_ASYNC_PROGRESS=1 for MPICH's progress thread.

MPI_Wait has no deadline, so a request is finished by polling MPI_Test
(which drives MPI's progress as Wait does) until `timeout_s` passes, when
the wait raises CommunicationError as the torch.distributed backends do."""
from __future__ import annotations

import time
from typing import Optional

import torch

from .. import collectives
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
      timeout_s: deadline of each collective (default $ONEBIT_TIMEOUT_S or
        300 s); past it CommunicationError names the phase. MPI cannot cancel
        a collective, so the communicator is unusable after one: end the job.
      block_size, scale_dtype, check_finite, piece_size, agree_every_call: see
        CompressedAllreduceBase.
    """

    name = "mpi"

    def __init__(self, cuda_aware: bool = False, comm=None, check_finite: bool = True,
                 block_size: int = DEFAULT_BLOCK_SIZE,
                 scale_dtype: torch.dtype = DEFAULT_SCALE_DTYPE,
                 piece_size: Optional[int] = None, timeout_s: Optional[float] = None,
                 agree_every_call: bool = True) -> None:
        super().__init__(block_size=block_size, scale_dtype=scale_dtype, check_finite=check_finite,
                         piece_size=piece_size, agree_every_call=agree_every_call)
        self.timeout_s = collectives.check_timeout(timeout_s)
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

    def _start(self, phase: str, collective, send: torch.Tensor, recv: torch.Tensor):
        """Start a nonblocking MPI byte collective on contiguous uint8 tensors;
        returns its request (wait(): finished within the deadline)."""
        def request(started, then=None):
            return _Request(started, BoundedWait(phase, self.timeout_s, self.rank, self.size),
                            then)

        if send.device.type == "cpu":
            return request(collective([send.numpy(), self._byte], [recv.numpy(), self._byte]))
        from ..accelerator import get_accelerator

        # MPI knows nothing of torch streams: the producing kernels (and the
        # copy to the host) must finish before MPI reads.
        stream = get_accelerator().current_stream(send.device.index)
        if self.cuda_aware:
            stream.synchronize()
            return request(collective([send, self._byte], [recv, self._byte]))
        # Staged through pinned host twins of the piece's buffers, made once:
        # the collective stays nonblocking, so pieces pipeline as on the host.
        host_send, host_recv = self._staging(send, recv)
        host_send.copy_(send, non_blocking=True)
        stream.synchronize()
        return request(collective([host_send.numpy(), self._byte], [host_recv.numpy(), self._byte]),
                       lambda: recv.copy_(host_recv, non_blocking=True))

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
        return self._start("compressed_allreduce phase 1 (MPI all-to-all of worker signs)",
                           self.comm.Ialltoall, send, recv)

    def start_gather(self, send: torch.Tensor, recv: torch.Tensor):
        return self._start("compressed_allreduce all-gather (MPI, server signs / sizes)",
                           self.comm.Iallgather, send, recv)


class BoundedWait:
    """Finish MPI requests within a deadline: poll MPI_Test, giving the core
    away between polls (sleep(0)). Past `timeout_s` (None: the default
    deadline), CommunicationError naming the phase.

    Measured against MPI_Wait (4 ranks on 2 cores, one piece): 1.59 against
    0.81 ms a call at 2^16 elements, 22.9 against 23.8 ms at 2^22. A Python
    loop that spun on MPI_Test for a millisecond before sleeping took 3.8
    and 29 ms there: on shared cores a spinning rank takes the time its
    peers need to progress."""

    def __init__(self, phase: str, timeout_s: Optional[float], rank: int, size: int) -> None:
        self.phase, self.rank, self.size = phase, rank, size
        self.timeout_s = collectives.default_timeout_s() if timeout_s is None else timeout_s

    def finish(self, request) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not request.Test():
            if time.monotonic() > deadline:
                raise collectives.CommunicationError(
                    f"onebit: {self.phase} did not finish within {self.timeout_s:g} s on rank "
                    f"{self.rank} of {self.size} (MPI): a peer rank probably died, hung, or "
                    "stopped calling step() in step with the others. MPI cannot cancel the "
                    "collective, so this communicator is unusable now: end the job")
            time.sleep(0)


class _Request:
    def __init__(self, request, bounded: BoundedWait, then=None) -> None:
        self.request, self.bounded, self.then = request, bounded, then

    def wait(self) -> None:
        self.bounded.finish(self.request)
        if self.then is not None:
            self.then()
