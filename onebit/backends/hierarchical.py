"""The hierarchical compressed allreduce: full precision inside a node, 1 bit
only between nodes.

With K ranks on each of M nodes, the flat algorithm has every rank compress
its whole buffer and send it over the network: a node pushes K times the
inter-node bytes it needs, and p = K*M workers each add their sign noise.
Here the buffer of N elements (N a multiple of B*K*M) is cut into K shards
of S = N/K elements, and

  1. inside each node, a full-precision (fp32) reduce-scatter: local rank s
     ends with the node's mean of shard s;
  2. between nodes, the flat error-compensated 1-bit allreduce of shard s
     among the M ranks with local rank s (one per node), written once in
     base.py and run unchanged on that group;
  3. inside each node, an all-gather of the shards.

Stage 2 gives every node the same bits of shard s, and stage 3 copies them,
so every rank ends with the same bits. The error buffers belong to stage 2:
worker S elements, server S/M. Tensors start on block boundaries of the
whole buffer and S is a multiple of B*M, so every block lies inside one
shard and keeps its own scale: with one rank per node this is the flat
algorithm, bit for bit; on one node it is an exact fp32 mean (no network
between nodes, nothing to compress, the errors stay zero).

Node groups: `node_of_rank` (the node index of every rank of the group)
when given; else $ONEBIT_RANKS_PER_NODE, else the launcher's local world size
(torchrun's LOCAL_WORLD_SIZE, Open MPI's and MPICH's equivalents) with ranks
numbered node by node (rank = node * K + LOCAL_RANK, checked). Over MPI the
default is the shared-memory split of the communicator.
"""
from __future__ import annotations

import os
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import collectives
from ..accelerator.placement import RANKS_PER_NODE_ENV, local_world_size
from ..wire import DEFAULT_BLOCK_SIZE, DEFAULT_SCALE_DTYPE
from .base import CompressedAllreduceBase, check_operands, naming_the_agreement
from .layout import BlockLayout
from .node import MpiNode, TorchNode
from .shm import ShmNode
from .stats import TrafficStats, fp32_allreduce_bytes


class HierarchicalLayout:
    """A fused buffer as the hierarchical allreduce cuts it.

    `full` places the tensors for K*M ranks (so N divides into K shards of
    whole B*M units); `shard` is this rank's shard as the flat algorithm
    sees it: the pieces of tensors inside it, on M ranks. Offsets, views and
    the buffer length are those of `full`; the error buffers are the shard's.
    """

    def __init__(self, sizes: Sequence[int], block: int, ranks_per_node: int, nodes: int,
                 local_rank: int) -> None:
        self.full = BlockLayout(sizes, block, ranks_per_node * nodes)
        self.ranks_per_node, self.nodes = ranks_per_node, nodes
        self.shard_numel = self.full.padded // ranks_per_node
        lo = local_rank * self.shard_numel
        hi = lo + self.shard_numel
        # Every tensor starts on a block boundary and so does the shard, so
        # the pieces inside it sit exactly where BlockLayout would put them.
        inside = [j for j, (o, s) in enumerate(zip(self.full.offsets, self.full.sizes))
                  if max(o, lo) < min(o + s, hi)]
        pieces = [min(self.full.offsets[j] + self.full.sizes[j], hi) - max(self.full.offsets[j], lo)
                  for j in inside]
        self._piece_of = {j: k for k, j in enumerate(inside)}  # tensor -> its piece in the shard
        self.shard = BlockLayout(pieces, block, nodes, padded=self.shard_numel)
        self.sizes, self.offsets, self.numel = self.full.sizes, self.full.offsets, self.full.numel
        self.block, self.padded = block, self.full.padded

    @property
    def error_sizes(self):
        """(worker, server) error elements: the shard's."""
        return self.shard.error_sizes

    @property
    def key(self) -> tuple:
        return ("hierarchical", self.ranks_per_node, self.nodes) + self.full.key

    def error_ranges(self, index: int, node: int):
        """Where tensor `index` sits in the errors of the rank of node `node`
        holding this shard (BlockLayout.error_ranges of its piece), or
        (None, None) where the shard holds none of it."""
        piece = self._piece_of.get(index)
        return (None, None) if piece is None else self.shard.error_ranges(piece, node)

    def views(self, flat: torch.Tensor, shapes) -> List[torch.Tensor]:
        return self.full.views(flat, shapes)


