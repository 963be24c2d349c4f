"""What real training scripts do to an optimizer, on real gloo ranks: param
groups added mid-run, layers frozen and unfrozen, ranks that disagree on
requires_grad. Each either works (replicas bitwise identical, everything
finite) or fails with a ValueError on every rank before anything changed."""
import copy
import math

import pytest
import torch

from tests.distributed import run_workers

pytestmark = pytest.mark.slow  # the fast tier (-m "not slow") leaves these out

NAMES = ["OnebitAdam", "OnebitLamb", "ZeroOneAdam"]


def _make(name, params, freeze, **kw):
    import onebit

    step = "var_freeze_step" if name == "ZeroOneAdam" else "freeze_step"
    if name == "ZeroOneAdam":
        kw.setdefault("local_step_scaler", 2)
        kw.setdefault("local_step_clipper", 2)
    return getattr(onebit, name)(params, lr=1e-2, weight_decay=1e-3, **{step: freeze}, **kw)


def small_model(seed):
    torch.manual_seed(seed)  # a different start on each rank: construction broadcasts rank 0's
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _train_step(model, opt, rank, t):
    g = torch.Generator().manual_seed(1000 * t + rank)
    x = torch.randn(5, model[0].in_features, generator=g)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def flat(module_or_params):
    ps = module_or_params.parameters() if hasattr(module_or_params, "parameters") else module_or_params
    return torch.cat([p.detach().reshape(-1) for p in ps]).tolist()


def _add_param_group(rank, world, name, when):
    """A head added at step `when` (before or after the freeze at 3), with a
    different initialisation on each rank."""
    model = small_model(rank)
    opt = _make(name, model.parameters(), freeze=3)
    head = None
    for t in range(1, 11):  # ends on a 0/1 Adam sync
        if t == when:
            torch.manual_seed(50 + rank)
            head = torch.nn.Linear(2, 3)
            opt.add_param_group({"params": head.parameters(), "lr": 5e-3})
            start = flat(head)
        g = torch.Generator().manual_seed(1000 * t + rank)
        x = torch.randn(5, 6, generator=g)
        opt.zero_grad()
        out = model(x)
        loss = out.pow(2).mean() + (head(out).pow(2).mean() if head is not None else 0)
        loss.backward()
        opt.step()
    last = name != "ZeroOneAdam" or opt.counters["last_sync"] == opt.counters["step"]
    return {"model": flat(model), "head": flat(head), "synced": last,
            "head_moved": flat(head) != start}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", NAMES)
def test_add_param_group_broadcasts_and_trains_in_step_before_and_after_the_freeze(name):
    for when in (2, 6):
        out = run_workers(_add_param_group, 3, name, when, timeout=120)
        assert out[0]["synced"] and out[0]["head_moved"]  # after the freeze too (late.py)
        for r in out[1:]:  # rank 0's head everywhere, then identical steps
            assert r["model"] == out[0]["model"] and r["head"] == out[0]["head"]
        assert all(abs(x) < 1e3 for x in out[0]["head"] + out[0]["model"])


def _disagree_at_construction(rank, world, name):
    model = small_model(0)
    model[2].bias.requires_grad_(rank != 1)
    try:
        _make(name, model.parameters(), freeze=3)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", NAMES)
def test_ranks_disagreeing_on_requires_grad_fail_at_construction(name):
    for msg in run_workers(_disagree_at_construction, 3, name, timeout=60):
        assert "ranks disagree on parameter shapes/order/requires_grad" in msg, msg


def _built_apart(rank, world, name, option, values):
    model = small_model(0)
    try:
        _make(name, model.parameters(), freeze=3, timeout_s=30, **{option: values[rank % 2]})
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("option, values, named", [
    # each made a collective before the fingerprint, or one of its own after
    ("overlap_backward", (False, True), "hyper-parameters"),  # hung in new_group
    ("comm_backend_name", ("compressed", "hierarchical"), "compressed backend"),  # gloo aborted
    ("check_replicas_every", (2, 0), "hyper-parameters"),  # paired with a step's gather
])
def test_ranks_built_with_options_apart_fail_at_construction(option, values, named):
    for msg in run_workers(_built_apart, 2, "OnebitAdam", option, values, timeout=60):
        assert f"ranks disagree on {named}" in msg, msg


