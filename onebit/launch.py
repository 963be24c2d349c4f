"""Launch helpers: join the process group a launcher set up, or start local ranks.

  init_distributed()          torchrun (RANK/WORLD_SIZE/MASTER_ADDR...) or
                              mpirun (MPI rank and size; rank 0 picks a port)
  launched_externally()       whether either launcher started this process
  spawn_local(fn, n, *args)   start n local ranks, each running
                              fn(rank, world_size, *args) in a gloo group
                              (or nccl/xccl, one device per rank);
                              returns their results, re-raises a failure,
                              and kills everyone if `timeout` passes
  run_everywhere(fn, n, *args)  under a launcher, fn on this rank; else
                              spawn_local with n ranks
  local_backend(n)            the best backend for n local ranks
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable, List, Optional, Sequence

from .accelerator.placement import local_world_size  # noqa: F401 - re-exported

_MPI_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def under_mpirun() -> bool:
    return any(v in os.environ for v in _MPI_RANK_VARS)


def launched_externally() -> bool:
    return under_torchrun() or under_mpirun()


def share_cores() -> int:
    """Give this rank its share of the machine's cores (unless OMP_NUM_THREADS
    says otherwise): 4 ranks on 2 cores that each run 2 threads would fight."""
    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size()))
    return torch.get_num_threads()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(backend: Optional[str] = None, timeout_s: float = 300.0) -> None:
    """Initialise torch.distributed from torchrun's or mpirun's environment.

    backend: torch.distributed backend (default: the accelerator's). Under
    mpirun, rank 0 chooses MASTER_PORT and MASTER_ADDR unless they are set
    (default_master_addr), and MPI broadcasts them.
    The device is chosen by *local* rank.
    """
    import torch.distributed as dist

    from .accelerator import get_accelerator

    if dist.is_initialized():
        return
    acc = get_accelerator()
    if under_torchrun():
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", 0))
    elif under_mpirun():
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        local = node.Get_rank()
        port = comm.bcast(os.environ.get("MASTER_PORT") or (free_port() if rank == 0 else None))
        addr = comm.bcast(os.environ.get("MASTER_ADDR") or default_master_addr(
            spans_nodes=node.Get_size() < size) if rank == 0 else None)
        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), LOCAL_RANK=str(local))
    else:
        raise RuntimeError("init_distributed: not launched by torchrun or mpirun")
    if acc.device_count() > 1:
        acc.set_device(local % acc.device_count())
    dist.init_process_group(backend or acc.communication_backend_name(), rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=timeout_s))


def default_master_addr(spans_nodes: bool) -> str:
    """Where rank 0's store listens when MASTER_ADDR is not set under mpirun:
    the loopback on one machine; across machines rank 0's host name, which
    the others resolve (on theirs, 127.0.0.1 would be their own loopback,
    and each would wait out the deadline). Not verified on several nodes
    here: set MASTER_ADDR where host names do not resolve."""
    import socket

    return socket.gethostname() if spans_nodes else "127.0.0.1"


def local_backend(world_size: int) -> str:
    """The torch.distributed backend for `world_size` local ranks: the
    accelerator's (nccl, xccl) when each rank can have a device of its own,
    else gloo on the host (nccl refuses two ranks on one GPU)."""
    from .accelerator import get_accelerator

    acc = get_accelerator()
    if acc.name != "cpu" and acc.device_count() >= world_size:
        return acc.communication_backend_name()
    return "gloo"


def shutdown(clean: bool = True, timeout_s: float = 60.0) -> None:
    """Tear down the default process group in order. After a clean run every
    rank first waits at a barrier, so none destroys its group while a peer
    is still sending to it (the race that ends a process with "terminate
    called without an active exception"). After an error, peers may be gone:
    destroy at once rather than wait for them."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    from . import collectives

    try:
        if clean:
            collectives.run("shutdown barrier", lambda: dist.barrier(async_op=True), timeout_s)
    except collectives.CommunicationError:
        pass  # a peer is gone already (it died, or left after an error): nothing to wait for
    finally:
        dist.destroy_process_group()


def _entry(fn, rank, world_size, port, args, results, env, timeout_s, threads, backend):
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        import torch
        import torch.distributed as dist

        if threads:
            torch.set_num_threads(threads)
        if backend != "gloo":  # a device per rank where there are enough (cuda:gloo
            # on one GPU: the ranks share it)
            from .accelerator import get_accelerator

            acc = get_accelerator()
            acc.set_device(rank % max(1, acc.device_count()))
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        ok = False
        try:
            results.put((rank, "ok", fn(rank, world_size, *args)))
            ok = True
        finally:
            shutdown(ok)
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, "error", traceback.format_exc()))


def spawn_local(fn: Callable[..., Any], world_size: int, *args: Any,
                timeout: Optional[float] = None, env: Optional[dict] = None,
                pg_timeout_s: float = 300.0, threads: Optional[int] = None,
                may_die: Sequence[int] = (), backend: str = "gloo",
                start_method: str = "spawn") -> List[Any]:
    """Run fn(rank, world_size, *args) on `world_size` local ranks.

    fn must be importable (a module-level function). `threads` sets each
    rank's torch threads (default: cores shared out, at least 1). Ranks in
    `may_die` (fault-injection tests) may exit without reporting; their
    result is None. `backend`: gloo (host tensors), or a device backend
    (see local_backend), in which case rank r uses device r (modulo the
    devices there are: ranks of a cuda:gloo group may share one GPU).
    `start_method` "forkserver" forks each rank from a server that has
    imported torch once, and torch._dynamo, which torch imports at the first
    optimizer's construction (together about 6 s per rank less than "spawn"
    on a 2-core box, which matters to a test suite that starts hundreds); it
    suits host backends only, and modules other than torch's still start
    fresh in each rank.
    """
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # No effect once the server runs.
        ctx.set_forkserver_preload(["torch", "torch._dynamo"])
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, daemon=True,
                         args=(fn, r, world_size, port, args, results, env or {}, pg_timeout_s,
                               threads, backend))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out, errors = {}, []
    deadline = None if timeout is None else time.monotonic() + timeout

    def settled() -> int:
        gone = [r for r in may_die if r not in out and procs[r].exitcode not in (None, 0)]
        return len(out) + len(gone)

    try:
        while settled() < world_size and not errors:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"local ranks timed out after {timeout}s; finished: {sorted(out)}")
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in may_die]
                if dead:
                    raise RuntimeError(f"ranks {dead} died without reporting (exit codes "
                                       f"{[procs[r].exitcode for r in dead]})")
                continue
            if status == "ok":
                out[rank] = value
            else:
                errors.append((rank, value))
    finally:
        for p in procs:
            p.join(timeout=0.5 if errors else 5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        rank, tb = errors[0]
        raise RuntimeError(f"rank {rank} failed:\n{tb}")
    return [out.get(r) for r in range(world_size)]


def run_everywhere(fn: Callable[..., Any], nproc: int, *args: Any,
                   backend: str = "gloo") -> tuple:
    """Run fn(rank, world_size, *args) on every rank and return (rank, result).

    Under torchrun or mpirun: join their process group and run on this
    process's rank. Otherwise: start `nproc` local ranks on `backend` and
    return rank 0's result as (0, result). fn must be importable (module level).
    """
    if launched_externally():
        import torch.distributed as dist

        share_cores()
        init_distributed()
        ok = False
        try:
            rank = dist.get_rank()
            out = rank, fn(rank, dist.get_world_size(), *args)
            ok = True
            return out
        finally:
            shutdown(ok)
    return 0, spawn_local(fn, nproc, *args, backend=backend)[0]

