"""Every collective runs on the device its process group serves.

An NCCL group has no backend for host tensors: a collective on one raises
"No backend type associated with device type cpu". A CPU-only machine
reproduces that group with `init_process_group("cuda:gloo")`, whose only
backend serves CUDA tensors. Under it, each side collective must *ask for*
the group's device (here that fails with torch's "not compiled with CUDA",
since there is no GPU) instead of handing the group a host tensor: the
piece tuner at its 8th call, gather_numbers, the backend's agreement,
the hierarchical setup, the optimizer's construction and the bench.
"""
import pytest
import torch

from tests.distributed import run_workers

HOST_TENSOR_ERROR = "No backend type associated with device type cpu"


def _asks_for_the_gpu(what, fn):
    try:
        fn()
    except (RuntimeError, AssertionError) as exc:  # torch: AssertionError("Torch not compiled ...")
        text = str(exc)
        assert HOST_TENSOR_ERROR not in text, f"{what} handed a host tensor to the group: {text}"
        assert "CUDA" in text, f"{what} failed otherwise than by asking for CUDA: {text}"
        return
    raise AssertionError(f"{what} ran a collective without the group's device")


def _side_collectives(rank, world):
    import torch.distributed as dist

    from onebit import collectives
    from onebit.backends import CompressedBackend
    from onebit.backends.hierarchical import torch_hierarchical
    from onebit.backends.pipeline import TUNING_CALLS, PieceTuner

    assert collectives.served_device_types() == ["cuda"]
    assert collectives.communication_device().type == "cuda"
    # The group really refuses host tensors, as NCCL does.
    try:
        dist.all_reduce(torch.zeros(1))
        raise AssertionError("a host tensor went through a cuda-only group")
    except RuntimeError as exc:
        assert HOST_TENSOR_ERROR in str(exc)

    _asks_for_the_gpu("gather_numbers", lambda: collectives.gather_numbers(
        "test", [1, 2], torch.int64))
    backend = CompressedBackend(piece_size=None)
    _asks_for_the_gpu("backend.share", lambda: backend.share(torch.zeros(2)))
    tuner = PieceTuner(None)
    key = ("layout",)
    for call in range(TUNING_CALLS - 1):  # the trials gather nothing
        tuner.record(key, tuner.count(key, 1 << 23, world), lambda: 0.1, backend.share)
    _asks_for_the_gpu("the piece tuner's decision", lambda: tuner.record(
        key, tuner.count(key, 1 << 23, world), lambda: 0.1, backend.share))
    m = torch.randn(100)
    n, ns = backend.error_sizes(100)
    _asks_for_the_gpu("compressed_allreduce's agreement", lambda: backend.compressed_allreduce(
        m, torch.zeros(n), torch.zeros(ns)))
    _asks_for_the_gpu("the hierarchical setup", lambda: torch_hierarchical(node_of_rank=[0, 0]))
    return True


def _optimizer_on_host_params(rank, world):
    import onebit

    try:
        onebit.OnebitAdam(torch.nn.Linear(3, 2).parameters(), freeze_step=2)
    except ValueError as exc:
        assert "is on cpu" in str(exc) and "cuda only" in str(exc), exc
        return True
    raise AssertionError("an optimizer over host params was built on a cuda-only group")


def _bench_step(rank, world):
    from onebit.bench import step

    a = dict(params=1 << 12, width=64, batch=2, steps=1, rounds=1, untimed=0,
             optimizers=["onebitadam"], overlap="off")
    _asks_for_the_gpu("bench step", lambda: step.measure(rank, world, a))
    return True


@pytest.mark.parametrize("body", [_side_collectives, _optimizer_on_host_params, _bench_step],
                         ids=["side-collectives", "optimizer", "bench-step"])
def test_every_collective_asks_for_the_groups_device(body):
    assert run_workers(body, 2, timeout=90, backend="cuda:gloo") == [True, True]


def _devices(rank, world):
    import torch.distributed as dist

    from onebit import collectives

    cpu_only = dist.new_group([0, 1], backend="cpu:gloo")
    return (str(collectives.communication_device()),  # plain gloo serves cpu and cuda
            collectives.served_device_types(cpu_only))


