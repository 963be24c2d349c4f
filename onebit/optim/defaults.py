"""The hyper-parameters every onebit optimizer shares (Adam's), checked and
turned into param-group defaults."""
from __future__ import annotations

from ..checks import check, check_flag, check_number, is_number


def check_common(lr, betas, eps, weight_decay, max_grad_norm, amsgrad, cls_name) -> None:
    check_number("lr", lr)
    check("betas", betas, isinstance(betas, (tuple, list)) and len(betas) == 2
          and all(is_number(b) and 0.0 <= float(b) < 1.0 for b in betas),
          "a pair of finite numbers in [0, 1)")
    check_number("eps", eps)
    check_number("weight_decay", weight_decay)
    check_number("max_grad_norm", max_grad_norm)  # 0 disables clipping
    check_flag("amsgrad", amsgrad)
    if amsgrad:
        raise ValueError(f"{cls_name} does not support amsgrad=True: its variance is frozen "
                         "(or updated rarely), which is what the AMSGrad maximum would track")


def adam_defaults(cls_name, lr, betas, eps, weight_decay, max_grad_norm, amsgrad,
                  bias_correction, eps_inside_sqrt, **extra) -> dict:
    """Check the hyper-parameters every onebit optimizer shares and return
    them as param-group defaults (plus `extra`, already checked by the caller)."""
    check_common(lr, betas, eps, weight_decay, max_grad_norm, amsgrad, cls_name)
    check_flag("bias_correction", bias_correction)
    check_flag("eps_inside_sqrt", eps_inside_sqrt)
    return dict(lr=lr, betas=tuple(float(b) for b in betas), eps=eps, weight_decay=weight_decay,
                bias_correction=bias_correction, eps_inside_sqrt=eps_inside_sqrt,
                max_grad_norm=max_grad_norm, **extra)
