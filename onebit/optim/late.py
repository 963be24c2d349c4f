"""Params that start training after the variance froze: a layer unfrozen
late (progressive unfreezing), a param group added mid-run.

Such a param has no variance estimate (v = 0), and the 1-bit stage needs
one. So it gets a warmup of its own: for as many steps as the optimizer's
own warmup (freeze_step; 0/1 Adam: var_freeze_step), its gradients are
averaged in full precision and it takes the warmup maths (Adam; LAMB for
OnebitLamb) with bias corrections counted from its first step. Then it joins
the 1-bit exchange like the rest (the flat layouts are rebuilt then, and the
error-feedback buffers restart from zero). Which params are late follows
from the replicated state, so every rank agrees without a collective.
"""
from __future__ import annotations

from typing import List

import torch

from . import functional as F

LATE_KEY = "late_steps"  # state[p][LATE_KEY]: its own warmup steps so far


class LateJoiners:
    """The late-joiner half of OnebitOptimizer."""

    def _warmup_length(self) -> int:
        raise NotImplementedError

    def _is_late(self, p: torch.Tensor) -> bool:
        st = self.state.get(p)
        return st is not None and st.get(LATE_KEY, self._warmup_length()) < self._warmup_length()

    def _mark_late(self) -> None:
        """Params that train now, once v froze, without ever having had state."""
        if not self._variance_frozen() or self._warmup_length() == 0:
            return
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad and "exp_avg_sq" not in self.state.get(p, {}):
                    self.state[p][LATE_KEY] = 0

    def _late(self, group) -> List[torch.Tensor]:
        return [p for p in group["params"] if p.requires_grad and self._is_late(p)]

    def _late_step(self, groups, grads) -> None:
        """One warmup step for each late param (grads: averaged already)."""
        for i, ((group, params), gs) in enumerate(zip(groups, grads)):
            if params:
                self._late_update(-1 - i, group, params, gs)
                for p in params:
                    self.state[p][LATE_KEY] += 1

    def _late_update(self, index: int, group, params, grads) -> None:
        """Adam, with bias corrections counted per param from its first step."""
        beta1, beta2 = group["betas"]
        self._clip_(grads, group["max_grad_norm"])
        for p, g in zip(params, grads):
            k = self.state[p][LATE_KEY] + 1
            m, v = self._state_tensor(p, "exp_avg"), self._state_tensor(p, "exp_avg_sq")
            F.update_momentum_([m], [g], beta1)
            F.update_variance_([v], [g], beta2)
            bc1, bc2 = self._bias_corrections(group, k, k)
            denom = F.denominators([v], group["eps"], group["eps_inside_sqrt"], bc2)
            F.adam_step_([p], [m], denom, group["lr"], group["weight_decay"], bc1)
