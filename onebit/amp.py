"""A torch.amp.GradScaler whose scale is the same on every rank.

torch's GradScaler decides from this rank's gradients alone. Under plain
DDP that is enough: the all-reduce has spread an inf to every rank before
the scaler looks. With the onebit optimizers the scaler sees each rank's
own gradients (the optimizer exchanges them later, compressed; DDP with
onebit's comm hook sends nothing on most steps), so an inf on one rank
backs off that rank's scale alone. The optimizers still skip such a step
on every rank, but from then on the ranks scale their losses differently:
a checkpoint of rank 0's scaler no longer describes the others, and under
DDP the next full-precision average mixes gradients scaled by different
factors, so the replicas drift apart.

This scaler agrees before it updates: whether any rank found an inf or a
NaN since the last update is gathered across the process group (one
bounded all-gather of one number per update), and every rank's scaler
backs off, or grows, on that answer.

    scaler = onebit.amp.GradScaler("cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
"""
from typing import Optional

import torch
import torch.distributed as dist

from . import collectives

# Set on an optimizer for the duration of this scaler's step(): a onebit
# optimizer whose ranks disagree on found-inf then knows the scales will
# agree anyway, and does not warn.
AGREEING_SCALER_ATTRIBUTE = "scaler_agrees_across_ranks"


class GradScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler (same arguments) whose `update()` backs off on
    every rank of `process_group` (default: the world) when any of them
    found an inf or a NaN; `timeout_s` bounds that agreement."""

    def __init__(self, device: str = "cuda", init_scale: float = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, process_group=None,
                 timeout_s: Optional[float] = None) -> None:
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled)
        self.process_group = process_group
        self.timeout_s = collectives.check_timeout(timeout_s)

    def step(self, optimizer, *args, **kwargs):
        setattr(optimizer, AGREEING_SCALER_ATTRIBUTE, True)
        try:
            return super().step(optimizer, *args, **kwargs)
        finally:
            delattr(optimizer, AGREEING_SCALER_ATTRIBUTE)

    def update(self, new_scale=None) -> None:
        if new_scale is None and self.is_enabled() and self._distributed():
            self._agree_on_found_inf()
        super().update(new_scale)

    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and \
            dist.get_world_size(self.process_group) > 1

    def _agree_on_found_inf(self) -> None:
        # The parent keeps what each optimizer's step found per device, and
        # update() reads it from there: the agreed answer is written back in
        # place, so the parent's own update logic decides the new scale.
        found = [flag for state in self._per_optimizer_states.values()
                 for flag in state["found_inf_per_device"].values()]
        if not found:  # the parent's update() says what is wrong
            return
        here = sum(flag.detach().to(torch.float64).sum() for flag in found)
        table = collectives.gather_numbers("agreeing on the GradScaler's found-inf",
                                           [here], torch.float64, self.process_group,
                                           self.timeout_s)
        anywhere = float(any(row[0] > 0 for row in table))
        for flag in found:
            flag.fill_(anywhere)
