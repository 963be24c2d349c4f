"""Every example runs, under every launcher it documents, for a few steps."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the fast tier (-m "not slow") leaves these out

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CONFIGS = ROOT / "examples" / "configs"


def run(cmd, timeout=240):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    final = [l for l in proc.stdout.splitlines() if l.startswith("final:")]
    assert len(final) == 1, proc.stdout[-3000:]  # printed once, by rank 0
    return final[0], float(re.search(r"accuracy ([\d.]+)%", final[0]).group(1))


TRAIN = [str(ROOT / "examples" / "train_digits.py"), "--steps", "120"]


@pytest.mark.parametrize("config", ["onebit_adam", "onebit_lamb", "zero_one_adam", "adam"])
def test_train_digits_plain_python_spawns_local_ranks(config):
    line, acc = run([sys.executable, *TRAIN, "--nproc", "2", "--config", str(CONFIGS / f"{config}.json")])
    assert "on 2 ranks" in line and acc > 80.0


def test_train_digits_under_torchrun():
    line, acc = run([str(BIN / "torchrun"), "--nproc-per-node", "3", *TRAIN,
                     "--config", str(CONFIGS / "onebit_adam.json")])
    assert "OnebitAdam on 3 ranks" in line and acc > 80.0


def test_train_digits_under_mpirun():
    line, acc = run([str(BIN / "mpiexec"), "-n", "3", sys.executable, *TRAIN,
                     "--config", str(CONFIGS / "zero_one_adam.json")])
    assert "ZeroOneAdam on 3 ranks" in line and acc > 80.0


def test_ddp_example_with_comm_hook():
    line, acc = run([sys.executable, str(ROOT / "examples" / "ddp_digits.py"), "--nproc", "2",
                     "--steps", "120"])
    assert "DDP + OnebitAdam on 2 ranks" in line and acc > 80.0


def test_hugging_face_trainer_example_reaches_the_compression_stage():
    line, _ = run([sys.executable, str(ROOT / "examples" / "hf_trainer.py"), "--steps", "30",
                   "--freeze-step", "10"])
    assert "step 30" in line  # the Trainer called our step() every step, past the freeze


def _ddp_check(out, hooked):
    """The examples' `--check` line: DDP averaged every warmup step and, with
    the hook, no compression step (each rank sees other data, so averaged
    gradients are equal on every rank and local ones are not)."""
    (line,) = [l for l in out.splitlines() if l.startswith("ddp check:")]
    assert "warmup: 20 of 20 steps averaged" in line, line
    assert f"compression: {0 if hooked else 60} of 60 steps averaged" in line, line


def run_with_output(cmd, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    acc = float(re.search(r"final: .* accuracy ([\d.]+)%", proc.stdout).group(1))
    return proc.stdout, acc


@pytest.mark.parametrize("example", ["accelerate_digits.py", "lightning_digits.py"])
@pytest.mark.parametrize("hooked", [True, False], ids=["hook", "without-hook"])
def test_trainer_recipes_send_no_full_precision_gradients_after_the_freeze(example, hooked):
    """Hugging Face Accelerate and PyTorch Lightning on 2 CPU ranks: with the
    recipe, DDP averages in warmup only; without the hook (the mistake the
    check is there to catch) it averages every step."""
    cmd = [sys.executable, str(ROOT / "examples" / example), "--nproc", "2", "--steps", "80",
           "--freeze-step", "20", "--check"] + ([] if hooked else ["--without-hook"])
    out, acc = run_with_output(cmd)
    _ddp_check(out, hooked)
    assert acc > 80.0
