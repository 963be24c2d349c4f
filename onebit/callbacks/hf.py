"""Error feedback through the Hugging Face Trainer's checkpoints.

    trainer = Trainer(model, args, optimizers=(opt, None), train_dataset=data,
                      callbacks=[ErrorFeedbackCallback()])
    trainer.train(resume_from_checkpoint=True)

On each save, every rank's buffers go into `onebit_error_feedback.pt` in the
checkpoint folder (rank 0 writes it, next to the Trainer's `optimizer.pt`).
On a resume, after the Trainer has loaded the optimizer, each rank takes its
own entry back. See onebit/callbacks/__init__.py for the rules.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from transformers import TrainerCallback

from . import gather_error_feedback, onebit_optimizer, restore_error_feedback

FILE_NAME = "onebit_error_feedback.pt"


class ErrorFeedbackCallback(TrainerCallback):
    """resume_from: the checkpoint folder a resume loads, when it is not the
    one `resume_from_checkpoint=True` picks (`<output_dir>/checkpoint-<step>`,
    the step the Trainer resumes at)."""

    def __init__(self, resume_from: Optional[str] = None) -> None:
        self.resume_from = resume_from
        self.restored: Optional[bool] = None  # after a resume: whether the buffers came back

    def on_save(self, args, state, control, optimizer=None, **kwargs):
        opt = onebit_optimizer(optimizer)
        if opt is None:
            return
        states = gather_error_feedback(opt)  # every rank takes part
        if states is not None and args.should_save:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            os.makedirs(folder, exist_ok=True)
            torch.save(states, os.path.join(folder, FILE_NAME))

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        # The Trainer calls this after it loaded the optimizer's state_dict,
        # which reset the buffers.
        opt = onebit_optimizer(optimizer)
        if opt is None or state.global_step == 0:
            return
        folder = self.resume_from or os.path.join(args.output_dir,
                                                  f"checkpoint-{state.global_step}")
        path = os.path.join(folder, FILE_NAME)
        # No file (a checkpoint saved without this callback): the buffers
        # restart, and the optimizer warns at its next step.
        states = torch.load(path, weights_only=True) if os.path.isfile(path) else None
        self.restored = restore_error_feedback(opt, states)
