"""CUDAPackbitsBuilder: kernels/cuda/packbits.cu built with nvcc into a shared
library of extern "C" launchers (no torch headers, so it builds beside a CPU
torch too). When it cannot be built, cupy's packbits is used, and
`onebit.ops` falls back to pure torch after that."""
from __future__ import annotations

import os
import warnings

import torch

from .base import OpBuilderError, self_test
from .native import LauncherKernels, SharedLibraryBuilder
from .torch_kernels import TorchKernels

# Ampere and Hopper; override with ONEBIT_CUDA_ARCH="80;90;100".
_DEFAULT_ARCHS = "80;90"


def _gencode() -> list:
    """Machine code (SASS) for each architecture, and PTX for the lowest:
    a newer GPU than any listed JIT-compiles the PTX instead of finding
    "no kernel image"."""
    archs = [a.strip() for a in
             os.environ.get("ONEBIT_CUDA_ARCH", _DEFAULT_ARCHS).replace(",", ";").split(";")
             if a.strip()]
    lowest = min(archs, key=int)
    return [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs] + [
        f"-gencode=arch=compute_{lowest},code=compute_{lowest}"]


def _current_stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


class CupyKernels(TorchKernels):
    """cupy's packbits (little bit order) for the pack; torch for the rest."""

    name = "cupy"

    def __init__(self) -> None:
        import cupy

        self._cp = cupy

    def pack(self, x: torch.Tensor, out: torch.Tensor) -> None:
        cp = self._cp
        # cupy on torch's current stream and device (the tensors' GPU), not its own.
        with cp.cuda.Device(out.device.index), \
                cp.cuda.ExternalStream(_current_stream(out.device)):
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
        # -fmad=false: no contracted multiply-adds, so x - s * sign(x) rounds
        # as the CPU kernel's separate multiply and subtract do.
        return ["-O3", "-std=c++17", "-fmad=false", "-Xcompiler", "-fPIC", *_gencode()]

    def load(self):
        """The CUDA kernel, self-tested on the current device; else cupy's
        pack (with a warning naming why), self-tested too; else an
        OpBuilderError (onebit.ops then falls back to pure torch)."""
        device = torch.device("cuda", torch.cuda.current_device())
        try:
            kernels = LauncherKernels("cuda", self.open_library(), "onebit_cuda", _current_stream,
                                      stream_first=False, device_guard=torch.cuda.device)
            self_test(kernels, device)
            return kernels
        except (OpBuilderError, OSError) as first:
            try:
                kernels = CupyKernels()
            except ImportError:
                raise OpBuilderError(f"{first}; and cupy is not installed") from first
            self_test(kernels, device)
            warnings.warn(f"onebit: the CUDA packbits kernel is unusable ({first}); using cupy's",
                          RuntimeWarning, stacklevel=2)
            return kernels
