"""Bounded collectives: every torch.distributed call onebit makes, with a
deadline and an error that says which phase failed.

A collective whose peer died fails as soon as the transport notices (gloo:
"connection closed by peer"); one whose peer hangs fails when `timeout_s`
passes. Either way every surviving rank raises `CommunicationError` naming
the phase -- never a silent hang. The default deadline is
$ONEBIT_TIMEOUT_S, else 300 s; backends and optimizers take `timeout_s`.
"""
from __future__ import annotations

import collections
import datetime
import hashlib
import math
import numbers
import os
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from .accelerator import placement


# torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CommunicationError(RuntimeError):
    """A collective failed or timed out; the message names the phase."""


# About 31 years: far beyond any job, and well inside what datetime.timedelta holds.
MAX_TIMEOUT_S = 1e9


def check_timeout(timeout_s) -> Optional[float]:
    """None (the default deadline) or a finite number of seconds > 0, checked
    where it is given rather than at the first collective. At most
    MAX_TIMEOUT_S: a deadline is a timedelta, which holds no more."""
    if timeout_s is None:
        return None
    if (isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real)
            or not math.isfinite(timeout_s) or not 0 < timeout_s <= MAX_TIMEOUT_S):
        raise ValueError(f"timeout_s must be a finite number of seconds > 0 and at most "
                         f"{MAX_TIMEOUT_S:.0e} (or None for "
                         f"$ONEBIT_TIMEOUT_S, else 300), got {timeout_s!r}")
    return float(timeout_s)


def default_timeout_s() -> float:
    raw = os.environ.get("ONEBIT_TIMEOUT_S", "300")
    try:
        return check_timeout(float(raw))
    except ValueError:
        raise ValueError(f"$ONEBIT_TIMEOUT_S must be a number of seconds > 0, got {raw!r}") from None


class Pending:
    """A started collective; `wait()` finishes it within the deadline or
    raises CommunicationError naming the phase."""

    def __init__(self, phase: str, work: "dist.Work", timeout_s: float, group) -> None:
        self.phase, self.work, self.timeout_s, self.group = phase, work, timeout_s, group

    def wait(self) -> None:
        try:
            if stream_ordered(self.group):
                # The current stream waits for the collective; the host does
                # not (NCCL polls the host until done when given a timeout).
                # NCCL's watchdog, at the process group's timeout, is then
                # what ends a dead peer's wait.
                self.work.wait()
            else:
                self.work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise _failed(self.phase, self.timeout_s, self.group, exc) from exc


# What a transport says when the peer is gone rather than the call wrong.
_PEER_GONE = ("timed out", "timeout", "closed by peer", "connection reset", "broken pipe",
              "connection refused", "end of file", "watchdog")


def _failed(phase: str, t: float, group, exc: Exception) -> CommunicationError:
    """A CommunicationError naming the phase and the rank. Only a deadline
    passed or a connection lost is blamed on a peer; any other error (a
    tensor the group cannot take, an op with no implementation) is reported
    as itself."""
    where = f"rank {dist.get_rank(group)} of {dist.get_world_size(group)}"
    if any(s in str(exc).lower() for s in _PEER_GONE):
        return CommunicationError(
            f"onebit: {phase} failed or did not finish within {t:g} s on {where}: {exc}. "
            "A peer rank probably died, hung, or stopped calling step() in step with the "
            "others (or is at another step: resumed from another checkpoint)")
    return CommunicationError(f"onebit: {phase} failed on {where}: {exc}")


# The works of the collectives started since the last one began that had
# finished. A gloo worker thread drops its reference to a work just after
# the waiter has woken; when that is the last one, the work's destructor
# runs there and frees the Python tensors it holds (torch.distributed's
# Python layer makes some, such as the chunks of an all-gather's output),
# which takes the GIL. If the script has ended by then, the interpreter is
# finalizing: the thread is torn down inside a noexcept C++ destructor and
# the process aborts ("terminate called without an active exception",
# SIGABRT after a finished job). Held here, the last works are freed by the
# main thread. The last 8 are held (their buffers too: onebit's exchanges
# reuse fused buffers, so this holds little memory beside them); letting a
# work go as soon as a later collective starts after it finished measured
# worse (1 abort in 40 and in 60 runs, against 0 in 110).
_RECENT_COLLECTIVES: collections.deque = collections.deque(maxlen=8)


