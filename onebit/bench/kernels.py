"""`python -m onebit.bench kernels`: sign-bit kernel throughput.

`--device cpu` (the default) prints the host table below, then the shares
table; `--device cuda` (or any accelerator) the shares table alone:
each kernel's time and its share of the device's copy bandwidth, measured in
the same run (y.copy_(x), 8 bytes per element), for the bytes the kernel
must move at the least. Device times are event timings (no host clock
around queued work).

Host table, with baselines measured in the same run:
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
from .. import ops
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


def device_timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    """timeit for `device`: the host clock on the CPU, elsewhere the median of
    per-call device events (after one warm-up call)."""
    if device.type == "cpu":
        return timeit
    api = getattr(torch, device.type)

    def timed(fn: Callable[[], object], repeat: int) -> float:
        fn()
        events = [(api.Event(enable_timing=True), api.Event(enable_timing=True))
                  for _ in range(repeat)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        api.synchronize(device)
        return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3
    return timed


# Bytes per element each kernel must move at the least (fp32 input, the
# default block of 256 with fp32 scales): what its share of the copy
# bandwidth is computed from.
BLOCK = 256


def least_bytes(kernel: str, rows: int = 1) -> float:
    scale = 4 / BLOCK
    return {
        "copy": 8.0,
        "pack": 4 + 1 / 8,
        "compensate": 12 + 8 / BLOCK,            # read buf, err; write err; the sums
        "pack_error": 8 + 1 / 8 + scale,          # read and write err; the bits
        "compress": 12 + 1 / 8 + 2 * scale,       # both in one pass, the counts read
        "decode": rows * (1 / 8 + scale) + 4,     # every row's bits and scales; one output
    }[kernel]


def measure_shares(n: int, device: torch.device, repeat: int) -> Dict[str, Dict[str, float]]:
    """{kernel: {"ms", "share"}} for n fp32 elements on `device`, every
    kernel's share of the copy bandwidth measured in this call."""
    kernels, timed = kernels_for(device), device_timer(device)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g).to(device)
    y = torch.empty_like(x)
    err = (torch.randn(n, generator=g) * 0.1).to(device)
    bits = torch.empty(n // 8, dtype=torch.uint8, device=device)
    counts = torch.full((n // BLOCK,), float(BLOCK), dtype=torch.float64, device=device)
    sumsq = torch.empty(n // BLOCK, dtype=torch.float64, device=device)
    scales = torch.rand(n // BLOCK, generator=g).to(device) + 0.5
    scale_bytes = torch.empty(4 * (n // BLOCK), dtype=torch.uint8, device=device)
    out = torch.empty(n, device=device)

    def fused():  # what ops.compress runs: the kernel's one pass, or the composed three
        if hasattr(kernels, "compress"):
            kernels.compress(x, err, counts, BLOCK, scale_bytes, bits)
        else:
            composed_compress(kernels, x, err, counts, BLOCK, torch.float32, scale_bytes, bits)

    seconds = {
        "copy": timed(lambda: y.copy_(x), repeat),
        "pack": timed(lambda: kernels.pack(x, bits), repeat),
        # Error feedback keeps err bounded, so repeated calls stay representative.
        "compensate": timed(lambda: kernels.compensate(x, err, sumsq, BLOCK), repeat),
        "pack_error": timed(lambda: kernels.pack_error(err, scales, BLOCK, bits), repeat),
        "compress": timed(fused, repeat),
    }
    copy_rate = least_bytes("copy") * n / seconds["copy"]
    result = {k: {"ms": t * 1e3, "share": least_bytes(k) * n / t / copy_rate}
              for k, t in seconds.items()}
    # The same n elements as four ranks' rows, in one call each (ops.compress_rows and
    # ops.decode_rows, what the worker and the final decode of p = 4 ranks run).
    rows4 = max(BLOCK, n // 4 // BLOCK * BLOCK)
    messages = torch.empty(4, rows4 // 8 + rows4 // BLOCK * 4, dtype=torch.uint8, device=device)
    scales4 = (torch.rand(4, rows4 // BLOCK, generator=g) + 0.5).to(device)
    row_err = err[:4 * rows4].view(4, rows4) if 4 * rows4 <= n else torch.zeros(4, rows4,
                                                                                 device=device)
    counts4 = torch.full((4, rows4 // BLOCK), float(BLOCK), dtype=torch.float64, device=device)
    # The kernel's own call where it has one (as the other rows time the kernels, not
    # ops' checks), else what ops runs in its place: a call per row.
    if hasattr(kernels, "compress_rows") and hasattr(kernels, "decode_rows"):
        cb = rows4 // 8
        compress4 = lambda: kernels.compress_rows(  # noqa: E731
            x, row_err, counts4, BLOCK, messages[:, cb:], messages[:, :cb])
        decode4 = lambda: kernels.decode_rows(messages, scales4, BLOCK, rows4, out, rows4)  # noqa: E731
    else:
        compress4 = lambda: ops.compress_rows(  # noqa: E731
            x, row_err, counts4, BLOCK, torch.float32, messages, rows4 // 8)
        decode4 = lambda: ops.decode_rows(messages, scales4, rows4, out, rows4, BLOCK)  # noqa: E731
    for name, fn in (("compress rows x4", compress4), ("decode rows x4", decode4)):
        t = timed(fn, repeat)
        kind = "compress" if name.startswith("compress") else "decode"
        result[name] = {"ms": t * 1e3, "share": least_bytes(kind) * 4 * rows4 / t / copy_rate}
    for rows in (1, 2, 8, 32):
        cols = max(8, n // rows)  # n bits in all: rows chunks of a message, decoded at once
        row_bits = torch.randint(0, 256, (rows, cols // 8), generator=g, dtype=torch.uint8).to(device)
        row_scales = (torch.rand(rows * -(-cols // BLOCK), generator=g) + 0.5).to(device)
        t = timed(lambda: kernels.decode(row_bits, row_scales, BLOCK, cols, out[:cols]), repeat)
        result[f"decode x{rows}"] = {
            "ms": t * 1e3, "share": least_bytes("decode", rows) * cols / t / copy_rate}
    return result


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
    device = torch.device(args.device)
    results = run_host(args) if device.type == "cpu" else []
    shares = run_shares(args, device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "kernels", "device": str(device), "results": results,
                       "shares": shares}, f, indent=1)
    return results


def run_shares(args: argparse.Namespace, device: torch.device) -> List[Dict]:
    kernels = kernels_for(device)
    print(f"# {device} ({kernels.name}): each kernel's ms and its share of the copy bandwidth "
          f"measured in the same run, for the least bytes it must move (fp32, block {BLOCK}); "
          "decode xR: R rows of n/R columns, averaged; rows x4: four ranks' rows of n/4 "
          "in one call (the worker's compress, the final decode)")
    names = ["copy", "pack", "compensate", "pack_error", "compress", "compress rows x4",
             "decode rows x4", "decode x1", "decode x2", "decode x8", "decode x32"]
    table = Table([("count", 10, "d")] + [(f"{k}", 11, "s") for k in names])
    table.header()
    out = []
    for e in range(args.min_exp, args.max_exp + 1):
        r = measure_shares(1 << e, device, args.iters)
        out.append({"n": 1 << e, **r})
        table.row(count=1 << e, **{k: f"{r[k]['ms']:.3f}/{100 * r[k]['share']:.0f}%" for k in names})
    return out


def run_host(args: argparse.Namespace) -> List[Dict]:
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
    return results


def check_arguments(args: argparse.Namespace) -> None:
    if args.min_exp > args.max_exp:
        raise ValueError(f"--min-exp ({args.min_exp}) is larger than --max-exp ({args.max_exp})")


def add_arguments(p: argparse.ArgumentParser) -> None:
    # From 2^8: a size below one block (BLOCK, 256 elements) has no block to compress.
    p.add_argument("--min-exp", type=int_arg(8), default=20, help="smallest size, 2^k elements")
    p.add_argument("--max-exp", type=int_arg(8), default=26, help="largest size, 2^k elements")
    p.add_argument("-n", "--iters", type=int_arg(1), default=10, help="timed repeats (median)")
    p.add_argument("--device", default="cpu",
                   help="cpu (the host table, then the shares table) or an accelerator's "
                        "device (cuda, cuda:1, xpu): the shares table")
    p.add_argument("--json", help="also write results to this JSON file")
