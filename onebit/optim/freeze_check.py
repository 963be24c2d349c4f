"""A warning when the variance is frozen before it has settled.

Frozen, v sets each coordinate's step for the rest of the run:
lr * m / (sqrt(v) + eps). A coordinate whose gradient was still near zero
when v froze keeps a near-zero denominator, and once its gradient grows
its step is thousands of times the lr. A freshly initialised transformer
has such coordinates: attention's query and key weights get almost no
gradient while attention is still uniform.

The rule and its threshold were measured on a small GPT-2 where 0/1 Adam
with var_freeze_step=8 diverged (docs/benchmarks.md, "Freezing the
variance too early"): Adam with v frozen there diverged too, with no
compression at all.
"""
from __future__ import annotations

import warnings
from typing import Sequence

import torch

# A coordinate is unsettled below this share of its tensor's mean variance:
# its frozen step is then about 1000x its tensor's typical one, or more.
TINY_SHARE = 1e-6
# Warn when more than this share of all coordinates is unsettled.
UNSETTLED_LIMIT = 1e-3


@torch.no_grad()
def unsettled_share(variances: Sequence[torch.Tensor]) -> float:
    """The share of all elements of `variances` (Adam's v, one tensor per
    param) below TINY_SHARE times their own tensor's mean: one host sync."""
    counts = [(v < TINY_SHARE * v.float().mean()).sum() for v in variances if v.numel()]
    total = sum(v.numel() for v in variances)
    if not counts or not total:
        return 0.0
    return float(torch.stack([c.to(counts[0].device) for c in counts]).sum()) / total


def warn_if_unsettled(owner: str, option: str, step: int,
                      variances: Sequence[torch.Tensor]) -> None:
    """A UserWarning at the freeze when more than UNSETTLED_LIMIT of the
    coordinates have a variance that has not settled (unsettled_share)."""
    share = unsettled_share(variances)
    if share > UNSETTLED_LIMIT:
        warnings.warn(
            f"{owner}: the variance froze after step {step} ({option}={step}) with {share:.2%} "
            f"of its coordinates below {TINY_SHARE:g} of their tensor's mean variance (more "
            f"than {UNSETTLED_LIMIT:.1%}): their gradients have barely started, and once they "
            f"grow those coordinates take steps far larger than the lr, which can make the "
            f"loss diverge. Freeze later ({option} at the end of the lr warmup, or where this "
            f"share has fallen below {UNSETTLED_LIMIT:.1%})", UserWarning, stacklevel=4)
