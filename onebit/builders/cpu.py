"""CPUPackbitsBuilder: the pybind11 module from kernels/cpu/packbits.cpp.

It is normally compiled ahead of time by setup.py as `onebit._packbits_cpu`.
If that module is missing (or ONEBIT_FORCE_JIT=1), it is compiled just in
time with the C++ compiler ($ONEBIT_CXX, default `c++`) into
$ONEBIT_BUILD_DIR (default ~/.cache/onebit).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sysconfig
from pathlib import Path

import torch

from .base import OpBuilder, OpBuilderError

# dtype codes understood by the C++ `pack` (see packbits.cpp).
DTYPE_CODES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}
MODULE = "_packbits_cpu"


class CpuKernels:
    """Tensor-level wrapper around the raw-pointer C++ entry points."""

    def __init__(self, module) -> None:
        self._m = module
        self.name = "cpu-avx2" if module.has_avx2() else "cpu-portable"

    @staticmethod
    def _threads() -> int:
        return max(1, torch.get_num_threads())

    def pack(self, x: torch.Tensor, out: torch.Tensor) -> None:
        self._m.pack(DTYPE_CODES[x.dtype], x.data_ptr(), x.numel(), out.data_ptr(), self._threads())

    def decode(self, bits: torch.Tensor, scales: torch.Tensor, block: int, cols: int,
               out: torch.Tensor) -> None:
        self._m.decode(bits.data_ptr(), bits.stride(0), bits.shape[0], scales.data_ptr(), block,
                       cols, out.data_ptr(), self._threads())

    def compensate(self, buf: torch.Tensor, err: torch.Tensor, sumsq: torch.Tensor,
                   block: int) -> None:
        self._m.compensate(buf.data_ptr(), buf.numel(), err.data_ptr(), err.numel(), block,
                           sumsq.data_ptr(), self._threads())

    def pack_error(self, err: torch.Tensor, scales: torch.Tensor, block: int,
                   out: torch.Tensor) -> None:
        self._m.pack_error(err.data_ptr(), err.numel(), scales.data_ptr(), block, out.data_ptr(),
                           self._threads())

    def compress(self, buf: torch.Tensor, err: torch.Tensor, counts: torch.Tensor, block: int,
                 scales_out: torch.Tensor, bits_out: torch.Tensor) -> None:
        self._m.compress(buf.data_ptr(), buf.numel(), err.data_ptr(), err.numel(), block,
                         counts.data_ptr(), scales_out.numel() // counts.numel(),
                         scales_out.data_ptr(), bits_out.data_ptr(), self._threads())


    def compress_rows(self, buf: torch.Tensor, err: torch.Tensor, counts: torch.Tensor,
                      block: int, scales_out: torch.Tensor, bits_out: torch.Tensor) -> None:
        self._m.compress_rows(buf.data_ptr(), buf.numel(), err.data_ptr(), err.shape[1],
                              err.shape[0], err.stride(0), block, counts.data_ptr(),
                              scales_out.shape[1] // counts.shape[1], scales_out.data_ptr(),
                              bits_out.data_ptr(), bits_out.stride(0), self._threads())

    def decode_rows(self, bits: torch.Tensor, scales: torch.Tensor, block: int, cols: int,
                    out: torch.Tensor, stride: int) -> None:
        self._m.decode_rows(bits.data_ptr(), bits.stride(0), bits.shape[0], scales.data_ptr(),
                            block, cols, out.data_ptr(), stride, out.numel(), self._threads())


ENTRY_POINTS = ("pack", "compensate", "pack_error", "compress", "compress_rows", "decode",
                "decode_rows")


class CPUPackbitsBuilder(OpBuilder):
    NAME = "PackbitsBuilder"
    SOURCES = ("cpu/packbits.cpp",)

    def load(self) -> CpuKernels:
        if os.environ.get("ONEBIT_FORCE_JIT", "0") in ("", "0"):
            try:
                built = importlib.import_module(f"onebit.{MODULE}")
            except ImportError:
                built = None  # not built at install time: build it now
            # A module built from older sources (a checkout updated without
            # reinstalling) lacks the newer entry points: it failed in the
            # first allreduce. Build the current sources instead.
            if built is not None and all(hasattr(built, f) for f in ENTRY_POINTS):
                return CpuKernels(built)
        return CpuKernels(self.jit_load())

    def jit_load(self):
        try:
            import pybind11
        except ImportError as exc:
            raise OpBuilderError(f"{self.NAME}: pybind11 is needed to build the CPU kernel") from exc
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        out = self.build_dir() / f"cpu-{self.source_hash()}" / f"{MODULE}{suffix}"
        if not out.exists():
            self.run_compiler(
                ["-O3", "-shared", "-fPIC", "-std=c++17", "-fvisibility=hidden",
                 f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}",
                 str(self.sources()[0])],
                out)
        return _import_extension(f"onebit.{MODULE}", out)


def _import_extension(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise OpBuilderError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        raise OpBuilderError(f"cannot load {path}: {exc}") from exc
    return module
