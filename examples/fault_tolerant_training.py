"""Fault-tolerant 1-bit training on torchft, in one command.

Starts a torchft Lighthouse and R replica processes on this machine, each
training the benchmark language model (benchmarks/lm.py's TinyGPT) with
OnebitAdam through onebit.fault_tolerance; with --kill-every it kills a
replica (SIGKILL) every that many seconds and starts it again, and the
survivors go on while it heals from a peer:

  pip install -e ".[ft]"
  python examples/fault_tolerant_training.py --replicas 4 --steps 300 --kill-every 30

It prints the goodput (committed steps per second), the held-out loss at
the end, and the bytes a replica sends in a committed 1-bit step. --baseline
first runs the same training with no faults, and prints the ratios.
"""
import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(a: argparse.Namespace) -> None:
    import torch

    import onebit
    from onebit.fault_tolerance import FaultTolerantOptimizer, replica_manager
    sys.path.insert(0, ROOT)
    from benchmarks.lm import TinyGPT, held_out_loss, load_tokens, sample_batch

    torch.set_num_threads(1)
    train_ids, held_ids, vocab = load_tokens(a.vocab)
    torch.manual_seed(0)
    model = TinyGPT(vocab, a.dim, a.layers, a.heads, a.context)
    manager = replica_manager(model, lighthouse_addr=a.lighthouse,
                              replica_id=f"replica_{a.replica}", timeout_s=a.timeout_s)
    freeze = max(1, int(a.freeze * a.steps))
    opt = FaultTolerantOptimizer(manager, model.parameters(), lambda ps: onebit.OnebitAdam(
        ps, lr=a.lr, freeze_step=freeze, timeout_s=a.timeout_s))
    held = sample_batch(held_ids, torch.Generator().manual_seed(12345), 128, a.context)
    with open(a.out, "a") as out:
        while manager.current_step() < a.steps:
            started = time.time()
            opt.zero_grad()
            step = manager.current_step()
            gen = torch.Generator().manual_seed(1000 * step + a.replica)
            ids = sample_batch(train_ids, gen, a.batch, a.context)
            logits = model(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab),
                                                     ids[:, 1:].reshape(-1))
            loss.backward()
            committed = opt.step()
            # A replica of its own machine: the step takes at least --step-time
            # whatever the other replicas on this box do with the cores.
            time.sleep(max(0.0, a.step_time - (time.time() - started)))
            stats = opt.comm_stats()
            record = dict(replica=a.replica, step=step, committed=committed, t=time.time(),
                          replicas=manager.num_participants(), bytes=stats["bytes_sent"],
                          compressed=stats["stage"] == "compression")
            if committed and manager.current_step() == a.steps:
                record.update(held_out=held_out_loss(model, held, vocab))
            out.write(json.dumps(record) + "\n")
            out.flush()
    manager.shutdown(wait=False)


def run_replicas(a: argparse.Namespace, kill_every: float) -> dict:
    """One training run of a.replicas replicas; the summary of its records."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2,
                                  join_timeout_ms=1000, heartbeat_timeout_ms=2000)
    out = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False).name
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "RUST_LOG": "error"}

    def start(r: int) -> subprocess.Popen:
        args = [sys.executable, os.path.abspath(__file__), "--worker", "--replica", str(r),
                "--lighthouse", lighthouse.address(), "--out", out]
        for name in ("steps", "freeze", "lr", "vocab", "dim", "layers", "heads", "context",
                     "batch", "timeout_s", "step_time"):
            args += [f"--{name.replace('_', '-')}", str(getattr(a, name))]
        return subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL)

    procs = {r: start(r) for r in range(a.replicas)}
    kills, restarts, rng = 0, 0, random.Random(a.seed)
    next_kill = time.time() + kill_every if kill_every else float("inf")
    deadline = time.time() + a.deadline_s
    finished = None  # when the first replica committed the last step
    while any(p.poll() is None for p in procs.values()) and time.time() < deadline:
        time.sleep(0.2)
        if finished is None and '"held_out"' in open(out).read():
            finished = time.time()
        if finished is not None:  # the run is over: a replica restarted now has no peers
            if time.time() > finished + 20:
                break
            continue
        for r, p in procs.items():  # a supervisor's job (torchx, SLURM): restart what died
            if p.poll() not in (None, 0):
                procs[r] = start(r)
                restarts += 1
        if time.time() >= next_kill:
            victim = rng.choice([r for r, p in procs.items() if p.poll() is None] or [0])
            if procs[victim].poll() is None:
                procs[victim].send_signal(signal.SIGKILL)
                procs[victim].wait()
                procs[victim] = start(victim)
                kills += 1
            next_kill += kill_every
    for p in procs.values():
        if p.poll() is None:
            p.kill()
    lighthouse.shutdown()
    records = [json.loads(line) for line in open(out)]
    os.unlink(out)
    committed = [r for r in records if r["committed"]]
    first = min(r["t"] for r in committed if r["step"] == 0)
    last = max(r["t"] for r in committed)
    ends = [r for r in committed if "held_out" in r]
    full = [r["bytes"] for r in committed if r["compressed"] and r["replicas"] == a.replicas]
    return dict(kills=kills, restarts=restarts,
                failed_steps=sum(not r["committed"] for r in records),
                seconds=last - first, steps_per_s=a.steps / (last - first),
                held_out=ends[0]["held_out"] if ends else float("nan"),
                # what a rank sends in a committed 1-bit step with every replica in
                bytes_per_step=statistics.mean(full) if full else float("nan"),
                identical_end=len({r["held_out"] for r in ends}) == 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--kill-every", dest="kill_every", type=float, default=0.0,
                   help="kill a replica every this many seconds and restart it (0: no faults)")
    p.add_argument("--baseline", action="store_true", help="run with no faults first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline-s", dest="deadline_s", type=float, default=1800)
    p.add_argument("--freeze", type=float, default=0.2)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--timeout-s", dest="timeout_s", type=float, default=10.0)
    p.add_argument("--step-time", dest="step_time", type=float, default=0.0,
                   help="pad each step to this many seconds: replicas sharing a small box "
                        "then run as if each had its own machine")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--replica", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    if a.replicas < 2:
        p.error("--replicas must be at least 2 (a fault needs survivors)")
    runs = ([("no faults", 0.0)] if a.baseline or not a.kill_every else []) + \
        ([(f"kill every {a.kill_every:g} s", a.kill_every)] if a.kill_every else [])
    results = {}
    print(f"# {a.replicas} replicas, {a.steps} steps of OnebitAdam on TinyGPT "
          f"(dim {a.dim}, {a.layers} layers), torchft on loopback")
    print(f"{'run':>20} {'kills':>6} {'crashes':>8} {'failed':>7} {'seconds':>8} {'steps/s':>8} "
          f"{'held-out':>9} {'bytes/step':>11}")
    for name, every in runs:
        r = results[name] = run_replicas(a, every)
        print(f"{name:>20} {r['kills']:>6} {r['restarts']:>8} {r['failed_steps']:>7} "
              f"{r['seconds']:>8.1f} {r['steps_per_s']:>8.2f} {r['held_out']:>9.4f} "
              f"{r['bytes_per_step']:>11.0f}")
    if len(results) == 2:
        free, faulty = results["no faults"], results[runs[1][0]]
        print(f"goodput {faulty['steps_per_s'] / free['steps_per_s']:.1%} of the fault-free run; "
              f"held-out loss {faulty['held_out'] / free['held_out'] - 1:+.2%}; "
              f"bytes per committed step x{faulty['bytes_per_step'] / free['bytes_per_step']:.3f}")


if __name__ == "__main__":
    main()
