"""Each tensor's 2-norm over a list of tensors, as one 1-D tensor on their
device: LAMB's trust ratios and gradient clipping read thousands of them a
step.

On a device whose kernels have the list kernel (CUDA's), contiguous fp32
tensors take it: two launches on a table of pointers, the squares summed in
float64 in a fixed order. torch's `_foreach_norm` allocates an output per
tensor and needs a stack after it, about 3 ms of host time for 2000 tensors
on an H200. Elsewhere (the CPU, other layouts and dtypes) `_foreach_norm`
stays, and with it every bit the CPU has computed so far.
"""
from __future__ import annotations

import operator
from typing import List

import torch

from . import ops

_DTYPE = operator.attrgetter("dtype")


def tensor_norms(tensors: List[torch.Tensor]) -> torch.Tensor:
    """A 1-D fp32 tensor (one float per input, the inputs' dtype where
    `_foreach_norm` takes them) of each tensor's 2-norm, 0 for empty ones.
    `tensors`: a non-empty list on one device."""
    device = tensors[0].device
    kernel = None if device.type == "cpu" else getattr(ops.kernels_for(device),
                                                       "tensor_norms", None)
    if (kernel is None or set(map(_DTYPE, tensors)) != {torch.float32}
            or not all(map(torch.Tensor.is_contiguous, tensors))):
        return torch.stack(torch._foreach_norm(tensors))
    out = torch.empty(len(tensors), dtype=torch.float32, device=device)
    kernel(tensors, list(map(torch.Tensor.numel, tensors)), out)
    return out
