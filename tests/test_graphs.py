"""Graph capture of the optimizer step, on CPU.

The emulator (graph_emulator.py) behaves like a CUDA graph where code can go
wrong: capture records without running, replay re-runs with frozen Python
numbers, and host syncs in a capture raise. So "captured equals eager,
bitwise" is checked here on every machine; tests/test_gpu.py checks it again
with real CUDA graphs where there is a GPU.
"""
import pytest
import torch

from distributed import run_workers
from graph_emulator import EmulatedGraphAccelerator


@pytest.fixture
def emulated_graphs():
    from onebit.accelerator import set_accelerator

    set_accelerator(EmulatedGraphAccelerator())
    yield
    set_accelerator(None)


# ------------------------------------------------------------ the emulator --
def test_emulator_behaves_like_a_graph(emulated_graphs):
    """The emulator's own contract, so the tests below can trust it."""
    from onebit.accelerator import get_accelerator

    acc = get_accelerator()
    x, step, frozen = torch.zeros(3), torch.tensor(1.0), [2.0]
    g = acc.create_graph()
    with acc.capture_to_graph(g):
        y = x * step  # an intermediate made during capture
        x.add_(y).add_(frozen[0])
    assert torch.equal(x, torch.zeros(3)), "capture must not leave its work done"
    acc.replay_graph(g)
    assert torch.equal(x, torch.full((3,), 2.0))  # 0 + 0*1 + 2
    step.fill_(10.0)
    frozen[0] = 100.0  # a Python number read at capture stays as captured
    acc.replay_graph(g)
    assert torch.equal(x, torch.full((3,), 2.0 + 20.0 + 2.0))
    with pytest.raises(RuntimeError, match="host sync"):
        with acc.capture_to_graph(acc.create_graph()):
            float(x.sum())


# ----------------------------------------------------------- GraphedRegion --
def test_graphed_region_warms_up_captures_then_replays(emulated_graphs):
    from onebit.graphs import GraphedRegion, tensor_key

    region = GraphedRegion(warmup=2)
    x, inc = torch.zeros(4), torch.tensor(1.0)
    for call in range(1, 7):
        region(tensor_key([x, inc]), lambda: x.add_(inc))
        assert torch.equal(x, torch.full((4,), float(call))), f"call {call}"
    assert (region.eager_runs, region.captures, region.replays) == (2, 1, 4)
    inc.fill_(0.5)  # a device-tensor scalar: replays see the new value
    region(tensor_key([x, inc]), lambda: x.add_(inc))
    assert torch.equal(x, torch.full((4,), 6.5))
    x2 = torch.zeros(4)  # new address: the old graph would write the wrong tensor
    region(tensor_key([x2, inc]), lambda: x2.add_(inc))
    assert region.captures == 1 and region.eager_runs == 3 and torch.equal(x2, torch.full((4,), 0.5))


def test_graphed_region_runs_eagerly_without_graphs():
    from onebit.accelerator import CpuAccelerator
    from onebit.graphs import GraphedRegion

    region = GraphedRegion(accelerator=CpuAccelerator())
    x = torch.zeros(2)
    for _ in range(5):
        region("key", lambda: x.add_(1.0))
    assert torch.equal(x, torch.full((2,), 5.0))
    assert (region.eager_runs, region.captures, region.replays) == (5, 0, 0)


def test_graphed_region_rejects_bad_warmup():
    from onebit.graphs import GraphedRegion

    with pytest.raises(ValueError, match="warmup"):
        GraphedRegion(warmup=0)


# --------------------------------------------------------------- optimizer --
def _train(world_size, rank, graphs, capture, steps=24, dtype=torch.float32):
    """OnebitAdam on synthetic gradients with an lr that changes every step,
    weight decay on one group, a mask on the other, and one param without grad."""
    from onebit import OnebitAdam
    from onebit.accelerator import set_accelerator

    set_accelerator(EmulatedGraphAccelerator() if graphs else None)
    try:
        torch.manual_seed(0)
        a = [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in [(7, 5), (13,), (4, 3, 2)]]
        b = [torch.nn.Parameter(torch.randn(6)), torch.nn.Parameter(torch.randn(6))]
        mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
        opt = OnebitAdam([{"params": a, "weight_decay": 0.01}, {"params": b, "exp_avg_mask": mask}],
                         lr=1e-2, freeze_step=4, graph_capture=capture)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
        for t in range(1, steps + 1):
            gen = torch.Generator().manual_seed(1000 * t + rank)
            for p in a + b[:1]:  # b[1] never gets a gradient
                p.grad = torch.randn(p.shape, generator=gen).to(p.dtype) * (1 + rank)
            opt.step()
            sched.step()
        return [p.detach().clone() for p in a + b], opt.graph_stats()
    finally:
        set_accelerator(None)


def test_single_process_captured_step_equals_eager_bitwise():
    captured, stats = _train(1, 0, graphs=True, capture=True)
    eager, eager_stats = _train(1, 0, graphs=False, capture=True)
    assert stats["update"]["captures"] == 1 and stats["update"]["replays"] == 24 - 4 - 3
    assert eager_stats["update"]["captures"] == 0
    for c, e in zip(captured, eager):
        assert torch.equal(c, e)
    plain, _ = _train(1, 0, graphs=False, capture=False)
    for c, p in zip(captured, plain):  # graph_capture only changes the rounding
        torch.testing.assert_close(c, p, rtol=1e-5, atol=1e-6)


def test_low_precision_params_captured_equals_eager():
    captured, _ = _train(1, 0, graphs=True, capture=True, dtype=torch.bfloat16)
    eager, _ = _train(1, 0, graphs=False, capture=True, dtype=torch.bfloat16)
    for c, e in zip(captured, eager):
        assert torch.equal(c, e)


def _dist_compare(rank, world):
    import torch.distributed as dist

    captured, stats = _train(world, rank, graphs=True, capture=True)
    eager, _ = _train(world, rank, graphs=False, capture=True)
    plain, _ = _train(world, rank, graphs=False, capture=False)
    assert stats["momentum"]["replays"] > 0 and stats["update"]["replays"] > 0, stats
    for i, (c, e, p) in enumerate(zip(captured, eager, plain)):
        assert torch.equal(c, e), f"param {i}: captured differs from eager on rank {rank}"
        torch.testing.assert_close(c, p, rtol=1e-5, atol=1e-6)
        copies = [torch.empty_like(c) for _ in range(world)]
        dist.all_gather(copies, c)
        assert all(torch.equal(copies[0], x) for x in copies), f"param {i} differs across ranks"
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_distributed_captured_step_equals_eager_and_replicas_match(world_size):
    assert all(run_workers(_dist_compare, world_size, timeout=180))


def test_graph_capture_must_be_a_bool():
    from onebit import OnebitAdam

    with pytest.raises(ValueError, match="graph_capture"):
        OnebitAdam([torch.nn.Parameter(torch.zeros(2))], graph_capture="yes")
