"""Error feedback through Lightning's checkpoints.

    trainer = lightning.Trainer(..., callbacks=[ErrorFeedbackCallback()])
    trainer.fit(module, ckpt_path="last")

On each save, every rank's buffers of every onebit optimizer of
`configure_optimizers` go into the checkpoint, under "onebit_error_feedback".
On a resume, each rank takes its own entry back once Lightning has loaded
the optimizers (at `on_train_start`). See onebit/callbacks/__init__.py for
the rules.
"""
from __future__ import annotations

from typing import Optional

from lightning.pytorch.callbacks import Callback

from . import CHECKPOINT_KEY, gather_error_feedback, onebit_optimizer, restore_error_feedback


class ErrorFeedbackCallback(Callback):
    def __init__(self) -> None:
        self._loaded: Optional[dict] = None  # from on_load_checkpoint until the optimizers are
        self.restored: Optional[bool] = None  # after a resume: whether every buffer came back

    def _onebit_optimizers(self, trainer) -> dict:
        found = {i: onebit_optimizer(o) for i, o in enumerate(trainer.optimizers)}
        return {i: o for i, o in found.items() if o is not None}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        # Lightning calls this on every rank and writes rank 0's dict.
        entries = {i: gather_error_feedback(o) for i, o in self._onebit_optimizers(trainer).items()}
        if entries and all(states is not None for states in entries.values()):
            checkpoint[CHECKPOINT_KEY] = entries

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        # Lightning loads the optimizers after this: they would reset the buffers.
        self._loaded = checkpoint.get(CHECKPOINT_KEY, {})

    def on_train_start(self, trainer, pl_module) -> None:
        if self._loaded is None:
            return
        done = [restore_error_feedback(o, self._loaded.get(i))
                for i, o in self._onebit_optimizers(trainer).items()]
        self.restored, self._loaded = all(done), None
