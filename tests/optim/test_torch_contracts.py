"""torch.optim's contracts that users rely on without reading our docs
(issue 70 item 2), for each optimizer in its warmup and past its freeze, at
world size 1 (no process group): copies, state entries that are no
param's, load_state_dict post-hooks, a `.grad` left alone by clipping, and
a one-element tensor lr. Each is compared with the original optimizer or
with torch's own behaviour, not with numbers this code produced."""
import copy
import pickle

import pytest
import torch

from onebit import OnebitAdam, OnebitLamb, ZeroOneAdam

OPTIMIZERS = [OnebitAdam, OnebitLamb, ZeroOneAdam]
STAGES = {"warmup": 2, "frozen": 6}  # steps taken before the test; the freeze is at 3


def build(cls, seed=0, **kw):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    freeze = ({"var_freeze_step": 3, "local_step_scaler": 2, "local_step_clipper": 2}
              if cls is ZeroOneAdam else {"freeze_step": 3})
    return model, cls(model.parameters(), **{"lr": 1e-2, "weight_decay": 1e-3, **freeze, **kw})


def gradients(model, t):
    g = torch.Generator().manual_seed(t)
    x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
    for p in model.parameters():
        p.grad = None
    torch.nn.functional.mse_loss(model(x), y).backward()


def train(model, opt, ts):
    for t in ts:
        gradients(model, t)
        opt.step()


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def tensors_of(state_dict):
    """Every tensor of a state_dict's per-param state, by (index, name)."""
    return {(k, name): v for k, st in state_dict["state"].items() if isinstance(st, dict)
            for name, v in st.items() if torch.is_tensor(v)}


@pytest.fixture(params=OPTIMIZERS, ids=lambda c: c.__name__)
def cls(request):
    return request.param


@pytest.fixture(params=sorted(STAGES))
def stage(request):
    return request.param


# ------------------------------------------------------------- copies --
def pickled(obj):
    return pickle.loads(pickle.dumps(obj))


@pytest.mark.parametrize("copier", [copy.deepcopy, pickled], ids=["deepcopy", "pickle"])
def test_a_copy_steps_and_saves_as_the_original(cls, stage, copier):
    """EMA/SWA utilities and some trainers deep-copy an optimizer (with its
    model): the copy failed with AttributeError: _channel. It now steps and
    saves as the original does, bit for bit, and is independent of it."""
    model, opt = build(cls)
    train(model, opt, range(1, STAGES[stage] + 1))
    model2, opt2 = copier((model, opt))
    assert opt2.counters == opt.counters and opt2.counters is not opt.counters
    train(model, opt, range(100, 104))
    train(model2, opt2, range(100, 104))
    assert torch.equal(flat(model), flat(model2))
    assert opt2.stage() == opt.stage()
    mine, theirs = tensors_of(opt.state_dict()), tensors_of(opt2.state_dict())
    assert mine.keys() == theirs.keys()
    for key in mine:
        assert torch.equal(mine[key], theirs[key]), key
    # independent: a step of the copy leaves the original alone
    before = flat(model).clone()
    train(model2, opt2, [200])
    assert torch.equal(flat(model), before) and opt.counters != opt2.counters


# ------------------------------------------- state entries of no param --
def test_a_state_entry_of_no_param_survives_a_round_trip(cls, stage):
    """torch keeps `opt.state` entries keyed by something other than a param
    (its own hook tests write one); state_dict() and load_state_dict()
    crashed on them."""
    model, opt = build(cls)
    train(model, opt, range(1, STAGES[stage] + 1))
    opt.state["note"] = 1
    saved = opt.state_dict()
    assert saved["state"]["note"] == 1
    model2, opt2 = build(cls)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(copy.deepcopy(saved))
    assert opt2.state["note"] == 1
    train(model, opt, range(100, 103))
    train(model2, opt2, range(100, 103))
    assert torch.equal(flat(model), flat(model2))


# ------------------------------------------------ load post-hooks --
def test_a_load_post_hook_runs_once_the_load_is_done(cls, stage):
    """torch runs `register_load_state_dict_post_hook` hooks when the load is
    complete. They ran inside torch's part of it: a hook saw the counters
    with the checkpoint's bookkeeping keys still in them, and onebit's part
    ran after it. The hook now sees the counters the optimizer goes on with,
    and what it sets stays."""
    model, opt = build(cls)
    train(model, opt, range(1, STAGES[stage] + 1))
    saved = opt.state_dict()
    model2, opt2 = build(cls)
    model2.load_state_dict(model.state_dict())
    seen = []

    def hook(optimizer):
        seen.append(dict(optimizer.counters))
        first = optimizer.param_groups[0]["params"][0]
        optimizer.state[first]["exp_avg"] = torch.full_like(first, 0.25, dtype=torch.float32)
        optimizer.param_groups[0]["lr"] = 0.5

    opt2.register_load_state_dict_post_hook(hook)
    opt2.load_state_dict(saved)
    assert len(seen) == 1
    assert seen[0] == opt2.counters == opt.counters
    first = opt2.param_groups[0]["params"][0]
    assert torch.equal(opt2.state[first]["exp_avg"], torch.full_like(first, 0.25))
    assert opt2.param_groups[0]["lr"] == 0.5


