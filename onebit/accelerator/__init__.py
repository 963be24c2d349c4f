"""`get_accelerator()` / `set_accelerator()`: which device onebit runs on.

Selection order: an object given to `set_accelerator`; else the
`ONEBIT_ACCELERATOR` environment variable (cpu, cuda or xpu); else the first
available of xpu, cuda, cpu.
"""
from __future__ import annotations

import os
from typing import Optional

from .abstract import Accelerator, EagerGraph
from .cpu import CpuAccelerator
from .cuda import CudaAccelerator
from .xpu import XpuAccelerator

ACCELERATORS = {"cpu": CpuAccelerator, "cuda": CudaAccelerator, "xpu": XpuAccelerator}
_DETECT_ORDER = ("xpu", "cuda", "cpu")
_current: Optional[Accelerator] = None


def _select() -> Accelerator:
    wanted = os.environ.get("ONEBIT_ACCELERATOR", "").strip().lower()
    if wanted:
        if wanted not in ACCELERATORS:
            raise ValueError(
                f"ONEBIT_ACCELERATOR={wanted!r} is not a known accelerator; "
                f"expected one of {sorted(ACCELERATORS)}")
        acc = ACCELERATORS[wanted]()
        if not acc.is_available():
            raise ValueError(f"ONEBIT_ACCELERATOR={wanted!r}, but no {wanted} device is available")
        return acc
    for name in _DETECT_ORDER:
        acc = ACCELERATORS[name]()
        if acc.is_available():
            return acc
    raise AssertionError("unreachable: the cpu accelerator is always available")


def get_accelerator() -> Accelerator:
    """The accelerator in use, chosen once per process (see module doc)."""
    global _current
    if _current is None:
        _current = _select()
    return _current


def accelerator_for(device) -> Accelerator:
    """The accelerator that owns `device` (a torch.device): the one in use
    where its type matches, else the CPU's (host tensors, host events)."""
    acc = get_accelerator()
    return acc if device.type == acc.name else CpuAccelerator()


def set_accelerator(accelerator: Optional[Accelerator]) -> None:
    """Use `accelerator` from now on (None: choose again on next use)."""
    global _current
    if accelerator is not None and not isinstance(accelerator, Accelerator):
        raise ValueError(
            f"set_accelerator expects an onebit.accelerator.Accelerator, got {type(accelerator).__name__}")
    _current = accelerator


__all__ = ["Accelerator", "EagerGraph", "CpuAccelerator", "CudaAccelerator", "XpuAccelerator",
           "accelerator_for", "get_accelerator", "set_accelerator", "ACCELERATORS"]
