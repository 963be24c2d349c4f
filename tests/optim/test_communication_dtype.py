"""communication_data_type: the full-precision exchanges (warmup, 0/1 Adam's
variance steps, the DDP hook in those steps) in bf16 or fp16.

The mean is checked against numpy: each rank's share (gradient / world, in
fp32) rounded to the half dtype, summed exactly in float64 and rounded once
more. bf16 rounding is written here from its definition (round to nearest
even on the top 16 bits of the fp32), not taken from torch."""
import copy

import numpy as np
import pytest
import torch

from tests.distributed import run_workers

SHAPES = [(7, 5), (13,), (301,)]  # 349 elements: not a multiple of 2 or 3
NUMEL = 349


# The optimizer averages its fused buffer, where each tensor but the last
# starts on a 256-element block, pads and all: 256 + 256 + 301 elements.
FUSED = sum(-(-int(np.prod(s)) // 256) * 256 for s in SHAPES[:-1]) + int(np.prod(SHAPES[-1]))


def ring_bytes(world, itemsize, numel=NUMEL):
    """What a rank sends in a ring all-reduce of `numel` elements: 2 (p-1)/p of them."""
    return 2 * (world - 1) * itemsize * numel // world
SCALES = [1e-3, 1.0, 40.0]  # orders of magnitude apart
BETA1 = 0.9


def to_bf16(x):
    """float32 -> the nearest bf16 (ties to even), as float32 values."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def to_half(x, name):
    x = np.asarray(x, dtype=np.float32)
    return to_bf16(x) if name == "bf16" else x.astype(np.float16).astype(np.float32)


UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}


def local_grad(rank, step, i):
    g = torch.Generator().manual_seed(7919 * step + 31 * rank + i)
    return (torch.randn(SHAPES[i], generator=g) * SCALES[i] * (1 + rank)).numpy()


def reference_mean(world, step, i, name):
    """(the mean as the half-precision exchange computes it when world == 2
    (with more ranks the transport's order of additions matters), a bound
    on its error at any world size, the fp32 mean)."""
    shares = [to_half(np.float32(local_grad(r, step, i)) / np.float32(world), name)
              for r in range(world)]
    exact = np.sum([s.astype(np.float64) for s in shares], axis=0)
    bound = world * UNIT_ROUNDOFF[name] * np.sum([np.abs(s.astype(np.float64)) for s in shares],
                                                 axis=0)
    fp32 = np.sum([np.float32(local_grad(r, step, i)) for r in range(world)], axis=0) / world
    return to_half(exact, name), bound, fp32


# ------------------------------------------------- the optimizer's mean --
def _warmup_mean(rank, world, name):
    import onebit

    params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    opt = onebit.OnebitAdam(params, lr=1e-3, freeze_step=5, communication_data_type=name)
    for i, p in enumerate(params):
        p.grad = torch.from_numpy(local_grad(rank, 1, i))
    before = opt.traffic.snapshot()
    opt.step()
    moved = opt.traffic.since(before)
    out = []
    for i, p in enumerate(params):
        mean, bound, fp32 = reference_mean(world, 1, i, name)
        got = opt.state[p]["exp_avg"].numpy() / np.float32(1 - BETA1)
        # exp_avg after step 1 is (1 - beta1) * mean, one fp32 rounding away.
        if world == 2:  # one addition per element: exactly the numpy mean
            exp_avg = opt.state[p]["exp_avg"]
            exchanged = torch.lerp(torch.zeros(SHAPES[i]), torch.from_numpy(mean),
                                   1.0 - BETA1)
            assert torch.equal(exp_avg, exchanged), f"param {i}: not the numpy mean's bits"
        exact = np.sum([local_grad(r, 1, i).astype(np.float64) for r in range(world)],
                       axis=0) / world
        assert np.all(np.abs(got - exact) <= bound * 1.01), f"param {i}: outside the bound"
        assert not np.allclose(got, fp32, rtol=1e-6, atol=0), f"param {i}: an fp32 mean"
        out.append(bool(np.all(np.isfinite(got))))
    return all(out), (moved["bytes_sent"], moved["fp32_bytes"])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_warmup_mean_is_the_half_precision_mean_of_numpy_and_half_the_bytes(name, world):
    results = run_workers(_warmup_mean, world, name, timeout=120)
    assert all(ok for ok, _ in results)
    # sent: the fused buffer in half precision; the fp32 baseline: the params' elements
    assert all(moved == (ring_bytes(world, 2, FUSED), ring_bytes(world, 4)) for _, moved in results)


# --------------------------------------------------- the DDP hook's mean --
def _hooked_mean(rank, world, name, device="cpu"):
    """The DDP hook's half-precision mean of a model on `device`, bitwise
    numpy's (asserted here; the GPU tier calls it with a CUDA device)."""
    import onebit

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(),
                                torch.nn.Linear(9, 3)).to(device)
    plain = copy.deepcopy(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = onebit.OnebitAdam(ddp.parameters(), lr=1e-3, freeze_step=5,
                            communication_data_type=name)
    ddp.register_comm_hook(opt.ddp_hook_state(), onebit.ddp_comm_hook)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 6, generator=g) * (1 + rank), torch.randn(8, 3, generator=g)
    x, y = x.to(device), y.to(device)
    torch.nn.functional.mse_loss(plain(x), y).backward()
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    import torch.distributed as dist

    for a, b in zip(plain.parameters(), ddp.module.parameters()):
        shares = [torch.empty_like(a.grad) for _ in range(world)]
        dist.all_gather(shares, a.grad)  # every rank's local gradient
        half = [to_half(s.cpu().numpy() / np.float32(world), name).astype(np.float64)
                for s in shares]
        expected = to_half(np.sum(half, axis=0), name)
        np.testing.assert_array_equal(b.grad.cpu().numpy(), expected)
    return True


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_ddp_hook_averages_the_warmup_in_the_half_dtype(name):
    assert run_workers(_hooked_mean, 2, name, timeout=120) == [True, True]


# ------------------------------------------------------- fp16 overflow --
def _fp16_overflow(rank, world, case):
    import onebit

    params = [torch.nn.Parameter(torch.full(s, 0.5)) for s in SHAPES]
    # Two groups: the overflow is in the second, after the first's mean landed.
    opt = onebit.OnebitAdam([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2,
                            freeze_step=5, communication_data_type="fp16")
    for i, p in enumerate(params):
        p.grad = torch.from_numpy(local_grad(rank, 1, i))
    if case == "share" and rank == 1:
        params[2].grad[4] = 3e5  # finite in fp32; its share 1.5e5 is beyond fp16
    if case == "sum":
        params[2].grad[4] = 1e5  # shares of 5e4 each, within fp16; their sum is not
    with pytest.raises(ValueError, match="float16's range"):
        opt.step()
    assert opt.counters["step"] == 0
    assert all(torch.equal(p, torch.full(s, 0.5)) for p, s in zip(params, SHAPES))
    assert not any(opt.state[p] for p in params)
    for i, p in enumerate(params):  # the next step goes on as if the bad one never came
        p.grad = torch.from_numpy(local_grad(rank, 2, i))
    opt.step()
    assert opt.counters["step"] == 1
    return [p.detach().tolist() for p in params]  # lists: tensors do not outlive the rank


@pytest.mark.slow
@pytest.mark.parametrize("case", ["share", "sum"])
def test_fp16_mean_out_of_range_raises_on_every_rank_and_changes_nothing(case):
    first, second = run_workers(_fp16_overflow, 2, case, timeout=120)
    assert first == second


def _fp16_hook_overflow(rank, world):
    import onebit

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = onebit.OnebitAdam(ddp.parameters(), lr=1e-3, freeze_step=5,
                            communication_data_type="fp16")
    ddp.register_comm_hook(opt.ddp_hook_state(), onebit.ddp_comm_hook)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.ones(4, 6)
    (ddp(x).sum() * (1e7 if rank == 1 else 1.0)).backward()  # rank 1's share beyond 65504
    with pytest.raises(ValueError, match="communication_data_type='fp16'"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt.counters["step"] == 0
    return True


@pytest.mark.slow
def test_fp16_overflow_through_the_ddp_hook_raises_naming_the_setting():
    assert run_workers(_fp16_hook_overflow, 2, timeout=120) == [True, True]


# -------------------------------------------------- through both stages --
RUNS = {
    "OnebitAdam": dict(freeze_step=8, lr=1e-2),
    "OnebitLamb": dict(freeze_step=8, lr=1e-2),
    "ZeroOneAdam": dict(var_freeze_step=8, var_update_scaler=2, local_step_scaler=4,
                        local_step_clipper=2, lr=1e-2),
}


def _both_stages(rank, world, cls_name, name):
    import torch.distributed as dist

    import onebit

    params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)))
              for i, s in enumerate(SHAPES)]
    opt = getattr(onebit, cls_name)(params, communication_data_type=name, **RUNS[cls_name])
    for t in range(1, 17):
        for i, p in enumerate(params):
            p.grad = torch.from_numpy(local_grad(rank, t, i))
        opt.step()
        if not opt.last_stage.replicas_match:  # 0/1 Adam's local steps differ by design
            continue
        for p in params:
            copies = [torch.empty_like(p) for _ in range(world)]
            dist.all_gather(copies, p.detach())
            assert all(torch.equal(copies[0], c) for c in copies[1:]), f"step {t}"
    return opt.traffic.snapshot()


