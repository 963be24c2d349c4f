"""Intel GPUs through native `torch.xpu` (torch >= 2.5), xccl collectives and
the SYCL packbits kernel. intel-extension-for-pytorch is imported only where
`torch.xpu` is missing (older torch)."""
from __future__ import annotations

from typing import Optional

import torch

from .abstract import Accelerator


def _xpu():
    if not hasattr(torch, "xpu"):
        import intel_extension_for_pytorch  # noqa: F401 - registers torch.xpu
    return torch.xpu


class XpuAccelerator(Accelerator):
    name = "xpu"

    def is_available(self) -> bool:
        try:
            return bool(_xpu().is_available())
        except ImportError:
            return False

    def device_count(self) -> int:
        return _xpu().device_count()

    def current_device(self) -> int:
        return _xpu().current_device()

    def set_device(self, index: int) -> None:
        # Callers pass the *local* rank; DeepSpeed's group rank breaks across nodes.
        _xpu().set_device(index)

    def synchronize(self, index: Optional[int] = None) -> None:
        _xpu().synchronize(index)

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()

    @property
    def Stream(self):  # noqa: N802
        return _xpu().Stream

    @property
    def Event(self):  # noqa: N802
        return _xpu().Event

    def stream(self, stream):
        return _xpu().stream(stream)

    def current_stream(self, index: Optional[int] = None):
        return _xpu().current_stream(index)

    def graphs_supported(self) -> bool:
        # torch.xpu.XPUGraph is recent (torch 2.13 has it); older stacks run eagerly.
        return hasattr(_xpu(), "XPUGraph")

    def create_graph(self):
        return _xpu().XPUGraph()

    def capture_to_graph(self, graph, pool=None, stream=None):
        return _xpu().graph(graph, pool=pool, stream=stream)

    def communication_backend_name(self) -> str:
        # torch >= 2.8 ships xccl; older stacks name oneCCL's binding "ccl".
        if hasattr(torch.distributed, "is_xccl_available") and torch.distributed.is_xccl_available():
            return "xccl"
        return "ccl"

    def _op_builders(self) -> dict:
        from ..builders import SYCLPackbitsBuilder

        return {"PackbitsBuilder": SYCLPackbitsBuilder}