def start(phase: str, begin: Callable[[], "dist.Work"], timeout_s: Optional[float] = None,
          group=None) -> Pending:
    """Start an async collective with `begin()`; wait on the result, bounded."""
    t = default_timeout_s() if timeout_s is None else timeout_s
    try:
        pending = Pending(phase, begin(), t, group)
    except RuntimeError as exc:
        raise _failed(phase, t, group, exc) from exc
    hold_until_later(pending.work)
    return pending


def hold_until_later(work: "dist.Work") -> None:
    """Keep `work` referenced from Python until 8 later collectives replace
    it (see _RECENT_COLLECTIVES): for collectives started outside `start`."""
    _RECENT_COLLECTIVES.append(work)


def run(phase: str, begin: Callable[[], "dist.Work"], timeout_s: Optional[float] = None,
        group=None) -> None:
    """Start an async collective with `begin()` and wait for it, bounded."""
    start(phase, begin, timeout_s, group).wait()


ALLOW_NO_PROCESS_GROUP = "ONEBIT_ALLOW_NO_PROCESS_GROUP"


def is_distributed(name: str) -> bool:
    """Whether torch.distributed is initialised, for `name` (an optimizer or
    DiLoCo) deciding between its ranks and world size 1. A launcher that set
    WORLD_SIZE > 1 (torchrun, or a script's own environment) without a
    process group means a script that forgot init_process_group: each rank
    would train its own model and the job would end "successfully" with
    replicas that differ, so that is a ValueError, as DDP's. Setting
    $ONEBIT_ALLOW_NO_PROCESS_GROUP=1 runs at world size 1 anyway."""
    if dist.is_available() and dist.is_initialized():
        return True
    # mpirun sets its own variables, not WORLD_SIZE: a script under mpirun
    # that forgot init_distributed() must fail as one under torchrun does.
    launched = placement.world_size()
    if launched > 1 and os.environ.get(ALLOW_NO_PROCESS_GROUP) != "1":
        said = placement.world_size_variable()
        raise ValueError(
            f"{name}: {said}={launched} says this job has {launched} ranks, but no process group "
            "is initialised, so every rank would train a model of its own. Call "
            "torch.distributed.init_process_group() (or onebit.launch.init_distributed(), which "
            f"also joins mpirun jobs) before building it; to run one process alone anyway, set "
            f"{ALLOW_NO_PROCESS_GROUP}=1")
    return False


# A backend named without its device types serves the device it was made for.
_BACKEND_DEVICE = {"nccl": "cuda", "xccl": "xpu", "ccl": "xpu", "gloo": "cpu", "mpi": "cpu"}


def backend_config(group=None) -> str:
    """`group`'s backends by device type ("cpu:gloo,cuda:nccl"; older torch:
    its one backend's name): what a group made from it (dist.new_group's
    `backend`) must take, or it gets the world's."""
    return str(dist.get_backend_config(group) if hasattr(dist, "get_backend_config")
               else dist.get_backend(group))


def served_device_types(group=None) -> List[str]:
    """The device types whose tensors `group`'s collectives accept, from its
    backend config: "nccl" serves cuda alone, plain "gloo" both cpu and cuda,
    "cuda:gloo" cuda alone (which is how a CPU-only machine reproduces an
    NCCL group's refusal of host tensors)."""
    config = backend_config(group)
    types = []
    for entry in config.split(","):
        device, sep, backend = entry.strip().partition(":")
        types.append(device if sep else _BACKEND_DEVICE.get(device.lower(), "cpu"))
    return types


def stream_ordered(group=None) -> bool:
    """Whether `group`'s collectives finish on a device stream (nccl, xccl)
    rather than on the host (gloo, mpi)."""
    return any(t in ("cuda", "xpu") for t in served_device_types(group)) and not any(
        b in str(dist.get_backend(group)) for b in ("gloo", "mpi"))


