"""DeepSpeed's schedulers as torch schedulers (onebit.build_scheduler): the
lr each optimizer step runs at, against DeepSpeed's formulas written out
here by hand (iteration it = optimizer step - 2, DeepSpeed's counting)."""
import io
import math

import pytest
import torch

import onebit


def lrs_used(config, steps, lr=0.2, opt_cls=None, groups=1):
    """The lr (and first beta) of every group at each of `steps` optimizer steps."""
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(groups)]
    opt = (opt_cls or onebit.OnebitAdam)([{"params": [p]} for p in params], lr=lr)
    sched = onebit.build_scheduler(opt, config)
    seen = []
    for _ in range(steps):
        seen.append([(g["lr"], g["betas"][0]) for g in opt.param_groups])
        for p in params:
            p.grad = torch.ones(3)
        opt.step()
        sched.step()
    return seen


def at(seen, step, group=0):
    return seen[step - 1][group][0]


def test_warmup_lr_log_and_linear():
    cfg = {"scheduler": {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 10}}}
    seen = lrs_used(cfg, 20)
    expected = {1: 0.01, 2: 0.01, 3: 0.01 + 0.09 * math.log(2) / math.log(10),
                7: 0.01 + 0.09 * math.log(6) / math.log(10), 12: 0.1, 20: 0.1}
    for step, lr in expected.items():
        assert at(seen, step) == pytest.approx(lr, rel=1e-12), step
    cfg["scheduler"]["params"]["warmup_type"] = "linear"
    seen = lrs_used(cfg, 20)
    for step, lr in {1: 0.01, 2: 0.01, 3: 0.01 + 0.09 / 10, 8: 0.01 + 0.09 * 6 / 10,
                     12: 0.1}.items():
        assert at(seen, step) == pytest.approx(lr, rel=1e-12), step
    # warmup_max_lr defaults to the optimizer's lr
    del cfg["scheduler"]["params"]["warmup_max_lr"]
    assert at(lrs_used(cfg, 20, lr=0.3), 15) == pytest.approx(0.3)


def test_warmup_decay_lr_reaches_0_at_total_num_steps():
    cfg = {"type": "WarmupDecayLR", "params": {"total_num_steps": 20, "warmup_max_lr": 0.1,
                                               "warmup_num_steps": 5, "warmup_type": "linear"}}
    seen = lrs_used(cfg, 26)
    for step, lr in {2: 0.0, 4: 0.1 * 2 / 5, 7: 0.1 * (20 - 5) / 15, 12: 0.1 * (20 - 10) / 15,
                     22: 0.0, 26: 0.0}.items():
        assert at(seen, step) == pytest.approx(lr, abs=1e-15), step


def test_warmup_cosine_lr_scales_the_optimizers_lr():
    cfg = {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 20, "warmup_min_ratio": 0.1, "warmup_num_steps": 5,
        "cos_min_ratio": 0.01, "warmup_type": "linear"}}
    seen = lrs_used(cfg, 25, lr=0.2)

    def cosine(it):
        progress = min(1.0, (it - 5 + 1) / 15)
        return 0.2 * (0.01 + 0.99 * (1 + math.cos(math.pi * progress)) / 2)

    expected = {1: 0.0, 2: 0.2 * 0.1, 4: 0.2 * (0.1 + 0.9 * 2 / 5), 7: cosine(5),
                15: cosine(13), 21: 0.2 * 0.01, 25: 0.2 * 0.01}
    for step, lr in expected.items():
        assert at(seen, step) == pytest.approx(lr, rel=1e-12, abs=1e-15), step


