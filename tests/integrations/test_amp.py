"""onebit.amp.GradScaler: after any pattern of one-rank infs, every rank's
loss scale is the same, on 3 real gloo ranks, through the freeze; torch's
own GradScaler drifts apart there (and the optimizer warns once), which is
what the scaler is for. Under DDP with onebit's comm hook, 0/1 Adam's
replicas stay bitwise identical with it and drift apart without it."""
import warnings

import pytest
import torch

from tests.distributed import run_workers

NAMES = ["OnebitAdam", "OnebitLamb", "ZeroOneAdam"]
INIT_SCALE = 2.0 ** 10
INFS = {2: 1, 6: 2, 9: 0, 10: 2}  # step -> the one rank whose gradient gets an inf


def _make(name, params):
    import onebit

    if name == "ZeroOneAdam":
        return onebit.ZeroOneAdam(params, lr=1e-2, var_freeze_step=4, var_update_scaler=1)
    return getattr(onebit, name)(params, lr=1e-2, freeze_step=4)


def _scaler(kind):
    import onebit

    cls = onebit.amp.GradScaler if kind == "onebit" else torch.amp.GradScaler
    return cls("cpu", init_scale=INIT_SCALE, growth_interval=10_000)  # no growth in 12 steps


def _scaled_run(rank, world, name, kind):
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt, scaler = _make(name, model.parameters()), _scaler(kind)
    scales, params = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(1, 13):
            g = torch.Generator().manual_seed(100 * t + rank)
            opt.zero_grad()
            scaler.scale(model(torch.randn(8, 6, generator=g)).pow(2).mean()).backward()
            if INFS.get(t) == rank:
                model[0].weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist())
    drift = [str(w.message) for w in caught if "loss scales now differ" in str(w.message)]
    return {"scales": scales, "params": params, "drift_warnings": len(drift),
            "skipped": opt.comm_stats()["skipped_steps"]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", NAMES)
def test_every_ranks_scale_backs_off_together_after_one_rank_infs(name):
    out = run_workers(_scaled_run, 3, name, "onebit", timeout=120)
    # An independent count: 4 steps had an inf somewhere, each halves the scale once.
    expected, scale = [], INIT_SCALE
    for t in range(1, 13):
        scale *= 0.5 if t in INFS else 1.0
        expected.append(scale)
    for r in out:
        assert r["scales"] == expected
        assert r["params"] == out[0]["params"]  # bitwise, after every step
        assert r["drift_warnings"] == 0 and r["skipped"] == len(INFS)


@pytest.mark.timeout(300)
def test_torchs_scaler_drifts_apart_there_and_the_optimizer_says_so():
    out = run_workers(_scaled_run, 3, "OnebitAdam", "torch", timeout=120)
    assert out[0]["scales"] != out[1]["scales"]  # rank 1 backed off at step 2, rank 0 did not
    assert out[1]["scales"][1] == INIT_SCALE / 2 and out[0]["scales"][1] == INIT_SCALE
    assert all(r["drift_warnings"] == 1 for r in out)  # once, not at every such step
    for r in out:  # the optimizer still skipped on every rank
        assert r["params"] == out[0]["params"] and r["skipped"] == len(INFS)


def _ddp_zero_one_adam(rank, world, kind):
    import onebit

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)))
    # v updates at steps 1, 2, 4, 8, 16 (full-precision averages through the
    # hook), 1-bit gradients between them, frozen from 17.
    opt = onebit.ZeroOneAdam(model.parameters(), lr=1e-2, var_freeze_step=16,
                             var_update_scaler=1)
    model.register_comm_hook(opt.ddp_hook_state(), onebit.ddp_comm_hook)
    scaler = _scaler(kind)
    first_difference = None
    for t in range(1, 25):
        g = torch.Generator().manual_seed(100 * t + rank)
        opt.zero_grad()
        scaler.scale(model(torch.randn(8, 6, generator=g)).pow(2).mean()).backward()
        if t == 3 and rank == 1:  # a 1-bit step: the inf stays on rank 1
            model.module[0].weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        every = [torch.empty_like(flat) for _ in range(world)]
        torch.distributed.all_gather(every, flat)
        if first_difference is None and any(not torch.equal(e, every[0]) for e in every):
            first_difference = t
    return first_difference


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_hook_zero_one_adam_replicas_stay_identical_with_one_rank_infs():
    assert run_workers(_ddp_zero_one_adam, 2, "onebit", timeout=120) == [None, None]
    # torch's scaler: rank 1 scales by half from step 4 on, and the next
    # full-precision average (step 4) mixes the two scales.
    drifted = run_workers(_ddp_zero_one_adam, 2, "torch", timeout=120)
    assert drifted[0] is not None and drifted[0] == drifted[1]


