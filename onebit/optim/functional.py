"""The maths of one optimizer step, as pure functions on lists of tensors.

No process group, no optimizer state: these can be tested on their own, and
the optimizer classes only decide *which* of them to call and on *what*
(averaged or compressed quantities). Everything works in place on fp32
tensors with torch's multi-tensor (`_foreach_*`) kernels, which is what keeps
a step as cheap as `torch.optim.Adam(foreach=True)`.

Notation: m = exp_avg, v = exp_avg_sq, t = step (1-based), bc1 = 1 - beta1^t,
bc2 = 1 - beta2^(number of variance updates so far), both 1 without bias
correction.
"""
from __future__ import annotations

import math
import operator
import os
from typing import List, Optional, Sequence

import torch

from ..multi_tensor import tensor_norms

Tensors = List[torch.Tensor]


def update_momentum_(exp_avgs: Tensors, grads: Tensors, beta1: float) -> None:
    """m <- beta1 * m + (1 - beta1) * g"""
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)


# Where one launch per tensor costs more than a pass over memory: many
# small tensors on an accelerator. There the `..._into` functions below copy
# their first operand into `out` and apply the op in place with one
# multi-tensor (foreach) launch per chunk of tensors, instead of an `out=`
# launch per tensor. The bits are the same either way: the copy is exact
# and the element-wise op is the same. On the CPU nothing is launched, so
# the one-pass `out=` form stays. $ONEBIT_FOREACH_BELOW (elements per
# tensor on average) overrides the threshold on every device, the CPU
# included, which is how the tests run the foreach forms here.
FOREACH_BELOW = 1 << 16


def foreach_pays(tensors: Tensors) -> bool:
    """Whether `tensors` are many and small enough for the foreach forms."""
    if len(tensors) < 2:
        return False
    below = os.environ.get("ONEBIT_FOREACH_BELOW")
    if below is None:
        if tensors[0].device.type == "cpu":
            return False
        below = FOREACH_BELOW
    return sum(t.numel() for t in tensors) < int(below) * len(tensors)


def as_fp32(tensors: Tensors) -> Tensors:
    """The tensors in fp32: the list itself where every one already is (a
    step over thousands of small tensors pays for each .float() call)."""
    if all(t.dtype is torch.float32 for t in tensors):
        return tensors
    return [t.float() for t in tensors]


def _same(a: Tensors, b: Tensors) -> bool:
    return a is b or all(map(operator.is_, a, b))


def copy_unless_same_(out: Tensors, src: Tensors) -> None:
    if not _same(out, src):
        torch._foreach_copy_(out, src)


def _either_form(out: Tensors, first: Tensors, in_place, one) -> None:
    """out[i] <- op(first[i], ...), in one of foreach_pays's two forms:
    `first` copied into `out`, then `in_place(out)` (the foreach op); or
    `one(i, out[i])` (the per-tensor out= op) for each tensor. Where `out`
    is `first` the foreach op runs in place on any device: nothing to copy."""
    if not out:  # (a foreach op refuses an empty list)
        return
    if _same(out, first) or foreach_pays(out):
        copy_unless_same_(out, first)
        in_place(out)
        return
    for i, o in enumerate(out):
        one(i, o)


def momentum_into(out: Tensors, exp_avgs: Tensors, grads: Tensors, beta1: float) -> None:
    """out <- beta1 * m + (1 - beta1) * g, m unchanged unless it is `out`:
    one pass, and the same kernel (so the same bits) as update_momentum_."""
    _either_form(out, exp_avgs, lambda o: torch._foreach_lerp_(o, grads, 1.0 - beta1),
          lambda i, o: torch.lerp(exp_avgs[i], grads[i], 1.0 - beta1, out=o))


def div_into(out: Tensors, numerators: Tensors, denominators: Tensors) -> None:
    """out <- a / b for each pair."""
    _either_form(out, numerators, lambda o: torch._foreach_div_(o, denominators),
          lambda i, o: torch.div(numerators[i], denominators[i], out=o))


