"""`python -m onebit.bench kernels`: sign-bit kernel throughput on this host.

Baselines measured in the same run:
  numpy   numpy.packbits(x >= 0, bitorder="little")  (already SIMD)
  clone   torch.clone(x): 8 bytes moved per element, plus fresh pages
  copy    y.copy_(x) into a preallocated y: the same bytes without page
          faults, which is the honest memory-bandwidth yardstick
  torch   the same maths as torch ops (onebit's pure-torch fallback)
GB/s are of fp32 input (4 bytes per element) unless the column says bytes.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable, Dict, List

import numpy as np
import torch

from .table import int_arg

from ..builders import TorchKernels
from ..ops import composed_compress, kernels_for
from .table import Table


def timeit(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds of `repeat` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(n: int, repeat: int) -> Dict[str, float]:
    native, ref = kernels_for(torch.device("cpu")), TorchKernels()
    x = torch.randn(n)
    y = torch.empty_like(x)
    xn = x.numpy()
    bits = torch.empty(n // 8, dtype=torch.uint8)
    out = torch.empty(n)
    one = torch.ones(1)
    err0 = torch.randn(n) * 0.1
    err = err0.clone()
    block = 256  # the default block size (one scale per block)
    counts = torch.full((n // block,), float(block), dtype=torch.float64)
    scales = torch.empty(4 * (n // block), dtype=torch.uint8)

    def fused(k):  # the error-feedback step (ops.compress): one pass where k fuses it
        if hasattr(k, "compress"):
            k.compress(x, err, counts, block, scales, bits)
        else:
            composed_compress(k, x, err, counts, block, torch.float32, scales, bits)

    t = {
        "numpy": timeit(lambda: np.packbits(xn >= 0, bitorder="little"), repeat),
        "clone": timeit(lambda: x.clone(), repeat),
        "copy": timeit(lambda: y.copy_(x), repeat),
        "pack": timeit(lambda: native.pack(x, bits), repeat),
        "unpack": timeit(lambda: native.decode(bits.view(1, -1), one, n, n, out), repeat),
        # Error feedback keeps err bounded, so repeated calls stay representative.
        "fused": timeit(lambda: fused(native), repeat),
        "fused_torch": timeit(lambda: fused(ref), max(3, repeat // 3)),
    }
    gbs = lambda sec: 4 * n / sec / 1e9  # noqa: E731
    return {
        "n": n, "kernel": native.name,
        "numpy_GBs": gbs(t["numpy"]), "pack_GBs": gbs(t["pack"]),
        "unpack_GBs": gbs(t["unpack"]), "clone_GBs": gbs(t["clone"]), "copy_GBs": gbs(t["copy"]),
        "pack_vs_numpy": t["numpy"] / t["pack"],
        # bytes moved per second: pack 4 + 1/8 per element, clone and copy 8
        "pack_bytes_vs_clone": (4.125 * n / t["pack"]) / (8 * n / t["clone"]),
        "pack_bytes_vs_copy": (4.125 * n / t["pack"]) / (8 * n / t["copy"]),
        "fused_ms": t["fused"] * 1e3, "fused_torch_ms": t["fused_torch"] * 1e3,
        "fused_speedup": t["fused_torch"] / t["fused"],
    }


COLUMNS = [("count", 10, "d"), ("kernel", 12, "s"), ("numpy", 7, ".2f"), ("pack", 7, ".2f"),
           ("unpack", 7, ".2f"), ("clone", 7, ".2f"), ("copy", 7, ".2f"), ("xnumpy", 7, ".2f"),
           ("bytes/clone", 11, ".2f"), ("bytes/copy", 10, ".2f"), ("fused(ms)", 9, ".2f"), ("torch(ms)", 9, ".2f"),
           ("xtorch", 7, ".2f")]


def run(args: argparse.Namespace) -> List[Dict]:
    print(f"# onebit kernel benchmark: threads={torch.get_num_threads()} repeat={args.iters}")
    print("# numpy/pack/unpack/clone/copy in GB/s of fp32 input; xnumpy = pack speed / numpy;")
    print("# bytes/clone, bytes/copy = pack's byte rate (4.125 B/elem) / theirs (8 B/elem);")
    print("# fused = compensate+scales+pack+error kernel (one pass), torch = same maths as torch ops")
    table = Table(COLUMNS)
    table.header()
    results = []
    for e in range(args.min_exp, args.max_exp + 1):
        r = measure(1 << e, args.iters)
        results.append(r)
        table.row(count=r["n"], kernel=r["kernel"], numpy=r["numpy_GBs"], pack=r["pack_GBs"],
                  unpack=r["unpack_GBs"], clone=r["clone_GBs"], copy=r["copy_GBs"],
                  xnumpy=r["pack_vs_numpy"],
                  **{"bytes/clone": r["pack_bytes_vs_clone"], "bytes/copy": r["pack_bytes_vs_copy"],
                     "fused(ms)": r["fused_ms"],
                     "torch(ms)": r["fused_torch_ms"]}, xtorch=r["fused_speedup"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "kernels", "results": results}, f, indent=1)
    return results


def check_arguments(args: argparse.Namespace) -> None:
    if args.min_exp > args.max_exp:
        raise ValueError(f"--min-exp ({args.min_exp}) is larger than --max-exp ({args.max_exp})")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--min-exp", type=int_arg(3), default=20, help="smallest size, 2^k elements")
    p.add_argument("--max-exp", type=int_arg(3), default=26, help="largest size, 2^k elements")
    p.add_argument("-n", "--iters", type=int_arg(1), default=10, help="timed repeats (median)")
    p.add_argument("--json", help="also write results to this JSON file")
