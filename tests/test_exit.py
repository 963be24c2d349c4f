"""A finished 2-rank job exits 0 (issue 32's SIGABRT at exit).

torch's gloo worker thread used to drop the last reference to a onebit
collective's work after the script ended; the work's destructor then took
the GIL from a finalizing interpreter and the process aborted ("terminate
called without an active exception"): 7 to 10 of 40 runs of this script
before collectives.py held the last works. The same race in torch's own
collectives is pytorch/pytorch#190489 (about 1 in 30 runs of a plain DDP +
torch Adam script here): not ours to fix, so the script below ends on
onebit's collectives, in the compressed stage and in warmup."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SCRIPT = """
import os, sys
import torch
import torch.distributed as dist
import onebit

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 4))
opt = onebit.OnebitAdam(model.parameters(), lr=1e-3, freeze_step=int(sys.argv[1]))
model.register_comm_hook(opt.ddp_hook_state(), onebit.ddp_comm_hook)
for t in range(6):
    opt.zero_grad()
    model(torch.randn(8, 32)).pow(2).mean().backward()
    opt.step()
print("done", dist.get_rank())
"""


@pytest.mark.timeout(400)
def test_twenty_finished_two_rank_jobs_all_exit_0(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    failures = []
    for i in range(20):
        freeze = "3" if i % 2 else "100"  # ends compressed, or in warmup (the DDP hook's allreduce)
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                               "2", "--master-port", str(29600 + i), str(script), freeze],
                              capture_output=True, text=True, timeout=60)
        if proc.returncode != 0 or proc.stdout.count("done") != 2:
            failures.append((i, proc.returncode, proc.stderr[-400:]))
    # Before the fix about 1 run in 5 aborted; after it, 0 in 110 runs. At
    # most one of 20 keeps a rare abort of torch's own (the docstring) from
    # failing CI, and still fails a regression 93 times in 100.
    assert len(failures) <= 1, failures
