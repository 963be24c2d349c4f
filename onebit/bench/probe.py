"""`python -m onebit.bench probe`: will 1-bit compression help here?

Run it under the launcher and on the machines you train with (local ranks
by default, torchrun, mpirun). It measures
  the link      fp32 all_reduce at a few small sizes, fitted to
                time = latency + (bytes each rank sends) / bandwidth;
  compression   this machine's compression speed: seconds per element of
                the compressed allreduce's own kernels (its `compress_s`,
                the time outside the transport) on these ranks;
and predicts, for a model of --params parameters, the exchange time of one
step both ways:
  fp32          latency + 2 (p-1)/p * 4 P / bandwidth       (a ring all-reduce)
  1-bit         2 latency + the faster of compressing, then sending, and the
                two overlapped (pipelining: the larger of the two, plus one
                piece of the smaller); the wire bytes are wire format v2's
and the saving, their difference. It prints a plain recommendation and a
freeze_step range. --verify also times both exchanges at --params itself
(the probe's own sizes stay far below it), to show predicted against measured.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Dict, List

import torch
import torch.distributed as dist

from .. import collectives, launch
from ..backends.pipeline import PIECE_SIZE
from .table import count_arg, int_arg

PROBE_SIZES = (1 << 16, 1 << 18, 1 << 20, 1 << 22)  # fp32 elements: 256 KB .. 16 MB
COMPRESS_ELEMENTS = 1 << 22


def _slowest_median(fn, iters: int) -> float:
    """The slowest rank's median time of fn()."""
    fn()  # warm up (connections, buffers)
    times = []
    for _ in range(iters):
        dist.barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    mine = torch.tensor([statistics.median(times)], dtype=torch.float64,
                        device=collectives.communication_device())
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return mine.item()


def fit_link(sizes: List[int], seconds: List[float], world: int):
    """(latency s, bandwidth bytes/s) of time = latency + sent / bandwidth,
    sent = 2 (p-1)/p * 4 n, least squares over the probed sizes."""
    sent = [2 * (world - 1) / world * 4 * n for n in sizes]
    mx, my = statistics.fmean(sent), statistics.fmean(seconds)
    sxx = sum((x - mx) ** 2 for x in sent)
    slope = sum((x - mx) * (y - my) for x, y in zip(sent, seconds)) / sxx
    slope = max(slope, 1e-15)
    return max(0.0, my - slope * mx), 1.0 / slope


def wire_bytes(params: int, world: int, block: int = 256, scale_bytes: int = 4) -> float:
    """Bytes each rank sends in one compressed allreduce of `params` floats."""
    return 2 * (world - 1) / world * params * (1 / 8 + scale_bytes / block)


