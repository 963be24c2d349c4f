"""DiLoCo's outer lr: a number, or a schedule read where each round lands.

`outer_lr` may be a function of the inner steps taken (warmup included),
read at a round's place in the schedule: where its outer step lands (its
launch plus overlap_steps). Every rank must step its anchors alike, so a
round reads it there whatever this rank does: a rank a step behind its
peers (a skipped inner step) lands its last rounds in close(), drain()
and sync() land early. `OuterLR` holds those rules; `SteppedOuterLR` is a
picklable two-value schedule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, Union

from .. import collectives
from ..checks import check_number
from ..agreement import group_settings
from .fragments import FragmentPlan


@dataclass(frozen=True)
class SteppedOuterLR:
    """An outer lr schedule for DiLoCo(outer_lr=...): `early` until inner
    step `from_step`, then `later` (a class, not a lambda, so that it
    pickles into spawned workers)."""

    early: float
    later: float
    from_step: int

    def __call__(self, inner_steps: int) -> float:
        return self.early if inner_steps < self.from_step else self.later


class OuterLR:
    """Which lr each round lands with. `outer_lr`: a number (the outer SGD
    keeps it: nothing to resolve) or a schedule of the inner steps."""

    def __init__(self, outer_lr: Union[float, Callable[[int], float]], plan: FragmentPlan,
                 warmup_steps: int) -> None:
        self.schedule = outer_lr if callable(outer_lr) else None
        self._constant = None if callable(outer_lr) else outer_lr
        self.plan, self.warmup_steps = plan, warmup_steps

    def first_landings(self, rounds: int) -> List[int]:
        """The inner steps (as counted when a landing reads the outer lr)
        of every fragment's landings in the first `rounds` rounds."""
        return sorted(self.warmup_steps + self.plan.offset(f) + self.plan.delay
                      + k * self.plan.sync_every
                      for f in range(self.plan.count) for k in range(rounds))

    def fingerprint(self) -> object:
        """What the ranks compare when built: a schedule by its values at
        the first rounds' landings, the inner steps a landing reads it at."""
        if self.schedule is None:
            return self._constant
        return [self.schedule(step) for step in self.first_landings(65)]

    def read(self, step: int) -> float:
        """The schedule's outer lr at inner step `step`; ValueError if it is
        no finite number >= 0."""
        lr = self.schedule(step)
        check_number("outer_lr", lr, low=0.0)
        return float(lr)

    def for_round(self, lands_at: int) -> Tuple[Optional[float], bool]:
        """A launching round's scheduled lr and whether it was read at its
        landing step in the schedule (`lands_at`), the same on every rank
        (None without a schedule). A schedule may end with the run: the
        last launches land past it, and a proposal at close() may never be
        made. Where it gives no lr at `lands_at`, the round takes the one
        at its launch step, which every rank that makes the round reached,
        for a landing before `lands_at` (drain(), close()); a landing at
        `lands_at` reads it there again, and raises (`at_landing`). None
        where it gives none at either."""
        if self.schedule is None:
            return None, True
        for step, planned in ((lands_at, True), (lands_at - self.plan.delay, False)):
            try:
                return self.read(step), planned
            except Exception:  # (any error of the user's schedule: raised at a landing)
                pass
        return None, False

    def at_landing(self, job, inner_steps: int) -> Optional[float]:
        """The outer lr the round `job` (a RoundInFlight) lands with under a
        schedule (None without one), when this rank has taken `inner_steps`:
        read at its landing step in the schedule, not where this rank lands
        it (`for_round`). Fills in `job.lr` for a restored round."""
        if self.schedule is None:
            return None
        early = job.lands_at > inner_steps
        if job.lr is None and early:  # restored, or undefined at both steps
            job.lr, job.planned = self.for_round(job.lands_at)
        if job.lr is not None and (job.planned or early):
            return job.lr
        return self.read(job.lands_at)  # raises: the run reached it, undefined

    def planned_landing(self, fragment: int, inner_steps: int) -> int:
        """The inner step where `fragment`'s round in flight at a saved step
        (`inner_steps`) lands in the schedule: launched at or before it, it
        lands within a round after it."""
        for step in range(inner_steps + 1, inner_steps + self.plan.sync_every + 1):
            if fragment in self.plan.landing(step - self.warmup_steps):
                return step
        return inner_steps

    def digest(self, param_groups: Sequence[dict], lr: Tuple[Optional[float], bool]) -> int:
        """A digest of the outer SGD's settings for a round: a value set on
        one rank only (its lr, say) would let the anchors drift apart.
        Under a schedule, the lr the round will land with and where it was
        read (`lr`: for_round's, the same steps on every rank)."""
        settings = group_settings(param_groups,
                                  leave_out=("lr",) if self.schedule is not None else ())
        return collectives.stable_digest((settings, lr))
