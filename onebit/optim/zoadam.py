"""0/1 Adam (Lu et al., 2022, arXiv 2202.06009)."""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch

from . import functional as F
from .caches import apply_mask_
from .guards import mask_unseen_, only_seen, only_unseen
from ..multi_tensor import zero_one_land, zero_one_local_step, zero_one_step, zero_one_sync_input
from ..wire import DEFAULT_BLOCK_SIZE
from .base import OnebitOptimizer
from .defaults import adam_defaults
from .freeze_check import warn_if_unsettled
from .options import CommOptions, documents_comm_options
from .stage_schedules import ZeroOneSchedule
from .step_exchange import GroupExchange
from .step_plan import float_lr


@documents_comm_options
class ZeroOneAdam(OnebitOptimizer):
    """Adam with rare variance updates, 1-bit gradients, then local steps.

    Before var_freeze_step: the variance v is updated only on steps that are
    multiples of an interval that starts at 1 and doubles every
    `var_update_scaler` updates; those steps average gradients in full
    precision. Every other step averages the gradient with the 1-bit
    compressed allreduce and moves only the momentum.
    After var_freeze_step: v is frozen; each rank takes *local* steps while
    accumulating its displacement u, and every `local_step_interval` steps
    the ranks average, with the 1-bit allreduce, the interval's lr-weighted
    mean direction u * (sqrt(v) + eps) / (sum of lr since the last sync),
    in momentum units, and land on the same point. DeepSpeed's 0/1 Adam
    exchanges u * (sqrt(v) + eps) and divides afterwards, so its error
    buffers carry lr-scaled values that return, at a small lr sum, as a
    huge momentum (docs/deepspeed.md).
    The interval starts at 1 and doubles every `local_step_scaler` steps, up
    to `local_step_clipper`. Between syncs the ranks' parameters differ by
    design; after each sync they are bitwise identical.

    Choosing var_freeze_step: the end of the learning-rate warmup (the paper's
    T_v); it needs no other tuning. Hyper-parameters otherwise as OnebitAdam.

    overlap_backward: see OnebitAdam; here it starts during backward the
    1-bit gradient exchanges (before var_freeze_step) and the syncs that
    follow a sync (interval 1: every step for the first local_step_scaler
    steps after the freeze, by default), whose input, this step's
    displacement, needs only this step's gradient. A sync after local steps
    (or at lr 0) is exchanged in step(), over the same buckets.
    """

    _adam_compatible = True  # loads torch.optim.Adam checkpoints (checkpoints.py)

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True,
                 betas=(0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0,
                 var_freeze_step: int = 100000, var_update_scaler: int = 16,
                 local_step_scaler: int = 32678, local_step_clipper: int = 16,
                 amsgrad: bool = False,
                 *, cuda_aware: bool = False, comm_backend_name: Optional[str] = None,
                 process_group=None, timeout_s: Optional[float] = None,
                 check_replicas_every: int = 0, block_size: int = DEFAULT_BLOCK_SIZE,
                 scale_dtype="float32", overlap_backward: bool = False,
                 bucket_cap_mb: float = 25.0, communication_data_type=None) -> None:
        defaults = adam_defaults("ZeroOneAdam", lr, betas, eps, weight_decay, max_grad_norm, amsgrad,
                                 bias_correction, eps_inside_sqrt)
        schedule = ZeroOneSchedule(var_freeze_step, var_update_scaler, local_step_scaler,
                                   local_step_clipper)
        super().__init__(params, defaults, schedule, CommOptions(
            cuda_aware=cuda_aware, comm_backend_name=comm_backend_name,
            process_group=process_group, timeout_s=timeout_s,
            check_replicas_every=check_replicas_every, block_size=block_size,
            scale_dtype=scale_dtype, overlap_backward=overlap_backward,
            bucket_cap_mb=bucket_cap_mb, communication_data_type=communication_data_type))

    def _staged_state(self):
        def zeros(p):
            return torch.zeros_like(p, dtype=torch.float32)
        # The accumulator is zero until the first local step and after each sync.
        return {"momentum_accumulator": (zeros, lambda step: True),
                "sync_point": (lambda p: torch.zeros_like(p), lambda step: self.frozen(step))}

    # The last synced point is the run's, not a param's move: a local step
    # that leaves a gradless param as it was still records it (its first
    # local step after a sync copies it; put back, the next steps would
    # land on the sync before).
    STATE_OF_THE_RUN = ("sync_point",)
    # A point the params land on: their own dtype, so landing rounds nothing.
    STATE_IN_PARAM_DTYPE = ("sync_point",)

    def _leaves_gradless_params(self, stage) -> bool:
        """A sync lands every param on the ranks' common point: one that no
        rank has a gradient for in this step joins it with a zero gradient,
        else it would keep this rank's own value and the replicas would
        stay apart."""
        return not (stage.variance_frozen and stage.compressed)

    # The schedule's settings, read-only (they are agreed at construction).
    var_freeze_step = property(lambda self: self._schedule.var_freeze_step)
    var_update_scaler = property(lambda self: self._schedule.var_update_scaler)
    local_step_scaler = property(lambda self: self._schedule.local_step_scaler)
    local_step_clipper = property(lambda self: self._schedule.local_step_clipper)

    def frozen(self, step: Optional[int] = None) -> bool:
        """Whether step `step` (default: the next) is past var_freeze_step."""
        return self._schedule.frozen(self.counters["step"] + 1 if step is None else step)

    def _exchange_input_key(self, index: int):
        t = self._coming_step()
        if not self.frozen(t):
            return None
        g = self.param_groups[index]
        return (t, float(g["lr"]), g["weight_decay"], tuple(g["betas"]), g["eps"],
                g["eps_inside_sqrt"], g["bias_correction"])

    def _exchange_input_(self, index, params, grads, out, positions) -> None:
        """Before the freeze: the gradients. At a sync that follows a sync:
        this step's direction (see _sync_single_)."""
        t = self._coming_step()
        if not self.frozen(t):
            if out is not grads:  # at world size 1 the gradients are their own average
                torch._foreach_copy_(out, grads)
            return
        group = float_lr(self.param_groups[index])
        version = self.counters["var_updates"]
        bc1, bc2 = F.bias_corrections(group, t, version)

        def group_variances() -> List[torch.Tensor]:
            # Only where the caches of the frozen v miss (once per v): a
            # lookup of every trained param per bucket made backward's host
            # time grow with buckets x params.
            return self._params.tensors(self._params.trainable(group), "exp_avg_sq")

        denom = self._caches.denominators(index, group, group_variances, bc2, version)
        seen, masks = self._caches.seen(index, group, group_variances, version)
        m = self._params.tensors(params, "exp_avg")  # (`params` are trained[j] for j in positions)
        single_sync_input_into(out, params, m, grads, [denom[j] for j in positions], bc1,
                               [seen[j] for j in positions], [masks[j] for j in positions],
                               beta1=group["betas"][0], weight_decay=group["weight_decay"])

    def _update(self, stage, groups, grads) -> None:
        c = self.counters
        t, frozen, full = stage.step, stage.variance_frozen, stage.full_precision
        version = stage.variance_updates  # v's updates, this step's included
        freezing = frozen and not self.frozen(t - 1)
        if freezing:
            # The error buffers switch from gradients to accumulated steps.
            self.reset_compression_errors()
            warn_if_unsettled("ZeroOneAdam", "var_freeze_step", t - 1,
                              [v for _, params in groups if params
                               for v in self._params.moments(params)[1]])
        sync = frozen and stage.compressed
        for i, ((group, params), gs) in enumerate(zip(groups, grads)):
            if not params:
                continue
            # A sync right after a sync (or the freeze, or steps at lr 0):
            # the accumulator would hold this step's displacement alone.
            single = sync and c["lrs"][i] == 0.0
            beta1, beta2 = group["betas"]
            states = self._params.states(params)
            m, v = self._params.moments(params, states)
            if single:  # (lrs stays 0: the next interval starts here)
                self._sync_single_(i, t, version, group, params, gs, m, v, states)
                continue
            if full:
                F.update_variance_(v, gs, beta2)
            seen, masks = self._caches.seen(i, group, v, version)
            # The exchanged or local gradient moves nothing v never saw.
            if not full and not frozen:  # the 1-bit average of the gradients
                exchange = self._exchanges.group(i)
                inputs = exchange.inputs(gs)
                if inputs is not None:  # (else backward wrote them: the same copy)
                    F.copy_unless_same_(inputs, gs)
                exchange.average_(gs, seen, masks)
                apply_mask_(gs, self._caches.mask(group, params))
            elif not full:
                mask_unseen_(gs, masks, seen)
            bc1, bc2 = F.bias_corrections(group, t, version)
            denom = self._caches.denominators(i, group, v, bc2, version)  # (v's, not m's)
            if frozen:
                u = self._params.tensors(params, "momentum_accumulator", states)
                anchors = self._anchors(params, states, c["lrs"][i] == 0.0)
                # A local step: the momentum and the step in one pass where
                # the device has the kernel (the tensors that move; the
                # others' momentum apart).
                fused = not sync and any(seen) and zero_one_local_step(
                    *only_seen(seen, params, gs, m, denom, u, anchors), beta1=beta1,
                    lr=group["lr"], weight_decay=group["weight_decay"], bc1=bc1)
                if fused:
                    _unseen_momentum_(seen, m, gs, beta1)
                else:
                    F.update_momentum_(m, gs, beta1)
                    # Tensors that never saw a gradient do not move (guards.py).
                    accumulate_(*only_seen(seen, params, m, denom, u, anchors), lr=group["lr"],
                                weight_decay=group["weight_decay"], bc1=bc1, sync=sync)
                c["lrs"][i] += group["lr"]
            else:  # (the same maths in one pass where the device has the kernel)
                fused = any(seen) and zero_one_step(*only_seen(seen, params, gs, m, denom),
                                                    beta1=beta1, lr=group["lr"],
                                                    weight_decay=group["weight_decay"], bc1=bc1)
                if fused:
                    _unseen_momentum_(seen, m, gs, beta1)
                else:
                    F.update_momentum_(m, gs, beta1)
                    ps, ms, ds = only_seen(seen, params, m, denom)
                    upd = F.adam_updates(ms, ds, F.as_fp32(ps), group["weight_decay"], bc1,
                                         out=self._caches.static.scratch("update", i, ms))
                    if upd:  # (empty when no tensor of the group has seen a gradient)
                        torch._foreach_mul_(upd, -group["lr"])  # upd is now the displacement
                    F.add_updates_(ps, upd)
            if sync:
                sync_local_steps_(params, anchors, m, u, denom, exchange=self._exchanges.group(i),
                                  seen=seen, masks=masks,
                                  exp_avg_mask=self._caches.mask(group, params),
                                  bc1=bc1, lrs=c["lrs"][i])
                c["lrs"][i] = 0.0

    @torch.no_grad()
    def _params_stopped_training(self, params) -> None:
        """A param frozen after local steps holds this rank's own value, and
        no later sync takes it: the replicas would stay apart for good. It
        goes back to its last synced point, the same on every rank (the
        local steps since then are dropped for it, as a frozen layer takes
        no more steps)."""
        in_interval = {id(p) for g, lrs in zip(self.param_groups, self.counters["lrs"])
                       if lrs != 0.0 for p in g["params"]}
        for p in self._shards.locals([p for p in params if id(p) in in_interval]):
            st = self._params.of(p)
            if "sync_point" in st:
                p.copy_(st["sync_point"])
                if "momentum_accumulator" in st:
                    st["momentum_accumulator"].zero_()

    def _anchors(self, params, states, first: bool):
        """The last synced point of each param, kept exactly: recomputing it
        as p - u would round differently on each rank, and the replicas would
        no longer be bitwise identical after a sync. Until the first local
        step after a sync (`first`), p itself is that point, so it is copied
        only then: with sync interval 1, never."""
        out = []
        for p, st in zip(params, states):  # (`states`: the params' _states)
            if "sync_point" not in st:
                st["sync_point"] = p.detach().clone()
            elif first:
                st["sync_point"].copy_(p.detach())
            out.append(st["sync_point"])
        return out

    def _sync_single_(self, i, t, version, group, params, grads, m, v, states) -> None:
        """A sync with no lr since the last sync (see sync_single_)."""
        # The accumulators stay 0, but exist for the local steps.
        self._params.tensors(params, "momentum_accumulator", states)
        bc1, bc2 = F.bias_corrections(group, t, version)
        denom = self._caches.denominators(i, group, v, bc2, version)
        seen, masks = self._caches.seen(i, group, v, version)
        sync_single_(params, grads, m, denom, exchange=self._exchanges.group(i), seen=seen,
                     masks=masks, exp_avg_mask=self._caches.mask(group, params),
                     beta1=group["betas"][0], lr=group["lr"],
                     weight_decay=group["weight_decay"], bc1=bc1)


