"""`python -m onebit.bench optim`: optimizer-step compute at world size 1.

Times one step() of each onebit optimizer, in its warmup and its
compression stage, against torch.optim.Adam(foreach=True) on the same
parameters in the same run. At world size 1 nothing is communicated, so
this is the cost of the step's maths alone.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Dict, List

import torch

from .table import Table


def _params(total: int, tensors: int) -> List[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    each = total // tensors
    ps = [torch.nn.Parameter(torch.randn(each, generator=g)) for _ in range(tensors)]
    for p in ps:
        p.grad = torch.randn(each, generator=g) * 1e-3
    return ps


def _time_steps(opt, iters: int) -> float:
    opt.step()  # state allocation happens here, outside the timing
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return min(times)  # the least-disturbed run: this machine is shared and noisy


def measure(total: int, tensors: int, iters: int) -> List[Dict]:
    import onebit

    cases = [
        ("torch.optim.Adam(foreach)", lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True)),
        ("OnebitAdam warmup", lambda ps: onebit.OnebitAdam(ps, freeze_step=10**9)),
        ("OnebitAdam compression", lambda ps: onebit.OnebitAdam(ps, freeze_step=0)),
        ("OnebitLamb warmup", lambda ps: onebit.OnebitLamb(ps, freeze_step=10**9)),
        ("OnebitLamb compression", lambda ps: onebit.OnebitLamb(ps, freeze_step=0)),
        ("ZeroOneAdam 1-bit steps", lambda ps: onebit.ZeroOneAdam(ps, var_freeze_step=10**9,
                                                                   var_update_scaler=1)),
        ("ZeroOneAdam local steps", lambda ps: onebit.ZeroOneAdam(ps, var_freeze_step=0,
                                                                   local_step_clipper=16)),
    ]
    rows, base = [], None
    for name, make in cases:
        t = _time_steps(make(_params(total, tensors)), iters)
        base = base or t
        rows.append({"optimizer": name, "params": total, "ms": t * 1e3, "vs_adam": t / base})
    return rows


def run(args: argparse.Namespace) -> bool:
    print(f"# onebit.bench optim: {args.params} params in {args.tensors} tensors, "
          f"threads={torch.get_num_threads()}, best of {args.iters} steps, world size 1")
    table = Table([("optimizer", 26, "s"), ("ms/step", 9, ".2f"), ("x Adam", 7, ".2f")])
    table.header()
    rows = measure(args.params, args.tensors, args.iters)
    for r in rows:
        table.row(optimizer=r["optimizer"], **{"ms/step": r["ms"], "x Adam": r["vs_adam"]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "optim", "config": vars(args), "results": rows}, f, indent=1)
    return True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", type=int, default=10_000_000)
    p.add_argument("--tensors", type=int, default=10)
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("--json")
