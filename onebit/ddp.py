"""A DistributedDataParallel communication hook for the onebit optimizers.

    model = DistributedDataParallel(model)
    opt = onebit.OnebitAdam(model.parameters(), freeze_step=...)
    model.register_comm_hook(opt.ddp_hook_state(), onebit.ddp_comm_hook)

With the hook, DDP averages gradients in full precision exactly when the
optimizer's next step needs it (1-bit Adam/LAMB warmup, 0/1 Adam's variance
steps) -- one bucketed allreduce, and the optimizer then skips its own -- and
sends nothing otherwise, leaving the local gradients to the optimizer's
1-bit exchange. Without the hook, DDP would allreduce every step and the
compression would save nothing.

Parameters the optimizer trains outside the DDP model (a head added with
add_param_group) are not in any bucket: the optimizer averages those itself,
in full precision, in the steps where the hook averages the others.
"""

import torch
import torch.distributed as dist

from . import collectives
from .half_precision import share


class OnebitHookState:
    """What the hook needs: the optimizer (it knows the stage) and its group.

    Trainers that build the DDP wrapper before the optimizer (PyTorch
    Lightning's `DDPStrategy(ddp_comm_hook=..., ddp_comm_state=...)`) can
    create it empty and set `.optimizer` once the optimizer exists (in
    `configure_optimizers`); the first backward needs it."""

    __slots__ = ("optimizer",)

    def __init__(self, optimizer=None) -> None:
        self.optimizer = optimizer

    def __getstate__(self):
        raise TypeError("OnebitHookState refers to a live optimizer; register a new one after "
                        "loading a checkpoint instead of pickling it")


def _optimizer_of(state):
    """The onebit optimizer in `state`, refusing a state of another kind
    (the mistakes are registering the optimizer itself, or a hook state
    around an optimizer that has no stages) with what to register."""
    if not isinstance(state, OnebitHookState):
        raise TypeError("onebit.ddp_comm_hook: the hook state is of type "
                        f"{type(state).__name__}; register it with "
                        "model.register_comm_hook(opt.ddp_hook_state(), onebit.ddp_comm_hook)")
    opt = state.optimizer
    if opt is not None and not hasattr(opt, "needs_full_precision_gradients"):
        raise TypeError("onebit.ddp_comm_hook: the hook state holds an optimizer of type "
                        f"{type(opt).__name__}, not a onebit optimizer (OnebitAdam, OnebitLamb, "
                        "ZeroOneAdam); other optimizers need no hook (DDP's own all-reduce "
                        "serves them)")
    return opt


def ddp_comm_hook(state: OnebitHookState,
                  bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    opt = _optimizer_of(state)
    if opt is None:
        raise RuntimeError("onebit.ddp_comm_hook: the hook state has no optimizer yet; set "
                           "state.optimizer = the onebit optimizer before the first backward")
    buf = bucket.buffer()
    if opt.world_size > 1 and opt.needs_full_precision_gradients():
        opt.mark_gradients_averaged(bucket.parameters())
        dtype = opt.averaging_dtype
        # communication_data_type: the share goes out in half precision, as
        # torch's fp16/bf16 compress hooks. An fp16 mean out of range comes
        # back inf, which the step's agreement then sees on every rank (a
        # GradScaler skips that step; without one step() raises).
        wire = buf.div_(opt.world_size) if dtype == torch.float32 else share(
            buf, opt.world_size, dtype)
        # Bytes only: its time overlaps backward.
        opt.traffic.add_allreduce(buf.numel(), opt.world_size, wire.element_size())
        work = dist.all_reduce(wire, group=opt.process_group, async_op=True)
        collectives.hold_until_later(work)  # no abort at exit (collectives.py)
        if wire is buf:
            return work.get_future().then(lambda fut: fut.value()[0])
        return work.get_future().then(lambda fut: buf.copy_(fut.value()[0]))
    fut = torch.futures.Future()
    fut.set_result(buf)  # compression stage: the optimizer exchanges 1-bit momentum
    return fut
