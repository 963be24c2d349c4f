"""The wheel installs the library, `onebit` only: builders and kernel sources
inside it, and none of the checkout's research harness (benchmarks/, its corpus,
examples/)."""
import pytest
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

pytestmark = pytest.mark.slow  # the fast tier (-m "not slow") leaves these out

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_contains_only_the_onebit_package(tmp_path):
    # Build from a clean copy: a stale build/ folder would mask missing packages.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".venv", "build", "dist", "*.egg-info", "__pycache__", ".git", "*.so"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=300,
                          env={"ONEBIT_NO_AOT": "1", "PATH": "/usr/bin:/bin",
                               "HOME": str(tmp_path), "PIP_CONFIG_FILE": "/dev/null"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    wheel = next(tmp_path.glob("onebit-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops <= {"onebit", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}, tops
    sources = [str(p.relative_to(ROOT)) for p in (ROOT / "onebit").rglob("*")
               if p.suffix in (".py", ".cpp", ".cu", ".h") and "__pycache__" not in p.parts]
    assert any(s.endswith(".cu") for s in sources) and any(s.endswith("builders/cpu.py") for s in sources)
    assert "onebit/kernels/common/onebit_kernels.h" in sources  # every kernel includes it
    missing = sorted(set(sources) - set(names))
    assert not missing, f"not in the wheel: {missing}"  # an editable install would hide this
    harness = [n for n in names if n.endswith(".gz") or "/lm" in n or "convergence" in n or "soak" in n]
    assert not harness, harness
