"""`python -m benchmarks.time_to_target`: what reaching a loss costs a user in
seconds, on this link, for each method of `benchmarks.lm`.

The target is the full-precision baseline's final held-out loss (DDP-style
fp32 averaging with torch.optim.Adam, the row `Adam`, mean over the seeds)
plus --target-pct. For each method and seed: the step at which its
held-out loss first reaches the target, interpolated linearly between the
evaluations (every --every steps), and the wall time the run had spent in
its steps by then (held-out evaluations left out), interpolated the same
way. A method that does not reach it in --steps steps is `never`. The
column `x fp16` is the fp16 hook's time over the method's: how many times
faster than DDP with torch's fp16_compress_hook, which is what a PyTorch
user runs for fewer bytes (its time the mean of its two rows, below).
`MB` is what each rank had sent by the target (benchmarks.lm's count,
warmups included) and `MB x fp16` the hook's over the method's: where the
wire is the whole step, time is bytes, so that is the most `x fp16` can
reach on any link. Every run is the same training as
`benchmarks.lm` with the same flags (the same bits on any link); only the
link changes its time.

Runs under benchmarks/shaped_net.sh, one rank per host, for a shaped link:

  sudo OMP_NUM_THREADS=1 benchmarks/shaped_net.sh run 4 100mbit -- \\
      .venv/bin/python -m benchmarks.time_to_target --steps 300 --every 10 --json ttt.json

or on local ranks over loopback without the wrapper. After a short untimed
run, Adam-fp16 runs first and again last (row `Adam-fp16 again`): the gap
between the two is the machine's drift over the run, against which the
other rows' differences are read. Rank 0's clock times the steps; every
step's collectives keep the ranks within one step of each other. Held-out
losses match `benchmarks.lm`'s at the same flags; its runs at other
evaluation intervals give the same bits, so its 3-seed curves check the
steps column.
"""
from __future__ import annotations

import argparse
import json
import math
from typing import Dict, List, Optional, Sequence, Tuple

from onebit import launch

from . import lm

BASELINE = "Adam"        # sets the target
AGAINST = "Adam-fp16"    # the row every time is compared with
METHODS = ["Adam", "PowerSGD-r4", "OnebitAdam", "ZeroOneAdam", "OnebitLamb", "Lamb"]
AGAIN = " again"
WARMUP_STEPS = 10


def steps_to_target(curve: Sequence[Tuple[int, float]], target: float) -> Optional[float]:
    """The step at which the piecewise-linear held-out loss curve through
    `curve` ((step, loss) pairs, in step order) first reaches `target`;
    None if it never does. Before the first evaluation nothing is known:
    a first point already at or below the target counts at its own step."""
    prev = None
    for step, loss in curve:
        if loss <= target:
            if prev is None:
                return float(step)
            (s0, l0) = prev
            return s0 + (step - s0) * (l0 - target) / (l0 - loss)
        prev = (step, loss)
    return None


def seconds_by(step_seconds: Sequence[float], step: float) -> float:
    """The wall time spent in steps 1..step, a fractional step counting its
    share of that step's time."""
    whole = int(math.floor(step))
    spent = sum(step_seconds[:whole])
    if step > whole:
        spent += (step - whole) * step_seconds[whole]
    return spent


def bytes_by(curve: Sequence[Tuple[int, float]], bytes_sent: Sequence[float],
             step: float) -> float:
    """What a rank had sent by `step`: `bytes_sent` is the count at each
    evaluation of `curve`, interpolated linearly from (0, 0) between them."""
    points = [(0, 0.0)] + [(s, b) for (s, _), b in zip(curve, bytes_sent)]
    for (s0, b0), (s1, b1) in zip(points, points[1:]):
        if step <= s1:
            return b0 + (b1 - b0) * (step - s0) / (s1 - s0)
    return points[-1][1]


def _mean_step(per_seed: List[Sequence[float]]) -> Optional[float]:
    """The seeds' mean of their mean step time; None where a seed has no steps."""
    if not all(per_seed):
        return None
    return sum(sum(p) / len(p) for p in per_seed) / len(per_seed)


