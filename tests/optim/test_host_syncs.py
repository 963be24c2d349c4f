"""At most one host sync per compression-stage step (no MPI): the ranks'
agreement reads its gathered table once, and nothing else in the step, the
compressed allreduce included, waits for the device. 1-bit LAMB reads its
trust ratios once more (the norms of every param and update, in one read):
they are Python numbers in its fused update, whose rounding the bits fixture
holds. On a GPU a host sync
stalls the CPU until the stream drains, so each one costs the overlap of the
next step's launch with this one's kernels.

Counted without a GPU: a dispatch mode sees every op that reads a tensor's
value on the host (`.item()`, `bool(t)`, `float(t)`, `nonzero`) and a
function mode every `.tolist()`, on 2 real ranks. The first compression step
is left out: it measures the zero-variance guard once (guards.py)."""
import collections
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tests.distributed import run_workers

READS_ON_HOST = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default,
                 torch.ops.aten.nonzero.default}


class HostSyncs(TorchDispatchMode):
    """Counts host reads of tensor values, by where in onebit they happen."""

    def __init__(self):
        super().__init__()
        self.where = collections.Counter()

    def note(self, what: str) -> None:
        frames = [f"{f.filename.rsplit('onebit/', 1)[-1]}:{f.lineno}"
                  for f in traceback.extract_stack() if "/onebit/" in f.filename]
        self.where[f"{what} at {' < '.join(reversed(frames[-3:]))}"] += 1

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        if op in READS_ON_HOST:
            self.note(str(op))
        return op(*args, **(kwargs or {}))


class ToList(TorchFunctionMode):
    def __init__(self, syncs: HostSyncs):
        super().__init__()
        self.syncs = syncs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "tolist":
            self.syncs.note("tolist")
        return func(*args, **(kwargs or {}))


class Model(torch.nn.Module):
    """An embedding whose rows a batch mostly misses, a head that never gets
    a gradient, and scales 1e3 apart."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(100, 16)
        self.hidden = torch.nn.Linear(48, 8)
        self.out = torch.nn.Parameter(torch.randn(8, 4) * 1e3)
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.hidden(self.emb(x).flatten(1)) @ self.out


STAGES = {"OnebitAdam": dict(freeze_step=3), "OnebitLamb": dict(freeze_step=3),
          "ZeroOneAdam": dict(var_freeze_step=3, local_step_scaler=2, local_step_clipper=2)}
STEPS = 12
ALLOWED = {"OnebitAdam": 1, "OnebitLamb": 2, "ZeroOneAdam": 1}


def _count_syncs(rank, world, name):
    import onebit

    torch.manual_seed(0)
    model = Model()
    opt = getattr(onebit, name)(model.parameters(), lr=1e-3, weight_decay=1e-2, **STAGES[name])
    counts = []
    for step in range(1, STEPS + 1):
        g = torch.Generator().manual_seed(100 * rank + step)
        opt.zero_grad()
        model(torch.randint(0, 100, (5, 3), generator=g)).pow(2).mean().backward()
        syncs = HostSyncs()
        with syncs, ToList(syncs):
            opt.step()
        counts.append((step, sum(syncs.where.values()), dict(syncs.where)))
    return counts


@pytest.mark.parametrize("name", list(STAGES))
def test_one_host_sync_per_compression_step(name):
    allowed = ALLOWED[name]
    first_compressed = STAGES[name].get("freeze_step", STAGES[name].get("var_freeze_step")) + 1
    for rank, counts in enumerate(run_workers(_count_syncs, 2, name, timeout=120)):
        for step, n, where in counts:
            if step > first_compressed:
                assert n <= allowed, f"rank {rank}, step {step}: {n} host syncs: {where}"
        # The counter sees syncs where they happen: the agreement's one.
        assert all(n >= 1 for _, n, _ in counts), counts
