"""Graph capture of the optimizer step: captured equals eager, bitwise.

Every test runs with the CPU graph emulator (graph_emulator.py), which
behaves like a CUDA graph where code can go wrong: capture records without
running, replay re-runs with frozen Python numbers, and host syncs in a
capture raise. The "cuda" variants run the same checks with real CUDA
graphs where there is a GPU (marked gpu; skipped here, with the reason).
"""
import pytest
import torch

from tests.distributed import run_workers
from tests.graph_emulator import EmulatedGraphAccelerator
from onebit.accelerator import CpuAccelerator, CudaAccelerator

on_cuda = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here")])


class CudaWithoutGraphs(CudaAccelerator):
    """CUDA, with the graphed regions run eagerly: the reference for captures."""

    def graphs_supported(self):
        return False


def graphs_on(kind):
    """(accelerator with graphs, the same without, device) for a test kind."""
    if kind == "cuda":
        return CudaAccelerator(), CudaWithoutGraphs(), "cuda"
    return EmulatedGraphAccelerator(), CpuAccelerator(), "cpu"


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
@pytest.mark.parametrize("kind", ["emulated", on_cuda])
def test_graphed_region_warms_up_captures_then_replays(kind):
    from onebit.graphs import GraphedRegion, tensor_key

    acc, _, device = graphs_on(kind)
    region = GraphedRegion(warmup=2, accelerator=acc)
    x, inc = torch.zeros(4, device=device), torch.tensor(1.0, device=device)
    for call in range(1, 7):
        region(tensor_key([x, inc]), lambda: x.add_(inc))
        assert torch.equal(x.cpu(), torch.full((4,), float(call))), f"call {call}"
    assert (region.eager_runs, region.captures, region.replays) == (2, 1, 4)
    inc.fill_(0.5)  # a device-tensor scalar: replays see the new value
    region(tensor_key([x, inc]), lambda: x.add_(inc))
    assert torch.equal(x.cpu(), torch.full((4,), 6.5))
    x2 = torch.zeros(4, device=device)  # new address: the old graph would write the wrong tensor
    region(tensor_key([x2, inc]), lambda: x2.add_(inc))
    assert region.captures == 1 and region.eager_runs == 3
    assert torch.equal(x2.cpu(), torch.full((4,), 0.5))


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
# Both stage machines reach their graphed steps after step 4. 0/1 Adam's sync
# interval grows 1, 2, 4: local steps (graphed) between eager syncs.
CONFIGS = {"OnebitAdam": dict(freeze_step=4),
           "ZeroOneAdam": dict(var_freeze_step=4, var_update_scaler=2, local_step_scaler=4,
                               local_step_clipper=4)}
GRAPHED = {"OnebitAdam": ("momentum", "update"), "ZeroOneAdam": ("local step",)}


def _train(world_size, rank, graphs, capture, steps=24, dtype=torch.float32, kind="emulated",
           cls_name="OnebitAdam"):
    """An optimizer on synthetic gradients with an lr that changes every step,
    weight decay on one group, a mask on the other, and one param without grad."""
    import onebit
    from onebit.accelerator import set_accelerator

    with_graphs, without, device = graphs_on(kind)
    set_accelerator(with_graphs if graphs else without)
    try:
        torch.manual_seed(0)
        a = [torch.nn.Parameter(torch.randn(s).to(device, dtype)) for s in [(7, 5), (13,), (4, 3, 2)]]
        b = [torch.nn.Parameter(torch.randn(6, device=device)) for _ in range(2)]
        mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 1.0], device=device)
        opt = getattr(onebit, cls_name)(
            [{"params": a, "weight_decay": 0.01}, {"params": b, "exp_avg_mask": mask}],
            lr=1e-2, graph_capture=capture, **CONFIGS[cls_name])
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
        for t in range(1, steps + 1):
            gen = torch.Generator().manual_seed(1000 * t + rank)
            for p in a + b[:1]:  # b[1] never gets a gradient
                p.grad = torch.randn(p.shape, generator=gen).to(device, p.dtype) * (1 + rank)
            opt.step()
            sched.step()
        return [p.detach().cpu() for p in a + b], opt.graph_stats()
    finally:
        set_accelerator(None)


