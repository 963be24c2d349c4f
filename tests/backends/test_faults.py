"""Faults end in a clear error on every surviving rank, never a hang or
silent corruption: dead and hung ranks, ranks that disagree, diverging
replicas."""
import os
import signal
import time

import pytest
import torch

from tests.distributed import run_workers

pytestmark = pytest.mark.slow  # dead and hung ranks: each waits out a deadline; the fast tier (-m "not slow") leaves these out

SHAPES = [(6, 4), (9,)]


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]


def _grads(params, rank, t):
    g = torch.Generator().manual_seed(100 * t + rank)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def _dies_mid_training(rank, world, how, freeze):
    import onebit

    params = _params()
    opt = onebit.OnebitAdam(params, freeze_step=freeze, timeout_s=4.0)
    for t in range(1, 9):
        _grads(params, rank, t)
        if t == 6 and rank == 1:
            if how == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(12)  # hung: alive, but misses the collective until the others gave up
            return None
        if rank == 1 or t < 6:
            opt.step()
            continue
        start = time.monotonic()
        with pytest.raises(onebit.CommunicationError) as err:
            opt.step()
        return str(err.value), time.monotonic() - start


@pytest.mark.parametrize("how", ["killed", "hung"])
@pytest.mark.parametrize("freeze", [100, 3], ids=["warmup", "compression"])
def test_dead_or_hung_rank_gives_a_timely_error_naming_the_phase(how, freeze):
    results = run_workers(_dies_mid_training, 3, how, freeze, timeout=90, may_die=(1,))
    for rank in (0, 2):
        message, waited = results[rank]
        assert waited < 4.0 + 6.0, f"rank {rank} waited {waited:.1f}s"
        assert "OnebitAdam" in message
        # Each step's first collective, in both stages: the ranks agree on
        # which params train and on skipping a non-finite step.
        assert "agreeing on the trainable params" in message, message
    if how == "hung":
        assert "within 4 s" in results[0][0]


def _hangs_in_a_bucket(rank, world):
    """overlap_backward, 6 buckets: rank 1 hangs inside its third bucket's
    exchange of a compressed step, after the agreement all-gather."""
    import onebit

    params = [torch.nn.Parameter(torch.randn(64, 16)) for _ in range(6)]
    opt = onebit.OnebitAdam(params, freeze_step=2, timeout_s=4.0, overlap_backward=True,
                            bucket_cap_mb=0.004)  # one 1024-element param per bucket
    calls = []
    exchange = opt.backend.compressed_allreduce

    def hangs_at_the_ninth(*args, **kw):
        calls.append(1)
        if rank == 1 and len(calls) == 6 + 3:  # step 4, third bucket
            time.sleep(12)
            os.kill(os.getpid(), signal.SIGKILL)
        return exchange(*args, **kw)

    opt.backend.compressed_allreduce = hangs_at_the_ninth
    for t in range(1, 4):
        _grads(params, rank, t)
        opt.step()
    _grads(params, rank, 4)
    start = time.monotonic()
    with pytest.raises(onebit.CommunicationError) as err:
        opt.step()
    return str(err.value), time.monotonic() - start, opt.overlap_stats()


def test_a_hang_in_one_bucket_costs_one_deadline_not_one_per_bucket():
    """The buckets queued behind the one that failed fail at once: waiting out
    each one's deadline in turn would multiply the time to the error."""
    results = run_workers(_hangs_in_a_bucket, 3, timeout=90, may_die=(1,))
    for rank in (0, 2):
        message, waited, stats = results[rank]
        assert "compressed_allreduce" in message and "within 4 s" in message, message
        assert 4.0 <= waited < 2 * 4.0, f"rank {rank} waited {waited:.1f}s"
        assert stats["launched_in_step"] == 6 * 2, stats  # steps 3 and 4: all 6 from step()


def _backend_peer_dies(rank, world, agree_every_call):
    import onebit
    from onebit.backends import CompressedBackend

    b = CompressedBackend(timeout_s=4.0, agree_every_call=agree_every_call)
    n, ns = b.error_sizes(1000)
    w, s = torch.zeros(n), torch.zeros(ns)
    b.compressed_allreduce(torch.randn(1000), w, s)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    # A direct call's first collective is the layout agreement; an owner's
    # backend (agreed once) starts with phase 1.
    phase = "agreeing on the compressed buffer's layout" if agree_every_call else "phase 1"
    with pytest.raises(onebit.CommunicationError, match=phase):
        b.compressed_allreduce(torch.randn(1000), w, s)
    return True


