"""The error-feedback residual over a run, for the README: OnebitAdam on the
language model of `python -m benchmarks.lm`, frozen at a sound point (20%
of the steps) and at a bad one (2%, before the variance settles), with
rank 0's `comm_stats()["worker_error_norm"]` after every step and the
held-out loss. Writes docs/error_norm.png and prints the numbers.

  python -m benchmarks.error_norm [--steps 240]
"""
import argparse
import json
import sys

from benchmarks import lm


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--freezes", type=float, nargs="+", default=[0.02, 0.2])
    p.add_argument("--plot", default="docs/error_norm.png")
    p.add_argument("--json")


def run(args: argparse.Namespace) -> bool:
    parser = argparse.ArgumentParser()
    lm.add_arguments(parser)
    runs = {}
    for freeze in args.freezes:
        a = vars(parser.parse_args(["--steps", str(args.steps), "--batch", "8", "--every", "40",
                                    "--seeds", "0", "--freeze", str(freeze),
                                    "--only", "OnebitAdam"]))
        _, every = lm.compare({k: v for k, v in a.items() if k not in ("json", "plot")})
        run = next(r for r in every if r["optimizer"] == "OnebitAdam")
        runs[freeze] = run
        norms = dict(run["error_norms"])
        marks = [int(args.steps * f) for f in (0.25, 0.5, 1.0)]
        print(f"freeze {freeze:.0%}: held-out {run['final']:.4f}; worker error norm at steps "
              + ", ".join(f"{t}: {norms[t]:.3g}" for t in marks), flush=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    for freeze, run in runs.items():
        steps, norms = zip(*run["error_norms"])
        left.plot(steps, norms, label=f"freeze_step at {freeze:.0%}")
        right.plot(*zip(*run["curve"]), marker="o", label=f"freeze_step at {freeze:.0%}")
    left.set_xlabel("step")
    left.set_ylabel("worker error-feedback norm (rank 0)")
    left.set_yscale("log")
    right.set_xlabel("step")
    right.set_ylabel("held-out loss")
    for ax in (left, right):
        ax.legend(fontsize=8)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(k): v for k, v in runs.items()}, f)
    return True


if __name__ == "__main__":
    from onebit.bench.command import main

    sys.exit(main(sys.modules[__name__]))