@pytest.mark.parametrize("cls_name", list(CONFIGS))
@pytest.mark.parametrize("kind", ["emulated", on_cuda])
def test_single_process_captured_step_equals_eager_bitwise(kind, cls_name):
    captured, stats = _train(1, 0, graphs=True, capture=True, kind=kind, cls_name=cls_name)
    eager, eager_stats = _train(1, 0, graphs=False, capture=True, kind=kind, cls_name=cls_name)
    for region in GRAPHED[cls_name]:
        assert stats[region]["captures"] == 1 and stats[region]["replays"] > 0, stats
        assert eager_stats[region]["captures"] == 0
    if cls_name == "OnebitAdam":  # every step after 4 warm-up + 3 eager runs replays
        assert stats["update"]["replays"] == 24 - 4 - 3
    for c, e in zip(captured, eager):
        assert torch.equal(c, e)
    plain, _ = _train(1, 0, graphs=False, capture=False, kind=kind, cls_name=cls_name)
    for c, p in zip(captured, plain):  # graph_capture only changes the rounding
        torch.testing.assert_close(c, p, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls_name", list(CONFIGS))
@pytest.mark.parametrize("kind", ["emulated", on_cuda])
def test_low_precision_params_captured_equals_eager(kind, cls_name):
    run = dict(capture=True, dtype=torch.bfloat16, kind=kind, cls_name=cls_name)
    captured, _ = _train(1, 0, graphs=True, **run)
    eager, _ = _train(1, 0, graphs=False, **run)
    for c, e in zip(captured, eager):
        assert torch.equal(c, e)


def _dist_compare(rank, world, cls_name, kind="emulated"):
    import torch.distributed as dist

    device = "cuda" if kind == "cuda" else "cpu"
    captured, stats = _train(world, rank, graphs=True, capture=True, cls_name=cls_name, kind=kind)
    eager, _ = _train(world, rank, graphs=False, capture=True, cls_name=cls_name, kind=kind)
    plain, _ = _train(world, rank, graphs=False, capture=False, cls_name=cls_name, kind=kind)
    assert all(stats[r]["replays"] > 0 for r in GRAPHED[cls_name]), stats
    for i, (c, e, p) in enumerate(zip(captured, eager, plain)):
        assert torch.equal(c, e), f"param {i}: captured differs from eager on rank {rank}"
        if kind != "cuda":  # on CUDA the rounding difference can grow (docs/usage.md)
            torch.testing.assert_close(c, p, rtol=1e-5, atol=1e-6)
        copies = [torch.empty_like(c, device=device) for _ in range(world)]
        dist.all_gather(copies, c.to(device))
        assert all(torch.equal(copies[0], x) for x in copies), f"param {i} differs across ranks"
    return True


@pytest.mark.slow
@pytest.mark.parametrize("cls_name", list(CONFIGS))
@pytest.mark.parametrize("world_size", [2, 3])
def test_distributed_captured_step_equals_eager_and_replicas_match(world_size, cls_name):
    # 24 steps end on a 0/1 Adam sync (interval 4), so its replicas must match too.
    assert all(run_workers(_dist_compare, world_size, cls_name, timeout=180))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
@pytest.mark.parametrize("cls_name", list(CONFIGS))
def test_distributed_cuda_graphs_equal_the_same_steps_without_graphs(cls_name):
    """Real CUDA graphs on 2 ranks sharing the GPU (cuda:gloo): the captured
    steps equal the same code run eagerly, bit for bit, on every rank."""
    backend = "nccl" if torch.cuda.device_count() >= 2 else "cuda:gloo"
    assert all(run_workers(_dist_compare, 2, cls_name, "cuda", timeout=240, backend=backend))


@pytest.mark.parametrize("cls_name", list(CONFIGS))
def test_graph_capture_must_be_a_bool(cls_name):
    import onebit

    with pytest.raises(ValueError, match="graph_capture"):
        getattr(onebit, cls_name)([torch.nn.Parameter(torch.zeros(2))], graph_capture="yes")


def _disagree_on_graph_capture(rank, world):
    from onebit import OnebitAdam

    try:
        OnebitAdam([torch.nn.Parameter(torch.zeros(4))], graph_capture=rank == 0)
    except ValueError as exc:
        return str(exc)
    return None


def test_ranks_must_agree_on_graph_capture():
    # It changes the rounding of the update, so mixed ranks would drift apart.
    for message in run_workers(_disagree_on_graph_capture, 2, timeout=120):
        assert message is not None and "hyper-parameters" in message


def _changes_mid_run(graphs):
    """OnebitAdam whose weight decay changes at step 9 (read from a device
    scalar), whose eps changes at step 12 and which reloads its own checkpoint
    at step 18: the last two must re-capture, not replay a stale graph."""
    from onebit import OnebitAdam
    from onebit.accelerator import set_accelerator

    set_accelerator(EmulatedGraphAccelerator() if graphs else CpuAccelerator())
    try:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s)) for s in [(9, 4), (17,)]]
        opt = OnebitAdam(params, lr=1e-2, freeze_step=2, graph_capture=True, weight_decay=0.01)
        for t in range(1, 27):
            gen = torch.Generator().manual_seed(t)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            if t == 9:
                opt.param_groups[0]["weight_decay"] = 0.05  # a device scalar: no re-capture
            if t == 12:
                opt.param_groups[0]["eps"] = 1e-3  # new denominators: new addresses
            if t == 18:
                before_load = opt.graph_stats()
                opt.load_state_dict(opt.state_dict())  # new state tensors
            opt.step()
        return [p.detach().clone() for p in params], (before_load, opt.graph_stats())
    finally:
        set_accelerator(None)


def test_changed_hyper_parameters_and_reloaded_state_recapture():
    captured, (before_load, after_load) = _changes_mid_run(graphs=True)
    eager, _ = _changes_mid_run(graphs=False)
    for c, e in zip(captured, eager):
        assert torch.equal(c, e)
    # Steps 3-11 and 12-17 each warm up (3 eager runs), capture once and
    # replay the rest; loading starts the regions afresh for steps 18-26.
    assert before_load["update"] == {"eager_runs": 6, "captures": 2, "replays": 6 + 3}
    assert after_load["update"] == {"eager_runs": 3, "captures": 1, "replays": 6}
