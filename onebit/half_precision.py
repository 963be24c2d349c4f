"""The full-precision exchanges in half precision: `communication_data_type`.

The optimizers average gradients in full precision during their warmup (and
0/1 Adam's variance steps, and for late joiners), through their own
all-reduce or the DDP hook. DeepSpeed's `communication_data_type` sends
that all-reduce in bf16 or fp16 instead: half the bytes. Each rank divides
its buffer by the world size in fp32 and rounds that share to the half
dtype; the all-reduce sums the shares (in the transport's order: every rank
receives the one result), and the sum is widened back to fp32.

bf16 has fp32's range and 8 bits of mantissa. fp16 has 11 bits but a range
of 65504 and flushes magnitudes below about 6e-8 to 0 (unscaled LM
gradients can be that small): bf16 is the safer choice. A share or sum
beyond fp16's range comes back inf, which `check_fp16_mean` turns into an
error on every rank.
"""
from __future__ import annotations

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def communication_dtype_from(value) -> torch.dtype:
    """torch.float32 for None, else float32 / bfloat16 / float16 from
    themselves or their names ("fp32", "bf16", "fp16", ...); a ValueError
    for anything else."""
    if value is None:
        return torch.float32
    dtype = _NAMES.get(value.lower()) if isinstance(value, str) else value
    if dtype not in DTYPES:
        raise ValueError(f"communication_data_type must be None, 'fp32', 'bf16' or 'fp16' "
                         f"(or the torch dtypes), got {value!r}")
    return dtype


def share(flat: torch.Tensor, world_size: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's share of the mean, to all-reduce: `flat` / world_size in
    fp32 (in place: `flat` is scratch until the mean is copied back), then
    rounded to `dtype`."""
    return flat.div_(world_size).to(dtype)


def check_fp16_mean(owner: str, wire: torch.Tensor) -> None:
    """A ValueError if an fp16 all-reduce overflowed: a rank's share or the
    sum beyond fp16's range came back inf, where no rank's gradient was
    (the ranks agreed on finite gradients before). Every rank holds the
    same result, so every rank raises. One host read, fp16 only."""
    if wire.dtype == torch.float16 and not bool(torch.isfinite(wire).all()):
        raise ValueError(f"{owner}: a rank's share of the gradient mean, or their sum, is beyond "
                         "float16's range (|x| > 65504) in the full-precision exchange "
                         "(communication_data_type='fp16'); no param or optimizer state "
                         "changed. Use 'bf16' (fp32's range) or 'fp32'")
