"""Trainer callbacks that keep the error feedback through a trainer's own
checkpoints.

Trainers save `optimizer.state_dict()` from rank 0 and load it on every
rank. The error-feedback buffers differ on every rank, so they are not in
it: a resume through the trainer alone restarts them from zero, close to the
uninterrupted run but not bitwise equal. The callbacks gather every rank's
buffers into the checkpoint rank 0 writes, and give each rank its own back
after the trainer has loaded the optimizer:

- `onebit.callbacks.hf.ErrorFeedbackCallback` for the Hugging Face Trainer
  (a file next to the Trainer's `optimizer.pt`);
- `onebit.callbacks.lightning.ErrorFeedbackCallback` for Lightning (an entry
  of the `.ckpt`).

The rules are the optimizers' own (`load_error_feedback_state_dict`): at the
same world size the resume is bitwise identical; at another one the buffers
restart from zero.

This module holds what both share, for any object with the optimizers'
error-feedback methods (the three optimizers, DiLoCo).
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

CHECKPOINT_KEY = "onebit_error_feedback"


def onebit_optimizer(optimizer):
    """The onebit optimizer inside `optimizer` (Accelerate's and Lightning's
    wrappers keep it as `.optimizer`), or None when there is none."""
    seen = 0
    while optimizer is not None and seen < 8:
        if hasattr(optimizer, "error_feedback_state_dict"):
            return optimizer
        optimizer, seen = getattr(optimizer, "optimizer", None), seen + 1
    return None


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def _job_size() -> int:
    # The whole job, not the optimizer's process_group: on sharded params
    # that group holds one shard's replicas, and every shard's buffers must
    # reach the checkpoint.
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def gather_error_feedback(optimizer) -> Optional[List[dict]]:
    """Every rank's `error_feedback_state_dict()`, on CPU, in global rank
    order, on global rank 0 (None on the others). Every rank must call it,
    as trainers call their save hooks."""
    mine = _to_cpu(optimizer.error_feedback_state_dict())
    if _job_size() == 1:
        return [mine]
    out = [None] * _job_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, out, dst=0)
    return out


def restore_error_feedback(optimizer, states: Optional[List[dict]]) -> bool:
    """Load this rank's entry of what `gather_error_feedback` returned, after
    the trainer loaded the optimizer's state. False (the buffers restart from
    zero) when there is no entry for this rank or it does not fit here
    (another world size, step, shard or layout: the optimizer checks)."""
    rank = dist.get_rank() if _job_size() > 1 else 0
    if not states or rank >= len(states):
        return False
    return optimizer.load_error_feedback_state_dict(states[rank])
