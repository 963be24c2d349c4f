"""1-bit Adam (Tang et al., 2021, arXiv 2102.02888)."""
from __future__ import annotations

from typing import Iterable, List, Optional, Sequence

import torch

from . import functional as F
from .guards import only_seen
from ..wire import DEFAULT_BLOCK_SIZE
from .freeze_step import FreezeStepOptimizer
from .caches import apply_mask_
from .defaults import adam_defaults
from .options import CommOptions, documents_comm_options
from .stage_schedules import FreezeStepSchedule
from .step_exchange import GroupExchange

Tensors = List[torch.Tensor]


@documents_comm_options
class OnebitAdam(FreezeStepOptimizer):
    """Adam whose communication drops to 1 bit per element after a warmup.

    Warmup (steps 1..freeze_step): gradients are averaged across ranks in full
    precision and this is plain Adam, so the variance v learns.
    Compression (steps after freeze_step): v is frozen; each rank folds its
    *local* gradient into the momentum m, and m is averaged with the
    error-compensated 1-bit compressed allreduce -- about 32x less traffic
    than an fp32 allreduce. The update is m / (sqrt(v) + eps) + wd * p.

    Choosing freeze_step: 15-25% of the total steps. It must be late enough
    for v to settle (the compression stage relies on a good v), and early
    enough that most steps are cheap. If the loss jumps at the switch, freeze
    later.

    Args (DeepSpeed's names; `deepspeed=` is not needed):
      params, lr, betas, eps, weight_decay: as torch.optim.Adam (weight decay
        is added to the update, as DeepSpeed does: L2 inside the step size).
      freeze_step: last full-precision step.
      bias_correction: divide m by 1 - beta1^t and v by 1 - beta2^t (v's
        count stops at freeze_step). DeepSpeed accepts and ignores this; here
        it is implemented (False gives DeepSpeed's maths).
      eps_inside_sqrt: m / sqrt(v + eps) instead of m / (sqrt(v) + eps).
      max_grad_norm: clip the gradient to this global norm (0: off). In
        warmup the averaged gradient is clipped; in compression, the local one.
      amsgrad: not supported (raises).
    Elements whose v is exactly 0 are not moved by the 1-bit momentum, and a
    tensor whose v is 0 everywhere is not updated at all (see
    onebit.optim.guards).
    Construction broadcasts rank 0's parameters and checks that every rank
    built the same optimizer (shapes, hyper-parameters, backend, wire format).
    Param groups may carry `exp_avg_mask`: multiplied into m after every
    compressed exchange, for entries whose momentum must stay exactly 0.
    """

    _adam_compatible = True  # loads torch.optim.Adam checkpoints (checkpoints.py)

    def __init__(self, params, lr: float = 1e-3, freeze_step: int = 100000,
                 bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, amsgrad: bool = False,
                 *, cuda_aware: bool = False, comm_backend_name: Optional[str] = None,
                 process_group=None, timeout_s: Optional[float] = None,
                 check_replicas_every: int = 0, block_size: int = DEFAULT_BLOCK_SIZE,
                 scale_dtype="float32", overlap_backward: bool = False,
                 bucket_cap_mb: float = 25.0, communication_data_type=None) -> None:
        defaults = adam_defaults("OnebitAdam", lr, betas, eps, weight_decay, max_grad_norm, amsgrad,
                                 bias_correction, eps_inside_sqrt)
        super().__init__(params, defaults, FreezeStepSchedule(freeze_step), CommOptions(
            cuda_aware=cuda_aware, comm_backend_name=comm_backend_name,
            process_group=process_group, timeout_s=timeout_s,
            check_replicas_every=check_replicas_every, block_size=block_size,
            scale_dtype=scale_dtype, overlap_backward=overlap_backward,
            bucket_cap_mb=bucket_cap_mb, communication_data_type=communication_data_type))

    def _update(self, stage, groups, grads) -> None:
        t, version = stage.step, stage.variance_version
        for i, ((group, params), gs) in enumerate(zip(groups, grads)):
            if not params:
                continue
            m, v = self._params.moments(params)
            beta1, beta2 = group["betas"]
            if not stage.compressed:  # warmup: m and v learn from the averaged gradients
                F.adam_moments_(gs, m, v, beta1=beta1, beta2=beta2)
            bc1, bc2 = F.bias_corrections(group, t, stage.variance_updates)
            seen, masks = self._caches.seen(i, group, v, version)
            onebit_adam(
                params, gs, m, self._caches.denominators(i, group, v, bc2, version),
                seen=seen, masks=masks,
                exchange=self._exchanges.group(i) if stage.compressed else None,
                exp_avg_mask=self._caches.mask(group, params) if stage.compressed else None,
                beta1=beta1, lr=group["lr"], weight_decay=group["weight_decay"], bc1=bc1)


def onebit_adam(params: Tensors, grads: Tensors, exp_avgs: Tensors, denoms: Tensors, *,
                seen: Sequence[bool], masks: Sequence[Optional[torch.Tensor]],
                exchange: Optional[GroupExchange], exp_avg_mask: Optional[torch.Tensor],
                beta1: float, lr: float, weight_decay: float, bc1: float) -> None:
    """One step of 1-bit Adam on one param group, in place: the 1-bit step.

    Warmup (`exchange` None): m already learned from the averaged gradients
    (functional.adam_moments_), and this is Adam's step. Compression: v is frozen and
    m becomes the 1-bit average of every rank's new momentum beta1 * m +
    (1 - beta1) * g, written straight into the buffer that travels
    (`exchange`, step_exchange.py) and landing in parts: each part's params
    step while the later parts are still on the wire (overlap_backward);
    `exp_avg_mask` (the group's, or None) is applied to each landed part.

    Then p <- p - lr * (m / bc1 / denom + weight_decay * p), with `denoms`
    sqrt(v / bc2) + eps. `seen` and `masks` are the zero-variance guard's
    (guards.py): the tensors and elements v never saw do not move.
    """
    parts: Iterable[Sequence[int]] = [range(len(params))]
    if exchange is not None:
        inputs = exchange.inputs(exp_avgs)
        if inputs is not None:  # (else backward wrote them: the same expression)
            F.momentum_into(inputs, exp_avgs, grads, beta1)
        parts = exchange.parts(exp_avgs, seen, masks)
    for part in parts:  # (disjoint: a part as long as the list is all of it)
        ps, ms, ds, ss = ((params, exp_avgs, denoms, seen) if len(part) == len(params) else
                          ([xs[j] for j in part] for xs in (params, exp_avgs, denoms, seen)))
        if exchange is not None:
            apply_mask_(ms, exp_avg_mask)
        F.adam_step_(*only_seen(ss, ps, ms, ds), lr, weight_decay, bc1)
