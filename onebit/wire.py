"""The wire format of the compressed allreduce, in one place: its version,
the block size and scale dtypes it may carry, and the checks on them.

Every rank must use the same format (the optimizers' construction
fingerprint compares the version; the backend compares block size and
scale bytes per layout), and a per-rank error-feedback checkpoint is
loaded only under the version it was saved with. docs/design.md describes
the bytes themselves.

Version 2: one scale per block of `block_size` elements, little-endian
fp32 or bf16 (the top half of the fp32), after the block's packed signs.
"""
from __future__ import annotations

import torch

WIRE_FORMAT_VERSION = 2
DEFAULT_BLOCK_SIZE = 256  # elements per scale
DEFAULT_SCALE_DTYPE = torch.float32
SCALE_DTYPES = (torch.float32, torch.bfloat16)
_SCALE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                "bf16": torch.bfloat16}


# The full-precision exchanges (warmup, variance steps, late joiners) may go
# out in half precision: DeepSpeed's `communication_data_type`.
AVERAGING_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_AVERAGING_NAMES = {**_SCALE_NAMES, "float16": torch.float16, "fp16": torch.float16}


def averaging_dtype_from(value) -> torch.dtype:
    """The dtype of the full-precision exchanges: torch.float32 for None, else
    float32 / bfloat16 / float16 from themselves or their names ("fp32",
    "bf16", "fp16", ...); a ValueError for anything else."""
    if value is None:
        return torch.float32
    dtype = _AVERAGING_NAMES.get(value.lower()) if isinstance(value, str) else value
    if dtype not in AVERAGING_DTYPES:
        raise ValueError(f"communication_data_type must be None, 'fp32', 'bf16' or 'fp16' "
                         f"(or the torch dtypes), got {value!r}")
    return dtype


def check_half_mean(owner: str, wire: torch.Tensor) -> None:
    """A ValueError if an fp16 exchange's result overflowed: a mean beyond
    fp16's range became inf, which no rank's gradient was (the ranks agreed
    on finite gradients before). The result is the same on every rank, so
    every rank raises, before the mean reaches any gradient. One host read,
    fp16 only: bf16 has fp32's range."""
    if wire.dtype == torch.float16 and not bool(torch.isfinite(wire).all()):
        raise ValueError(f"{owner}: a gradient's mean is beyond float16's range (|x| > 65504) "
                         "in the full-precision exchange (communication_data_type='fp16'); "
                         "nothing was updated. Use 'bf16' (fp32's range) or 'fp32'")


def check_block_size(block: int) -> None:
    """A ValueError unless `block` is a positive multiple of 8 (whole bytes of signs)."""
    if not isinstance(block, int) or isinstance(block, bool) or block < 8 or block % 8:
        raise ValueError(f"block_size must be a positive multiple of 8 (whole bytes of signs), "
                         f"got {block!r}")


def scale_dtype_from(value) -> torch.dtype:
    """torch.float32 / torch.bfloat16 from themselves or their names
    ("float32", "fp32", "bfloat16", "bf16"); a ValueError for anything else."""
    dtype = _SCALE_NAMES.get(value.lower()) if isinstance(value, str) else value
    if dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be float32 or bfloat16 (or their names), "
                         f"got {value!r}")
    return dtype
