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


def test_command_line_validates_a_config(tmp_path):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps({"optimizer": {"type": "ZeroOneAdam", "params": {"var_freeze_step": 7}}}))
    bad.write_text(json.dumps({"optimizer": {"type": "ZeroOneAdam", "params": {"freeze_step": 7}}}))
    ok = subprocess.run([sys.executable, "-m", "onebit", str(good)], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "ZeroOneAdam(" in ok.stdout and "var_freeze_step = 7" in ok.stdout
    no = subprocess.run([sys.executable, "-m", "onebit", str(bad)], capture_output=True, text=True, timeout=60)
    assert no.returncode == 1 and "unknown parameter" in no.stderr
