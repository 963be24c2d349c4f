"""Params that no rank has a gradient for stay as they were.

torch's optimizers skip a param whose .grad is None: no momentum decay, no
weight decay, no move. The onebit optimizers exchange fused buffers in which
every param has its place, so a missing gradient counts as zero there: the
ranks' buffers must line up. A param that *no* rank has a gradient for (a
branch no rank used in this step: a frozen head, an expert nobody was routed
to) would then still move, through its momentum and weight decay.

So the ranks agree on those params before the step, one bit each in the
all-gather they already make (it is never decided per rank), and the step
puts back what it changed for them: the value, the per-param state it had
(state the step made for it stays: the layouts keep it), and this rank's
slices of the error-feedback buffers (blocks never mix tensors, so
nothing else was computed from them). A param with a gradient on some ranks
only is averaged with zeros from the others, as before.
"""
from __future__ import annotations

from typing import Callable, List

import torch

class UntouchedParams:
    """What a step must leave as it was, kept before the step and put back
    after it (in place: the state tensors keep their addresses, which the
    optimizer's cached lists and views hold)."""

    def __init__(self) -> None:
        self._put_back: List[Callable[[], None]] = []

    def keep_param(self, p: torch.Tensor, state: dict, leave=()) -> None:
        """Keep `p`'s value and `state`, but for the keys in `leave`: what
        the step sets for every param alike, gradient or not (0/1 Adam's
        last synced point)."""
        value = p.detach().clone()
        before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()
                  if k not in leave}

        def put_back() -> None:
            with torch.no_grad():
                p.copy_(value)
            # State this step made for it stays as made (zeros, with no
            # gradient): a param with state is not a late joiner (late.py).
            for k, v in before.items():
                now = state.get(k)
                if isinstance(v, torch.Tensor) and isinstance(now, torch.Tensor) \
                        and now.shape == v.shape:
                    now.copy_(v)
                else:
                    state[k] = v
        self._put_back.append(put_back)

    def keep(self, put_back: Callable[[], None]) -> None:
        """Anything else, as a function that puts it back."""
        self._put_back.append(put_back)

    def restore(self) -> None:
        for put_back in self._put_back:
            put_back()
