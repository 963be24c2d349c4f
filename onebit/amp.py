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

For an optimizer that does not agree on found-inf itself (torch's, fused
or not, such as DiLoCo's inner optimizer), the agreement comes earlier, in
`step()`, so
that every rank skips the step when any rank found an inf: local steps
(DiLoCo's inner steps) then stay counted alike on every rank, and the
rounds run at the same iterations everywhere. A rank skipping alone would
start each later round one step after the others, and a loop of fixed
length would end with the ranks a round apart. The healthy ranks lose that
step; under DDP the found-infs already agree, and nothing changes. The
onebit optimizers take found-inf into their own step and agree there.

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
from torch.amp.grad_scaler import OptState

from . import collectives

# Set on an optimizer for the duration of this scaler's step(): a onebit
# optimizer whose ranks disagree on found-inf then knows the scales will
# agree anyway, and does not warn.
AGREEING_SCALER_ATTRIBUTE = "scaler_agrees_across_ranks"
# In a per-optimizer state of the parent (reset at every update()): its
# found-inf flags were agreed at step(), update() need not gather again.
_AGREED = "onebit_found_inf_agreed"


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
        # Not only optimizers that leave found-inf to the scaler: torch's
        # fused ones (AdamW(fused=True)) take it into their kernel, and
        # skipped on the ranks that found an inf alone.
        if self.is_enabled() and self._distributed() and \
                not getattr(optimizer, "agrees_on_found_inf", False):
            # torch's step() skips on this rank's found-inf alone: unscale
            # (what its step() would do first) and agree before it looks.
            if self._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
                self.unscale_(optimizer)
            self._agree_on_found_inf([optimizer])
        setattr(optimizer, AGREEING_SCALER_ATTRIBUTE, True)
        try:
            return super().step(optimizer, *args, **kwargs)
        finally:
            delattr(optimizer, AGREEING_SCALER_ATTRIBUTE)

    def update(self, new_scale=None) -> None:
        if new_scale is None and self.is_enabled() and self._distributed():
            self._agree_on_found_inf(None)
        super().update(new_scale)

    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and \
            dist.get_world_size(self.process_group) > 1

    def _agree_on_found_inf(self, optimizers) -> None:
        """Whether any rank found an inf: gathered, and written back into
        each flag in place, so the parent's own logic (step's skip, update's
        new scale) decides on the agreed answer. `optimizers`: those whose
        flags to agree now (step), or None for every one not agreed yet
        (update)."""
        states = [self._per_optimizer_states[id(o)] for o in optimizers] if optimizers else \
            [st for st in self._per_optimizer_states.values() if not st.get(_AGREED)]
        for state in states:
            if (not state["found_inf_per_device"] and state["stage"] is not OptState.READY
                    and self._scale is not None):
                # Unscaled or stepped with no gradient on this rank: the
                # parent recorded no flag, but this rank must still join the
                # gather its peers make (else they wait out the deadline);
                # it found nothing.
                state["found_inf_per_device"][self._scale.device] = torch.zeros(
                    1, dtype=torch.float32, device=self._scale.device)
        found = [flag for state in states for flag in state["found_inf_per_device"].values()]
        if not found:  # the parent's update() says what is wrong
            return
        here = sum(flag.detach().to(torch.float64).sum() for flag in found)
        table = collectives.gather_numbers("agreeing on the GradScaler's found-inf",
                                           [here], torch.float64, self.process_group,
                                           self.timeout_s)
        anywhere = float(any(row[0] > 0 for row in table))
        for flag in found:
            flag.fill_(anywhere)
        for state in states:
            state[_AGREED] = True
