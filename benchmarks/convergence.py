"""`python -m benchmarks.convergence`: 1-bit optimizers vs their baselines
on real data (scikit-learn's digits: 1797 8x8 images, 10 classes), on
--nproc local gloo ranks, an MLP 64-128(tanh)-10, the same seeds for every run.

Pairs (the bar: final training loss within 2%, or test accuracy within
1 point, after the same number of steps):
  OnebitAdam  vs torch.optim.Adam on the averaged gradient
  OnebitLamb  vs OnebitLamb that never leaves warmup (plain LAMB)
  ZeroOneAdam vs torch.optim.Adam
Adam's lr is --lr, LAMB's --lamb-lr (LAMB's best on this model: of 3e-3,
1e-2 and 3e-2, the last is past LAMB's own stability, 0.43 training loss and
89.7% test accuracy after 600 steps, where 1e-2 fits the training set).
The freeze point is --freeze (a fraction of --steps; 15-25% is advised).
"""
from __future__ import annotations

import argparse
import json
from typing import Dict, List

import torch
import torch.distributed as dist

from onebit.bench.table import int_arg
from onebit import launch

from examples.digits import load_digits_split

PAIRS = [("OnebitAdam", "Adam"), ("OnebitLamb", "Lamb"), ("ZeroOneAdam", "Adam")]


def _optimizer(name: str, params, steps: int, freeze: float, lr: float):
    import onebit

    f = max(1, int(freeze * steps))
    if name == "Adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "OnebitAdam":
        return onebit.OnebitAdam(params, lr=lr, freeze_step=f)
    if name == "ZeroOneAdam":
        # Local-step intervals grow 1, 2, 4 over the compression stage.
        return onebit.ZeroOneAdam(params, lr=lr, var_freeze_step=f, var_update_scaler=8,
                                  local_step_scaler=max(1, (steps - f) // 8), local_step_clipper=4)
    if name == "OnebitLamb":
        return onebit.OnebitLamb(params, lr=lr, freeze_step=f)
    if name == "Lamb":  # the same code, kept in warmup
        return onebit.OnebitLamb(params, lr=lr, freeze_step=10 * steps)
    raise ValueError(name)


def train(rank: int, world: int, name: str, steps: int, freeze: float, lr: float,
          batch: int = 32) -> Dict:
    """One run on this rank; returns loss curve and final metrics (rank 0's view)."""
    xtr, ytr, xte, yte = load_digits_split()
    torch.manual_seed(0)
    # tanh, not ReLU: a dead ReLU unit has v = 0 and would need a mask too.
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 10))
    for p in model.parameters():  # torch.optim.Adam does not broadcast: start equal anyway
        dist.broadcast(p.data, 0)
    # Pixels that are constant in every training image give their weights an
    # exactly zero gradient, so v = 0 there; 1-bit signs cannot say "zero",
    # and +-scale / (sqrt(0) + eps) would blow up. exp_avg_mask pins those
    # momenta to 0 -- the documented remedy (DeepSpeed uses it for BERT's
    # unused position embeddings).
    live = (xtr.abs().sum(0) > 0).float()
    first = model[0].weight
    groups = [{"params": [first], "exp_avg_mask": live.expand_as(first).clone()},
              {"params": [p for p in model.parameters() if p is not first]}]
    opt = _optimizer(name, groups, steps, freeze, lr)
    gen = torch.Generator().manual_seed(100 + rank)
    shard = torch.arange(rank, len(ytr), world)
    curve = []
    for t in range(steps):
        idx = shard[torch.randint(len(shard), (batch,), generator=gen)]
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
        loss.backward()
        if isinstance(opt, torch.optim.Adam):  # the baseline averages in full precision
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if t % max(1, steps // 20) == 0 or t == steps - 1:
            with torch.no_grad():
                curve.append(torch.nn.functional.cross_entropy(model(xtr), ytr).item())
    with torch.no_grad():
        acc = (model(xte).argmax(1) == yte).float().mean().item() * 100
    return {"optimizer": name, "final_loss": curve[-1], "accuracy": acc, "curve": curve}


def _all_runs(rank: int, world: int, runs: List, steps: int, freeze: float):
    return [train(rank, world, n, steps, freeze, lr) for n, lr in runs]


def compare(steps: int, freeze: float, nproc: int, lr: float = 3e-3,
            lamb_lr: float = 1e-2) -> List[Dict]:
    names = list(dict.fromkeys(n for pair in PAIRS for n in pair))
    plan = [(n, lamb_lr if n.endswith("Lamb") else lr) for n in names]
    runs = {r["optimizer"]: r for r in launch.spawn_local(_all_runs, nproc, plan, steps, freeze)[0]}
    rows = []
    for onebit_name, base_name in PAIRS:
        a, b = runs[onebit_name], runs[base_name]
        loss_gap = (a["final_loss"] - b["final_loss"]) / b["final_loss"] * 100
        acc_gap = a["accuracy"] - b["accuracy"]
        rows.append({"optimizer": onebit_name, "baseline": base_name, "loss": a["final_loss"],
                     "baseline_loss": b["final_loss"], "loss_gap_pct": loss_gap,
                     "accuracy": a["accuracy"], "baseline_accuracy": b["accuracy"],
                     "accuracy_gap": acc_gap, "ok": loss_gap <= 2.0 or acc_gap >= -1.0})
    return rows


def run(args: argparse.Namespace) -> bool:
    print(f"# benchmarks.convergence: digits MLP, ranks={args.nproc} steps={args.steps} "
          f"freeze={args.freeze:.0%} lr={args.lr} lamb_lr={args.lamb_lr}")
    print(f"#{'optimizer':>12} {'baseline':>11} {'loss':>8} {'base':>8} {'gap%':>6} "
          f"{'acc':>6} {'base':>6} {'gap':>5} ok")
    rows = compare(args.steps, args.freeze, args.nproc, args.lr, args.lamb_lr)
    for r in rows:
        print(f" {r['optimizer']:>12} {r['baseline']:>11} {r['loss']:8.4f} {r['baseline_loss']:8.4f} "
              f"{r['loss_gap_pct']:6.2f} {r['accuracy']:6.2f} {r['baseline_accuracy']:6.2f} "
              f"{r['accuracy_gap']:5.1f} {'yes' if r['ok'] else 'NO'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "convergence", "config": vars(args), "results": rows}, f, indent=1)
    return all(r["ok"] for r in rows)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int_arg(1), default=1000)
    p.add_argument("--freeze", type=float, default=0.2, help="freeze point, fraction of steps")
    p.add_argument("--nproc", type=int_arg(1), default=4)
    p.add_argument("--lr", type=float, default=3e-3, help="Adam's lr")
    p.add_argument("--lamb-lr", type=float, default=1e-2, help="LAMB's lr")
    p.add_argument("--json")


if __name__ == "__main__":
    import sys

    from onebit.bench.command import main

    sys.exit(main(sys.modules[__name__]))
