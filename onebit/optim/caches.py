"""What a step derives from v and keeps while v is frozen, per param group.

Once v stops changing, sqrt(v / bc2) + eps need not be recomputed each
step: that buffer (one fp32 copy of the group) is what makes the
compression stage cheaper than an Adam step. The zero-variance guard's
masks (guards.py) are kept alike. `GroupCaches` holds both, the scratch
buffers a step reuses, and reads each group's `exp_avg_mask`; the stage
maths then takes plain tensors from it.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from . import functional as F
from .capture import StaticBuffers
from .guards import Variances, ZeroVarianceGuard, resolved


class GroupCaches:
    """Keyed by group index (or a late joiner's group key). `shards`: the
    optimizer's ShardedParams (on shards, "seen" and the masks are decided
    for whole params)."""

    def __init__(self, shards) -> None:
        self.shards = shards
        self.zero_variance = ZeroVarianceGuard(shards.whole_sums if shards.sharded else None)
        self.static = StaticBuffers()
        self._denoms: Dict[object, tuple] = {}  # index -> (key, denominators)

    def clear(self) -> None:
        """Forget what was derived from v (v was put back, or the layout changed)."""
        self.zero_variance.clear()
        self._denoms.clear()

    def forget(self) -> None:
        """Forget everything, the static scratch buffers too (who trains
        changed: none of it fits the new set)."""
        self.clear()
        self.static.clear()

    def seen(self, index, group, exp_avg_sqs: Variances, version: Optional[int]):
        """The zero-variance guard's (seen, masks) for group `index` (see
        guards.py); `version` names v (a stage's `variance_version`: None
        while it changes every step). Where v changes every step and there
        is no weight decay, nothing can move an unseen element (its m is 0
        too), so nothing is checked. `exp_avg_sqs`: as for `denominators`."""
        if version is None and not group["weight_decay"]:
            n = len(resolved(exp_avg_sqs))
            return [True] * n, [None] * n
        return self.zero_variance.check(index, exp_avg_sqs, version)

    def denominators(self, index, group, exp_avg_sqs: Variances, bc2: float,
                     version: Optional[int]) -> List[torch.Tensor]:
        """sqrt(v / bc2) + eps, cached while v is frozen.

        `version` names the current v (None: v changes every step, no
        cache). `exp_avg_sqs`: the group's v, or a function giving it,
        called only when there is no cache to use (a bucket's input written
        during backward then costs in proportion to the bucket, not the
        group)."""
        if version is None:
            self._denoms.pop(index, None)
            v = resolved(exp_avg_sqs)
            return F.denominators(v, group["eps"], group["eps_inside_sqrt"], bc2,
                                  out=self.static.scratch("denominators", index, v))
        key = (version, group["eps"], group["eps_inside_sqrt"], bc2)
        cached = self._denoms.get(index)
        if cached is None or cached[0] != key:
            cached = self._denoms[index] = (key, F.denominators(
                resolved(exp_avg_sqs), group["eps"], group["eps_inside_sqrt"], bc2))
        return cached[1]

    def mask(self, group, params: List[torch.Tensor]) -> Optional[torch.Tensor]:
        """The group's exp_avg_mask on the device of `params` (moved there
        once), or None; on sharded params, the part this rank's shards take.
        DeepSpeed's semantics: 1-bit signs cannot represent exact zeros, so
        positions known to stay 0 are forced back to 0 after every
        compressed exchange (see `apply_mask_`)."""
        mask = group.get("exp_avg_mask")
        if mask is None or not params:
            return None
        device = params[0].device
        if mask.device != device:
            mask = group["exp_avg_mask"] = mask.to(device)
        return self.shards.local_mask(mask, group["params"])


def apply_mask_(tensors: List[torch.Tensor], mask: Optional[torch.Tensor]) -> None:
    """Multiply each tensor by a group's exp_avg_mask (None: nothing)."""
    if mask is None:
        return
    for t in tensors:
        t.mul_(mask if mask.device == t.device else mask.to(t.device))
