"""benchmarks/shaped_net.sh: the link-speed benchmarks' network of shaped "hosts".

It needs root; without root it says so and changes nothing. With root (and
network namespaces allowed) every rank gets the torchrun variables, and the
namespaces are gone after the run, after a failing rank and after Ctrl-C; a
run removes what a SIGKILLed run left, and a second concurrent run refuses."""
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = str(ROOT / "benchmarks" / "shaped_net.sh")


def namespaces():
    if shutil.which("ip") is None:  # no iproute2: no namespaces either
        return []
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return sorted(line.split()[0] for line in proc.stdout.splitlines() if line.startswith("obn"))


def can_make_namespaces():
    """Why the namespace tests cannot run here ("" when they can). Runs at
    collection: on a machine without `ip` (a bare GPU box) it must say so,
    not fail the whole collection (`pytest -m gpu tests`)."""
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "no `ip` or `tc` command here (iproute2)"
    proc = subprocess.run(["ip", "netns", "add", "obn_probe"], capture_output=True, text=True)
    if proc.returncode != 0:
        return "network namespaces refused here: " + proc.stderr.strip()
    subprocess.run(["ip", "netns", "del", "obn_probe"])
    return ""


@pytest.mark.parametrize("args", [[], ["run"], ["run", "0", "none", "--", "true"],
                                  ["run", "2", "none", "true"], ["spin", "2"]])
def test_wrong_usage_exits_2_with_the_usage(args):
    proc = subprocess.run(["bash", TOOL, *args], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "shaped_net.sh" in proc.stderr, proc.stderr


def test_without_root_it_says_so_and_builds_nothing(tmp_path):
    fake_id = tmp_path / "id"
    fake_id.write_text("#!/bin/sh\necho 1000\n")
    fake_id.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    before = namespaces()
    proc = subprocess.run(["bash", TOOL, "run", "2", "none", "--", "true"], capture_output=True,
                          text=True, timeout=30, env=env)
    assert proc.returncode == 1 and "needs root" in proc.stderr and "sudo" in proc.stderr
    assert namespaces() == before


WHY_NOT = can_make_namespaces()
needs_namespaces = pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "ok")


@needs_namespaces
def test_every_rank_gets_its_torchrun_variables_and_the_network_goes():
    env = {**os.environ, "PER_HOST": "2"}
    proc = subprocess.run(["bash", TOOL, "run", "2", "100mbit", "--", "sh", "-c",
                           "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR "
                           "$GLOO_SOCKET_IFNAME"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    rows = sorted(proc.stdout.split("\n")[:-1])
    assert rows == ["0 4 0 2 10.201.0.1 obnv0", "1 4 1 2 10.201.0.1 obnv0",
                    "2 4 0 2 10.201.0.1 obnv1", "3 4 1 2 10.201.0.1 obnv1"]
    assert namespaces() == []


@needs_namespaces
def test_a_failing_rank_is_the_exit_status():
    proc = subprocess.run(["bash", TOOL, "run", "3", "none", "--", "sh", "-c", "exit $((RANK * 3))"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3 and namespaces() == []


@needs_namespaces
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_stops_the_ranks_and_removes_the_network(sig):
    # As from a terminal: bash cannot trap a signal that was ignored when it
    # started, and a CI runner that starts the suite in the background with
    # job control off hands every child SIGINT ignored.
    proc = subprocess.Popen(["bash", TOOL, "run", "2", "none", "--", "sleep", "60"],
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_for_namespaces(["obn0", "obn1"])
        time.sleep(0.3)  # the ranks are started right after the network
        proc.send_signal(sig)
        assert proc.wait(timeout=20) == 128 + sig
    finally:
        stop(proc)
    assert namespaces() == []
    assert subprocess.run(["pgrep", "-f", "sleep 60"], capture_output=True).returncode == 1


@needs_namespaces
def test_a_run_removes_what_a_killed_larger_run_left_behind():
    subprocess.run(["ip", "netns", "add", "obn7"], check=True)  # as a SIGKILLed P=8 run leaves it
    proc = subprocess.run(["bash", TOOL, "run", "2", "none", "--", "true"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert namespaces() == []


@needs_namespaces
def test_a_second_run_fails_at_once_and_leaves_the_first_ones_network():
    first = subprocess.Popen(["bash", TOOL, "run", "2", "none", "--", "sleep", "30"])
    try:
        wait_for_namespaces(["obn0", "obn1"])
        second = subprocess.run(["bash", TOOL, "run", "3", "none", "--", "true"],
                                capture_output=True, text=True, timeout=30)
        assert second.returncode == 1 and "holds the network" in second.stderr, second.stderr
        assert namespaces() == ["obn0", "obn1"]
    finally:
        stop(first)
    assert namespaces() == []


def wait_for_namespaces(expected):
    deadline = time.monotonic() + 30
    while namespaces() != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    assert namespaces() == expected


def stop(proc):
    """End the tool the way a user would (SIGTERM), so it removes its network.
    If it does not end, that is a failure of its own: SIGKILL it and remove
    what it leaves, so later tests and benchmarks on this machine do not run
    on a stale shaped network."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            subprocess.run(["bash", TOOL, "down", "1"], timeout=30)
            raise AssertionError("shaped_net.sh did not end within 20 s of SIGTERM")
