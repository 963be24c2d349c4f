"""Following a gradient from step() to the wire and back: each module on the
way is entered once, going down the layers, and nothing below the
optimizer calls back into it.

Two moments are recorded on real ranks (gloo, 2 processes), through a
profile hook, for each optimizer over every stage it has (warmup, 1-bit
compression; 0/1 Adam's 1-bit gradients, variance updates, local steps and
syncs), with the exchange fused and with overlap_backward:

- the wire: every entry into the error-feedback exchange's compressed
  allreduce on the main thread;
- the input: every entry into the functions that write what is exchanged
  (the new momentum, a copy of the gradient, the mean direction).

At each, the onebit modules on the call stack, outermost first, with runs
of one module merged, must not name a module twice.
"""
import sys

import pytest
import torch

from tests.distributed import run_workers

WIRE = {("feedback/exchange.py", "allreduce")}
INPUT_WRITERS = {("optim/functional.py", name)
                 for name in ("momentum_into", "mul_into", "copy_unless_same_")}


def _module_path(frame):
    """The onebit modules on the stack above `frame`, outermost first,
    consecutive repeats merged."""
    files = []
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if "/onebit/" in name:
            files.append(name.split("/onebit/", 1)[1])
        frame = frame.f_back
    path = []
    for f in reversed(files):
        if not path or path[-1] != f:
            path.append(f)
    return path


def _walk(rank, world, cls_name, overlap):
    import onebit

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    kwargs = dict(lr=1e-2, overlap_backward=overlap)
    if cls_name == "ZeroOneAdam":
        kwargs.update(var_freeze_step=4, var_update_scaler=2, local_step_scaler=2,
                      local_step_clipper=4)
    else:
        kwargs.update(freeze_step=3)
    opt = getattr(onebit, cls_name)(model.parameters(), **kwargs)
    seen = []  # (moment, path)

    def profile(frame, event, arg):
        if event != "call":
            return
        name = frame.f_code.co_filename.replace("\\", "/")
        if "/onebit/" not in name:
            return
        where = (name.split("/onebit/", 1)[1], frame.f_code.co_name)
        if where in WIRE:
            seen.append(("wire", tuple(_module_path(frame))))
        elif where in INPUT_WRITERS:
            seen.append(("input", tuple(_module_path(frame))))

    stages = set()
    for step in range(14):
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        stages.add(opt.stage())
        sys.setprofile(profile)
        try:
            opt.step()
        finally:
            sys.setprofile(None)
    return sorted(stages), sorted(set(seen))


@pytest.mark.parametrize("overlap", [False, True], ids=["fused", "overlap"])
@pytest.mark.parametrize("cls_name", ["OnebitAdam", "OnebitLamb", "ZeroOneAdam"])
def test_the_gradient_goes_down_to_the_wire_and_back_without_doubling_back(cls_name, overlap):
    stages, seen = run_workers(_walk, 2, cls_name, overlap, timeout=120)[0]
    moments = {moment for moment, _ in seen}
    if not overlap:  # (with the overlap, 1-bit Adam's exchange runs on its thread)
        assert moments == {"wire", "input"}, (stages, seen)
    for moment, path in seen:
        repeated = {m for m in path if path.count(m) > 1}
        assert not repeated, f"{moment}: {' -> '.join(path)} comes back to {repeated}"
        if moment == "input":  # written by the optimizer, not from inside the exchange
            assert not any(m.startswith("feedback/") or m == "optim/step_exchange.py"
                           for m in path), " -> ".join(path)
    if cls_name == "ZeroOneAdam":
        assert {"1-bit gradients", "local step", "sync"} <= set(stages), stages
