"""What one optimizer step works on, and the ranks' agreement before it.

`OnebitOptimizer.step()` reads as five verbs over a `StepPlan`: gather
(the stage, who trains, the fp32 gradients), agree (`StepGate`: skip a
non-finite step, which params no rank has a gradient for, which are used
for the first time since v froze), average in full precision, update (the
subclass's maths: the 1-bit step) and finish. The helpers here take their
inputs explicitly: the optimizer's ParamState, GroupCaches, overlap and
error-feedback exchange.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch

from ..agreement import group_settings, nonfinite_flag
from ..feedback.exchange import GroupKey
from .checkpoints import COUNTERS_KEY
from .late import LATE, LATE_KEY, TRAINED
from .stage import Stage
from .untouched import UntouchedParams


def step_settings(counters: dict, param_groups) -> dict:
    """What every rank must hold alike at each step, named for the message:
    the counters that decide the stage (a rank resumed from another
    checkpoint would run another stage's collectives) and each group's
    hyper-parameters (a scheduler stepped on one rank only)."""
    return {"the step counters": sorted(counters.items()),
            "hyper-parameters": group_settings(param_groups, leave_out=(COUNTERS_KEY,))}


@dataclass
class StepPlan:
    """One step's inputs, decided before anything changes."""
    stage: Stage
    groups: list  # [(param group as the maths reads it, its trained params)]
    grads: list  # their fp32 gradients, one list per group
    late: list  # [(param group, its late joiners)] (late.py)
    late_grads: list
    gradless: list = field(default_factory=list)  # trained params no rank has a gradient for
    first_used: list = field(default_factory=list)  # used for the first time since v froze
    untouched: Optional[UntouchedParams] = None  # what the step puts back for `gradless`
    exchanged_in_buckets: bool = False  # backward started this step's exchanges (overlap.py)

    @property
    def trained(self) -> List[List[torch.Tensor]]:
        return [ps for _, ps in self.groups]


def drop_scaler_handoff(optimizer) -> None:
    """After a step that raised: forget the `grad_scale` and `found_inf` a
    GradScaler handed `optimizer`. torch's GradScaler takes them back only
    from a step that returned: left, the next step would divide the
    gradients by scale^2."""
    for handed in ("grad_scale", "found_inf"):
        if hasattr(optimizer, handed):
            delattr(optimizer, handed)


def float_lr(group: dict) -> dict:
    """The group as the maths reads it: a one-element tensor lr (torch.optim
    accepts one) read once as a float; the group itself keeps the tensor,
    which schedulers update in place."""
    lr = group["lr"]
    return {**group, "lr": float(lr)} if isinstance(lr, torch.Tensor) else group


def gather(stage: Stage, codes: List[List[int]], param_groups, params, overlap,
           scale) -> StepPlan:
    """Step `stage`'s plan: each group's trained params and late joiners
    (`codes`: LateJoiners.codes's) as local shards, and their fp32
    gradients (`params`: ParamState; `scale`: a GradScaler's grad_scale, or
    None). `overlap` (BackwardOverlap or None) first notices gradients
    changed since backward, before `gradients` unscales them in place."""
    groups = [(float_lr(g), ps) for g, ps in zip(param_groups, params.coded(codes, TRAINED))]
    late = [(g, ps) for (g, _), ps in zip(groups, params.coded(codes, LATE))]
    if overlap is not None:
        overlap.notice_changed_gradients()
    return StepPlan(stage, groups, [params.gradients(ps, scale) for _, ps in groups],
                    late, [params.gradients(ps, scale) for _, ps in late])


def unseen_trained(plan: StepPlan, caches, params) -> list:
    """(param, its fp32 gradient) for each trained param whose v is 0
    everywhere, the zero-variance guard's answer (cached while v is
    frozen): once v froze, the params a nonzero gradient on some rank uses
    for the first time (late.py). Nothing per param where every trained
    tensor has seen a gradient, and nothing before v froze or without a
    late warmup. `caches`: GroupCaches; `params`: ParamState."""
    if not (plan.stage.variance_frozen and params.late.warmup_length):
        return []
    out = []
    for i, ((group, ps), gs) in enumerate(zip(plan.groups, plan.grads)):
        if not ps:
            continue
        seen, _ = caches.seen(i, group, lambda ps=ps: params.tensors(ps, "exp_avg_sq"),
                              plan.stage.variance_version)
        if not all(seen):
            out += [(p, g) for p, g, ok in zip(ps, gs, seen) if not ok]
    return out


def keep_untouched(gradless: List[torch.Tensor], trained: List[List[torch.Tensor]], params,
                   overlap, exchange, leave: tuple) -> UntouchedParams:
    """What a step must put back for the params no rank has a gradient for
    (untouched.py): their values and state (less `leave`, the state a step
    sets either way), and this rank's slices of every error buffer they sit
    in (`exchange`'s; with `overlap`, its buckets' too), as they were before
    this step's exchanges (those launched during backward included)."""
    keep = UntouchedParams()
    ids = {id(p) for p in gradless}
    for p in gradless:
        keep.keep_param(p, params.of(p), leave=leave)
    for i, ps in enumerate(trained):
        places = [(GroupKey(i), ps, j) for j, p in enumerate(ps) if id(p) in ids]
        if overlap is not None:
            places += overlap.places(trained, i, ids)
        for key, like, index in places:
            keep.keep(exchange.keep_tensor_errors(key, like, index))
    return keep


def plan_untouched(plan: StepPlan, gradless: List[torch.Tensor], leaves_all: bool, params,
                   overlap, exchange, leave: tuple) -> None:
    """`plan` learns the trained params the step leaves as they were
    (`gradless`: no rank has a gradient for them, as local shards) and what
    it puts back for them (keep_untouched). Every step leaves them all
    (`leaves_all`) but 0/1 Adam's syncs, which leave only the late joiners:
    a late joiner is averaged in full precision every step, so its replicas
    need no common point."""
    if not leaves_all:
        late_ids = {id(p) for _, ps in plan.late for p in ps}
        gradless = [p for p in gradless if id(p) in late_ids]
    plan.gradless = gradless
    plan.untouched = (keep_untouched(gradless, plan.trained, params, overlap, exchange, leave)
                      if gradless else None)


def put_back_untouched(plan: StepPlan, caches) -> None:
    """After the step: the params it left as they were put back
    (plan.untouched). Where the step moved v (full precision), what it
    derived from v (its square roots, the zero-variance masks, `caches`:
    GroupCaches) is derived again from the v put back."""
    if plan.untouched is None:
        return
    plan.untouched.restore()
    if plan.stage.full_precision:
        caches.clear()


def start_late(first_used: List[torch.Tensor], params) -> None:
    """`first_used` (local shards) were used for the first time since v
    froze, in the step just taken: v of 0 held them still, so that gradient
    is spent. From the next step they are late joiners (late.py): their
    state is that of a late joiner's first step (zeros), kept whole so that
    a checkpoint taken now has every key (DCP loads only into those). The
    caller forgets what was laid out for the old trained set."""
    for p in first_used:
        st = params.of(p)
        st.clear()
        st[LATE_KEY] = 0
        params.tensor(p, "exp_avg")
        params.tensor(p, "exp_avg_sq")


class StepGate:
    """The agreement before a step: one all-gather (RankAgreement.before_step)
    behind the exchanges backward queued (`in_order`), or, on one rank
    alone, the local answer. `name` names the optimizer in errors;
    `agreement`: its RankAgreement, `agreeing` whether there are ranks to
    agree with; `overlap`: its BackwardOverlap or None."""

    def __init__(self, name: str, agreement, agreeing: bool, comm_device, overlap) -> None:
        self.name, self.agreement, self.agreeing = name, agreement, agreeing
        self.comm_device, self.overlap = comm_device, overlap
        self.warned_scales_drift = False

    def in_order(self, collective: Callable):
        """A collective of step() on the optimizer's group: behind the
        exchanges that backward queued, on their thread (overlap.in_order),
        so that every rank issues the two groups' collectives in one order."""
        return collective() if self.overlap is None else self.overlap.in_order(collective)

    def agree(self, plan: StepPlan, unseen: list, param_groups, settings: dict, digest: int,
              found_inf, *, agreeing_scaler: bool, fp16_hint: bool
              ) -> Tuple[bool, List[torch.Tensor]]:
        """`before_step` for `plan`, once every bucket backward queued has
        launched (overlap.py): whether to skip the step, and the params no
        rank has a gradient for (whole params); `plan` learns which of
        `unseen` are used for the first time."""
        if self.overlap is not None:
            self.overlap.launch_rest(plan.trained, plan.grads)
        skip, gradless, plan.first_used = self.before_step(
            plan.stage.step, plan.grads + plan.late_grads, unseen, param_groups, settings, digest,
            found_inf, agreeing_scaler=agreeing_scaler, fp16_hint=fp16_hint)
        return skip, gradless

    def before_step(self, t: int, grads_by_group, unseen: list, param_groups, settings: dict,
                    digest: int, found_inf, *, agreeing_scaler: bool, fp16_hint: bool
                    ) -> Tuple[bool, List[torch.Tensor], list]:
        """Whether step t must be skipped: a GradScaler saw inf/NaN, or a
        gradient is not finite, on any rank; without a GradScaler
        (`found_inf` None), non-finite gradients raise on every rank before
        anything changes. The same all-gather checks that the ranks train
        the same params (`digest`) with the same `settings`, finds the
        params no rank has a gradient for (returned second, whole params)
        and which of `unseen` (unseen_trained) some rank has a nonzero
        gradient for (returned third): one host sync in all."""
        flag = nonfinite_flag(grads_by_group, self.comm_device, found_inf)
        every = [p for g in param_groups for p in g["params"]]
        no_grad = [p.grad is None for p in every]
        # (on the device: the flags join the gather, no host read of their own)
        used = torch.stack([g.ne(0).any() for _, g in unseen]) if unseen else None
        if self.agreeing:
            stale = self.overlap is not None and self.overlap.stale
            verdict = self.in_order(lambda: self.agreement.before_step(
                t, flag, digest, stale, param_groups, no_grad, settings, used))
            if self.overlap is not None:  # every rank redoes its buckets, or none
                self.overlap.stale = verdict.redo_buckets
            bad, no_grad, used = verdict.nonfinite, verdict.gradless, verdict.used
            if bad and found_inf is not None and not verdict.nonfinite_everywhere:
                self._warn_scales_drift(t, agreeing_scaler)
        else:
            bad, used = bool(flag), used.tolist() if used is not None else ()
        if bad and found_inf is None:
            hint = (" With communication_data_type='fp16' the DDP hook's mean arrives as inf "
                    "when a rank's share or the sum is beyond 65504: use 'bf16'."
                    if fp16_hint else "")
            raise ValueError(f"{self.name}: NaN or Inf gradient at step {t} on at "
                             "least one rank; nothing was updated (use torch.amp.GradScaler to "
                             f"skip such steps).{hint}")
        return (bad, [p for p, none in zip(every, no_grad) if none and p.requires_grad],
                [p for (p, _), first in zip(unseen, used) if first])

    def _warn_scales_drift(self, t: int, agreeing_scaler: bool) -> None:
        """Some ranks' GradScaler found an inf and others not: every rank
        skips this step, but torch's GradScaler backs off only where it
        found one, so the ranks' scales now differ (onebit.amp's does not)."""
        if agreeing_scaler or self.warned_scales_drift:
            return
        self.warned_scales_drift = True
        warnings.warn(f"{self.name}: at step {t} only some ranks found an inf or NaN; "
                      "every rank skipped the step, but torch.amp.GradScaler backs off only on "
                      "those ranks, so the ranks' loss scales now differ (under DDP the replicas "
                      "then drift apart). Use onebit.amp.GradScaler, which agrees across ranks",
                      RuntimeWarning, stacklevel=4)