# ------------------------------- DiLoCo with fp16 (issue 46 item 1) --
DILOCO_INFS = {2: [1], 6: [2], 7: [0], 11: [1, 2], 13: [2]}  # iteration -> ranks with an inf


def _diloco_scaled_loop(rank, fragments, kind, scheduled=False):
    """A fixed-length loop of 16 iterations of DiLoCo over inner AdamW, the
    loss scaled by a `kind` GradScaler, infs on the ranks DILOCO_INFS says;
    yields (diloco, scaler) after each iteration. `scheduled`: an outer lr
    that changes at every inner step."""
    import onebit

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer_lr = (lambda inner_steps: 1.0 + 0.05 * inner_steps) if scheduled else 1.3
    diloco = onebit.DiLoCo(model, inner, sync_every=4, fragments=fragments, outer_lr=outer_lr,
                           overlap_steps=1 if fragments > 1 else 0, timeout_s=30)
    scaler = _scaler(kind)
    for t in range(1, 17):  # a loop of fixed length, as scripts are written
        g = torch.Generator().manual_seed(100 * t + rank)
        inner.zero_grad()
        scaler.scale(model(torch.randn(8, 6, generator=g)).pow(2).mean()).backward()
        if rank in DILOCO_INFS.get(t, []):
            model[0].weight.grad[0, 0] = float("inf")
        scaler.step(inner)
        scaler.update()
        yield diloco, scaler


def _diloco_with_scaler(rank, world, fragments):
    seen = []
    for diloco, scaler in _diloco_scaled_loop(rank, fragments, "onebit"):
        seen.append((diloco.inner_steps, diloco.rounds, scaler.get_scale(),
                     [a.tolist() for a in diloco.anchors]))
    diloco.close()
    return seen, diloco.rounds, [a.tolist() for a in diloco.anchors]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fragments", [1, 2])
def test_diloco_with_the_scaler_and_one_rank_infs_runs_a_fixed_loop_to_the_end(fragments):
    """Every rank skips the inner step where any rank found an inf, so the
    rounds come at the same iterations everywhere and every landing is the
    same point, bit for bit; before, the ranks' collectives crossed (a gloo
    abort, or garbage round numbers) two iterations after the first inf."""
    out = run_workers(_diloco_with_scaler, 3, fragments, timeout=120)
    steps_taken = 16 - len(DILOCO_INFS)
    for seen, rounds, anchors in out:
        assert seen == out[0][0]  # inner steps, rounds, scale and the landed point, every iteration
        assert seen[-1][0] == steps_taken and rounds == out[0][1] and anchors == out[0][2]
    assert out[0][1] >= steps_taken // 4 - 1  # the rounds did run
    scales = [s[2] for s in out[0][0]]
    assert scales[-1] == INIT_SCALE * 0.5 ** len(DILOCO_INFS)


def _diloco_with_torchs_scaler(rank, world, fragments, scheduled=False):
    landed = {}  # rounds -> the anchors once that many outer steps had landed
    for diloco, _ in _diloco_scaled_loop(rank, fragments, "torch", scheduled):  # a rank that skipped
        landed[diloco.rounds] = [a.tolist() for a in diloco.anchors]  # ends behind
    diloco.close()  # joins the rounds the others launched and this rank did not reach
    landed[diloco.rounds] = [a.tolist() for a in diloco.anchors]
    return landed, diloco.inner_steps, diloco.rounds


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scheduled", [False, True], ids=["constant outer lr", "scheduled"])
@pytest.mark.parametrize("fragments", [1, 2])
def test_diloco_with_torchs_scaler_ends_a_fixed_loop_on_one_point(fragments, scheduled):
    """torch's GradScaler skips an inner step on the rank that overflowed
    alone, so that rank makes each later round a step after the others and
    ends the loop a round behind; close() makes it join the rounds the
    others launched. Before, the others waited in that round's agreement
    until the deadline (a CommunicationError), or the job aborted. Under an
    outer lr scheduled by the inner step, each round reads it at its place
    in the schedule on every rank: the rank behind lands its last rounds at
    another inner step than its peers (in close()), and it read the lr
    there, so its final point differed."""
    out = run_workers(_diloco_with_torchs_scaler, 3, fragments, scheduled, timeout=150)
    skipped = [sum(rank in ranks for ranks in DILOCO_INFS.values()) for rank in range(3)]
    assert [steps for _, steps, _ in out] == [16 - k for k in skipped]  # they did lag
    rounds = out[0][2]
    assert all(r == rounds for _, _, r in out) and rounds >= 16 // 4 * fragments - fragments
    for k in out[0][0]:  # every landing seen on several ranks is the same point, bit for bit
        points = [landed[k] for landed, _, _ in out if k in landed]
        assert all(p == points[0] for p in points), k
    assert all(landed[rounds] == out[0][0][rounds] for landed, _, _ in out)


