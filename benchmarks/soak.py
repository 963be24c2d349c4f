"""`python -m benchmarks.soak`: many steps on local ranks, memory watched.

Each rank trains a small MLP with every onebit optimizer in turn (warmup,
then compression from 20% of the steps) and samples its resident memory
(RSS) every 10 steps. Once each stage has run 50 steps (its buffers
allocated, the allocator warm), the trend -- mean RSS over the last third of
the samples minus the first third -- must stay within --slack-mb on every
rank. A leak grows with the number of steps; malloc's own jitter (a few MB
up and down on a 300 MB process) does not, and averaging keeps it out. The compression stage allocates once when it starts (error
buffers, the fused buffer, the frozen denominators); that is not growth.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Dict, List

import torch

from onebit.bench.table import int_arg
from onebit import launch

NAMES = ("OnebitAdam", "OnebitLamb", "ZeroOneAdam")


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def freeze_step(steps: int) -> int:
    return max(1, steps // 5)


def _optimizer(name: str, params, steps: int):
    import onebit

    f = freeze_step(steps)
    if name == "ZeroOneAdam":
        return onebit.ZeroOneAdam(params, lr=1e-3, var_freeze_step=f, local_step_scaler=max(1, steps // 10),
                                  local_step_clipper=4)
    return getattr(onebit, name)(params, lr=1e-3, freeze_step=f)


def soak(rank: int, world: int, steps: int) -> List[Dict]:
    out = []
    for name in NAMES:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 64))
        opt = _optimizer(name, model.parameters(), steps)
        g = torch.Generator().manual_seed(rank)
        samples = []
        for t in range(1, steps + 1):
            x, y = torch.randn(32, 256, generator=g), torch.randn(32, 64, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if t % 10 == 0:
                samples.append((t, rss_mb()))
        settled = [m for t, m in samples if t >= freeze_step(steps) + 50]
        third = max(1, len(settled) // 3)
        trend = sum(settled[-third:]) / third - sum(settled[:third]) / third
        out.append({"optimizer": name, "rank": rank, "steps": steps, "rss_settled_mb": settled[0],
                    "rss_end_mb": settled[-1], "max_growth_mb": max(settled) - settled[0],
                    "trend_mb": trend})
    return out


def run(args: argparse.Namespace) -> bool:
    per_rank = launch.spawn_local(soak, args.nproc, args.steps)
    print(f"# benchmarks.soak: ranks={args.nproc} steps={args.steps}, RSS from step "
          f"{freeze_step(args.steps) + 50} (compression stage + 50) to the end")
    print(f"#{'optimizer':>12} {'rank':>4} {'from(MB)':>9} {'end(MB)':>8} {'max+':>6} {'trend':>6}")
    rows = [r for rank_rows in per_rank for r in rank_rows]
    for r in sorted(rows, key=lambda r: (r["optimizer"], r["rank"])):
        print(f" {r['optimizer']:>12} {r['rank']:>4} {r['rss_settled_mb']:9.1f} {r['rss_end_mb']:8.1f} "
              f"{r['max_growth_mb']:6.2f} {r['trend_mb']:6.2f}")
    worst = max(r["trend_mb"] for r in rows)
    print(f"# worst trend (last third - first third): {worst:.2f} MB (slack {args.slack_mb} MB): "
          f"{'OK' if worst <= args.slack_mb else 'GROWING'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "soak", "config": vars(args), "results": rows}, f, indent=1)
    return worst <= args.slack_mb


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int_arg(1), default=2000)
    p.add_argument("--nproc", type=int_arg(1), default=4)
    p.add_argument("--slack-mb", type=float, default=4.0, help="allowed RSS trend once settled")
    p.add_argument("--json")


if __name__ == "__main__":
    import sys

    from onebit.bench.command import main

    sys.exit(main(sys.modules[__name__]))
