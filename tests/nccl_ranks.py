"""Several NCCL ranks on one GPU, for the multi-rank GPU tier.

NCCL refuses two ranks on one device ("Duplicate GPU detected") by
comparing the ranks' host hashes, and `NCCL_HOSTID` sets a process's host
hash. Each rank started here gets its own (`onebit-rank-<RANK>`), so NCCL
sees one host per rank: it then uses neither P2P nor shared memory between
them and carries their traffic over its socket transport on the loopback.
What runs is real NCCL (communicators, CUDA streams, async work handles,
the watchdog and abort), slowly: this is for correctness, not speed.

Each rank is a fresh interpreter started with torchrun's variables, as a
"node" of one rank whose local rank 0 is on cuda:0:

  rank_env(rank, world_size, port)     the variables one rank gets (pure)
  rank_command(job_dir)                the command line of a rank that runs
                                       one test body (pure)
  choose_gpu_backend(world, gpus)      how the GPU tier runs `world` ranks (pure)
  run_gpu_ranks(fn, world, *args)      run fn(rank, world, *args) that way
  run_command_ranks(argv, world)       run a whole command (the bench) on
                                       ranks started that way

The rank side is this module's __main__: `python -m tests.nccl_ranks JOB_DIR`.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
HOSTID_PREFIX = "onebit-rank-"


def rank_env(rank: int, world_size: int, master_port: int, *,
             base: Optional[Mapping[str, str]] = None,
             master_addr: str = "127.0.0.1") -> Dict[str, str]:
    """The environment of rank `rank` of `world_size` sharing one GPU: `base`
    (default: this process's environment), torchrun's variables for a node
    of one rank (LOCAL_RANK 0, so onebit.launch.init_distributed and
    DeviceMesh put it on cuda:0), NCCL's host id of its own, NCCL's sockets
    on the loopback without InfiniBand, and its share of the cores
    (unless `base` sets OMP_NUM_THREADS)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    env = dict(os.environ if base is None else base)
    env.update(
        RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank),
        MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
        NCCL_HOSTID=f"{HOSTID_PREFIX}{rank}",
        NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1",
        # `python -m tests.nccl_ranks` and the test bodies import from the checkout
        PYTHONPATH=os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])),
    )
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
    return env


def rank_command(job_dir: os.PathLike) -> List[str]:
    """The command line of a rank that runs the test body pickled in `job_dir`."""
    return [sys.executable, "-m", "tests.nccl_ranks", str(job_dir)]


class GpuBackend(NamedTuple):
    """How the GPU tier runs its ranks: `backend` for init_process_group,
    and whether the ranks share one GPU through this module's launcher
    (else each rank gets a GPU of its own from tests.distributed)."""
    backend: str
    shared_gpu: bool


def choose_gpu_backend(world_size: int, gpu_count: int, *, gloo_only: bool = False) -> GpuBackend:
    """The backend of the multi-rank GPU tier for `world_size` ranks on a
    machine with `gpu_count` GPUs:
      - NCCL, a GPU per rank, where there are enough GPUs;
      - NCCL on one GPU through this launcher where there are fewer;
      - cuda:gloo (ranks sharing a GPU) only for a test of something NCCL
        cannot show (`gloo_only`: gloo's own behaviour, such as a group that
        serves CUDA tensors alone)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if gpu_count < 1:
        raise ValueError(f"the GPU tier needs a CUDA device, got gpu_count={gpu_count}")
    if gloo_only:
        return GpuBackend("cuda:gloo", shared_gpu=gpu_count < world_size)
    return GpuBackend("nccl", shared_gpu=gpu_count < world_size)


# ------------------------------------------------------------- the launcher --
def _free_port() -> int:
    from onebit.launch import free_port

    return free_port()


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _start(argv_of_rank: Callable[[int], List[str]], world_size: int, workdir: Path,
           env: Optional[Mapping[str, str]]) -> List[subprocess.Popen]:
    port = _free_port()
    procs = []
    for r in range(world_size):
        e = rank_env(r, world_size, port)
        e.update(env or {})
        with open(workdir / f"log-{r}.txt", "wb") as log:
            procs.append(subprocess.Popen(argv_of_rank(r), env=e, cwd=ROOT, stdout=log,
                                          stderr=subprocess.STDOUT))
    return procs


def _kill(procs: Sequence[subprocess.Popen], grace_s: float) -> None:
    """Wait up to `grace_s` for the ranks to exit, then kill the rest (a
    rank whose NCCL teardown hangs after it reported)."""
    end = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _logs(workdir: Path, ranks: Sequence[int]) -> str:
    return "\n".join(f"--- rank {r}'s output (tail) ---\n{_tail(workdir / f'log-{r}.txt')}"
                     for r in ranks)


def run_gpu_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240,
                  pg_timeout: float = 60, may_die: Sequence[int] = (),
                  env: Optional[Mapping[str, str]] = None, gloo_only: bool = False,
                  workdir: Optional[os.PathLike] = None) -> List[Any]:
    """fn(rank, world_size, *args) on `world_size` ranks over the backend
    choose_gpu_backend picks for this machine; the ranks' results, in rank
    order (None for a rank in `may_die` that died). A failure, a rank that
    died without reporting, or `timeout` passing is an AssertionError
    carrying the ranks' tracebacks or output."""
    import torch

    choice = choose_gpu_backend(world_size, torch.cuda.device_count(), gloo_only=gloo_only)
    if not choice.shared_gpu or choice.backend != "nccl":
        from onebit.launch import spawn_local

        try:  # "spawn": a rank that initialises CUDA is better not forked
            return spawn_local(fn, world_size, *args, timeout=timeout, env=dict(env or {}),
                               pg_timeout_s=pg_timeout, may_die=may_die, backend=choice.backend,
                               start_method="spawn")
        except RuntimeError as exc:
            raise AssertionError(str(exc)) from None
    return run_shared_gpu_ranks(fn, world_size, *args, timeout=timeout, pg_timeout=pg_timeout,
                                may_die=may_die, env=env, backend="nccl", workdir=workdir)


