"""How DiLoCo's rounds reach the other ranks, opened once when it is built.

With several ranks: the ranks first agree on every setting that must match
(one all-gather of digests), rank 0's params are broadcast, and then come
the groups the rounds use. With overlap_steps the exchanges run on a
communication thread with a process group of its own, so its collectives
never interleave with the training loop's. Sharded (FSDP2), a round is
skipped on every shard of the model or on none: its agreement spans the
mesh. 1-bit, 2-bit and sparse 2-bit rounds open a compressed backend; bf16 and fp32
rounds use plain all-reduces.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import List, Optional

import torch

from .. import collectives
from ..agreement import RankAgreement
from ..feedback.channel import open_backend, wire_backend_name
from ..handoff import exchange_group
from ..shards import ShardedParams, local
from ..wire import WIRE_FORMAT_VERSION
from .options import DiLoCoOptions


@dataclass
class Links:
    """backend: the compressed exchange's (None: bf16, fp32 or one rank);
    round_group: the rounds' all-reduces; agree_group: their agreement;
    thread: the communication thread (None without overlap)."""

    comm_device: torch.device
    round_group: object = None
    agree_group: object = None
    backend: object = None
    thread: Optional[ThreadPoolExecutor] = None


def connect(options: DiLoCoOptions, shards: ShardedParams, params: List[torch.Tensor],
            all_params: List[torch.Tensor], group, world_size: int, lr_fingerprint: object,
            comm_backend_name: Optional[str]) -> Links:
    """Open the links of DiLoCo's synced `params` (of the model's
    `all_params`) over `group`; `lr_fingerprint`: OuterLR.fingerprint()."""
    links = Links(torch.device("cpu"), group, group)
    if world_size == 1:
        if shards.sharded:  # one replica of shards (a 1 x N mesh): no exchange
            links.agree_group = shards.mesh_group
            links.comm_device = collectives.communication_device(shards.mesh_group,
                                                                 params[0].device)
        return links
    links.comm_device = collectives.communication_device(group, params[0].device)
    # The backend each rank will open, by its registered name: None,
    # DeepSpeed's "nccl" and "compressed" are one backend. (Moot for
    # rounds in bf16 or fp32, which use none.)
    wire = wire_backend_name(shards.comm_backend(comm_backend_name),
                             options.codec, group, options.timeout_s,
                             links.comm_device)
    RankAgreement("DiLoCo", group, options.timeout_s).check_fields(
        _agreed_fields(options, shards, params, all_params, wire, lr_fingerprint))
    collectives.broadcast_from_first_rank("DiLoCo: broadcast of rank 0's initial parameters",
                                          [local(p) for p in params], group, options.timeout_s)
    if options.overlap_steps:
        links.round_group = exchange_group(group)
        links.thread = ThreadPoolExecutor(1, thread_name_prefix="onebit-diloco")
    links.agree_group = links.round_group
    if shards.sharded:
        links.agree_group = (exchange_group(shards.mesh_group) if options.overlap_steps
                             else shards.mesh_group)
    if options.codec is not None:
        links.backend = open_backend(wire, links.round_group, timeout_s=options.timeout_s,
                                     cuda_aware=False, block_size=options.block_size,
                                     scale_dtype=options.wire_scale_dtype,
                                     codec=options.codec)
    return links


def _agreed_fields(o: DiLoCoOptions, shards: ShardedParams, params: List[torch.Tensor],
                   all_params: List[torch.Tensor], wire, lr_fingerprint: object) -> dict:
    """What every rank must hold alike, compared when built."""
    return {
        "sync_every and warmup_steps": (o.sync_every, o.warmup_steps),
        "fragments, overlap_steps, keep_local_progress and fragment_update_alpha": (
            o.fragments, o.overlap_steps, o.keep_local_progress, o.fragment_update_alpha),
        "the synced parameters (which of the model's, shapes, dtypes)": (
            len(all_params), [i for i, p in enumerate(all_params) if p.requires_grad],
            [(tuple(p.shape), str(p.dtype)) for p in params]),
        "compression and wire format": (o.compression, o.block_size, str(o.wire_scale_dtype),
                                        WIRE_FORMAT_VERSION, wire,
                                        o.topk if o.compression == "sparse2bit" else None,
                                        o.error_decay),
        # a schedule by its values at the first rounds' landings
        "outer optimizer": (lr_fingerprint, o.outer_momentum, o.nesterov),
        **(shards.replica_fields() if shards.sharded else {})}
