"""Kernels loaded with ctypes from a shared library of extern "C" launchers
(the CUDA and SYCL kernels), and the builder logic they share."""
from __future__ import annotations

import ctypes
import itertools
import threading
from pathlib import Path
from typing import Callable, ContextManager, Sequence

import torch

from .base import OpBuilder, OpBuilderError
from .cpu import DTYPE_CODES

_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int

# Elements per thread block of the kernels over a list of tensors (the
# non-finite check, the norms): a multiple of 4, since they read 16-byte
# vectors from a chunk's start.
TABLE_CHUNK = 8192

# The fused optimizer steps over lists of tensors (multi_tensor.py), each
# launcher's name after the prefix and its count of float arguments.
LIST_STEPS = {"zero_one_local_step": 3, "zero_one_step": 4, "zero_one_sync_input": 3,
              "zero_one_land": 2}


class SharedLibraryBuilder(OpBuilder):
    """Builds `<prefix>-<hash>/lib<stem>.so` with the subclass's compile flags."""

    FLAGS: Sequence[str] = ()
    LIB_STEM = "onebit_kernels"

    def library_path(self) -> Path:
        return self.build_dir() / f"{self.LIB_STEM}-{self.source_hash()}" / f"lib{self.LIB_STEM}.so"

    def build(self) -> Path:
        out = self.library_path()
        if not out.exists():
            self.run_compiler([*self.FLAGS, "-shared", *map(str, self.sources())], out)
        return out

    def compile_check(self, output: Path) -> Path:
        """Compile the sources to an object file only: proves they build
        where the device (or its driver) is absent."""
        return self.run_compiler([*self.FLAGS, "-c", *map(str, self.sources())], output)

    def open_library(self) -> ctypes.CDLL:
        try:
            return ctypes.CDLL(str(self.build()))
        except OSError as exc:
            raise OpBuilderError(f"{self.NAME}: cannot load {self.library_path()}: {exc}") from exc


