"""`python -m benchmarks.loss_per_byte --plot OUT.png RUN.json...`: held-out loss
against the bytes each rank has sent, from `benchmarks.lm --json` files.

Each run of each file is one curve: its held-out loss at every --every
steps, against the bytes the rank had sent by then (warmups included). A
file holds one sync_every, so pass one file per H; the label names the
optimizer, H for DiLoCo and SparseLoCo (" muon" over Muon; DeMo's lr),
and the outer lr (when a file's --outer-lr is not
the default, or when a later outer lr applies to the row: `lr=1.3>2@20%`
for 1.3, then 2.0 from 20% of the steps), and the freeze fraction for the
rows it moves (1-bit optimizers, PowerSGD) when a file's --freeze is not
the default.
Prints the curves' final points as a table (loss, MB per rank) too, then
the frontier: each label's final point
averaged over its seeds, marked where no other label reaches a lower loss
with no more bytes.
"""
from __future__ import annotations

import argparse
import json
from typing import List


DEFAULT_FREEZE = 0.2  # benchmarks.lm's --freeze
DEFAULT_OUTER_LR = 1.3  # benchmarks.lm's --outer-lr
DEFAULT_LATER_FROM = 0.2  # benchmarks.lm's --later-from
FULL_PRECISION_DILOCO = ("DiLoCo-bf16", "DiLoCo-fp32")  # take --later-outer-lr-full
NO_FREEZE = ("Adam", "Lamb", "Adam-fp16", "Adam-bf16")  # rows --freeze leaves alone


def curves(paths: List[str]) -> List[dict]:
    out = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        h = data["config"].get("sync_every")
        freeze = data["config"].get("freeze", DEFAULT_FREEZE)
        for run in data["runs"]:
            name = run["optimizer"]
            label = f"{name} H={h}{outer_lr_label(name, data['config'])}" \
                if name.startswith("DiLoCo") or name == "SparseLoCo" else name
            label += anchor_label(name, data["config"])
            if freeze != DEFAULT_FREEZE and not name.startswith("DiLoCo") and name not in NO_FREEZE:
                label = f"{name} freeze={freeze:.0%}"
            losses = [loss for _, loss in run["curve"]]
            out.append({"label": label, "seed": run["seed"], "losses": list(losses),
                        "megabytes": [b / 1e6 for b in run["bytes_sent"]]})
    return out


def anchor_label(name: str, config: dict) -> str:
    """' muon' for a DiLoCo row over Muon (--inner muon); DeMo's lr where
    --demo-lr set one."""
    if config.get("inner") == "muon" and (name.startswith("DiLoCo") or name == "SparseLoCo"):
        return " muon"
    if name == "DeMo" and config.get("demo_lr") is not None:
        return f" lr={config['demo_lr']:g}"
    return ""


def outer_lr_label(name: str, config: dict) -> str:
    """' lr=...' for a DiLoCo row whose outer lr is not the constant default:
    ' lr=1' (constant 1.0) or ' lr=1.3>2@20%' (a later lr from 20% on); the
    sparse row's --sparse-outer-lr and SparseLoCo's --sparseloco-lr (its
    published 1.0 unlabelled) as constants."""
    if name == "DiLoCo-sparse" and config.get("sparse_outer_lr") is not None:
        decay = config.get("error_decay") or 1.0
        return f" lr={config['sparse_outer_lr']:g}" + (f" decay={decay:g}" if decay != 1.0 else "")
    if name == "SparseLoCo":
        lr = config.get("sparseloco_lr", 1.0)
        return f" lr={lr:g}" if lr != 1.0 else ""
    outer_lr = config.get("outer_lr", DEFAULT_OUTER_LR)
    later = config.get("later_outer_lr_full" if name in FULL_PRECISION_DILOCO
                       else "later_outer_lr")
    if later is not None:
        return f" lr={outer_lr:g}>{later:g}@{config.get('later_from', DEFAULT_LATER_FROM):.0%}"
    return f" lr={outer_lr:g}" if outer_lr != DEFAULT_OUTER_LR else ""


