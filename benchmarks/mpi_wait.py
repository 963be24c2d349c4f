"""How the MPI backend waits: MPI_Test polled against the deadline
(BoundedWait, sleep(0) between polls) against MPI_Wait, which has no
deadline, and against a loop that spins on MPI_Test before sleeping.
Alternating rounds, one piece, the layout agreed once (as an optimizer
calls it).

  .venv/bin/mpiexec -n 4 python -m benchmarks.mpi_wait
"""
import time

import torch
from mpi4py import MPI

from onebit.backends.mpi import BoundedWait, MpiBackend

COMM = MPI.COMM_WORLD
ROUNDS, CALLS = 5, 5


def mpi_wait(self, request):
    request.Wait()


def spin_then_sleep(self, request):
    started, pause = time.monotonic(), 1e-5
    while not request.Test():
        if time.monotonic() - started > 1e-3:
            time.sleep(pause)
            pause = min(2 * pause, 2e-4)


def main() -> None:
    variants = {"BoundedWait (polls, sleep(0))": BoundedWait.finish, "MPI_Wait": mpi_wait,
                "spin 1 ms, then sleep": spin_then_sleep}
    backend = MpiBackend(agree_every_call=False, piece_size=0)
    times = {(name, numel): [] for name in variants for numel in (1 << 16, 1 << 22)}
    for numel in (1 << 16, 1 << 22):
        n, ns = backend.error_sizes(numel)
        x, w, s = torch.randn(numel), torch.zeros(n), torch.zeros(ns)
        for _ in range(ROUNDS):
            for name, finish in variants.items():
                BoundedWait.finish = finish
                COMM.Barrier()
                t = time.perf_counter()
                for _ in range(CALLS):
                    backend.compressed_allreduce(x, w, s)
                COMM.Barrier()
                times[name, numel].append((time.perf_counter() - t) / CALLS)
    BoundedWait.finish = variants["BoundedWait (polls, sleep(0))"]
    if COMM.Get_rank() == 0:
        print(f"{COMM.Get_size()} ranks, median of {ROUNDS} rounds of {CALLS} calls, ms a call")
        for (name, numel), ts in times.items():
            print(f"{numel:>9} elements  {name:30s} {sorted(ts)[len(ts) // 2] * 1e3:8.2f}")


if __name__ == "__main__":
    main()
