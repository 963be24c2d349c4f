"""CUDAPackbitsBuilder: kernels/cuda/packbits.cu built with nvcc into a shared
library of extern "C" launchers (no torch headers, so it builds beside a CPU
torch too). When it cannot be built, cupy's packbits is used, and
`onebit.ops` falls back to pure torch after that."""
from __future__ import annotations

import os

import torch

from .base import OpBuilderError
from .native import LauncherKernels, SharedLibraryBuilder
from .torch_kernels import TorchKernels

# Ampere and Hopper; override with ONEBIT_CUDA_ARCH="80;90;100".
_DEFAULT_ARCHS = "80;90"


def _gencode() -> list:
    archs = os.environ.get("ONEBIT_CUDA_ARCH", _DEFAULT_ARCHS).replace(",", ";").split(";")
    return [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs if a.strip()]


class CupyKernels(TorchKernels):
    """cupy's packbits (little bit order) for the pack; torch for the rest."""

    name = "cupy"

    def __init__(self) -> None:
        import cupy

        self._cp = cupy

    def pack(self, x: torch.Tensor, out: torch.Tensor) -> None:
        cp = self._cp
        nonneg = cp.asarray((x.reshape(-1) >= 0))
        out.copy_(torch.as_tensor(cp.packbits(nonneg, bitorder="little"), device=out.device))


class CUDAPackbitsBuilder(SharedLibraryBuilder):
    NAME = "PackbitsBuilder"
    SOURCES = ("cuda/packbits.cu",)
    COMPILER_ENV = "ONEBIT_NVCC"
    DEFAULT_COMPILER = "nvcc"
    LIB_STEM = "onebit_cuda"

    @property
    def FLAGS(self):  # noqa: N802 - the base class reads it as a constant
        return ["-O3", "-std=c++17", "-Xcompiler", "-fPIC", *_gencode()]

    def load(self):
        try:
            lib = self.open_library()
            return LauncherKernels("cuda", lib, "onebit_cuda",
                                   lambda: torch.cuda.current_stream().cuda_stream, stream_first=False)
        except OpBuilderError as first:
            try:
                return CupyKernels()
            except ImportError:
                raise OpBuilderError(f"{first}; and cupy is not installed") from first
