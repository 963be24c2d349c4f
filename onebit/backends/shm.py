"""Full-precision collectives among the ranks of one machine through shared
memory: the hierarchical allreduce's stages 1 and 3 on a CPU node.

Over gloo, ranks on one machine still talk TCP through loopback: on a small
host that moved 64 MB of fp32 at about 160 MB/s (README, "Multi-node"),
slower than the 1-bit exchange between nodes it was meant to feed. Here each
rank owns one shared segment (a file in /dev/shm, unlinked as soon as every
rank has mapped it, so nothing is left behind even by a crash); a rank writes
into its own segment and reads the others', and the node group's gloo
barriers order the two. Stage 1 sums shard s in place in region s of local
rank s's segment and stage 2 works on it there, so stage 3 reads every
shard straight from its owner's segment into the result.

`ShmNode.connect` checks that the segments really are shared (ranks that
only think they share a machine see other files) and returns None where they
are not, so the caller keeps the gloo transport. A segment is allocated with
posix_fallocate rather than ftruncate: on a /dev/shm too small for it
(Docker's default is 64 MB) that raises ENOSPC here, where a sparse file
would kill the process with SIGBUS on the first write past the end. If any
rank of the node cannot grow its segment, every rank of the node warns once
and moves its stages to the gloo group for good.
"""
from __future__ import annotations

import errno
import os
import uuid
import warnings
from typing import List, Optional

import torch
import torch.distributed as dist

from .. import collectives
from .node import TorchNode

SHM_DIR = "/dev/shm"


class ShmNode:
    """reduce_scatter / all_gather of fp32 among the K ranks of a node.

    `staging(n)` is this rank's segment (n floats) for the caller to write
    its input into, so stage 1 needs no extra copy. Tensors elsewhere (a
    device's, or small ones like the layout check's) go over the group as
    TorchNode moves them."""

    def __init__(self, group, local_rank: int, size: int, timeout_s: Optional[float]) -> None:
        self.group, self.local_rank, self.size, self.timeout_s = group, local_rank, size, timeout_s
        self._segments: List[torch.Tensor] = []  # every local rank's, mapped here
        self._capacity = 0
        self._given_up = False  # a segment could not grow: the gloo group from now on
        self.over_group = TorchNode(group, timeout_s)

    @classmethod
    def connect(cls, group, local_rank: int, size: int,
                timeout_s: Optional[float]) -> Optional["ShmNode"]:
        """A ShmNode if every rank of the group can map every other's
        segment; else None (on every rank of the group alike)."""
        node = cls(group, local_rank, size, timeout_s)
        ok = os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)
        ok = node._map(8) if all(node._gather_floats([float(ok)])) else False
        token = float(uuid.uuid4().int % (1 << 23))  # exact in fp32
        if ok:
            node._segments[local_rank][0] = token
        tokens = node._gather_floats([token])
        node.barrier()
        # Ranks that only think they share a machine map files of their own.
        ok = ok and all(float(seg[0]) == t for seg, t in zip(node._segments, tokens))
        verdicts = node._gather_floats([float(ok)])  # every rank chooses alike
        return node if all(verdicts) else None

    # -------------------------------------------------------------- setup --
    def _gather_floats(self, values) -> List[float]:
        """Every local rank's values, one after another."""
        every = collectives.gather_numbers("shared-memory setup (all-gather inside the node)",
                                           values, torch.float64, self.group, self.timeout_s)
        return [x for row in every for x in row]

    def _map(self, numel: int) -> bool:
        """(Re)create this rank's segment of `numel` floats and map everyone's.
        True on every rank of the node, or False on every one (then nothing
        is mapped): every rank runs the same collectives whatever happens,
        so none is left waiting.
        Names: local rank 0's random tag (shared), then the local rank."""
        tag = int(self._gather_floats([float(uuid.uuid4().int % (1 << 52))])[0])
        names = [f"{SHM_DIR}/onebit-{tag:013x}-{r}" for r in range(self.size)]
        ok = True
        try:
            try:
                with open(names[self.local_rank], "wb") as f:
                    _allocate(f.fileno(), 4 * numel)
            except OSError:
                ok = False
            ok = all(self._gather_floats([float(ok)]))  # also: every file exists
            segments = []
            try:
                if ok:
                    segments = [torch.from_file(n, shared=True, size=numel, dtype=torch.float32)
                                for n in names]
            except (OSError, RuntimeError):
                ok = False
            ok = all(self._gather_floats([float(ok)]))  # also: everyone has mapped everything
        finally:
            # The mappings stay; the name goes, whatever happened: a peer that
            # died between the gathers must not leave this file in /dev/shm.
            if os.path.exists(names[self.local_rank]):
                os.unlink(names[self.local_rank])
        self._segments, self._capacity = (segments, numel) if ok else ([], 0)
        return ok

    def _is_mine(self, t: torch.Tensor) -> bool:
        """Whether `t` lies in this rank's segment."""
        return bool(self._segments) and t.device.type == "cpu" and \
            t.untyped_storage().data_ptr() == self._segments[self.local_rank].untyped_storage().data_ptr()

    def staging(self, numel: int, device: torch.device) -> torch.Tensor:
        if device.type != "cpu" or self._given_up:
            return self.over_group.staging(numel, device)
        # Every rank asks for the same size (the layout was agreed), so every
        # rank maps, or gives up, alike.
        if numel > self._capacity and not self._map(numel):
            self._given_up = True
            warnings.warn(
                f"onebit hierarchical: a rank of this node could not allocate {4 * numel} bytes "
                f"in {SHM_DIR} (is it full, or small? Docker's default is 64 MB: raise it with "
                f"--shm-size); the node's full-precision stages go over gloo from now on",
                RuntimeWarning, stacklevel=2)
            return self.over_group.staging(numel, device)
        return self._segments[self.local_rank][:numel]

    # --------------------------------------------------------- collectives --
    def barrier(self) -> None:
        collectives.run("hierarchical: barrier inside the node (shared memory)",
                        lambda: dist.barrier(group=self.group, async_op=True),
                        self.timeout_s, self.group)

    def reduce_scatter(self, staging: torch.Tensor, shard_numel: int) -> torch.Tensor:
        """The sum over local ranks of region s (s = this local rank) of every
        segment, added into region s of this rank's own segment (which no
        other rank reads until all_gather): its own input, then the others'
        in local-rank order. Returned as the shard."""
        if not self._is_mine(staging):
            return self.over_group.reduce_scatter(staging, shard_numel)
        lo, hi = self.local_rank * shard_numel, (self.local_rank + 1) * shard_numel
        self.barrier()  # every rank has written its input
        shard = self._segments[self.local_rank][lo:hi]  # this rank's own input there
        for k, seg in enumerate(self._segments):
            if k != self.local_rank:
                shard.add_(seg[lo:hi])
        return shard

    def all_gather(self, shard: torch.Tensor, out: torch.Tensor) -> None:
        """out = every local rank's shard (each in region k of its own
        segment, where reduce_scatter left it), cut at out.numel()."""
        if not self._is_mine(shard):
            return self.over_group.all_gather(shard, out)
        s, n = shard.numel(), out.numel()
        self.barrier()  # every shard is final
        for k, seg in enumerate(self._segments):
            lo, hi = k * s, min((k + 1) * s, n)
            if lo < hi:
                out[lo:hi].copy_(seg[lo:hi])
        self.barrier()  # nobody overwrites a segment another rank still reads


def _allocate(fd: int, nbytes: int) -> None:
    """Reserve nbytes for the file: ENOSPC now rather than SIGBUS later.
    File systems without fallocate get a sparse file, as before."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, nbytes)