def mul_into(out: Tensors, src: Tensors, factors) -> None:
    """out <- a * k for each a of `src`; `factors`: one number for all, or a
    list of tensors."""
    each = factors if isinstance(factors, (list, tuple)) else [factors] * len(out)
    _either_form(out, src, lambda o: torch._foreach_mul_(o, factors),
          lambda i, o: torch.mul(src[i], each[i], out=o))


def add_into(out: Tensors, starts: Tensors, updates: Tensors) -> None:
    """out <- a + u for each pair."""
    _either_form(out, starts, lambda o: torch._foreach_add_(o, updates),
          lambda i, o: torch.add(starts[i], updates[i], out=o))


def addcdiv_into(out: Tensors, starts: Tensors, numerators: Tensors, denominators: Tensors,
                 value: float) -> None:
    """out <- a + value * n / d for each."""
    _either_form(out, starts,
          lambda o: torch._foreach_addcdiv_(o, numerators, denominators, value=value),
          lambda i, o: torch.addcdiv(starts[i], numerators[i], denominators[i], value=value,
                                     out=o))


def update_variance_(exp_avg_sqs: Tensors, grads: Tensors, beta2: float) -> None:
    """v <- beta2 * v + (1 - beta2) * g^2"""
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)


def _into(out: Optional[Tensors], src: Tensors) -> Tensors:
    """`src` copied into `out` (caller-owned buffers), or a fresh copy."""
    if out is None:
        return [t.clone() for t in src]
    if out:
        torch._foreach_copy_(out, src)
    return out


def adam_moments_(grads: Tensors, exp_avgs: Tensors, exp_avg_sqs: Tensors, *, beta1: float,
                  beta2: float) -> None:
    """A warmup's moments, in place: m and v learn from `grads` (averaged
    across ranks), before the denominators and masks of the new v are read."""
    update_momentum_(exp_avgs, grads, beta1)
    update_variance_(exp_avg_sqs, grads, beta2)


def bias_corrections(group: dict, step: int, variance_updates: int):
    """(1 - beta1^step, 1 - beta2^variance_updates) for a param group; (1, 1)
    without bias_correction. v's count stops when v freezes."""
    if not group["bias_correction"]:
        return 1.0, 1.0
    b1, b2 = group["betas"]
    return 1.0 - b1 ** step, (1.0 - b2 ** max(variance_updates, 1))


def denominators(exp_avg_sqs: Tensors, eps: float, eps_inside_sqrt: bool, bc2: float,
                 out: Optional[Tensors] = None) -> Tensors:
    """sqrt(v / bc2) + eps, or sqrt(v / bc2 + eps) when eps_inside_sqrt.

    `out`: buffers to write into. On the CPU a fresh multi-MB tensor costs
    page faults worth several passes over it, so the optimizers pass buffers
    they keep from step to step."""
    d = _into(out, exp_avg_sqs)
    if eps_inside_sqrt:
        torch._foreach_div_(d, bc2)
        torch._foreach_add_(d, eps)
        torch._foreach_sqrt_(d)
        return d
    torch._foreach_sqrt_(d)
    torch._foreach_div_(d, math.sqrt(bc2))
    torch._foreach_add_(d, eps)
    return d


def adam_updates(exp_avgs: Tensors, denoms: Tensors, params: Tensors, weight_decay: float,
                 bc1: float, out: Optional[Tensors] = None) -> Tensors:
    """u = (m / bc1) / denom + weight_decay * p   (the direction, before lr).
    `out`: buffers to write into (see denominators)."""
    if not exp_avgs:  # every tensor skipped (guards.py): nothing to compute
        return [] if out is None else out
    if out is None:
        u = torch._foreach_div(exp_avgs, denoms)
    else:  # m / denom straight into the buffers: one pass, not a copy and a divide
        u = out
        div_into(u, exp_avgs, denoms)
    if bc1 != 1.0:
        torch._foreach_div_(u, bc1)
    if weight_decay:
        torch._foreach_add_(u, params, alpha=weight_decay)
    return u


