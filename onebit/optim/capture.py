"""Scratch buffers a step keeps from step to step: on the CPU a fresh
multi-MB tensor costs page faults worth several passes over it. The
optimizer holds one `StaticBuffers` and clears it when the layout changes."""
from __future__ import annotations

import operator
from typing import Dict, Hashable, List, Tuple

import torch


class StaticBuffers:
    """Named fp32 buffers, kept until `clear()`.

    Buffers are keyed by (name, index): `index` is whatever the caller uses
    to tell its groups apart (a param group's number; a late joiner's group
    has its own)."""

    def __init__(self) -> None:
        self._buffers: Dict[tuple, Tuple[List[torch.Tensor], List[torch.Tensor]]] = {}

    def clear(self) -> None:
        """Forget every buffer (the layout they were made for changed)."""
        self._buffers.clear()

    def scratch(self, name: str, index: Hashable, like: List[torch.Tensor]) -> List[torch.Tensor]:
        """fp32 buffers shaped like `like`, kept from step to step. `like`
        are the optimizer's own state tensors, which are never resized in
        place: while they are the same tensors as last time, the buffers fit
        without reading a shape (reading 2000 shapes twice a call cost 3 ms
        a call here; 1-bit LAMB makes two or three calls a step)."""
        key = (name, index)
        kept = self._buffers.get(key)
        if kept is not None:
            bufs, last = kept
            if len(last) == len(like) and all(map(operator.is_, like, last)):
                return bufs
            if list(map(_SHAPE, bufs)) == list(map(_SHAPE, like)):
                self._buffers[key] = (bufs, list(like))
                return bufs
        bufs = [torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in like]
        self._buffers[key] = (bufs, list(like))
        return bufs


_SHAPE = operator.attrgetter("shape")
