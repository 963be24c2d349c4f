"""Launch tests/mpi under the project's own MPI (from the [mpi] extra) with
2, 3 and 4 ranks. These fail, not skip, when MPI is missing: the README's
test command installs it."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the fast tier (-m "not slow") leaves these out

HERE = Path(__file__).resolve().parent


def mpiexec() -> str:
    exe = Path(sys.executable).parent / "mpiexec"  # the venv's, not whatever is on PATH
    if not exe.exists():
        pytest.fail(f"no mpiexec beside {sys.executable}: pip install '.[mpi]' installs MPICH")
    return str(exe)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_mpi_suite_under_mpirun(ranks):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "pytest", "-q", "-x",
           "-p", "no:cacheprovider", "--timeout=240", str(HERE / "mpi")]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=env,
                              cwd=HERE.parent)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"mpirun -n {ranks} hung past 420 s:\n{(exc.stdout or b'')[-3000:]}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert out.count(" passed") == ranks, out[-3000:]  # every rank reports its pass line