Tensors = List[torch.Tensor]


def _unseen_momentum_(seen: Sequence[bool], exp_avgs: Tensors, grads: Tensors,
                      beta1: float) -> None:
    """The momentum of the tensors a fused pass left out (never seen): as
    update_momentum_ gives every tensor on the torch path."""
    if not all(seen):
        F.update_momentum_(*only_unseen(seen, exp_avgs, grads), beta1)


def accumulate_(params: Tensors, exp_avgs: Tensors, denoms: Tensors, accumulators: Tensors,
                anchors: Tensors, *, lr: float, weight_decay: float, bc1: float,
                sync: bool) -> None:
    """A frozen step's displacement d = -lr * (m / bc1 / denom + wd * p)
    added to the accumulators u, and p moved to anchor + u -- in two or
    three passes, without materialising d. A sync step leaves p alone:
    the sync sets it to the new common point."""
    if not params:
        return
    if weight_decay:
        torch._foreach_add_(accumulators, F.as_fp32(params), alpha=-lr * weight_decay)
    torch._foreach_addcdiv_(accumulators, exp_avgs, denoms, value=-lr / bc1)
    if not sync:
        fp32 = [j for j, p in enumerate(params) if p.dtype == torch.float32]
        F.add_into([params[j] for j in fp32], [anchors[j] for j in fp32],
                   [accumulators[j] for j in fp32])
        for p, a, u in zip(params, anchors, accumulators):
            if p.dtype != torch.float32:  # in fp32, rounded once
                p.copy_(a.float() + u)


