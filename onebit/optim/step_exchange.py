"""The 1-bit exchange of one optimizer step, as the step's maths sees it.

A stage that exchanges something (1-bit Adam's and LAMB's new momentum, 0/1
Adam's gradient or mean direction) makes two calls for each param group:

1. `inputs(out)`: where to write what it exchanges. The optimizer writes
   it there itself, with its own maths: no callback.
2. `parts(out, seen, masks)`: run the exchange and land the average in
   `out`, zeroed where v == 0 (the zero-variance guard's `seen` and
   `masks`, guards.py), yielding the positions that are ready. The step
   updates those params while the rest is still on the wire.

Behind the two calls sits whichever path the step took:

- buckets exchanged during backward (overlap.py): `inputs` is None, since
  backward wrote them, and `parts` yields a bucket as it lands;
- overlap_backward, but the exchange could not start in backward: the
  buckets' own buffers, exchanged now, in order;
- the group's fused buffer (feedback/exchange.py), one part;
- world size 1: `out` itself, nothing on the wire.

The input goes straight into the buffer that travels: no pass to write it
into the state first and another to copy it in.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Sequence

import torch

from ..feedback.exchange import ErrorFeedbackExchange, GroupKey
from .guards import copy_masked_, mask_unseen_
from .overlap import BackwardOverlap

Tensors = List[torch.Tensor]


class StepExchange:
    """One optimizer's compressed exchanges, per param group and step."""

    def __init__(self, exchange: ErrorFeedbackExchange, overlap: Optional[BackwardOverlap],
                 world_size: int) -> None:
        self.exchange = exchange
        self.overlap = overlap
        self.world_size = world_size
        self._written: Dict[int, Tensors] = {}  # group -> where `inputs` had the input written

    def group(self, index: int) -> "GroupExchange":
        """The two calls for param group `index`."""
        return GroupExchange(self, index)

    def inputs(self, index: int, out: Tensors) -> Optional[Tensors]:
        """Where group `index`'s exchange input goes, shaped like `out` (the
        group's trained params' order); None when backward wrote it."""
        if self.overlap is not None:
            return None if self.overlap.settled else self.overlap.inputs_now(index, out)
        written = self._written[index] = (
            out if self.world_size == 1 else self.exchange.prepare(GroupKey(index), out))
        return written

    def parts(self, index: int, out: Optional[Tensors], seen: Sequence[bool],
              masks: Sequence) -> Iterator[List[int]]:
        """Exchange what `inputs` took and land the average in `out`, zeroed
        where v == 0, yielding the positions ready in `out`. With `out`
        None the average stays where `inputs` put the input, unmasked."""
        if self.overlap is not None and self.overlap.settled:
            yield from self.overlap.collect(index, out, seen, masks)
            return
        if self.overlap is not None:
            yield from self.overlap.exchange_now(index, out, seen, masks)
            return
        written = self._written.pop(index)
        if self.world_size > 1:
            self.exchange.allreduce(GroupKey(index))
        if out is not None and self.world_size > 1:
            copy_masked_(out, written, masks, seen)
        elif out is not None:
            mask_unseen_(out, masks, seen)
        yield list(range(len(written)))

    def average_(self, index: int, out: Tensors, seen: Sequence[bool], masks: Sequence) -> None:
        """`parts`, all of them, before anything is updated."""
        for _ in self.parts(index, out, seen, masks):
            pass


class GroupExchange:
    """`StepExchange`'s calls for one param group, for the stage maths."""

    def __init__(self, step_exchange: StepExchange, index: int) -> None:
        self._step_exchange = step_exchange
        self.index = index

    def inputs(self, out: Tensors) -> Optional[Tensors]:
        return self._step_exchange.inputs(self.index, out)

    def parts(self, out: Optional[Tensors], seen: Sequence[bool],
              masks: Sequence) -> Iterator[List[int]]:
        return self._step_exchange.parts(self.index, out, seen, masks)

    def average_(self, out: Optional[Tensors], seen: Sequence[bool], masks: Sequence) -> None:
        self._step_exchange.average_(self.index, out, seen, masks)
