"""PyTorch Lightning with a onebit optimizer: the onebit hook goes to
`DDPStrategy(ddp_comm_hook=..., ddp_comm_state=...)`, and the optimizer,
built in `configure_optimizers`, is handed to the hook's state there (the
strategy exists before the optimizer does).

Lightning registers a strategy's comm hook only on CUDA (ddp.py,
`_register_ddp_hooks`); elsewhere it drops it without a word and DDP
averages every step in full precision, which `--check` shows. So off CUDA
this module registers the hook itself in `on_train_start`, when the DDP
wrapper exists and before the first backward.

  python examples/lightning_digits.py --nproc 2    (Lightning starts the ranks)

The recipe is the lines marked `# onebit`. `--check` also counts the steps
whose gradients DDP had averaged (expected: every warmup step, no
compression step).
"""
import os
import sys

import torch

import onebit
from onebit.callbacks.lightning import ErrorFeedbackCallback
from onebit import launch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from digits import load_digits_split  # noqa: E402
from train_digits import AveragingCheck, make_model_and_groups, recipe_parser  # noqa: E402


def main(argv=None):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    args = recipe_parser(__doc__).parse_args(argv)

    xtr, ytr, xte, yte = load_digits_split()
    hook_state = onebit.OnebitHookState()  # onebit: the optimizer joins it below

    class Digits(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model, self.groups = make_model_and_groups(xtr)
            self.verify = None

        def training_step(self, batch, index):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.model(x), y)
            if self.global_rank == 0 and (self.global_step + 1) % 50 == 0:
                print(f"step {self.global_step + 1:5d}  loss {loss.item():.4f}", flush=True)
            return loss

        def configure_optimizers(self):
            opt = onebit.OnebitAdam(self.groups, lr=3e-3, freeze_step=args.freeze_step)
            hook_state.optimizer = opt  # onebit
            if args.check:
                self.verify = AveragingCheck(self.model, opt)
            return opt

        def on_train_start(self):
            strategy = self.trainer.strategy
            if args.hook and strategy.root_device.type != "cuda":  # onebit: off CUDA
                strategy.model.register_comm_hook(hook_state, onebit.ddp_comm_hook)

        def on_after_backward(self):
            if self.verify is not None:
                self.verify()

    data = torch.utils.data.TensorDataset(xtr, ytr)
    loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True, drop_last=True,
                                         generator=torch.Generator().manual_seed(0))
    hook = dict(ddp_comm_hook=onebit.ddp_comm_hook, ddp_comm_state=hook_state) if args.hook else {}
    strategy = DDPStrategy(process_group_backend="gloo", **hook)  # onebit: the hook
    trainer = L.Trainer(accelerator="cpu", devices=args.nproc, strategy=strategy,
                        max_steps=args.steps, logger=False, enable_checkpointing=False,
                        # onebit: every rank's error feedback in the checkpoints it
                        # writes (none here), so ckpt_path= resumes bit for bit
                        callbacks=[ErrorFeedbackCallback()],
                        enable_progress_bar=False, enable_model_summary=False)
    module = Digits()
    trainer.fit(module, loader)
    with torch.no_grad():
        acc = (module.model(xte).argmax(1) == yte).float().mean().item() * 100
    if trainer.global_rank == 0:
        if module.verify is not None:
            print(f"ddp check: {module.verify.report()}", flush=True)
        print(f"final: Lightning + OnebitAdam on {trainer.world_size} ranks, "
              f"test accuracy {acc:.2f}%", flush=True)
    # Lightning leaves its process group alive after fit. Left to interpreter
    # exit, gloo's threads can still hold work whose tensors need the GIL
    # while Python is being torn down: an abort ("terminate called without an
    # active exception") after a run that succeeded. Tear it down in order.
    launch.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
