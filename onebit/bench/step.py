"""`python -m onebit.bench step`: the time of one training step, end to end.

Times forward, backward and step() of an MLP of about `--params` parameters,
`--batch` samples per rank, under any launcher (local ranks by default,
torchrun, mpirun, or ../shared/tools/shaped_net.sh for shaped links). In the
same run, as baselines:
  floor      the same model and torch.optim.Adam with no communication at
             all: what a step costs if the network were free;
  ddp+adam   DistributedDataParallel + torch.optim.Adam (fp32 gradients,
             bucketed and overlapped with backward by DDP);
then each onebit optimizer in its compression stage (the warmup and
`--untimed` more steps run first, untimed), used drop-in: step() exchanges
1-bit momentum itself; with `--overlap` (default both) 1-bit Adam and LAMB
also run with overlap_backward=True (rows `+overlap`), which starts each
bucket's exchange during backward. Times are the slowest rank's mean per
step. The floor is timed again after every setup, and each setup's `x floor`
is its time over the mean of the floors timed just before and just after it
(`floor ms`): on a shared machine the floor drifts by tens of percent within
a run, and a ratio against one floor timed first would carry that drift. The
last floor is the row `floor again` (its `x floor`: the drift over the run).
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Dict, List

import torch
import torch.distributed as dist

from .. import launch
from .table import Table, count_arg, int_arg

COLUMNS = [("setup", 19, "s"), ("ms/step", 10, ".1f"), ("x floor", 8, ".2f"),
           ("floor ms", 9, ".1f"), ("stage", 12, "s"), ("MB sent/step", 12, ".2f"), ("pieces", 6, "s")]
OPTIMIZERS = ("onebitadam", "zerooneadam", "onebitlamb")
FREEZE = 2  # warmup steps before the compression stage (each is a full-precision allreduce)
# A timing run, not a training recipe: two warmup steps give a poor variance
# estimate (1-bit Adam wants 15-25% of training), and at lr 1e-4 this deep MLP
# then diverges within ten steps; at 1e-5 every optimizer stays finite.
LR = 1e-5


def _model(params: int, width: int) -> torch.nn.Module:
    depth = max(1, round(params / (width * width + width)))
    layers: List[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


OVERLAP = "+overlap"  # the setup's name suffix for overlap_backward=True
OVERLAPPED = ("onebitadam", "onebitlamb")  # 0/1 Adam's syncs cannot start in backward
FLOOR, FLOOR_AGAIN = "floor", "floor again"


def _onebit(setup: str, params):
    import onebit

    name, overlap = setup.removesuffix(OVERLAP), setup.endswith(OVERLAP)
    kw = dict(lr=LR, overlap_backward=overlap)
    if name == "onebitadam":
        return onebit.OnebitAdam(params, freeze_step=FREEZE, **kw)
    if name == "zerooneadam":
        return onebit.ZeroOneAdam(params, var_freeze_step=FREEZE, **kw)
    return onebit.OnebitLamb(params, freeze_step=FREEZE, **kw)


def setups(optimizers: List[str], overlap: str) -> List[str]:
    """The rows after the baselines: each optimizer without overlap_backward
    and/or with it (`overlap`: off, on, both)."""
    out = []
    for name in optimizers:
        if overlap != "on" or name not in OVERLAPPED:
            out.append(name)
        if overlap != "off" and name in OVERLAPPED:
            out.append(name + OVERLAP)
    return out


def _time(rank: int, world: int, setup: str, a: dict) -> Dict:
    torch.manual_seed(0)  # the same model on every rank and in every setup
    model = _model(a["params"], a["width"])
    gen = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(a["batch"], a["width"], generator=gen)
    y = torch.randn(a["batch"], a["width"], generator=gen)
    net, opt = model, None
    if setup == FLOOR:
        opt = torch.optim.Adam(model.parameters(), lr=LR)
    elif setup == "ddp+adam":
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.Adam(model.parameters(), lr=LR)
    else:
        opt = _onebit(setup, model.parameters())

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()

    onebit = setup not in (FLOOR, "ddp+adam")
    untimed = a["untimed"] + (FREEZE if onebit else 0)
    for _ in range(untimed):
        step()
    stats = opt.comm_stats() if onebit else None
    sent_before = stats["total_bytes_sent"] if stats else 0
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(a["steps"]):
        step()
    mine = (time.perf_counter() - t0) / a["steps"]
    slowest = torch.tensor([mine], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    row = {"setup": setup, "seconds": slowest.item(), "stage": "", "bytes_sent": 0.0,
           "pieces": ""}
    if onebit:
        stats = opt.comm_stats()
        row["stage"] = stats["stage"]
        row["bytes_sent"] = (stats["total_bytes_sent"] - sent_before) / a["steps"]
        # The pipeline's piece count per fused buffer, as its tuner chose it
        # (backends/pipeline.py): one piece serialises compression and wire.
        chosen = getattr(getattr(opt.backend, "pipeline", None), "chosen", {})
        row["pieces"] = ",".join(str(c) for c in sorted(set(chosen.values())))
    elif setup == "ddp+adam":
        n = sum(p.numel() for p in model.parameters())
        row["stage"], row["bytes_sent"] = "fp32", 2 * (world - 1) * 4 * n / world
    return row


def measure(rank: int, world: int, a: dict) -> List[Dict]:
    table = Table(COLUMNS, quiet=rank != 0)
    if rank == 0:
        n = sum(p.numel() for p in _model(a["params"], a["width"]).parameters())
        print(f"# onebit.bench step: MLP {n / 1e6:.1f}M params (width {a['width']}), "
              f"batch={a['batch']}/rank, ranks={world}, threads/rank={torch.get_num_threads()}, "
              f"steps={a['steps']} after {a['untimed']} untimed (+{FREEZE} warmup for onebit)")
        table.header()
    def show(row: Dict, floor_seconds: float) -> None:
        row["floor_seconds"] = floor_seconds
        row["x_floor"] = row["seconds"] / floor_seconds
        rows.append(row)
        table.row(**{"setup": row["setup"], "ms/step": row["seconds"] * 1e3,
                     "x floor": row["x_floor"], "floor ms": floor_seconds * 1e3,
                     "stage": row["stage"], "MB sent/step": row["bytes_sent"] / 1e6,
                     "pieces": row["pieces"]})

    rows: List[Dict] = []
    floor = _time(rank, world, FLOOR, a)
    show(floor, floor["seconds"])
    for setup in ["ddp+adam"] + setups(a["optimizers"], a["overlap"]):
        row = _time(rank, world, setup, a)
        after = _time(rank, world, FLOOR, a)  # the floor again, right after it
        show(row, (floor["seconds"] + after["seconds"]) / 2)
        floor = after
    show(dict(floor, setup=FLOOR_AGAIN), rows[0]["seconds"])
    return rows


def run(args: argparse.Namespace) -> bool:
    a = dict(params=args.params, width=args.width, batch=args.batch, steps=args.steps,
             untimed=args.untimed, optimizers=args.optimizers.split(","), overlap=args.overlap)
    rank, rows = launch.run_everywhere(measure, args.nproc, a,
                                       backend=launch.local_backend(args.nproc))
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "step", "config": vars(args), "results": rows}, f, indent=1)
    return True


def check_arguments(args: argparse.Namespace) -> None:
    unknown = [o for o in args.optimizers.split(",") if o not in OPTIMIZERS]
    if unknown:
        raise ValueError(f"unknown optimizer(s) {unknown}; choose from {','.join(OPTIMIZERS)}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", type=count_arg, default="25M",
                   help="about this many parameters (25M = 25 * 2^20)")
    p.add_argument("--width", type=int_arg(8), default=2048, help="MLP width")
    p.add_argument("--batch", type=int_arg(1), default=16, help="samples per rank")
    p.add_argument("--steps", type=int_arg(1), default=10, help="timed steps per setup")
    p.add_argument("--untimed", type=int_arg(0), default=10,
                   help="untimed steps first (the onebit optimizers also run their warmup)")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma list")
    p.add_argument("--overlap", choices=("off", "on", "both"), default="both",
                   help="time 1-bit Adam and LAMB without and/or with overlap_backward=True "
                        "(rows named +overlap)")
    p.add_argument("--nproc", type=int_arg(1), default=4, help="local ranks when not launched")
    p.add_argument("--json", help="write results to this JSON file")
