"""`python -m onebit.bench`: compressed allreduce throughput, nccl-tests style.

Run with no launcher it starts --nproc local ranks (4 CPU processes on gloo
by default); under torchrun or mpirun it joins their ranks instead.

For each size it times the compressed backend(s) and two baselines,
dist.all_reduce in fp32 and fp16, on the same ranks:
  size     logical fp32 payload in bytes (4 * count)
  time     per iteration, the slowest rank's (max-reduced), in microseconds
  algbw    size / time, GB/s;  busbw = algbw * 2(p-1)/p, as nccl-tests
  wire     bytes each rank sends per iteration over the network (hierarchical:
           its 1-bit stage between nodes; the full-precision stages stay inside
           the node)
  node_tx  bytes per iteration counted on this host's network interface
           ($GLOO_SOCKET_IFNAME, as shaped_net.sh sets it; "-" elsewhere): what
           left rank 0's node, by the kernel's count
  speedup  fp32 all_reduce time / this row's time
  #wrong   elements off an fp64 reference (compressed: a float64 simulation
           of the algorithm; all_reduce: the float64 sum), checked once per size
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Dict, List

import torch
import torch.distributed as dist

from .. import collectives, launch
from ..accelerator import get_accelerator
from ..wire import DEFAULT_BLOCK_SIZE, check_block_size
from ..backends.pipeline import TUNING_CALLS, piece_ranges
from .reference import count_wrong, simulate, simulate_hierarchical
from .table import Table, int_arg, piece_arg, progress, size_arg

COLUMNS = [("size(B)", 12, "d"), ("count", 10, "d"), ("type", 6, "s"), ("backend", 15, "s"),
           ("time(us)", 11, ".1f"), ("algbw", 7, ".2f"), ("busbw", 7, ".2f"),
           ("wire(B)", 11, "d"), ("node_tx(B)", 11, "s"), ("speedup", 7, ".2f"),
           ("#wrong", 6, "d")]


MAX_SIZES = 1000


def _sizes(args) -> List[int]:
    sizes, b = [], args.minbytes
    while b <= args.maxbytes:
        sizes.append(b)
        b = int(b * args.stepfactor) if args.stepfactor > 1 else b + args.stepbytes
        if b <= sizes[-1] or len(sizes) > MAX_SIZES:  # -f too close to 1 (or -i too small)
            raise ValueError(f"-f {args.stepfactor:g} -i {args.stepbytes} from -b {args.minbytes} "
                             f"to -e {args.maxbytes} would run more than {MAX_SIZES} sizes; "
                             "use a larger factor or increment")
    return sizes


def check_arguments(args: argparse.Namespace) -> None:
    """Combinations argparse cannot check alone (ValueError: the CLI's error)."""
    if args.minbytes > args.maxbytes:
        raise ValueError(f"-b ({args.minbytes} bytes) is larger than -e ({args.maxbytes} bytes): "
                         "no sizes to run")
    if not args.stepfactor >= 1 or args.stepfactor == float("inf"):
        raise ValueError(f"-f must be a finite number >= 1, got {args.stepfactor:g}")
    _sizes(args)
    check_block_size(args.block_size)
    check_backend_names(args.backend)


def check_backend_names(flag: str) -> None:
    """Every name in --backend's comma list is a registered backend, checked
    before any rank starts (a typo otherwise killed each rank mid-launch)."""
    from ..backends import backend_name

    for name in flag.split(","):
        try:
            backend_name(name)
        except ValueError as exc:
            raise ValueError(f"--backend {flag}: {exc}") from None


def _device() -> torch.device:
    """Where the benchmark's tensors live: the group's communication device
    (gloo: the host; nccl, xccl: this rank's device)."""
    return collectives.communication_device()


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _nic_tx_bytes():
    """Bytes this host's interface has sent, if the launcher named it
    (GLOO_SOCKET_IFNAME) and the kernel shows it; else None."""
    import os

    name = os.environ.get("GLOO_SOCKET_IFNAME")
    try:
        with open(f"/sys/class/net/{name}/statistics/tx_bytes") as f:
            return int(f.read())
    except (OSError, TypeError, ValueError):
        return None


def _timed(fn, warmup: int, iters: int):
    """(the slowest rank's seconds per call, this host's interface bytes per
    call or None)."""
    for _ in range(warmup):
        fn()
    dist.barrier()
    tx0 = _nic_tx_bytes()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    get_accelerator().synchronize()
    took = time.perf_counter() - t0
    tx1 = _nic_tx_bytes()
    tx = (tx1 - tx0) // iters if tx0 is not None and tx1 is not None else None
    return _slowest(took / iters), tx


def _network_stage(backend, count: int):
    """(the backend whose 1-bit collectives cross the network, its layout of
    a `count` buffer): the backend itself, or a hierarchical one's
    cross-node backend and this rank's shard."""
    layout = backend.layout([count])
    if hasattr(layout, "shard"):
        return backend.net, layout.shard
    return backend, layout


def _wire_bytes(backend, count: int) -> int:
    """Bytes each rank sends per call over the network (wire format v2): its
    all-to-all rows and its all-gather row to each of p - 1 peers."""
    net, layout = _network_stage(backend, count)
    chunk = layout.chunk
    return 2 * (net.size - 1) * (chunk // 8 + chunk // net.block_size * net.scale_dtype.itemsize)


def _gather_to_rank0(t: torch.Tensor) -> List[torch.Tensor]:
    """Every rank's `t`, on rank 0's host (None elsewhere)."""
    t = t.contiguous().to(_device())
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
    dist.gather(t, parts, dst=0)
    return [p.cpu() for p in parts] if parts is not None else None


def _check_compressed(backend, count: int, device) -> int:
    """Run one fresh compressed allreduce and count wrong elements on rank 0."""
    n, ns = backend.error_sizes(count)
    g = torch.Generator().manual_seed(1234 + dist.get_rank())
    m = torch.randn(count, generator=g).to(device)
    werr = (torch.randn(n, generator=g) * 0.1).to(device)
    serr = (torch.randn(ns, generator=g) * 0.1).to(device)
    inputs = [_gather_to_rank0(t.cpu()) for t in (m, werr, serr)]
    backend.compressed_allreduce(m, werr, serr)
    wrong = 0
    if dist.get_rank() == 0:
        nodes = getattr(backend, "nodes", None)
        block, scales = backend.block_size, backend.scale_dtype
        expected, c = (simulate(*inputs, block, scale_dtype=scales) if nodes is None
                       else simulate_hierarchical(*inputs, block, nodes, scales))
        # bf16: the kernel rounds its own fp32 scale, which can sit across a
        # rounding boundary from the simulation's: one bf16 ulp off is right.
        wrong = count_wrong(m.cpu(), expected, c,
                            ulp=0.0 if scales == torch.float32 else 2.0 ** -7)
    return _broadcast_int(wrong)


def _check_all_reduce(count: int, dtype, device) -> int:
    g = torch.Generator().manual_seed(99 + dist.get_rank())
    x = torch.randn(count, generator=g)
    parts = _gather_to_rank0(x)
    y = x.to(dtype).to(device)
    dist.all_reduce(y)
    wrong = 0
    if dist.get_rank() == 0:
        expected = torch.stack([p.to(dtype).double() for p in parts]).sum(0)
        tol = (1e-5 if dtype == torch.float32 else 1e-2) * expected.abs().max().item() * 2
        wrong = int(((y.cpu().double() - expected).abs() > tol).sum())
    return _broadcast_int(wrong)


def _broadcast_int(v: int) -> int:
    t = torch.tensor([v], dtype=torch.int64, device=_device())
    dist.broadcast(t, 0)
    return int(t.item())


def _make_backends(names: List[str], piece_size: int, block_size: int,
                   scale_dtype: str) -> Dict[str, object]:
    from ..backends import get_backend, is_built_in

    made = {}
    for name in names:
        # Each layout agreed on its first call, as the optimizers call it (they
        # agree on what they exchange every step themselves), not on every call.
        once = {"agree_every_call": False} if is_built_in(name) else {}
        try:
            made[name] = get_backend(name, piece_size=piece_size, block_size=block_size,
                                     scale_dtype=getattr(torch, scale_dtype), **once)
        except ImportError as exc:
            raise SystemExit(f"onebit.bench: cannot use backend {name!r}: {exc}")
    return made


def sweep(rank: int, world: int, args: argparse.Namespace) -> List[Dict]:
    """Runs on every rank; rank 0 prints. Returns the rows (rank 0) or []."""
    device = _device()
    backends = _make_backends(args.backend.split(","), args.piece_size, args.block_size,
                              args.scale_dtype)
    sizes = _sizes(args)
    table = Table(COLUMNS, out=sys.stdout, quiet=rank != 0)
    if rank == 0:
        print(f"# onebit.bench allreduce: ranks={world} device={device.type} "
              f"dist={dist.get_backend()} threads/rank={torch.get_num_threads()} "
              f"sizes={args.minbytes}..{args.maxbytes} x{args.stepfactor} "
              f"warmup={args.warmup} iters={args.iters} "
              f"piece_size={'auto' if args.piece_size is None else args.piece_size} "
              f"block_size={args.block_size} scale_dtype={args.scale_dtype}")
        table.header()
    bar = progress(len(sizes), "onebit.bench") if rank == 0 else None
    results = []
    for size in sizes:
        count = max(1, size // 4)
        rows = []
        for dtype, label in ((torch.float32, "fp32"), (torch.float16, "fp16")):
            x = torch.randn(count).to(dtype).to(device)
            t, tx = _timed(lambda: dist.all_reduce(x), args.warmup, args.iters)
            wire = 2 * (world - 1) * count * x.element_size() // world
            rows.append(dict(type=label, backend="all_reduce", time=t, wire=wire, node_tx=tx,
                             wrong=_check_all_reduce(count, dtype, device)))
        for name, backend in backends.items():
            n, ns = backend.error_sizes(count)
            m = torch.randn(count).to(device)
            werr, serr = torch.zeros(n, device=device), torch.zeros(ns, device=device)
            # The piece-count tuner's trial calls are warmup too: time its choice.
            warmup = args.warmup + (TUNING_CALLS if backend.piece_size is None else 0)
            t, tx = _timed(lambda: backend.compressed_allreduce(m, werr, serr), warmup, args.iters)
            net, layout = _network_stage(backend, count)
            rows.append(dict(type="fp32", backend=name, time=t, wire=_wire_bytes(backend, count),
                             node_tx=tx,
                             # what run_pipelined cuts: the count, at most a chunk's blocks
                             pieces=len(piece_ranges(layout.chunk, layout.block, net.pipeline.count(
                                 layout.key, layout.padded, net.size))),
                             wrong=_check_compressed(backend, count, device)))
        base = rows[0]["time"]
        for r in rows:
            algbw = 4 * count / r["time"] / 1e9
            r.update(size=4 * count, count=count, algbw=algbw,
                     busbw=algbw * 2 * (world - 1) / world, speedup=base / r["time"])
            table.row(**{"size(B)": r["size"], "count": count, "type": r["type"],
                         "backend": r["backend"], "time(us)": r["time"] * 1e6, "algbw": algbw,
                         "busbw": r["busbw"], "wire(B)": r["wire"],
                         "node_tx(B)": "-" if r["node_tx"] is None else str(r["node_tx"]),
                         "speedup": r["speedup"],
                         "#wrong": r["wrong"]})
        results.extend(rows)
        if bar:
            bar.update()
    if bar:
        bar.close()
    return results if rank == 0 else []


def _size_label(size: int) -> str:
    """Bytes in the largest binary unit they fill (under 1 MiB was "0M")."""
    for shift, unit in ((30, "G"), (20, "M"), (10, "K")):
        if size >= 1 << shift:
            return f"{size / (1 << shift):g}{unit}"
    return f"{size}B"


def _footer(rows: List[Dict]) -> None:
    by = {}
    for r in rows:
        by.setdefault(f"{r['backend']}/{r['type']}", []).append(r)
    for key, rs in by.items():
        avg = sum(r["busbw"] for r in rs) / len(rs)
        sp = sum(r["speedup"] for r in rs) / len(rs)
        print(f"# {key:<18} avg busbw {avg:7.3f} GB/s   avg speedup vs fp32 all_reduce {sp:6.2f}x")
    compressed = list(dict.fromkeys(r["backend"] for r in rows if "pieces" in r))
    for name in compressed:
        pieces = [f"{_size_label(r['size'])}:{r['pieces']}" for r in rows
                  if r["backend"] == name and "pieces" in r]
        which = f" ({name})" if len(compressed) > 1 else ""
        print(f"# pipelined pieces per payload{which}: {' '.join(pieces)}")
    wrong = sum(r["wrong"] for r in rows)
    print(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")


def run(args: argparse.Namespace) -> bool:
    if any(b.startswith("mpi") for b in args.backend.split(",")) and not launch.under_mpirun():
        raise SystemExit("--backend mpi needs the ranks to be started by mpirun, e.g.\n"
                         "  mpirun -n 4 python -m onebit.bench --backend compressed,mpi\n"
                         "(MPI itself comes with: pip install 'onebit[mpi]')")
    rank, rows = launch.run_everywhere(sweep, args.nproc, args,
                                       backend=launch.local_backend(args.nproc))
    if rank != 0:
        return True
    _footer(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "allreduce", "config": vars(args), "results": rows}, f, indent=1)
    if args.plot:
        _plot(rows, args.plot)
    return all(r["wrong"] == 0 for r in rows)


def _plot(rows: List[Dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'onebit[bench]'")
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in dict.fromkeys(f"{r['backend']}/{r['type']}" for r in rows):
        rs = [r for r in rows if f"{r['backend']}/{r['type']}" == key]
        ax.plot([r["size"] for r in rs], [r["algbw"] for r in rs], marker="o", label=key)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("payload (bytes of fp32)")
    ax.set_ylabel("algbw (GB/s)")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-b", "--minbytes", type=size_arg, default="1M", help="smallest fp32 payload (bytes)")
    p.add_argument("-e", "--maxbytes", type=size_arg, default="64M", help="largest fp32 payload (bytes)")
    p.add_argument("-f", "--stepfactor", type=float, default=2, help="size multiplier (>= 1)")
    p.add_argument("-i", "--stepbytes", type=size_arg, default="1M", help="size increment when -f 1")
    p.add_argument("-w", "--warmup", type=int_arg(0), default=2, help="warmup iterations")
    p.add_argument("-n", "--iters", type=int_arg(1), default=10, help="timed iterations")
    p.add_argument("--nproc", type=int_arg(1), default=4, help="local ranks when not launched")
    p.add_argument("--backend", default="compressed",
                   help="comma list: compressed,hierarchical,mpi,mpi_hierarchical")
    p.add_argument("--piece-size", dest="piece_size", type=piece_arg, default=None,
                   help="elements per pipelined piece of the compressed allreduce: 0 for one "
                        "piece, default auto (timed on the first calls)")
    p.add_argument("--block-size", dest="block_size", type=int_arg(8), default=DEFAULT_BLOCK_SIZE,
                   help="elements per scale (a multiple of 8), as the optimizers' block_size")
    p.add_argument("--scale-dtype", dest="scale_dtype", choices=("float32", "bfloat16"),
                   default="float32", help="the scales on the wire, as the optimizers' scale_dtype")
    p.add_argument("--json", help="write results to this JSON file")
    p.add_argument("--plot", help="write algbw vs size to this PNG (needs matplotlib)")
