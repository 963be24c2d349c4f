"""DiLoCo's arguments, checked once when it is built.

`DiLoCoOptions` holds every setting DiLoCo(...) takes besides the model,
the inner optimizer and the process group, as `CommOptions` does for the
optimizers: one ValueError naming the argument, the expected and the
actual value, before anything is opened. `synced_params` checks the model
argument and picks the params the rounds sync.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple, Union

import torch

from .. import collectives
from ..checks import (check_each_parameter_once, check_flag, check_number, check_positive_int,
                      check_real)
from ..backends.codecs import codec_for
from ..backends import sparse_codec
from ..backends.sparse_codec import SparseCodec, check_keep
from ..wire import DEFAULT_BLOCK_SIZE, check_block_size, scale_dtype_from
from .misuse import DDP_MISUSE

COMPRESSIONS = ("1bit", "2bit", SparseCodec.name, "bf16", "none")


@dataclass(frozen=True)
class DiLoCoOptions:
    """How DiLoCo rounds go (see DiLoCo's docstring for each); checked when
    built. `timeout_s` is kept as collectives.check_timeout returns it."""

    sync_every: int
    outer_lr: Union[float, Callable[[int], float]] = 1.3
    outer_momentum: float = 0.0
    nesterov: bool = False
    compression: str = "1bit"
    warmup_steps: int = 0
    fragments: int = 1
    overlap_steps: int = 0
    keep_local_progress: float = 0.0
    fragment_update_alpha: float = 0.0
    timeout_s: Optional[float] = None
    block_size: Optional[int] = None  # the wire's default
    scale_dtype: object = "float32"
    topk: Optional[int] = None  # the sparse wire's default
    error_decay: float = 1.0

    def __post_init__(self) -> None:
        check_positive_int("sync_every", self.sync_every)
        check_positive_int("warmup_steps", self.warmup_steps, minimum=0)
        check_positive_int("fragments", self.fragments)
        check_positive_int("overlap_steps", self.overlap_steps, minimum=0)
        check_number("keep_local_progress", self.keep_local_progress, low=0.0, high=1.0)
        check_number("fragment_update_alpha", self.fragment_update_alpha, low=0.0, high=1.0)
        if self.keep_local_progress > 0 and self.fragment_update_alpha > 0:
            raise ValueError("DiLoCo: keep_local_progress and fragment_update_alpha each say "
                             "where a landing fragment goes: set one of them, not both")
        # A schedule is read at every landing; its first value is checked now.
        check_number("outer_lr", self.first_lr, low=0.0)
        check_number("outer_momentum", self.outer_momentum, high=1.0, high_open=True)
        check_flag("nesterov", self.nesterov)
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {list(COMPRESSIONS)}, "
                             f"got {self.compression!r}")
        if self.nesterov and self.outer_momentum == 0:
            raise ValueError("nesterov=True needs outer_momentum > 0 (as torch.optim.SGD)")
        sparse = self.compression == SparseCodec.name
        if self.block_size is None:
            object.__setattr__(self, "block_size", sparse_codec.DEFAULT_BLOCK if sparse
                               else DEFAULT_BLOCK_SIZE)
        check_block_size(self.block_size)
        if self.topk is None:
            object.__setattr__(self, "topk", sparse_codec.default_keep(self.block_size))
        check_keep(self.topk, self.block_size)
        check_number("error_decay", self.error_decay, low=0.0, high=1.0, low_open=True)
        object.__setattr__(self, "error_decay", float(self.error_decay))
        object.__setattr__(self, "timeout_s", collectives.check_timeout(self.timeout_s))
        object.__setattr__(self, "keep_local_progress", float(self.keep_local_progress))
        object.__setattr__(self, "fragment_update_alpha", float(self.fragment_update_alpha))

    @property
    def first_lr(self) -> float:
        """The outer lr the outer SGD is built with (a schedule's at step 0)."""
        return self.outer_lr(0) if callable(self.outer_lr) else self.outer_lr

    @property
    def codec(self):
        """The compressed allreduce's code (backends/codecs.py), None for
        rounds averaged in bf16 or fp32."""
        return codec_for(self.compression, self.block_size, self.topk)

    @property
    def wire_scale_dtype(self) -> torch.dtype:
        """The scales' dtype on the wire, from its name or dtype."""
        return scale_dtype_from(self.scale_dtype)

    @property
    def keeps_progress(self) -> bool:
        """Whether a landing adds local progress back: only an exchange that
        runs behind inner steps has any."""
        return self.keep_local_progress > 0 and self.overlap_steps > 0


def synced_params(model) -> Tuple[List[torch.Tensor], List[torch.Tensor], List[torch.Tensor]]:
    """All of `model`'s params (an nn.Module or an iterable of tensors), the
    ones the rounds sync (those that require grad now) and the others."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise ValueError(DDP_MISUSE)
    params = list(model.parameters() if isinstance(model, torch.nn.Module) else model)
    odd = next((p for p in params if not isinstance(p, torch.Tensor)), None)
    if odd is not None:
        raise ValueError(f"DiLoCo: model must be an nn.Module or an iterable of its "
                         f"parameters (tensors), got an element of type "
                         f"{type(odd).__name__} (for named_parameters(), pass "
                         f"model.parameters() or the model itself)")
    synced = [p for p in params if p.requires_grad]
    if not synced:
        raise ValueError("DiLoCo: no parameter requires grad")
    # A tensor listed twice would get two anchors and, in two fragments,
    # two outer steps a round.
    check_each_parameter_once("DiLoCo", synced)
    check_real("DiLoCo", synced)
    return params, synced, [p for p in params if not p.requires_grad]