def _masks_apart(rank, world, name):
    import onebit

    p = torch.nn.Parameter(torch.ones(8))
    mask = torch.ones(8)
    if rank == 1:
        mask[0] = 0.0  # the same shape, another entry kept at 0
    try:
        getattr(onebit, name)([{"params": [p], "exp_avg_mask": mask}], lr=1e-2, freeze_step=2)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["OnebitAdam", "OnebitLamb"])
def test_ranks_with_exp_avg_masks_of_other_values_fail_at_construction(name):
    """Tensors in a group counted by shape only: the replicas drifted apart."""
    for msg in run_workers(_masks_apart, 2, name, timeout=60):
        assert "ranks disagree on hyper-parameters" in msg, msg


def _disagree_mid_run(rank, world, name, at):
    model = small_model(0)
    opt = _make(name, model.parameters(), freeze=3)
    for t in range(1, at):
        _train_step(model, opt, rank, t)
    before = flat(model)
    step = opt.counters["step"]
    model[0].weight.requires_grad_(rank == 0)  # only rank 0 keeps training it
    try:
        _train_step(model, opt, rank, at)
    except ValueError as exc:
        return {"error": str(exc), "unchanged": flat(model) == before,
                "step": opt.counters["step"] == step}
    return {"error": "no error"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", NAMES)
def test_ranks_disagreeing_on_requires_grad_mid_run_raise_on_every_rank_and_change_nothing(name):
    for at in (2, 6):  # in warmup (gloo would abort the process), and after the freeze
        for r in run_workers(_disagree_mid_run, 3, name, at, timeout=60):
            assert "disagree on which parameters require grad" in r["error"], r
            assert r["unchanged"] and r["step"], r


def _settings_apart_mid_run(rank, world, name, at, what):
    model = small_model(0)
    opt = _make(name, model.parameters(), freeze=3)
    for t in range(1, at):
        _train_step(model, opt, rank, t)
    if rank == 1 and what == "lr":  # a scheduler stepped on one rank only
        opt.param_groups[0]["lr"] *= 0.5
    if rank == 1 and what == "counters":  # as if resumed from another checkpoint
        saved = copy.deepcopy(opt.state_dict())
        for g in saved["param_groups"]:
            g["onebit"] = {**g["onebit"], "step": g["onebit"]["step"] + 2}
        opt.load_state_dict(saved)
    # A load without the error buffers restarts the momentum at the next
    # step, before anything is agreed (momentum_restart): the counters and
    # params are what must stay, and the whole state where nothing was loaded.
    before, state = flat(model), copy.deepcopy(opt.state_dict())
    counters = copy.deepcopy(opt.counters)
    try:
        _train_step(model, opt, rank, at)
    except ValueError as exc:
        kept = (opt.counters == counters if what == "counters"
                else repr(opt.state_dict()) == repr(state))
        return {"error": str(exc), "unchanged": flat(model) == before, "state": kept}
    return {"error": "no error"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("what,named", [("lr", "hyper-parameters"), ("counters", "the step counters")])
def test_ranks_whose_settings_drift_apart_mid_run_raise_on_every_rank_and_change_nothing(
        name, what, named):
    for at in (2, 6):  # in warmup, and after the freeze
        for r in run_workers(_settings_apart_mid_run, 3, name, at, what, timeout=60):
            assert f"ranks disagree on {named} at step" in r["error"], r
            assert r["unchanged"] and r["state"], r


def _freeze_then_unfreeze(rank, world, name, overlap=False):
    model = small_model(0)
    model[0].requires_grad_(False)  # the bottom layer starts frozen
    opt = _make(name, model.parameters(), freeze=3, overlap_backward=overlap)
    moved = []
    for t in range(1, 13):  # ends on a 0/1 Adam sync
        if t == 6:  # after the freeze: progressive unfreezing
            model[0].requires_grad_(True)
        if t == 9:
            model[2].requires_grad_(False)
        before = flat(model[0])
        _train_step(model, opt, rank, t)
        if t in (6, 10):  # the unfrozen layer trains in its own warmup, then in 1 bit
            moved.append(flat(model[0]) != before)
    synced = name != "ZeroOneAdam" or opt.counters["last_sync"] == opt.counters["step"]
    return {"params": flat(model), "step": opt.counters["step"], "synced": synced,
            "moved": moved}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_unfreezing_and_freezing_layers_after_the_freeze_step(name, overlap):
    # With overlap_backward, 0/1 Adam's syncs exchanged during backward
    # read the denominators and zero-variance masks cached for the params
    # trained before the layer joined (an IndexError, or a shape mismatch).
    out = run_workers(_freeze_then_unfreeze, 3, name, overlap, timeout=120)
    assert all(r["step"] == 12 for r in out)
    assert out[0]["synced"]
    assert all(r["moved"] == [True, True] for r in out)
    for r in out[1:]:
        assert r["params"] == out[0]["params"]
    assert all(abs(x) < 1e3 for x in out[0]["params"])


def _late_joiner_follows_adam(rank, world, name):
    """A layer unfrozen after the freeze: its own warmup is Adam on the
    full-precision mean gradient. The reference: torch.optim.AdamW (the same
    decoupled weight decay) fed that mean, computed here with all_reduce."""
    model = small_model(0)
    model[2].requires_grad_(False)
    opt = _make(name, model.parameters(), freeze=3)
    ref, ref_opt, diffs = None, None, []
    for t in range(1, 13):  # ends on a 0/1 Adam sync
        if t == 6:
            model[2].requires_grad_(True)
            ref = copy.deepcopy(model[2])
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=1e-3)
        g = torch.Generator().manual_seed(1000 * t + rank)
        x = torch.randn(5, 6, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        if ref is not None and t <= 8:  # its own warmup: freeze_step = 3 steps
            for q, mine in zip(ref.parameters(), model[2].parameters()):
                q.grad = mine.grad.clone()
                torch.distributed.all_reduce(q.grad)
                q.grad /= world
            ref_opt.step()
        opt.step()
        if ref is not None and t <= 8:
            diffs.append(max(float((a - b).detach().abs().max())
                             for a, b in zip(ref.parameters(), model[2].parameters())))
    synced = name != "ZeroOneAdam" or opt.counters["last_sync"] == opt.counters["step"]
    return {"diffs": diffs, "params": flat(model), "synced": synced,
            "finite": all(abs(x) < 1e3 for x in flat(model))}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["OnebitAdam", "ZeroOneAdam"])
def test_a_late_joiner_warms_up_as_adam_on_the_mean_gradient_then_joins(name):
    out = run_workers(_late_joiner_follows_adam, 3, name, timeout=120)
    for r in out:
        assert len(r["diffs"]) == 3 and max(r["diffs"]) < 1e-6, r["diffs"]
        assert r["params"] == out[0]["params"] and r["finite"] and r["synced"]


def _used_first_after_the_freeze(rank, world, name, overlap, zeroed):
    """A head in the optimizer from the start but used by no rank until step
    8 (an expert no token reached, a head switched on later): .grad None on
    every rank through the warmup (freeze at 3), or zeros (`zeroed`: an
    expert whose empty batch gives zero gradients). Its first gradient, at
    step 8, meets a v of 0 and is spent; from step 9 it is a late joiner,
    Adam on the mean gradient (the reference: torch.optim.AdamW fed that
    mean), then it joins the 1-bit exchange. An expert used in the warmup,
    then idle, then used again at step 8 has a v: it moves at once."""
    model = small_model(0)
    head, expert = torch.nn.Linear(2, 3), torch.nn.Linear(2, 2)
    opt = _make(name, [*model.parameters(), *head.parameters(), *expert.parameters()], freeze=3,
                overlap_backward=overlap)
    start, ref, ref_opt, diffs, moved, expert_moved = flat(head), None, None, [], [], []
    for t in range(1, 15):  # ends on a 0/1 Adam sync
        if t == 9:
            ref = copy.deepcopy(head)
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=1e-3)
        g = torch.Generator().manual_seed(1000 * t + rank)
        out = model(torch.randn(5, 6, generator=g))
        loss = out.pow(2).mean() + (head(out).pow(2).mean() if t >= 8
                                    else head(out).sum() * 0 if zeroed else 0)
        loss = loss + (expert(out).pow(2).mean() if t <= 2 or t >= 8 else 0)
        opt.zero_grad()
        loss.backward()
        if ref is not None and t <= 11:  # its own warmup: freeze_step = 3 steps
            for q, mine in zip(ref.parameters(), head.parameters()):
                q.grad = mine.grad.clone()
                torch.distributed.all_reduce(q.grad)
                q.grad /= world
            ref_opt.step()
        before, expert_before = flat(head), flat(expert)
        opt.step()
        moved.append(flat(head) != before)
        expert_moved.append(flat(expert) != expert_before)
        if ref is not None and t <= 11:
            diffs.append(max(float((a - b).detach().abs().max())
                             for a, b in zip(ref.parameters(), head.parameters())))
    synced = name != "ZeroOneAdam" or opt.counters["last_sync"] == opt.counters["step"]
    return {"diffs": diffs, "moved": moved, "head": flat(head), "model": flat(model),
            "synced": synced, "expert_moved": expert_moved}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("overlap, zeroed", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("name", NAMES)
def test_a_param_first_used_after_the_freeze_becomes_a_late_joiner(name, overlap, zeroed):
    # It kept the zero state of its untouched warmup steps, so it never
    # counted as a late joiner, and its v of 0 held it still for good.
    out = run_workers(_used_first_after_the_freeze, 3, name, overlap, zeroed, timeout=120)
    for r in out:
        assert r["moved"][:8] == [False] * 8, r["moved"]  # unused, then its first gradient spent
        assert all(r["moved"][8:]), r["moved"]  # its own warmup, then 1 bit
        assert r["expert_moved"][7], r["expert_moved"]  # seen in the warmup: no late start
        if name != "OnebitLamb":  # (LAMB's own warmup is LAMB)
            assert len(r["diffs"]) == 3 and max(r["diffs"]) < 1e-6, r["diffs"]
        assert r["head"] == out[0]["head"] and r["model"] == out[0]["model"] and r["synced"]
        assert all(abs(x) < 1e3 for x in r["head"] + r["model"])


def _zero_one_adam_syncs_in_backward_as_a_param_joins(rank, world):
    """0/1 Adam with overlap_backward and syncs at every step (the default
    local_step_scaler): a head first used at step 8 (freeze at 3) leaves
    the trained params after step 8, its own warmup over, joins at 12."""
    import onebit

    model = small_model(0)
    head = torch.nn.Linear(2, 3)
    opt = onebit.ZeroOneAdam([*model.parameters(), *head.parameters()], lr=1e-2,
                             weight_decay=1e-3, var_freeze_step=3, overlap_backward=True)
    for t in range(1, 16):
        g = torch.Generator().manual_seed(1000 * t + rank)
        out = model(torch.randn(5, 6, generator=g))
        opt.zero_grad()
        (out.pow(2).mean() + (head(out).pow(2).mean() if t >= 8 else 0)).backward()
        opt.step()
    return flat(model) + flat(head)


@pytest.mark.timeout(300)
def test_zero_one_adam_syncs_during_backward_as_the_trained_params_change():
    # Backward's sync inputs read the denominators cached for the params
    # trained before the change: an IndexError inside loss.backward().
    out = run_workers(_zero_one_adam_syncs_in_backward_as_a_param_joins, 2, timeout=120)
    assert out[0] == out[1] and all(abs(x) < 1e3 for x in out[0])


def dcp_save(module, opt, path) -> None:
    """torch.distributed.checkpoint, as docs/checkpoints.md saves: the
    model, the optimizer, and this rank's error buffers under their key."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save({"model": module.state_dict(), "optim": get_optimizer_state_dict(module, opt),
              opt.error_feedback_key(): opt.error_feedback_state_dict()}, checkpoint_id=path)


def dcp_resume(module, opt, path, partial: bool = False) -> bool:
    """docs/checkpoints.md's resume: the model and optimizer, then this
    rank's error buffers into a dict built on the *loaded* optimizer (a late
    joiner's, and a changed trained set's, are laid out as it says).
    `partial`: docs/sharding.md's `allow_partial_load=True`, as a resume at
    another world size loads (this rank's error entry is then absent).
    Returns whether the buffers came back."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    def planner():  # (one per load: a planner keeps the state of its load)
        return dcp.DefaultLoadPlanner(allow_partial_load=True) if partial else None
    state = {"model": module.state_dict(), "optim": get_optimizer_state_dict(module, opt)}
    dcp.load(state, checkpoint_id=path, planner=planner())
    module.load_state_dict(state["model"])
    set_optimizer_state_dict(module, opt, state["optim"])
    errors = {opt.error_feedback_key(): opt.error_feedback_state_dict()}
    dcp.load(errors, checkpoint_id=path, planner=planner())
    return opt.load_error_feedback_state_dict(errors[opt.error_feedback_key()])


def _resumed_in_a_late_joiners_warmup(rank, world, name, save_at, dcp_dir=None):
    """A head first used at step 8 (freeze at 3): a late joiner from step 9,
    its own warmup through step 11. Uninterrupted, then saved after step
    `save_at` and resumed in a new optimizer (its errors too), through
    torch.save's dicts or, with `dcp_dir`, torch.distributed.checkpoint."""

    def build():
        torch.manual_seed(0)
        model, head = small_model(0), torch.nn.Linear(2, 3)
        local = dict(local_step_scaler=1, local_step_clipper=4) if name == "ZeroOneAdam" else {}
        # two groups: the change of trained params at step 9 must restart the
        # errors of both, resumed or not
        return model, head, _make(name, [{"params": model.parameters()},
                                         {"params": head.parameters(), "weight_decay": 0.0}],
                                  freeze=3, **local)

    def train(model, head, opt, steps):
        for t in steps:
            g = torch.Generator().manual_seed(1000 * t + rank)
            out = model(torch.randn(5, 6, generator=g))
            opt.zero_grad()
            (out.pow(2).mean() + (head(out).pow(2).mean() if t >= 8 else 0)).backward()
            opt.step()

    model, head, opt = build()
    train(model, head, opt, range(1, 21))
    straight = flat(model) + flat(head)
    model, head, opt = build()
    train(model, head, opt, range(1, save_at + 1))
    if dcp_dir is None:
        saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(head.state_dict()),
                 copy.deepcopy(opt.state_dict()), copy.deepcopy(opt.error_feedback_state_dict()))
        model, head, opt = build()
        model.load_state_dict(saved[0])
        head.load_state_dict(saved[1])
        opt.load_state_dict(saved[2])
        opt.load_error_feedback_state_dict(saved[3])
    else:
        dcp_save(torch.nn.ModuleList([model, head]), opt, dcp_dir)
        model, head, opt = build()
        assert dcp_resume(torch.nn.ModuleList([model, head]), opt, dcp_dir)
    train(model, head, opt, range(save_at + 1, 21))
    return straight, flat(model) + flat(head)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("save_at", [8, 10])