# --------------------------------------------------------- clipping --
def test_clipping_leaves_the_users_grad_as_it_was(cls, stage):
    """torch's optimizers never write `.grad`; with max_grad_norm > 0 the
    step rescaled it in place. It clips a copy now, and steps as an
    optimizer without clipping stepped on gradients clipped by
    torch.nn.utils.clip_grad_norm_."""
    clipped_model, clipped = build(cls, max_grad_norm=0.05)
    plain_model, plain = build(cls)
    for t in range(1, STAGES[stage] + 4):
        gradients(clipped_model, t)
        gradients(plain_model, t)
        grads = [p.grad.clone() for p in clipped_model.parameters()]
        clipped.step()
        for p, g in zip(clipped_model.parameters(), grads):
            assert torch.equal(p.grad, g), f"step {t} wrote .grad"
        norm = torch.nn.utils.clip_grad_norm_(list(plain_model.parameters()), 0.05)
        assert norm > 0.05  # (the test clips at every step)
        plain.step()
        torch.testing.assert_close(flat(clipped_model), flat(plain_model), rtol=1e-5, atol=1e-6)


# -------------------------------------------------------- tensor lr --
def test_a_one_element_tensor_lr_trains_as_the_float(cls, stage):
    """torch accepts any one-element tensor lr; shape [1] was refused. It
    trains as the float it holds (fp32's 0.01, not Python's)."""
    lr = torch.tensor([1e-2])
    float_model, by_float = build(cls, lr=lr.item())
    tensor_model, by_tensor = build(cls, lr=lr)
    for model, opt in ((float_model, by_float), (tensor_model, by_tensor)):
        train(model, opt, range(1, STAGES[stage] + 4))
    assert torch.equal(flat(float_model), flat(tensor_model))
    assert by_tensor.param_groups[0]["lr"] is lr  # (a scheduler updates it in place)


def test_a_tensor_lr_of_several_elements_is_refused(cls):
    with pytest.raises(ValueError, match=r"lr must be .*tensor\(\[0\.0100, 0\.0100\]\)"):
        build(cls, lr=torch.tensor([1e-2, 1e-2]))


def _copy_across_ranks(rank, world):
    model, opt = build(OnebitAdam)
    with pytest.raises(TypeError, match="cannot be copied or pickled across 2 ranks"):
        copy.deepcopy(opt)
    with pytest.raises(TypeError, match="state_dict"):
        pickle.dumps(opt)
    train(model, opt, [1])  # (the refusal left it as it was)
    return opt.counters["step"]


@pytest.mark.slow
def test_a_copy_across_ranks_is_refused_with_what_to_do_instead():
    """Past one rank the optimizer holds the process group and the backend
    its peers exchange with, which no copy can share."""
    from tests.distributed import run_workers

    assert run_workers(_copy_across_ranks, 2, timeout=60) == [1, 1]


def test_a_complex_param_is_refused_at_construction(cls):
    """torch's conformance suite (test_complex) found a complex param
    accepted and its imaginary part wiped at the first step (the fp32 cast
    of the gradient). The optimizers and DiLoCo refuse it, naming it."""
    import onebit

    z = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"param 1 \(3,\) has dtype torch.complex64"):
        cls([torch.nn.Parameter(torch.zeros(2)), z], lr=1e-2)
    with pytest.raises(ValueError, match=r"DiLoCo: param 0 \(3,\) has dtype torch.complex64"):
        onebit.DiLoCo([z], torch.optim.SGD([z], lr=0.1), sync_every=4)


def test_named_params_train_as_the_unnamed_and_are_checked(cls):
    """torch takes (name, tensor) pairs (named_parameters()); the
    construction checks read the tensors of those pairs (the complex check
    broke on the pairs, which torch's conformance suite caught)."""
    model, opt = build(cls)
    named_model, _ = build(cls)
    named = cls(named_model.named_parameters(), lr=1e-2, weight_decay=1e-3,
                **({"var_freeze_step": 3, "local_step_scaler": 2, "local_step_clipper": 2}
                   if cls is ZeroOneAdam else {"freeze_step": 3}))
    train(model, opt, range(1, 6))
    train(named_model, named, range(1, 6))
    assert torch.equal(flat(model), flat(named_model))
    w = named_model[0].weight
    with pytest.raises(ValueError, match="same tensor"):
        cls([("a", w), ("b", w)], lr=1e-2)
