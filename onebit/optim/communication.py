"""Who an optimizer talks to, and how: opened once, at construction.

The process group and its size, the compressed backend (agreed across
ranks), the device of the optimizer's own collectives, the wire format,
and the two rank agreements: the decisions every rank must share (over the
shard group too, on FSDP2 shards) and the replicas' checksums (copies of
one shard only). Before any group or backend is made, the ranks check
that they built the same optimizer: those are collectives that ranks built
differently would not all join, hanging or aborting instead.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import collectives
from ..backends import backend_name
from ..agreement import RankAgreement, check_params_served
from ..feedback.channel import agreed_backend_name, open_backend
from ..handoff import exchange_group
from .options import CommOptions


def agreed_settings(schedule, own: dict, options: CommOptions) -> dict:
    """What every rank must share besides the param groups: the stage
    schedule's and the subclass's (`own`) settings; the wire format; and
    what decides the bucket plan."""
    return {**schedule.settings(), **own,
            "block_size": options.block_size, "scale_dtype": str(options.wire_scale_dtype),
            "overlap_backward": options.overlap_backward, "bucket_cap_mb": options.bucket_cap_mb,
            "communication_data_type": str(options.averaging_dtype),
            # its checks are collectives of their own
            "check_replicas_every": options.check_replicas_every}


class Communication:
    """An optimizer's communication, from its `options` (options.py).
    `name` names the optimizer in errors; `settings`: agreed_settings's;
    `shards`: its ShardedParams; `device`: where its params are."""

    def __init__(self, name: str, options: CommOptions, settings: dict, shards,
                 device: torch.device) -> None:
        self.name, self.settings, self.options = name, settings, options
        self.process_group, self.timeout_s = options.process_group, options.timeout_s
        self.distributed = collectives.is_distributed(name)
        self.world_size = dist.get_world_size(self.process_group) if self.distributed else 1
        self.rank = dist.get_rank(self.process_group) if self.world_size > 1 else 0
        if shards.sharded and options.overlap_backward:
            raise ValueError(f"{name}: overlap_backward is not supported with "
                             "FSDP2-sharded params yet; leave it False")
        self.chosen = shards.comm_backend(options.comm_backend_name)
        self.comm_backend_name = backend_name(self.chosen)  # a default: agreed in open()
        self.backend = None
        # Where the optimizer's own collectives (averaging, agreement) take tensors.
        self.comm_device = (collectives.communication_device(self.process_group, device)
                            if self.distributed else torch.device("cpu"))
        # The decisions every rank must share (skipping a step, which params
        # have no gradient) span the shard group too: a shard that skipped
        # while its neighbour stepped would leave half a parameter behind.
        # The replicas' checksums, though, compare only copies of one shard.
        self.agreement = RankAgreement(name, shards.mesh_group if shards.sharded
                                       else self.process_group, self.timeout_s)
        self.replicas = RankAgreement(name, self.process_group, self.timeout_s)
        self.agreeing = self.world_size > 1 or (shards.sharded and dist.get_world_size() > 1)

    def open(self, param_groups, shards) -> None:
        """Check that every rank built the same optimizer, agree on the
        backend, open it, and start every rank from rank 0's params."""
        if self.agreeing and self.world_size == 1:  # one replica of shards: agree, no exchange
            self.agreement.check_construction(self.settings, param_groups, self.comm_backend_name)
        if self.world_size == 1:
            return
        check_params_served(self.name, param_groups, self.process_group)
        # (a default: each rank read it from its own launcher's variables)
        self.comm_backend_name = agreed_backend_name(self.chosen, self.process_group,
                                                     self.timeout_s, self.comm_device)
        self.agreement.check_construction(self.settings, param_groups, self.comm_backend_name)
        group, o = self.process_group, self.options
        if o.overlap_backward and not self.comm_backend_name.startswith("mpi"):
            group = exchange_group(group)  # the communication thread's own (overlap.py)
        self.backend = open_backend(self.comm_backend_name, group, timeout_s=self.timeout_s,
                                    cuda_aware=o.cuda_aware, block_size=o.block_size,
                                    scale_dtype=o.wire_scale_dtype)
        if shards.sharded:  # replicas of one shard, not of different ones
            self.replicas.check_fields(shards.replica_fields())
        self.broadcast(param_groups, shards)

    def check_added(self, param_groups) -> None:
        """A group added (the last of `param_groups`): every rank added the same."""
        if self.world_size > 1:
            check_params_served(self.name, param_groups, self.process_group)
            self.agreement.check_construction(self.settings, param_groups, self.comm_backend_name)

    def admit(self, param_groups, shards, wiring) -> None:
        """A group just added (the last of `param_groups`): refused, it leaves
        `param_groups` (it would train unchecked, and 0/1 Adam's per-group
        counters would miss it) unless every rank added the same and the
        overlap (`wiring`: OverlapWiring) can serve it; these checks come
        before the broadcast, so a refusal leaves its params as they were.
        Admitted, its params start from rank 0's values (`shards`:
        ShardedParams) and get the overlap's hooks."""
        try:
            self.check_added(param_groups)
            wiring.check(param_groups[-1])
        except BaseException:
            param_groups.pop()
            raise
        if self.world_size > 1:
            self.broadcast(param_groups[-1:], shards)
        wiring.watch(param_groups[-1])

    def check_replicas(self, stage, param_groups, params) -> None:
        """After step `stage`, every check_replicas_every steps where the
        stage leaves the replicas equal: compare their checksums.
        `params`: the optimizer's ParamState."""
        every, t = self.options.check_replicas_every, stage.step
        if every and self.world_size > 1 and t % every == 0 and stage.replicas_match:
            self.replicas.check_replicas(
                t, [{"params": params.shards.locals(g["params"])} for g in param_groups],
                params.local_state())

    def broadcast(self, groups, shards) -> None:
        """Start every rank from rank 0's parameters (one collective per group)."""
        for group in groups:
            collectives.broadcast_from_first_rank(
                f"{self.name}: broadcast of rank 0's initial parameters",
                shards.locals(list(group["params"])), self.process_group, self.timeout_s)