@pytest.mark.parametrize("name", NAMES)
def test_a_resume_in_a_late_joiners_warmup_is_bitwise_identical(name, save_at):
    # 0/1 Adam's checkpoint gave the late joiner a placeholder synced point
    # of zeros, which passed for real: it landed near 0 after its warmup.
    for straight, resumed in run_workers(_resumed_in_a_late_joiners_warmup, 2, name, save_at,
                                         timeout=120):
        assert resumed == straight


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", NAMES)
def test_a_dcp_resume_right_after_a_first_use_is_bitwise_identical(name, tmp_path):
    # The first use left the param with an empty state: DCP's fresh target
    # has exp_avg for it, which the checkpoint lacked ("Missing key").
    for straight, resumed in run_workers(_resumed_in_a_late_joiners_warmup, 2, name, 8,
                                         str(tmp_path / "dcp"), timeout=120):
        assert resumed == straight


def _first_used_between_variance_updates(rank, world):
    """0/1 Adam updates v at steps 1, 2, 4, 8, 16, 32 before its freeze at
    40: a head first used at step 33 still has v = 0 when v freezes, and
    a gradient at every step after (never a step without one)."""
    import onebit

    model = small_model(0)
    head = torch.nn.Linear(2, 3)
    opt = onebit.ZeroOneAdam([*model.parameters(), *head.parameters()], lr=1e-2,
                             var_freeze_step=40, var_update_scaler=2, local_step_scaler=4,
                             local_step_clipper=2)
    moved = []
    for t in range(1, 61):
        g = torch.Generator().manual_seed(1000 * t + rank)
        out = model(torch.randn(5, 6, generator=g))
        opt.zero_grad()
        (out.pow(2).mean() + (head(out).pow(2).mean() if t >= 33 else 0)).backward()
        before = flat(head)
        opt.step()
        moved.append(flat(head) != before)
    return {"moved": moved, "head": flat(head),
            "synced": opt.counters["last_sync"] == opt.counters["step"]}


