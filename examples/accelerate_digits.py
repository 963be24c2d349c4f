"""Hugging Face Accelerate with a onebit optimizer: `accelerator.prepare(...)`
wraps the model in DistributedDataParallel; register the onebit hook on that
wrapper, so DDP averages gradients only where the optimizer needs full
precision and sends nothing once 1-bit compression starts:

  python examples/accelerate_digits.py --nproc 2           (local ranks)
  torchrun --nproc-per-node 2 examples/accelerate_digits.py
  accelerate launch --num_processes 2 examples/accelerate_digits.py

The recipe is the three lines marked `# onebit`. `--check` also counts the
steps whose gradients DDP had averaged (expected: every warmup step, no
compression step).
"""
import os
import sys

import torch

import onebit
from onebit import launch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from digits import load_digits_split  # noqa: E402
from train_digits import (AveragingCheck, batches, evaluate, fit,  # noqa: E402
                          make_model_and_groups, recipe_parser)


def train(rank, world, steps, freeze_step, check, hook=True):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    xtr, ytr, xte, yte = load_digits_split()
    model, groups = make_model_and_groups(xtr)
    opt = onebit.OnebitAdam(groups, lr=3e-3, freeze_step=freeze_step)  # onebit
    ddp, prepared = accelerator.prepare(model, opt)
    if hook:
        ddp.register_comm_hook(opt.ddp_hook_state(), onebit.ddp_comm_hook)  # onebit
    verify = AveragingCheck(model, opt) if check else None
    fit(ddp, prepared, batches(xtr, ytr, rank, world, 32), steps, rank, after_backward=verify,
        backward=accelerator.backward)
    if verify is not None and rank == 0:
        print(f"ddp check: {verify.report()}", flush=True)
    return evaluate(model, xte, yte, rank, f"Accelerate + OnebitAdam on {world} ranks")


def main(argv=None):
    args = recipe_parser(__doc__).parse_args(argv)
    launch.run_everywhere(train, args.nproc, args.steps, args.freeze_step, args.check, args.hook)
    return 0


if __name__ == "__main__":
    sys.exit(main())