def sync_local_steps_(params: Tensors, anchors: Tensors, exp_avgs: Tensors,
                      accumulators: Tensors, denoms: Tensors, *, exchange: GroupExchange,
                      seen, masks, exp_avg_mask: Optional[torch.Tensor], bc1: float,
                      lrs: float) -> None:
    """Replace the local steps since the last sync with their 1-bit average.

    u (`accumulators`) holds this rank's displacement since the anchor (the
    last synced point), and lrs > 0 the sum of lr over those steps. The
    ranks average u * denom / lrs, the interval's lr-weighted mean direction
    (-m / bc1 less weight decay), the momentum is re-derived from it (m =
    -avg * bc1) and every rank lands on anchor + lrs * avg / denom: the same
    bits everywhere.

    The exchange carries the mean direction, not the displacement u *
    denom, so that its error buffers hold momentum units whatever the lr
    does. In displacement units an error left by a sync at a large lr
    came back, divided by a small lrs, as a huge m: an lr that decays to
    about 0 and rises again (cosine with a short period, warm restarts)
    blew the loss up.

    A sync with no lr since the last sync takes sync_single_ instead.
    """
    # u * denom / lrs goes straight into the buffer that travels, and the
    # average is read from there: no pass to scale u, none to copy it back
    # (at world size 1 the buffer is u itself). Never written in backward:
    # a sync after local steps needs u.
    avg = exchange.inputs(accumulators)
    F.mul_into(avg, accumulators, denoms)
    torch._foreach_div_(avg, lrs)
    exchange.average_(None, seen, masks)  # the average stays where the input was
    apply_mask_(avg, exp_avg_mask)
    mask_unseen_(avg, masks, seen)
    F.mul_into(exp_avgs, avg, -bc1)
    land_(params, anchors, avg, denoms, seen, lrs)
    torch._foreach_zero_(accumulators)


