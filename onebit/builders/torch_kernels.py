"""The sign-bit kernels in plain torch: the fallback on any device, and the
readable statement of what every native kernel must compute.

Interface shared by every kernels object (all tensors contiguous, one device;
`block` is a positive multiple of 8, and for the last two it divides n):
  pack(x, out)                          out[i] = packed signs of x, uint8[ceil(n/8)]
  decode(bits, scales, block, cols, out)
                                        out[j] = mean_r scales[r, j // block] * sign(bits[r], j);
                                        bits [rows, >= cols/8] may have a row stride;
                                        scales float32 [rows, ceil(cols/block)]
  compensate(buf, err, sumsq, block)    err <- x = buf (zero-padded to n) + err;
                                        sumsq[k] = sum of x^2 over block k (float64)
  pack_error(err, scales, block, out)   out = pack(err); err <- err - scales[k] * sign(err)
                                        (float32 scales, one per block)
Optional, where a kernel can fuse them (the CPU's):
  compress(buf, err, counts, block, scales_out, bits_out)
                                        compensate, the scales, pack_error in one pass;
                                        ops.compress composes the three elsewhere
  compress_rows(buf, err, counts, block, scales_out, bits_out)
                                        compress on each row of a 2-D err (row stride
                                        S; buf's row r at r * S), into message rows
  decode_rows(bits, scales, block, cols, out, stride)
                                        each row decoded on its own into out[r * stride:]
                                        (ops.compress_rows and ops.decode_rows say more;
                                        without them, ops calls the above once per row)
"""
from __future__ import annotations

import torch

_WEIGHTS = {}


def _bit_weights(device: torch.device) -> torch.Tensor:
    """uint8 [1, 2, 4, ..., 128]: bit j of a byte has weight 1 << j (little order)."""
    w = _WEIGHTS.get(device)
    if w is None:
        w = _WEIGHTS[device] = (1 << torch.arange(8, device=device)).to(torch.uint8)
    return w


def block_sumsq(x: torch.Tensor, block: int) -> torch.Tensor:
    """float64 sum of squares of each block of `x`, in the one order every
    kernel sums (so a scale has the same bits on any device): eight partial
    sums, partial j over elements j, j + 8, j + 16, ... in turn, then
    ((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7))."""
    squares = x.view(-1, block // 8, 8).double().square()
    part = squares[:, 0].clone()
    for i in range(1, block // 8):  # in turn: torch's sum has no fixed order
        part += squares[:, i]
    pairs = part[:, :4] + part[:, 4:]
    return (pairs[:, 0] + pairs[:, 1]) + (pairs[:, 2] + pairs[:, 3])


class TorchKernels:
    name = "torch"

    def pack(self, x: torch.Tensor, out: torch.Tensor) -> None:
        n = x.numel()
        nonneg = (x.reshape(-1) >= 0).to(torch.uint8)  # IEEE: -0.0 -> 1, NaN -> 0
        if n % 8:
            nonneg = torch.cat([nonneg, nonneg.new_zeros(8 - n % 8)])
        out.copy_((nonneg.view(-1, 8) * _bit_weights(x.device)).sum(1, dtype=torch.uint8))

    def signs(self, bits: torch.Tensor, cols: int) -> torch.Tensor:
        """float32 [rows, cols] of +-1 from uint8 [rows, >= ceil(cols/8)]."""
        rows = bits[:, : (cols + 7) // 8]
        b = (rows.unsqueeze(-1) & _bit_weights(bits.device)) != 0
        return b.reshape(rows.shape[0], -1)[:, :cols].to(torch.float32) * 2 - 1

    def decode(self, bits: torch.Tensor, scales: torch.Tensor, block: int, cols: int,
               out: torch.Tensor) -> None:
        signs = self.signs(bits, cols)
        per_element = scales.reshape(signs.shape[0], -1).repeat_interleave(block, dim=1)[:, :cols]
        # The rows added in order, as the wire's one order has it (the C++
        # and CUDA kernels): torch's sum(0) splits 5 or more rows over
        # several accumulators, and its last bits differed.
        acc = signs[0] * per_element[0]
        for r in range(1, signs.shape[0]):
            acc += signs[r] * per_element[r]
        out.copy_(acc * (1.0 / signs.shape[0]))

    def compensate(self, buf: torch.Tensor, err: torch.Tensor, sumsq: torch.Tensor,
                   block: int) -> None:
        err[: buf.numel()].add_(buf.reshape(-1))
        sumsq.copy_(block_sumsq(err, block))

    def pack_error(self, err: torch.Tensor, scales: torch.Tensor, block: int,
                   out: torch.Tensor) -> None:
        self.pack(err, out)
        s = scales.to(err.dtype).repeat_interleave(block)
        err.sub_(torch.where(err >= 0, s, -s))
