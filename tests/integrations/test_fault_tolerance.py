"""Training that survives a replica failing: onebit on torchft
(onebit.fault_tolerance). Three replicas of one process each, a Lighthouse
on loopback, gloo; faults injected by the replicas themselves
(tests/integrations/ft_replica.py) at a committed step, as torchft's own tests do.

What must hold for every fault: no hang; the survivors go on; a step that
failed is applied nowhere (params as before it); every committed step
leaves every replica that took it with the same bits; a restarted replica
heals from a peer and is then bitwise equal to it; the run ends with
identical replicas."""
import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

torchft = pytest.importorskip("torchft", reason="the [ft] extra (torchft) is not installed")
from torchft.coordination import LighthouseServer  # noqa: E402

slow = pytest.mark.slow  # each run starts 3-4 interpreters and waits out deadlines

REPLICA = str(Path(__file__).with_name("ft_replica.py"))
ROOT = str(Path(__file__).resolve().parents[2])
STEPS, FREEZE, FAULT_STEP = 14, 5, 8
DEADLINE_S = 150


class Run:
    """A Lighthouse and replica processes; `records(r)` is what replica r wrote."""

    def __init__(self, tmp_path: Path, optimizer: str = "OnebitAdam", steps: int = STEPS) -> None:
        self.lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=4000,
                                           heartbeat_timeout_ms=2000)
        self.tmp, self.optimizer, self.steps = tmp_path, optimizer, steps
        self.procs = {}

    def start(self, replica: int, *fault: str, until_replicas: int = 0) -> subprocess.Popen:
        out = self.tmp / f"replica{replica}.jsonl"
        log = open(self.tmp / f"replica{replica}.log", "a")
        env = {**os.environ, "PYTHONPATH": ROOT, "RUST_LOG": "error"}
        proc = subprocess.Popen(
            [sys.executable, REPLICA, "--replica", str(replica), "--lighthouse",
             self.lighthouse.address(), "--out", str(out), "--steps", str(self.steps),
             "--optimizer", self.optimizer, "--freeze-step", str(FREEZE),
             "--until-replicas", str(until_replicas), *fault],
            stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs.setdefault(replica, []).append(proc)
        return proc

    def wait(self, deadline_s: float = DEADLINE_S) -> None:
        end = time.monotonic() + deadline_s
        try:
            for procs in self.procs.values():
                for p in procs:
                    p.wait(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill_all()
            pytest.fail(f"a replica hung past {deadline_s} s:\n{self.logs()}")
        finally:
            self.lighthouse.shutdown()

    def kill_all(self) -> None:
        for procs in self.procs.values():
            for p in procs:
                if p.poll() is None:
                    os.kill(p.pid, signal.SIGCONT)
                    p.kill()

    def records(self, replica: int) -> list:
        path = self.tmp / f"replica{replica}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def logs(self) -> str:
        return "\n".join(f"--- replica {r}\n" + (self.tmp / f"replica{r}.log").read_text()[-3000:]
                         for r in self.procs)


def committed_digests(records: list) -> dict:
    """Manager step after the commit -> params digest, for one replica."""
    return {r["after"]: r["params"] for r in records if r["committed"]}


def check_replicas_agree(run: Run, replicas) -> None:
    """Every committed step: one digest among the replicas that took it;
    every failed step left the params (DiLoCo: the anchors, the params
    keeping this replica's inner progress) as the last committed one did."""
    by_step = {}
    for r in replicas:
        recs = run.records(r)
        last = None
        for rec in recs:
            kept = rec.get("anchors", rec["params"])
            if rec["committed"]:
                by_step.setdefault(rec["after"], set()).add((rec["params"], kept))
                last = kept
            elif last is not None:
                assert kept == last, f"replica {r}: a failed step moved what it must not"
    split = {s: d for s, d in by_step.items() if len(d) > 1}
    assert not split, f"replicas differ after committed steps {sorted(split)}:\n{run.logs()}"


def final(run: Run, replica: int) -> dict:
    recs = [r for r in run.records(replica) if r["committed"]]
    assert recs, f"replica {replica} committed nothing:\n{run.logs()}"
    return recs[-1]


@slow
def test_fault_free_replicas_match_the_plain_run_step_by_step(tmp_path):
    """Without faults the wrapper adds nothing to the maths: three torchft
    replicas commit every step, identical after each, through warmup and
    compression."""
    run = Run(tmp_path)
    for r in range(3):
        run.start(r)
    run.wait()
    check_replicas_agree(run, range(3))
    for r in range(3):
        recs = run.records(r)
        assert all(rec["committed"] for rec in recs), recs
        assert [rec["after"] for rec in recs] == list(range(1, STEPS + 1))
        assert recs[-1]["stage"] == "compression"
    assert len({final(run, r)["params"] for r in range(3)}) == 1


# Every fault point with OnebitAdam; the other optimizers at the hardest
# one, inside the exchange (the wrapper around them is the same).
@slow
@pytest.mark.parametrize("optimizer,fault", [
    ("OnebitAdam", "kill-before"), ("OnebitAdam", "kill-during"), ("OnebitAdam", "kill-after"),
    ("ZeroOneAdam", "kill-during"), ("OnebitLamb", "kill-during"),
    ("DiLoCo-1bit", "kill-during"), ("DiLoCo-2bit", "kill-during"),
    ("DiLoCo-sparse2bit", "kill-during")])
def test_a_killed_replica_costs_one_step_and_the_survivors_go_on(tmp_path, optimizer, fault):
    run = Run(tmp_path, optimizer)
    for r in range(3):
        run.start(r, *(["--fault", fault, "--fault-step", str(FAULT_STEP)] if r == 1 else []))
    run.wait()
    assert run.procs[1][0].returncode == -signal.SIGKILL
    for r in (0, 2):
        assert run.procs[r][0].returncode == 0, run.logs()
    check_replicas_agree(run, (0, 1, 2))
    for r in (0, 2):
        recs = run.records(r)
        assert final(run, r)["after"] == STEPS
        assert final(run, r)["replicas"] == 2
        # The fault step is the only one retried: at most one failed step.
        failed = [rec for rec in recs if not rec["committed"]]
        assert len(failed) <= 1 and all(rec["step"] == FAULT_STEP for rec in failed), failed
    assert final(run, 0)["params"] == final(run, 2)["params"]


@slow
@pytest.mark.parametrize("optimizer", ["OnebitAdam", "DiLoCo-1bit"])
def test_a_killed_replica_restarted_heals_and_ends_identical(tmp_path, optimizer):
    run = Run(tmp_path, optimizer)
    for r in range(3):
        run.start(r, *(["--fault", "kill-during", "--fault-step", str(FAULT_STEP)] if r == 1
                       else []), until_replicas=3)
    first = run.procs[1][0]
    first.wait(timeout=DEADLINE_S)
    run.start(1, until_replicas=3)  # the same replica id, fresh process and fresh params
    run.wait()
    for r in range(3):
        assert run.procs[r][-1].returncode == 0, run.logs()
    check_replicas_agree(run, range(3))
    healed = [rec for rec in run.records(1) if rec["committed"]]
    # It joined past the warmup: its first committed step is in compression,
    # with the counters of its peers, not a warmup of its own.
    rejoined = [rec for rec in healed if rec["after"] > FAULT_STEP]
    rounds = optimizer.startswith("DiLoCo")  # counters: inner steps, 4 a round
    assert rejoined and rejoined[0]["counters"] == rejoined[0]["after"] * (4 if rounds else 1)
    assert rejoined[0]["stage"] == ("rounds" if rounds else "compression")
    assert len({final(run, r)["params"] for r in range(3)}) == 1
    assert final(run, 1)["replicas"] == 3


@slow
def test_a_stopped_replica_past_the_timeout_rejoins_after_continuing(tmp_path):
    run = Run(tmp_path)
    for r in range(3):
        run.start(r, *(["--fault", "stop", "--fault-step", str(FAULT_STEP)] if r == 1 else []),
                  until_replicas=3)
    stopped = run.procs[1][0]
    end = time.monotonic() + DEADLINE_S
    state = Path(f"/proc/{stopped.pid}/stat")
    while time.monotonic() < end and state.read_text().split()[2] != "T":  # T: stopped
        time.sleep(0.1)
    time.sleep(12)  # past the replicas' timeout (6 s) and the heartbeat's (2 s)
    os.kill(stopped.pid, signal.SIGCONT)
    run.wait()
    for r in range(3):
        assert run.procs[r][0].returncode == 0, run.logs()
    check_replicas_agree(run, range(3))
    for r in (0, 2):
        failed = [rec for rec in run.records(r) if not rec["committed"]]
        assert failed, "the survivors never noticed the stopped replica"
    assert len({final(run, r)["params"] for r in range(3)}) == 1


# ---------------------------------------------------------------------------
# The transaction, with no processes: a stand-in for torchft's Manager that
# votes as told, at world size 1 (no process group).

class _Group:
    generation = 0
    replica_rank, replica_world_size = 0, 1


class _VotingManager:
    def __init__(self) -> None:
        self.onebit_group = _Group()
        self.votes, self.errors, self.fns = [], [], {}

    def start_quorum(self) -> None:
        pass

    def errored(self):
        return self.errors[-1] if self.errors else None

    def report_error(self, exc) -> None:
        self.errors.append(exc)

    def should_commit(self) -> bool:
        return self.votes.pop(0)

    def register_state_dict_fn(self, key, load, save) -> None:
        self.fns[key] = (load, save)


def _fast(test):
    return pytest.mark.parametrize("optimizer", ["OnebitAdam", "OnebitLamb", "ZeroOneAdam"])(
        pytest.mark.filterwarnings("ignore::UserWarning")(test))


def _wrapped(optimizer):
    import onebit
    from onebit.fault_tolerance import FaultTolerantOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    manager = _VotingManager()
    kinds = {"OnebitAdam": lambda ps: onebit.OnebitAdam(ps, lr=1e-2, freeze_step=2),
             "OnebitLamb": lambda ps: onebit.OnebitLamb(ps, lr=1e-2, freeze_step=2),
             "ZeroOneAdam": lambda ps: onebit.ZeroOneAdam(ps, lr=1e-2, var_freeze_step=2)}
    return model, manager, FaultTolerantOptimizer(manager, model.parameters(), kinds[optimizer])


def _train_step(model, opt, t):
    g = torch.Generator().manual_seed(t)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(torch.randn(4, 5, generator=g)),
                                 torch.randn(4, 2, generator=g)).backward()
    return opt.step()


@_fast
def test_a_refused_step_leaves_params_state_and_counters_as_they_were(optimizer):
    """should_commit() says no: the step is applied nowhere, and the same
    step taken again gives the bits of a run that never failed."""
    model, manager, opt = _wrapped(optimizer)
    ref_model, ref_manager, ref = _wrapped(optimizer)
    manager.votes = [True, True, True, False, True, True]
    ref_manager.votes = [True] * 5
    for t in range(3):
        assert _train_step(model, opt, t) and _train_step(ref_model, ref, t)
    before = [p.detach().clone() for p in model.parameters()]
    state_before = copy.deepcopy(opt.state_dict())
    assert not _train_step(model, opt, 3)  # refused
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    opt.zero_grad()  # the next quorum: the optimizer is rebuilt from the snapshot
    after = opt.state_dict()
    assert after["param_groups"][0]["onebit"] == state_before["param_groups"][0]["onebit"]
    assert after["state"].keys() == state_before["state"].keys()
    for i, st in state_before["state"].items():
        for name, value in st.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(after["state"][i][name], value), (i, name)
    for t in (3, 4):
        assert _train_step(model, opt, t) and _train_step(ref_model, ref, t)
    for p, r in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, r)
    assert opt.committed_steps == 5 and opt.failed_steps == 1


