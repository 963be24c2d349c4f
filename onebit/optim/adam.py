"""1-bit Adam (Tang et al., 2021, arXiv 2102.02888)."""
from __future__ import annotations

from typing import Optional

from . import functional as F
from .guards import only_seen
from ..wire import DEFAULT_BLOCK_SIZE
from .base import FreezeStepOptimizer
from .defaults import adam_defaults
from .options import CommOptions, documents_comm_options
from .stage_schedules import FreezeStepSchedule


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
                 bucket_cap_mb: float = 25.0) -> None:
        defaults = adam_defaults("OnebitAdam", lr, betas, eps, weight_decay, max_grad_norm, amsgrad,
                                 bias_correction, eps_inside_sqrt)
        super().__init__(params, defaults, FreezeStepSchedule(freeze_step), CommOptions(
            cuda_aware=cuda_aware, comm_backend_name=comm_backend_name,
            process_group=process_group, timeout_s=timeout_s,
            check_replicas_every=check_replicas_every, block_size=block_size,
            scale_dtype=scale_dtype, overlap_backward=overlap_backward,
            bucket_cap_mb=bucket_cap_mb))

    def _update(self, stage, groups, grads) -> None:
        t, compress, version = stage.step, stage.compressed, stage.variance_version
        for i, ((group, params), gs) in enumerate(zip(groups, grads)):
            if not params:
                continue
            beta1, beta2 = group["betas"]
            m, v = self._moments(group, params, gs)
            if not compress:
                F.update_momentum_(m, gs, beta1)
                F.update_variance_(v, gs, beta2)
            seen, masks = self._seen(i, group, v, version)
            bc1, bc2 = self._bias_corrections(group, t, stage.variance_updates)
            denom = self._denominators(i, group, v, bc2, version)
            # m <- the 1-bit average of the new momentum, in parts: with
            # overlap_backward, each bucket's params step while the next
            # bucket is still on the wire.
            parts = (self._exchanged_parts(i, params, gs, m, seen, masks) if compress
                     else [range(len(params))])
            for part in parts:
                ps, ms, ds, ss = ([xs[j] for j in part] for xs in (params, m, denom, seen))
                if compress:
                    self._mask_(group, ms)
                F.adam_step_(*only_seen(ss, ps, ms, ds), group["lr"], group["weight_decay"], bc1)
