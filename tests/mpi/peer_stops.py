"""Run by tests/backends/test_mpirun.py as `mpiexec -n 2 python tests/mpi/peer_stops.py`
(not collected by the suite: what it leaves behind is an unusable
communicator). Rank 1 misses a collective by more than the deadline; the
other ranks' MPI waits must end in CommunicationError naming the phase,
within the deadline, for the flat backend and the hierarchical one's
stage inside the node. Prints one result line per rank and case."""
import os
import sys
import time

import torch
from mpi4py import MPI

from onebit.backends import get_backend
from onebit.collectives import CommunicationError

DEADLINE_S, LATE_S = 2.0, 6.0
COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()


def one_call(backend, numel=4096):
    n, ns = backend.error_sizes(numel)
    buffer, worker, server = torch.randn(numel), torch.zeros(n), torch.zeros(ns)
    backend.compressed_allreduce(buffer, worker, server)


def case(name, make):
    backend = make(COMM.Dup())  # its own communicator: this one is left unusable
    one_call(backend)  # a first call that every rank makes: the layout agreed
    COMM.Barrier()
    if RANK == 1:
        time.sleep(LATE_S)
    started = time.monotonic()
    try:
        one_call(backend)
        outcome = "finished"
    except CommunicationError as exc:
        outcome = f"CommunicationError {str(exc)!r}"
    print(f"RESULT {name} rank {RANK} after {time.monotonic() - started:.1f} s: {outcome}",
          flush=True)
    COMM.Barrier()  # the world communicator still works: the next case starts together


for once in (False, True):  # a direct user's backend, then an owner's (layouts agreed once)
    suffix = "-once" if once else ""
    case("flat" + suffix, lambda comm: get_backend("mpi", comm=comm, timeout_s=DEADLINE_S,
                                                   agree_every_call=not once))
    case("hierarchical" + suffix, lambda comm: get_backend(
        "mpi_hierarchical", comm=comm, node_of_rank=[0] * SIZE, timeout_s=DEADLINE_S,
        agree_every_call=not once))
sys.stdout.flush()
# MPI_Finalize would wait on the collectives the deadline abandoned.
os._exit(0)