@_fast
def test_a_failed_exchange_votes_no_and_rolls_back(optimizer):
    from onebit.collectives import CommunicationError

    model, manager, opt = _wrapped(optimizer)
    manager.votes = [True, True, True]
    for t in range(2):
        assert _train_step(model, opt, t)
    before = [p.detach().clone() for p in model.parameters()]

    def dies(*a, **k):
        raise CommunicationError("onebit: compressed_allreduce phase 1 failed (test)")
    opt.optimizer.step = dies
    assert not _train_step(model, opt, 2)
    assert manager.errors and isinstance(manager.errors[0], CommunicationError)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_needs_the_managers_replica_group():
    from onebit.fault_tolerance import FaultTolerantOptimizer

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="replica_manager"):
        FaultTolerantOptimizer(object(), model.parameters(), lambda ps: None)


@slow
def test_the_example_runs_in_one_command_and_reports_what_a_fault_cost():
    """examples/fault_tolerant_training.py, as docs/fault_tolerance.md runs
    it, scaled down: 3 replicas, a kill every 8 s, beside a fault-free run.
    Its table and its summary line come out, the killed run committed every
    step, and a committed 1-bit step sent what the fault-free one did."""
    cmd = [sys.executable, str(Path(ROOT) / "examples" / "fault_tolerant_training.py"),
           "--replicas", "3", "--steps", "200", "--kill-every", "8", "--step-time", "0.1",
           "--baseline", "--deadline-s", "150"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=280,
                         env={**os.environ, "PYTHONPATH": ROOT}).stdout
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.strip().startswith(("no faults", "kill every"))}
    assert set(rows) == {"no", "kill"}, out
    kills = int(rows["kill"][4])  # "kill every 8 s  KILLS ..."
    assert kills >= 1, out
    summary = [line for line in out.splitlines() if line.startswith("goodput")]
    assert summary and "bytes per committed step x1.000" in summary[0], out
