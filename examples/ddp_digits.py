"""The same training, with the model wrapped in DistributedDataParallel.

The comm hook makes DDP allreduce gradients (once, bucketed) only on the
steps that need full precision, and send nothing in the compression stage,
where the optimizer exchanges 1-bit momentum instead:

  python examples/ddp_digits.py --nproc 4
  torchrun --nproc-per-node 4 examples/ddp_digits.py
"""
import argparse
import os
import sys

import torch

import onebit
from onebit import launch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from digits import load_digits_split  # noqa: E402
from train_digits import batches, evaluate, fit, make_model_and_groups  # noqa: E402


def train(rank, world, steps, freeze_step):
    xtr, ytr, xte, yte = load_digits_split()
    model, groups = make_model_and_groups(xtr)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = onebit.OnebitAdam(groups, lr=3e-3, freeze_step=freeze_step)
    ddp.register_comm_hook(opt.ddp_hook_state(), onebit.ddp_comm_hook)
    fit(ddp, opt, batches(xtr, ytr, rank, world, 32), steps, rank)
    return evaluate(model, xte, yte, rank, f"DDP + OnebitAdam on {world} ranks")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--freeze-step", type=int, default=60)
    p.add_argument("--nproc", type=int, default=4)
    args = p.parse_args(argv)
    launch.run_everywhere(train, args.nproc, args.steps, args.freeze_step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
