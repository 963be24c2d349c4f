"""The error-compensated compressed allreduce (1 bit per element, or the
2-bit code of codecs.py), written once.

A backend supplies only how bytes move: `rank`, `size`, and two collectives
on uint8 tensors, each started without waiting and returning a handle whose
`wait()` finishes it (so the next piece is compressed while this one is on
the wire):

  start_exchange(send[p, row], recv[p, row])  all-to-all: row k of send goes
                                              to rank k, recv row i came from rank i;
  start_gather(send[row], recv[p, row])       all-gather: recv row i is rank i's send.

A backend with only blocking collectives implements `exchange(send, recv)`
and `gather(send, recv)` instead; the defaults of start_* call them.

Everything else -- padding, validation, error feedback, the wire layout --
lives here, so the maths cannot drift between torch.distributed, MPI or a
vendor's library.

Scales (wire format v2). The padded buffer of N elements is cut into blocks
of B = block_size elements (see layout.py: every tensor of a fused buffer
starts on a block boundary), and each block has its own scale in both
phases: s = ||x_block|| / sqrt(real elements of the block). A block that is
all zero therefore stays exactly zero, with zero error, and every sign and
scale decision is local to its block.

Wire layout. Chunk k (elements [k*N/p, (k+1)*N/p)) is served by rank k.
It travels as one message row per pipelined piece (pipeline.py: piece j is
the same block-aligned sub-range j of every chunk; one piece unless the
buffer is large): the piece's packed codes (the signs, docs/design.md's bit
order; or the codec's), then the
scales of its blocks in block order, each a little-endian fp32 (4 bytes) or
bf16 (2 bytes, the top half of the fp32) per `scale_dtype`. The signs and
their scales travel in one collective per phase and piece. The piece count
is a schedule only: it changes no bit of the result or of the errors.
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Dict, Optional, Tuple

import torch

from ..collectives import CommunicationError, stable_digest
from ..wire import DEFAULT_BLOCK_SIZE, DEFAULT_SCALE_DTYPE, SCALE_DTYPES, check_block_size
from .codecs import SignCodec
from .layout import BlockLayout
from .pipeline import CallTimer, PieceTuner, PipelineStage, piece_ranges, run_pipelined
from .stats import TrafficStats, fp32_allreduce_bytes

def padded_size(numel: int, world_size: int, block: int = DEFAULT_BLOCK_SIZE) -> int:
    """N: the smallest multiple of block * world_size that holds `numel` elements.

    worker_error needs N elements and server_error N / world_size.
    """
    unit = block * world_size
    return max(unit, (numel + unit - 1) // unit * unit)


class _Piece:
    """Message buffers of one pipelined piece: elements [a, b) of every chunk."""

    def __init__(self, a: int, b: int, p: int, block: int, scale_bytes: int,
                 device: torch.device, codec) -> None:
        self.a, self.b = a, b
        self.chunk_bytes = codec.code_bytes(b - a)  # the codes, then the scales
        row = self.chunk_bytes + (b - a) // block * scale_bytes
        u8 = dict(dtype=torch.uint8, device=device)
        self.send, self.recv = torch.empty(p, row, **u8), torch.empty(p, row, **u8)
        self.server_msg, self.gathered = torch.empty(row, **u8), torch.empty(p, row, **u8)


class _Buffers:
    """Scratch for one layout, allocated once and reused every call."""

    def __init__(self, layout: BlockLayout, scale_dtype: torch.dtype, device: torch.device,
                 codec) -> None:
        block = layout.block
        self.layout, self.scale_dtype, self.device, self.codec = layout, scale_dtype, device, codec
        self.server_x = torch.empty(layout.chunk, dtype=torch.float32, device=device)
        self._pieces: Dict[int, list] = {}
        # Message bytes per rank and phase: the same for any piece count.
        self.row_bytes = codec.code_bytes(layout.chunk) + layout.chunk // block * scale_dtype.itemsize

    def pieces(self, count: int) -> list:
        made = self._pieces.get(count)
        if made is None:
            lay = self.layout
            made = self._pieces[count] = [
                _Piece(a, b, lay.world_size, lay.block, self.scale_dtype.itemsize, self.device,
                       self.codec)
                for a, b in piece_ranges(lay.chunk, lay.block, count)]
        return made


def check_operands(buffer_m, worker_error, server_error) -> None:
    """What every backend's compressed_allreduce asks of its arguments,
    whatever sizes its errors have (each backend checks those): a floating
    buffer, and fp32 errors on its device, contiguous (updated in place)."""
    if not isinstance(buffer_m, torch.Tensor) or not buffer_m.is_floating_point():
        raise ValueError(f"buffer_m must be a floating-point tensor, got "
                         f"{getattr(buffer_m, 'dtype', type(buffer_m).__name__)}")
    for name, t in (("worker_error", worker_error), ("server_error", server_error)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {t.dtype}")
        if t.device != buffer_m.device:
            raise ValueError(f"{name} is on {t.device} but buffer_m is on {buffer_m.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (it is updated in place)")


@contextlib.contextmanager
def naming_the_agreement():
    """A CommunicationError in the layout agreement says so: its all-gather
    goes through the transport's gather, whose phase is the data's."""
    try:
        yield
    except CommunicationError as exc:
        raise CommunicationError(f"onebit: agreeing on the compressed buffer's layout, before "
                                 f"any data moved: {exc}") from exc


class Finished:
    """The handle of a collective that already finished."""

    def wait(self) -> None:
        pass


class CompressedAllreduceBase:
    """`compressed_allreduce` over `exchange` and `gather` (see module doc).

    Args:
      block_size: B, elements per scale (a multiple of 8). Smaller blocks
        follow the data more closely and cost more scale bytes: the wire
        carries 1/8 + scale_bytes/B bytes per element.
      scale_dtype: torch.float32 or torch.bfloat16, the scales on the wire.
        A rounded scale is what the error feedback uses, so rounding is
        compensated like the signs are.
      check_finite: reject NaN/Inf in the buffer before any communication
        (one min/max reduction). Turn off only if the caller already checks.
      piece_size: elements per pipelined piece; 0: no pipelining; None (the
        default): time both on the first calls of each layout and keep the
        faster (pipeline.py). It never changes a bit of the result.
      codec: what each element carries (codecs.py): SignCodec (1 bit, the
        default) or TernaryCodec (2 bits: -1, 0, +1 times the scale).
      agree_every_call: check on every call, in one small all-gather before
        any data moves, that every rank passes the same buffer layout and
        piece size (the default: ranks that disagree get a ValueError, not
        mismatched collectives, which gloo can abort on and MPI hang on).
        False checks each layout's first call only: for owners that agree
        on what they exchange every step themselves (the optimizers, DiLoCo).
    """

    name = "base"

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE,
                 scale_dtype: torch.dtype = DEFAULT_SCALE_DTYPE, check_finite: bool = True,
                 piece_size: Optional[int] = None, codec=SignCodec,
                 agree_every_call: bool = True) -> None:
        check_block_size(block_size)
        self.agree_every_call = agree_every_call
        self.codec = codec
        self.pipeline = PieceTuner(piece_size)
        self.piece_size = piece_size
        if scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}, got {scale_dtype!r}")
        self.block_size, self.scale_dtype = block_size, scale_dtype
        self.check_finite = check_finite
        self._buffers: Dict[tuple, _Buffers] = {}
        self._layouts: Dict[Tuple[int, int], BlockLayout] = {}
        self._agreed: set = set()
        self.stats = TrafficStats()  # bytes and seconds of every compressed_allreduce

    # -------------------------------------------------- transport (subclass) --
    @property
    def rank(self) -> int:
        raise NotImplementedError

    @property
    def size(self) -> int:
        raise NotImplementedError

    def start_exchange(self, send: torch.Tensor, recv: torch.Tensor):
        """Begin the all-to-all; returns a handle whose wait() finishes it."""
        self.exchange(send, recv)
        return Finished()

    def start_gather(self, send: torch.Tensor, recv: torch.Tensor):
        """Begin the all-gather; returns a handle whose wait() finishes it."""
        self.gather(send, recv)
        return Finished()

    def exchange(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} implements neither start_exchange "
                                  "nor exchange")

    def gather(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} implements neither start_gather "
                                  "nor gather")

    # ------------------------------------------------------------- helpers --
    def error_sizes(self, numel: int) -> Tuple[int, int]:
        """(N, N/p): the sizes worker_error and server_error need for a
        buffer of `numel` elements (for a fused buffer: `layout(sizes).padded`)."""
        n = padded_size(numel, self.size, self.block_size)
        return n, n // self.size

    def layout(self, sizes) -> BlockLayout:
        """The tensor-aligned layout of a fused buffer holding tensors of
        `sizes` elements: flatten into `layout.views(flat, shapes)` of a
        zeroed buffer of `layout.numel`, size the errors by `layout.padded`."""
        return BlockLayout(sizes, self.block_size, self.size)

    def error_ranges(self, layout: BlockLayout, index: int):
        """Where tensor `index` of `layout` sits in this rank's (worker,
        server) errors: (start, end) pairs, None where it has no element."""
        return layout.error_ranges(index, self.rank)

    def _validate(self, buffer_m, worker_error, server_error, layout) -> None:
        check_operands(buffer_m, worker_error, server_error)
        p, numel = self.size, buffer_m.numel()
        n, unit = worker_error.numel(), self.block_size * p
        if n % unit or n < numel or (n == 0 and numel):
            raise ValueError(
                f"worker_error has {n} elements; it needs a multiple of block_size*world_size="
                f"{unit} that is at least buffer_m.numel()={numel} (error_sizes({numel}) gives "
                f"{self.error_sizes(numel)[0]})")
        if server_error.numel() != n // p:
            raise ValueError(f"server_error has {server_error.numel()} elements; with "
                             f"worker_error of {n} and world_size {p} it needs {n // p}")
        if layout is not None:
            if (layout.block, layout.world_size) != (self.block_size, p):
                raise ValueError(f"layout was made for block_size {layout.block} and world size "
                                 f"{layout.world_size}; this backend has {self.block_size} and {p}")
            if numel != layout.numel or n != layout.padded:
                raise ValueError(f"buffer_m has {numel} elements and worker_error {n}; the layout "
                                 f"needs {layout.numel} and {layout.padded}")

    def reject_nonfinite(self, buffer_m: torch.Tensor) -> None:
        """A ValueError if `buffer_m` holds a NaN or an inf (two host reads)."""
        lo, hi = torch.aminmax(buffer_m.detach().reshape(-1))  # NaN and +-inf all surface here
        if not (math.isfinite(lo.item()) and math.isfinite(hi.item())):
            raise ValueError("buffer_m contains NaN or Inf; skip this step (e.g. with a "
                             "GradScaler) instead of compressing it")

    @property
    def communication_device(self) -> torch.device:
        """The device the transport's collectives take tensors on (subclasses:
        the process group's, or the host for MPI without CUDA support). The
        small side collectives (agreement, the piece tuner) use it."""
        return torch.device("cpu")

    def _agree(self, layout: BlockLayout) -> None:
        """Every rank checks that all ranks use the same layout (N, block
        size, scale dtype, tensor sizes) and piece size; otherwise the
        collectives below would mismatch or mean different things. On every
        call (agree_every_call), else on a layout's first: a rank's cache
        cannot know that another rank has moved to another layout."""
        key = (layout.key, self.scale_dtype)
        if self.size == 1 or (key in self._agreed and not self.agree_every_call):
            return
        pieces = -1 if self.pipeline.piece_size is None else self.pipeline.piece_size
        mine = torch.tensor([layout.padded, layout.block, self.scale_dtype.itemsize,
                             stable_digest(list(layout.sizes)), self.codec.fingerprint, pieces],
                            dtype=torch.int64)
        with naming_the_agreement():
            rows = [tuple(r) for r in self.share(mine).tolist()]
        if len(set(rows)) != 1:
            raise ValueError("ranks disagree on the compressed buffer (padded size N, block size, "
                             "scale bytes, tensor sizes, code, piece size): " +
                             ", ".join(f"rank {r}: N={v[0]} B={v[1]} scale bytes={v[2]} "
                                       f"code={v[4]} piece size="
                                       f"{'auto' if v[5] < 0 else v[5]}"
                                       for r, v in enumerate(rows)) +
                             "; every rank must pass the same")
        self._agreed.add(key)

    def share(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's copy of the small tensor `t`, stacked (an all-gather
        on the communication device, where the result stays)."""
        t = t.to(self.communication_device)
        every = torch.empty((self.size,) + tuple(t.shape), dtype=t.dtype, device=t.device)
        self.start_gather(t.contiguous().view(torch.uint8).view(-1),
                          every.view(torch.uint8).view(self.size, -1)).wait()
        return every

    def _layout_for(self, numel: int, n: int, layout: Optional[BlockLayout]) -> BlockLayout:
        if layout is not None:
            return layout
        cached = self._layouts.get((numel, n))
        if cached is None:
            cached = self._layouts[(numel, n)] = BlockLayout([numel], self.block_size, self.size, n)
        return cached

    # ----------------------------------------------------------- algorithm --
    def compressed_allreduce(self, buffer_m: torch.Tensor, worker_error: torch.Tensor,
                             server_error: torch.Tensor, local_rank=None,
                             layout: Optional[BlockLayout] = None) -> torch.Tensor:
        """Average `buffer_m` across ranks with error-compensated compression
        (the codec's: 1-bit signs by default), one scale per block of
        `block_size` elements.

        buffer_m: any float dtype and shape, numel <= N. worker_error: fp32 [N],
        N = error_sizes(numel)[0] (a multiple of block_size * p). server_error:
        fp32 [N/p]. Both errors are updated in place. The result is written
        into `buffer_m` (and returned): the same bits on every rank.
        layout: for a fused buffer of several tensors, `self.layout(sizes)`;
        buffer_m then has layout.numel elements, its pad positions are
        ignored and come back zero. Default: one tensor of buffer_m.numel().
        `local_rank` is accepted for DeepSpeed compatibility and unused: the
        device is the one buffer_m lives on.

        The steps (chunk k, elements [k*N/p, (k+1)*N/p), is served by rank k):

        1. Check the arguments, the buffer's values (`check_finite`), and
           that every rank has the same layout (on every call, or with
           agree_every_call=False on a layout's first).
        2. Take buffer_m as one flat fp32 buffer, zeros in the pads.
        3. Worker: add worker_error to every chunk, compress it to codes and
           block scales (row k of the all-to-all), keep what they missed in
           worker_error.
        4. All-to-all: rank k receives every rank's row k.
        5. Server: decode and average the p rows of its own chunk, add
           server_error, compress again, keep what that missed in
           server_error.
        6. All-gather: every rank receives every server's compressed chunk.
        7. Decode: every rank decodes the same bits and scales into
           buffer_m, so every rank holds the same result.

        Steps 3-7 run piece by piece (pipeline.py): while one piece is on
        the wire the next is compressed. The piece count changes no bit.
        """
        started = time.perf_counter()
        self._validate(buffer_m, worker_error, server_error, layout)
        if buffer_m.numel() and self.check_finite:
            self.reject_nonfinite(buffer_m)
        layout = self._layout_for(buffer_m.numel(), worker_error.numel(), layout)
        if buffer_m.numel() or self.agree_every_call:  # (an empty one on some ranks only)
            self._agree(layout)
        if buffer_m.numel() == 0:
            worker_error.zero_()
            server_error.zero_()
            return buffer_m
        device = buffer_m.device
        key = (layout.key, device)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = _Buffers(layout, self.scale_dtype, device, self.codec)
        count = self.pipeline.count(layout.key, layout.padded, self.size)
        # The tuner's clock (device events), only on the calls it times.
        timer = CallTimer(device) if self.pipeline.timing(layout.key) else None
        plan = _AllreducePlan(buffer_m, worker_error, server_error, layout, buf, self.rank,
                              self.scale_dtype)
        comm_s = 0.0

        def on_wire(call, *args):  # starting and waiting count as communication time
            nonlocal comm_s
            t = time.perf_counter()
            result = call(*args)
            comm_s += time.perf_counter() - t
            return result

        run_pipelined(buf.pieces(count), [
            PipelineStage(plan.worker, lambda pc: self.start_exchange(pc.send, pc.recv)),
            PipelineStage(plan.server, lambda pc: self.start_gather(pc.server_msg, pc.gathered)),
            PipelineStage(plan.decode)], on_wire)
        plan.finish()
        # Phase 1 sends p - 1 rows of the all-to-all, phase 2 one row to p - 1 peers.
        moved = (self.size - 1) * 2 * buf.row_bytes
        took = time.perf_counter() - started
        self.stats.add(moved, moved, fp32_allreduce_bytes(sum(layout.sizes), self.size), comm_s,
                       took - comm_s)
        if timer is not None:
            self.pipeline.record(layout.key, count, timer.stop().seconds, self.share)
        return buffer_m