def test_communication_device_comes_from_the_groups_backend():
    assert run_workers(_devices, 2, timeout=60)[0] == ("cpu", ["cpu"])


def _device_from_the_data(rank, world):
    from onebit import collectives

    # A rank whose params live on GPU 1 but that never called set_device:
    # its side collectives go to GPU 1, not to the current device (GPU 0).
    on_gpu1 = collectives.communication_device(None, torch.device("cuda", 1))
    # Host params under a group that serves CUDA only: the group's device.
    on_host = collectives.communication_device(None, torch.device("cpu"))
    return str(on_gpu1), str(on_host)


def test_the_communication_device_follows_the_params_where_the_group_serves_them():
    for on_gpu1, on_host in run_workers(_device_from_the_data, 2, timeout=60, backend="cuda:gloo"):
        assert on_gpu1 == "cuda:1" and on_host == "cuda", (on_gpu1, on_host)


def test_the_tuners_clock_is_the_devices_events():
    """CallTimer records on the data's device's current stream through the
    accelerator's events (a host clock around NCCL's stream-ordered waits
    would time the launches only); on the host those events are the host
    clock, and seconds() measures the call."""
    import time

    from onebit.accelerator import CpuAccelerator, set_accelerator
    from onebit.backends.pipeline import CallTimer

    timer = CallTimer(torch.device("cpu"))
    time.sleep(0.05)
    assert 0.05 <= timer.stop().seconds() < 1.0

    recorded = []

    class Accounted(CpuAccelerator):
        def current_stream(self, index=None):
            return ("stream of", index)

        @property
        def Event(self):  # noqa: N802
            class E:
                def __init__(e, enable_timing=False):
                    assert enable_timing
                    e.at = None

                def record(e, stream=None):
                    recorded.append(stream)
                    e.at = len(recorded)

                def synchronize(e):
                    recorded.append("synchronized")

                def elapsed_time(e, end):
                    return 250.0 * (end.at - e.at)
            return E

    set_accelerator(Accounted())
    try:
        timer = CallTimer(torch.device("cpu"))
        assert timer.stop().seconds() == 0.25
        assert recorded == [("stream of", None)] * 2 + ["synchronized"]
    finally:
        set_accelerator(None)


def _host_group_in_a_device_world(rank, world):
    """A gloo group for host params inside a cuda:gloo world: the overlap's
    and DiLoCo's own exchange groups take its backends, not the world's
    (which refuses host tensors)."""
    import torch.distributed as dist

    import onebit
    from onebit.handoff import exchange_group

    host = dist.new_group(backend="gloo")
    x = torch.ones(4)
    dist.all_reduce(x, group=exchange_group(host))
    model = torch.nn.Linear(8, 4)
    opt = onebit.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=1, process_group=host,
                            overlap_backward=True, bucket_cap_mb=0.0001)
    for t in range(3):
        opt.zero_grad()
        model(torch.randn(2, 8, generator=torch.Generator().manual_seed(t + 10 * rank))).sum().backward()
        opt.step()
    return float(x[0]), opt.overlap_stats()["launched_in_backward"]


def test_a_host_group_in_a_device_world_keeps_its_backend():
    out = run_workers(_host_group_in_a_device_world, 2, timeout=90, backend="cuda:gloo")
    assert all(total == 2.0 and launched > 0 for total, launched in out), out


def _hierarchical_over_a_host_group(rank, world):
    """The hierarchical backend's node and cross groups take the backends of
    the group it regroups: over a gloo group in a cuda:gloo world they take
    host tensors (with the world's backend they refused them)."""
    import torch.distributed as dist

    from onebit.backends.hierarchical import torch_hierarchical

    host = dist.new_group(backend="gloo")
    backend = torch_hierarchical(group=host, node_of_rank=[0, 0, 1, 1], shared_memory=False)
    x = torch.full((1000,), float(rank + 1))
    big, small = backend.error_sizes(x.numel())
    out = backend.compressed_allreduce(x, torch.zeros(big), torch.zeros(small))
    return float(out.mean())


def test_the_hierarchical_backend_keeps_its_groups_backends():
    out = run_workers(_hierarchical_over_a_host_group, 4, timeout=120, backend="cuda:gloo")
    assert all(abs(m - 2.5) < 1e-5 for m in out), out  # the mean of 1..4, sign and scale exact
