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

`MisuseGuard` runs both checks for DiLoCo, and a third: a param frozen when
DiLoCo was built that trains later would never be synced.
"""
from __future__ import annotations

import sys
from typing import Callable, List

import torch

DDP_MISUSE = ("DiLoCo: the model is wrapped in DistributedDataParallel, which all-reduces every "
              "gradient at every step, in full precision: DiLoCo would save nothing. DiLoCo's "
              "inner steps are local: pass the bare model, with no DDP wrapper")


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


class MisuseGuard:
    """DiLoCo's checks for misuse, from its construction or last load on.

    params: the synced params; frozen_when_built: the model's params that
    did not require grad then; has_forward: the model is an nn.Module (its
    first forward ends the setup); anchor_at_the_params: moves the anchors
    to the params (a fresh DiLoCo's answer to weights loaded after it)."""

    def __init__(self, params: List[torch.Tensor], frozen_when_built: List[torch.Tensor],
                 has_forward: bool, anchor_at_the_params: Callable[[], None]) -> None:
        self.writes = ParamWriteWatch(lambda: params)
        self._frozen_when_built, self._has_forward = frozen_when_built, has_forward
        self._anchor_at_the_params = anchor_at_the_params
        self._steps_at_start, self._armed = 0, False
        # Built, not loaded: weights written before the first forward (a
        # pretrained model loaded now, say) are where the first round starts.
        self._fresh = True

    def loaded(self, inner_steps: int) -> None:
        """After a load: the anchors are the checkpoint's, loaded params must
        not move them."""
        self._steps_at_start, self._armed, self._fresh = inner_steps, False, False
        self.writes.mark()

    def check_unfrozen(self) -> None:
        """Before each inner step: the rounds sync only the params that
        required grad when DiLoCo was built."""
        unfrozen = sum(p.requires_grad for p in self._frozen_when_built)
        if unfrozen:
            raise ValueError(
                f"DiLoCo: {unfrozen} param(s) frozen when DiLoCo was built now require grad; "
                "the rounds sync only the params that required grad then, so these would "
                "train on every rank apart. Nothing was stepped. Build DiLoCo with them "
                "trainable (a param no rank has a gradient for stays as it is), or build it "
                "again after unfreezing")

    def before_forward(self, model: torch.nn.Module, inner_steps: int) -> None:
        if ddp_in_call_stack(model):
            raise ValueError(DDP_MISUSE)
        self.check_writes("forward", inner_steps)

    def check_writes(self, where: str, inner_steps: int) -> None:
        """A ValueError when the params were written while DiLoCo has counted
        no inner step since it was built or loaded: another optimizer steps
        them. Writes before a model's first forward are setup (weights
        loaded after DiLoCo was built or after its state was loaded), taken
        as they are by the first forward or by a state_dict(), sync() or
        close() before it: on a fresh build the anchors follow them, so the
        first round starts from the loaded weights (load the same ones on
        every rank, as the construction's broadcast made the params)."""
        if inner_steps != self._steps_at_start:
            return
        if not self._armed and self._has_forward:
            if self.writes.moved() and self._fresh:
                self._anchor_at_the_params()
            self.writes.mark()
            self._armed = where == "forward"
            return
        if self.writes.moved():
            raise ValueError(
                f"DiLoCo ({where}): the params changed, but DiLoCo has counted no inner step since "
                "it was built: an optimizer it does not hook is stepping them (one built again "
                "after DiLoCo(...), say), so no round ever runs and the replicas drift apart. "
                "Build the inner optimizer once, pass it to DiLoCo, and step that one")
