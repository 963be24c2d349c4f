"""What to do with the error buffers when the replicas change (issue 69).

When a torchft quorum changes, the 1-bit exchange reopens on a group of
another size. The server errors are chunks laid out by world size (chunk k
is served by rank k): they cannot follow. The worker errors are one value
per element of the fused buffer, and their tensors start at the same
offsets at any world size (block-aligned; only the tail padding differs):
they could be kept. This measures, on the benchmark language model
(benchmarks/lm.py's TinyGPT), 4 gloo ranks, one rank leaving and rejoining
several times in the compression stage:

  none     no quorum change: the reference
  restart  every error buffer restarts from zero
  keep     the worker errors are kept, the server errors restart (what
           onebit.fault_tolerance does: feedback.state.carried_worker_errors)
  momentum as restart, and the momentum restarts too

A leaving rank idles; a joining one takes rank 0's params and optimizer
state, as torchft's healing gives it. Deterministic: the same data and
changes for every variant, so the held-out losses compare directly.

  python -m benchmarks.quorum_change --steps 300 --seeds 0 1 2
"""
import argparse
import warnings
import copy
import statistics

import torch
import torch.distributed as dist

import onebit
from onebit import launch
from onebit.feedback.state import carried_worker_errors

from .lm import TinyGPT, held_out_loss, load_tokens, lr_factor, sample_batch

VARIANTS = ("none", "restart", "keep", "momentum")


def _rebuilt(model, group, a, old, variant: str, joined: bool):
    """A new OnebitAdam on `group` carrying `old`'s state (the quorum change)."""
    opt = onebit.OnebitAdam(model.parameters(), lr=a["lr"], freeze_step=a["freeze"],
                            process_group=group)
    state, errors = old
    opt.momentum_restart = variant == "momentum"
    opt.load_state_dict(state)
    if variant == "keep" and errors is not None and not joined:  # as onebit.fault_tolerance
        carried = carried_worker_errors(errors, opt.error_feedback_state_dict())
        assert carried is not None and opt.load_error_feedback_state_dict(carried)
    return opt


def train(rank: int, world: int, variant: str, seed: int, a: dict) -> dict:
    warnings.filterwarnings("ignore", message=".*error-feedback buffers restarted.*")  # on purpose
    train_ids, held_ids, vocab = load_tokens(a["vocab"])
    torch.manual_seed(seed)
    model = TinyGPT(vocab, 64, 2, 4, a["context"])
    for p in model.parameters():
        dist.broadcast(p.data, 0)
    fewer = dist.new_group(list(range(world - 1)))  # the last rank gone
    changes = set() if variant == "none" else set(a["changes"])
    members, group = list(range(world)), None
    opt = onebit.OnebitAdam(model.parameters(), lr=a["lr"], freeze_step=a["freeze"])
    factor = lr_factor({**a, "schedule": "cosine", "warmup": 0.1})
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    held = sample_batch(held_ids, torch.Generator().manual_seed(7), 256, a["context"])
    for t in range(1, a["steps"] + 1):
        x = sample_batch(train_ids, gen, a["batch"], a["context"])  # every rank draws: same data
        if t in changes:
            leaving = len(members) == world
            member = rank in members
            old = None
            if member:
                old = (copy.deepcopy(opt.state_dict()),
                       copy.deepcopy(opt.error_feedback_state_dict()))
            # a joiner heals from rank 0: its params and optimizer state
            box = [old[0] if rank == 0 else None]
            dist.broadcast_object_list(box, 0)
            for p in model.parameters():
                dist.broadcast(p.data, 0)
            joined = not member
            members = list(range(world - 1)) if leaving else list(range(world))
            group = fewer if leaving else None
            if rank in members:
                opt = _rebuilt(model, group, a, (box[0], old[1] if old else None), variant,
                               joined)
        if rank not in members:
            continue
        for g in opt.param_groups:
            g["lr"] = a["lr"] * factor(t - 1)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, vocab),
                                                 x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
    return {"variant": variant, "seed": seed, "held_out": held_out_loss(model, held, vocab)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--changes", type=int, nargs="+", default=None,
                   help="steps at which the last rank leaves, then rejoins, alternately")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                   help="which to run (none, the reference, always runs first)")


def check_arguments(args: argparse.Namespace) -> None:
    if args.nproc < 3:
        raise ValueError("--nproc must be at least 3: a rank leaves, and two must remain")
    if args.changes is not None and (len(args.changes) % 2 or sorted(args.changes) != args.changes):
        raise ValueError("--changes: an even number of increasing steps (leave, rejoin, ...)")


def run(args: argparse.Namespace) -> bool:
    a = vars(args)
    steps = a["steps"]
    a.update(lr=2e-3, freeze=int(0.2 * steps), vocab=4096, context=32, batch=16)
    if a["changes"] is None:  # four leaves and four joins in the compression stage
        a["changes"] = [int(steps * f) for f in (0.3, 0.35, 0.45, 0.5, 0.6, 0.65, 0.75, 0.8)]
    print(f"# quorum change: TinyGPT d=64, {a['nproc']} gloo ranks, {steps} steps, freeze "
          f"{a['freeze']}, the last rank leaves/rejoins at {a['changes']}, seeds {a['seeds']}")
    print(f"{'variant':>9} {'held-out (mean)':>16} {'min':>7} {'max':>7}  vs none  "
          f"per seed (vs none, the same seed)")
    results = {}
    for variant in ["none"] + [v for v in a["variants"] if v != "none"]:
        runs = [launch.spawn_local(train, a["nproc"], variant, s, a, threads=1)[0]["held_out"]
                for s in a["seeds"]]
        results[variant] = runs
        base = statistics.mean(results["none"])
        mean = statistics.mean(runs)
        paired = " ".join(f"{(x / y - 1) * 100:+.2f}%" for x, y in zip(runs, results["none"]))
        print(f"{variant:>9} {mean:>16.4f} {min(runs):>7.4f} {max(runs):>7.4f}  "
              f"{(mean / base - 1) * 100:+.2f}%   {paired}", flush=True)
    return True


if __name__ == "__main__":
    import sys

    from onebit.bench.command import main

    sys.exit(main(sys.modules[__name__]))