@pytest.mark.slow
@pytest.mark.parametrize("cls_name", sorted(RUNS))
def test_replicas_stay_identical_through_both_stages_on_3_ranks(cls_name):
    halves = run_workers(_both_stages, 3, cls_name, "bf16", timeout=180)
    fulls = run_workers(_both_stages, 3, cls_name, None, timeout=180)
    # Each full-precision exchange sends half the bytes, and nothing else changed.
    calls = halves[0]["calls"]
    assert calls == fulls[0]["calls"] > 0
    assert halves[0]["bytes_sent"] == calls * ring_bytes(3, 2, FUSED)
    assert fulls[0]["bytes_sent"] == calls * ring_bytes(3, 4, FUSED)


# --------------------------------------------------------- bad settings --
def _disagree(rank, world):
    import onebit

    p = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match="communication_data_type"):
        onebit.OnebitAdam([p], communication_data_type="bf16" if rank else "fp32")
    return True


@pytest.mark.slow
def test_ranks_that_disagree_on_the_dtype_fail_at_construction():
    assert run_workers(_disagree, 2, timeout=120) == [True, True]


@pytest.mark.parametrize("bad", ["int8", "half", torch.float64, 16])
def test_a_dtype_that_is_not_fp32_bf16_or_fp16_is_refused(bad):
    import onebit

    with pytest.raises(ValueError, match="communication_data_type must be"):
        onebit.OnebitLamb([torch.nn.Parameter(torch.zeros(3))], communication_data_type=bad)


