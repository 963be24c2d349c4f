"""A finished 2-rank job exits 0 (issue 32's SIGABRT at exit).

torch's gloo worker thread used to drop the last reference to a onebit
collective's work after the script ended; the work's destructor then took
the GIL from a finalizing interpreter and the process aborted ("terminate
called without an active exception"): 7 to 10 of 40 runs of this script
before collectives.py held the last works. The same race in torch's own
collectives is pytorch/pytorch#190489 (about 1 in 30 runs of a plain DDP +
torch Adam script here): not ours to fix, so the script below ends on
onebit's collectives, in the compressed stage and in warmup."""
import os
import subprocess
import sys

import pytest

from onebit.launch import free_port

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


def _job(script, freeze, port):
    """Both ranks as plain processes with torchrun's variables: what is
    tested is how a rank's interpreter ends, and torchrun's agent would
    only add a third interpreter's start to each job."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), freeze],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    return [p.returncode for p in procs], "".join(o for o, _ in outs), "".join(e for _, e in outs)


@pytest.mark.timeout(400)
def test_twenty_finished_two_rank_jobs_all_exit_0(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    failures = []
    for i in range(20):
        freeze = "3" if i % 2 else "100"  # ends compressed, or in warmup (the DDP hook's allreduce)
        codes, out, err = _job(script, freeze, free_port())
        if codes != [0, 0] or out.count("done") != 2:
            failures.append((i, codes, err[-400:]))
    # Before the fix about 1 run in 5 aborted; after it, 0 in 110 runs. At
    # most one of 20 keeps a rare abort of torch's own (the docstring) from
    # failing CI, and still fails a regression 93 times in 100.
    assert len(failures) <= 1, failures
