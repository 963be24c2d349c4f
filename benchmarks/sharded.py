"""Sharded training's memory and bytes: each rank's optimizer state plus
error buffers, its peak RSS, and the bytes it sends to other nodes per
compression-stage step, for OnebitAdam on whole params (DDP's layout, one
rank per node) against FSDP2 shards (S ranks per node), all on local gloo
ranks of this machine.

  python -m benchmarks.sharded [--nodes 2] [--shards 1 2 4] [--params 4000000]

The "HSDP" column is what FSDP2 on the whole 2-D mesh would send instead:
an fp32 ring all-reduce of the same shard over the nodes.
"""
import argparse
import resource

import torch

from onebit.bench.table import int_arg


def _state_bytes(opt) -> int:
    """The optimizer state and this rank's error buffers, in bytes."""
    def size(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()
    state = sum(size(v) for st in opt.state_dict()["state"].values() for v in st.values()
                if isinstance(v, torch.Tensor))
    errors = opt.error_feedback_state_dict()["groups"]
    return state + sum(size(t) for g in errors.values() for t in
                       (g.values() if isinstance(g, dict) else [g]) if isinstance(t, torch.Tensor))


def _rank(rank, world, nodes, params, steps):
    import onebit

    shards = world // nodes
    torch.manual_seed(0)
    width = int((params / 4) ** 0.5)
    model = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
                                torch.nn.Linear(2 * width, width))
    group = None
    if shards > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (nodes, shards), mesh_dim_names=("replicate", "shard"))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
        group = mesh.get_group("replicate")
    opt = onebit.OnebitAdam(model.parameters(), lr=1e-3, freeze_step=2, process_group=group)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randn(8, width, generator=g)
        (model(x) - x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    stats = opt.comm_stats()
    return (_state_bytes(opt), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            stats["bytes_sent"], stats["fp32_bytes"], stats["stage"])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int_arg(1), default=2)
    p.add_argument("--shards", type=int_arg(1), nargs="+", default=[1, 2, 4],
                   help="ranks per node; 1: whole params (DDP's layout)")
    p.add_argument("--params", type=int_arg(1), default=4_000_000)
    p.add_argument("--steps", type=int_arg(3), default=4, help="steps, the last ones 1-bit")


def run(a: argparse.Namespace) -> bool:
    from onebit.launch import spawn_local

    print(f"# benchmarks.sharded: OnebitAdam, nodes={a.nodes} params~{a.params} "
          f"torch={torch.__version__}; per rank, compression-stage step")
    print(f"{'shards':>6} {'ranks':>5} {'state+errors MB':>15} {'vs whole':>8} {'peak RSS MB':>11} "
          f"{'sent KB/step':>12} {'HSDP KB/step':>12} {'ratio':>6}")
    base = None
    for shards in a.shards:
        rows = spawn_local(_rank, a.nodes * shards, a.nodes, a.params, a.steps, timeout=600,
                           threads=1)
        state = max(r[0] for r in rows)
        base = base or state
        rss = max(r[1] for r in rows)
        sent, fp32 = max(r[2] for r in rows), max(r[3] for r in rows)
        assert all(r[4] == "compression" for r in rows)
        print(f"{shards:>6} {a.nodes * shards:>5} {state / 2**20:>15.2f} {state / base:>8.3f} "
              f"{rss / 2**20:>11.0f} {sent / 1024:>12.1f} {fp32 / 1024:>12.1f} "
              f"{fp32 / sent:>6.1f}", flush=True)
    return True


if __name__ == "__main__":
    import sys

    from onebit.bench.command import main

    sys.exit(main(sys.modules[__name__]))