def _a_rank_without_gradients(rank, world, everyone):
    """A step whose loss reaches the optimizer's params on rank 0 only (or on
    no rank): torch's GradScaler records no found-inf flag where no param
    has a gradient, and hands step() the int 0."""
    import onebit

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = onebit.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2, timeout_s=20)
    scaler = onebit.amp.GradScaler("cpu", init_scale=4.0)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.ones(3, 4, requires_grad=True)
    opt.zero_grad(set_to_none=True)
    scaler.scale(model(x).sum() if rank == 0 and not everyone else x.sum()).backward()
    scaler.step(opt)
    scaler.update()
    moved = [not torch.equal(a, p) for a, p in zip(before, model.parameters())]
    return opt.counters["step"], scaler.get_scale(), moved, flat_of(model)


def flat_of(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("everyone", [False, True], ids=["one rank", "every rank"])
def test_a_rank_whose_params_got_no_gradient_steps_with_the_others(everyone):
    """It raised AttributeError ('int' object has no attribute 'to') and its
    peers waited out the deadline, blaming a dead rank; under update() it
    skipped the gather the others made. Now the step runs on every rank (a
    missing gradient counts as zero, as without a scaler) and the scales
    agree."""
    out = run_workers(_a_rank_without_gradients, 2, everyone, timeout=90)
    assert [o[0] for o in out] == [1, 1] and out[0][1] == out[1][1] == 4.0, out
    assert out[0][3] == out[1][3]  # the same params on both ranks
    assert all(moved == [not everyone] * 2 for _, _, moved, _ in out), out


def _fails_then_steps(rank, world, fail_first):
    import onebit

    p = torch.nn.Parameter(torch.zeros(8))
    opt = onebit.OnebitAdam([p], lr=1e-2, freeze_step=5, communication_data_type="fp16")
    scaler = onebit.amp.GradScaler("cpu", init_scale=4.0)
    refused = None
    if fail_first:  # rank 1's unscaled share, 1.5e5, is beyond fp16: the step raises
        scaler.scale((p * torch.full((8,), 3e5 if rank == 1 else 1.0)).sum()).backward()
        try:
            scaler.step(opt)
        except ValueError as exc:
            refused = str(exc)
        scaler.update()
        p.grad = None
    scaler.scale((p * (torch.arange(8.0) + rank)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    return refused, opt.state[p]["exp_avg"].tolist()


@pytest.mark.timeout(120)
def test_a_step_that_raised_under_a_scaler_leaves_no_scale_behind():
    """torch's GradScaler removes the scale it hands step() only after a
    step that returned: after a refused step the next one multiplied the two
    scales and divided the gradients by 16, not 4. The momentum after one
    step is (1 - beta1) x the ranks' mean unscaled gradient, 0.1 x (i + 0.5)."""
    out = run_workers(_fails_then_steps, 2, True, timeout=90)
    want = [0.1 * (i + 0.5) for i in range(8)]
    for refused, m in out:
        assert refused is not None and "float16's range" in refused, refused
        assert torch.allclose(torch.tensor(m), torch.tensor(want)), m


def _fused_torch_optimizer(rank, world):
    import onebit

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = onebit.amp.GradScaler("cpu", init_scale=4.0)
    moved = []
    for t in range(3):
        before = flat_of(model)
        opt.zero_grad()
        scaler.scale(model(torch.randn(5, 4, generator=torch.Generator().manual_seed(t)))
                     .sum()).backward()
        if t == 1 and rank == 1:
            model.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        moved.append(flat_of(model) != before)
    return moved, scaler.get_scale()


@pytest.mark.timeout(120)
def test_a_fused_torch_optimizer_skips_on_every_rank_where_one_found_an_inf():
    """torch's fused AdamW takes found-inf into its kernel, and the scaler
    left the agreement to it as it does to the onebit optimizers: the rank
    that found the inf skipped alone. The scaler now agrees in step() for
    every optimizer but onebit's, which agree themselves."""
    out = run_workers(_fused_torch_optimizer, 2, timeout=90)
    assert [moved for moved, _ in out] == [[True, False, True]] * 2, out
    assert out[0][1] == out[1][1] == 2.0  # one backoff, on both
