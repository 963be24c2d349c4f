"""Per-step telemetry of the onebit optimizers: `comm_stats()`. The
full-precision averaging counts its traffic in `optimizer.traffic`; the
compressed backend in `backend.stats` (see onebit.backends.stats for how
bytes are counted). A step's window runs from the end of the previous
step, so a DDP hook's traffic during backward counts toward the step after it."""
from __future__ import annotations

from typing import Dict, List

import torch


def _norm(tensors: List[torch.Tensor]) -> float:
    """The 2-norm of several tensors together (0 for none)."""
    if not tensors:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors))))


class Telemetry:
    """The telemetry half of OnebitOptimizer."""

    def _traffic_snapshot(self) -> tuple:
        backend = self.backend.stats.snapshot() if self.backend is not None else {}
        return self.traffic.snapshot(), backend

    def _end_window(self, step: int, stage: str, skipped: bool) -> None:
        mine, theirs = self._window
        self._window = self._traffic_snapshot()
        parts = [self.traffic.since(mine)]
        if self.backend is not None:
            parts.append(self.backend.stats.since(theirs))
        self._last_step = {"step": step, "stage": stage, "skipped": skipped,
                           **{k: sum(p[k] for p in parts) for k in parts[0]}}

    def comm_stats(self) -> Dict[str, object]:
        """What the last step sent and what it cost, and the totals so far, as
        a plain dict (cheap: call it every step and log it).

        step and stage of the last step (`stage()`: the coming one's), world_size; for it:
        bytes_sent, bytes_received, fp32_bytes (what an fp32 ring all-reduce
        of the same gradients would have sent), compression_ratio
        (fp32_bytes / bytes_sent), comm_s (in the transport) and compress_s
        (compression kernels around it); the same summed over the run as
        total_*; worker_error_norm and server_error_norm (the error-feedback
        residual: a norm that keeps growing is the early sign of a bad freeze
        point); skipped_steps (non-finite gradients under a GradScaler).
        Traffic of a DDP hook during backward counts toward the step after it.
        Bytes are each rank's share (see onebit.backends.stats)."""
        last = dict(self._last_step) or {k: 0 for k in ("bytes_sent", "bytes_received",
                                                        "fp32_bytes", "comm_s", "compress_s")}
        totals = self.traffic.snapshot()
        if self.backend is not None:
            for k, v in self.backend.stats.snapshot().items():
                totals[k] += v
        errors = list(self._ef_exchange.error_buffers().values())
        return {
            "step": self.counters["step"], "stage": last.get("stage"), "world_size": self.world_size,
            **{k: last[k] for k in ("bytes_sent", "bytes_received", "fp32_bytes", "comm_s",
                                    "compress_s")},
            "compression_ratio": last["fp32_bytes"] / last["bytes_sent"] if last["bytes_sent"] else None,
            **{f"total_{k}": totals[k] for k in ("bytes_sent", "bytes_received", "fp32_bytes",
                                                  "comm_s", "compress_s")},
            "total_compression_ratio": (totals["fp32_bytes"] / totals["bytes_sent"]
                                        if totals["bytes_sent"] else None),
            "worker_error_norm": _norm([w for w, _ in errors]),
            "server_error_norm": _norm([s for _, s in errors]),
            "skipped_steps": self._skipped_steps,
        }

    def stage(self) -> str:
        """The stage of the coming step, in words."""
        raise NotImplementedError