def predict(params: int, world: int, latency: float, bandwidth: float,
            compress_per_element: float) -> Dict[str, float]:
    fp32 = latency + 2 * (world - 1) / world * 4 * params / bandwidth
    compute = compress_per_element * params
    wire = wire_bytes(params, world) / bandwidth
    pieces = max(1, -(-params // PIECE_SIZE))
    overlapped = max(compute, wire) + min(compute, wire) / pieces
    onebit = 2 * latency + min(compute + wire, overlapped)
    return {"fp32_s": fp32, "onebit_s": onebit, "saving_s": fp32 - onebit,
            "compute_s": compute, "wire_s": wire}


def measure(rank: int, world: int, a: dict) -> Dict:
    # Every tensor made below lives on the group's device (nccl takes no host tensors).
    with collectives.communication_device():
        return _measure(rank, world, a)


def _measure(rank: int, world: int, a: dict) -> Dict:
    from ..backends import CompressedBackend

    link = [_slowest_median(lambda x=torch.randn(n): dist.all_reduce(x), a["iters"])
            for n in PROBE_SIZES]
    latency, bandwidth = fit_link(list(PROBE_SIZES), link, world)
    backend = CompressedBackend(check_finite=False, piece_size=0, agree_every_call=False)
    m = torch.randn(COMPRESS_ELEMENTS)
    werr, serr = (torch.zeros(k) for k in backend.error_sizes(COMPRESS_ELEMENTS))
    per_call = []
    for i in range(a["iters"] + 1):
        before = backend.stats.snapshot()
        backend.compressed_allreduce(m, werr, serr)
        if i:
            per_call.append(backend.stats.since(before)["compress_s"])
    mine = torch.tensor([statistics.median(per_call) / COMPRESS_ELEMENTS], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    out = {"world": world, "latency_s": latency, "bandwidth_Bps": bandwidth,
           "compress_s_per_element": mine.item(), "probe_sizes": list(PROBE_SIZES),
           "probe_s": link, "params": a["params"]}
    out["predicted"] = predict(a["params"], world, latency, bandwidth, mine.item())
    if a["verify"]:
        full = torch.randn(a["params"])
        fp32 = _slowest_median(lambda: dist.all_reduce(full), a["verify_iters"])
        auto = CompressedBackend(check_finite=False,  # piece count tuned as in training
                                 agree_every_call=False)
        werr, serr = (torch.zeros(k) for k in auto.error_sizes(a["params"]))
        for _ in range(8):  # the tuner's trial calls
            auto.compressed_allreduce(full, werr, serr)
        onebit = _slowest_median(lambda: auto.compressed_allreduce(full, werr, serr),
                                 a["verify_iters"])
        out["measured"] = {"fp32_s": fp32, "onebit_s": onebit, "saving_s": fp32 - onebit}
    return out


def report(r: Dict, total_steps: int) -> str:
    p, pred = r["predicted"], r["predicted"]
    lines = [
        f"# onebit.bench probe: ranks={r['world']} params={r['params']}",
        f"link:        latency {r['latency_s'] * 1e3:.2f} ms, bandwidth "
        f"{r['bandwidth_Bps'] * 8 / 1e9:.3f} Gbit/s per rank (fp32 all_reduce at "
        + ", ".join(f"{4 * n >> 10} KB: {t * 1e3:.1f} ms" for n, t in zip(r["probe_sizes"], r["probe_s"]))
        + ")",
        f"compression: {r['compress_s_per_element'] * 1e9:.2f} ns per element on these ranks",
        f"predicted per step: fp32 all_reduce {pred['fp32_s'] * 1e3:.1f} ms, 1-bit "
        f"{pred['onebit_s'] * 1e3:.1f} ms (compute {pred['compute_s'] * 1e3:.1f}, wire "
        f"{pred['wire_s'] * 1e3:.1f}), saving {pred['saving_s'] * 1e3:.1f} ms",
    ]
    if "measured" in r:
        m = r["measured"]
        err = (p["saving_s"] - m["saving_s"]) / abs(m["saving_s"]) * 100 if m["saving_s"] else 0.0
        lines.append(f"measured at {r['params']}: fp32 all_reduce {m['fp32_s'] * 1e3:.1f} ms, 1-bit "
                     f"{m['onebit_s'] * 1e3:.1f} ms, saving {m['saving_s'] * 1e3:.1f} ms "
                     f"(prediction off by {err:+.0f}%)")
    saving, fp32 = p["saving_s"], p["fp32_s"]
    if saving > 0.1 * fp32:
        advice = (f"compress: 1-bit saves about {saving * 1e3:.0f} ms of the "
                  f"{fp32 * 1e3:.0f} ms fp32 exchange per step ({fp32 / p['onebit_s']:.1f}x less "
                  "time in communication)")
    else:
        advice = ("do not compress: on this link the fp32 exchange is cheap enough that 1-bit "
                  f"saves {max(saving, 0) * 1e3:.0f} ms of {fp32 * 1e3:.0f} ms per step; keep "
                  "torch.optim.Adam (+ DDP, which also overlaps it with backward)")
    lines.append(f"recommendation: {advice}")
    lo, hi = (int(0.15 * total_steps), int(0.25 * total_steps)) if total_steps else (None, None)
    lines.append("freeze_step: 15-25% of the training steps"
                 + (f" ({lo}..{hi} of {total_steps})" if total_steps else "")
                 + "; later if the loss jumps at the freeze or the error norm in "
                 "comm_stats() keeps growing")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> bool:
    a = {k: v for k, v in vars(args).items() if k != "json"}
    rank, r = launch.run_everywhere(measure, args.nproc, a)
    if rank != 0:
        return True
    print(report(r, args.total_steps), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "probe", "config": a, "result": r}, f, indent=1)
    return True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", type=count_arg, default=1 << 24,
                   help="parameters of the model to predict for (default 16M; K/M suffixes)")
    p.add_argument("--total-steps", dest="total_steps", type=int_arg(0), default=0,
                   help="training steps, for the freeze_step range")
    p.add_argument("--iters", type=int_arg(1), default=5, help="timed calls per probe size")
    p.add_argument("--verify", action="store_true",
                   help="also time both exchanges at --params (slow on a slow link)")
    p.add_argument("--verify-iters", dest="verify_iters", type=int_arg(1), default=3)
    p.add_argument("--nproc", type=int_arg(1), default=4, help="local ranks when not launched")
    p.add_argument("--json", help="write the measurements and predictions to this JSON file")
