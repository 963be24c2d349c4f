"""`python -m onebit.bench step`: the time of one training step, end to end.

Times forward, backward and step() of an MLP of about `--params` parameters,
`--batch` samples per rank, under any launcher (local ranks by default,
torchrun, mpirun, or, from a checkout, benchmarks/shaped_net.sh for shaped links). In the
same run, as baselines:
  floor      the same model and torch.optim.Adam with no communication at
             all: what a step costs if the network were free;
  ddp+adam   DistributedDataParallel + torch.optim.Adam (fp32 gradients,
             bucketed and overlapped with backward by DDP; `--ddp off` leaves
             it out);
  ddp+fp16, ddp+powersgd  what a user picks instead for fewer bytes: DDP
             with torch's fp16_compress_hook, or its powerSGD_hook at rank
             4 (error feedback and warm start, compressing from the step
             the onebit rows' compression starts), with Adam (not on shards)
then each onebit optimizer in its compression stage (the warmup and
`--untimed` more steps run first, untimed), used drop-in: step() exchanges
1-bit momentum itself; with `--overlap` (default both) each optimizer
also run with overlap_backward=True (rows `+overlap`), which starts each
bucket's exchange during backward. `--optimizers diloco` adds DiLoCo over
the floor's Adam (`--diloco-compression`'s wire, 1-bit by default), an
outer round every `--sync-every` inner steps
(row `diloco`), and streaming (row `diloco+overlap`: `--fragments`
fragments, each exchange `--overlap-steps` inner steps behind); its timed
rounds are whole outer rounds from one quiet step of the schedule to the
next (a step after which no exchange is in flight: fragments.py), so a
timed round pays for the exchanges it launches, as a long run does, and
none runs into the floor's round. A schedule with no quiet step ends each
timed round by landing what is in flight (`drain`), which waits for an
exchange a long run would hide; column `tail` counts those exchanges
per timed round. Times are the slowest rank's mean per
step. The floor lives through the whole run and is timed in alternating
rounds with each setup (`--rounds` of `--steps` steps: floor, setup, floor,
setup, ..., floor), and each setup's `x floor` is its time over the mean of
the floor rounds around its own (`floor ms`): on a shared machine the floor
drifts by tens of percent within a run, and a ratio against a floor timed
minutes earlier would carry that drift. The first floor round is the row
`floor`, the last the row `floor again` (its `x floor`: the drift over the
run).

`--shards S`: sharded training on a (ranks / S nodes) x (S shards) mesh
(docs/sharding.md). Every model is under FSDP2 on the shard dim, each layer
then the whole: the floor is FSDP2 with Adam and nothing between nodes, the
baseline `hsdp+adam` is FSDP2 on both dims (its own fp32 all-reduce across
nodes), and the onebit rows average over the replicate group (no
overlap_backward: not built for shards). Under benchmarks/shaped_net.sh
with PER_HOST=S, a host is a node: only the replicate exchange crosses the
shaped link.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Dict, List

import torch
import torch.distributed as dist

from .. import collectives, launch
from ..accelerator import get_accelerator
from . import hooks
from .table import Table, count_arg, int_arg

COLUMNS = [("setup", 19, "s"), ("ms/step", 10, ".1f"), ("x floor", 8, ".2f"),
           ("floor ms", 9, ".1f"), ("stage", 12, "s"), ("MB sent/step", 12, ".2f"),
           ("pieces", 6, "s"), ("tail", 5, "s")]
OPTIMIZERS = ("onebitadam", "zerooneadam", "onebitlamb")
CHOICES = OPTIMIZERS + ("diloco",)
FREEZE = 2  # warmup steps before the compression stage (each is a full-precision allreduce)
# A timing run, not a training recipe: two warmup steps give a poor variance
# estimate (1-bit Adam wants 15-25% of training), and at lr 1e-4 this deep MLP
# then diverges within ten steps; at 1e-5 every optimizer stays finite.
LR = 1e-5


def make_model(params: int, width: int) -> torch.nn.Module:
    depth = max(1, round(params / (width * width + width)))
    layers: List[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


OVERLAP = "+overlap"  # the setup's name suffix for overlap_backward=True
FLOOR, FLOOR_AGAIN = "floor", "floor again"


def _onebit(setup: str, params, group=None):
    import onebit

    name, overlap = setup.removesuffix(OVERLAP), setup.endswith(OVERLAP)
    kw = dict(lr=LR, overlap_backward=overlap, process_group=group)
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
        if overlap != "on":
            out.append(name)
        if overlap != "off":
            out.append(name + OVERLAP)
    return out


BASELINES = ("ddp+adam", "hsdp+adam")  # the fp32 baseline, whole params or sharded
# What a user picks instead for fewer bytes: DDP with a comm hook (hooks.py), Adam.
HOOK_ROWS = {"ddp+fp16": "fp16", "ddp+powersgd": "powersgd"}
POWERSGD_RANK = 4


def _shard(model: torch.nn.Module, name: str, shards: int):
    """FSDP2 on the shard dim of a (ranks / shards) x shards mesh (HSDP, on
    both dims, for the hsdp+adam baseline); returns the replicate group,
    None for the floor (which talks to no other node)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = collectives.communication_device().type
    mesh = init_device_mesh(device, (dist.get_world_size() // shards, shards),
                            mesh_dim_names=("replicate", "shard"))
    on = mesh if name == "hsdp+adam" else mesh["shard"]
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=on)
    fully_shard(model, mesh=on)
    return None if name in (FLOOR,) + BASELINES else mesh.get_group("replicate")


