"""DeepSpeed-style JSON configs: one word swaps the optimizer."""
import json
import subprocess
import sys

import pytest
import torch

import onebit


def params():
    return [torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize("kind, cls", [
    ("OneBitAdam", onebit.OnebitAdam), ("onebitadam", onebit.OnebitAdam),
    ("OneBitLamb", onebit.OnebitLamb), ("ZeroOneAdam", onebit.ZeroOneAdam),
    ("Adam", torch.optim.AdamW), ("AdamW", torch.optim.AdamW), ("Lamb", onebit.OnebitLamb)])
def test_type_names_case_insensitive(kind, cls):
    opt = onebit.build_optimizer(params(), {"optimizer": {"type": kind, "params": {"lr": 0.01}}})
    assert type(opt) is cls and opt.param_groups[0]["lr"] == 0.01


@pytest.mark.parametrize("given, cls", [({}, torch.optim.AdamW),
                                        ({"adam_w_mode": True}, torch.optim.AdamW),
                                        ({"adam_w_mode": False}, torch.optim.Adam),
                                        ({"adam_w_mode": False, "torch_adam": True},
                                         torch.optim.Adam)])
def test_deepspeeds_adam_is_adamw_unless_adam_w_mode_is_false(given, cls):
    """DeepSpeed's "Adam" decouples the weight decay (adam_w_mode defaults to
    true); it had built torch's L2 Adam here and refused DeepSpeed's own
    adam_w_mode and torch_adam keys. A step with weight decay tells them
    apart: AdamW moves a zero-gradient param by lr x wd x p, Adam by lr."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = onebit.build_optimizer([p], {"type": "Adam", "params": {"lr": 0.1,
                                                                  "weight_decay": 0.5, **given}})
    assert type(opt) is cls
    p.grad = torch.zeros(3)
    opt.step()
    want = 1 - 0.1 * 0.5 if cls is torch.optim.AdamW else 1 - 0.1  # Adam: the sign of wd * p
    assert torch.allclose(p.detach(), torch.full((3,), want)), p
    with pytest.raises(ValueError, match="adam_w_mode"):
        onebit.build_optimizer([p], {"type": "Adam", "params": {"adam_w_mode": "no"}})


def test_deepspeed_keys_pass_through_and_inner_dict_works(tmp_path):
    cfg = {"type": "OneBitAdam", "params": {"lr": 2e-4, "freeze_step": 23, "cuda_aware": False,
                                            "comm_backend_name": "compressed", "betas": [0.8, 0.99]}}
    opt = onebit.build_optimizer(params(), cfg)
    assert opt.freeze_step == 23 and opt.param_groups[0]["betas"] == (0.8, 0.99)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "optimizer": cfg}))
    assert onebit.build_optimizer(params(), str(path)).freeze_step == 23


def test_plain_lamb_never_compresses():
    opt = onebit.build_optimizer(params(), {"type": "Lamb", "params": {}})
    assert not opt.compression_started(10**9)


def test_unknown_type_or_parameter_lists_valid_names():
    with pytest.raises(ValueError, match="valid types: .*OneBitAdam.*ZeroOneAdam"):
        onebit.build_optimizer(params(), {"type": "SGDish"})
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['freez_step'\].*freeze_step"):
        onebit.build_optimizer(params(), {"type": "OneBitAdam", "params": {"freez_step": 3}})
    with pytest.raises(ValueError, match="optimizer"):
        onebit.build_optimizer(params(), {"params": {}})


@pytest.mark.slow
def test_command_line_validates_a_config(tmp_path):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps({"optimizer": {"type": "ZeroOneAdam", "params": {"var_freeze_step": 7}}}))
    bad.write_text(json.dumps({"optimizer": {"type": "ZeroOneAdam", "params": {"freeze_step": 7}}}))
    ok = subprocess.run([sys.executable, "-m", "onebit", str(good)], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "ZeroOneAdam(" in ok.stdout and "var_freeze_step = 7" in ok.stdout
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps(DEEPSPEED_CONFIG))
    told = subprocess.run([sys.executable, "-m", "onebit", str(whole)], capture_output=True,
                          text=True, timeout=60)
    assert told.returncode == 0, told.stderr
    assert "max_grad_norm=1.0" in told.stdout and "mapped" in told.stdout
    for key in DEEPSPEED_CONFIG:
        assert key in told.stdout
    no = subprocess.run([sys.executable, "-m", "onebit", str(bad)], capture_output=True, text=True, timeout=60)
    assert no.returncode == 1 and "unknown parameter" in no.stderr
    # A scheduler section build_scheduler would refuse (it passed as "mapped").
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({**DEEPSPEED_CONFIG, "scheduler": {
        "type": "WarmupDecayLR", "params": {"total_num_steps": 100, "warmup_num_stepz": 10}}}))
    no = subprocess.run([sys.executable, "-m", "onebit", str(typo)], capture_output=True,
                        text=True, timeout=60)
    assert no.returncode == 1 and "['warmup_num_stepz']" in no.stderr, no.stderr


@pytest.mark.parametrize("section, match", [
    ({"type": "OneBitAdam", "parms": {"freeze_step": 5}}, r"parms.*did you mean \"params\""),
    ({"type": "OneBitAdam", "params": {}, "freeze_step": 5}, r"unknown key\(s\) \['freeze_step'\]"),
    ({"type": "OneBitAdam", "params": {"bias_correction": "false"}}, "bias_correction must be True or False"),
    ({"type": "OneBitAdam", "params": {"betas": 0.9}}, "betas must be a list of two numbers"),
    ({"type": "OneBitAdam", "params": {"betas": [0.9]}}, "betas must be a list of two numbers"),
    ({"type": "OneBitAdam", "params": None}, '"params" must be a JSON object'),
    ({"type": "OneBitAdam", "params": {"comm_backend_name": "nccll"}}, "unknown onebit backend 'nccll'"),
    ({"type": "Adam", "params": {"lr": "fast"}}, "Adam: "),
])
def test_config_mistakes_are_errors_naming_the_fix(section, match):
    with pytest.raises(ValueError, match=match):
        onebit.build_optimizer(params(), {"train_batch_size": 8, "optimizer": section})


def _deepspeed_backend_names(rank, world):
    model = torch.nn.Linear(5, 3)
    for name in ("nccl", "hccl", "compressed"):
        cfg = {"type": "OneBitAdam", "params": {"lr": 1e-2, "freeze_step": 1,
                                                "comm_backend_name": name}}
        opt = onebit.build_optimizer(model.parameters(), cfg)
        assert opt.comm_backend_name == "compressed"
        for _ in range(3):  # warmup, then two compressed steps over gloo
            opt.zero_grad()
            model(torch.randn(4, 5)).pow(2).sum().backward()
            opt.step()
    return [p.detach().tolist() for p in model.parameters()]  # plain lists cross the queue


def test_deepspeed_backend_names_run_at_two_ranks():
    """"nccl" (in every DeepSpeed 1-bit config) means the torch.distributed
    backend, whatever the device: it trains on 2 gloo ranks, identically."""
    from tests.distributed import run_workers

    a, b = run_workers(_deepspeed_backend_names, 2, timeout=120)
    assert a == b


# A config as DeepSpeed users write it for 1-bit Adam (issue 32).
DEEPSPEED_CONFIG = {
    "train_batch_size": 64, "fp16": {"enabled": True}, "zero_optimization": {"stage": 0},
    "gradient_clipping": 1.0,
    "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 100}},
    "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 400,
                                                   "comm_backend_name": "nccl"}}}


def test_a_whole_deepspeed_config_is_read_and_nothing_is_dropped_silently():
    opt = onebit.build_optimizer(params(), DEEPSPEED_CONFIG)
    assert type(opt) is onebit.OnebitAdam and opt.param_groups[0]["max_grad_norm"] == 1.0
    notes = {key: (verdict, note) for key, verdict, note in
             onebit.config.read_config(DEEPSPEED_CONFIG).notes}
    assert set(notes) == set(DEEPSPEED_CONFIG)  # every key has a verdict
    assert notes["gradient_clipping"] == ("mapped", "max_grad_norm=1")
    assert notes["fp16"][0] == "advice" and "torch.float16" in notes["fp16"][1]
    assert "GradScaler" in notes["fp16"][1]
    assert notes["scheduler"][0] == "mapped" and "build_scheduler" in notes["scheduler"][1]
    sched = onebit.build_scheduler(opt, DEEPSPEED_CONFIG)
    assert type(sched.schedule).__name__ == "WarmupLR"
    assert notes["zero_optimization"][0] == "ignored" and notes["train_batch_size"][0] == "ignored"
    assert notes["optimizer"] == ("used", "OneBitAdam")


def test_the_optimizers_own_max_grad_norm_wins_over_gradient_clipping():
    cfg = dict(DEEPSPEED_CONFIG, optimizer={"type": "OneBitLamb", "params": {"max_grad_norm": 0.5}})
    assert onebit.build_optimizer(params(), cfg).param_groups[0]["max_grad_norm"] == 0.5


def test_gradient_clipping_for_torch_adam_is_advice_not_a_silent_drop():
    cfg = dict(DEEPSPEED_CONFIG, optimizer={"type": "AdamW", "params": {"lr": 0.1}})
    assert type(onebit.build_optimizer(params(), cfg)) is torch.optim.AdamW
    notes = {k: (v, n) for k, v, n in onebit.config.read_config(cfg).notes}
    assert notes["gradient_clipping"][0] == "advice" and "clip_grad_norm_" in notes["gradient_clipping"][1]


@pytest.mark.parametrize("change, match", [
    ({"zero_optimization": {"stage": 2}}, r"zero_optimization.stage=2: .*whole parameters"),
    ({"zero_optimization": {"stage": "0"}}, r"stage must be an integer from 0 to 3, got '0'"),
    ({"gradient_clipping": {"max": 1.0}}, r"gradient_clipping must be a number"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"overlap_backward": True}}},
     r"gradient_clipping=1.0 with overlap_backward=True"),
])
def test_what_cannot_work_is_refused_naming_what_to_do(change, match):
    with pytest.raises(ValueError, match=match):
        onebit.build_optimizer(params(), {**DEEPSPEED_CONFIG, **change})