@pytest.mark.timeout(300)
def test_zero_one_adam_trains_a_param_first_used_between_variance_updates():
    # It was never gradless after the freeze, so a rule that looked only at
    # params coming back from a step without a gradient never found it.
    out = run_workers(_first_used_between_variance_updates, 2, timeout=120)
    for r in out:
        assert not any(r["moved"][:32]) and all(r["moved"][41:]), r["moved"]
        assert all(abs(x) < 1e3 for x in r["head"])
    assert out[0]["synced"] and out[1]["head"] == out[0]["head"]


def _zero_one_adam_under(rank, world, schedule):
    """A teacher regression under an lr schedule that reaches 0 (or about)
    and rises again; the loss of every step, and this rank's params."""
    import onebit

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    teacher = torch.nn.Linear(16, 4)
    opt = onebit.ZeroOneAdam(model.parameters(), lr=1e-2, var_freeze_step=10,
                             local_step_scaler=4, local_step_clipper=4)
    lr_sched = torch.optim.lr_scheduler
    sched = {"cosine": lambda: lr_sched.CosineAnnealingLR(opt, T_max=20),
             "warm restarts": lambda: lr_sched.CosineAnnealingWarmRestarts(opt, T_0=20,
                                                                            eta_min=1e-5),
             "cyclic": lambda: lr_sched.CyclicLR(opt, base_lr=0.0, max_lr=1e-2, step_size_up=10,
                                                 cycle_momentum=False)}[schedule]()
    losses = []
    for t in range(80):
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1000 * t + rank))
        with torch.no_grad():
            y = teacher(x)
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return {"losses": losses, "params": flat(model),
            "synced": opt.counters["last_sync"] == opt.counters["step"]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["cosine", "warm restarts", "cyclic"])
