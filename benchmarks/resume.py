"""`python -m benchmarks.resume`: resuming a 1-bit optimizer from a checkpoint
that cannot give back the error-feedback buffers (another world size, or a
checkpoint saved without them), against the run that never stopped.

For each optimizer and each `--moves` entry SAVED:RESUMED, on
benchmarks/lm.py's TinyGPT and corpus (its defaults unless given here), or
with `--model gpt2` on Hugging Face's GPT-2 (--dim, --layers, --heads,
--context) over the corpus's characters, the small GPT-2 of issue 46:
  1. an uninterrupted run on SAVED ranks, which also saves rank 0's params
     and `optimizer.state_dict()` at --save-at of the steps (the way
     trainers save: no per-rank error buffers);
  2. a run on RESUMED ranks that loads that checkpoint and trains to the
     end, its lr schedule continuing where the saved one stood.
Reported: the held-out loss every --every steps after the resume, its worst
excess over the uninterrupted run's at the same step (the spike), and the
excess at the end. SAVED == RESUMED is the plain "checkpoint without the
buffers" case.
"""
from __future__ import annotations

import argparse
import io
import itertools
import json
import math
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from onebit import launch
from onebit.bench.table import int_arg

from . import lm

NAMES = ["OnebitAdam", "OnebitLamb", "ZeroOneAdam"]
RESTART = {"on": [True], "off": [False], "both": [True, False]}  # --restart: momentum_restart


def _segment(rank: int, world: int, name: str, a: dict, start: Optional[bytes],
             first: int, save_at: Optional[int], restart: bool = True) -> Dict:
    """Steps first..a["steps"] of one run on `world` ranks, from the
    checkpoint `start` (None: from scratch). Returns rank 0's held-out curve
    and, at step `save_at`, its checkpoint."""
    train_ids, held_ids, vocab = lm.load_data(a)
    torch.manual_seed(a["seed"])
    model = lm.make_model(vocab, a)
    opt = lm.make_optimizer(name, model.parameters(), a)
    if start is not None:
        ckpt = torch.load(io.BytesIO(start), weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        opt.momentum_restart = restart
    else:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    factor = lm.lr_factor(a)
    base_lrs = [g["lr"] for g in opt.param_groups]
    # Each rank's batches depend on the step they start at, not on the world.
    gen = torch.Generator().manual_seed(1000 * a["seed"] + 7919 * first + rank)
    held = lm.sample_batch(held_ids, torch.Generator().manual_seed(7), a["eval_batch"], a["context"])
    curve, saved, finite = [], None, True
    for t in range(first, a["steps"] + 1):
        for g, lr in zip(opt.param_groups, base_lrs):
            g["lr"] = lr * factor(t - 1)
        x = lm.sample_batch(train_ids, gen, a["batch"], a["context"])
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, vocab),
                                                 x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        finite = finite and math.isfinite(loss.item())
        if t % a["every"] == 0 or t == a["steps"]:
            held_loss = lm.held_out_loss(model, held, vocab)
            curve.append((t, held_loss))
            finite = finite and math.isfinite(held_loss)
        if t == save_at and rank == 0:
            buf = io.BytesIO()
            for g, lr in zip(opt.param_groups, base_lrs):
                g["lr"] = lr  # the checkpoint holds the base lr, as a scheduler's would
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
            saved = buf.getvalue()
    return {"curve": curve, "saved": saved, "finite": finite}


def _run(world: int, name: str, a: dict, start=None, first=1, save_at=None, restart=True) -> Dict:
    return launch.spawn_local(_segment, world, name, a, start, first, save_at, restart,
                              threads=1)[0]


def measure(a: dict) -> List[Dict]:
    rows = []
    save_at = max(1, int(a["save_at"] * a["steps"]))
    moves = [tuple(int(w) for w in m.split(":")) for m in a["moves"]]
    for name in a["only"]:
        straight = {}
        for saved_on in sorted({s for s, _ in moves}):
            straight[saved_on] = _run(saved_on, name, a, save_at=save_at)
        for (saved_on, resumed_on), restart in itertools.product(moves, RESTART[a["restart"]]):
            ref = dict(straight[saved_on]["curve"])
            resumed = _run(resumed_on, name, a, start=straight[saved_on]["saved"],
                           first=save_at + 1, restart=restart)
            excess = [(t, (loss - ref[t]) / ref[t] * 100) for t, loss in resumed["curve"]]
            worst = max(excess, key=lambda e: e[1])
            rows.append({"optimizer": name, "saved_on": saved_on, "resumed_on": resumed_on,
                         "momentum_restart": restart, "save_at": save_at, "curve": resumed["curve"],
                         "uninterrupted": straight[saved_on]["curve"],
                         "worst_excess_pct": worst[1], "worst_at": worst[0],
                         "final_excess_pct": excess[-1][1],
                         "finite": resumed["finite"] and straight[saved_on]["finite"]})
    return rows


def run(args: argparse.Namespace) -> bool:
    a = {k: v for k, v in vars(args).items() if k != "json"}
    print(f"# benchmarks.resume: {lm.model_name(a)} "
          f"d={a['dim']} layers={a['layers']} steps={a['steps']} "
          f"freeze={a['freeze']:.0%} lr={a['lr']} schedule={a['schedule']} "
          f"saved at step {max(1, int(a['save_at'] * a['steps']))}, without error buffers; "
          f"seed={a['seed']}")
    print(f"#{'optimizer':>12} {'ranks':>6} {'restart':>7} {'worst%':>7} {'at':>5} {'end%':>6} finite  "
          "held-out after the resume (uninterrupted)")
    rows = measure(a)
    for r in rows:
        points = " ".join(f"{t}:{loss:.3f}({dict(r['uninterrupted'])[t]:.3f})"
                          for t, loss in r["curve"][:4])
        print(f" {r['optimizer']:>12} {r['saved_on']:>2}->{r['resumed_on']:<2} "
              f"{'on' if r['momentum_restart'] else 'off':>7} "
              f"{r['worst_excess_pct']:7.2f} {r['worst_at']:5d} {r['final_excess_pct']:6.2f} "
              f"{'yes' if r['finite'] else 'NO':>6}  {points}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "resume", "config": a, "results": rows}, f, indent=1)
    return all(r["finite"] for r in rows)


def check_arguments(args: argparse.Namespace) -> None:
    lm.check_arguments(args)
    if set(args.only) - set(NAMES):  # DiLoCo has its own resume tests
        raise ValueError(f"--only takes {NAMES}, got {args.only}")
    if not 0 < args.save_at < 1:
        raise ValueError(f"--save-at is a fraction of the steps in (0, 1), got {args.save_at:g}")
    for m in args.moves:
        parts = m.split(":")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--moves takes SAVED:RESUMED rank counts, got {m!r}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    lm.add_arguments(p)
    p.set_defaults(only=NAMES, nproc=2, seeds=[0])
    p.add_argument("--seed", type=int_arg(0), default=0)
    p.add_argument("--restart", choices=sorted(RESTART), default="both",
                   help="resume with the optimizers' momentum_restart on, off, or each")
    p.add_argument("--save-at", dest="save_at", type=float, default=0.5,
                   help="where the checkpoint is taken, fraction of the steps")
    p.add_argument("--moves", nargs="+", default=["2:1", "2:3", "4:2", "2:2"],
                   help="SAVED:RESUMED rank counts")


if __name__ == "__main__":
    import sys

    from onebit.bench.command import main

    sys.exit(main(sys.modules[__name__]))
