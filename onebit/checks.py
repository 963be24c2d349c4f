"""Argument checks shared by the optimizers and DiLoCo: one ValueError per
bad value, naming it, what it must be, and what it was."""
from __future__ import annotations

import math
import numbers

import torch


def check(name: str, value, ok: bool, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def is_number(value) -> bool:
    """A finite real number, as torch.optim accepts them: Python and numpy
    ints and floats, and one-element tensors (what a capturable lr is: 0-dim
    or of shape [1]). bool is not a number here: `lr=True` is a mistake."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and value.is_floating_point() and bool(torch.isfinite(value))
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(float(value)))


def check_number(name: str, value, low: float = 0.0, high: float = math.inf,
                 high_open: bool = False, low_open: bool = False) -> None:
    """A finite number in [low, high] (either end open when asked)."""
    ok = is_number(value)
    if ok:
        x = float(value)
        ok = (x > low if low_open else x >= low) and (x < high if high_open else x <= high)
    span = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    check(name, value, ok, f"a finite number in {span}")


def check_flag(name: str, value) -> None:
    check(name, value, isinstance(value, bool), "True or False")


def check_positive_int(name: str, value, minimum: int = 1) -> None:
    check(name, value, isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
          f"an integer >= {minimum}")


def check_real(name: str, params) -> None:
    """A ValueError for a complex parameter.
    The state is fp32 and the 1-bit wire carries real signs: a complex
    parameter would lose its imaginary part at the first step with nothing
    but a cast warning (torch's optimizers step its view_as_real)."""
    for i, p in enumerate(params):
        if p.is_complex():
            raise ValueError(
                f"{name}: param {i} {tuple(p.shape)} has dtype {p.dtype}; onebit trains real "
                "params only (for a complex one, register "
                "torch.view_as_real(p) as the parameter and view it back in forward)")


def check_each_parameter_once(name: str, params) -> None:
    """A ValueError for a parameter listed twice in one group. torch.optim
    only warns and then updates it twice per step; here the two entries
    would also be exchanged twice, with their error feedback and momentum
    counted twice, and the training diverges without a word."""
    first = {}
    for i, p in enumerate(params):
        if id(p) in first:
            raise ValueError(
                f"{name}: param {i} {tuple(p.shape)} is the same tensor as param {first[id(p)]}; "
                "list each parameter once (model.parameters() already lists a tied weight "
                "once; for a list of your own, list(dict.fromkeys(params)))")
        first[id(p)] = i
