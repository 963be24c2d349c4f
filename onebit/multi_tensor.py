"""An optimizer step's passes over lists of tensors, in one launch each
where the device's kernels have them (CUDA's: a table of pointers per
call, no host sync), else None or torch's ops.

- tensor_norms: each tensor's 2-norm (LAMB's trust ratios, clipping), the
  squares summed in float64 in a fixed order. torch's `_foreach_norm`
  allocates an output per tensor and needs a stack after it: about 3 ms of
  host time for 2000 tensors on an H200.
- lamb_ratio_norms and 0/1 Adam's zero_one_*: one optimizer's passes
  fused, so that the step reads and writes each tensor fewer times. Each
  op rounds as torch's foreach op does (to within its multiply-adds: the
  GPU tests hold them to a few ulps of torch's).

`list_kernel` says which kernel a list takes (the optimizer's non-finite
check asks it too, agreement.py). The kernels take contiguous
fp32 tensors off the CPU. Elsewhere (the CPU,
other layouts and dtypes) torch's ops stay, and with them every bit the CPU
has computed so far.
"""
from __future__ import annotations

import operator
from typing import List, Optional

import torch

from . import ops

_DTYPE = operator.attrgetter("dtype")


def list_kernel(name: str, *lists: List[torch.Tensor]):
    """The device kernels' `name` where they have it and every tensor of
    `lists` is contiguous fp32 on one device off the CPU; else None (a
    kernel launched on one device with another's pointers would fault, or
    read across devices; torch's ops take such lists)."""
    device = lists[0][0].device
    kernel = None if device.type == "cpu" else getattr(ops.kernels_for(device), name, None)
    if kernel is None:
        return None
    # The device by its index: `.device` builds a torch.device per read, at
    # twice the cost of get_device, and a step over 2000 tensors a list pays
    # for every read (list_kernel took 1.2 ms a call on an H200's host). A
    # CPU tensor's index is -1, a GPU's its number; a list mixing two kinds
    # of accelerator with the same number is not one anyone builds.
    index = lists[0][0].get_device()
    for tensors in lists:
        if (set(map(_DTYPE, tensors)) != {torch.float32}
                or set(map(torch.Tensor.get_device, tensors)) != {index}
                or not all(map(torch.Tensor.is_contiguous, tensors))):
            return None
    return kernel


def tensor_norms(tensors: List[torch.Tensor]) -> torch.Tensor:
    """A 1-D fp32 tensor (one float per input, the inputs' dtype where
    `_foreach_norm` takes them) of each tensor's 2-norm, 0 for empty ones.
    `tensors`: a non-empty list on one device."""
    kernel = list_kernel("tensor_norms", tensors)
    if kernel is None:
        sizes = list(map(torch.Tensor.numel, tensors))
        if 0 not in sizes:
            return torch.stack(torch._foreach_norm(tensors))
        # Empty tensors stay out of _foreach_norm: torch 2.2-2.5's CUDA one
        # gave wrong norms for lists holding them (pytorch#140066).
        held = [i for i, n in enumerate(sizes) if n]
        if not held:
            return torch.zeros(len(tensors), dtype=tensors[0].dtype, device=tensors[0].device)
        norms = torch.stack(torch._foreach_norm([tensors[i] for i in held]))
        out = norms.new_zeros(len(tensors))
        out[held] = norms
        return out
    out = torch.empty(len(tensors), dtype=torch.float32, device=tensors[0].device)
    kernel(tensors, list(map(torch.Tensor.numel, tensors)), out)
    return out


