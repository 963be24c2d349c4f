"""The CPU: gloo collectives and the C++ (pybind11) packbits kernel."""
from __future__ import annotations

import torch

from .abstract import Accelerator


class CpuAccelerator(Accelerator):
    name = "cpu"

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        # One "device"; parallelism inside it comes from threads.
        return 1

    def device_name(self, index=None) -> str:
        return "cpu"  # torch has no "cpu:N" devices that mean anything

    def current_device_name(self) -> str:
        return "cpu"

    def synchronize(self, index=None) -> None:
        pass

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def communication_backend_name(self) -> str:
        return "gloo"

    def _op_builders(self) -> dict:
        from ..builders import CPUPackbitsBuilder

        return {"PackbitsBuilder": CPUPackbitsBuilder}

