"""DiLoCo's full-precision averages over the ranks: the warmup's gradients
before each inner step, and the pseudo-gradients of rounds in bf16 or fp32
(compression "bf16" or "none"; 1-bit and 2-bit rounds go through the
compressed exchange instead)."""
from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from .. import collectives
from ..backends.stats import TrafficStats
from ..half_precision import share
from ..shards import local


class RankMean:
    """The ranks' mean of a list of tensors, in one all-reduce."""

    def __init__(self, world_size: int, comm_device: torch.device, timeout_s) -> None:
        self.world_size, self.comm_device, self.timeout_s = world_size, comm_device, timeout_s

    def __call__(self, phase: str, tensors: List[torch.Tensor], dtype: torch.dtype, group,
                 traffic: TrafficStats) -> List[torch.Tensor]:
        """The ranks' mean of `tensors`, flat fp32 pieces in their order: one
        all-reduce over `group` in `dtype` (each rank's share divided first),
        counted in `traffic` against fp32."""
        flat = share(torch.cat([t.reshape(-1).float() for t in tensors]), self.world_size,
                     dtype).to(self.comm_device)
        collectives.run(phase, lambda: dist.all_reduce(flat, group=group, async_op=True),
                        self.timeout_s, group)
        traffic.add_allreduce(flat.numel(), self.world_size, dtype.itemsize)
        return list(flat.float().split([t.numel() for t in tensors]))

    def into(self, phase: str, tensors: List[torch.Tensor], dtype: torch.dtype, group,
             traffic: TrafficStats) -> None:
        """The same mean, written back into `tensors` (nothing to do alone)."""
        if self.world_size == 1:
            return
        for t, avg in zip(tensors, self(phase, tensors, dtype, group, traffic)):
            t.copy_(avg.view_as(t))


class WarmupAverage:
    """The warmup's synchronous data parallelism: every rank's gradients,
    averaged in fp32 before each inner step, over `group`, counted in
    `traffic`. After a load (`resumed()`), the first average checks first
    that the ranks resumed at one inner step."""

    def __init__(self, mean: RankMean, group, traffic: TrafficStats) -> None:
        self.mean, self.group, self.traffic = mean, group, traffic
        self._unchecked = False

    def resumed(self) -> None:
        self._unchecked = True

    @torch.no_grad()
    def __call__(self, params: List[torch.Tensor], inner_steps: int) -> None:
        """As DDP does, a .grad missing on some ranks counts as zero there,
        and a param that has no .grad on any rank keeps none (so the inner
        optimizer skips it: no state, no weight decay). One value per param
        in the same all-reduce says whether this rank has its .grad."""
        if self._unchecked:
            self._check_same_step(inner_steps)
            self._unchecked = False
        grads = [local(p.grad) if p.grad is not None else torch.zeros_like(local(p))
                 for p in params]
        has_grad = torch.tensor([float(p.grad is not None) for p in params],
                                device=params[0].device)
        *averages, anywhere = self.mean("DiLoCo: averaging the warmup's gradients",
                                        grads + [has_grad], torch.float32, self.group,
                                        self.traffic)
        for p, avg, used in zip(params, averages, anywhere.tolist()):
            if not used:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # a DTensor for a sharded param
            local(p.grad).copy_(avg.view_as(local(p)))

    def _check_same_step(self, inner_steps: int) -> None:
        """A ValueError on every rank, before the warmup's inner step, where
        the ranks resumed at different inner steps (each loaded another
        checkpoint): one all-reduce of (step, -step) for the largest and the
        smallest, once after a load. Else the average paired gradients of
        different steps with no error, until the first round made the
        ranks' collectives differ (a timeout). A collective of its own: in
        the average's buffer it would move gloo's chunks, and the average's
        bits with them."""
        extremes = torch.tensor([inner_steps, -inner_steps], dtype=torch.int64,
                                device=self.mean.comm_device)
        collectives.run("DiLoCo: agreeing on the inner step after a load",
                        lambda: dist.all_reduce(extremes, op=dist.ReduceOp.MAX,
                                                group=self.group, async_op=True),
                        self.mean.timeout_s, self.group)
        largest, smallest = extremes[0].item(), -extremes[1].item()
        if largest != smallest:
            raise ValueError(
                f"DiLoCo: ranks resumed at different inner steps of the warmup ({smallest} to "
                f"{largest}; this rank: {inner_steps}); nothing was stepped. Load the same "
                "checkpoint on every rank")