def summarise(runs: List[Dict], target_pct: float, freeze_step: int = 0
              ) -> Tuple[float, List[Dict]]:
    """(target, rows): per method, in run order, the mean over its seeds of
    the steps and seconds to the target (None where a seed never reaches
    it), its mean seconds per step, over the steps up to `freeze_step` (the
    1-bit optimizers' full-precision warmup, PowerSGD's before it starts)
    and after, and the fp16 hook's time over its own."""
    by: Dict[str, List[Dict]] = {}
    for r in runs:
        by.setdefault(r["optimizer"], []).append(r)
    base = by[BASELINE]
    target = sum(r["final"] for r in base) / len(base) * (1 + target_pct / 100)
    rows = []
    for name, rs in by.items():
        steps = [steps_to_target(r["curve"], target) for r in rs]
        reached = all(s is not None for s in steps)
        seconds = [seconds_by(r["step_seconds"], s) for r, s in zip(rs, steps)] if reached else []
        sent = ([bytes_by(r["curve"], r["bytes_sent"], s) for r, s in zip(rs, steps)]
                if reached else [])
        rows.append({"method": name, "final": sum(r["final"] for r in rs) / len(rs),
                     "seconds_per_step": _mean_step([r["step_seconds"] for r in rs]),
                     "seconds_per_step_to_freeze": _mean_step(
                         [r["step_seconds"][:freeze_step] for r in rs]),
                     "seconds_per_step_after": _mean_step(
                         [r["step_seconds"][freeze_step:] for r in rs]),
                     "steps": sum(steps) / len(steps) if reached else None,
                     "seconds": sum(seconds) / len(seconds) if reached else None,
                     "megabytes": sum(sent) / len(sent) / 1e6 if reached else None})
    # The fp16 hook's time: the mean of its first and last rows, which
    # bracket every other row.
    hooks = [r["seconds"] for r in rows if r["method"] in (AGAINST, AGAINST + AGAIN)]
    against = sum(hooks) / len(hooks) if hooks and None not in hooks else None
    hook_mb = next((r["megabytes"] for r in rows if r["method"] == AGAINST), None)
    for row in rows:
        row["x_fp16"] = (against / row["seconds"] if against is not None and row["seconds"]
                         else None)
        # On a link slow enough that the wire is all of a step, time is bytes:
        # the hook's megabytes over the method's bound its x fp16 there.
        row["bytes_x_fp16"] = (hook_mb / row["megabytes"] if hook_mb and row["megabytes"]
                               else None)
    return target, rows


def _runs(rank: int, world: int, names: List[str], seeds: List[int], a: dict) -> List[Dict]:
    # Untimed first: a process's first steps pay for its start (allocations,
    # the first collectives' connections), which no row should carry.
    lm.train(rank, world, AGAINST, seeds[0], {**a, "steps": WARMUP_STEPS, "every": WARMUP_STEPS})
    out = []
    for seed in seeds:
        for name in names:
            run = lm.train(rank, world, name.removesuffix(AGAIN), seed, a)
            run["optimizer"], run["ranks"] = name, world
            out.append(run)
    return out


def run(args: argparse.Namespace) -> bool:
    a = {k: v for k, v in vars(args).items()
         if k not in ("json", "plot", "methods", "target_pct")}
    a["only"] = []
    names = [AGAINST] + [m for m in args.methods if m != AGAINST] + [AGAINST + AGAIN]
    rank, runs = launch.run_everywhere(_runs, args.nproc, names, args.seeds, a)
    if rank != 0:
        return True
    freeze_step = int(a["freeze"] * a["steps"])
    target, rows = summarise(runs, args.target_pct, freeze_step)
    print(f"# benchmarks.time_to_target: {lm.model_name(a)} d={a['dim']} layers={a['layers']}, "
          f"ranks={runs[0]['ranks']}, steps={a['steps']} freeze={a['freeze']:.0%} "
          f"every={a['every']} seeds={a['seeds']}; "
          f"target = {BASELINE}'s final held-out loss + {args.target_pct:g}% = {target:.4f}")
    print(f"# s/step: mean over all steps, over steps 1-{freeze_step} (the 1-bit optimizers' "
          "warmup, PowerSGD's full-precision start) and after")
    print(f"#{'method':>22} {'final':>8} {'s/step':>8} {'to frz':>8} {'after':>8} {'steps':>7} "
          f"{'seconds':>9} {'x fp16':>7} {'MB':>9} {'MB x fp16':>9}")
    for r in rows:
        reached = r["seconds"] is not None
        before = r["seconds_per_step_to_freeze"]
        print(f" {r['method']:>22} {r['final']:8.4f} {r['seconds_per_step']:8.4f} "
              f"{before if before is not None else float('nan'):8.4f} "
              f"{r['seconds_per_step_after']:8.4f} "
              f"{r['steps'] if reached else float('nan'):7.1f} "
              f"{r['seconds'] if reached else float('nan'):9.2f} "
              + (f"{r['x_fp16']:7.2f}" if r["x_fp16"] is not None
                 else f"{'never' if not reached else '-':>7}")
              + (f" {r['megabytes']:9.2f} {r['bytes_x_fp16']:9.2f}" if reached else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "time_to_target", "config": vars(args), "target": target,
                       "results": rows, "runs": runs}, f, indent=1)
    return True


def check_arguments(args: argparse.Namespace) -> None:
    lm.check_arguments(argparse.Namespace(**{**vars(args), "only": args.methods}))
    if BASELINE not in args.methods:
        raise ValueError(f"--methods must include {BASELINE}: its final loss sets the target")
    if args.target_pct < 0:
        raise ValueError(f"--target-pct must be at least 0, got {args.target_pct:g}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    lm.add_arguments(p)
    p.set_defaults(steps=300, seeds=[0])
    p.add_argument("--methods", nargs="+", default=METHODS,
                   choices=sorted({n for pair in lm.PAIRS for n in pair}),
                   help=f"methods besides {AGAINST} (which runs first and last)")
    p.add_argument("--target-pct", dest="target_pct", type=float, default=2.0,
                   help=f"the target: {BASELINE}'s final held-out loss plus this many percent")


if __name__ == "__main__":
    import sys

    from onebit.bench.command import main

    sys.exit(main(sys.modules[__name__]))
