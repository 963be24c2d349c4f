"""Buffers a step keeps at fixed addresses, and the graphed regions that
replay over them. A captured graph reads and writes where it was captured,
so its inputs, scratch space and lr-dependent scalars must live in buffers
that survive from step to step; on the CPU the same buffers also save the
page faults of allocating multi-MB tensors every step. The owner keeps
`_graph_regions` and `_static` and clears both when the layout changes."""
from __future__ import annotations

from typing import Dict, List

import torch

from ..graphs import GraphedRegion


class StaticBuffers:
    """The fixed-address half of OnebitOptimizer."""

    def _graphed(self, name: str, key, body) -> None:
        """Run `body` through the GraphedRegion `name` (see onebit.graphs):
        eagerly at first and where the device has no graphs, then captured
        once and replayed while `key` stays the same."""
        region = self._graph_regions.get(name)
        if region is None:
            region = self._graph_regions[name] = GraphedRegion()
        region(key, body)

    def graph_stats(self) -> Dict[str, dict]:
        """Per graphed region: how many eager runs, captures and replays so far."""
        return {name: {"eager_runs": r.eager_runs, "captures": r.captures, "replays": r.replays}
                for name, r in self._graph_regions.items()}

    def _scratch(self, name: str, index: int, like: List[torch.Tensor]) -> List[torch.Tensor]:
        """fp32 buffers shaped like `like`, kept from step to step: a graph
        needs fixed addresses, and on the CPU fresh multi-MB tensors cost page
        faults worth several passes over them."""
        key = (name, index)
        bufs = self._static.get(key)
        if bufs is None or [b.shape for b in bufs] != [t.shape for t in like]:
            bufs = self._static[key] = [torch.empty(t.shape, dtype=torch.float32, device=t.device)
                                        for t in like]
        return bufs

    def _static_copy(self, index: int, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        """fp32 copies of `tensors` at fixed addresses (gradients arrive in
        new tensors each step; a graph reads from where it was captured)."""
        bufs = self._scratch("inputs", index, tensors)
        if bufs:
            torch._foreach_copy_(bufs, tensors)
        return bufs

    def _step_scalars(self, index: int, device: torch.device, values) -> torch.Tensor:
        """A device tensor holding this step's `values` (lr-dependent numbers)
        at a fixed address, so a replayed graph reads the new values."""
        key = ("scalars", index)
        t = self._static.get(key)
        if t is None or t.device != device or t.numel() != len(values):
            t = self._static[key] = torch.empty(len(values), dtype=torch.float32, device=device)
        for j, v in enumerate(values):
            t[j].fill_(v)  # a kernel argument, not a host-to-device copy: no sync
        return t