def adam_step_(params: Tensors, exp_avgs: Tensors, denoms: Tensors, lr: float,
               weight_decay: float, bc1: float,
               scales: Optional[Sequence[float]] = None) -> None:
    """p <- p - lr * s_i * ((m / bc1) / denom + weight_decay * p), without
    materialising the update: decay in place, then one addcdiv (what keeps
    this as cheap as torch.optim.Adam's foreach step). `scales`: per-tensor
    s_i (LAMB's coefficients), 1 if None. Each tensor's rounding depends on
    its own dtype only, so stepping a list in parts (overlap.py) gives the
    same bits as stepping it whole."""
    if not params:
        return
    if scales is None and all(p.dtype is torch.float32 for p in params):
        # The usual case with scalars, not per-tensor lists of them (the same
        # values, so the same bits): a step over thousands of small tensors
        # pays for every per-tensor list it builds.
        if weight_decay:
            torch._foreach_mul_(params, 1.0 - lr * weight_decay)
        torch._foreach_addcdiv_(params, exp_avgs, denoms, value=-lr / bc1)
        return
    scales = [1.0] * len(params) if scales is None else scales
    fp32 = [i for i, p in enumerate(params) if p.dtype == torch.float32]
    if fp32:
        pick = (lambda xs: xs) if len(fp32) == len(params) else (lambda xs: [xs[i] for i in fp32])
        ss = pick(scales)
        if weight_decay:
            torch._foreach_mul_(pick(params), [1.0 - lr * s * weight_decay for s in ss])
        torch._foreach_addcdiv_(pick(params), pick(exp_avgs), pick(denoms), [-lr * s / bc1 for s in ss])
    low = [i for i, p in enumerate(params) if p.dtype != torch.float32]
    if low:  # low-precision params: compute in fp32, round once
        pick = lambda xs: [xs[i] for i in low]  # noqa: E731
        upd = adam_updates(pick(exp_avgs), pick(denoms), [p.float() for p in pick(params)],
                           weight_decay, bc1)
        apply_updates_(pick(params), upd, lr, pick(scales))


# The steps land their updates through these.

def add_updates_(params: Tensors, updates: Tensors) -> None:
    """p <- p + u for fp32 updates; low-precision params are computed in fp32
    and rounded once."""
    fp32 = [(p, u) for p, u in zip(params, updates) if p.dtype == torch.float32]
    if fp32:
        torch._foreach_add_([p for p, _ in fp32], [u for _, u in fp32])
    for p, u in zip(params, updates):
        if p.dtype != torch.float32:
            p.copy_(p.float().add_(u))


def apply_updates_(params: Tensors, updates: Tensors, lr: float,
                   scales: Optional[Sequence[float]] = None) -> None:
    """p <- p - lr * scale_i * u_i (scales: LAMB's per-tensor coefficients).

    Params of another dtype (bf16, fp16) receive the fp32 update rounded once.
    """
    if not updates:
        return
    if scales is not None:
        torch._foreach_mul_(updates, [-lr * s for s in scales])
    else:
        torch._foreach_mul_(updates, -lr)
    add_updates_(params, updates)


def norms(tensors: Tensors, whole=None) -> List[float]:
    """L2 norm of each tensor (0 for empty tensors), as Python floats.
    `whole` (sharded params, shards.py) turns the stacked norms of local
    shards into those of the whole parameters."""
    if not tensors:
        return []
    stacked = tensor_norms(tensors)
    if whole is not None:
        stacked = whole(stacked)
    return [float(n) for n in stacked.tolist()]


