"""One owner's error-feedback exchanges over its process group.

An optimizer and DiLoCo each hold one `ErrorFeedbackChannel`: the compressed
backend, the exchange of fused buffers with their worker and server errors,
the traffic of the owner's full-precision averaging beside the backend's
own, the per-step telemetry built on both, the notice that warns when a
resume lost the errors, and this rank's errors in a checkpoint with the
identity they are valid for. The owner says what it exchanges and when;
the channel keeps what must survive from one exchange to the next.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from .. import collectives
from ..backends import backend_name, get_backend, is_built_in
from ..backends.codecs import SignCodec
from ..backends.stats import TrafficStats
from ..wire import WIRE_FORMAT_VERSION
from .exchange import ErrorFeedbackExchange
from .state import ErrorFeedbackRestartNotice, error_feedback_state, restore_error_feedback
from .telemetry import StepTelemetry


def open_backend(name: Optional[str], group, *, timeout_s: Optional[float], cuda_aware: bool,
                 block_size: int, scale_dtype: torch.dtype, codec=SignCodec):
    """The compressed backend `name` (None: the default for this job) for an owner that checks its inputs for
    NaN/Inf itself (agreeing across ranks before anything is exchanged). MPI
    has its own communicator, which must be the process group's world
    (check_same_world); torch.distributed backends take the process group.
    Each takes the deadline. A `codec` other than the signs
    (backends/codecs.py) is taken by the "compressed" backend only, which
    is then the default whatever the job's."""
    if codec is not SignCodec:
        return get_backend(_codec_backend_name(name, codec), group=group, check_finite=False,
                           block_size=block_size, scale_dtype=scale_dtype, timeout_s=timeout_s,
                           codec=codec, agree_every_call=False)
    name = backend_name(name) if name is not None else agreed_backend_name(None, group,
                                                                            timeout_s)
    # The owner agrees every step on what it exchanges: the built-in backends
    # then check each layout once, not every call (a vendor's takes the
    # contract's arguments only).
    once = {"agree_every_call": False} if is_built_in(name) else {}
    if name.startswith("mpi"):
        backend = get_backend(name, group=None, check_finite=False, block_size=block_size,
                              scale_dtype=scale_dtype, cuda_aware=cuda_aware, timeout_s=timeout_s,
                              **once)
        check_same_world(name, backend, group)
        return backend
    return get_backend(name, group=group, check_finite=False, block_size=block_size,
                       scale_dtype=scale_dtype, timeout_s=timeout_s, **once)


def wire_backend_name(name: Optional[str], codec, group, timeout_s: Optional[float],
                      device: Optional[torch.device] = None) -> Optional[str]:
    """The registered backend that `open_backend(name, codec=codec)` opens
    (None for `codec` None: no compressed exchange): what an owner's
    construction check compares (None, "nccl" and "compressed" name one
    backend). The name is agreed across `group` first (agreed_backend_name:
    one all-gather that every rank makes, whatever it named and whatever its
    codec, so that ranks built apart still meet in the check after it)."""
    agreed = agreed_backend_name(name, group, timeout_s, device)
    if codec is None:
        return None
    return agreed if codec is SignCodec else _codec_backend_name(name, codec)


def _codec_backend_name(name: Optional[str], codec) -> str:
    """A codec other than the signs runs over 'compressed' only."""
    name = "compressed" if name is None else backend_name(name)
    if name != "compressed":
        raise ValueError(f"a {codec.name} wire runs over the 'compressed' backend only, "
                         f"not {name!r}")
    return name


def agreed_backend_name(chosen: Optional[str], group, timeout_s: Optional[float],
                        device: Optional[torch.device] = None) -> str:
    """The backend `chosen` names (None: the accelerator's default), agreed
    across `group` in one small all-gather that every rank makes, whatever
    it chose. Each rank reads the default from its own launcher's
    variables: on nodes of uneven size (2 + 1 ranks) some chose
    'hierarchical' and some 'compressed', their first collectives did not
    match, and gloo aborted the process. Where every rank took the default
    and the defaults differ, all take 'compressed' (the flat backend takes
    any layout); names that differ otherwise are the construction check's
    to report. `device`: where the owner's collectives take tensors
    (default: the group's communication device)."""
    import torch.distributed as dist

    name = backend_name(chosen)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return name
    rows = collectives.gather_numbers("agreeing on the compressed backend",
                                      [int(chosen is None), collectives.stable_digest(name)],
                                      torch.int64, group, timeout_s, device)
    if all(default for default, _ in rows) and len({d for _, d in rows}) > 1:
        return "compressed"
    return name


