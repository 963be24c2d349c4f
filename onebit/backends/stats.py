"""Traffic counters: what went over the network and what it cost.

Bytes are counted where they are handed to the transport, as each rank's
share of the collective: an all-to-all or all-gather of rows of R bytes
sends (p - 1) * R and receives as much (a rank's own row never leaves it).
Next to them, `fp32_bytes`: what a ring all-reduce of the same elements in
fp32 sends per rank, 2 (p - 1) / p * 4 bytes each -- the baseline a
compression ratio is against. `bytes_between_nodes`: the part of
`bytes_sent` that leaves this rank's node, what the slow link carries. The
hierarchical backend knows its nodes and counts its 1-bit stage there (its
fp32 traffic inside the node stays out); a collective that knows no nodes
(the flat backends, the optimizers' full-precision averaging) counts all it
sends, as if every peer were on another host (on one host it is an upper
bound). Seconds are host wall time around the calls:
where the waits are stream-ordered (NCCL, XCCL) they count the launches, not
the transfers, which finish later on the device. The piece tuner, which
must know the transfer's time, takes it from device events instead
(pipeline.CallTimer).
"""
from __future__ import annotations

from typing import Dict, Optional

FIELDS = ("calls", "bytes_sent", "bytes_received", "bytes_between_nodes", "fp32_bytes", "comm_s",
          "compress_s")


def fp32_allreduce_bytes(numel: int, world_size: int) -> int:
    """Bytes each rank sends in a ring all-reduce of `numel` fp32 elements."""
    return allreduce_bytes(numel, world_size, 4)


def allreduce_bytes(numel: int, world_size: int, itemsize: int) -> int:
    """Bytes each rank sends in a ring all-reduce of `numel` elements of
    `itemsize` bytes."""
    return (2 * (world_size - 1) * itemsize * numel) // world_size if world_size > 1 else 0


class TrafficStats:
    """Running totals of FIELDS; `snapshot()` and `since(snapshot)` give a
    plain dict, e.g. for one step."""

    def __init__(self) -> None:
        self.totals: Dict[str, float] = dict.fromkeys(FIELDS, 0)

    def add(self, sent: int = 0, received: int = 0, fp32: int = 0, comm_s: float = 0.0,
            compress_s: float = 0.0, between_nodes: Optional[int] = None) -> None:
        """One call's counts; `between_nodes` defaults to all of `sent` (a
        collective that knows no nodes)."""
        t = self.totals
        t["calls"] += 1
        t["bytes_sent"] += sent
        t["bytes_received"] += received
        t["bytes_between_nodes"] += sent if between_nodes is None else between_nodes
        t["fp32_bytes"] += fp32
        t["comm_s"] += comm_s
        t["compress_s"] += compress_s

    def add_allreduce(self, numel: int, world_size: int, itemsize: int,
                      comm_s: float = 0.0, payload: Optional[int] = None) -> None:
        """One ring all-reduce of `numel` elements of `itemsize` bytes, sent
        and received alike, against fp32's bytes for the `payload` elements
        in it (default all of them; fewer where the buffer carries pads,
        which are sent all the same)."""
        sent = allreduce_bytes(numel, world_size, itemsize)
        fp32 = fp32_allreduce_bytes(numel if payload is None else payload, world_size)
        self.add(sent, sent, fp32, comm_s)

    def snapshot(self) -> Dict[str, float]:
        return dict(self.totals)

    def since(self, snapshot: Dict[str, float]) -> Dict[str, float]:
        return {k: self.totals[k] - snapshot.get(k, 0) for k in FIELDS}
