"""1-bit LAMB (Li et al., 2021, arXiv 2104.06069)."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from . import checkpoints
from . import functional as F
from .caches import apply_mask_
from .guards import only_seen
from ..wire import DEFAULT_BLOCK_SIZE
from .freeze_step import FreezeStepOptimizer
from ..checks import check_number
from ..multi_tensor import lamb_ratio_norms
from .defaults import adam_defaults
from .options import CommOptions, documents_comm_options
from .stage_schedules import FreezeStepSchedule
from .late import LateJoiners


TRUST_RATIOS = ("fresh", "frozen")  # the default first (bench lm reads it so)


@documents_comm_options
class OnebitLamb(FreezeStepOptimizer):
    """LAMB whose communication drops to 1 bit per element after a warmup.

    Warmup (steps 1..freeze_step): LAMB with full-precision averaged
    gradients. Each tensor's trust ratio ||p|| / ||update|| is clamped to
    [min_coeff, max_coeff] and tracked as a running average (coeff_beta),
    which becomes the frozen coefficient.
    Compression (after freeze_step): *one* compressed allreduce of the
    momenta covers the whole group, and the update is the averaged momentum
    over the frozen variance. The paper (and DeepSpeed) first scale every
    momentum by a per-tensor coefficient so that all share one RMS, because
    one scale covered the fused buffer; here every tensor starts on its own
    blocks, each with its own scale, so such a coefficient would cancel out
    exactly (signs, scales and errors are all linear in it) and only cost
    two passes.

    trust_ratio: how the compression stage sets each tensor's coefficient.
    "fresh" (the default): LAMB's own ratio ||p|| / ||update||, clamped to
    [min_coeff, max_coeff], every step, on the frozen variance. Its
    ||update|| is measured on a running average of the averaged momentum
    (trust_ratio_beta; it starts from the momentum at the freeze), not on
    this step's: the 1-bit momentum carries compression error that error
    feedback pays back over the next steps, and a norm taken on one step
    counts that error as signal. Measured on this step's momentum, the
    ratios came out about half of those with an exact allreduce and 1-bit
    LAMB stalled (26% behind LAMB); the average lets the error cancel first.
    Every input is the same on every rank, so it costs no communication.
    "frozen": the paper's and DeepSpeed's rule. The warmup's running
    average (coeff_beta) of the ratio is frozen, a fresh variance is rebuilt
    from the gradient implied by the momentum change, and the ratio becomes
    frozen coefficient x max(sqrt(v)/sqrt(v_fresh)), clamped to
    [factor_min, factor_max] and to within factor_threshold of the previous
    factor. On the language-model benchmark (README, "Migrating from
    DeepSpeed"), 3 seeds, 240 steps: "fresh" ended 2.0% and 2.1% behind
    LAMB at a third of LAMB's best lr and at it (0.9% at LAMB's best in 480
    steps); "frozen" beat the starved LAMB by 9% at the first and ended 21%
    behind at the second. "fresh" is also the
    cheaper step (no fresh variance, no materialised update). Because it
    follows LAMB's ratio, it also follows LAMB past LAMB's stable lr: the
    ratio grows toward max_coeff as gradients shrink under the frozen
    variance, where "frozen" stays near its warmup value (the digits MLP
    at 3x LAMB's best lr; README, "Convergence").

    freeze_step: as OnebitAdam (15-25% of steps). Other arguments as
    OnebitAdam, with DeepSpeed's names and defaults.
    """

    rank_agreed_settings = ("trust_ratio", "trust_ratio_beta", "coeff_beta",
                            "factor_max", "factor_min", "factor_threshold")

    def __init__(self, params, lr: float = 1e-3, freeze_step: int = 100000,
                 bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01,
                 amsgrad: bool = False, coeff_beta: float = 0.9,
                 factor_max: float = 4.0, factor_min: float = 0.5, factor_threshold: float = 0.1,
                 trust_ratio: str = "fresh", trust_ratio_beta: float = 0.8,
                 *, cuda_aware: bool = False, comm_backend_name: Optional[str] = None,
                 process_group=None, timeout_s: Optional[float] = None,
                 check_replicas_every: int = 0, block_size: int = DEFAULT_BLOCK_SIZE,
                 scale_dtype="float32", overlap_backward: bool = False,
                 bucket_cap_mb: float = 25.0, communication_data_type=None) -> None:
        defaults = adam_defaults("OnebitLamb", lr, betas, eps, weight_decay, max_grad_norm, amsgrad,
                                 bias_correction, eps_inside_sqrt, max_coeff=max_coeff,
                                 min_coeff=min_coeff)
        for name, v in (("max_coeff", max_coeff), ("min_coeff", min_coeff),
                        ("factor_max", factor_max), ("factor_min", factor_min)):
            check_number(name, v, low_open=True)
        if min_coeff > max_coeff:
            raise ValueError(f"min_coeff ({min_coeff}) must not exceed max_coeff ({max_coeff})")
        if factor_min > factor_max:
            raise ValueError(f"factor_min ({factor_min}) must not exceed factor_max ({factor_max})")
        check_number("coeff_beta", coeff_beta, high=1.0, high_open=True)
        check_number("factor_threshold", factor_threshold, high=1.0, high_open=True)
        if trust_ratio not in TRUST_RATIOS:
            raise ValueError(f"trust_ratio must be one of {list(TRUST_RATIOS)}, not {trust_ratio!r}")
        check_number("trust_ratio_beta", trust_ratio_beta, high=1.0, high_open=True)
        self.trust_ratio, self.trust_ratio_beta = trust_ratio, trust_ratio_beta
        self.coeff_beta = coeff_beta
        self.factor_max, self.factor_min, self.factor_threshold = factor_max, factor_min, factor_threshold
        super().__init__(params, defaults, FreezeStepSchedule(freeze_step), CommOptions(
            cuda_aware=cuda_aware, comm_backend_name=comm_backend_name,
            process_group=process_group, timeout_s=timeout_s,
            check_replicas_every=check_replicas_every, block_size=block_size,
            scale_dtype=scale_dtype, overlap_backward=overlap_backward,
            bucket_cap_mb=bucket_cap_mb, communication_data_type=communication_data_type))
        self.lamb_coeffs = []  # the last step's per-tensor coefficients (for logging)
        self._scaled_errors = False  # see load_state_dict

    def _after_load(self) -> None:
        # Checkpoints of onebit before 2026-11 scaled the momenta (a per-param
        # "scaling_coeff"), so their error buffers are in those units: they
        # restart from zero instead (load_error_feedback_state_dict).
        coeffs = [st.pop("scaling_coeff", 1.0) for _, st in checkpoints.param_states(self.state)]
        self._scaled_errors = any(c != 1.0 for c in coeffs)

    def load_error_feedback_state_dict(self, state: dict) -> bool:
        if self._scaled_errors:
            state = dict(state, wire_format=None)  # matches nothing: the buffers restart
        return super().load_error_feedback_state_dict(state)

    def _staged_state(self):
        def zeros(p):
            return torch.zeros_like(p, dtype=torch.float32)
        # 0.0 and 1.0: the defaults. The warmup sets both for every param it
        # steps: a late joiner saved before its own steps lacked them.
        staged = {"lamb_coeff_freeze": (lambda p: 0.0, lambda step: True),
                  "last_factor": (lambda p: 1.0, lambda step: True)}
        if self.trust_ratio == "frozen":  # its factor's state
            staged["exp_avg_sq_fresh"] = (zeros, lambda step: step >= max(self.freeze_step, 1))
        else:
            staged["exp_avg_smoothed"] = (zeros, lambda step: step >= max(self.freeze_step, 1))
        return staged

    def _update(self, stage, groups, grads) -> None:
        self.lamb_coeffs = []
        for i, ((group, params), gs) in enumerate(zip(groups, grads)):
            if not params:
                continue
            if stage.compressed:
                self._compressed_step(i, group, params, gs, stage.step, stage.variance_updates)
            else:
                self._warmup_step(i, group, params, gs, stage.step)

    def _late_update(self, key, group, params, grads) -> None:
        """A late joiner's own warmup (late.py): LAMB's warmup maths, one
        param at a time, counted from its first step; its last step keeps its
        variance as the fresh one, as freeze_step does for the rest."""
        for p, g in zip(params, grads):
            done = LateJoiners.steps_done(self._params.local_state(), p)
            [g] = self._params.clipped([g], group["max_grad_norm"])  # (its own norm: step() clips the rest)
            self._warmup_step(key, group, [p], [g], done + 1)

    def _warmup_step(self, i, group, params, gs, t) -> None:
        states = self._params.states(params)
        m, v = self._params.moments(params, states)
        F.adam_moments_(gs, m, v, beta1=group["betas"][0], beta2=group["betas"][1])
        seen = self._caches.seen(i, group, v, None)[0]
        bc1, bc2 = F.bias_corrections(group, t, t)
        denoms = (self._caches.denominators(i, group, only_seen(seen, v)[0], bc2, None)
                  if any(seen) else [])
        coeffs = lamb_warmup_step_(
            params, m, denoms, seen=seen,
            scratch=lambda like: self._caches.static.scratch("update", i, like),
            whole_norms=self._whole_norms(), lr=group["lr"], weight_decay=group["weight_decay"],
            bc1=bc1, min_coeff=group["min_coeff"], max_coeff=group["max_coeff"])
        self.lamb_coeffs.extend(c for c in coeffs if c is not None)
        for st, mi, vi, coeff in zip(states, m, v, coeffs):
            if coeff is None:  # never seen: stays as it is
                continue
            st.setdefault("lamb_coeff_freeze", 0.0)
            st.setdefault("last_factor", 1.0)
            if coeff != 1.0:
                st["lamb_coeff_freeze"] = (self.coeff_beta * st["lamb_coeff_freeze"]
                                           + (1.0 - self.coeff_beta) * coeff)
            if t == self.freeze_step:  # what the compression stage's ratio starts from
                if self.trust_ratio == "frozen":
                    st["exp_avg_sq_fresh"] = vi.clone()
                else:
                    st["exp_avg_smoothed"] = mi.clone()

    def _whole_norms(self):
        """Sharded params: the ratio is of whole parameters' norms, so each
        list of shard norms is completed over the shard group (shards.py)."""
        return self._shards.whole_norms if self._shards.sharded else None

    def _compressed_step(self, i, group, params, gs, t, variance_updates: int) -> None:
        """`variance_updates`: how many updates the frozen v had (freeze_step,
        unless a checkpoint from a run with another freeze_step was loaded)."""
        states = self._params.states(params)
        m, v = self._params.moments(params, states)
        frozen = self.trust_ratio == "frozen"
        if frozen:
            m_last = self._caches.static.scratch("momentum before this step", i, m)
            torch._foreach_copy_(m_last, m)
        # m <- the 1-bit average of the new momentum: one fused exchange for
        # the whole group (see the class doc for why it is not rescaled).
        seen, masks = self._caches.seen(i, group, v, variance_updates)
        exchange = self._exchanges.group(i)
        inputs = exchange.inputs(m)
        if inputs is not None:  # (else backward wrote them: the same expression)
            F.momentum_into(inputs, m, gs, group["betas"][0])
        exchange.average_(m, seen, masks)
        apply_mask_(m, self._caches.mask(group, params))
        bc1, bc2 = F.bias_corrections(group, t, variance_updates)
        # freeze_step = 0 or a restored warmup: the ratio's state starts here
        start, name = (v, "exp_avg_sq_fresh") if frozen else (m, "exp_avg_smoothed")
        for st, x in zip(states, start):
            if name not in st:
                st[name] = x.clone()
        params, m, v, states = only_seen(seen, params, m, v, states)
        if not params:
            return
        denom = self._caches.denominators(i, group, v, bc2, variance_updates)
        common = dict(scratch=lambda like: self._caches.static.scratch("update", i, like),
                      whole_norms=self._whole_norms(), lr=group["lr"],
                      weight_decay=group["weight_decay"], bc1=bc1,
                      min_coeff=group["min_coeff"], max_coeff=group["max_coeff"])
        if not frozen:  # LAMB itself, on the averaged momentum and the frozen variance
            coeffs = onebit_lamb_fresh_step_(params, m, denom,
                                             [st["exp_avg_smoothed"] for st in states],
                                             trust_ratio_beta=self.trust_ratio_beta, **common)
        else:
            fresh = [st["exp_avg_sq_fresh"] for st in states]
            coeffs, factors = onebit_lamb_frozen_step_(
                params, m, denom, [m_last[j] for j, ok in enumerate(seen) if ok], fresh,
                [st.get("lamb_coeff_freeze", 0.0) for st in states],
                [st.get("last_factor", 1.0) for st in states],
                fresh_denominators=lambda fresh: F.denominators(
                    fresh, group["eps"], group["eps_inside_sqrt"], bc2,
                    out=self._caches.static.scratch("fresh denominators", i, fresh)),
                whole_maxima=self._shards.whole_maxima if self._shards.sharded else None,
                beta1=group["betas"][0], beta2=group["betas"][1], factor_min=self.factor_min,
                factor_max=self.factor_max, factor_threshold=self.factor_threshold, **common)
            for st, factor in zip(states, factors):
                st["last_factor"] = factor
        self.lamb_coeffs.extend(coeffs)


Tensors = List[torch.Tensor]


def lamb_step_(params: Tensors, exp_avgs: Tensors, denoms: Tensors, *, scratch, whole_norms,
               lr: float, weight_decay: float, bc1: float, min_coeff: float,
               max_coeff: float) -> List[float]:
    """LAMB's step: p -= lr * clamp(||p|| / ||u||) * u with u = (m / bc1) /
    denom + weight_decay * p, built in `scratch(like)`. `whole_norms`
    completes shard norms into whole-parameter ones (None: unsharded).
    Returns each tensor's coefficient."""
    pf = F.as_fp32(params)
    upd = F.adam_updates(exp_avgs, denoms, pf, weight_decay, bc1, out=scratch(exp_avgs))
    coeffs = F.lamb_trust_ratios(pf, upd, min_coeff, max_coeff, whole=whole_norms)
    F.apply_updates_(params, upd, lr, coeffs)
    return coeffs


def lamb_warmup_step_(params: Tensors, exp_avgs: Tensors, denoms: Tensors, *,
                      seen: List[bool], scratch, whole_norms, lr: float, weight_decay: float,
                      bc1: float, min_coeff: float, max_coeff: float) -> List[Optional[float]]:
    """One warmup step of 1-bit LAMB on one group, once m and v learned from
    the averaged gradients (functional.adam_moments_): LAMB itself.
    `denoms`: sqrt(v / bc2) + eps of the tensors v saw (`seen`, the
    zero-variance guard's), the others do not move. Returns each tensor's
    trust ratio, None for the tensors v never saw."""
    ps, ms = only_seen(seen, params, exp_avgs)
    if not ps:
        return [None] * len(params)
    coeffs = iter(lamb_step_(ps, ms, denoms, scratch=scratch,
                             whole_norms=whole_norms, lr=lr, weight_decay=weight_decay, bc1=bc1,
                             min_coeff=min_coeff, max_coeff=max_coeff))
    return [next(coeffs) if ok else None for ok in seen]


def onebit_lamb_fresh_step_(params: Tensors, exp_avgs: Tensors, denoms: Tensors,
                            smoothed: Tensors, *, scratch, whole_norms, trust_ratio_beta: float,
                            lr: float, weight_decay: float, bc1: float, min_coeff: float,
                            max_coeff: float) -> List[float]:
    """trust_ratio="fresh", after the exchange (`exp_avgs` hold the 1-bit
    average): LAMB's ratio, measured on the running average `smoothed` of
    the exchanged momentum (see OnebitLamb), over the frozen variance's
    `denoms`. Returns the coefficients."""
    # bc1 times the ratio's update (bc1 = 1 and weight decay x bc1 below):
    # the norm takes the 1 / bc1 instead of a pass over the buffers.
    pf = F.as_fp32(params)
    fused = lamb_ratio_norms(pf, exp_avgs, smoothed, denoms, 1.0 - trust_ratio_beta,
                             weight_decay * bc1)
    if fused is not None:  # (a GPU: the lerp and both norms in one read)
        both = (fused if whole_norms is None else whole_norms(fused)).tolist()
        coeffs = F.trust_ratios_of(both, min_coeff, max_coeff, updates_scale=1.0 / bc1)
    else:
        torch._foreach_lerp_(smoothed, exp_avgs, 1.0 - trust_ratio_beta)
        ref = F.adam_updates(smoothed, denoms, pf, weight_decay * bc1, 1.0,
                             out=scratch(exp_avgs))
        coeffs = F.lamb_trust_ratios(pf, ref, min_coeff, max_coeff, updates_scale=1.0 / bc1,
                                     whole=whole_norms)
    # The step itself never materialises the update (a decay and an addcdiv).
    F.adam_step_(params, exp_avgs, denoms, lr, weight_decay, bc1, scales=coeffs)
    return coeffs


def onebit_lamb_frozen_step_(params: Tensors, exp_avgs: Tensors, denoms: Tensors,
                             momentum_before: Tensors, fresh: Tensors, coeffs_at_freeze: list,
                             last_factors: list, *, fresh_denominators, whole_maxima, scratch,
                             whole_norms, beta1: float, beta2: float, lr: float,
                             weight_decay: float, bc1: float, min_coeff: float, max_coeff: float,
                             factor_min: float, factor_max: float,
                             factor_threshold: float) -> Tuple[List[float], List[float]]:
    """trust_ratio="frozen", the paper's compression-stage update, after
    the exchange: the gradient implied by the momentum change feeds a fresh
    variance, and each ratio is its coefficient at the freeze times a factor
    from max(denom / fresh denom). Returns (coefficients, factors)."""
    # g = (m - beta1 * m_last) / (1 - beta1), computed in m_last's buffer.
    g_rec = momentum_before
    torch._foreach_mul_(g_rec, -beta1 / (1.0 - beta1))
    torch._foreach_add_(g_rec, exp_avgs, alpha=1.0 / (1.0 - beta1))
    F.update_variance_(fresh, g_rec, beta2)
    ratio_maxes = F.max_ratios_(denoms, fresh_denominators(fresh), whole_maxima)
    pf = F.as_fp32(params)
    # The update before weight decay, then after, in the same buffer.
    upd = F.adam_updates(exp_avgs, denoms, pf, 0.0, bc1, out=scratch(exp_avgs))
    prelim_norms = upd_norms = F.norms(upd, whole_norms)
    if weight_decay:
        torch._foreach_add_(upd, pf, alpha=weight_decay)
        upd_norms = F.norms(upd, whole_norms)
    factors = [F.lamb_frozen_factor(rmax, pn, un, weight_decay, last, factor_min, factor_max,
                                    factor_threshold)
               for rmax, pn, un, last in zip(ratio_maxes, prelim_norms, upd_norms, last_factors)]
    coeffs = [c * f for c, f in zip(coeffs_at_freeze, factors)]
    F.apply_updates_(params, upd, lr, coeffs)
    return coeffs, factors
