"""The DDP comm hooks a PyTorch user picks instead of onebit for fewer bytes,
as the benchmarks' baselines, and what each sends.

- "fp16": torch's `fp16_compress_hook`;
- "bf16": the same steps in bf16 (`bf16_allreduce_hook`: torch's
  `bf16_compress_hook` is refused by name without NCCL or XCCL, and gloo
  takes bf16 tensors);
- "powersgd": torch's `powerSGD_hook` at a rank, error feedback and warm
  start on, plain all-reduce before `start_iter`, one bucket at a time.

Bytes are each rank's share of a ring all-reduce of what the hook
all-reduces (`sent_bytes`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..backends.stats import fp32_allreduce_bytes

KINDS = ("fp16", "bf16", "powersgd")


def bf16_allreduce_hook(process_group, bucket):
    """torch's bf16_compress_hook under another name: the bucket cast to
    bf16, each rank's share divided first, all-reduced in bf16, cast back."""
    group = process_group if process_group is not None else dist.group.WORLD
    half = bucket.buffer().to(torch.bfloat16).div_(group.size())
    future = dist.all_reduce(half, group=group, async_op=True).get_future()

    def back_to_fp32(done):
        out = bucket.buffer()
        out.copy_(done.value()[0])
        return out
    return future.then(back_to_fp32)


def _one_bucket_at_a_time(hook):
    """`hook`, finished before DDP hands it the next bucket. PowerSGD chains
    three all-reduces per bucket through future callbacks, which gloo runs
    on its own threads: with two buckets in flight the ranks issued them in
    different orders (a gloo size mismatch in bench step). Serial, every
    rank issues them in one order; the maths is the same."""
    def serial(state, bucket):
        done = torch.futures.Future()
        done.set_result(hook(state, bucket).wait())
        return done
    return serial


def hooked(model: torch.nn.Module, kind: str, rank: int = 4,
           start_iter: int = 2) -> torch.nn.parallel.DistributedDataParallel:
    """`model` under DDP with the comm hook `kind` (KINDS)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if kind not in KINDS:
        raise ValueError(f"hook must be one of {list(KINDS)}, got {kind!r}")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if kind == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank,
            start_powerSGD_iter=max(2, start_iter), use_error_feedback=True, warm_start=True)
        ddp.register_comm_hook(state, _one_bucket_at_a_time(powerSGD_hook.powerSGD_hook))
    else:
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook if kind == "fp16"
                               else bf16_allreduce_hook)
    return ddp


def powersgd_numel(params, rank: int) -> int:
    """The elements PowerSGD all-reduces per step once it compresses: each
    gradient viewed as an n x m matrix goes as its factors P (n x r) and Q
    (m x r), r = min(n, m, rank), where torch's rule compresses it
    ((n + m) r * 2 < n m, min_compression_rate 2), else whole."""
    total = 0
    for p in params:
        n = p.shape[0] if p.dim() else 1
        m = p.numel() // max(n, 1)
        r = min(n, m, rank)
        total += (n + m) * r if (n + m) * r * 2 < n * m else n * m
    return total


def step_bytes(params, kind: str, world: int, rank: int = 4) -> float:
    """What a rank sends in one step under the hook `kind` (PowerSGD: once
    it compresses)."""
    params = list(params)
    if kind == "powersgd":
        return fp32_allreduce_bytes(powersgd_numel(params, rank), world)
    return fp32_allreduce_bytes(sum(p.numel() for p in params), world) / 2


def sent_bytes(params, kind: str, world: int, steps: int, rank: int = 4,
               start_iter: int = 2) -> float:
    """What a rank has sent after `steps` steps under the hook `kind`
    (PowerSGD in fp32 before `start_iter`)."""
    params = list(params)
    if kind != "powersgd":
        return step_bytes(params, kind, world) * steps
    start = min(steps, max(2, start_iter))
    return (fp32_allreduce_bytes(sum(p.numel() for p in params), world) * start
            + step_bytes(params, kind, world, rank) * (steps - start))
