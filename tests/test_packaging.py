"""The wheel installs `onebit` only: builders and kernels live inside it."""
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_contains_only_the_onebit_package(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300,
                          env={"ONEBIT_NO_AOT": "1", "PATH": "/usr/bin:/bin",
                               "HOME": str(tmp_path), "PIP_CONFIG_FILE": "/dev/null"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    wheel = next(tmp_path.glob("onebit-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops <= {"onebit", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}, tops
    for needed in ("onebit/builders/cpu.py", "onebit/kernels/cpu/packbits.cpp",
                   "onebit/kernels/cuda/packbits.cu", "onebit/kernels/sycl/packbits.cpp",
                   "onebit/backends/base.py", "onebit/bench/__main__.py"):
        assert needed in names, needed
