"""The communication options every onebit optimizer takes, keyword-only.

Each optimizer lists them after a `*` in its signature (so DeepSpeed
configs and `inspect.signature` see them), hands them to the base class as
one `CommOptions`, and documents them through one shared fragment,
`COMM_OPTIONS_DOC`, appended to its docstring: the torch.optim way of
documenting `foreach` or `capturable` once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import collectives
from ..checks import check_flag, check_number, check_positive_int
from ..half_precision import communication_dtype_from
from ..wire import DEFAULT_BLOCK_SIZE, check_block_size, scale_dtype_from


@dataclass(frozen=True)
class CommOptions:
    """How an optimizer talks to the other ranks; checked when built."""

    cuda_aware: bool = False
    comm_backend_name: Optional[str] = None
    process_group: object = None
    timeout_s: Optional[float] = None
    check_replicas_every: int = 0
    block_size: int = DEFAULT_BLOCK_SIZE
    scale_dtype: object = "float32"
    overlap_backward: bool = False
    bucket_cap_mb: float = 25.0
    communication_data_type: object = None

    def __post_init__(self) -> None:
        check_positive_int("check_replicas_every", self.check_replicas_every, minimum=0)
        check_flag("cuda_aware", self.cuda_aware)
        collectives.check_timeout(self.timeout_s)
        check_block_size(self.block_size)
        check_flag("overlap_backward", self.overlap_backward)
        check_number("bucket_cap_mb", self.bucket_cap_mb, low=0.0, low_open=True)
        communication_dtype_from(self.communication_data_type)

    @property
    def wire_scale_dtype(self) -> torch.dtype:
        """The scales' dtype on the wire, from its name or dtype."""
        return scale_dtype_from(self.scale_dtype)

    @property
    def averaging_dtype(self) -> torch.dtype:
        """The dtype the full-precision exchanges travel in."""
        return communication_dtype_from(self.communication_data_type)


COMM_OPTIONS_DOC = """
    Communication options (keyword-only, the same for every onebit optimizer):
      comm_backend_name: 'compressed' (torch.distributed), 'hierarchical'
        (full precision inside a node, 1 bit between nodes), 'mpi',
        'mpi_hierarchical', or a registered name; None asks the accelerator
        (`onebit_backend()`: 'hierarchical' on several nodes of several ranks).
      cuda_aware: for comm_backend_name='mpi': pass device buffers to MPI.
      process_group: the data-parallel group (default: world). With FSDP2
        shards, the mesh's replicate group (docs/sharding.md).
      timeout_s: deadline of every collective (default $ONEBIT_TIMEOUT_S or
        300 s); a dead or hung peer raises CommunicationError naming the phase.
      check_replicas_every: every K steps, compare checksums of all params and
        state across ranks and raise ReplicaDivergenceError naming the first
        tensor that differs (0: off; costs one small all-gather).
      block_size: elements per scale in the compressed exchange (a multiple
        of 8; default 256). Each tensor starts on its own blocks. Smaller
        blocks follow the data more closely and send more scale bytes.
      scale_dtype: "float32" (default) or "bfloat16": the scales on the wire.
      overlap_backward: start each bucket's compressed exchange during
        backward, as soon as its gradients are accumulated; step() updates
        each bucket's params as soon as its exchange is back, while the
        later ones are still on the wire (onebit/optim/overlap.py): the same
        bits as without. Needs max_grad_norm=0; with gradient accumulation,
        run all but the last micro-batch inside
        `with optimizer.no_overlap():`.
      bucket_cap_mb: the size of those buckets (fp32 MB), as DDP's.
      communication_data_type: None or "fp32" (default), "bf16" or "fp16":
        the dtype of the full-precision exchanges -- the warmup before the
        freeze, 0/1 Adam's variance steps, late joiners, and the DDP hook's
        all-reduce in those steps -- as DeepSpeed's key of that name. Half
        precision halves the warmup's bytes and rounds each rank's share
        (gradient / world size) to it before the sum; the 1-bit exchange
        is unchanged. Prefer bf16 (fp32's range, 8 bits of mantissa); fp16
        flushes shares below about 6e-8 to 0 and raises on a share or sum
        beyond 65504 (onebit/half_precision.py).
"""


def documents_comm_options(cls):
    """Class decorator: the shared fragment at the end of `cls`'s docstring."""
    cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n" + COMM_OPTIONS_DOC
    return cls
