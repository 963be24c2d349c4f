"""When each step is warmup, compression, a sync or a local step.

A stage schedule owns the optimizer's stage counters' meaning: which stage
step t is in (`stage_at`), how the counters start and move, how long the
warmup is, whether a run at some step holds error feedback, and whether the
coming step's exchange can start during backward. The optimizer keeps the
counters in its param groups (where torch's checkpoint tools expect them)
and hands them to the schedule, which holds nothing that changes.

- `FreezeStepSchedule`: 1-bit Adam and 1-bit LAMB, full precision up to
  `freeze_step`, 1 bit after.
- `ZeroOneSchedule`: 0/1 Adam, variance updates at doubling intervals and
  1-bit gradients in between, then local steps with syncs at doubling
  intervals after `var_freeze_step`.
"""
from __future__ import annotations

from typing import Dict, List

from ..checks import check_positive_int
from .stage import Stage


class FreezeStepSchedule:
    """Full precision up to `freeze_step`, 1 bit after."""

    def __init__(self, freeze_step: int) -> None:
        check_positive_int("freeze_step", freeze_step, minimum=0)
        self.freeze_step = freeze_step

    def settings(self) -> Dict[str, int]:
        """What every rank must share."""
        return {"freeze_step": self.freeze_step}

    @property
    def warmup_length(self) -> int:
        """Steps before v freezes (a late joiner's own warmup is as long)."""
        return self.freeze_step

    warmup_option = "freeze_step"  # the option that sets warmup_length

    def initial_counters(self, optimizer: str, groups: int) -> dict:
        # The name tells a checkpoint's reader which optimizer's state it is.
        return {"optimizer": optimizer, "step": 0}

    def counters_at(self, optimizer: str, groups: int, step: int) -> dict:
        """The counters after `step` steps of full-precision Adam (what a
        torch.optim.Adam checkpoint means, see checkpoints.py): v has had
        `step` updates, even past freeze_step."""
        return {**self.initial_counters(optimizer, groups), "step": step, "var_updates": step}

    def compressed(self, step: int) -> bool:
        """Whether step `step` is in the compression stage."""
        return step > self.freeze_step

    def stage_at(self, counters: dict, step: int) -> Stage:
        # v's updates so far are counted, not taken as min(step, freeze_step):
        # a torch.optim.Adam checkpoint past freeze_step, or a resume with a
        # smaller freeze_step, froze a v with more updates than that, and its
        # bias correction must say so for the rest of the run. (A checkpoint
        # written before the count was kept is a run of this freeze_step.)
        done = counters.get("var_updates", min(step - 1, self.freeze_step))
        compress = self.compressed(step)
        return Stage(step, "compression" if compress else "warmup", full_precision=not compress,
                     compressed=compress, variance_frozen=compress,
                     variance_updates=done + (not compress), variance_moves=not compress)

    def had_error_feedback(self, counters: dict, step: int) -> bool:
        """Whether a run that has taken `step` steps holds error-feedback
        buffers: a compressed exchange has happened."""
        return step > self.freeze_step

    def exchanges_during_backward(self, counters: dict, step: int) -> bool:
        """Whether step `step`'s exchange input needs only its gradients (so
        the exchange can start during backward): the new momentum does."""
        return self.compressed(step)

    def advance(self, counters: dict, stage: Stage) -> None:
        """After step `stage.step`: v's update count."""
        counters["var_updates"] = stage.variance_updates

    def group_added(self, counters: dict) -> None:
        """A param group was added: no counter is per group."""