def frontier(runs: List[dict]) -> List[dict]:
    """Each label's final point, the mean over its seeds, in bytes order,
    with `on_frontier`: no other label has a lower loss for no more bytes."""
    by: dict = {}
    for r in runs:
        by.setdefault(r["label"], []).append((r["losses"][-1], r["megabytes"][-1]))
    points = [{"label": label, "loss": sum(x for x, _ in v) / len(v),
               "megabytes": sum(m for _, m in v) / len(v)} for label, v in by.items()]
    for p in points:
        p["on_frontier"] = not any(q["megabytes"] <= p["megabytes"] and q["loss"] < p["loss"]
                                   for q in points if q is not p)
    return sorted(points, key=lambda p: (p["megabytes"], p["loss"]))


def mean_curves(runs: List[dict]) -> List[dict]:
    """One curve per label: its seeds' losses and bytes averaged point by
    point (a label's seeds share the evaluation steps)."""
    by: dict = {}
    for r in runs:
        by.setdefault(r["label"], []).append(r)
    out = []
    for label, rs in by.items():
        n = min(len(r["losses"]) for r in rs)
        out.append({"label": label,
                    "losses": [sum(r["losses"][i] for r in rs) / len(rs) for i in range(n)],
                    "megabytes": [sum(r["megabytes"][i] for r in rs) / len(rs) for i in range(n)]})
    return out


def plot(runs: List[dict], path: str) -> None:
    """Each label's mean curve; its final point a star where it is on the
    frontier, a hollow circle where another label beats it for the bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves_ = mean_curves(runs)
    columns = 1 + (len(curves_) - 1) // 30  # the legend's: 30 labels fit one
    fig, ax = plt.subplots(figsize=(8.5 + 3.0 * columns, 6.4))
    # one color per form, one line style per H: a form's curves read left to right
    forms = sorted({r["label"].split(" ")[0] for r in runs})
    colors = {form: plt.cm.tab20(i % 20) for i, form in enumerate(forms)}
    styles = {"H=2": ":", "H=4": ":", "H=8": ":", "H=16": "-", "H=32": "-.", "H=64": "--",
              "H=128": "--", "freeze=10%": "--", "freeze=5%": ":"}
    on = {p["label"]: p["on_frontier"] for p in frontier(runs)}
    for c in curves_:
        form, _, rest = c["label"].partition(" ")
        h = rest.split(" lr=")[0]  # (the outer lr does not change the style)
        ax.plot(c["megabytes"], c["losses"], styles.get(h, "-"), color=colors[form],
                linewidth=1.2, label=c["label"] + (" *" if on[c["label"]] else ""))
        ax.plot(c["megabytes"][-1:], c["losses"][-1:], "*" if on[c["label"]] else "o",
                color=colors[form], markersize=11 if on[c["label"]] else 6,
                markerfacecolor=colors[form] if on[c["label"]] else "none")
    ax.set_xscale("log")
    ax.set_xlabel("MB sent per rank (log)")
    ax.set_ylabel("held-out loss (mean over seeds)")
    ax.set_title("* on the frontier: no other method reaches a lower loss with no more bytes",
                 fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0),  # beside: no curve hidden
              ncol=columns)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args: argparse.Namespace) -> bool:
    runs = curves(args.runs)
    if args.plot:
        plot(runs, args.plot)
    w = max([22] + [len(r["label"]) for r in runs])
    print(f"{'run':>{w}} {'seed':>4} {'held-out':>9} {'MB/rank':>10}")
    for r in runs:
        print(f"{r['label']:>{w}} {r['seed']:>4} {r['losses'][-1]:9.4f} {r['megabytes'][-1]:10.3f}")
    print("# frontier: mean over seeds; * where no other reaches a lower loss with no more bytes")
    for p in frontier(runs):
        print(f"# {p['label']:>{w - 2}} {p['loss']:9.4f} {p['megabytes']:10.3f} "
              f"{'*' if p['on_frontier'] else ''}")
    return True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", help="benchmarks.lm --json files")
    p.add_argument("--plot", help="write the curves to this PNG")


if __name__ == "__main__":
    import sys

    from onebit.bench.command import main

    sys.exit(main(sys.modules[__name__]))
