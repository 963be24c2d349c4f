"""SYCLPackbitsBuilder: kernels/sycl/packbits.cpp built with `icpx -fsycl`
into a shared library of extern "C" launchers that run on the SYCL queue of
torch's current XPU stream."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import torch

from .base import OpBuilderError, self_test
from .native import LauncherKernels, SharedLibraryBuilder

HOST_COMPILER_ENV = "ONEBIT_SYCL_HOST_CXX"  # default: clang++-22
HEADERS_ENV = "ONEBIT_SYCL_INCLUDE"  # the include/ folder of the intel-sycl-rt wheel


class SYCLPackbitsBuilder(SharedLibraryBuilder):
    NAME = "PackbitsBuilder"
    SOURCES = ("sycl/packbits.cpp",)
    COMPILER_ENV = "ONEBIT_SYCL_CXX"
    DEFAULT_COMPILER = "icpx"
    LIB_STEM = "onebit_sycl"
    # icpx defaults to -fp-model=fast (reassociation, contraction); precise
    # keeps the arithmetic in the order the CPU kernel uses.
    FLAGS = ("-fsycl", "-O3", "-fp-model=precise", "-std=c++17", "-fPIC")

    def host_syntax_check(self, include_dir=None) -> None:
        """Check the kernel source against real SYCL headers without a device
        compiler: `clang++ -fsycl -fsycl-host-only -fsyntax-only`.

        Where no icpx exists (as on the CPU machines this project is built
        on), this is what catches a typo or an API misuse in the SYCL source.
        Needs clang (Debian's clang-22) and the headers shipped in PyPI's
        intel-sycl-rt wheel, given by `include_dir` or $ONEBIT_SYCL_INCLUDE.
        """
        cxx = os.environ.get(HOST_COMPILER_ENV, "clang++-22")
        include_dir = include_dir or os.environ.get(HEADERS_ENV)
        if shutil.which(cxx) is None:
            raise OpBuilderError(f"{self.NAME}: host compiler {cxx!r} not found (set {HOST_COMPILER_ENV})")
        if not include_dir or not (Path(include_dir) / "sycl" / "sycl.hpp").exists():
            raise OpBuilderError(f"{self.NAME}: no SYCL headers at {include_dir!r} (set {HEADERS_ENV} "
                                 "to the include/ folder of the intel-sycl-rt wheel)")
        cmd = [cxx, "-fsycl", "-fsycl-host-only", "-fsyntax-only", "-std=c++17",
               "-Wno-deprecated-declarations", "-isystem", str(include_dir), str(self.sources()[0])]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise OpBuilderError(f"{self.NAME}: host syntax check failed: {' '.join(cmd)}\n"
                                 f"{proc.stderr[-4000:]}")

    def load(self):
        lib = self.open_library()
        # torch.xpu.Stream.sycl_queue is the address of the stream's sycl::queue.
        kernels = LauncherKernels("sycl", lib, "onebit_sycl",
                                  lambda device: torch.xpu.current_stream(device).sycl_queue,
                                  stream_first=True, device_guard=torch.xpu.device)
        self_test(kernels, torch.device("xpu", torch.xpu.current_device()))
        return kernels