def communication_device(group=None, data: Optional[torch.device] = None) -> torch.device:
    """The device every tensor onebit hands to `group`'s collectives lives on:
    `data`'s (the params' device) when the group serves it, so a rank that
    never called set_device still uses its own GPU rather than GPU 0, and
    host params over a gloo group in a GPU job stay on the host; else the accelerator's current device where the group serves
    it (an NCCL group: the GPU, never the host), else the host where it
    serves that, else the first device type it serves. The one place that
    decides it: side collectives (agreement, the piece tuner, telemetry,
    setup) ask here rather than use the host."""
    from .accelerator import get_accelerator

    served = served_device_types(group)
    if data is not None and data.type in served:
        return data
    acc = get_accelerator()
    if acc.name in served and acc.name != "cpu":
        return torch.device(acc.name, acc.current_device())
    if "cpu" in served:
        return torch.device("cpu")
    return torch.device(served[0])


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a small CPU tensor) on `device` without a host sync: through
    pinned memory and a non-blocking copy where the device is an accelerator
    (a pageable copy would wait for the stream), as it is on the host."""
    if device.type == "cpu":
        return host
    on_device = torch.empty_like(host, device=device)
    return on_device.copy_(host.pin_memory(), non_blocking=True)


# The construction broadcast's buckets: a model is never copied whole.
BROADCAST_BUCKET_BYTES = 64 << 20


def broadcast_from_first_rank(phase: str, tensors: List[torch.Tensor], group=None,
                              timeout_s: Optional[float] = None,
                              bucket_bytes: int = BROADCAST_BUCKET_BYTES) -> None:
    """Copy the group's first rank's values into `tensors` on every rank:
    bounded broadcasts on the group's communication device, each of a bucket
    of tensors of one dtype (in it, exactly) of at most `bucket_bytes` (a
    larger tensor is a bucket of its own), so the copy in flight is a bucket,
    not the model."""
    if not tensors:
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    device = communication_device(group)
    with torch.no_grad():
        for bucket in _buckets(tensors, bucket_bytes):
            flat = torch.cat([t.detach().reshape(-1) for t in bucket]).to(device)
            run(phase, lambda: dist.broadcast(flat, src=src, group=group, async_op=True),
                timeout_s, group)
            for t, v in zip(bucket, flat.split([t.numel() for t in bucket])):
                t.copy_(v.view_as(t))


def _buckets(tensors: List[torch.Tensor], bucket_bytes: int) -> List[List[torch.Tensor]]:
    """`tensors` in buckets of one dtype and at most `bucket_bytes`, in
    their order within each dtype (the same buckets on every rank)."""
    out: List[List[torch.Tensor]] = []
    open_bucket = {}  # dtype -> (bucket, bytes so far)
    for t in tensors:
        size = t.numel() * t.element_size()
        bucket, used = open_bucket.get(t.dtype, (None, 0))
        if bucket is None or used + size > bucket_bytes:
            bucket, used = [], 0
            out.append(bucket)
        bucket.append(t)
        open_bucket[t.dtype] = (bucket, used + size)
    return out


def gather_numbers(phase: str, values: list, dtype: torch.dtype, group=None,
                   timeout_s: Optional[float] = None,
                   device: Optional[torch.device] = None) -> List[list]:
    """Every rank's `values` (a few numbers, as many on each rank), one list
    per rank of `group`, through one bounded all-gather on the group's
    communication device (or `device`, the caller's own), and one host sync
    to read the result.

    A value may be a 0-dim tensor already on the device (a flag computed
    there): it joins the message on the device, never read on the host
    before the gather."""
    device = communication_device(group) if device is None else device
    mine = to_device(torch.tensor([0 if isinstance(v, torch.Tensor) else v for v in values],
                                  dtype=dtype), device)
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            mine[i] = v.to(device=device, dtype=dtype).reshape(())
    every = torch.empty(dist.get_world_size(group) * len(values), dtype=dtype, device=device)
    run(phase, lambda: all_gather_flat(every, mine, group=group, async_op=True), timeout_s, group)
    return every.view(-1, len(values)).tolist() if values else []


def stable_digest(value) -> int:
    """A non-negative int64 digest of repr(value), the same in every process
    (Python's own hash of a str is salted per process): what ranks compare
    to agree on a layout or a setting in one int64."""
    return int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:7], "little")
