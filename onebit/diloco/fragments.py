"""Streaming DiLoCo's fragments: which parameters sync together, and when.

Streaming DiLoCo (Douillard et al., 2025) splits the model into F fragments
and syncs them at staggered inner steps, so each round sends 1/F of the
model and the link is busy all the time instead of in bursts. Fragment f
(0-based) starts its exchange after inner step (f + 1) * H // F of every
round of H steps, counted from the end of the warmup: with F = 1 that is
every H-th step, plain DiLoCo. Its outer step lands `delay` (tau) inner
steps later, the exchange running meanwhile (tau = 0: at once).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple


@dataclass(frozen=True)
class FragmentPlan:
    """The fragments (parameter indices, in order) and their schedule."""

    sync_every: int  # H
    delay: int  # tau: inner steps between a fragment's launch and its outer step
    members: List[List[int]]  # each fragment's parameter indices

    @classmethod
    def split(cls, sizes: Sequence[int], count: int, sync_every: int,
              delay: int) -> "FragmentPlan":
        """`count` fragments of consecutive parameters (of `sizes` elements),
        each about the same number of elements: each fragment in turn takes
        the next parameter, then more while their middle element stays within
        an equal share of what is left (the last takes the rest)."""
        if count > len(sizes):
            raise ValueError(f"DiLoCo: fragments={count} exceeds the {len(sizes)} synced "
                             "parameters: a fragment holds whole parameters")
        if count > sync_every:
            raise ValueError(f"DiLoCo: fragments={count} exceeds sync_every={sync_every}: "
                             "each fragment needs an inner step of its own in a round")
        if delay >= sync_every:
            raise ValueError(f"DiLoCo: overlap_steps={delay} must be below sync_every="
                             f"{sync_every}, so a fragment's outer step lands before its next "
                             "exchange starts")
        members: List[List[int]] = []
        i, left = 0, sum(sizes)
        for f in range(count):
            share = left / (count - f)
            take, size = [i], sizes[i]
            i += 1
            last_free = len(sizes) - (count - f - 1)  # leave a parameter for each later fragment
            while i < last_free and (f == count - 1 or size + sizes[i] / 2 <= share):
                take.append(i)
                size += sizes[i]
                i += 1
            members.append(take)
            left -= size
        return cls(sync_every, delay, members)

    @property
    def count(self) -> int:
        return len(self.members)

    def offset(self, fragment: int) -> int:
        """The inner step of each round (1..H) after which `fragment` launches."""
        return (fragment + 1) * self.sync_every // self.count

    def launching(self, past: int) -> List[int]:
        """The fragments whose exchange starts after inner step `past`
        (counted from the end of the warmup; none before the first round)."""
        return [f for f in range(self.count)
                if past >= self.offset(f) and (past - self.offset(f)) % self.sync_every == 0]

    def launches_after(self, past: int) -> Iterator[Tuple[int, int]]:
        """Every launch after inner step `past`, in schedule order, without
        end: (fragment, its inner step counted as `past` is)."""
        while True:
            past += 1
            for fragment in self.launching(past):
                yield fragment, past

    def landing(self, past: int) -> List[int]:
        """The fragments whose outer step lands after inner step `past`."""
        return self.launching(past - self.delay)

    def quiet_step(self) -> Optional[int]:
        """The first inner step of a round (0..H-1) after which no exchange
        is in flight in any round, or None when the exchanges cover every
        step. A run timed from one quiet step to another pays for the
        exchanges it launches and for nothing launched before it, as a
        long run does: the bench's timed rounds (bench/step.py) start there."""
        late = 2 * self.sync_every  # past the first round, where launches start up
        for step in range(self.sync_every):
            # in flight after `late + step`: launched within the last `delay` steps
            if not any(self.launching(late + step - back) for back in range(self.delay)):
                return step
        return None
