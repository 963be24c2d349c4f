"""What one element of a compressed message carries: the codec.

The compressed allreduce (base.py) moves message rows of codes followed by
one scale per block, and keeps what the codes missed in its worker and
server errors. The codec is the code itself:

- `SignCodec` ("1bit", every optimizer and DiLoCo's default): 1 bit per
  element, the sign, with the block's scale ||x|| / sqrt(count): the
  sign-bit kernels of `onebit.ops` on every accelerator.
- `TernaryCodec` ("2bit", DiLoCo's `compression="2bit"`): 2 bits per
  element, -1, 0 or +1 times the block's scale, after Ternary Weight
  Networks (Li and Liu, 2016): elements whose magnitude passes 0.7 times
  the block's mean magnitude keep their sign, the rest send 0, and the
  scale is the mean magnitude of those kept. Zeros let the code follow a
  block whose few large values the 1-bit code would smear over all of
  it. Written in torch ops (DiLoCo exchanges once every H steps).
- `SparseCodec` ("sparse2bit", sparse_codec.py): the top-k of each block,
  an index and 2 bits each, with the block's scale.

docs/design.md gives the wire formats.
"""
from __future__ import annotations

import torch

from .. import ops
from .sparse_codec import SparseCodec

# The ternary code's field values (2 bits each, element 4 i + j in bits
# 2 j, 2 j + 1 of byte i): 0 sends 0, PLUS sends +scale, MINUS -scale.
PLUS, MINUS = 1, 2
TERNARY_THRESHOLD = 0.7  # times the block's mean magnitude (Li and Liu's Delta)


class SignCodec:
    """1 bit per element: the sign (bit 1 iff x >= 0), scale ||x|| / sqrt(count)."""

    name = "1bit"
    bits = 1
    fingerprint = 1  # what ranks compare when they agree on a layout

    @staticmethod
    def code_bytes(n: int) -> int:
        """Bytes of codes for n elements (n a multiple of 8 inside a message)."""
        return (n + 7) // 8

    @staticmethod
    def compress(buf, err, counts, block, scale_dtype, scales_out, codes_out) -> None:
        ops.compress(buf, err, counts, block, scale_dtype, scales_out, codes_out)

    @staticmethod
    def decode_mean(rows, scales, cols, out, block) -> None:
        ops.decode_mean(rows, scales, cols, out, block)

    @staticmethod
    def compress_rows(buf, err, counts, block, scale_dtype, messages, code_bytes) -> None:
        ops.compress_rows(buf, err, counts, block, scale_dtype, messages, code_bytes)

    @staticmethod
    def decode_rows(rows, scales, cols, out, stride, block) -> None:
        ops.decode_rows(rows, scales, cols, out, stride, block)


class TernaryCodec:
    """2 bits per element: -1, 0 or +1 times the block's scale (see the module doc)."""

    name = "2bit"
    bits = 2
    fingerprint = 2

    @staticmethod
    def code_bytes(n: int) -> int:
        return (n + 3) // 4

    @staticmethod
    def compress(buf: torch.Tensor, err: torch.Tensor, counts: torch.Tensor, block: int,
                 scale_dtype: torch.dtype, scales_out: torch.Tensor,
                 codes_out: torch.Tensor) -> None:
        """Error feedback on one message, as ops.compress does for signs:
        err <- x = buf (zero-padded to err.numel()) + err; per block,
        threshold t = 0.7 * sum|x| / counts[k] and scale s = the mean of
        |x| over the elements with |x| > t (0 if none), both in float64, s
        rounded to fp32 and then to `scale_dtype`; codes: sign(x) where |x|
        > t, else 0; err <- x - s * code, with the rounded s."""
        x = err
        x[:buf.numel()] += buf.reshape(-1)
        blocks = x.view(-1, block)
        magnitude = blocks.abs().double()
        threshold = TERNARY_THRESHOLD * (magnitude.sum(1) / counts)
        kept = magnitude > threshold[:, None]
        scale = (torch.where(kept, magnitude, 0.0).sum(1) / kept.sum(1).clamp(min=1))
        scale = scale.float().to(scale_dtype)
        scales_out.copy_(scale.view(torch.uint8).view(-1))
        s = scale.float()[:, None]
        plus, minus = kept & (blocks >= 0), kept & (blocks < 0)
        blocks.copy_(torch.where(plus, blocks - s, torch.where(minus, blocks + s, blocks)))
        fields = plus.to(torch.uint8) * PLUS + minus.to(torch.uint8) * MINUS
        codes_out.copy_(pack_fields(fields.view(-1)))

    @staticmethod
    def decode_mean(rows: torch.Tensor, scales: torch.Tensor, cols: int, out: torch.Tensor,
                    block: int) -> None:
        """out[j] = (sum over rows r, in order, of scales[r, j // block] *
        code(r, j)) * (1 / rows), j < cols: the sign decode's order."""
        count = rows.shape[0]
        nblocks = -(-cols // block)
        scales = scales.reshape(count, nblocks)
        acc = torch.zeros(nblocks * block, dtype=torch.float32, device=out.device)
        for r in range(count):
            fields = unpack_fields(rows[r, :TernaryCodec.code_bytes(cols)])
            fields = torch.nn.functional.pad(fields, (0, nblocks * block - fields.numel()))
            s = scales[r].view(-1, 1).expand(nblocks, block).reshape(-1)
            acc += torch.where(fields == PLUS, s, torch.where(fields == MINUS, -s, 0.0))
        out.copy_(acc[:cols] * (1.0 / count))


    @staticmethod
    def compress_rows(buf, err, counts, block, scale_dtype, messages, code_bytes) -> None:
        """`ops.compress_rows` for this code: a compress per row (DiLoCo
        exchanges once every H steps; torch ops, no kernel to fuse)."""
        ops.compress_each_row(TernaryCodec.compress, buf, err, counts, block, scale_dtype,
                              messages, code_bytes)

    @staticmethod
    def decode_rows(rows, scales, cols, out, stride, block) -> None:
        """`ops.decode_rows` for this code: a one-row decode_mean per row."""
        ops.decode_each_row(TernaryCodec.decode_mean, rows, scales, cols, out, stride, block)


def pack_fields(fields: torch.Tensor) -> torch.Tensor:
    """uint8 2-bit fields (numel a multiple of 4) -> bytes, field 4 i + j in
    bits 2 j and 2 j + 1 of byte i."""
    f = fields.view(-1, 4)
    return f[:, 0] | (f[:, 1] << 2) | (f[:, 2] << 4) | (f[:, 3] << 6)


def unpack_fields(codes: torch.Tensor) -> torch.Tensor:
    """Bytes -> their 2-bit fields, four per byte in pack_fields's order."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=codes.device)
    return ((codes.view(-1, 1) >> shifts) & 3).view(-1)


CODECS = {c.name: c for c in (SignCodec, TernaryCodec)}


def codec_for(name: str, block: int, keep: int):
    """The code called `name` ("1bit", "2bit" or "sparse2bit"), None for
    any other (a full-precision average); the sparse code for `block`-element
    blocks, `keep` values sent per block."""
    if name == SparseCodec.name:
        return SparseCodec(block, keep)
    return CODECS.get(name)