class _Setup:
    """One setup's model, optimizer and training step, built the same way
    on every rank (the same initial model for every setup)."""

    def __init__(self, name: str, a: dict, x: torch.Tensor, y: torch.Tensor) -> None:
        torch.manual_seed(0)
        # On the group's device: an NCCL group takes no host tensors.
        self.name = name
        self.model = make_model(a["params"], a["width"]).to(collectives.communication_device())
        self.onebit = name not in (FLOOR,) + BASELINES + tuple(HOOK_ROWS)
        net = self.model
        group = None
        if a.get("shards"):
            group = _shard(self.model, name, a["shards"])
        elif name == "ddp+adam":
            net = torch.nn.parallel.DistributedDataParallel(self.model)
        elif name in HOOK_ROWS:  # PowerSGD compresses from the step the 1-bit rows do
            net = hooks.hooked(self.model, HOOK_ROWS[name], POWERSGD_RANK, start_iter=FREEZE)
        self.diloco = None
        if self.onebit and not name.startswith("diloco"):
            self.opt = _onebit(name, self.model.parameters(), group)
        else:
            self.opt = torch.optim.Adam(self.model.parameters(), lr=LR)
        if name.startswith("diloco"):
            import onebit

            streaming = name.endswith(OVERLAP)
            self.diloco = onebit.DiLoCo(
                self.model, self.opt, sync_every=a["sync_every"],
                fragments=a["fragments"] if streaming else 1,
                overlap_steps=a["overlap_steps"] if streaming else 0, process_group=group,
                compression=a["diloco_compression"])
        self.net, self.x, self.y = net, x, y
        self.tail: List[int] = []  # per timed round, the exchanges drain() waited for

    def stats(self) -> Dict:
        return (self.diloco or self.opt).comm_stats()

    def steps_per_round(self, steps: int) -> int:
        """DiLoCo's timed rounds: whole outer rounds (at least `steps`)."""
        if self.diloco is None:
            return steps
        return -(-steps // self.diloco.sync_every) * self.diloco.sync_every

    def untimed_steps(self, steps: int) -> int:
        """DiLoCo's untimed steps: whole outer rounds (at least `steps`),
        then on to the schedule's quiet step, where the timed rounds start."""
        if self.diloco is None:
            return steps
        return self.steps_per_round(steps) + (self.diloco.plan.quiet_step() or 0)

    def run(self, steps: int) -> float:
        """The slowest rank's mean seconds per step over `steps` steps."""
        sync = get_accelerator().synchronize  # device work is asynchronous: time to completion
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            self.opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(self.net(self.x), self.y).backward()
            self.opt.step()
        if self.diloco is not None:
            self.tail.append(self.diloco.exchanges_in_flight)
            self.diloco.drain()
        sync()
        slowest = torch.tensor([(time.perf_counter() - t0) / max(steps, 1)], dtype=torch.float64,
                               device=collectives.communication_device())
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return slowest.item()


def _interleaved(setup: _Setup, floor: _Setup, floor_before: float, a: dict) -> Dict:
    """`a["rounds"]` rounds of the setup's steps, each followed by a round
    of the floor's; the floor rounds (with `floor_before`) bracket every
    setup round, so both see the same minutes of this machine."""
    stats = setup.stats() if setup.onebit else None
    sent_before = stats["total_bytes_sent"] if stats else 0
    times, floors = [], [floor_before]
    steps = setup.steps_per_round(a["steps"])
    for _ in range(a["rounds"]):
        times.append(setup.run(steps))
        floors.append(floor.run(a["steps"]))
    row = {"setup": setup.name, "seconds": sum(times) / len(times),
           "floor_seconds": sum(floors) / len(floors), "last_floor": floors[-1],
           "stage": "", "bytes_sent": 0.0, "pieces": "", "tail": ""}
    if setup.diloco is not None:
        tail = setup.tail[-len(times):]
        row["tail"] = f"{sum(tail) / len(tail):g}"
    if setup.onebit:
        stats = setup.stats()
        row["stage"] = stats["stage"]
        row["bytes_sent"] = (stats["total_bytes_sent"] - sent_before) / (a["rounds"] * steps)
        # The pipeline's piece count per fused buffer, as its tuner chose it
        # (backends/pipeline.py): one piece serialises compression and wire.
        chosen = getattr(getattr((setup.diloco or setup.opt).backend, "pipeline", None),
                         "chosen", {})
        row["pieces"] = ",".join(str(c) for c in sorted(set(chosen.values())))
    elif setup.name in BASELINES:  # a ring all-reduce of what a rank holds, over its replicas
        world = dist.get_world_size() // (a.get("shards") or 1)
        n = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                for p in setup.model.parameters())
        row["stage"], row["bytes_sent"] = "fp32", 2 * (world - 1) * 4 * n / world
    elif setup.name in HOOK_ROWS:
        kind = HOOK_ROWS[setup.name]
        row["stage"] = "fp16" if kind == "fp16" else f"rank {POWERSGD_RANK}"
        row["bytes_sent"] = hooks.step_bytes(setup.model.parameters(), kind,
                                             dist.get_world_size(), POWERSGD_RANK)
    return row


