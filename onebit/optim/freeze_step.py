"""What 1-bit Adam and 1-bit LAMB share beyond OnebitOptimizer: the
freeze_step schedule (stage_schedules.FreezeStepSchedule) and the input of
their compression stage's exchange, the new momentum."""
from __future__ import annotations

from typing import Optional

from . import functional as F
from .base import OnebitOptimizer


class FreezeStepOptimizer(OnebitOptimizer):
    """1-bit Adam and 1-bit LAMB: full precision up to `freeze_step`, 1-bit
    after (stage_schedules.FreezeStepSchedule); the compression stage
    exchanges the new momentum."""

    @property
    def freeze_step(self) -> int:
        """The last full-precision step."""
        return self._schedule.freeze_step

    def compression_started(self, step: Optional[int] = None) -> bool:
        """Whether step `step` (default: the next one) is in the compression stage."""
        return self._schedule.compressed(self.counters["step"] + 1 if step is None else step)

    def _exchange_input_(self, index, params, grads, out, positions) -> None:
        """The new momentum beta1 * m + (1 - beta1) * g, into `out`: m itself
        changes only when step() commits it."""
        m = self._params.tensors(params, "exp_avg")
        F.momentum_into(out, m, grads, self.param_groups[index]["betas"][0])
