"""One torchft replica for tests/integrations/test_fault_tolerance.py: a
small model with an embedding (rows absent from a batch) and a head,
trained by a onebit optimizer through `onebit.fault_tolerance`, writing one
JSON line per step (committed or not) with a digest of its params, so the
test can compare replicas bitwise.

Faults it injects in itself, at committed step `--fault-step` (an event
injector, as torchft's own tests fail at step k):
  kill-before   SIGKILL before the step's exchange starts;
  kill-during   SIGKILL inside the exchange, after its first phase was sent
                (the compressed all-gather, or the warmup's all-reduce);
  kill-after    SIGKILL after the exchange, before should_commit();
  stop          SIGSTOP inside the exchange (the test sends SIGCONT later).
"""
import argparse
import hashlib
import json
import os
import signal
import sys
import time

import torch

import onebit
from onebit import collectives
from onebit.fault_tolerance import FaultTolerantDiLoCo, FaultTolerantOptimizer, replica_manager

VOCAB, DIM, OUT = 24, 8, 3


def model_for(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, DIM), torch.nn.Flatten(),
                               torch.nn.Linear(2 * DIM, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, OUT))


def batch(replica: int, step: int):
    """This replica's batch at committed step `step`: its own data, the same
    whenever the step is taken again. Tokens come from the first 16 rows
    only, so rows 16..23 never get a gradient."""
    g = torch.Generator().manual_seed(1000 * step + replica)
    x = torch.randint(0, 16, (12, 2), generator=g)
    y = torch.randn(12, OUT, generator=g)
    return x, y


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def make_optimizer(name: str, freeze_step: int, timeout_s: float):
    def make(params):
        common = dict(lr=1e-2, timeout_s=timeout_s)
        if name == "OnebitAdam":
            return onebit.OnebitAdam(params, freeze_step=freeze_step, **common)
        if name == "OnebitLamb":
            return onebit.OnebitLamb(params, freeze_step=freeze_step, **common)
        return onebit.ZeroOneAdam(params, var_freeze_step=freeze_step, var_update_scaler=2,
                                  local_step_scaler=1000, local_step_clipper=2, **common)
    return make


class Injector:
    """Arms the fault for one committed step; the exchange's own calls fire it."""

    def __init__(self, kind: str, at: int, manager) -> None:
        self.kind, self.at, self.armed = kind, at, False
        if kind == "kill-after":  # the exchange is done, the vote not yet cast
            vote = manager.should_commit

            def should_commit(*a, **k):
                self.fire()
                return vote(*a, **k)
            manager.should_commit = should_commit
        if kind in ("kill-during", "stop"):
            inner = collectives.all_gather_flat
            inner_reduce = torch.distributed.all_reduce

            def gather(*a, **k):
                self.fire()
                return inner(*a, **k)

            def reduce(*a, **k):
                self.fire()
                return inner_reduce(*a, **k)
            collectives.all_gather_flat = gather
            torch.distributed.all_reduce = reduce

    def arm(self, step: int, phase: str) -> None:
        self.armed = step == self.at
        if self.armed and self.kind == f"kill-{phase}":
            os.kill(os.getpid(), signal.SIGKILL)

    def fire(self) -> None:
        if not self.armed:
            return
        self.armed = False
        if self.kind in ("kill-during", "kill-after"):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)


def train_diloco(args, model, manager, injector, params) -> None:
    """DiLoCo's rounds every 4 inner steps of AdamW; one record per round."""
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    wire = args.optimizer.split("-")[1]  # DiLoCo-1bit, DiLoCo-2bit, DiLoCo-sparse2bit
    ft = FaultTolerantDiLoCo(manager, model, inner, lambda: onebit.DiLoCo(
        model, inner, sync_every=4, compression=wire, timeout_s=args.timeout_s))
    replicas = 0
    with open(args.out, "a") as out:
        while manager.current_step() < args.steps or (
                replicas < args.until_replicas and manager.current_step() < args.steps + 1000):
            if manager.current_step() >= args.steps:
                time.sleep(0.05)
            step = manager.current_step()
            x, y = batch(args.replica, ft.inner_steps)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            injector.arm(step, "before")
            committed = ft.step()
            inner.zero_grad()
            if committed is None:
                continue
            anchors = digest(ft.diloco.anchors)
            record = dict(replica=args.replica, step=step, committed=committed,
                          after=manager.current_step(), loss=loss.item(),
                          replicas=manager.num_participants(), params=digest(params),
                          anchors=anchors, stage="rounds", counters=ft.inner_steps)
            replicas = record["replicas"] if committed else 0
            out.write(json.dumps(record) + "\n")
            out.flush()
    manager.shutdown(wait=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--optimizer", default="OnebitAdam")
    ap.add_argument("--freeze-step", type=int, default=6)
    ap.add_argument("--timeout-s", type=float, default=6.0)
    ap.add_argument("--fault", default="none")
    ap.add_argument("--fault-step", type=int, default=-1)
    ap.add_argument("--until-replicas", type=int, default=0,
                    help="past --steps, go on until a step commits with this many replicas")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    model = model_for(seed=args.replica)  # replicas start apart: the first quorum syncs them
    manager = replica_manager(model, lighthouse_addr=args.lighthouse,
                              replica_id=f"replica_{args.replica}", timeout_s=3 * args.timeout_s)
    injector = Injector(args.fault, args.fault_step, manager)
    params = list(model.parameters())
    if args.optimizer.startswith("DiLoCo"):
        return train_diloco(args, model, manager, injector, params)
    opt = FaultTolerantOptimizer(manager, model.parameters(),
                                 make_optimizer(args.optimizer, args.freeze_step, args.timeout_s))
    with open(args.out, "a") as out:
        replicas = 0
        while manager.current_step() < args.steps or (
                replicas < args.until_replicas and manager.current_step() < args.steps + 1000):
            if manager.current_step() >= args.steps:
                time.sleep(0.05)  # waiting for a replica to come back: no need to race
            opt.zero_grad()
            step = manager.current_step()
            x, y = batch(args.replica, step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            injector.arm(step, "before")
            committed = opt.step()
            record = dict(replica=args.replica, step=step, committed=committed,
                          after=manager.current_step(), loss=loss.item(),
                          replicas=manager.num_participants(),
                          params=digest(params), stage=opt.optimizer.stage(),
                          counters=opt.optimizer.counters["step"])
            replicas = record["replicas"] if committed else 0
            out.write(json.dumps(record) + "\n")
            out.flush()
    manager.shutdown(wait=False)
    sys.exit(0)


if __name__ == "__main__":
    main()
