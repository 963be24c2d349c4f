"""Hyper-parameter checks shared by the onebit optimizers: one ValueError per
bad value, naming it, what it must be, and what it was."""
from __future__ import annotations

import torch

from ..backends.base import SCALE_DTYPES
from ..backends.layout import check_block_size  # noqa: F401 - re-exported for the optimizers


def _check(name: str, value, ok: bool, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def check_common(lr, betas, eps, weight_decay, max_grad_norm, amsgrad, cls_name) -> None:
    _check("lr", lr, isinstance(lr, (int, float)) and lr >= 0, "a number >= 0")
    _check("betas", betas, isinstance(betas, (tuple, list)) and len(betas) == 2
           and all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas),
           "a pair of numbers in [0, 1)")
    _check("eps", eps, isinstance(eps, (int, float)) and eps >= 0, "a number >= 0")
    _check("weight_decay", weight_decay, isinstance(weight_decay, (int, float))
           and weight_decay >= 0, "a number >= 0")
    _check("max_grad_norm", max_grad_norm, isinstance(max_grad_norm, (int, float))
           and max_grad_norm >= 0, "a number >= 0 (0 disables clipping)")
    if amsgrad:
        raise ValueError(f"{cls_name} does not support amsgrad=True: its variance is frozen "
                         "(or updated rarely), which is what the AMSGrad maximum would track")


def adam_defaults(cls_name, lr, betas, eps, weight_decay, max_grad_norm, amsgrad,
                  bias_correction, eps_inside_sqrt, **extra) -> dict:
    """Check the hyper-parameters every onebit optimizer shares and return
    them as param-group defaults (plus `extra`, already checked by the caller)."""
    check_common(lr, betas, eps, weight_decay, max_grad_norm, amsgrad, cls_name)
    return dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                bias_correction=bias_correction, eps_inside_sqrt=eps_inside_sqrt,
                max_grad_norm=max_grad_norm, **extra)


def scale_dtype_from(value) -> torch.dtype:
    """torch.float32 / torch.bfloat16, or their names ("float32", "bf16", ...)."""
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16}
    dtype = names.get(value.lower()) if isinstance(value, str) else value
    if dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be float32 or bfloat16, got {value!r}")
    return dtype


def check_flag(name: str, value) -> None:
    _check(name, value, isinstance(value, bool), "True or False")


def check_positive_int(name: str, value, minimum: int = 1) -> None:
    _check(name, value, isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
           f"an integer >= {minimum}")