@pytest.mark.parametrize("agree_every_call", [True, False])
def test_backend_names_the_phase_when_a_peer_dies(agree_every_call):
    assert run_workers(_backend_peer_dies, 3, agree_every_call, timeout=60,
                       may_die=(2,))[:2] == [True, True]


def _disagree(rank, world, what):
    import onebit
    import onebit.agreement as agreement

    params = _params()
    kw = {}
    if what == "freeze_step" and rank == 1:
        kw["freeze_step"] = 7
    if what == "shapes" and rank == 2:
        params = params[::-1]
    if what == "wire format" and rank == 0:
        agreement.WIRE_FORMAT_VERSION = 99  # where the fingerprint reads it
    if what == "backend" and rank == 1:
        from onebit.backends import CompressedBackend, register_backend

        register_backend("compressed-v2", CompressedBackend)
        kw["comm_backend_name"] = "compressed-v2"
    with pytest.raises(ValueError, match="ranks disagree on") as err:
        onebit.OnebitAdam(params, **kw)
    return str(err.value)


@pytest.mark.parametrize("what, named", [("freeze_step", "hyper-parameters"),
                                         ("shapes", "parameter shapes/order"),
                                         ("wire format", "wire format version"),
                                         ("backend", "compressed backend")])
def test_construction_fingerprint_catches_disagreeing_ranks(what, named):
    messages = run_workers(_disagree, 3, what, timeout=60)
    assert all(named in m for m in messages), messages


def _mpi_outside_mpirun(rank, world, backend):
    """Spawned ranks with a gloo group: each process is an MPI world of one."""
    import onebit

    with pytest.raises(ValueError, match="MPI's world has this process as rank 0 of 1") as err:
        onebit.OnebitAdam(_params(), comm_backend_name=backend)
    return str(err.value)


@pytest.mark.parametrize("backend", ["mpi", "mpi_hierarchical"])
def test_an_mpi_backend_whose_world_is_not_the_process_group_is_refused(backend):
    """Under torchrun (or spawn) each process is MPI's only rank: the 1-bit
    exchange averaged nothing and the replicas drifted apart with no error.
    Construction now refuses, on every rank, naming both worlds and the fix."""
    messages = run_workers(_mpi_outside_mpirun, 2, backend, timeout=90)
    assert all("rank 1 of 2" in m or "rank 0 of 2" in m for m in messages), messages
    assert all("comm_backend_name='compressed'" in m for m in messages), messages


def _corrupted(rank, world):
    import onebit

    params = _params()
    opt = onebit.OnebitAdam(params, freeze_step=3, check_replicas_every=5)
    for t in range(1, 5):
        _grads(params, rank, t)
        opt.step()
    if rank == 2:
        with torch.no_grad():
            params[1][4] += 1e-3  # silent corruption on one rank
    _grads(params, rank, 5)
    with pytest.raises(onebit.ReplicaDivergenceError) as err:
        opt.step()
    return str(err.value)


def test_divergence_guard_names_the_first_differing_tensor():
    for message in run_workers(_corrupted, 3, timeout=60):
        assert "group 0 param 1 (9,) value differs on rank(s) [2]" in message, message


def _orderly_shutdown(rank, world, marker):
    from onebit import launch

    if rank == 1:
        time.sleep(1.0)  # the slow peer, still working when rank 0 is done
        open(marker, "w").close()
    launch.shutdown()
    return os.path.exists(marker)


def test_shutdown_waits_for_every_peer_before_destroying_the_group(tmp_path):
    """The cause of "terminate called without an active exception" at exit:
    a rank destroying its group while a peer still uses it. After a clean
    run, no rank gets past shutdown before all have reached it."""
    marker = str(tmp_path / "rank1-done")
    assert run_workers(_orderly_shutdown, 3, marker, timeout=60) == [True, True, True]


def _collective_on_a_tensor_the_group_refuses(rank, world):
    import torch.distributed as dist

    from onebit import collectives

    with pytest.raises(collectives.CommunicationError) as err:
        # A bitwise AND of floats: an error at once, no peer involved.
        collectives.run("test phase", lambda: dist.all_reduce(
            torch.zeros(2), op=dist.ReduceOp.BAND, async_op=True), 5.0)
    return str(err.value)


def test_an_immediate_error_is_reported_as_itself_not_as_a_dead_peer():
    for message in run_workers(_collective_on_a_tensor_the_group_refuses, 2, timeout=60):
        assert "test phase failed on rank" in message, message
        assert "probably died" not in message and "within" not in message, message

