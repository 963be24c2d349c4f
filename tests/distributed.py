"""Run a test body on real processes (gloo over loopback), with a deadline.

`run_workers(fn, world_size, *args, timeout=...)` spawns `world_size`
processes, each calling `fn(rank, world_size, *args)` inside an initialised
gloo group. It returns the list of per-rank return values, re-raises the
first worker failure with its traceback, and kills every worker and fails if
the deadline passes -- a hang costs seconds, never CI's 90 minutes.
"""
import datetime
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world_size, port, args, results, env, pg_timeout):
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # p ranks share 2 cores
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        try:
            results.put((rank, "ok", fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", traceback.format_exc()))


def run_workers(fn, world_size, *args, timeout=120, env=None, pg_timeout=60):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, daemon=True,
                         args=(fn, r, world_size, port, args, results, env or {}, pg_timeout))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out, errors = {}, []
    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"workers timed out after {timeout}s; finished ranks: "
                                   f"{sorted(out)}; failed: {len(errors)}")
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and not errors:
                    raise RuntimeError(f"ranks {dead} died without reporting (exit codes "
                                       f"{[procs[r].exitcode for r in dead]})")
                continue
            if status == "ok":
                out[rank] = value
            else:
                errors.append((rank, value))
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        rank, tb = errors[0]
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    return [out[r] for r in range(world_size)]
