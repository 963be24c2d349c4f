"""OnebitAdam with overlap_backward (each bucket's params step while the
later buckets are on the wire) against the fused step without overlap and
the floor, without the drift of a shared machine.

Every setup lives in the same processes and they are timed in alternating
rounds, so a slow minute hits them all alike (`onebit.bench step` times one
setup after another). Setups: `floor` (torch.optim.Adam, no communication),
`per-bucket` (overlap_backward), `fused` (no overlap). The `after-last`
setup of docs/benchmarks.md (commit 49453ff) replaced a private method of the
optimizer; it is gone with that monkeypatch.
For the README's figure, on 4 shaped hosts:

  sudo OMP_NUM_THREADS=1 benchmarks/shaped_net.sh run 4 100mbit -- \\
      .venv/bin/python benchmarks/overlap_update.py
"""
import argparse
import time

import torch
import torch.distributed as dist

from onebit import launch
from onebit.bench.step import make_model

SETUPS = ("floor", "per-bucket", "fused")


def _build(name: str, a: dict):
    import onebit

    torch.manual_seed(0)  # the same model in every setup and on every rank
    model = make_model(a["params"], a["width"])
    if name == "floor":
        return model, torch.optim.Adam(model.parameters(), lr=1e-5)
    opt = onebit.OnebitAdam(model.parameters(), lr=1e-5, freeze_step=2,
                            overlap_backward=name != "fused")
    return model, opt


def measure(rank: int, world: int, a: dict) -> dict:
    gen = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(a["batch"], a["width"], generator=gen)
    y = torch.randn(a["batch"], a["width"], generator=gen)
    setups = {name: _build(name, a) for name in a["setups"]}

    def step(name: str) -> None:
        model, opt = setups[name]
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    for name in setups:  # onebit's warmup, then into the compression stage
        for _ in range(4):
            step(name)
    times = {name: [] for name in setups}
    for _ in range(a["rounds"]):
        for name in setups:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(a["steps"]):
                step(name)
            mine = torch.tensor([(time.perf_counter() - start) / a["steps"]], dtype=torch.float64)
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # a step waits for the slowest rank
            times[name].append(mine.item() * 1e3)
    if rank == 0:
        print(f"# ms per step, slowest rank, {a['rounds']} rounds of {a['steps']} steps, "
              f"{world} ranks")
        for name, ts in times.items():
            print(f"{name:>11s} mean {sum(ts) / len(ts):8.1f} best {min(ts):8.1f}  rounds "
                  + " ".join(f"{t:.0f}" for t in ts))
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int, default=25 * 2 ** 20)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="timed steps per setup and round")
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--nproc", type=int, default=4, help="local ranks when not launched")
    args = p.parse_args(argv)
    a = dict(vars(args), setups=args.setups.split(","))
    launch.run_everywhere(measure, args.nproc, a, backend="gloo")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
