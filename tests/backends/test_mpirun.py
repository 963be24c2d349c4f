"""Launch tests/mpi under the project's own MPI (from the [mpi] extra) with
2, 3 and 4 ranks. These fail, not skip, when MPI is missing: the README's
test command installs it."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the fast tier (-m "not slow") leaves these out

TESTS = Path(__file__).resolve().parents[1]  # tests/, where mpi/ lives


def mpiexec() -> str:
    exe = Path(sys.executable).parent / "mpiexec"  # the venv's, not whatever is on PATH
    if not exe.exists():
        pytest.fail(f"no mpiexec beside {sys.executable}: pip install '.[mpi]' installs MPICH")
    return str(exe)


def run_under_mpiexec(ranks: int, args: list, timeout_s: int) -> subprocess.CompletedProcess:
    """`python ARGS` on `ranks` ranks under the venv's mpiexec, one thread
    each; a test failure, with the output so far, past `timeout_s`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env,
                              cwd=TESTS.parent)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"mpirun -n {ranks} hung past {timeout_s} s:\n{(exc.stdout or b'')[-3000:]}")


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_mpi_suite_under_mpirun(ranks):
    proc = run_under_mpiexec(ranks, ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                                     "--timeout=240", str(TESTS / "mpi")], 420)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert out.count(" passed") == ranks, out[-3000:]  # every rank reports its pass line


@pytest.mark.mpi
def test_a_peer_that_misses_an_mpi_collective_ends_in_a_timely_error():
    """MPI_Wait has no deadline: before the backends polled MPI_Test against
    `timeout_s`, rank 0 waited for rank 1 for ever. Now, with rank 1 late by
    three deadlines, every rank raises CommunicationError naming the phase
    within the deadline, in the flat backend and in the hierarchical one
    (the peer_stops.py script also runs the agreed-once backends an owner
    builds, whose first collectives are phase 1 and the node's stage 1)."""
    proc = run_under_mpiexec(2, [str(TESTS / "mpi" / "peer_stops.py")], 120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert len(results) == 8, out[-4000:]
    # (a direct call's first collective is the layout agreement)
    first_phase = {"flat": "agreeing on the compressed buffer's layout",
                   "hierarchical": "agreeing on the compressed buffer's layout",
                   "flat-once": "phase 1 (MPI all-to-all",
                   "hierarchical-once": "stage 1 (MPI reduce-scatter"}
    for line in results:
        _, case, _, rank, _, seconds, _, outcome = line.split(" ", 7)
        assert outcome.startswith("CommunicationError"), line
        assert "within 2 s" in outcome and "end the job" in outcome, line
        assert float(seconds) < 2.0 + 3.0, line  # the deadline, not the peer's 6 s
        if rank == "0":  # waiting on the late rank's first collective
            assert first_phase[case] in outcome, line
