"""Op builders: compile and load onebit's sign-bit kernels.

Installed as `onebit.builders`. Each builder's `load()` returns a *kernels*
object with the tensor-level interface of `TorchKernels` (pack, decode,
compensate, pack_error), or raises `OpBuilderError` with a message saying what is
missing; `onebit.ops` then falls back to `TorchKernels` and warns once.
"""
from .base import OpBuilder, OpBuilderError, self_test
from .cpu import CPUPackbitsBuilder, CpuKernels
from .cuda import CUDAPackbitsBuilder
from .sycl import SYCLPackbitsBuilder
from .torch_kernels import TorchKernels

__all__ = ["OpBuilder", "OpBuilderError", "CPUPackbitsBuilder", "CUDAPackbitsBuilder",
           "SYCLPackbitsBuilder", "TorchKernels", "CpuKernels", "self_test"]
