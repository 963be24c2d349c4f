"""The ranks' agreement on each DiLoCo round, in one all-gather.

Before a fragment's pseudo-gradients are averaged, every rank sends six
numbers: whether its Δ is finite, the exchange's number, whether it only
proposes the round from close(), the fragment, a digest of its frozen
params and one of the outer SGD's settings. A round is skipped on every
rank when one rank's Δ is not finite; ranks that disagree on anything else
raise a ValueError naming it, where they would otherwise pair different
exchanges or step their anchors apart.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from .. import collectives
from ..agreement import nonfinite_flag


class RoundAgreement:
    """Over `group` (the rounds' agreement group; None with one rank and no
    shards: nothing to agree on). `scheduled`: the outer lr is a schedule
    (for the error message)."""

    def __init__(self, group, needed: bool, comm_device: torch.device,
                 timeout_s, scheduled: bool) -> None:
        self.group, self.needed, self.comm_device = group, needed, comm_device
        self.timeout_s, self.scheduled = timeout_s, scheduled

    def check(self, number: int, fragment: int, deltas: List[torch.Tensor],
              closing: bool = False, frozen: Sequence[int] = (),
              outer: int = 0) -> Tuple[bool, bool]:
        """Whether any rank's pseudo-gradient is not finite, and whether
        every rank only proposes this exchange from `close()` (then nobody
        makes it); the same all-gather checks that every rank is at exchange
        `number`, of `fragment` (a sync() on one rank only pairs fragments),
        with the same params `frozen` (positions in the fragment) and the
        same `outer` settings (OuterLR.digest)."""
        flag = nonfinite_flag([deltas], self.comm_device)
        if not self.needed:
            return bool(flag), closing
        table = collectives.gather_numbers("DiLoCo: agreeing on the outer round",
                                           [flag, number, int(closing), fragment,
                                            collectives.stable_digest(list(frozen)), outer],
                                           torch.int64, self.group, self.timeout_s)
        self._refuse_disagreement(table, number, fragment, frozen)
        return any(row[0] for row in table), all(row[2] for row in table)

    def _refuse_disagreement(self, table, number: int, fragment: int,
                             frozen: Sequence[int]) -> None:
        numbers = [row[1] for row in table]
        if len(set(numbers)) > 1:
            raise ValueError(f"DiLoCo: ranks are at different outer exchanges {numbers}: they "
                             "must load the same checkpoint and take the same inner steps")
        fragments = [row[3] for row in table]
        if len(set(fragments)) > 1:
            raise ValueError(f"DiLoCo: ranks exchange different fragments {fragments} at outer "
                             f"exchange {number}: call sync() on every rank, after the same "
                             "inner step")
        if len({row[4] for row in table}) > 1:
            raise ValueError(f"DiLoCo: ranks freeze different synced params at outer exchange "
                             f"{number} (this rank: positions {list(frozen)} of fragment "
                             f"{fragment}): freeze and unfreeze layers on every rank, at the "
                             "same inner step")
        if len({row[5] for row in table}) > 1:
            scheduled = ("; under an outer_lr schedule, the lr this round lands with, read at "
                         "its landing step: the same schedule on every rank, and sync() after "
                         "the same inner step (a rank whose GradScaler skipped one is a step "
                         "behind: end with close())" if self.scheduled else "")
            raise ValueError(f"DiLoCo: ranks disagree on the outer optimizer's settings at outer "
                             f"exchange {number} (its param groups' lr, momentum...): set "
                             f"them on every rank alike{scheduled}")
