"""What real models do to a 1-bit optimizer, on real gloo ranks: embedding rows
absent from every batch, parameters that never get a gradient, tensors whose
scales differ by orders of magnitude, and learning rates that reach 0."""
import math

import numpy as np
import pytest
import torch

from tests.distributed import run_workers

pytestmark = pytest.mark.slow  # multi-process training of small models; the fast tier (-m "not slow") leaves these out

ALL = ["OnebitAdam", "OnebitLamb", "ZeroOneAdam"]
STAGES = {  # short warmups, so both stages run within a few dozen steps
    "OnebitAdam": dict(freeze_step=6),
    "OnebitLamb": dict(freeze_step=6),
    "ZeroOneAdam": dict(var_freeze_step=6, var_update_scaler=1, local_step_scaler=4,
                        local_step_clipper=4),
}


class TinyLM(torch.nn.Module):
    """An embedding of 64 rows, a tiny scale-1e-3 gain, an unused head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(64, 16)
        self.gain = torch.nn.Parameter(torch.full((16,), 1e-3))
        self.out = torch.nn.Linear(16, 64)
        self.unused = torch.nn.Linear(16, 16)  # never in the graph: .grad stays None

    def forward(self, tokens):
        return self.out(self.emb(tokens) * (1.0 + self.gain))


def _train(rank, world, cls_name, steps, lr_lambda, unused_group=False, late_rows=False):
    import onebit

    model = TinyLM()
    params = model.parameters()
    if unused_group:  # a param group none of whose tensors ever gets a gradient
        unused = list(model.unused.parameters())
        params = [{"params": [p for p in model.parameters() if all(p is not u for u in unused)]},
                  {"params": unused}]
    opt = getattr(onebit, cls_name)(params, lr=1e-2, weight_decay=0.01, **STAGES[cls_name])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda else None
    unused0 = [p.detach().clone() for p in model.unused.parameters()]
    rare0 = model.emb.weight[48:].detach().clone()
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        # Rows 48..63 never appear; with late_rows, 48..55 do once v froze.
        high = 56 if late_rows and opt.counters["step"] >= 6 else 48
        tokens = torch.randint(0, high, (32,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(tokens), tokens)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched:
            sched.step()
        for p in model.parameters():
            assert torch.isfinite(p).all(), f"non-finite parameter after step {opt.counters['step']}"
    for p, p0 in zip(model.unused.parameters(), unused0):
        assert torch.equal(p, p0), "a parameter with no gradient moved"
    rare_moved = (model.emb.weight[48:] - rare0).abs().max().item()
    # numpy, not tensors: a tensor crosses the result queue by shared memory that
    # the worker takes with it when it exits.
    return [p.detach().numpy().copy() for p in model.parameters()], loss.item(), rare_moved


@pytest.mark.parametrize("unused_group", [False, True])
@pytest.mark.parametrize("cls_name", ALL)
def test_unused_params_and_absent_rows_stay_put_and_replicas_match(cls_name, unused_group):
    """A parameter without a gradient is bitwise unchanged (weight decay
    included); rows never seen move only by weight decay (v = 0: the 1-bit
    momentum may not move them); no NaN; identical replicas after a sync."""
    steps = 24  # a sync step for ZeroOneAdam's interval of 4
    outs = run_workers(_train, 3, cls_name, steps, None, unused_group, timeout=180)
    params0, loss, rare_moved = outs[0]
    assert math.isfinite(loss)
    # Weight decay alone moves an unseen row by lr * wd * |w| (LAMB: times a trust
    # ratio <= 10) per step: 24 * 1e-2 * 1e-2 * 4 * 10 < 0.01. A 1-bit momentum step
    # would move it by about lr = 1e-2 per step.
    assert rare_moved < 0.01, rare_moved
    for params, _, _ in outs[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(params0, params))


@pytest.mark.parametrize("cls_name", ALL)
def test_rows_first_seen_after_the_freeze_move_only_by_weight_decay(cls_name):
    """Rows 48..55 get gradients only after v froze, so their v is 0: the
    1-bit momentum (and 0/1 Adam's local momentum, which no exchange masks)
    must not move them; m / (sqrt(0) + eps) would move them by ~1e6 * lr."""
    outs = run_workers(_train, 3, cls_name, 24, None, False, True, timeout=180)
    for _, loss, rare_moved in outs:
        assert math.isfinite(loss)
        assert rare_moved < 0.01, rare_moved  # the bound of the test above


def _to_zero(step):
    return max(0.0, 1.0 - step / 16)


def test_zero_one_adam_with_a_schedule_that_reaches_zero():
    """lr falls to 0 within the local-step stage and stays there: the syncs
    average m itself (no division by sum(lr) = 0), nothing moves once lr is
    0, and the replicas are bitwise identical after the last sync."""
    outs = run_workers(_train, 2, "ZeroOneAdam", 28, _to_zero, timeout=180)
    (p0, loss, _), (p1, _, _) = outs
    assert math.isfinite(loss)
    assert all(np.array_equal(a, b) for a, b in zip(p0, p1))


def _lr_zero_group(rank, world):
    import onebit

    model = TinyLM()
    frozen = list(model.out.parameters())
    before = [p.detach().clone() for p in frozen]
    rest = [p for n, p in model.named_parameters() if not n.startswith("out.")]
    opt = onebit.ZeroOneAdam([{"params": rest}, {"params": frozen, "lr": 0.0}], lr=1e-2,
                             **STAGES["ZeroOneAdam"])
    g = torch.Generator().manual_seed(rank)
    for _ in range(20):
        tokens = torch.randint(0, 48, (32,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(tokens), tokens)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(frozen, before)), "an lr=0 group moved"
    m = [opt.state[p]["exp_avg"] for p in frozen]
    assert all(torch.isfinite(t).all() for t in m)
    return [t.numpy().copy() for t in m]


def test_zero_one_adam_group_at_lr_zero_keeps_finite_identical_momentum():
    m0, m1 = run_workers(_lr_zero_group, 2, timeout=120)
    assert all(np.array_equal(a, b) for a, b in zip(m0, m1)), "the lr=0 group's m differs after sync"


@pytest.mark.parametrize("unseen", [1, 40, 400])  # indices below 1/16 unseen, a 0/1 mask above
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_zero_variance_masks_zero_exactly_the_unseen_elements(unseen, layout):
    from onebit.optim.guards import ZeroVarianceGuard, mask_unseen_

    g = torch.Generator().manual_seed(unseen)
    v = torch.rand(8, 6, 4, 5, generator=g) + 0.1  # 960 elements
    v.view(-1)[torch.randperm(v.numel(), generator=g)[:unseen]] = 0.0
    t = torch.randn(v.shape, generator=g)
    if layout == "channels_last":
        v, t = (x.contiguous(memory_format=torch.channels_last) for x in (v, t))
    never = torch.zeros(3, 3)
    seen, masks = ZeroVarianceGuard().check(0, [v, never, v.clone().add_(1)], "frozen")
    assert seen == [True, False, True] and masks[1] is None and masks[2] is None
    assert masks[0].dtype == (torch.int64 if unseen * 16 <= v.numel() else torch.float32)
    expected = torch.where(v == 0, torch.zeros(()), t)  # independent of the guard's masks
    out = [t.clone(), torch.ones(3, 3), t.clone()]
    mask_unseen_(out, masks, seen)
    assert torch.equal(out[0], expected) and int((out[0] == 0).sum()) == unseen
    assert torch.equal(out[1], torch.zeros(3, 3)) and torch.equal(out[2], t)