def test_one_cycle_lr_and_momentum_then_decay():
    cfg = {"type": "OneCycle", "params": {
        "cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4,
        "cycle_second_step_size": 6, "decay_lr_rate": 0.5, "decay_step_size": 2,
        "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}}
    seen = lrs_used(cfg, 16)
    # it -> (height on the triangle); total 10, the top at 4/10 of it
    heights = {0: 0.25, 3: 1.0, 5: (0.6 - 1) / (0.4 - 1), 8: (0.9 - 1) / (0.4 - 1)}
    assert seen[0][0] == (0.01, 0.85)  # it = -1: the bottom
    for it, h in heights.items():
        lr, beta1 = seen[it + 1][0]
        assert lr == pytest.approx(0.01 + 0.09 * h, rel=1e-12), it
        assert beta1 == pytest.approx(0.95 - 0.1 * h, rel=1e-12), it
    for it in (10, 13):  # past the cycle: decay intervals (it - 10 + 1) / 2
        lr, beta1 = seen[it + 1][0]
        assert lr == pytest.approx(0.01 / (1 + 0.5 * (it - 9) / 2), rel=1e-12), it
        assert beta1 == pytest.approx(0.95)  # decay_mom_rate 0


def test_one_cycle_stairs_and_per_group_values():
    cfg = {"type": "OneCycle", "params": {
        "cycle_min_lr": [0.01, 0.02], "cycle_max_lr": [0.1, 0.2], "cycle_first_step_size": 4,
        "cycle_second_step_size": 6, "cycle_first_stair_count": 2, "cycle_momentum": False}}
    seen = lrs_used(cfg, 10, groups=2)
    # stairs: position = k * 2 / 4 going up, (10 - k) * 2 / 6 going down, k = it + 1
    for it, h in {0: 0.0, 1: 0.5, 3: 1.0, 5: 0.5, 8: 0.0}.items():
        assert at(seen, it + 2, 0) == pytest.approx(0.01 + 0.09 * h, rel=1e-12), it
        assert at(seen, it + 2, 1) == pytest.approx(0.02 + 0.18 * h, rel=1e-12), it
    assert all(row[0][1] == 0.9 for row in seen)  # cycle_momentum off: betas untouched


def test_second_beta_is_the_users_and_state_dict_resumes():
    params = [torch.nn.Parameter(torch.ones(3))]
    opt = onebit.OnebitAdam(params, lr=0.1, betas=(0.9, 0.98))
    cfg = {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1,
                                          "cycle_first_step_size": 3}}
    sched = onebit.build_scheduler(opt, cfg)
    for _ in range(4):
        params[0].grad = torch.ones(3)
        opt.step()
        sched.step()
    assert opt.param_groups[0]["betas"][1] == 0.98  # DeepSpeed would force 0.99
    buf = io.BytesIO()
    torch.save(sched.state_dict(), buf)
    buf.seek(0)
    opt2 = onebit.OnebitAdam([torch.nn.Parameter(torch.ones(3))], lr=0.1, betas=(0.9, 0.98))
    again = onebit.build_scheduler(opt2, cfg)
    again.load_state_dict(torch.load(buf))
    sched.step()
    again.step()
    assert again.get_last_lr() == sched.get_last_lr()


def test_bad_scheduler_configs_say_what_is_wrong():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    with pytest.raises(ValueError, match="unknown scheduler type 'Cosine'.*WarmupCosineLR"):
        onebit.build_scheduler(opt, {"type": "Cosine", "params": {}})
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['warmup_steps'\]"):
        onebit.build_scheduler(opt, {"type": "WarmupLR", "params": {"warmup_steps": 5}})
    with pytest.raises(ValueError, match="total_num_steps"):
        onebit.build_scheduler(opt, {"type": "WarmupDecayLR", "params": {}})
    with pytest.raises(ValueError, match="warmup_type"):
        onebit.build_scheduler(opt, {"type": "WarmupLR", "params": {"warmup_type": "cos"}})
    with pytest.raises(ValueError, match="needs an optimizer with betas"):
        onebit.build_scheduler(opt, {"type": "OneCycle", "params": {"cycle_max_lr": 0.1}})
    with pytest.raises(ValueError, match="load_state_dict"):
        onebit.build_scheduler(opt, {"type": "WarmupLR", "params": {"last_batch_iteration": 7}})


def test_the_config_reading_names_the_scheduler_mapped():
    reading = onebit.config.read_config({
        "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}}})
    assert ("scheduler", "mapped") in [(k, v) for k, v, _ in reading.notes]
    other = onebit.config.read_config({
        "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}},
        "scheduler": {"type": "Cosine"}})
    assert ("scheduler", "advice") in [(k, v) for k, v, _ in other.notes]
