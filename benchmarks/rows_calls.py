"""One kernel call for every rank's row, against a call per row.

The compressed allreduce's worker compresses p rows (one per rank) and its
last stage decodes p rows (one per chunk). `ops.compress_rows` and
`ops.decode_rows` do each in one kernel call; `ops.compress_each_row` and
`ops.decode_each_row` are what they replaced (and what kernels without the
rows entry points still run). Prints each one's median time per call, in
microseconds, timed alternately in one process, for p ranks and chunks of
`chunk` elements (block 256, fp32 scales):

  python -m benchmarks.rows_calls                  # the host, one thread
  python -m benchmarks.rows_calls --device cuda    # times with device events
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from onebit import ops
from onebit.bench.kernels import device_timer
from onebit.bench.table import int_arg

BLOCK = 256
CASES = [(4, 1024), (4, 16384), (16, 1024), (16, 65536), (4, 1 << 20)]


def measure(p: int, chunk: int, device: torch.device, rounds: int) -> dict:
    g = torch.Generator().manual_seed(p * chunk)
    src = torch.randn(p * chunk, generator=g).to(device)
    err = torch.zeros(p, chunk, device=device)
    counts = torch.full((p, chunk // BLOCK), float(BLOCK), dtype=torch.float64, device=device)
    cb = chunk // 8
    messages = torch.empty(p, cb + chunk // BLOCK * 4, dtype=torch.uint8, device=device)
    scales = (torch.rand(p, chunk // BLOCK, generator=g) + 0.5).to(device)
    out = torch.empty(p * chunk, device=device)
    calls = {
        "compress rows": lambda: ops.compress_rows(src, err, counts, BLOCK, torch.float32,
                                                   messages, cb),
        "compress each": lambda: ops.compress_each_row(ops.compress, src, err, counts, BLOCK,
                                                       torch.float32, messages, cb),
        "decode rows": lambda: ops.decode_rows(messages, scales, chunk, out, chunk, BLOCK),
        "decode each": lambda: ops.decode_each_row(ops.decode_mean, messages, scales, chunk, out,
                                                   chunk, BLOCK),
    }
    timed = device_timer(device)
    times = {name: [] for name in calls}
    for _ in range(rounds):  # alternate, so drift hits every call alike
        for name, fn in calls.items():
            times[name].append(timed(fn, 20))
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu, or an accelerator (cuda, xpu)")
    p.add_argument("--threads", type=int_arg(1), default=1, help="torch threads on the host")
    p.add_argument("--rounds", type=int_arg(1), default=5, help="alternating rounds (median)")


def run(args: argparse.Namespace) -> bool:
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"# {device}, threads={torch.get_num_threads()}: us per call, median of "
          f"{args.rounds} alternating rounds of 20 calls (block {BLOCK})")
    print(f"# {'p':>3} {'chunk':>8} {'compress rows':>14} {'each':>8} {'x':>6} "
          f"{'decode rows':>12} {'each':>8} {'x':>6}")
    for p, chunk in CASES:
        r = measure(p, chunk, device, args.rounds)
        print(f"  {p:>3} {chunk:>8} {r['compress rows']:>14.1f} {r['compress each']:>8.1f} "
              f"{r['compress each'] / r['compress rows']:>6.2f} {r['decode rows']:>12.1f} "
              f"{r['decode each']:>8.1f} {r['decode each'] / r['decode rows']:>6.2f}")
    return True


if __name__ == "__main__":
    from onebit.bench.command import main

    sys.exit(main(sys.modules[__name__]))