def test_zero_one_adam_trains_through_an_lr_that_returns_from_0(schedule):
    # Its syncs once divided an error residual left at lr 1e-2 by the lr
    # summed since the last sync: near 0 that gave a huge momentum, and the
    # loss went to 1e8 (cosine) or 1e12 (eta_min 1e-7) once the lr rose.
    out = run_workers(_zero_one_adam_under, 2, schedule, timeout=120)
    losses = out[0]["losses"]
    assert all(math.isfinite(x) for x in losses)
    assert max(losses[40:]) < 0.2 * losses[0]  # it kept training after the lr came back
    assert sum(losses[-10:]) / 10 < 0.05 * losses[0]
    assert out[0]["synced"] and out[1]["params"] == out[0]["params"]


def _zero_one_adam_freezes_between_syncs(rank, world, unfreeze_at):
    import onebit

    torch.manual_seed(0)
    body, head = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)
    opt = onebit.ZeroOneAdam([*body.parameters(), *head.parameters()], lr=1e-2,
                             var_freeze_step=2, local_step_scaler=1, local_step_clipper=4)
    out = []
    for step in range(1, 17):
        if step == 6:  # after a local step: the replicas are apart by design
            body.requires_grad_(False)
        if step == unfreeze_at:
            body.requires_grad_(True)
        g = torch.Generator().manual_seed(10 * step + rank)
        opt.zero_grad(set_to_none=True)
        head(torch.tanh(body(torch.randn(8, 4, generator=g)))).pow(2).mean().backward()
        opt.step()
        out.append((opt.last_stage.name, flat(body)))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("unfreeze_at", [None, 9])
def test_zero_one_adam_layer_frozen_between_syncs_comes_back_to_the_common_point(unfreeze_at):
    """Frozen after a local step, the body kept each rank's own value, and
    no later sync took it: 0.013 apart for good, even after it was unfrozen
    again (each rank's anchor was its own). It now goes back to its last
    synced point when it stops training."""
    ranks = run_workers(_zero_one_adam_freezes_between_syncs, 2, unfreeze_at, timeout=90)
    stages = [stage for stage, _ in ranks[0]]
    assert stages[4] == "local step" and "sync" in stages[6:]
    for step, ((stage, a), (_, b)) in enumerate(zip(*ranks), start=1):
        frozen = step >= 6 and (unfreeze_at is None or step < unfreeze_at)
        if frozen or stage == "sync":
            assert a == b, (step, stage)
