"""Scratch buffers a step keeps from step to step: on the CPU a fresh
multi-MB tensor costs page faults worth several passes over it. The
optimizer holds one `StaticBuffers` and clears it when the layout changes."""
from __future__ import annotations

from typing import Dict, Hashable, List

import torch


class StaticBuffers:
    """Named fp32 buffers, kept until `clear()`.

    Buffers are keyed by (name, index): `index` is whatever the caller uses
    to tell its groups apart (a param group's number; a late joiner's group
    has its own)."""

    def __init__(self) -> None:
        self._buffers: Dict[tuple, object] = {}

    def clear(self) -> None:
        """Forget every buffer (the layout they were made for changed)."""
        self._buffers.clear()

    def scratch(self, name: str, index: Hashable, like: List[torch.Tensor]) -> List[torch.Tensor]:
        """fp32 buffers shaped like `like`, kept from step to step."""
        key = (name, index)
        bufs = self._buffers.get(key)
        if bufs is None or [b.shape for b in bufs] != [t.shape for t in like]:
            bufs = self._buffers[key] = [torch.empty(t.shape, dtype=torch.float32, device=t.device)
                                         for t in like]
        return bufs