class ZeroOneSchedule:
    """0/1 Adam's policies (Lu et al., 2022): before `var_freeze_step`, v is
    updated on the steps that are multiples of an interval that starts at 1
    and doubles every `var_update_scaler` updates, and every other step
    sends 1-bit gradients; after it, the ranks take local steps and sync
    every `local_step_interval` steps, an interval that starts at 1 and
    doubles every `local_step_scaler` steps, up to `local_step_clipper`."""

    def __init__(self, var_freeze_step: int, var_update_scaler: int, local_step_scaler: int,
                 local_step_clipper: int) -> None:
        check_positive_int("var_freeze_step", var_freeze_step, minimum=0)
        check_positive_int("var_update_scaler", var_update_scaler)
        check_positive_int("local_step_scaler", local_step_scaler)
        check_positive_int("local_step_clipper", local_step_clipper)
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper

    def settings(self) -> Dict[str, int]:
        return {"var_freeze_step": self.var_freeze_step,
                "var_update_scaler": self.var_update_scaler,
                "local_step_scaler": self.local_step_scaler,
                "local_step_clipper": self.local_step_clipper}

    @property
    def warmup_length(self) -> int:
        return self.var_freeze_step

    warmup_option = "var_freeze_step"

    def initial_counters(self, optimizer: str, groups: int) -> dict:
        return {"optimizer": optimizer, "step": 0, "var_interval": 1, "var_counter": 0,
                "var_updates": 0, "local_step_interval": 1, "local_step_counter": 0,
                "last_sync": 0,
                "lrs": [0.0] * groups}  # sum of lr since the last sync, per group

    def counters_at(self, optimizer: str, groups: int, step: int) -> dict:
        """After `step` Adam steps: the interval policies replayed to `step`,
        v updated at every one of them, and the ranks at a common point."""
        c = self.initial_counters(optimizer, groups)
        for t in range(1, step + 1):
            self._advance_intervals(c, t, self.frozen(t))
        c.update(step=step, var_updates=step, last_sync=step)
        return c

    def frozen(self, step: int) -> bool:
        """Whether step `step` is past var_freeze_step."""
        return step > self.var_freeze_step

    def variance_step(self, counters: dict, step: int) -> bool:
        """Whether step `step` updates v (with full-precision averaged gradients)."""
        return not self.frozen(step) and step % counters["var_interval"] == 0

    def sync(self, counters: dict, step: int) -> bool:
        """Whether step `step` (frozen) ends the local steps with a sync."""
        return self.frozen(step) and step % counters["local_step_interval"] == 0

    def single_sync(self, counters: dict, step: int) -> bool:
        """Whether step `step` is, for every group, a sync with no lr since
        the last sync: its input then needs this step's gradient alone."""
        return self.sync(counters, step) and all(x == 0.0 for x in counters["lrs"])

    def stage_at(self, counters: dict, step: int) -> Stage:
        if not self.frozen(step):
            full = self.variance_step(counters, step)
            return Stage(step, "variance update" if full else "1-bit gradients",
                         full_precision=full, compressed=not full, variance_frozen=False,
                         variance_updates=counters["var_updates"] + full, variance_moves=False)
        # Between syncs the ranks' parameters differ by design.
        sync = self.sync(counters, step)
        return Stage(step, "sync" if sync else "local step", full_precision=False,
                     compressed=sync, variance_frozen=True,
                     variance_updates=counters["var_updates"], variance_moves=False,
                     replicas_match=sync)

    def had_error_feedback(self, counters: dict, step: int) -> bool:
        # Every step but the variance updates exchanges 1-bit (or skips it
        # locally). At var_freeze_step itself the errors are about to be
        # restarted by the first frozen step: a run that lost them there
        # lost nothing.
        if self.frozen(step + 1) and not self.frozen(step):
            return False
        return step > counters["var_updates"]

    def exchanges_during_backward(self, counters: dict, step: int) -> bool:
        """The 1-bit gradient steps, and the syncs that follow a sync: a sync
        after local steps needs their accumulators, which step() computes.
        Not the first frozen step: it restarts the error buffers first."""
        if self.variance_step(counters, step):
            return False
        return not self.frozen(step) or (self.frozen(step - 1) and self.single_sync(counters, step))

    def advance(self, counters: dict, stage: Stage) -> None:
        """After step `stage.step`: v's update count, the last sync, and the
        intervals' policies."""
        counters["var_updates"] = stage.variance_updates
        if stage.variance_frozen and stage.compressed:
            counters["last_sync"] = stage.step
        self._advance_intervals(counters, stage.step, stage.variance_frozen)

    def group_added(self, counters: dict) -> None:
        lrs: List[float] = counters["lrs"]
        lrs.append(0.0)

    def _advance_intervals(self, c: dict, t: int, frozen: bool) -> None:
        if not frozen:
            if t % c["var_interval"] == 0:
                c["var_counter"] += 1
                if c["var_counter"] == self.var_update_scaler:
                    c["var_counter"] = 0
                    c["var_interval"] *= 2
        else:
            c["local_step_counter"] += 1
            if c["local_step_counter"] == self.local_step_scaler:
                c["local_step_counter"] = 0
                c["local_step_interval"] = min(self.local_step_clipper,
                                               c["local_step_interval"] * 2)
