"""How the MPI backend waits: MPI_Test polled against the deadline
(BoundedWait, sleep(0) between polls) against MPI_Wait, which has no
deadline, and against a loop that spins on MPI_Test before sleeping.
Alternating rounds, one piece, the layout agreed once (as an optimizer
calls it).

  .venv/bin/mpiexec -n 4 python -m benchmarks.mpi_wait
"""
import argparse
import sys
import time

import torch

from onebit.bench.table import int_arg


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int_arg(1), default=5, help="alternating rounds")
    p.add_argument("--calls", type=int_arg(1), default=5, help="timed calls per round")


def mpi_wait(self, request):
    request.Wait()


def spin_then_sleep(self, request):
    started, pause = time.monotonic(), 1e-5
    while not request.Test():
        if time.monotonic() - started > 1e-3:
            time.sleep(pause)
            pause = min(2 * pause, 2e-4)


def run(args: argparse.Namespace) -> bool:
    from mpi4py import MPI

    from onebit.backends.mpi import BoundedWait, MpiBackend

    comm = MPI.COMM_WORLD
    variants = {"BoundedWait (polls, sleep(0))": BoundedWait.finish, "MPI_Wait": mpi_wait,
                "spin 1 ms, then sleep": spin_then_sleep}
    backend = MpiBackend(agree_every_call=False, piece_size=0)
    times = {(name, numel): [] for name in variants for numel in (1 << 16, 1 << 22)}
    try:
        for numel in (1 << 16, 1 << 22):
            n, ns = backend.error_sizes(numel)
            x, w, s = torch.randn(numel), torch.zeros(n), torch.zeros(ns)
            for _ in range(args.rounds):
                for name, finish in variants.items():
                    BoundedWait.finish = finish
                    comm.Barrier()
                    t = time.perf_counter()
                    for _ in range(args.calls):
                        backend.compressed_allreduce(x, w, s)
                    comm.Barrier()
                    times[name, numel].append((time.perf_counter() - t) / args.calls)
    finally:
        BoundedWait.finish = variants["BoundedWait (polls, sleep(0))"]
    if comm.Get_rank() == 0:
        print(f"{comm.Get_size()} ranks, median of {args.rounds} rounds of {args.calls} calls, "
              "ms a call")
        for (name, numel), ts in times.items():
            print(f"{numel:>9} elements  {name:30s} {sorted(ts)[len(ts) // 2] * 1e3:8.2f}")
    return True


if __name__ == "__main__":
    from onebit.bench.command import main

    sys.exit(main(sys.modules[__name__]))
