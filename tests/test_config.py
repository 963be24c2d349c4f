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
    ("Adam", torch.optim.Adam), ("AdamW", torch.optim.AdamW), ("Lamb", onebit.OnebitLamb)])
def test_type_names_case_insensitive(kind, cls):
    opt = onebit.build_optimizer(params(), {"optimizer": {"type": kind, "params": {"lr": 0.01}}})
    assert type(opt) is cls and opt.param_groups[0]["lr"] == 0.01


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
    no = subprocess.run([sys.executable, "-m", "onebit", str(bad)], capture_output=True, text=True, timeout=60)
    assert no.returncode == 1 and "unknown parameter" in no.stderr


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
