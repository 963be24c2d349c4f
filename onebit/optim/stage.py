"""The stage of one optimizer step, as a value.

Each onebit optimizer is a small state machine: full precision, then 1 bit
(1-bit Adam and LAMB at `freeze_step`); variance updates, 1-bit gradients,
then local steps and syncs (0/1 Adam). The optimizer decides which stage
step t is in once, when step() starts (`stage_at(t)`), and every part of
the step reads the same answer: whether gradients are averaged in full
precision, whether v froze, how many updates v has had.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Stage:
    """What step `step` does."""

    step: int
    name: str  # in words, for comm_stats() and logs
    full_precision: bool  # its gradients are averaged in full precision
    compressed: bool  # it makes a 1-bit exchange (of gradients, momenta or displacements)
    variance_frozen: bool  # v froze before it: a param that first trains now is a late joiner
    variance_updates: int  # updates v has had once this step's is done (bias correction 2)
    variance_moves: bool  # v changes at every step (a warmup): nothing may be cached on it
    replicas_match: bool = True  # every rank holds the same params after it

    @property
    def variance_version(self) -> Optional[int]:
        """What names the current v for the caches built on it (denominators,
        zero-variance masks): None while v changes every step."""
        return None if self.variance_moves else self.variance_updates