def check_same_world(name: str, backend, group) -> None:
    """An MPI backend's communicator must be the owner's process group, rank
    for rank: the owner counts ranks by the group, the exchange by MPI. A
    job launched by torchrun (each process an MPI world of one) or a
    subgroup would otherwise average nothing, or the wrong ranks, and the
    replicas would drift apart without an error."""
    import torch.distributed as dist

    want = (dist.get_rank(group), dist.get_world_size(group))
    if (backend.rank, backend.size) != want:
        raise ValueError(
            f"comm_backend_name={name!r}: MPI's world has this process as rank {backend.rank} "
            f"of {backend.size}, but the process group as rank {want[0]} of {want[1]}. The "
            "MPI backends need the group to be MPI's world: launch with mpirun and "
            "onebit.launch.init_distributed(), with process_group left None; or use "
            "comm_backend_name='compressed', which takes any process group")


class ErrorFeedbackChannel:
    """What an owner's 1-bit exchanges carry between calls.

    owner: the class name its messages use. backend: the compressed backend
    (None at world size 1, or for an owner that exchanges in full precision
    only). world_size, rank: in the owner's process group. block_size: the
    wire's. shard_identity: `ShardedParams.identity()` (empty for whole
    params): saved errors are valid only for the same shard. consequence: a
    sentence for the restart notice on what the owner does when the errors
    are lost.
    """

    def __init__(self, owner: str, backend, world_size: int, rank: int, block_size: int,
                 shard_identity: Dict[str, object], consequence: str = "") -> None:
        self.owner = owner
        self.backend = backend
        self.world_size = world_size
        self.rank = rank
        self.block_size = block_size
        self.shard_identity = dict(shard_identity)
        self.exchange = ErrorFeedbackExchange(backend)
        self.traffic = TrafficStats()  # the owner's full-precision averaging
        self.telemetry = StepTelemetry([self.traffic] + ([backend.stats] if backend else []))
        self.restart_notice = ErrorFeedbackRestartNotice(owner, consequence)
        # Since the owner's last load: no errors came back and none were
        # exchanged (the buffers are the load's zeros, see state.py).
        self._load_left_zeros = False

    def report(self, step: int) -> Dict[str, object]:
        """`comm_stats()` after `step` steps (or rounds)."""
        return self.telemetry.report(step, self.world_size, self.exchange.errors_to_report())

    # --------------------------------------------------------- checkpoints --
    def identity(self, position: Dict[str, int]) -> Dict[str, object]:
        """What saved errors are valid for: this rank of this world size, the
        wire, the owner's `position` (its step or round) and the shard. A
        code other than the signs (DiLoCo's 2-bit) is named too: errors
        carried under one code are not the other's. (The signs are not, so
        checkpoints saved before codes had names still load.)"""
        codec = getattr(self.backend, "codec", None)
        code = {"code": codec.name} if codec is not None and codec.bits != 1 else {}
        return {"rank": self.rank, "world_size": self.world_size,
                "wire_format": WIRE_FORMAT_VERSION, "block_size": self.block_size,
                **code, **position, **self.shard_identity}

    def key(self, prefix: str) -> str:
        """This rank's key in a DCP checkpoint. It names the world size too:
        at another one the buffers have other sizes, and DCP refuses to load
        a tensor into one of another size, so there the key is simply absent
        (load with allow_partial_load=True). It names the shard as well:
        replicas of different shards share their replicate rank."""
        key = f"{prefix}.world{self.world_size}.rank{self.rank}"
        if self.shard_identity:
            key += f".shard{self.shard_identity['shard']}of{self.shard_identity['shards']}"
        return key

    def state_dict(self, layouts: dict, device: torch.device,
                   position: Dict[str, int]) -> dict:
        """This rank's errors of the fused buffers `layouts` (key -> layout),
        with their identity. Buffers that have not exchanged yet get zeros of
        the right size, so a fresh owner's dict is a target DCP can load into.
        Made after a load that left zeros, before anything restored them or
        was exchanged, it is such a target only: no load restores it unless
        a checkpoint's entry was written over it (state.py)."""
        restorable = not (self._load_left_zeros and not self.exchange.error_buffers())
        return error_feedback_state(self.exchange, layouts, device, self.identity(position),
                                    restorable)

    def load_state_dict(self, state: dict, layouts: dict, position: Dict[str, int]) -> bool:
        """Restore what `state_dict` saved, when it has this identity and
        these layouts; else the errors restart from zero. Returns whether it
        loaded."""
        loaded = restore_error_feedback(self.exchange, state, layouts, self.identity(position))
        if loaded:
            self.restart_notice.restored()
            self._load_left_zeros = False
        return loaded

    def owner_loaded(self, errors_lost: bool) -> None:
        """The owner loaded a checkpoint: the errors restart from zero until
        `load_state_dict` brings this rank's back; `errors_lost` (the saved
        run had some) arms the restart notice."""
        self.exchange.load_errors(None)
        self.restart_notice.loaded(errors_lost)
        self._load_left_zeros = True