@pytest.mark.parametrize("given", [None, "fp32", "float32", "bf16", "BF16", torch.bfloat16,
                                   "fp16", "float16", torch.float16])
def test_names_and_dtypes_are_accepted(given):
    import onebit

    opt = onebit.ZeroOneAdam([torch.nn.Parameter(torch.zeros(3))], communication_data_type=given)
    expected = {None: torch.float32, "fp32": torch.float32, "float32": torch.float32,
                "bf16": torch.bfloat16, "BF16": torch.bfloat16, "fp16": torch.float16,
                "float16": torch.float16}
    assert opt.averaging_dtype == expected.get(given, given)


def test_deepspeed_configs_top_level_key_reaches_the_1bit_optimizers():
    import onebit
    from onebit.config import read_config

    lamb = read_config({"optimizer": {"type": "Lamb", "params": {}},
                        "communication_data_type": "bf16"})  # a OnebitLamb kept in warmup
    assert lamb.extra_kwargs == {"communication_data_type": "bf16"}
    config = {"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 5}},
              "communication_data_type": "bf16"}
    reading = read_config(config)
    assert reading.extra_kwargs == {"communication_data_type": "bf16"}
    opt = onebit.build_optimizer([torch.nn.Parameter(torch.zeros(3))], config)
    assert opt.averaging_dtype == torch.bfloat16
    # The optimizer's own setting wins; torch's Adam gets advice instead.
    config["optimizer"]["params"]["communication_data_type"] = "fp16"
    assert onebit.build_optimizer([torch.nn.Parameter(torch.zeros(3))],
                                  config).averaging_dtype == torch.float16
    adam = read_config({"optimizer": {"type": "Adam", "params": {}},
                               "communication_data_type": "fp16"})
    assert adam.extra_kwargs == {}
    assert ("communication_data_type", "advice") in [(k, v) for k, v, _ in adam.notes]
    for kind in ("ZeroOneAdam", "Adam"):
        with pytest.raises(ValueError, match="communication_data_type must be"):
            read_config({"optimizer": {"type": kind, "params": {}},
                         "communication_data_type": "int8"})