def land_(params: Tensors, starts: Tensors, avg: Tensors, denoms: Tensors, seen,
          lrs: float) -> None:
    """Every rank lands on the same point: start + lrs * avg / denom
    (tensors v never saw stay where they are)."""
    ps, as_, ais, ds = only_seen(seen, params, starts, avg, denoms)
    fp32 = [j for j, p in enumerate(ps) if p.dtype == torch.float32]
    F.addcdiv_into(*([xs[j] for j in fp32] for xs in (ps, as_, ais, ds)), value=lrs)
    for p, a, ai, di in zip(ps, as_, ais, ds):
        if p.dtype != torch.float32:  # divide in fp32, round once
            p.copy_(torch.addcdiv(a, ai, di, value=lrs).to(p.dtype))


def sync_single_(params: Tensors, grads: Tensors, exp_avgs: Tensors, denoms: Tensors, *,
                 exchange: GroupExchange, seen, masks, exp_avg_mask: Optional[torch.Tensor],
                 beta1: float, lr: float, weight_decay: float, bc1: float) -> None:
    """A sync with no lr since the last sync (a sync that follows a sync:
    interval 1, the default for the first local_step_scaler steps after
    the freeze; or local steps at lr 0): u would hold this step's
    displacement alone, so the mean direction u * denom / lr = -(m' /
    bc1 + wd * p * denom), with m' this step's new momentum, is the
    exchange input itself (it needs only this step's gradient, so
    overlap_backward starts it during backward: ZeroOneAdam._exchange_input_).
    At lr 0 it is the same expression, the limit of the mean direction as
    lr -> 0: the error buffers never see another unit. m is re-derived from
    the average (m = -avg * bc1) and p, still the last synced point, moves
    in place: 11 passes over the parameters, as 1-bit Adam's step."""
    inputs = exchange.inputs(exp_avgs)
    if inputs is not None:  # (else backward wrote them: the same function)
        single_sync_input_into(inputs, params, exp_avgs, grads, denoms, bc1, seen, masks,
                               beta1=beta1, weight_decay=weight_decay)
    # m <- the average direction, zeroed where v == 0, bucket by bucket
    for part in exchange.parts(exp_avgs, seen, masks):
        ps, ms, ds, ss = ([xs[j] for j in part] for xs in (params, exp_avgs, denoms, seen))
        apply_mask_(ms, exp_avg_mask)
        if any(ss) and zero_one_land(*only_seen(ss, ps, ms, ds), lr=lr, bc1=bc1):  # (a GPU)
            if not all(ss):  # (they do not move)
                torch._foreach_mul_(only_unseen(ss, ms)[0], -bc1)
        else:
            land_(ps, ps, ms, ds, ss, lr)
            torch._foreach_mul_(ms, -bc1)


