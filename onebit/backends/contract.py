"""What the optimizers need from a compressed backend: the contract every
backend meets, the flat ones (CompressedAllreduceBase's subclasses: gloo,
NCCL, MPI, a vendor's) and the hierarchical one alike.

A vendor's backend registered with `register_backend` is checked against
it when `get_backend` builds one, so a missing method is a TypeError
naming it there, not an AttributeError in the middle of a step.
"""
from __future__ import annotations

from typing import Protocol, Sequence, Tuple, runtime_checkable

import torch

from .stats import TrafficStats


@runtime_checkable
class CompressedAllreduce(Protocol):
    """A backend's public surface, as the optimizers use it.

    layout(sizes) returns an object with `numel` (the fused buffer's
    elements), `padded` (the errors' size), `sizes`, `key` (hashable) and
    `views(flat, shapes)`; compressed_allreduce takes that layout back.
    """

    name: str
    block_size: int  # elements per scale on the wire (onebit.wire)
    scale_dtype: torch.dtype
    stats: TrafficStats  # every compressed_allreduce's bytes and seconds

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def communication_device(self) -> torch.device: ...

    def layout(self, sizes: Sequence[int]): ...

    def error_sizes(self, numel: int) -> Tuple[int, int]: ...

    def error_ranges(self, layout, index: int) -> tuple: ...

    def compressed_allreduce(self, buffer_m: torch.Tensor, worker_error: torch.Tensor,
                             server_error: torch.Tensor, local_rank=None,
                             layout=None) -> torch.Tensor: ...


# Its attributes, properties and methods, read off the class above.
MEMBERS = tuple(sorted(set(CompressedAllreduce.__annotations__) | {
    n for n, v in vars(CompressedAllreduce).items()
    if not n.startswith("_") and (callable(v) or isinstance(v, property))}))


def missing_members(backend) -> list:
    """The members of CompressedAllreduce that `backend` lacks (empty if none)."""
    return [n for n in MEMBERS if not hasattr(backend, n)]