def run_shared_gpu_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float,
                         pg_timeout: float = 60, may_die: Sequence[int] = (),
                         env: Optional[Mapping[str, str]] = None, backend: str = "nccl",
                         workdir: Optional[os.PathLike] = None) -> List[Any]:
    """fn(rank, world_size, *args) on ranks this launcher starts (see the
    module docstring), each in a process group of `backend` (gloo runs the
    same machinery on a machine without a GPU)."""
    import tempfile

    if getattr(fn, "__module__", "__main__") == "__main__" or "<" in fn.__qualname__:
        raise ValueError(f"fn must be a module-level function a rank can import, got {fn!r}")
    with tempfile.TemporaryDirectory(prefix="onebit-ranks-", dir=workdir) as tmp:
        job = Path(tmp)
        with open(job / "job.pkl", "wb") as f:
            pickle.dump(dict(module=fn.__module__, name=fn.__qualname__, args=args,
                             backend=backend, pg_timeout=pg_timeout), f)
        procs = _start(lambda r: rank_command(job), world_size, job, env)
        results: Dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        try:
            while True:
                for r in range(world_size):
                    path = job / f"result-{r}.pkl"
                    if r not in results and path.exists():
                        status, value = pickle.loads(path.read_bytes())
                        if status == "error":
                            raise AssertionError(f"rank {r} failed:\n{value}\n{_logs(job, [r])}")
                        results[r] = value
                dead = [r for r, p in enumerate(procs)
                        if r not in results and p.poll() is not None
                        and not (job / f"result-{r}.pkl").exists()]
                unexpected = [r for r in dead if r not in may_die]
                if unexpected:
                    raise AssertionError(
                        f"ranks {unexpected} died without reporting (exit codes "
                        f"{[procs[r].returncode for r in unexpected]})\n{_logs(job, unexpected)}")
                if len(results) + len(dead) == world_size:
                    break
                if time.monotonic() > deadline:
                    waiting = [r for r in range(world_size) if r not in results and r not in dead]
                    raise AssertionError(f"ranks {waiting} did not report within {timeout:g} s "
                                         f"(reported: {sorted(results)})\n{_logs(job, waiting)}")
                time.sleep(0.1)
        finally:
            _kill(procs, grace_s=15 if len(results) == world_size else 0)
    return [results.get(r) for r in range(world_size)]


class RankOutput(NamedTuple):
    returncode: int
    output: str


def run_command_ranks(argv: Sequence[str], world_size: int, *, timeout: float,
                      env: Optional[Mapping[str, str]] = None) -> List[RankOutput]:
    """Run the command `argv` (python -m onebit.bench ...) once per rank,
    each with rank_env's variables (its own NCCL host id, cuda:0): the
    command joins its process group as under torchrun. Returns each rank's
    exit status and output; AssertionError with the output if `timeout` passes."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="onebit-ranks-") as tmp:
        job = Path(tmp)
        procs = _start(lambda r: list(argv), world_size, job, env)
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in procs):
                if time.monotonic() > deadline:
                    raise AssertionError(f"{' '.join(argv)} did not finish within {timeout:g} s\n"
                                         f"{_logs(job, range(world_size))}")
                time.sleep(0.2)
        finally:
            _kill(procs, grace_s=0)
        return [RankOutput(p.returncode, _tail(job / f"log-{r}.txt", 100_000))
                for r, p in enumerate(procs)]


# --------------------------------------------------------------- rank side --
def _write(path: Path, value) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(value))
    tmp.rename(path)  # the parent never reads half a file


def _rank_main(job_dir: str) -> None:
    """Join the process group, run the job's test body, write its result
    (before teardown: an NCCL teardown after a dead peer may hang, and the
    parent then kills this process with the result in hand)."""
    import datetime
    import importlib

    job = Path(job_dir)
    spec = pickle.loads((job / "job.pkl").read_bytes())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = job / f"result-{rank}.pkl"
    ok = False
    try:
        import torch
        import torch.distributed as dist

        from onebit.launch import shutdown

        fn = importlib.import_module(spec["module"])
        for part in spec["name"].split("."):
            fn = getattr(fn, part)
        if spec["backend"] != "gloo":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(spec["backend"], rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=spec["pg_timeout"]))
        try:
            _write(out, ("ok", fn(rank, world, *spec["args"])))
            ok = True
        finally:
            shutdown(ok)
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        if not out.exists():
            _write(out, ("error", traceback.format_exc()))
        raise


if __name__ == "__main__":
    _rank_main(sys.argv[1])
