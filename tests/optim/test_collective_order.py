"""One order of collectives across process groups, on every rank.

With overlap_backward the bucket exchanges run on a communication thread,
over a process group of their own, while step() makes its agreement on the
optimizer's group. NCCL can deadlock when ranks issue the operations of two
communicators in different orders, so step()'s collective goes behind the
queued exchanges, on their thread (BackwardOverlap.in_order). Checked on 3
real gloo ranks through recording collectives: every collective of every
group is logged as it is issued, after a random delay drawn differently on
each rank (which, without the ordering, lets the agreement overtake some
exchanges on one rank and not on another), and the logs must be equal."""
import pytest
import torch

from tests.distributed import run_workers
from tests.optim.test_overlap import STAGES, Model, batch

RECORDED = ("all_to_all_single", "all_gather", "all_gather_into_tensor", "all_reduce",
            "broadcast", "barrier", "reduce_scatter_tensor")


def _record_collectives(rank: int) -> list:
    """Wrap torch.distributed's collectives (and onebit's alias of the flat
    all-gather): each logs (group, op) when issued, after a random delay."""
    import random
    import time

    import torch.distributed as dist

    from onebit import collectives

    log, delays = [], random.Random(7919 * rank + 1)

    def recording(real, name):
        def issue(*args, **kwargs):
            time.sleep(delays.random() * 0.01)
            group = kwargs.get("group")
            log.append(("world" if group is None else group.group_name, name))
            return real(*args, **kwargs)
        return issue

    for name in RECORDED:
        if hasattr(dist, name):
            setattr(dist, name, recording(getattr(dist, name), name))
    collectives.all_gather_flat = recording(collectives.all_gather_flat, "all_gather_flat")
    return log


def _train_recorded(rank, world, cls_name, steps):
    import onebit

    log = _record_collectives(rank)
    torch.manual_seed(0)
    model = Model()
    opt = getattr(onebit, cls_name)(model.parameters(), lr=1e-2, overlap_backward=True,
                                    bucket_cap_mb=0.004, **STAGES[cls_name])
    start = len(log)  # construction's collectives are in order by construction
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return log[start:], opt.overlap_stats()["launched_in_backward"]


@pytest.mark.parametrize("cls_name", ["OnebitAdam", "ZeroOneAdam"])
def test_every_rank_issues_the_collectives_of_both_groups_in_one_order(cls_name):
    steps = 12
    out = run_workers(_train_recorded, 3, cls_name, steps, timeout=240)
    logs = [log for log, _ in out]
    assert all(launched > steps for _, launched in out), "the exchanges must start in backward"
    groups = {g for g, _ in logs[0]}
    assert len(groups) == 2, f"expected the optimizer's group and the exchanges' own: {groups}"
    assert all(len(log) == len(logs[0]) for log in logs)
    for r, log in enumerate(logs[1:], 1):
        first = next((i for i, (a, b) in enumerate(zip(logs[0], log)) if a != b), None)
        assert first is None, (f"rank {r} issued {log[first]} where rank 0 issued "
                               f"{logs[0][first]} (collective {first})")
