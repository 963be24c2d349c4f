"""NVIDIA GPUs: nccl collectives, CUDA graphs, and our ballot packbits kernel
(falling back to cupy, then to pure torch)."""
from __future__ import annotations

from typing import Optional

import torch

from .abstract import Accelerator


class CudaAccelerator(Accelerator):
    name = "cuda"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)

    def synchronize(self, index: Optional[int] = None) -> None:
        torch.cuda.synchronize(index)

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()

    @property
    def Stream(self):  # noqa: N802
        return torch.cuda.Stream

    @property
    def Event(self):  # noqa: N802
        return torch.cuda.Event

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def current_stream(self, index: Optional[int] = None):
        return torch.cuda.current_stream(index)

    def graphs_supported(self) -> bool:
        return True

    def create_graph(self):
        return torch.cuda.CUDAGraph()

    def capture_to_graph(self, graph, pool=None, stream=None):
        # thread_local: the NCCL watchdog thread polls events of earlier
        # collectives while we capture; in the default "global" mode that
        # poll invalidates the capture (pytorch/pytorch#104555). What we
        # capture never calls collectives itself.
        return torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local")

    def communication_backend_name(self) -> str:
        return "nccl"

    def _op_builders(self) -> dict:
        from ..builders import CUDAPackbitsBuilder

        return {"PackbitsBuilder": CUDAPackbitsBuilder}
