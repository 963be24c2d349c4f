"""Buffers a step keeps at fixed addresses, and the graphed regions that
replay over them. A captured graph reads and writes where it was captured,
so its inputs, scratch space and lr-dependent scalars must live in buffers
that survive from step to step; on the CPU the same buffers also save the
page faults of allocating multi-MB tensors every step. The optimizer holds
one `StaticBuffers` and clears it when the layout changes."""
from __future__ import annotations

from typing import Callable, Dict, Hashable, List

import torch

from ..graphs import GraphedRegion


class StaticBuffers:
    """Named fp32 buffers and graphed regions, kept until `clear()`.

    Buffers are keyed by (name, index): `index` is whatever the caller uses
    to tell its groups apart (a param group's number; a late joiner's group
    has its own)."""

    def __init__(self) -> None:
        self._regions: Dict[str, GraphedRegion] = {}
        self._buffers: Dict[tuple, object] = {}

    def clear(self) -> None:
        """Forget every buffer and graph (the layout they were made for changed)."""
        self._regions.clear()
        self._buffers.clear()

    def graphed(self, name: str, key: Hashable, body: Callable[[], None]) -> None:
        """Run `body` through the GraphedRegion `name` (see onebit.graphs):
        eagerly at first and where the device has no graphs, then captured
        once and replayed while `key` stays the same."""
        region = self._regions.get(name)
        if region is None:
            region = self._regions[name] = GraphedRegion()
        region(key, body)

    def stats(self) -> Dict[str, dict]:
        """Per graphed region: how many eager runs, captures and replays so far."""
        return {name: {"eager_runs": r.eager_runs, "captures": r.captures, "replays": r.replays}
                for name, r in self._regions.items()}

    def scratch(self, name: str, index: Hashable, like: List[torch.Tensor]) -> List[torch.Tensor]:
        """fp32 buffers shaped like `like`, kept from step to step: a graph
        needs fixed addresses, and on the CPU fresh multi-MB tensors cost page
        faults worth several passes over them."""
        key = (name, index)
        bufs = self._buffers.get(key)
        if bufs is None or [b.shape for b in bufs] != [t.shape for t in like]:
            bufs = self._buffers[key] = [torch.empty(t.shape, dtype=torch.float32, device=t.device)
                                         for t in like]
        return bufs

    def copy(self, index: Hashable, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        """fp32 copies of `tensors` at fixed addresses (gradients arrive in
        new tensors each step; a graph reads from where it was captured)."""
        bufs = self.scratch("inputs", index, tensors)
        if bufs:
            torch._foreach_copy_(bufs, tensors)
        return bufs

    def scalars(self, index: Hashable, device: torch.device, values) -> torch.Tensor:
        """A device tensor holding this step's `values` (lr-dependent numbers)
        at a fixed address, so a replayed graph reads the new values."""
        key = ("scalars", index)
        t = self._buffers.get(key)
        if t is None or t.device != device or t.numel() != len(values):
            t = self._buffers[key] = torch.empty(len(values), dtype=torch.float32, device=device)
        for j, v in enumerate(values):
            t[j].fill_(v)  # a kernel argument, not a host-to-device copy: no sync
        return t
