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

A param that trained all along but never had a nonzero gradient before v
froze (an expert no token reached, a head switched on later; .grad None,
or zeros) has state, and a v of 0 that holds it still once v froze (the
zero-variance guard, guards.py). It becomes a late joiner when it is first
used: a step after the freeze in which some rank has a nonzero gradient
for it finds its v still 0 everywhere; that step's gradient is spent (v of
0 holds it still), and its state becomes a late joiner's first (zeros), so
the next step starts its own warmup (base.py decides; the ranks agree on who had a nonzero gradient
in the all-gather every step makes already, untouched.py).
"""
from __future__ import annotations

from typing import List

import torch

from . import functional as F


LATE_KEY = "late_steps"  # state[p][LATE_KEY]: its own warmup steps so far
FROZEN, TRAINED, LATE = 0, 1, 2  # a param's code in a step (LateJoiners.codes)


def codes_fit(codes: List[List[int]], param_groups) -> bool:
    """Whether `codes` (LateJoiners.codes's) has a row per group and a code
    per param: a checkpoint's, or the last step's after groups were added,
    may not."""
    return len(codes) == len(param_groups) and all(
        len(row) == len(g["params"]) for row, g in zip(codes, param_groups))


class LateJoiners:
    """Which params are in their own warmup, decided from the optimizer's
    `state` (passed to each call: torch's load_state_dict replaces the
    dict). `warmup_length`: the optimizer's own warmup, in steps, set by
    its option `warmup_option` (named in errors)."""

    def __init__(self, warmup_length: int, warmup_option: str = "freeze_step") -> None:
        self.warmup_length = warmup_length
        self.warmup_option = warmup_option

    def is_late(self, state, p: torch.Tensor) -> bool:
        st = state.get(p)
        return st is not None and st.get(LATE_KEY, self.warmup_length) < self.warmup_length

    def codes(self, state, param_groups, variance_frozen: bool) -> List[List[int]]:
        """Each group's params as codes: FROZEN (no grad), TRAINED, or LATE.
        Once v froze, a param that trains now without ever having had state
        is marked late (its own warmup starts). One pass, one state lookup
        per param: a step over thousands of small tensors pays per tensor."""
        marking, warm = variance_frozen and self.warmup_length > 0, self.warmup_length
        # A step at lr 0 moves nothing: DCP takes one on a fresh optimizer to
        # make the state it loads into (a checkpoint with v, say).
        refusing = variance_frozen and not marking and any(
            float(g["lr"]) != 0 for g in param_groups)
        out = []
        for group in param_groups:
            row = []
            for p in group["params"]:
                if not p.requires_grad:
                    row.append(FROZEN)
                    continue
                st = state.get(p)
                if variance_frozen and (st is None or "exp_avg_sq" not in st):
                    if refusing:
                        self._refuse_no_warmup(p)
                    if marking:
                        st = state[p]
                        st[LATE_KEY] = 0
                row.append(LATE if st is not None and st.get(LATE_KEY, warm) < warm else TRAINED)
            out.append(row)
        return out

    def _refuse_no_warmup(self, p: torch.Tensor) -> None:
        # No warmup, no v: the 1-bit stage would hold it still for good
        # (guards.py), silently. The state is the same on every rank, so
        # every rank raises here, before anything changed.
        raise ValueError(
            f"{self.warmup_option}=0 leaves a param of shape {tuple(p.shape)} without a "
            "variance estimate for good: the 1-bit stage would never move it. Use "
            f"{self.warmup_option} >= 1, or load a checkpoint that holds exp_avg_sq for "
            "every trained param before the first step.")

    def params(self, state, group) -> List[torch.Tensor]:
        """Group `group`'s late joiners."""
        return [p for p in group["params"] if p.requires_grad and self.is_late(state, p)]

    @staticmethod
    def steps_done(state, p: torch.Tensor) -> int:
        """How many of its own warmup steps `p` has taken."""
        return state[p][LATE_KEY]

    @staticmethod
    def advance(state, params: List[torch.Tensor]) -> None:
        """One more warmup step taken by each of `params`."""
        for p in params:
            state[p][LATE_KEY] += 1



def late_adam_step_(params: List[torch.Tensor], grads: List[torch.Tensor],
                    exp_avgs: List[torch.Tensor], exp_avg_sqs: List[torch.Tensor],
                    steps: List[int], group: dict) -> None:
    """Late joiners' own warmup: Adam, one param at a time, its bias
    corrections counted from its own first step (`steps`, this one
    included), on `grads` averaged across ranks in full precision."""
    beta1, beta2 = group["betas"]
    for p, g, m, v, k in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        F.update_momentum_([m], [g], beta1)
        F.update_variance_([v], [g], beta2)
        bc1, bc2 = F.bias_corrections(group, k, k)
        denom = F.denominators([v], group["eps"], group["eps_inside_sqrt"], bc2)
        F.adam_step_([p], [m], denom, group["lr"], group["weight_decay"], bc1)