class _ChunkTables:
    """The table the list kernels read (pointers, sizes, and each tensor's
    first chunk of TABLE_CHUNK elements), sent to the device pinned, behind
    the stream's work: no host sync. The last few are used again while their
    pointers and sizes are the same (the caching allocator tends to give a
    step's new gradients the last step's addresses; a step checks its
    gradients and takes LAMB's norms of other lists). Kept per stream: a
    table is read only behind the copy that wrote it, and freed only on the
    stream that used it (DiLoCo's communication thread has a stream of its
    own)."""

    KEEP = 8

    def __init__(self, stream: Callable[[torch.device], int]) -> None:
        self._stream = stream
        self._kept = {}  # (device, stream, pointers + sizes) -> (table, chunks), oldest first
        # DiLoCo's communication thread asks too: two threads evicting at
        # once would both pick the oldest key, and the second would fail.
        self._lock = threading.Lock()

    def table(self, tensors, sizes, device: torch.device, *more_lists):
        """(table, chunks): the pointers of `tensors` (then of each of
        `more_lists`, alike in length and sizes), `sizes`, first chunks."""
        pointers = [ptr for ts in (tensors, *more_lists) for ptr in map(torch.Tensor.data_ptr, ts)]
        key = (device, self._stream(device), tuple(pointers + list(sizes)))
        with self._lock:
            kept = self._kept.pop(key, None)
            if kept is None:
                first = list(itertools.accumulate((-(-n // TABLE_CHUNK) for n in sizes),
                                                  initial=0))
                table = torch.tensor(pointers + list(sizes) + first, dtype=torch.int64,
                                     pin_memory=True).to(device, non_blocking=True)
                kept = (table, first[-1])
                if len(self._kept) >= self.KEEP:
                    del self._kept[next(iter(self._kept))]
            self._kept[key] = kept  # (the newest last)
        return kept


class LauncherKernels:
    """The kernels interface over extern "C" launchers that return 0 on success.

    Every launch runs on the device of the tensors it is given, whichever
    thread calls it: inside `device_guard(device)` (the launcher's kernel
    goes to the current device), on `stream(device)`, the stream (CUDA,
    passed last) or queue (SYCL, passed first) pointer of that device's
    current torch stream. A communication thread whose current device is 0
    thus still launches on the data's GPU.
    """

    def __init__(self, name: str, lib: ctypes.CDLL, prefix: str,
                 stream: Callable[[torch.device], int], stream_first: bool,
                 device_guard: Callable[[torch.device], ContextManager]) -> None:
        self.name = name
        self._stream, self._first, self._guard = stream, stream_first, device_guard
        s = [_P] if stream_first else []
        e = [] if stream_first else [_P]
        self._pack = self._fn(lib, f"{prefix}_pack", s + [_I, _P, _I64, _P] + e)
        self._decode = self._fn(lib, f"{prefix}_decode", s + [_P, _I64, _I, _P, _I64, _I64, _P] + e)
        self._compensate = self._fn(lib, f"{prefix}_compensate", s + [_P, _I64, _P, _I64, _I64, _P] + e)
        self._pack_error = self._fn(lib, f"{prefix}_pack_error", s + [_P, _I64, _P, _I64, _P] + e)
        fused = getattr(lib, f"{prefix}_compress", None)
        if fused is not None:  # ops.compress takes the one-pass kernel where there is one
            fused = self._fn(lib, f"{prefix}_compress",
                             s + [_P, _I64, _P, _I64, _I64, _P, _I, _P, _P] + e)

            def compress(buf, err, counts, block, scales_out, bits_out) -> None:
                self._call(fused, err.device, buf.data_ptr(), buf.numel(), err.data_ptr(),
                           err.numel(), block, counts.data_ptr(),
                           scales_out.numel() // counts.numel(), scales_out.data_ptr(),
                           bits_out.data_ptr())

            self.compress = compress
        rows = getattr(lib, f"{prefix}_compress_rows", None)
        if rows is not None:  # ops.compress_rows: the worker's row for every rank in one launch
            rows = self._fn(lib, f"{prefix}_compress_rows",
                            s + [_P, _I64, _P, _I64, _I, _I64, _I64, _P, _I, _P, _P, _I64] + e)

            def compress_rows(buf, err, counts, block, scales_out, bits_out) -> None:
                self._call(rows, err.device, buf.data_ptr(), buf.numel(), err.data_ptr(),
                           err.shape[1], err.shape[0], err.stride(0), block, counts.data_ptr(),
                           scales_out.shape[1] // counts.shape[1], scales_out.data_ptr(),
                           bits_out.data_ptr(), bits_out.stride(0))

            self.compress_rows = compress_rows
        each = getattr(lib, f"{prefix}_decode_rows", None)
        if each is not None:  # ops.decode_rows: every gathered chunk decoded in one launch
            each = self._fn(lib, f"{prefix}_decode_rows",
                            s + [_P, _I64, _I, _P, _I64, _I64, _P, _I64, _I64] + e)

            def decode_rows(bits, scales, block, cols, out, stride) -> None:
                self._call(each, out.device, bits.data_ptr(), bits.stride(0), bits.shape[0],
                           scales.data_ptr(), block, cols, out.data_ptr(), stride, out.numel())

            self.decode_rows = decode_rows
        tables = _ChunkTables(stream)
        check = getattr(lib, f"{prefix}_nonfinite", None)
        if check is not None:  # the optimizer's non-finite check in one launch (agreement.py)
            check = self._fn(lib, f"{prefix}_nonfinite", s + [_P, _I64, _I64, _I64, _P] + e)

            def any_nonfinite(tensors, sizes, flag) -> None:
                """flag (a 0-dim int64 on the tensors' device) <- 1 where an
                element of `tensors` (contiguous fp32 of `sizes` elements,
                none empty) has a square beyond fp32: NaN, inf or |x| >
                ~1.8e19. No host sync (see _ChunkTables)."""
                table, chunks = tables.table(tensors, sizes, flag.device)
                self._call(check, flag.device, table.data_ptr(), len(tensors), chunks,
                           TABLE_CHUNK, flag.data_ptr())

            self.any_nonfinite = any_nonfinite
        norms = getattr(lib, f"{prefix}_norms", None)
        if norms is not None:  # per-tensor 2-norms in two launches (multi_tensor.py)
            norms = self._fn(lib, f"{prefix}_norms", s + [_P, _I64, _I64, _I64, _P, _P] + e)

            def tensor_norms(tensors, sizes, out) -> None:
                """out (fp32, one per tensor, on the tensors' device) <- each
                tensor's 2-norm, summed in float64 in a fixed order: the
                same bits at every call. `tensors`: contiguous fp32 of
                `sizes` elements (empty ones give 0). No host sync."""
                table, chunks = tables.table(tensors, sizes, out.device)
                partial = torch.empty(max(chunks, 1), dtype=torch.float64, device=out.device)
                self._call(norms, out.device, table.data_ptr(), len(tensors), chunks,
                           TABLE_CHUNK, partial.data_ptr(), out.data_ptr())

            self.tensor_norms = tensor_norms
        ratio = getattr(lib, f"{prefix}_lamb_ratio_norms", None)
        if ratio is not None:  # 1-bit LAMB's trust-ratio pass in one read (optim/lamb.py)
            ratio = self._fn(lib, f"{prefix}_lamb_ratio_norms",
                             s + [_P, _I64, _I64, _I64, ctypes.c_float, ctypes.c_float, _P, _P] + e)

            def lamb_ratio_norms(params, exp_avgs, smoothed, denoms, sizes, weight: float,
                                 weight_decay: float, out) -> None:
                """smoothed <- lerp(smoothed, exp_avgs, weight) (torch's
                lerp's rounding), and out (2 x len(params) fp32) <-
                each ||p||, then each ||smoothed / denom + weight_decay x
                p||, in tensor_norms' order of sums. Every list: contiguous
                fp32 of `sizes` elements. No host sync."""
                table, chunks = tables.table(params, sizes, out.device, exp_avgs, smoothed,
                                             denoms)
                partial = torch.empty(max(2 * chunks, 1), dtype=torch.float64, device=out.device)
                self._call(ratio, out.device, table.data_ptr(), len(params), chunks, TABLE_CHUNK,
                           weight, weight_decay, partial.data_ptr(), out.data_ptr())

            self.lamb_ratio_norms = lamb_ratio_norms
        # Optimizer steps fused over lists (multi_tensor.py says what each
        # computes): launch(lists, sizes, *scalars), `lists` alike in
        # sizes, contiguous fp32; the scalars go as C floats.
        for name, scalars in LIST_STEPS.items():
            if getattr(lib, f"{prefix}_{name}", None) is not None:
                fn = self._fn(lib, f"{prefix}_{name}",
                              s + [_P, _I64, _I64, _I64] + [ctypes.c_float] * scalars + e)
                setattr(self, name, self._list_step(fn, tables))

    def _list_step(self, fn, tables: "_ChunkTables"):
        def launch(lists, sizes, *scalars) -> None:
            device = lists[0][0].device
            table, chunks = tables.table(lists[0], sizes, device, *lists[1:])
            self._call(fn, device, table.data_ptr(), len(sizes), chunks, TABLE_CHUNK, *scalars)
        return launch

    @staticmethod
    def _fn(lib, name, argtypes):
        f = getattr(lib, name)
        f.argtypes, f.restype = argtypes, _I
        return f

    def _call(self, f, device: torch.device, *args) -> None:
        with self._guard(device):
            stream = self._stream(device)
            rc = f(stream, *args) if self._first else f(*args, stream)
        if rc != 0:
            raise RuntimeError(f"{self.name}: kernel launch on {device} failed with error {rc}")

    def pack(self, x: torch.Tensor, out: torch.Tensor) -> None:
        self._call(self._pack, out.device, DTYPE_CODES[x.dtype], x.data_ptr(), x.numel(),
                   out.data_ptr())

    def decode(self, bits: torch.Tensor, scales: torch.Tensor, block: int, cols: int,
               out: torch.Tensor) -> None:
        self._call(self._decode, out.device, bits.data_ptr(), bits.stride(0), bits.shape[0],
                   scales.data_ptr(), block, cols, out.data_ptr())

    def compensate(self, buf: torch.Tensor, err: torch.Tensor, sumsq: torch.Tensor,
                   block: int) -> None:
        self._call(self._compensate, err.device, buf.data_ptr(), buf.numel(), err.data_ptr(),
                   err.numel(), block, sumsq.data_ptr())

    def pack_error(self, err: torch.Tensor, scales: torch.Tensor, block: int,
                   out: torch.Tensor) -> None:
        self._call(self._pack_error, err.device, err.data_ptr(), err.numel(), scales.data_ptr(),
                   block, out.data_ptr())
