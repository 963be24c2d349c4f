"""Where a GPU step's time goes: each optimizer's step profiled on the device.

For every optimizer of `python -m onebit.bench optim` (world size 1, its
compression stage) and torch's fused Adam beside it, prints the step's time
between CUDA events, the device's busy time in kernels and copies, the
launches per step, and the kernels that take most of it. `bench optim`
says how slow a step is; this says why.

  python -m benchmarks.step_profile --params 104857600 --tensors 50
"""
from __future__ import annotations

import argparse
from typing import Callable, List, Tuple

import torch

from onebit.bench.optim import UNTIMED_STEPS, _params
from onebit.bench.table import int_arg


def optimizers() -> List[Tuple[str, Callable]]:
    import onebit

    local = dict(var_freeze_step=1, local_step_scaler=1, local_step_clipper=16)
    return [
        ("torch Adam(fused)", lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True)),
        ("OnebitAdam compression", lambda ps: onebit.OnebitAdam(ps, freeze_step=1)),
        ("OnebitLamb compression", lambda ps: onebit.OnebitLamb(ps, freeze_step=1)),
        ("ZeroOneAdam syncs", lambda ps: onebit.ZeroOneAdam(ps, var_freeze_step=1)),
        ("ZeroOneAdam local steps", lambda ps: onebit.ZeroOneAdam(ps, **local)),
    ]


def _device_us(event) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def profile_step(make: Callable, total: int, tensors: int, steps: int, top: int) -> dict:
    opt = make(_params(total, tensors, "cuda"))
    for _ in range(UNTIMED_STEPS):
        opt.step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, acc_events=True) as prof:
        start.record()
        for _ in range(steps):
            opt.step()
        end.record()
        torch.cuda.synchronize()
    # The device's own events (kernels, copies): the CPU ops above them
    # report their kernels' time too, which would count it twice.
    on_device = torch.autograd.DeviceType.CUDA
    kernels = [(_device_us(e) / steps / 1e3, e.count / steps, e.key)
               for e in prof.key_averages()
               if getattr(e, "device_type", None) == on_device and _device_us(e) > 0]
    kernels.sort(reverse=True)
    return {"step_ms": start.elapsed_time(end) / steps,
            "busy_ms": sum(k[0] for k in kernels),
            "launches": sum(k[1] for k in kernels), "top": kernels[:top]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int_arg(1), default=104_857_600)
    p.add_argument("--tensors", type=int_arg(1), default=50)
    p.add_argument("--steps", type=int_arg(1), default=5)
    p.add_argument("--top", type=int_arg(1), default=6)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    print(f"# step profile: {args.params} params in {args.tensors} tensors on "
          f"{torch.cuda.get_device_name()}, {args.steps} steps, world size 1")
    base = None
    for name, make in optimizers():
        r = profile_step(make, args.params, args.tensors, args.steps, args.top)
        base = base or r["step_ms"]
        print(f"{name:26s} step {r['step_ms']:8.3f} ms ({r['step_ms'] / base:5.2f}x fused Adam), "
              f"device busy {r['busy_ms']:8.3f} ms, {r['launches']:7.1f} launches/step")
        for ms, count, key in r["top"]:
            print(f"    {ms:8.3f} ms {count:6.1f}x  {key[:90]}")


if __name__ == "__main__":
    main()
