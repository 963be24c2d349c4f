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
