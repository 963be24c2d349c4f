"""Train an MLP on scikit-learn's digits with the optimizer a JSON config names.

  python examples/train_digits.py --config examples/configs/onebit_adam.json          # 4 local ranks
  torchrun --nproc-per-node 4 examples/train_digits.py --config examples/configs/onebit_adam.json
  mpirun -n 4 python examples/train_digits.py --config examples/configs/onebit_adam.json

Swapping optimizers is one word in the config ("type": "Adam" -> "OneBitAdam").
"""
import argparse
import sys

import torch
import torch.distributed as dist

import onebit
from onebit import launch
from digits import load_digits_split


def make_model_and_groups(xtr):
    """The model and its param groups: pixels that never vary get an
    exp_avg_mask (1-bit signs cannot say "this momentum is zero")."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 10))
    first = model[0].weight
    live = (xtr.abs().sum(0) > 0).float().expand_as(first).clone()
    groups = [{"params": [first], "exp_avg_mask": live},
              {"params": [p for p in model.parameters() if p is not first]}]
    return model, groups


def batches(xtr, ytr, rank, world, batch, seed=0):
    shard = torch.arange(rank, len(ytr), world)
    g = torch.Generator().manual_seed(seed + rank)
    while True:
        idx = shard[torch.randint(len(shard), (batch,), generator=g)]
        yield xtr[idx], ytr[idx]


def fit(forward, opt, data, steps, rank, after_backward=None, backward=None):
    """The training loop the examples share; rank 0 prints the loss.
    `backward(loss)` replaces loss.backward() (Accelerate's)."""
    for step in range(1, steps + 1):
        x, y = next(data)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(forward(x), y)
        if backward is not None:
            backward(loss)
        else:
            loss.backward()
        if after_backward is not None:
            after_backward()
        opt.step()
        if rank == 0 and (step % 50 == 0 or step == steps):
            print(f"step {step:5d}  loss {loss.item():.4f}{_comm(opt)}", flush=True)


def _comm(opt) -> str:
    """The onebit optimizers' telemetry, in a few words (torch's have none)."""
    if not hasattr(opt, "comm_stats"):
        return ""
    s = opt.comm_stats()
    ratio = f"{s['compression_ratio']:.1f}x" if s["compression_ratio"] else "-"
    return (f"  [{s['stage']}: sent {s['bytes_sent']} B, {ratio} below fp32, "
            f"error norm {s['worker_error_norm']:.3g}]")


class AveragingCheck:
    """Counts, per stage, the steps whose gradients were already averaged
    across ranks when backward finished -- what DDP's own allreduce would
    leave. Each rank sees other data, so local gradients differ; with the
    onebit hook DDP averages them only where the optimizer needs full
    precision. Call it after backward, before step (one small all-gather)."""

    def __init__(self, model, opt) -> None:
        self.param = next(p for p in model.parameters() if p.requires_grad)
        self.opt = opt
        self.averaged = {}  # stage -> [steps averaged, steps seen]

    def __call__(self) -> None:
        import torch.distributed as dist

        g = self.param.grad.detach().reshape(-1).contiguous()
        every = [torch.empty_like(g) for _ in range(dist.get_world_size())]
        dist.all_gather(every, g)
        same = all(torch.equal(every[0], e) for e in every[1:])
        counts = self.averaged.setdefault(self.opt.stage(), [0, 0])
        counts[0] += int(same)
        counts[1] += 1

    def report(self) -> str:
        return ", ".join(f"{stage}: {a} of {n} steps averaged by DDP"
                         for stage, (a, n) in self.averaged.items())


def recipe_parser(description):
    """The trainer recipes' command line (accelerate_digits.py, lightning_digits.py)."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--freeze-step", type=int, default=60)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--check", action="store_true", help="count steps DDP averaged, per stage")
    p.add_argument("--without-hook", dest="hook", action="store_false",
                   help="leave the hook out, to see DDP average every step (the mistake)")
    return p


def evaluate(model, xte, yte, rank, label):
    """Test accuracy in percent; rank 0 prints the one `final:` line."""
    with torch.no_grad():
        acc = (model(xte).argmax(1) == yte).float().mean().item() * 100
    if rank == 0:
        print(f"final: {label}, test accuracy {acc:.2f}%", flush=True)
    return acc


def train(rank, world, config, steps, batch):
    xtr, ytr, xte, yte = load_digits_split()
    model, groups = make_model_and_groups(xtr)
    opt = onebit.build_optimizer(groups, config)
    average = None
    if not isinstance(opt, onebit.optim.OnebitOptimizer) and world > 1:
        # torch optimizers neither broadcast the start nor average gradients
        for p in model.parameters():
            dist.broadcast(p.data, 0)

        def average():
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
    fit(model, opt, batches(xtr, ytr, rank, world, batch), steps, rank, average)
    return evaluate(model, xte, yte, rank, f"{type(opt).__name__} on {world} ranks")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="DeepSpeed-style JSON with an optimizer section")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    p.add_argument("--nproc", type=int, default=4, help="local ranks when not under torchrun/mpirun")
    args = p.parse_args(argv)
    launch.run_everywhere(train, args.nproc, args.config, args.steps, args.batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
