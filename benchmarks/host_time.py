"""Where a GPU step's host time goes: the ops a 1-bit step calls, one by one.

For 100M params in 50 tensors and 20M in 2000 (as `bench optim`), prints
each op's median wall time (launch to completion) and host time (until the
call returns), then each optimizer's step beside torch's fused Adam, then
the step's Python profile (cProfile: the top functions by own time, then
onebit's by cumulative time). At 2000
tensors a step is host-bound: this says which calls pay per tensor.

  python -m benchmarks.host_time            # a CUDA device
  python -m benchmarks.host_time --device cpu --scale 0.001
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from onebit.accelerator import get_accelerator
from onebit.bench.optim import _params
from onebit.agreement import nonfinite_flag
from onebit.multi_tensor import tensor_norms

REPEATS = 30
PROFILED_STEPS = 10


def median_ms(fn, wait_each: bool) -> float:
    """Median over REPEATS calls; with `wait_each`, until the device is done
    (wall), else until the call returns (host), the device drained after."""
    sync = get_accelerator().synchronize
    for _ in range(5):
        fn()
    sync()
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        if wait_each:
            sync()
        times.append(time.perf_counter() - t0)
        sync()
    return sorted(times)[REPEATS // 2] * 1e3


def ops(params: list, device: torch.device) -> dict:
    grads = [p.grad for p in params]
    plain = [p.detach() for p in params]
    m = [torch.zeros_like(p) for p in params]
    d = [torch.ones_like(p) for p in params]
    other = [grads, [g.clone() for g in grads]]  # new pointers at every call

    def swap():
        other.append(other.pop(0))
        return other[0]

    return {
        "torch._foreach_norm": lambda: torch._foreach_norm(grads),
        "non-finite, the norms' way": lambda: bool(
            torch.isfinite(torch.stack(torch._foreach_norm(grads))).all()),
        "nonfinite_flag, read": lambda: int(nonfinite_flag([grads], device)),
        "nonfinite_flag, new pointers": lambda: int(nonfinite_flag([swap()], device)),
        "norms, stack and read (_foreach_norm)": lambda: torch.stack(
            torch._foreach_norm(grads)).tolist(),
        "norms and read (tensor_norms)": lambda: tensor_norms(grads).tolist(),
        "torch._foreach_lerp_": lambda: torch._foreach_lerp_(m, grads, 0.1),
        "torch._foreach_addcdiv_": lambda: torch._foreach_addcdiv_(plain, m, d, value=-1e-9),
        "[p.grad for p in params]": lambda: [p.grad for p in params],
    }


def optimizers(params: list) -> dict:
    import onebit

    return {
        "torch Adam(fused)": lambda: torch.optim.Adam(params, lr=1e-3, fused=True),
        "OnebitAdam compression": lambda: onebit.OnebitAdam(params, freeze_step=1),
        "ZeroOneAdam syncs": lambda: onebit.ZeroOneAdam(params, var_freeze_step=1),
        "ZeroOneAdam local steps": lambda: onebit.ZeroOneAdam(
            params, var_freeze_step=1, local_step_scaler=1, local_step_clipper=16),
        "OnebitLamb compression": lambda: onebit.OnebitLamb(params, freeze_step=1),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--scale", type=float, default=1.0, help="times the params of each case")
    parser.add_argument("--top", type=int, default=12, help="profile rows per optimizer")
    a = parser.parse_args(argv)
    device = torch.device(a.device)
    for total, tensors in ((104857600, 50), (20971520, 2000)):
        total = max(tensors, int(total * a.scale))
        params = _params(total, tensors, device.type)
        print(f"## {total} params in {tensors} tensors on {device}, median of {REPEATS}")
        for name, fn in ops(params, device).items():
            print(f"{name:32s} wall {median_ms(fn, True):8.3f} ms   host "
                  f"{median_ms(fn, False):8.3f} ms")
        for name, make in optimizers(params).items():
            opt = make()
            print(f"{name:32s} wall {median_ms(opt.step, True):8.3f} ms   host "
                  f"{median_ms(opt.step, False):8.3f} ms")
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(PROFILED_STEPS):
                opt.step()
            get_accelerator().synchronize()
            prof.disable()
            stats = pstats.Stats(prof)
            calls = sum(row[1] for row in stats.stats.values()) / PROFILED_STEPS / tensors
            # (cProfile counts the calls Python makes; those map() makes
            # from C, as the kernels' checks and tables do per tensor, are
            # not in the count)
            print(f"  {calls:.1f} Python calls per tensor per step")
            if name.startswith("torch"):
                continue
            # By own time (which calls pay), then onebit's functions by
            # cumulative time (which of its steps holds them).
            for order, only in (("tottime", ()), ("cumulative", ("onebit/",))):
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats(order).print_stats(*only, a.top)
                print(f"  by {order}" + (" (onebit's own functions)" if only else ""))
                print("\n".join(line for line in out.getvalue().splitlines()
                                if line.strip() and "Ordered by" not in line
                                and "List reduced" not in line
                                and "function calls" not in line))
        del params
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
