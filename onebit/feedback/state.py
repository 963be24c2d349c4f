"""This rank's error-feedback buffers in a checkpoint.

They differ on every rank, so `state_dict()` does not hold them: each rank
saves its own (`error_feedback_state_dict`), as a file of its own or as a
rank-named entry of a DCP checkpoint, with the identity they are valid for.
A resume whose buffers do not come back restarts them from zero, and says
so once (`ErrorFeedbackRestartNotice`).
"""
from __future__ import annotations

import ast
import warnings
from typing import Optional

import torch


# Before a layout in a saved entry: zeros a load left, not any buffer's errors.
UNRESTORED = "unrestored: "


def error_feedback_state(exchange, layouts: dict, device: torch.device, identity: dict,
                         restorable: bool = True) -> dict:
    """This rank's error buffers of `exchange` (an ErrorFeedbackExchange) for
    the fused buffers of `layouts`, with `identity`: what they are valid for
    (rank, world size, wire format, block size, step or round).
    `restorable` False: they are the zeros a load left in place of lost
    errors; the layouts say so, and no load restores them (the module's
    docstring)."""
    groups = exchange.errors_state(layouts, device)
    if not restorable:
        for entry in groups.values():
            entry["layout"] = UNRESTORED + entry["layout"]
    return {**identity, "groups": groups}


def restore_error_feedback(exchange, state: dict, layouts: dict, identity: dict) -> bool:
    """Load what `error_feedback_state` saved into `exchange` when it was
    saved under the same `identity` and the same buffer layouts (another
    backend layout or bucket plan gives buffers of other sizes and
    meanings); else the errors restart from zero. Returns whether it loaded."""
    same = all(state.get(k) == v for k, v in identity.items())
    same = same and exchange.layouts_match(state["groups"], layouts)
    exchange.load_errors(state["groups"] if same else None)
    return same


# What a world-size change leaves meaningful: each rank's worker error is one
# value per element of the fused buffer, whose tensors start at the same
# block-aligned offsets at any world size (only the tail padding differs);
# its server error is the chunk it served, laid out by world size.
_WORLD = ("rank", "world_size")


def carried_worker_errors(saved: dict, target: dict) -> Optional[dict]:
    """`target` (a fresh `error_feedback_state_dict()` of this rank at the
    new world size) with the worker errors of `saved` (this rank's, at the
    old one) where a fused buffer holds the same tensors in the same blocks;
    server errors zero. None when nothing can carry over: another wire,
    block size, code, shard or step, or no buffer in common. A replica
    group that changed size keeps what is still meaningful
    (onebit.fault_tolerance; measured in docs/benchmarks/fault_tolerance.md)."""
    if any(saved.get(k) != v for k, v in target.items() if k != "groups" and k not in _WORLD):
        return None
    groups, carried = {}, 0
    for name, entry in target["groups"].items():
        layout = entry["layout"].removeprefix(UNRESTORED)
        worker = torch.zeros_like(entry["worker"])
        old = saved["groups"].get(name)
        if old is not None and not old["layout"].startswith(UNRESTORED):
            _, block, sizes = ast.literal_eval(old["layout"])
            _, new_block, new_sizes = ast.literal_eval(layout)
            if (block, sizes) == (new_block, new_sizes):
                n = min(old["worker"].numel(), worker.numel())
                worker[:n] = old["worker"][:n]
                carried += 1
        groups[name] = {"layout": layout, "worker": worker,
                        "server": torch.zeros_like(entry["server"])}
    return {**target, "groups": groups} if carried else None


class ErrorFeedbackRestartNotice:
    """Warns once, at the first step after a `load_state_dict` that left
    error feedback at zero where the saved run had some: trainers and most
    scripts save `state_dict()` from rank 0 and load it on every rank, and
    the per-rank buffers then restart without a word. The warning waits for
    the step because the per-rank buffers are restored after
    `load_state_dict` (`load_error_feedback_state_dict`, or a trainer
    callback), and a restored run has nothing to warn about."""

    def __init__(self, owner: str, consequence: str = "") -> None:
        self.owner = owner
        self.consequence = consequence  # a sentence on what the owner does about it
        self.pending = self.warned = False

    def loaded(self, errors_lost: bool) -> None:
        self.pending = errors_lost

    def restored(self) -> None:
        self.pending = False

    def before_step(self) -> None:
        if not self.pending or self.warned:
            return
        self.pending, self.warned = False, True
        warnings.warn(
            f"{self.owner}: the error-feedback buffers restarted from zero after load_state_dict(). "
            "They differ on every rank, so state_dict() does not hold them: this resume is close "
            f"to the uninterrupted run, not bitwise equal.{self.consequence} To keep them, save "
            "error_feedback_state_dict() on every rank and load it with "
            "load_error_feedback_state_dict() after load_state_dict(), or add "
            "onebit.callbacks.hf.ErrorFeedbackCallback (Hugging Face Trainer) or "
            "onebit.callbacks.lightning.ErrorFeedbackCallback (Lightning) to the trainer; "
            "see docs/checkpoints.md", stacklevel=3)
