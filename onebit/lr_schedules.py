"""DeepSpeed's lr schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR,
OneCycle) as torch lr schedulers, with DeepSpeed's parameter names and
formulas, so that a DeepSpeed config's "scheduler" section keeps its
meaning (`onebit.config.build_scheduler`).

Each schedule is a small frozen dataclass: the lr (and, for OneCycle, the
first beta) of param group `i` at DeepSpeed's iteration `it`. DeepSpeedLR
turns one into a torch.optim.lr_scheduler.LRScheduler, used as any torch
scheduler: built before the first step, `step()` after each
`optimizer.step()`. Its state_dict is torch's, less the schedule.

Step counting is DeepSpeed's. A DeepSpeed scheduler is built at iteration
-1, and each `step()` advances it by one, so in a loop of
`optimizer.step(); scheduler.step()` the k-th optimizer step runs at
iteration k - 2 (a log warmup holds warmup_min_lr for two steps, a cosine
one starts at 0). A torch scheduler's `last_epoch` is k - 1 there: the
iteration is `last_epoch - 1`.

Where we differ: OneCycle with cycle_momentum sets only the first beta;
DeepSpeed also replaces the second with 0.99, which would change the
variance decay of an Adam under the user's feet.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional, Sequence, Union

import torch

Number = Union[float, Sequence[float]]


def _for_group(value: Number, i: int) -> float:
    """A DeepSpeed per-group setting: one number for every group, or a list."""
    return float(value[i]) if isinstance(value, (list, tuple)) else float(value)


def _warmup_fraction(it: int, steps: int, kind: str) -> float:
    """How far through warmup iteration `it` is: log(it + 1) / log(steps)
    ("log", DeepSpeed's default) or it / steps ("linear"); 1 after it."""
    if it >= steps:
        return 1.0
    return math.log(it + 1) / math.log(steps) if kind == "log" else it / steps


def _check_warmup(steps, kind) -> None:
    if not isinstance(steps, int) or isinstance(steps, bool) or steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {steps!r}")
    if kind not in ("log", "linear"):
        raise ValueError(f"warmup_type must be 'log' or 'linear', got {kind!r}")


@dataclass(frozen=True)
class WarmupLR:
    """From warmup_min_lr to warmup_max_lr (default: the group's lr) over
    warmup_num_steps, then flat."""

    warmup_min_lr: Number = 0.0
    warmup_max_lr: Optional[Number] = None
    warmup_num_steps: int = 1000
    warmup_type: str = "log"

    def __post_init__(self):
        _check_warmup(self.warmup_num_steps, self.warmup_type)

    def _fraction(self, it: int) -> float:
        return _warmup_fraction(it, max(2, self.warmup_num_steps), self.warmup_type)

    def lr(self, it: int, i: int, base_lr: float) -> float:
        low = _for_group(self.warmup_min_lr, i)
        high = base_lr if self.warmup_max_lr is None else _for_group(self.warmup_max_lr, i)
        return low if it < 0 else low + (high - low) * self._fraction(it)


@dataclass(frozen=True)
class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linearly down to 0 at total_num_steps."""

    total_num_steps: int = 0
    warmup_max_lr: Optional[Number] = 0.001  # DeepSpeed's default here

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.total_num_steps, int) or self.total_num_steps <= 0:
            raise ValueError(f"WarmupDecayLR needs total_num_steps, a positive integer; got "
                             f"{self.total_num_steps!r}")

    def _fraction(self, it: int) -> float:
        warmup = max(2, self.warmup_num_steps)
        if it < warmup:
            return super()._fraction(it)
        return max(0.0, (self.total_num_steps - it) / max(1.0, self.total_num_steps - warmup))


@dataclass(frozen=True)
class WarmupCosineLR:
    """The group's lr times a ratio: from warmup_min_ratio to 1 over
    warmup_num_steps, then a half cosine down to cos_min_ratio at
    total_num_steps, and flat there after. Before the first step() the
    ratio is 0, as in DeepSpeed."""

    total_num_steps: int = 0
    warmup_min_ratio: float = 0.0
    warmup_num_steps: int = 1000
    cos_min_ratio: float = 0.0001
    warmup_type: str = "log"

    def __post_init__(self):
        _check_warmup(self.warmup_num_steps, self.warmup_type)
        if not isinstance(self.total_num_steps, int) or self.total_num_steps <= 0:
            raise ValueError(f"WarmupCosineLR needs total_num_steps, a positive integer; got "
                             f"{self.total_num_steps!r}")

    def lr(self, it: int, i: int, base_lr: float) -> float:
        if it < 0:
            return 0.0
        warmup = max(2, self.warmup_num_steps)
        if it < warmup:
            fraction = _warmup_fraction(it, warmup, self.warmup_type)
            return base_lr * (self.warmup_min_ratio + fraction * (1.0 - self.warmup_min_ratio))
        progress = min(1.0, (it - warmup + 1) / max(1, self.total_num_steps - warmup))
        half_cosine = (1 + math.cos(math.pi * progress)) / 2
        return base_lr * max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * half_cosine)


@dataclass(frozen=True)
class OneCycle:
    """One triangle from cycle_min_lr up to cycle_max_lr (over
    cycle_first_step_size iterations) and back (cycle_second_step_size),
    optionally in stairs; then, with decay_step_size, cycle_min_lr / (1 +
    decay_lr_rate * iterations past the cycle / decay_step_size). The first
    beta cycles the other way, between cycle_max_mom and cycle_min_mom."""

    cycle_min_lr: Number = 0.0
    cycle_max_lr: Number = 0.0
    decay_lr_rate: float = 0.0
    cycle_first_step_size: int = 2000
    cycle_second_step_size: Optional[int] = None
    cycle_first_stair_count: int = 0
    cycle_second_stair_count: Optional[int] = None
    decay_step_size: int = 0
    cycle_momentum: bool = True
    cycle_min_mom: Number = 0.8
    cycle_max_mom: Number = 0.9
    decay_mom_rate: float = 0.0

    def __post_init__(self):
        if self.cycle_first_step_size <= 0:
            raise ValueError(f"cycle_first_step_size must be positive, got "
                             f"{self.cycle_first_step_size}")
        if self.second_size < 0:
            raise ValueError(f"cycle_second_step_size must be non-negative, got "
                             f"{self.cycle_second_step_size}")

    @property
    def second_size(self) -> float:
        return float(self.cycle_first_step_size if self.cycle_second_step_size is None
                     else self.cycle_second_step_size)

    def _height(self, it: int) -> float:
        """Where iteration `it` is on the triangle: 0 at the bottom, 1 at the top."""
        first, second = float(self.cycle_first_step_size), self.second_size
        total = first + second
        n = it + 1
        x = n / total - math.floor(n / total)
        if x <= first / total:
            height, stairs = x / (first / total), self.cycle_first_stair_count
        else:
            height = (x - 1) / (first / total - 1)
            stairs = (self.cycle_first_stair_count if self.cycle_second_stair_count is None
                      else self.cycle_second_stair_count)
        if stairs > 0:  # counted on whole iterations, so a stair is never lost to rounding
            k = n % total
            position = k * stairs / first if k <= first else (total - k) * stairs / second
            height = math.floor(position) / stairs
        return height

    def _past_cycle(self, it: int) -> Optional[float]:
        """Decay intervals past the cycle at iteration `it`, or None inside it."""
        total = self.cycle_first_step_size + self.second_size
        if it < total:
            return None
        return (it - total + 1) / self.decay_step_size if self.decay_step_size else 0.0

    def lr(self, it: int, i: int, base_lr: float) -> float:
        low, high = _for_group(self.cycle_min_lr, i), _for_group(self.cycle_max_lr, i)
        if it < 0:
            return low
        past = self._past_cycle(it)
        if past is None:
            return low + (high - low) * self._height(it)
        return low / (1 + self.decay_lr_rate * past)

    def beta1(self, it: int, i: int) -> Optional[float]:
        if not self.cycle_momentum:
            return None
        low, high = _for_group(self.cycle_min_mom, i), _for_group(self.cycle_max_mom, i)
        if it < 0:
            return low
        past = self._past_cycle(it)
        if past is None:
            return high - (high - low) * self._height(it)
        return high * (1 + self.decay_mom_rate * past)


SCHEDULES = {cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle)}


class DeepSpeedLR(torch.optim.lr_scheduler.LRScheduler):
    """A torch scheduler that follows one of the schedules above."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule, last_epoch: int = -1) -> None:
        if type(schedule) not in SCHEDULES.values():
            raise TypeError(f"schedule must be one of {sorted(SCHEDULES)}, got "
                            f"{type(schedule).__name__}")
        self.schedule = schedule
        beta1 = getattr(schedule, "beta1", None)
        if beta1 is not None and schedule.cycle_momentum and any(
                "betas" not in g for g in optimizer.param_groups):
            raise ValueError(f"{type(schedule).__name__} with cycle_momentum needs an optimizer "
                             "with betas (an Adam); set cycle_momentum to false")
        super().__init__(optimizer, last_epoch)

    def state_dict(self) -> dict:
        """torch's, less the schedule (it comes from the config on rebuild),
        so the dict holds numbers only and loads with torch.load's default
        weights_only=True."""
        return {k: v for k, v in super().state_dict().items() if k != "schedule"}

    def get_lr(self):
        it = self.last_epoch - 1  # DeepSpeed's iteration for the coming optimizer step
        beta1 = getattr(self.schedule, "beta1", None)
        for i, group in enumerate(self.optimizer.param_groups):
            b1 = beta1(it, i) if beta1 is not None else None
            if b1 is not None:
                group["betas"] = (b1, group["betas"][1])
        return [self.schedule.lr(it, i, base) for i, base in enumerate(self.base_lrs)]


def schedule_from(kind: str, params: dict):
    """The schedule named `kind` (DeepSpeed's type names) with `params`;
    ValueError naming what is wrong."""
    cls = SCHEDULES.get(kind)
    if cls is None:
        raise ValueError(f"unknown scheduler type {kind!r}; valid types: {sorted(SCHEDULES)}")
    accepted = {f.name for f in fields(cls)}
    unknown = sorted(set(params) - accepted - {"last_batch_iteration"})
    if unknown:
        raise ValueError(f"{kind}: unknown parameter(s) {unknown}; valid: {sorted(accepted)}")
    if params.get("last_batch_iteration", -1) != -1:
        raise ValueError(f"{kind}: last_batch_iteration={params['last_batch_iteration']}: resume "
                         "a scheduler with load_state_dict of its saved state_dict instead")
    return cls(**{k: v for k, v in params.items() if k != "last_batch_iteration"})
