"""The error-compensated 1-bit allreduce, written once.

A backend supplies only how bytes move: `rank`, `size`, and two collectives
on uint8 tensors,

  exchange(send[p, row], recv[p, row])   all-to-all: row k of send goes to
                                         rank k, recv row i came from rank i;
  gather(send[row], recv[p, row])        all-gather: recv row i is rank i's send.

Everything else -- padding, validation, error feedback, the wire layout --
lives here, so the maths cannot drift between torch.distributed, MPI or a
vendor's library.

Wire layout. Each message row is `chunk/8` bytes of packed signs followed by
the sender's fp32 scale (4 bytes), so the signs and their scale travel in one
collective per phase instead of two.
"""
from __future__ import annotations

import math
from typing import Dict, Tuple

import torch

from .. import ops

WIRE_FORMAT_VERSION = 1
_SCALE_BYTES = 4


def padded_size(numel: int, world_size: int) -> int:
    """N: the smallest multiple of 8 * world_size that holds `numel` elements.

    worker_error needs N elements and server_error N / world_size.
    """
    unit = 8 * world_size
    return max(unit, (numel + unit - 1) // unit * unit)


class _Buffers:
    """Scratch for one padded size N, allocated once and reused every call."""

    def __init__(self, n: int, p: int, device: torch.device) -> None:
        chunk = n // p
        self.chunk_bytes = chunk // 8
        row = self.chunk_bytes + _SCALE_BYTES
        u8 = dict(dtype=torch.uint8, device=device)
        self.worker_bits = torch.empty(n // 8, **u8)
        self.send = torch.empty(p, row, **u8)
        self.recv = torch.empty(p, row, **u8)
        self.server_x = torch.empty(chunk, dtype=torch.float32, device=device)
        self.server_msg = torch.empty(row, **u8)
        self.gathered = torch.empty(p, row, **u8)
        self.scale = torch.empty(1, dtype=torch.float32, device=device)


def _scales(rows: torch.Tensor, chunk_bytes: int) -> torch.Tensor:
    """The fp32 scale at the end of each message row, as a [p] tensor."""
    fresh = rows[:, chunk_bytes:].clone(memory_format=torch.contiguous_format)  # 4-byte aligned
    return fresh.view(torch.float32).view(-1)


class CompressedAllreduceBase:
    """`compressed_allreduce` over `exchange` and `gather` (see module doc).

    Args:
      check_finite: reject NaN/Inf in the buffer before any communication
        (one min/max reduction). Turn off only if the caller already checks.
    """

    name = "base"

    def __init__(self, check_finite: bool = True) -> None:
        self.check_finite = check_finite
        self._buffers: Dict[Tuple[int, torch.device], _Buffers] = {}
        self._agreed_sizes: set = set()

    # -------------------------------------------------- transport (subclass) --
    @property
    def rank(self) -> int:
        raise NotImplementedError

    @property
    def size(self) -> int:
        raise NotImplementedError

    def exchange(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        raise NotImplementedError

    def gather(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------- helpers --
    def error_sizes(self, numel: int) -> Tuple[int, int]:
        """(N, N/p): the sizes worker_error and server_error need for `numel`."""
        n = padded_size(numel, self.size)
        return n, n // self.size

    def _validate(self, buffer_m, worker_error, server_error) -> None:
        if not isinstance(buffer_m, torch.Tensor) or not buffer_m.is_floating_point():
            raise ValueError(f"buffer_m must be a floating-point tensor, got "
                             f"{getattr(buffer_m, 'dtype', type(buffer_m).__name__)}")
        p, numel = self.size, buffer_m.numel()
        for name, t in (("worker_error", worker_error), ("server_error", server_error)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
            if t.dtype != torch.float32:
                raise ValueError(f"{name} must be float32, got {t.dtype}")
            if t.device != buffer_m.device:
                raise ValueError(f"{name} is on {t.device} but buffer_m is on {buffer_m.device}")
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous (it is updated in place)")
        n = worker_error.numel()
        if n % (8 * p) or n < numel or (n == 0 and numel):
            raise ValueError(
                f"worker_error has {n} elements; it needs a multiple of 8*world_size={8 * p} "
                f"that is at least buffer_m.numel()={numel} (error_sizes({numel}) gives "
                f"{self.error_sizes(numel)[0]})")
        if server_error.numel() != n // p:
            raise ValueError(f"server_error has {server_error.numel()} elements; with "
                             f"worker_error of {n} and world_size {p} it needs {n // p}")

    def _check_finite(self, buffer_m: torch.Tensor) -> None:
        lo, hi = torch.aminmax(buffer_m.detach().reshape(-1))  # NaN and +-inf all surface here
        if not (math.isfinite(lo.item()) and math.isfinite(hi.item())):
            raise ValueError("buffer_m contains NaN or Inf; skip this step (e.g. with a "
                             "GradScaler) instead of compressing it")

    def _agree_on_size(self, n: int, device: torch.device) -> None:
        """The first time a size is seen, every rank checks that all ranks
        passed the same N; otherwise the collectives below would mismatch."""
        if n in self._agreed_sizes or self.size == 1:
            return
        mine = torch.tensor([n], dtype=torch.int64, device=device).view(torch.uint8)
        all_n = torch.empty(self.size, 8, dtype=torch.uint8, device=device)
        self.gather(mine, all_n)
        sizes = all_n.view(torch.int64).view(-1).tolist()
        if len(set(sizes)) != 1:
            raise ValueError(f"ranks disagree on the padded size N (worker_error.numel()): "
                             f"{dict(enumerate(sizes))}; every rank must pass the same sizes")
        self._agreed_sizes.add(n)

    # ----------------------------------------------------------- algorithm --
    def compressed_allreduce(self, buffer_m: torch.Tensor, worker_error: torch.Tensor,
                             server_error: torch.Tensor, local_rank=None) -> torch.Tensor:
        """Average `buffer_m` across ranks with 1-bit error-compensated compression.

        buffer_m: any float dtype and shape, numel <= N. worker_error: fp32 [N],
        N = error_sizes(numel)[0] (a multiple of 8p). server_error: fp32 [N/p].
        Both errors are updated in place. The result is written into
        `buffer_m` (and returned): the same bits on every rank.
        `local_rank` is accepted for DeepSpeed compatibility and unused: the
        device is the one buffer_m lives on.
        """
        self._validate(buffer_m, worker_error, server_error)
        if buffer_m.numel() == 0:
            worker_error.zero_()
            server_error.zero_()
            return buffer_m
        if self.check_finite:
            self._check_finite(buffer_m)
        p, n = self.size, worker_error.numel()
        self._agree_on_size(n, buffer_m.device)
        buf = self._buffers.get((n, buffer_m.device))
        if buf is None:
            buf = self._buffers[(n, buffer_m.device)] = _Buffers(n, p, buffer_m.device)
        cb, chunk = buf.chunk_bytes, n // p

        # Worker: compensate, compress, send chunk k (+ my scale) to rank k.
        # `src` is buffer_m itself when it is contiguous fp32, else one fp32
        # copy; either way it is free once packed, and receives the result.
        inplace = buffer_m.dtype == torch.float32 and buffer_m.is_contiguous()
        src = buffer_m.detach().view(-1) if inplace else buffer_m.detach().reshape(-1).float()
        ops.compensate_pack(src, worker_error, buf.worker_bits, buf.scale)
        buf.send[:, :cb].copy_(buf.worker_bits.view(p, cb))
        buf.send[:, cb:].copy_(buf.scale.view(torch.uint8).expand(p, _SCALE_BYTES))
        self.exchange(buf.send, buf.recv)

        # Server for chunk `rank`: average the p decoded chunks, compensate, compress.
        ops.decode_mean(buf.recv, _scales(buf.recv, cb), chunk, buf.server_x)
        ops.compensate_pack(buf.server_x, server_error, buf.server_msg[:cb], buf.scale)
        buf.server_msg[cb:].copy_(buf.scale.view(torch.uint8))
        self.gather(buf.server_msg, buf.gathered)

        # Everyone decodes the same gathered bits and scales: identical output.
        scales, numel = _scales(buf.gathered, cb), src.numel()
        for k in range(p):
            lo, hi = k * chunk, min((k + 1) * chunk, numel)
            if lo < hi:
                ops.decode_mean(buf.gathered[k:k + 1], scales[k:k + 1], hi - lo, src[lo:hi])
        if not inplace:
            buffer_m.detach().copy_(src.view(buffer_m.shape))
        return buffer_m
