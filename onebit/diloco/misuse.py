"""Two ways to misuse DiLoCo that would otherwise go silent.

- **A DDP wrapper around the model.** DiLoCo's inner steps are local; DDP
  would still all-reduce every gradient, every step, in full precision: the
  replicas stay identical and nothing is saved. `ddp_in_call_stack` finds a
  DistributedDataParallel whose module is DiLoCo's model among the frames
  that called its forward (a few frames, so it can run at every forward).
- **Another optimizer stepping the params.** An inner optimizer built again
  after `DiLoCo(...)` steps the params without DiLoCo's hooks: no rounds,
  and the replicas drift apart. `ParamWriteWatch` notices it from the
  params' version counters (every in-place write bumps them, for free):
  when they moved while DiLoCo counted no inner step, something else wrote
  them.
"""
from __future__ import annotations

import sys
from typing import Callable, List

import torch


def ddp_in_call_stack(model: torch.nn.Module, depth: int = 32) -> bool:
    """Whether a DistributedDataParallel wrapping `model` is among the
    `depth` frames above the caller (call it from a forward pre-hook)."""
    from torch.nn.parallel import DistributedDataParallel

    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        owner = frame.f_locals.get("self")
        if isinstance(owner, DistributedDataParallel) and owner.module is model:
            return True
        frame = frame.f_back
    return False


class ParamWriteWatch:
    """The params' version counters as of the last write DiLoCo knows of.

    `tensors` gives the tensors whose counters to read (local shards of
    sharded params: taken afresh each time). `mark()` after every write
    DiLoCo makes or counts (its construction, an inner step, a landing, a
    load); `moved()` says whether anything wrote them since."""

    def __init__(self, tensors: Callable[[], List[torch.Tensor]]) -> None:
        self._tensors = tensors
        self._versions: List[int] = []
        self.mark()

    def mark(self) -> None:
        self._versions = [t._version for t in self._tensors()]

    def moved(self) -> bool:
        return [t._version for t in self._tensors()] != self._versions