def lamb_ratio_norms(params: List[torch.Tensor], exp_avgs: List[torch.Tensor],
                     smoothed: List[torch.Tensor], denoms: List[torch.Tensor], weight: float,
                     weight_decay: float) -> Optional[torch.Tensor]:
    """1-bit LAMB's ratio pass in one read where the device's kernels have
    it (CUDA's): smoothed <- lerp(smoothed, exp_avgs, weight), and returns
    [||p|| for each param, then ||smoothed / denom + weight_decay x p||]
    (2 x len(params) fp32 on their device). None elsewhere: the caller
    takes torch's ops (the same maths, five passes over memory instead of
    eight)."""
    kernel = list_kernel("lamb_ratio_norms", params, exp_avgs, smoothed, denoms)
    if kernel is None:
        return None
    out = torch.empty(2 * len(params), dtype=torch.float32, device=params[0].device)
    kernel(params, exp_avgs, smoothed, denoms, list(map(torch.Tensor.numel, params)), weight,
           weight_decay, out)
    return out


def _fused(name: str, lists, *scalars: float) -> bool:
    """Launch the fused pass `name` over `lists` (alike in sizes) with its
    scalars where the device's kernels have it; False (nothing done)
    elsewhere, and for empty lists."""
    kernel = list_kernel(name, *lists) if lists[0] else None
    if kernel is None:
        return False
    kernel(lists, list(map(torch.Tensor.numel, lists[0])), *scalars)
    return True


def zero_one_local_step(params: List[torch.Tensor], grads: List[torch.Tensor],
                        exp_avgs: List[torch.Tensor], denoms: List[torch.Tensor],
                        accumulators: List[torch.Tensor], anchors: List[torch.Tensor], *,
                        beta1: float, lr: float, weight_decay: float, bc1: float) -> bool:
    """0/1 Adam's local step in one pass where the device's kernels have it:
    m <- beta1 m + (1 - beta1) g; u <- u - lr (m / bc1 / denom + wd p);
    p <- anchor + u. Returns False (nothing done) elsewhere: the caller
    takes torch's ops, the same maths in ten passes over memory (eight
    here)."""
    return _fused("zero_one_local_step", (params, grads, exp_avgs, denoms, accumulators, anchors),
                  1.0 - beta1, -lr * weight_decay, -lr / bc1)


def zero_one_step(params: List[torch.Tensor], grads: List[torch.Tensor],
                  exp_avgs: List[torch.Tensor], denoms: List[torch.Tensor], *, beta1: float,
                  lr: float, weight_decay: float, bc1: float) -> bool:
    """0/1 Adam's step before the variance freezes, in one pass where the
    device's kernels have it: m <- beta1 m + (1 - beta1) g; p <- p - lr (m /
    denom / bc1 + wd p), rounded as torch's ops round functional.adam_updates
    and add_updates_. Returns False (nothing done) elsewhere."""
    return _fused("zero_one_step", (params, grads, exp_avgs, denoms), 1.0 - beta1, bc1,
                  weight_decay, -lr)


def zero_one_sync_input(out: List[torch.Tensor], params: List[torch.Tensor],
                        exp_avgs: List[torch.Tensor], grads: List[torch.Tensor],
                        denoms: List[torch.Tensor], *, beta1: float, bc1: float,
                        weight_decay: float) -> bool:
    """0/1 Adam's input to a sync that follows a sync, in one pass where the
    device's kernels have it: out <- -(lerp(m, g, 1 - beta1) / bc1 + wd p
    denom) (`out` may be `exp_avgs` itself). Returns False elsewhere."""
    return _fused("zero_one_sync_input", (out, params, exp_avgs, grads, denoms), 1.0 - beta1,
                  -1.0 / bc1, -weight_decay)


def zero_one_land(params: List[torch.Tensor], averages: List[torch.Tensor],
                  denoms: List[torch.Tensor], *, lr: float, bc1: float) -> bool:
    """0/1 Adam's landing after a sync that follows a sync, in one pass where
    the device's kernels have it: p <- p + lr x avg / denom, then the
    momentum re-derived in place, avg <- -bc1 x avg. Returns False
    elsewhere."""
    return _fused("zero_one_land", (params, averages, denoms), lr, -bc1)
