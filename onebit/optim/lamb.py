"""1-bit LAMB (Li et al., 2021, arXiv 2104.06069)."""
from __future__ import annotations

from typing import Optional

import torch

from . import functional as F
from .guards import only_seen
from ..wire import DEFAULT_BLOCK_SIZE
from .base import FreezeStepOptimizer
from ..checks import check_number
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
                 bucket_cap_mb: float = 25.0) -> None:
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
            bucket_cap_mb=bucket_cap_mb))
        self.lamb_coeffs = []  # the last step's per-tensor coefficients (for logging)
        self._scaled_errors = False  # see load_state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        # Checkpoints of onebit before 2026-11 scaled the momenta (a per-param
        # "scaling_coeff"), so their error buffers are in those units: they
        # restart from zero instead (load_error_feedback_state_dict).
        coeffs = [st.pop("scaling_coeff", 1.0) for st in self.state.values()]
        self._scaled_errors = any(c != 1.0 for c in coeffs)

    def load_error_feedback_state_dict(self, state: dict) -> bool:
        if self._scaled_errors:
            state = dict(state, wire_format=None)  # matches nothing: the buffers restart
        return super().load_error_feedback_state_dict(state)

    def _staged_state(self):
        def zeros(p):
            return torch.zeros_like(p, dtype=torch.float32)
        staged = {"lamb_coeff_freeze": (lambda p: 0.0, lambda step: True)}  # 0.0: the default
        if self.trust_ratio == "frozen":  # its factor's state
            staged["last_factor"] = (lambda p: 1.0, lambda step: True)
            staged["exp_avg_sq_fresh"] = (zeros, lambda step: step >= max(self.freeze_step, 1))
        else:
            staged["exp_avg_smoothed"] = (zeros, lambda step: step >= max(self.freeze_step, 1))
        return staged

    def _update(self, stage, groups, grads) -> None:
        self.lamb_coeffs = []
        for i, ((group, params), gs) in enumerate(zip(groups, grads)):
            if params:
                (self._compressed_step if stage.compressed else self._warmup_step)(
                    i, group, params, gs, stage.step)

    def _late_update(self, key, group, params, grads) -> None:
        """A late joiner's own warmup (late.py): LAMB's warmup maths, one
        param at a time, counted from its first step; its last step keeps its
        variance as the fresh one, as freeze_step does for the rest."""
        for p, g in zip(params, grads):
            done = LateJoiners.steps_done(self._local_state(), p)
            self._clip_([g], group["max_grad_norm"])  # (its own norm: step() clips the rest)
            self._warmup_step(key, group, [p], [g], done + 1)

    def _warmup_step(self, i, group, params, gs, t) -> None:
        beta1, beta2 = group["betas"]
        m, v = self._moments(params)
        F.update_momentum_(m, gs, beta1)
        F.update_variance_(v, gs, beta2)
        seen, _ = self._seen(i, group, v, None)
        params, m, v = only_seen(seen, params, m, v)  # never-seen tensors stay as they are
        if not params:
            return
        bc1, bc2 = self._bias_corrections(group, t, t)
        coeffs = self._lamb_update(i, group, params, m, self._denominators(i, group, v, bc2, None), bc1)
        for p, coeff in zip(params, coeffs):
            st = self._state_of(p)
            st.setdefault("lamb_coeff_freeze", 0.0)
            st.setdefault("last_factor", 1.0)
            if coeff != 1.0:
                st["lamb_coeff_freeze"] = (self.coeff_beta * st["lamb_coeff_freeze"]
                                           + (1.0 - self.coeff_beta) * coeff)
        if t == self.freeze_step:  # what the compression stage's ratio starts from
            key, src = (("exp_avg_sq_fresh", v) if self.trust_ratio == "frozen"
                        else ("exp_avg_smoothed", m))
            for p, x in zip(params, src):
                self._state_of(p)[key] = x.clone()

    def _lamb_update(self, i, group, params, m, denom, bc1) -> list:
        """LAMB's step: p -= lr * clamp(||p|| / ||u||) * u with
        u = (m / bc1) / denom + weight_decay * p. Returns the coefficients."""
        pf = [p.float() for p in params]
        upd = F.adam_updates(m, denom, pf, group["weight_decay"], bc1,
                             out=self._static.scratch("update", i, m))
        coeffs = F.lamb_trust_ratios(pf, upd, group["min_coeff"], group["max_coeff"],
                                     whole=self._whole_norms())
        self.lamb_coeffs.extend(coeffs)
        F.apply_updates_(params, upd, group["lr"], coeffs)
        return coeffs

    def _whole_norms(self):
        """Sharded params: the ratio is of whole parameters' norms, so each
        list of shard norms is completed over the shard group (shards.py)."""
        return self._shards.whole_norms if self._shards.sharded else None

    def _compressed_step(self, i, group, params, gs, t) -> None:
        m, v = self._moments(params)
        frozen = self.trust_ratio == "frozen"
        if frozen:
            m_last = self._static.scratch("momentum before this step", i, m)
            torch._foreach_copy_(m_last, m)
        # m <- the 1-bit average of the new momentum: one fused exchange for
        # the whole group (see the class doc for why it is not rescaled).
        seen, masks = self._seen(i, group, v, self.freeze_step)
        exchange = self._exchanges.group(i)
        inputs = exchange.inputs(m)
        if inputs is not None:  # (else backward wrote them: the same expression)
            F.momentum_into(inputs, m, gs, group["betas"][0])
        exchange.average_(m, seen, masks)
        self._mask_(group, m)
        bc1, bc2 = self._bias_corrections(group, t, self.freeze_step)
        if not frozen:  # LAMB itself, on the averaged momentum and the frozen variance
            self._fresh_ratio_step(i, group, params, m, v, seen, bc1, bc2)
            return
        self._frozen_ratio_step(i, group, params, m, v, m_last, seen, bc1, bc2)

    def _fresh_ratio_step(self, i, group, params, m, v, seen, bc1, bc2) -> None:
        """trust_ratio="fresh": LAMB's ratio, measured on the running average
        of the exchanged momentum (see the class doc)."""
        for p, mi in zip(params, m):  # freeze_step = 0 or a restored warmup: start from m
            if "exp_avg_smoothed" not in self._state_of(p):
                self._state_of(p)["exp_avg_smoothed"] = mi.clone()
        smoothed = [self._state_of(p)["exp_avg_smoothed"] for p in params]
        params, m, v, smoothed = only_seen(seen, params, m, v, smoothed)
        if not params:
            return
        torch._foreach_lerp_(smoothed, m, 1.0 - self.trust_ratio_beta)
        denom = self._denominators(i, group, v, bc2, self.freeze_step)
        # bc1 times the ratio's update (bc1 = 1 and weight decay x bc1 below):
        # the norm takes the 1 / bc1 instead of a pass over the buffers.
        pf, wd = [p.float() for p in params], group["weight_decay"]
        ref = F.adam_updates(smoothed, denom, pf, wd * bc1, 1.0,
                             out=self._static.scratch("update", i, m))
        coeffs = F.lamb_trust_ratios(pf, ref, group["min_coeff"], group["max_coeff"],
                                     updates_scale=1.0 / bc1, whole=self._whole_norms())
        self.lamb_coeffs.extend(coeffs)
        # The step itself never materialises the update (a decay and an addcdiv).
        F.adam_step_(params, m, denom, group["lr"], wd, bc1, scales=coeffs)

    def _frozen_ratio_step(self, i, group, params, m, v, m_last, seen, bc1, bc2) -> None:
        """The paper's compression-stage update (trust_ratio="frozen")."""
        beta1, beta2 = group["betas"]
        for p, vi in zip(params, v):  # freeze_step = 0: the fresh variance starts at v
            if "exp_avg_sq_fresh" not in self._state_of(p):
                self._state_of(p)["exp_avg_sq_fresh"] = vi.clone()
        fresh = [self._state_of(p)["exp_avg_sq_fresh"] for p in params]
        params, m, v, m_last, fresh = only_seen(seen, params, m, v, m_last, fresh)
        if not params:
            return
        # The gradient implied by the momentum change feeds the fresh variance:
        # g = (m - beta1 * m_last) / (1 - beta1), computed in m_last's buffer.
        g_rec = m_last
        torch._foreach_mul_(g_rec, -beta1 / (1.0 - beta1))
        torch._foreach_add_(g_rec, m, alpha=1.0 / (1.0 - beta1))
        F.update_variance_(fresh, g_rec, beta2)
        denom = self._denominators(i, group, v, bc2, self.freeze_step)
        denom_fresh = F.denominators(fresh, group["eps"], group["eps_inside_sqrt"], bc2,
                                     out=self._static.scratch("fresh denominators", i, fresh))
        ratio_maxes = F.max_ratios_(denom, denom_fresh, self._shards.whole_maxima
                                    if self._shards.sharded else None)
        pf = [p.float() for p in params]
        # The update before weight decay, then after, in the same buffer.
        upd = F.adam_updates(m, denom, pf, 0.0, bc1, out=self._static.scratch("update", i, m))
        prelim_norms = upd_norms = F.norms(upd, self._whole_norms())
        if group["weight_decay"]:
            torch._foreach_add_(upd, pf, alpha=group["weight_decay"])
            upd_norms = F.norms(upd, self._whole_norms())
        coeffs = []
        for p, rmax, pn, un in zip(params, ratio_maxes, prelim_norms, upd_norms):
            st = self._state_of(p)
            factor = F.lamb_frozen_factor(rmax, pn, un, group["weight_decay"],
                                          st.get("last_factor", 1.0), self.factor_min,
                                          self.factor_max, self.factor_threshold)
            st["last_factor"] = factor
            coeffs.append(st.get("lamb_coeff_freeze", 0.0) * factor)
        self.lamb_coeffs.extend(coeffs)
        F.apply_updates_(params, upd, group["lr"], coeffs)