def single_sync_input_into(out: Tensors, params: Tensors, exp_avgs: Tensors, grads: Tensors,
                           denoms: Tensors, bc1: float, seen, masks, *, beta1: float,
                           weight_decay: float) -> None:
    """What a sync that follows a sync exchanges, into `out`: the direction
    of this step's new momentum beta1 * m + (1 - beta1) * g (m itself is
    not committed). Written by step() (sync_single_) or, for a bucket,
    during backward (ZeroOneAdam._exchange_input_): one expression, so the
    two paths give the same bits."""
    # The tensors seen everywhere in one pass where the device has the
    # kernel; the others (masked, or never seen) as below.
    plain = [ok and k is None for ok, k in zip(seen, masks)]
    if any(plain) and zero_one_sync_input(*only_seen(plain, out, params, exp_avgs, grads, denoms),
                                          beta1=beta1, bc1=bc1, weight_decay=weight_decay):
        if all(plain):
            return
        out, params, exp_avgs, grads, denoms, seen, masks = only_unseen(
            plain, out, params, exp_avgs, grads, denoms, seen, masks)
    F.momentum_into(out, exp_avgs, grads, beta1)
    direction_into(params, out, denoms, bc1, seen, masks, out, weight_decay=weight_decay)


def direction_into(params: Tensors, exp_avgs: Tensors, denoms: Tensors, bc1: float, seen,
                   masks, out: Tensors, *, weight_decay: float) -> None:
    """out <- this step's direction in momentum units, -(m / bc1 + wd * p *
    denom) (its displacement is lr * out / denom), with m zeroed where v ==
    0 (in the same pass where the mask is dense); 0 for the tensors v never
    saw (they do not move)."""
    plain = [j for j, (ok, k) in enumerate(zip(seen, masks)) if ok and k is None]
    F.mul_into([out[j] for j in plain], [exp_avgs[j] for j in plain], -1.0 / bc1)
    for mi, o, ok, k in zip(exp_avgs, out, seen, masks):
        if ok and k is None:
            continue  # done above
        if ok and k.is_floating_point():
            torch.addcmul(torch.zeros((), device=o.device), mi, k, value=-1.0 / bc1, out=o)
        elif ok:
            torch.mul(mi, -1.0 / bc1, out=o)
            mask_unseen_([o], [k], [ok])
        else:
            o.zero_()
    ps, ds, os_ = only_seen(seen, params, denoms, out)
    if weight_decay and ps:
        torch._foreach_addcmul_(os_, F.as_fp32(ps), ds, value=-weight_decay)
