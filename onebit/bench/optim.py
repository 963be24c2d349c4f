"""`python -m onebit.bench optim`: the cost of one optimizer step.

Times one step() of each onebit optimizer, in its warmup and its
compression stage, against torch's fastest Adam on the same parameters in
the same run: Adam(fused=True) (the `x Adam` baseline, the first row) and
AdamW(fused=True) where torch has a fused kernel for the device (the CPU
included, since torch 2.4), and Adam(foreach=True). At world size 1 (the default) nothing is
communicated, so this is the cost of the step's maths alone. With
`--nproc N` (or under torchrun/mpirun) every rank steps on its own
gradients and the time is the slowest rank's: the maths plus the exchange
(the full-precision allreduce in warmup, the 1-bit one after), while Adam
stays local, so the ratio is what a step costs over Adam's with the
gradient averaging paid by the optimizer.

`--tensors` sets how many tensors the parameters are split into: with
many small ones a step pays per tensor (launches, Python).
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Dict, List

import torch

from .. import collectives, launch
from .table import Table, int_arg


# Untimed steps first: state allocation and 0/1 Adam's sync interval growing
# to 16 happen outside the timing.
UNTIMED_STEPS = 8


def _params(total: int, tensors: int, device: str, rank: int = 0) -> List[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    each = total // tensors
    ps = [torch.nn.Parameter(torch.randn(each, generator=g).to(device)) for _ in range(tensors)]
    g.manual_seed(1 + rank)  # each rank's own gradients
    for p in ps:
        p.grad = (torch.randn(each, generator=g) * 1e-3).to(device)
    return ps


def _time_steps(opt, iters: int, world: int) -> float:
    import torch.distributed as dist

    from ..accelerator import get_accelerator

    sync = get_accelerator().synchronize  # device work is asynchronous: time to completion
    for _ in range(UNTIMED_STEPS):
        opt.step()
    times = []
    for _ in range(iters):
        if world > 1:
            dist.barrier()  # every rank starts the step together
        sync()
        t0 = time.perf_counter()
        opt.step()
        sync()
        times.append(time.perf_counter() - t0)
    if world > 1:  # each step's slowest rank
        slowest = torch.tensor(times, dtype=torch.float64, device=collectives.communication_device())
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        times = slowest.tolist()
    return min(times)  # the least-disturbed run: this machine is shared and noisy


def has_fused_adam(device: str) -> bool:
    """Whether this torch has a fused Adam kernel for `device`."""
    p = torch.nn.Parameter(torch.zeros(2, device=device))
    p.grad = torch.zeros_like(p)
    try:
        torch.optim.Adam([p], fused=True).step()
    except (RuntimeError, ValueError):
        return False
    return True


def measure(total: int, tensors: int, iters: int, device: str = "cpu", rank: int = 0,
            world: int = 1) -> List[Dict]:
    import onebit

    # One warmup step before each compression stage, so v is non-zero (a
    # v of 0 is never moved: see onebit.optim.guards). local_step_scaler=1:
    # 0/1 Adam's sync interval doubles every step up to 16, so the timed
    # steps are mostly local steps; with its defaults every step is a sync
    # (interval 1 for the first 32678). The best of `iters` steps is reported.
    local = dict(var_freeze_step=1, local_step_scaler=1, local_step_clipper=16)
    fused = [("torch.optim.Adam(fused)", lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True)),
             ("torch.optim.AdamW(fused)", lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True))]
    cases = (fused if has_fused_adam(device) else []) + [
        ("torch.optim.Adam(foreach)", lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True)),
        ("OnebitAdam warmup", lambda ps: onebit.OnebitAdam(ps, freeze_step=10**9)),
        ("OnebitAdam compression", lambda ps: onebit.OnebitAdam(ps, freeze_step=1)),
        ("OnebitLamb warmup", lambda ps: onebit.OnebitLamb(ps, freeze_step=10**9)),
        ("OnebitLamb compression", lambda ps: onebit.OnebitLamb(ps, freeze_step=1)),
        ("  trust_ratio=frozen", lambda ps: onebit.OnebitLamb(ps, freeze_step=1, trust_ratio="frozen")),
        ("ZeroOneAdam 1-bit steps", lambda ps: onebit.ZeroOneAdam(ps, var_freeze_step=10**9,
                                                                   var_update_scaler=1)),
        ("ZeroOneAdam syncs", lambda ps: onebit.ZeroOneAdam(ps, var_freeze_step=1)),
        ("ZeroOneAdam local steps", lambda ps: onebit.ZeroOneAdam(ps, **local)),
    ]
    rows, base = [], None
    for name, make in cases:
        t = _time_steps(make(_params(total, tensors, device, rank)), iters, world)
        base = base or t
        rows.append({"optimizer": name, "params": total, "ms": t * 1e3, "vs_adam": t / base})
    return rows


def _on_rank(rank: int, world: int, a: dict) -> List[Dict]:
    from ..accelerator import get_accelerator

    device = a["device"] or get_accelerator().device_name()
    if world > 1 and device != "cpu":  # one device per rank
        device = f"{device}:{rank % get_accelerator().device_count()}"
    if rank == 0:
        print(f"# onebit.bench optim: {a['params']} params in {a['tensors']} tensors on {device}, "
              f"threads={torch.get_num_threads()}, best of {a['iters']} steps, world size {world}"
              + (" (the slowest rank)" if world > 1 else ""), flush=True)
    return measure(a["params"], a["tensors"], a["iters"], device, rank, world)


def run(args: argparse.Namespace) -> bool:
    a = dict(params=args.params, tensors=args.tensors, iters=args.iters, device=args.device)
    if args.nproc == 1 and not launch.launched_externally():
        rank, rows = 0, _on_rank(0, 1, a)
    else:
        rank, rows = launch.run_everywhere(_on_rank, args.nproc, a,
                                           backend=launch.local_backend(args.nproc))
    if rank != 0:
        return True
    table = Table([("optimizer", 26, "s"), ("ms/step", 9, ".2f"), ("x Adam", 7, ".2f")])
    table.header()
    for r in rows:
        table.row(optimizer=r["optimizer"], **{"ms/step": r["ms"], "x Adam": r["vs_adam"]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "optim", "config": vars(args), "results": rows}, f, indent=1)
    return True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", type=int_arg(1), default=10_000_000)
    p.add_argument("--tensors", type=int_arg(1), default=10)
    p.add_argument("-n", "--iters", type=int_arg(1), default=20)
    p.add_argument("--device", help="where the parameters live (default: the accelerator's device)")
    p.add_argument("--nproc", type=int_arg(1), default=1,
                   help="local ranks, each stepping on its own gradients (default 1: no exchange)")
    p.add_argument("--json")
