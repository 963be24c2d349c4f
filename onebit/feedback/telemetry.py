"""Per-step telemetry of the onebit optimizers: what `comm_stats()` reports.

Two counters feed it: the optimizer's full-precision averaging counts its
traffic in one TrafficStats, the compressed backend in its own `stats`
(see onebit.backends.stats for how bytes are counted). A step's window runs
from the end of the previous step, so a DDP hook's traffic during backward
counts toward the step after it."""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import torch

from ..backends.stats import TrafficStats

# bytes_between_nodes: the part of bytes_sent that leaves the node (stats.py)
_PER_STEP = ("bytes_sent", "bytes_received", "bytes_between_nodes", "fp32_bytes", "comm_s",
             "compress_s")


def _norm(tensors: List[torch.Tensor]) -> float:
    """The 2-norm of several tensors together (0 for none)."""
    if not tensors:
        return 0.0
    # Errors loaded from a checkpoint may wait on another device than the
    # live ones until taken up: each device's norms are stacked apart.
    by_device: Dict[torch.device, List[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    norms = [torch.linalg.vector_norm(torch.stack(torch._foreach_norm(ts))).cpu()
             for ts in by_device.values()]
    if len(norms) == 1:
        return float(norms[0])
    return float(torch.linalg.vector_norm(torch.stack(norms)))


class StepTelemetry:
    """Windows of traffic, one per step, over `counters` (the optimizer's
    own TrafficStats, then the backend's, when it has one)."""

    def __init__(self, counters: Iterable[TrafficStats]) -> None:
        self.counters = list(counters)
        self.skipped_steps = 0
        self._last: Dict[str, object] = {}
        self._window = self._snapshot()  # traffic since the last step ended

    def _snapshot(self) -> list:
        return [c.snapshot() for c in self.counters]

    def end_step(self, step: int, stage: str, skipped: bool) -> None:
        """Close the window of `step` (`stage`: its stage in words)."""
        started, self._window = self._window, self._snapshot()
        parts = [c.since(s) for c, s in zip(self.counters, started)]
        self.skipped_steps += skipped
        self._last = {"step": step, "stage": stage, "skipped": skipped,
                      **{k: sum(p[k] for p in parts) for k in parts[0]}}

    def report(self, step: int, world_size: int,
               errors: Iterable[Tuple[torch.Tensor, torch.Tensor]]) -> Dict[str, object]:
        """comm_stats()'s dict (see OnebitOptimizer.comm_stats) after `step`
        steps; `errors`: the (worker, server) error buffers."""
        last = dict(self._last) or {k: 0 for k in _PER_STEP}
        totals = {k: 0 for k in _PER_STEP}
        for snapshot in self._snapshot():
            for k in _PER_STEP:
                totals[k] += snapshot[k]
        errors = list(errors)
        return {
            "step": step, "stage": last.get("stage"), "world_size": world_size,
            **{k: last[k] for k in _PER_STEP},
            "compression_ratio": _ratio(last["fp32_bytes"], last["bytes_sent"]),
            **{f"total_{k}": totals[k] for k in _PER_STEP},
            "total_compression_ratio": _ratio(totals["fp32_bytes"], totals["bytes_sent"]),
            "worker_error_norm": _norm([w for w, _ in errors]),
            "server_error_norm": _norm([s for _, s in errors]),
            "skipped_steps": self.skipped_steps,
        }


def _ratio(fp32_bytes, sent) -> Optional[float]:
    return fp32_bytes / sent if sent else None
