"""overlap_backward as the optimizer sees it.

`OverlapWiring` holds the optimizer's `BackwardOverlap` (overlap.py), or
None without the option or at world size 1, and gives step(), the
checkpoints and add_param_group the few verbs they need of it, each doing
nothing without one. It also knows the step an exchange input is written
for: during backward the coming one, inside step() the one in progress.

The overlap asks its optimizer for the coming step's trained params
(`OverlapCallbacks.trained`) as step() will find them: a param that starts
training after v froze is marked a late joiner first, as step() marks it
(else backward's exchange inputs made its state, v = 0 included, and step()
took it for a trained param that never saw a gradient: it never moved), and
a change of who trains is noticed there, as step() would notice it:
backward's inputs must not read what was cached for the old params.
"""
from __future__ import annotations

import contextlib
from typing import List, Optional, Sequence

import torch

from ..feedback.exchange import ErrorFeedbackExchange
from .overlap import BackwardOverlap, OverlapCallbacks, check_overlap_group


class OverlapWiring:
    """The optimizer's `overlap` (None when off) and its step in progress."""

    def __init__(self, enabled: bool, exchange: ErrorFeedbackExchange,
                 callbacks: OverlapCallbacks, bucket_cap_mb: float, param_groups) -> None:
        self.overlap = BackwardOverlap(exchange, callbacks, bucket_cap_mb) if enabled else None
        self.step_in_progress: Optional[int] = None  # set by step() once it agreed to go on
        for group in param_groups:
            self.watch(group)

    def coming_step(self, last_step: int) -> int:
        """The step an exchange input is written for: the coming one
        (`last_step` + 1) during backward, the current one inside step()."""
        return self.step_in_progress or last_step + 1

    def settle(self, plan, found_inf) -> None:
        """step(), before the update: wait for the exchanges backward started
        for `plan` (step_plan.StepPlan), if it did. Backward's gradients were
        scaled whether step() unscales them (grad_scale) or the user did
        (unscale_, which leaves grad_scale None and `found_inf` set, and no
        mark on .grad): under a GradScaler they are exchanged again."""
        if plan.exchanged_in_buckets:
            self.overlap.settle(plan.trained, plan.grads, relaunch=found_inf is not None)

    def check(self, group: dict) -> None:
        """Refuse a param group the overlap cannot serve (clipping)."""
        if self.overlap is not None:
            check_overlap_group(group)

    def watch(self, group: dict) -> None:
        """Hook the params of `group` (checked first)."""
        if self.overlap is not None:
            check_overlap_group(group)
            self.overlap.watch(group["params"])

    def no_overlap(self):
        return self.overlap.no_overlap() if self.overlap is not None else contextlib.nullcontext()

    def stats(self) -> Optional[dict]:
        return dict(self.overlap.stats) if self.overlap is not None else None

    def end_step(self) -> None:
        if self.overlap is not None:
            self.overlap.end_step()

    def abandon(self) -> None:
        """Undo the exchanges backward queued (over buffers about to go: a
        group added mid-run, its params planned in); step() exchanges again."""
        if self.overlap is not None and self.overlap.launched:
            self.overlap.abandon()

    def bucket_sizes(self, trained: List[List[torch.Tensor]]) -> Sequence:
        """Each bucket's key and its params' sizes (none without the overlap)."""
        return self.overlap.bucket_sizes(trained) if self.overlap is not None else ()