def lamb_trust_ratios(params: Tensors, updates: Tensors, min_coeff: float,
                      max_coeff: float, updates_scale: float = 1.0, whole=None) -> List[float]:
    """||p|| / ||u|| clamped to [min_coeff, max_coeff]; 1 where either norm
    is 0. u is `updates` times `updates_scale` (a pass saved where the
    caller's buffers hold a multiple of the update). `whole`: see norms."""
    # One host sync for both lists of norms.
    both = norms([*as_fp32(params), *updates], whole)
    return trust_ratios_of(both, min_coeff, max_coeff, updates_scale)


def trust_ratios_of(both: List[float], min_coeff: float, max_coeff: float,
                    updates_scale: float = 1.0) -> List[float]:
    """lamb_trust_ratios from the norms: `both` holds each ||p||, then each
    ||u|| (before `updates_scale`)."""
    half = len(both) // 2
    out = []
    for w, u in zip(both[:half], both[half:]):
        u *= updates_scale
        out.append(min(max(w / u, min_coeff), max_coeff) if w > 0 and u > 0 else 1.0)
    return out


def max_ratios_(numerators: Tensors, denominators: Tensors, whole_max=None) -> List[float]:
    """max(a / b) of each pair of tensors (1.0 for empty ones), with one host
    sync for the whole list instead of one per tensor. Overwrites
    `denominators` with the ratios (no allocation). `whole_max` (sharded
    params, shards.py) takes per-tensor maxima of local shards to those of
    the whole parameters; an empty shard then counts as -inf, not 1.0."""
    live = [i for i, a in enumerate(numerators) if a.numel()]
    out = [1.0] * len(numerators)
    maxes = []
    if live:
        ratios = [denominators[i] for i in live]
        torch._foreach_reciprocal_(ratios)
        torch._foreach_mul_(ratios, [numerators[i] for i in live])
        maxes = torch._foreach_max(ratios) if hasattr(torch, "_foreach_max") else [r.max() for r in ratios]
    if whole_max is not None and numerators:
        every = torch.full((len(numerators),), -math.inf, device=numerators[0].device)
        if live:
            every[live] = torch.stack(maxes).float()
        return [v if v != -math.inf else 1.0 for v in whole_max(every).tolist()]
    for i, v in zip(live, torch.stack(maxes).tolist() if live else []):
        out[i] = v
    return out


def lamb_frozen_factor(denom_ratio_max: float, update_prelim_norm: float,
                       update_norm: float, weight_decay: float, last_factor: float,
                       factor_min: float, factor_max: float, threshold: float) -> float:
    """1-bit LAMB's compression-stage scaling factor for one tensor:
    max(denom / denom_fresh) (`denom_ratio_max`, see max_ratios_), blended
    toward 1 by the weight-decay share of the update, clamped to
    [factor_min, factor_max] and to within `threshold` of the previous
    step's factor."""
    factor = denom_ratio_max
    if weight_decay and update_norm > 0:
        ratio = min(1.0, update_prelim_norm / update_norm)
        factor = factor * ratio + (1.0 - ratio)
    factor = min(max(factor, factor_min), factor_max)
    return min(max(factor, last_factor * (1.0 - threshold)), last_factor * (1.0 + threshold))


def clipped(grads: Tensors, max_norm: float, whole_norms) -> Tensors:
    """`grads` clipped to the global norm `max_norm` (0: as they are).
    `whole_norms` completes per-tensor norms of shards into whole params'
    (ShardedParams.whole_norms; the identity on whole params). Clipped
    copies: `grads` may be the params' own `.grad`, which torch's
    optimizers never write."""
    if max_norm > 0 and grads:
        total = float(torch.linalg.vector_norm(whole_norms(tensor_norms(grads))))
        if not math.isfinite(total):
            # Finite gradients whose squares sum beyond fp32 (the
            # non-finite check let them through: no element's square
            # overflows, or no single tensor's on the CPU): the norm in
            # float64, not a coefficient of 0 that would zero the step.
            # (Every rank of a shard group takes this branch alike.)
            total = float(torch.linalg.vector_norm(whole_norms(torch.stack(
                [torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]))))
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            return list(torch._foreach_mul(grads, coef))
    return grads