def node_map(size: int, rank: int, node_of_rank: Optional[Sequence[int]], gather_ints):
    """(nodes: lists of group ranks per node, in local order). `gather_ints(list)`
    returns every rank's list (an all-gather), used to check that all ranks
    see the same layout and that the launcher numbered ranks node by node."""
    if node_of_rank is None:
        raw = os.environ.get(RANKS_PER_NODE_ENV)
        if raw is not None:
            if not raw.isdigit() or int(raw) < 1:
                raise ValueError(f"${RANKS_PER_NODE_ENV} must be a positive integer, got {raw!r}")
            k, local = int(raw), rank % int(raw)
        else:
            k, local = local_world_size(), int(os.environ.get("LOCAL_RANK", rank))
        k = min(k, size)
        every = gather_ints([k, local])
        if len({k_ for k_, _ in every}) != 1:
            raise ValueError("ranks disagree on the ranks per node: " + ", ".join(
                f"rank {r}: {k_}" for r, (k_, _) in enumerate(every)))
        if size % k:
            raise ValueError(f"{size} ranks do not split into nodes of {k}; pass node_of_rank or "
                             f"set ${RANKS_PER_NODE_ENV}")
        wrong = [r for r, (_, loc) in enumerate(every) if loc % k != r % k]
        if wrong and raw is None:
            raise ValueError(f"ranks {wrong} have a LOCAL_RANK that does not follow rank = node * "
                             f"{k} + LOCAL_RANK; pass node_of_rank (the node of every rank) or "
                             f"set ${RANKS_PER_NODE_ENV} for this layout")
        node_of_rank = [r // k for r in range(size)]
    node_of_rank = [int(n) for n in node_of_rank]
    if len(node_of_rank) != size:  # before the all-gather, whose sizes would not match
        raise ValueError(f"node_of_rank names {len(node_of_rank)} ranks; the group has {size}")
    if gather_ints(node_of_rank) != [node_of_rank] * size:
        raise ValueError("ranks disagree on node_of_rank: every rank must pass the same list")
    nodes: Dict[int, List[int]] = {}
    for r, n in enumerate(node_of_rank):
        nodes.setdefault(n, []).append(r)
    nodes_list = [nodes[n] for n in sorted(nodes)]
    if len({len(n) for n in nodes_list}) != 1:
        raise ValueError("every node needs the same number of ranks, got " + ", ".join(
            f"node {n}: {len(rs)}" for n, rs in sorted(nodes.items())))
    return nodes_list


class HierarchicalBackend:
    """compressed_allreduce in three stages (module docstring).

    net: the flat compressed backend among the ranks with this local rank
    (one per node); node: the full-precision transport inside this node
    (node.py's interface: staging, reduce_scatter, all_gather). Use
    `torch_hierarchical` or `mpi_hierarchical` to build one.
    The API is CompressedAllreduceBase's: `layout`, `error_sizes`,
    `compressed_allreduce`, `stats` (all bytes this rank sent; its
    `bytes_between_nodes`, the inter-node ones alone) and `net_stats` (the
    inter-node backend's own counters).
    """

    name = "hierarchical"

    def __init__(self, net: CompressedAllreduceBase, node, nodes: List[List[int]], rank: int,
                 check_finite: bool = True, agree_every_call: bool = True) -> None:
        self.net, self.node, self.nodes = net, node, nodes
        self.agree_every_call = agree_every_call  # see CompressedAllreduceBase
        self.ranks_per_node, self.node_count = len(nodes[0]), len(nodes)
        self._rank = rank
        self.local_rank = next(n.index(rank) for n in nodes if rank in n)
        self.block_size, self.scale_dtype = net.block_size, net.scale_dtype
        self.check_finite = check_finite
        self.piece_size, self.pipeline = net.piece_size, net.pipeline
        self.stats = TrafficStats()
        self.node_stats = TrafficStats()  # inside the node, full precision
        self._layouts: Dict[tuple, HierarchicalLayout] = {}
        self._agreed: set = set()

    @property
    def communication_device(self) -> torch.device:
        return self.net.communication_device

    @property
    def net_stats(self) -> TrafficStats:
        return self.net.stats

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self.ranks_per_node * self.node_count

    def layout(self, sizes) -> HierarchicalLayout:
        key = tuple(int(s) for s in sizes)
        made = self._layouts.get(key)
        if made is None:
            made = self._layouts[key] = HierarchicalLayout(
                key, self.block_size, self.ranks_per_node, self.node_count, self.local_rank)
        return made

    def error_sizes(self, numel: int):
        return self.layout([numel]).error_sizes

    def error_ranges(self, layout: HierarchicalLayout, index: int):
        return layout.error_ranges(index, self.net.rank)

    def compressed_allreduce(self, buffer_m: torch.Tensor, worker_error: torch.Tensor,
                             server_error: torch.Tensor, local_rank=None,
                             layout: Optional[HierarchicalLayout] = None) -> torch.Tensor:
        """The mean of `buffer_m` across all ranks (same contract as the flat
        backend's, with the shard-sized errors of `error_sizes`)."""
        started = time.perf_counter()
        check_operands(buffer_m, worker_error, server_error)
        layout = layout if layout is not None else self.layout([buffer_m.numel()])
        if not isinstance(layout, HierarchicalLayout) or layout.nodes != self.node_count or \
                layout.ranks_per_node != self.ranks_per_node:
            raise ValueError("layout must come from this backend's layout(sizes)")
        if buffer_m.numel() != layout.numel:
            raise ValueError(f"buffer_m has {buffer_m.numel()} elements; the layout needs "
                             f"{layout.numel}")
        want = layout.error_sizes
        for name, t, n in (("worker_error", worker_error, want[0]),
                           ("server_error", server_error, want[1])):
            if t.numel() != n:
                raise ValueError(f"{name} must be a contiguous float32 tensor of {n} elements on "
                                 f"{buffer_m.device} (the shard's: error_sizes), got "
                                 f"{t.numel()} elements")
        if buffer_m.numel() and self.check_finite:
            self.net.reject_nonfinite(buffer_m)
        device, k = buffer_m.device, self.ranks_per_node
        if buffer_m.numel() or self.agree_every_call:  # (an empty one on some ranks only)
            self._agree(layout, device)
        if buffer_m.numel() == 0:
            worker_error.zero_()
            server_error.zero_()
            return buffer_m
        before = self.net.stats.snapshot()
        if k == 1:  # one rank per node: the flat algorithm on the same layout
            self.net.compressed_allreduce(buffer_m, worker_error, server_error, layout=layout.shard)
            self._count(layout, before, 0.0, started)
            return buffer_m
        numel = layout.numel
        staging = self.node.staging(layout.padded, device)
        staging[:numel].copy_(buffer_m.detach().reshape(-1))
        t = time.perf_counter()
        shard = self.node.reduce_scatter(staging, layout.shard_numel)
        node_s = time.perf_counter() - t
        shard.div_(k)  # the node's mean
        mine = shard[:layout.shard.numel]
        # Past the shard's last piece are pads only, which no stage below
        # touches: zeros, as the contract has pads come back (they held the
        # node's mean of whatever the inputs had there).
        shard[layout.shard.numel:].zero_()
        if self.node_count > 1:
            self.net.compressed_allreduce(mine, worker_error, server_error, layout=layout.shard)
        else:  # the exact mean; its pads come back zero as the 1-bit ones do
            mine.index_fill_(0, layout.shard.pads(device)[:layout.shard.inner_pads], 0.0)
        inplace = buffer_m.dtype == torch.float32 and buffer_m.is_contiguous()
        out = buffer_m.detach().view(-1) if inplace else torch.empty(numel, device=device)
        t = time.perf_counter()
        self.node.all_gather(shard, out)
        node_s += time.perf_counter() - t
        if not inplace:
            buffer_m.detach().copy_(out.view(buffer_m.shape))
        self._count(layout, before, node_s, started)
        return buffer_m

    def _count(self, layout: HierarchicalLayout, before: dict, node_s: float,
               started: float) -> None:
        """Add a call to the counters. Inside the node the shards move as a
        ring reduce-scatter and all-gather of fp32 would move them: (K - 1)
        shards each way; between nodes, what the flat backend counted."""
        node_bytes = 2 * (self.ranks_per_node - 1) * layout.shard_numel * 4
        self.node_stats.add(node_bytes, node_bytes, 0, node_s, between_nodes=0)
        net = self.net.stats.since(before)
        compress_s = time.perf_counter() - started - net["comm_s"] - node_s
        self.stats.add(net["bytes_sent"] + node_bytes, net["bytes_received"] + node_bytes,
                       fp32_allreduce_bytes(sum(layout.sizes), self.size),
                       net["comm_s"] + node_s, compress_s,
                       between_nodes=net["bytes_sent"])  # the 1-bit stage, among the nodes

    def _agree(self, layout: HierarchicalLayout, device: torch.device) -> None:
        """Every rank checks that all ranks pass the same layout and piece
        size, so a mismatch is a ValueError on every rank, never a hang: the
        ranks of each node compare theirs, then one rank per node (the
        cross-node group) compares the nodes' verdicts. On every call
        (agree_every_call), else on a layout's first."""
        if layout.key in self._agreed and not self.agree_every_call:
            return
        pieces = -1 if self.pipeline.piece_size is None else self.pipeline.piece_size
        mine = torch.tensor([layout.padded, collectives.stable_digest((layout.key, pieces))],
                            dtype=torch.int64, device=device)
        every = mine.view(1, 2)
        with naming_the_agreement():
            if self.ranks_per_node > 1:
                every = torch.empty(self.ranks_per_node, 2, dtype=torch.int64, device=device)
                self.node.all_gather(mine.view(torch.uint8), every.view(torch.uint8).view(-1))
            node_agrees = int(len({tuple(r) for r in every.tolist()}) == 1)
            verdicts = torch.tensor([node_agrees, collectives.stable_digest(every.tolist())],
                                    dtype=torch.int64, device=device)
            if self.node_count > 1:
                verdicts = self.net.share(verdicts)
        verdicts = verdicts.view(-1, 2).tolist()
        if not all(ok for ok, _ in verdicts) or len({d for _, d in verdicts}) != 1:
            raise ValueError("ranks disagree on the compressed buffer (padded size, tensor "
                             f"sizes, piece size); this rank has N={layout.padded} for sizes "
                             f"{layout.sizes[:8]}{'...' if len(layout.sizes) > 8 else ''}; "
                             "every rank must pass the same")
        self._agreed.add(layout.key)


def _groups_of_every_replica_group(first_rank: int, node: int, local: int, backend: str,
                                   timeout_s: Optional[float],
                                   layout: List[Tuple[int, int, int]]):
    """This rank's node group and cross-node group. Every rank of the world
    creates every one (torch's rule for dist.new_group: all ranks, one
    order), for every data-parallel group of the world, not only its own:
    with two of them (tensor x data parallelism), ranks of each had created
    different groups under the same numbers, and gloo joined ranks of the
    other group (a wrong average, or a hang in new_group). One all-gather
    over the world says where each rank sits: its data-parallel group (by
    its first world rank), its node there and its place in the node. The
    groups take `backend` (a gloo group in an nccl world stays gloo).
    `layout`: (world rank, node, place) of every rank of this rank's own
    data-parallel group; where it spans the world, it is the only one and
    no gather is needed (nor made on the world's device, which may not be
    the group's)."""
    if len(layout) == dist.get_world_size():
        table = [None] * len(layout)
        for w, n, s in layout:
            table[w] = (first_rank, n, s)
    else:
        table = collectives.gather_numbers(
            "hierarchical groups of every data-parallel group (all-gather over the world)",
            [first_rank, node, local], torch.int64, None, timeout_s,
            collectives.communication_device(None, torch.device("cpu")))
    replicas: Dict[int, List[Tuple[int, int, int]]] = {}
    for w, (first, n, s) in enumerate(table):
        replicas.setdefault(int(first), []).append((int(n), int(s), w))
    node_group = cross_group = None
    for first in sorted(replicas):
        members = replicas[first]
        for n in sorted({n for n, _, _ in members}):
            made = dist.new_group(sorted(w for n_, _, w in members if n_ == n), backend=backend)
            if first == first_rank and n == node:
                node_group = made
        for s in sorted({s for _, s, _ in members}):
            made = dist.new_group(sorted(w for _, s_, w in members if s_ == s), backend=backend)
            if first == first_rank and s == local:
                cross_group = made
    return node_group, cross_group


def torch_hierarchical(group=None, node_of_rank: Optional[Sequence[int]] = None,
                       check_finite: bool = True, timeout_s: Optional[float] = None,
                       block_size: int = DEFAULT_BLOCK_SIZE,
                       scale_dtype: torch.dtype = DEFAULT_SCALE_DTYPE,
                       piece_size: Optional[int] = None,
                       shared_memory: bool = True,
                       agree_every_call: bool = True) -> HierarchicalBackend:
    """The hierarchical backend over torch.distributed: node groups and
    cross-node groups made with dist.new_group (every rank of the world must
    create it, as with any new group). Inside a node, host tensors move
    through shared memory (shm.py) where the node's ranks share it, else
    over the node group (`shared_memory=False` forces that)."""
    from .compressed import CompressedBackend

    timeout_s = collectives.check_timeout(timeout_s)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("the hierarchical backend needs torch.distributed initialised "
                           "(dist.init_process_group) before it is created")
    size, rank = dist.get_world_size(group), dist.get_rank(group)

    def gather_ints(values):
        return collectives.gather_numbers("hierarchical node map (all-gather)", values,
                                          torch.int64, group, timeout_s)

    nodes = node_map(size, rank, node_of_rank, gather_ints)
    mine = next(i for i, n in enumerate(nodes) if rank in n)
    local = nodes[mine].index(rank)
    world = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    node_group, cross_group = _groups_of_every_replica_group(
        min(world(r) for n in nodes for r in n), mine, local, collectives.backend_config(group),
        timeout_s, [(world(r), i, s) for i, n in enumerate(nodes) for s, r in enumerate(n)])
    # (the net's calls are agreed by this backend's own agreement)
    net = CompressedBackend(group=cross_group, check_finite=False, timeout_s=timeout_s,
                            block_size=block_size, scale_dtype=scale_dtype, piece_size=piece_size,
                            agree_every_call=False)
    node = None
    if shared_memory and len(nodes[0]) > 1:
        node = ShmNode.connect(node_group, local, len(nodes[0]), timeout_s)
    backend = HierarchicalBackend(net, node or TorchNode(node_group, timeout_s), nodes,
                                  rank, check_finite=check_finite,
                                  agree_every_call=agree_every_call)
    backend.timeout_s = timeout_s
    return backend


def mpi_hierarchical(comm=None, node_of_rank: Optional[Sequence[int]] = None,
                     cuda_aware: bool = False, check_finite: bool = True,
                     block_size: int = DEFAULT_BLOCK_SIZE,
                     scale_dtype: torch.dtype = DEFAULT_SCALE_DTYPE,
                     piece_size: Optional[int] = None,
                     timeout_s: Optional[float] = None,
                     agree_every_call: bool = True) -> HierarchicalBackend:
    """The hierarchical backend over MPI. Node groups: `node_of_rank`, else
    $ONEBIT_RANKS_PER_NODE, else MPI's shared-memory split (the ranks that
    share this machine's memory). `timeout_s`: each collective's deadline,
    as MpiBackend's."""
    from .mpi import MpiBackend, _mpi

    MPI = _mpi()
    comm = comm if comm is not None else MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    if node_of_rank is None and RANKS_PER_NODE_ENV not in os.environ:
        shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        leader = shared.allreduce(rank, op=MPI.MIN)  # the node's name: its lowest rank
        shared.Free()
        node_of_rank = comm.allgather(leader)
    nodes = node_map(size, rank, node_of_rank, lambda values: comm.allgather(list(values)))
    mine = next(i for i, n in enumerate(nodes) if rank in n)
    local = nodes[mine].index(rank)
    node_comm = comm.Split(color=mine, key=local)
    cross_comm = comm.Split(color=local, key=mine)
    timeout_s = collectives.check_timeout(timeout_s)
    net = MpiBackend(cuda_aware=cuda_aware, comm=cross_comm, check_finite=False,
                     block_size=block_size, scale_dtype=scale_dtype, piece_size=piece_size,
                     timeout_s=timeout_s, agree_every_call=False)
    backend = HierarchicalBackend(net, MpiNode(node_comm, timeout_s), nodes, rank,
                                  check_finite=check_finite, agree_every_call=agree_every_call)
    backend.timeout_s = timeout_s
    return backend
