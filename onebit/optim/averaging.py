"""The optimizer's own full-precision averaging of gradients.

Warmup steps (and late joiners, and 0/1 Adam's variance updates) average
the gradients across ranks in full precision: one all-reduce per fused
buffer, in `communication_data_type`. A DDP comm hook (onebit/ddp.py) may
have averaged some of them during backward already: it says so through
`mark`, and those are not averaged again.
"""
from __future__ import annotations

import time
from typing import Iterable, List

import torch
import torch.distributed as dist

from .. import collectives
from ..feedback.exchange import GroupKey, LateKey, UnhookedKey
from ..half_precision import check_fp16_mean, share


class FullPrecisionAveraging:
    """Means across the `world_size` ranks of `process_group`, over the fused
    buffers of `exchange` (the channel's ErrorFeedbackExchange), counted in
    `traffic`. `name` names the optimizer in errors."""

    def __init__(self, name: str, process_group, world_size: int, timeout_s, dtype: torch.dtype,
                 exchange, traffic) -> None:
        self.name, self.process_group, self.world_size = name, process_group, world_size
        self.timeout_s, self.dtype = timeout_s, dtype
        self.exchange, self.traffic = exchange, traffic
        self.hooked: set = set()  # ids of params the DDP hook averaged, for one step

    def mark(self, params: Iterable[torch.Tensor]) -> None:
        """The DDP hook's promise: these params' gradients of this step
        arrive averaged already."""
        self.hooked.update(id(p) for p in params)

    def forget_marks(self) -> None:
        """The DDP hook's promise covers one step."""
        self.hooked = set()

    def average_step_(self, plan) -> None:
        """A step's full-precision averages (`plan`: step_plan.StepPlan): the
        trained params' where the stage says so, the late joiners' at every
        step (late.py)."""
        if plan.stage.full_precision:
            for i, ((_, ps), gs) in enumerate(zip(plan.groups, plan.grads)):
                self.average_unhooked_(GroupKey(i), ps, gs)
        for i, ((_, ps), gs) in enumerate(zip(plan.late, plan.late_grads)):
            self.average_unhooked_(LateKey(i), ps, gs)

    def average_unhooked_(self, key, params: List[torch.Tensor],
                          grads: List[torch.Tensor]) -> None:
        """Average the gradients of `params` the DDP hook did not average:
        all of them without the hook; with it, those outside the DDP model
        (through a buffer of their own, UnhookedKey)."""
        if not self.hooked:
            self.average_(key, grads)
            return
        rest = [g for p, g in zip(params, grads) if id(p) not in self.hooked]
        if rest:
            self.average_(UnhookedKey(key), rest)

    def average_(self, key, tensors: List[torch.Tensor]) -> None:
        """Full-precision mean across ranks, as one collective on fused buffer
        `key` (a GroupKey, or a LateKey for late joiners), in `dtype`."""
        if self.world_size == 1 or not tensors:
            return
        dtype, world = self.dtype, self.world_size

        def mean_(flat: torch.Tensor) -> None:
            started = time.perf_counter()
            # fp32 sums, then divides (the bits every release had); half
            # precision divides first, so the sum stays as small as the mean.
            wire = flat if dtype == torch.float32 else share(flat, world, dtype)
            collectives.run(f"{self.name}: gradient averaging (full-precision all-reduce)",
                            lambda: dist.all_reduce(wire, group=self.process_group, async_op=True),
                            self.timeout_s, self.process_group)
            # The buffer is in the compression layout, every tensor padded to
            # whole blocks: the pads go over the wire too, so they count as
            # sent, though not in the fp32 baseline of the params' bytes.
            self.traffic.add_allreduce(wire.numel(), world, dtype.itemsize,
                                       time.perf_counter() - started,
                                       payload=sum(t.numel() for t in tensors))
            if wire is flat:
                flat.div_(world)
            else:
                check_fp16_mean(self.name, wire)
                flat.copy_(wire)

        self.exchange.average_(key, tensors, mean_)