class _AllreducePlan:
    """One call of the compressed allreduce, from step 2 on: the flat fp32
    buffer and the errors, and the worker, server and decode stages of one
    piece (the numbered steps of `compressed_allreduce`)."""

    def __init__(self, buffer_m: torch.Tensor, worker_error: torch.Tensor,
                 server_error: torch.Tensor, layout: BlockLayout, buffers: _Buffers, rank: int,
                 scale_dtype: torch.dtype) -> None:
        device = buffer_m.device
        self.codec = buffers.codec
        self.buffer_m, self.worker_error, self.server_error = buffer_m, worker_error, server_error
        self.layout, self.buffers, self.rank, self.scale_dtype = layout, buffers, rank, scale_dtype
        self.block, self.chunk, self.device = layout.block, layout.chunk, device
        # Step 2. `src` is buffer_m itself when it is contiguous fp32, else
        # one fp32 copy; either way it receives the result.
        self.inplace = buffer_m.dtype == torch.float32 and buffer_m.is_contiguous()
        self.src = (buffer_m.detach().view(-1) if self.inplace
                    else buffer_m.detach().reshape(-1).float())
        self.pads = layout.pads(device)
        self.inner_pads = self.pads[:layout.inner_pads]  # the gaps between tensors
        self.src.index_fill_(0, self.inner_pads, 0.0)
        worker_error.index_fill_(0, self.pads, 0.0)  # errors a caller left there would skew scales
        self.numel = self.src.numel()
        p = layout.world_size
        self.counts_rows = layout.counts(device).view(p, self.chunk // self.block)

    def worker(self, pc: _Piece) -> None:
        """Step 3: compensate and compress elements [a, b) of every chunk k,
        into row k: every row in one launch (ops.compress_rows)."""
        a, b, block, chunk = pc.a, pc.b, self.block, self.chunk
        rows = self.worker_error.view(self.layout.world_size, chunk)[:, a:b]
        self.codec.compress_rows(self.src[a:], rows, self.counts_rows[:, a // block:b // block],
                                 block, self.scale_dtype, pc.send, pc.chunk_bytes)

    def server(self, pc: _Piece) -> None:
        """Step 5: serve [a, b) of this rank's chunk: average the p decoded
        rows, compensate, compress into the all-gather message."""
        a, b, cb = pc.a, pc.b, pc.chunk_bytes
        mine = self.rank * self.chunk
        my_pads = self.layout.pads(self.device, mine + a, mine + b)
        x, err = self.buffers.server_x[a:b], self.server_error[a:b]
        self.codec.decode_mean(pc.recv, self._scales(pc.recv, cb), b - a, x, self.block)
        x.index_fill_(0, my_pads, 0.0)
        err.index_fill_(0, my_pads, 0.0)
        self.codec.compress(x, err, self.layout.counts(self.device, mine + a, mine + b),
                            self.block, self.scale_dtype, pc.server_msg[cb:], pc.server_msg[:cb])
        err.index_fill_(0, my_pads, 0.0)

    def decode(self, pc: _Piece) -> None:
        """Step 7: everyone decodes the same gathered bits and scales, row k
        into elements [a, b) of chunk k, every row in one launch."""
        scales = self._scales(pc.gathered, pc.chunk_bytes)
        self.codec.decode_rows(pc.gathered, scales, pc.b - pc.a, self.src[pc.a:], self.chunk,
                               self.block)

    def finish(self) -> None:
        """Zeros back in the pads; the result into buffer_m if it was copied."""
        self.worker_error.index_fill_(0, self.pads, 0.0)
        self.src.index_fill_(0, self.inner_pads, 0.0)
        if not self.inplace:
            self.buffer_m.detach().copy_(self.src.view(self.buffer_m.shape))

    def _scales(self, rows: torch.Tensor, chunk_bytes: int) -> torch.Tensor:
        """The fp32 scales at the end of each message row, [rows, blocks]. A
        copy of their own: one row alone is contiguous already, and its
        scales start chunk_bytes into it, where a 4-byte view may not."""
        return rows[:, chunk_bytes:].clone(memory_format=torch.contiguous_format).view(
            self.scale_dtype).float()
