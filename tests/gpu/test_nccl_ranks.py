"""The GPU tier's launcher (tests/nccl_ranks.py), checked on the CPU: the
environment each rank gets, its command line, the backend choice, and the
launcher's own machinery (results, failures, a dead rank, a deadline) on
ranks it starts over gloo."""
import os
import sys

import pytest

from tests.nccl_ranks import (GpuBackend, choose_gpu_backend, rank_command, rank_env,
                              run_command_ranks, run_shared_gpu_ranks)

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_rank_gets_its_own_nccl_host_and_torchruns_variables(world):
    envs = [rank_env(r, world, 29517, base={"PATH": "/bin"}) for r in range(world)]
    for r, env in enumerate(envs):
        assert env["NCCL_HOSTID"] == f"onebit-rank-{r}"
        assert env["NCCL_SOCKET_IFNAME"] == "lo" and env["NCCL_IB_DISABLE"] == "1"
        assert (env["RANK"], env["WORLD_SIZE"]) == (str(r), str(world))
        # a node of one rank, on cuda:0: init_distributed and DeviceMesh pick
        # the device by local rank
        assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == ("0", "1", str(r))
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "29517")
        assert env["PATH"] == "/bin", "the base environment is kept"
        assert all(isinstance(v, str) for v in env.values())
    assert len({e["NCCL_HOSTID"] for e in envs}) == world, "host ids must differ, or NCCL refuses"


def test_rank_env_keeps_the_callers_thread_count_and_pythonpath():
    env = rank_env(1, 2, 1234, base={"OMP_NUM_THREADS": "3", "PYTHONPATH": "/elsewhere"})
    assert env["OMP_NUM_THREADS"] == "3"
    root, rest = env["PYTHONPATH"].split(os.pathsep)
    assert rest == "/elsewhere" and os.path.isfile(os.path.join(root, "tests", "nccl_ranks.py"))
    shared = rank_env(0, 2, 1234, base={})
    assert shared["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))


def test_rank_env_refuses_a_rank_outside_the_world():
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\), got 2"):
        rank_env(2, 2, 1234)


def test_rank_command_runs_this_interpreter_on_the_job():
    assert rank_command("/tmp/job") == [sys.executable, "-m", "tests.nccl_ranks", "/tmp/job"]


@pytest.mark.parametrize("world,gpus,expected", [
    (2, 2, GpuBackend("nccl", shared_gpu=False)),   # a GPU per rank
    (4, 8, GpuBackend("nccl", shared_gpu=False)),
    (2, 1, GpuBackend("nccl", shared_gpu=True)),    # one GPU: NCCL through the launcher
    (3, 1, GpuBackend("nccl", shared_gpu=True)),
    (4, 2, GpuBackend("nccl", shared_gpu=True)),    # fewer GPUs than ranks
    (1, 1, GpuBackend("nccl", shared_gpu=False)),
])
def test_the_gpu_tier_runs_nccl_with_a_gpu_per_rank_or_shared(world, gpus, expected):
    assert choose_gpu_backend(world, gpus) == expected


def test_cuda_gloo_only_when_the_test_asks_for_gloo():
    assert choose_gpu_backend(2, 1, gloo_only=True) == GpuBackend("cuda:gloo", shared_gpu=True)
    assert choose_gpu_backend(2, 2, gloo_only=True) == GpuBackend("cuda:gloo", shared_gpu=False)


@pytest.mark.parametrize("world,gpus,message", [(0, 1, "world_size must be >= 1, got 0"),
                                                (2, 0, "needs a CUDA device, got gpu_count=0")])
def test_choose_gpu_backend_refuses_what_cannot_run(world, gpus, message):
    with pytest.raises(ValueError, match=message):
        choose_gpu_backend(world, gpus)


# ------------------------------------------- the launcher's machinery on gloo --
def _report_env(rank, world):
    import torch
    import torch.distributed as dist

    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)  # 1 + 2: both ranks are in one group
    return (os.environ["NCCL_HOSTID"], os.environ["LOCAL_RANK"], dist.get_rank(),
            dist.get_world_size(), float(total))


def _fails_on_rank_1(rank, world):
    if rank == 1:
        raise ValueError("rank 1's own complaint")
    return rank


def _rank_1_dies(rank, world):
    if rank == 1:
        os._exit(7)
    return rank


def _sleeps(rank, world):
    import time

    time.sleep(60)


@pytest.mark.slow  # each rank is a fresh interpreter importing torch
@pytest.mark.timeout(180)
def test_the_launchers_ranks_join_one_group_with_their_own_environment(tmp_path):
    got = run_shared_gpu_ranks(_report_env, 2, timeout=120, backend="gloo", workdir=tmp_path)
    assert got == [("onebit-rank-0", "0", 0, 2, 3.0), ("onebit-rank-1", "0", 1, 2, 3.0)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_launcher_reports_a_failure_a_dead_rank_and_a_deadline(tmp_path):
    with pytest.raises(AssertionError, match=r"(?s)rank 1 failed:.*rank 1's own complaint"):
        run_shared_gpu_ranks(_fails_on_rank_1, 2, timeout=120, backend="gloo", workdir=tmp_path)
    with pytest.raises(AssertionError, match=r"ranks \[1\] died without reporting \(exit codes \[7\]\)"):
        run_shared_gpu_ranks(_rank_1_dies, 2, timeout=120, backend="gloo", workdir=tmp_path)
    assert run_shared_gpu_ranks(_rank_1_dies, 2, timeout=120, may_die=(1,), backend="gloo",
                                workdir=tmp_path) == [0, None]
    with pytest.raises(AssertionError, match=r"ranks \[0, 1\] did not report within 20 s"):
        run_shared_gpu_ranks(_sleeps, 2, timeout=20, backend="gloo", workdir=tmp_path)


def test_the_launcher_refuses_a_body_a_rank_cannot_import():
    with pytest.raises(ValueError, match="module-level function"):
        run_shared_gpu_ranks(lambda rank, world: rank, 2, timeout=10, backend="gloo")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_command_on_the_launchers_ranks_joins_their_group_as_under_torchrun():
    """The bench, as the GPU tier runs it over NCCL, here over gloo: each
    rank joins through onebit.launch.init_distributed, and rank 0 prints."""
    argv = [sys.executable, "-m", "onebit.bench", "--minbytes", "4K", "--maxbytes", "16K",
            "--warmup", "1", "--iters", "1"]
    ranks = run_command_ranks(argv, 2, timeout=120)
    assert [r.returncode for r in ranks] == [0, 0], ranks
    assert "ranks=2 device=cpu dist=gloo" in ranks[0].output, ranks[0].output
    assert "# Out of bounds values : 0 OK" in ranks[0].output, ranks[0].output
    assert "Out of bounds" not in ranks[1].output, "only rank 0 prints"