def measure(rank: int, world: int, a: dict) -> List[Dict]:
    table = Table(COLUMNS, quiet=rank != 0)
    if rank == 0:
        n = sum(p.numel() for p in make_model(a["params"], a["width"]).parameters())
        print(f"# onebit.bench step: MLP {n / 1e6:.1f}M params (width {a['width']}), "
              f"batch={a['batch']}/rank, ranks={world}, threads/rank={torch.get_num_threads()}, "
              + (f"FSDP2 {world // a['shards']} nodes x {a['shards']} shards, "
                 if a.get("shards") else "")
              + f"{a['rounds']} rounds of {a['steps']} steps per setup, each round followed by "
              f"{a['steps']} floor steps, after {a['untimed']} untimed "
              f"(+{FREEZE} warmup steps for the onebit optimizers; DiLoCo's untimed steps "
              "are whole outer rounds, then up to the schedule's quiet step)")
        table.header()

    def show(row: Dict) -> None:
        row["x_floor"] = row["seconds"] / row["floor_seconds"]
        rows.append(row)
        table.row(**{"setup": row["setup"], "ms/step": row["seconds"] * 1e3,
                     "x floor": row["x_floor"], "floor ms": row["floor_seconds"] * 1e3,
                     "stage": row["stage"], "MB sent/step": row["bytes_sent"] / 1e6,
                     "pieces": row["pieces"], "tail": row["tail"]})

    gen = torch.Generator().manual_seed(1 + rank)
    device = collectives.communication_device()
    x = torch.randn(a["batch"], a["width"], generator=gen).to(device)
    y = torch.randn(a["batch"], a["width"], generator=gen).to(device)
    floor = _Setup(FLOOR, a, x, y)  # kept for the whole run: timed beside every setup
    floor.run(a["untimed"])
    rows: List[Dict] = []
    last = floor.run(a["steps"])
    first = {"setup": FLOOR, "seconds": last, "floor_seconds": last, "stage": "",
             "bytes_sent": 0.0, "pieces": "", "tail": ""}
    show(first)
    baselines = [BASELINES[bool(a.get("shards"))]] if a["ddp"] else []
    if a["ddp"] and not a.get("shards"):
        baselines += list(HOOK_ROWS)
    for name in baselines + setups(a["optimizers"], a["overlap"]):
        setup = _Setup(name, a, x, y)
        # DiLoCo has no freeze; PowerSGD starts compressing where the 1-bit rows do
        warmup = FREEZE if (setup.onebit or name in HOOK_ROWS) and setup.diloco is None else 0
        setup.run(setup.untimed_steps(a["untimed"] + warmup))
        row = _interleaved(setup, floor, last, a)
        last = row.pop("last_floor")
        show(row)
        if setup.diloco is not None:
            setup.diloco.close()
        del setup
    show(dict(first, setup=FLOOR_AGAIN, seconds=last))
    return rows


