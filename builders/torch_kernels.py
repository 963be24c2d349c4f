"""The sign-bit kernels in plain torch: the fallback on any device, and the
readable statement of what every native kernel must compute.

Interface shared by every kernels object (all tensors contiguous, one device):
  pack(x, out)                          out[i] = packed signs of x, uint8[ceil(n/8)]
  decode(bits, scales, cols, out)       out[j] = mean_r scales[r] * sign(bits[r], j);
                                        bits [rows, >= cols/8] may have a row stride
  compensate_pack(buf, err, out, scale) err <- x = buf (zero-padded) + err;
                                        scale[0] = ||x|| / sqrt(n); out = pack(x);
                                        err <- x - scale * sign(x)
"""
from __future__ import annotations

import math

import torch

_WEIGHTS = {}


def _bit_weights(device: torch.device) -> torch.Tensor:
    """uint8 [1, 2, 4, ..., 128]: bit j of a byte has weight 1 << j (little order)."""
    w = _WEIGHTS.get(device)
    if w is None:
        w = _WEIGHTS[device] = (1 << torch.arange(8, device=device)).to(torch.uint8)
    return w


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

    def decode(self, bits: torch.Tensor, scales: torch.Tensor, cols: int, out: torch.Tensor) -> None:
        signs = self.signs(bits, cols)
        acc = (signs * scales.view(-1, 1)).sum(0)
        out.copy_(acc * (1.0 / signs.shape[0]))

    def compensate_pack(self, buf: torch.Tensor, err: torch.Tensor, out: torch.Tensor,
                        scale: torch.Tensor) -> None:
        n = err.numel()
        err[: buf.numel()].add_(buf.reshape(-1))
        norm = torch.linalg.vector_norm(err, dtype=torch.float64)
        scale.copy_((norm / math.sqrt(n)).to(torch.float32) if n else norm.new_zeros(()))
        self.pack(err, out)
        s = scale.to(err.dtype)
        err.sub_(torch.where(err >= 0, s, -s))
