"""SYCLPackbitsBuilder: kernels/sycl/packbits.cpp built with `icpx -fsycl`
into a shared library of extern "C" launchers that run on the SYCL queue of
torch's current XPU stream."""
from __future__ import annotations

import torch

from .native import LauncherKernels, SharedLibraryBuilder


class SYCLPackbitsBuilder(SharedLibraryBuilder):
    NAME = "PackbitsBuilder"
    SOURCES = ("sycl/packbits.cpp",)
    COMPILER_ENV = "ONEBIT_SYCL_CXX"
    DEFAULT_COMPILER = "icpx"
    LIB_STEM = "onebit_sycl"
    FLAGS = ("-fsycl", "-O3", "-std=c++17", "-fPIC")

    def load(self):
        lib = self.open_library()
        # torch.xpu.Stream.sycl_queue is the address of the stream's sycl::queue.
        return LauncherKernels("sycl", lib, "onebit_sycl",
                               lambda: torch.xpu.current_stream().sycl_queue, stream_first=True)