def run(args: argparse.Namespace) -> bool:
    a = dict(params=args.params, width=args.width, batch=args.batch, steps=args.steps,
             rounds=args.rounds, untimed=args.untimed, optimizers=args.optimizers.split(","),
             overlap=args.overlap, ddp=args.ddp == "on", sync_every=args.sync_every,
             fragments=args.fragments, overlap_steps=args.overlap_steps, shards=args.shards,
             diloco_compression=args.diloco_compression)
    rank, rows = launch.run_everywhere(measure, args.nproc, a,
                                       backend=launch.local_backend(args.nproc))
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "step", "config": vars(args), "results": rows}, f, indent=1)
    return True


def check_arguments(args: argparse.Namespace) -> None:
    if args.shards and args.overlap != "off":
        raise ValueError("--shards needs --overlap off: overlap_backward is not built for "
                         "FSDP2-sharded params yet")
    from ..accelerator import placement

    ranks = placement.world_size() if placement.world_size() > 1 else args.nproc
    if args.shards and ranks % args.shards:
        raise ValueError(f"--shards {args.shards} does not divide the {ranks} ranks into nodes "
                         "(the mesh is ranks / shards nodes x shards)")
    unknown = [o for o in args.optimizers.split(",") if o not in CHOICES]
    if unknown:
        raise ValueError(f"unknown optimizer(s) {unknown}; choose from {','.join(CHOICES)}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", type=count_arg, default="25M",
                   help="about this many parameters (25M = 25 * 2^20)")
    p.add_argument("--width", type=int_arg(8), default=2048, help="MLP width")
    p.add_argument("--batch", type=int_arg(1), default=16, help="samples per rank")
    p.add_argument("--steps", type=int_arg(1), default=4, help="timed steps per round")
    p.add_argument("--rounds", type=int_arg(1), default=3,
                   help="rounds per setup, each followed by a round of the floor")
    p.add_argument("--untimed", type=int_arg(0), default=10,
                   help="untimed steps first (the onebit optimizers also run their warmup)")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                   help=f"comma list of {','.join(CHOICES)}")
    p.add_argument("--overlap", choices=("off", "on", "both"), default="both",
                   help="time each optimizer without and/or with overlap_backward=True "
                        "(rows named +overlap)")
    p.add_argument("--ddp", choices=("on", "off"), default="on",
                   help="time the DDP baselines, fp32 and with the fp16 and PowerSGD hooks (off: only "
                        "the floor and the optimizers, "
                        "for runs on slow links, where DDP's steps take most of the time)")
    p.add_argument("--sync-every", dest="sync_every", type=int_arg(1), default=16,
                   help="diloco: inner steps per outer round (H)")
    p.add_argument("--fragments", type=int_arg(1), default=4,
                   help="diloco+overlap: fragments synced at staggered steps")
    p.add_argument("--diloco-compression", dest="diloco_compression", default="1bit",
                   choices=("1bit", "2bit", "sparse2bit"),
                   help="diloco: the outer gradients' wire (sparse2bit: at its defaults)")
    p.add_argument("--overlap-steps", dest="overlap_steps", type=int_arg(0), default=1,
                   help="diloco+overlap: inner steps each fragment's exchange runs behind")
    p.add_argument("--shards", type=int_arg(1), default=None,
                   help="FSDP2 shards per node (ranks / shards nodes; the module doc)")
    p.add_argument("--nproc", type=int_arg(1), default=4, help="local ranks when not launched")
    p.add_argument("--json", help="write results to this JSON file")
