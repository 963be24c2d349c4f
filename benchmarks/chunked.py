"""The pieces SparseLoCo and DeMo (benchmarks/anchors.py) share: a tensor cut
into chunks, the orthonormal DCT-II of each chunk, the top-k of each chunk,
the average of several workers' selections, the 2-bit quantizer, and what
the published wire formats send.

Chunks, as both papers' reference code cuts them: a 2-D (m, n) tensor into
h x w blocks, h and w the largest divisors of m and n that are at most 64
(64 x 64 = 4096 elements); any other tensor, flattened, into runs of the
largest divisor of its length that is at most 64. A chunked tensor is a
(chunks, chunk_len) matrix, a 2-D block's elements row-major.
"""
from __future__ import annotations

import math
from typing import Sequence, Tuple

import torch

CHUNK_SIDE = 64  # both papers' chunk side: 64 x 64 blocks, runs of 64


def largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of n that is <= limit (1 at worst)."""
    if n < 1 or limit < 1:
        raise ValueError(f"largest_divisor_at_most: n and limit must be >= 1, got {n}, {limit}")
    return next(d for d in range(min(n, limit), 0, -1) if n % d == 0)


def chunk_shape(shape: Sequence[int]) -> Tuple[int, ...]:
    """(h, w) for a 2-D tensor, (c,) for any other: one chunk's shape."""
    if len(shape) == 2:
        return (largest_divisor_at_most(shape[0], CHUNK_SIDE),
                largest_divisor_at_most(shape[1], CHUNK_SIDE))
    return (largest_divisor_at_most(math.prod(shape), CHUNK_SIDE),)


def to_chunks(x: torch.Tensor) -> torch.Tensor:
    """x as a (chunks, chunk_len) matrix (a copy for 2-D x)."""
    cs = chunk_shape(x.shape)
    if len(cs) == 1:
        return x.reshape(-1, cs[0])
    (m, n), (h, w) = x.shape, cs
    return x.reshape(m // h, h, n // w, w).permute(0, 2, 1, 3).reshape(-1, h * w)


def from_chunks(chunks: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The inverse of to_chunks: a tensor of `shape`."""
    cs = chunk_shape(shape)
    if len(cs) == 1:
        return chunks.reshape(shape)
    (m, n), (h, w) = shape, cs
    return chunks.reshape(m // h, n // w, h, w).permute(0, 2, 1, 3).reshape(m, n)


def dct_matrix(n: int, dtype=torch.float32) -> torch.Tensor:
    """The orthonormal DCT-II matrix D (n x n): X = D @ x, x = D.T @ X.
    D[k, i] = sqrt(2/n) cos(pi (2i + 1) k / 2n), row 0 times 1/sqrt(2)."""
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    d = math.sqrt(2.0 / n) * torch.cos(math.pi * (2 * i + 1) * k / (2 * n))
    d[0] /= math.sqrt(2.0)
    return d.to(dtype)


class ChunkDCT:
    """The orthonormal DCT-II of every chunk of a tensor of `shape`: 2-D
    for 2-D chunks (D_h B D_w^T), 1-D for runs; on (chunks, chunk_len)."""

    def __init__(self, shape: Sequence[int], dtype=torch.float32) -> None:
        self.chunk = chunk_shape(shape)
        self.mats = [dct_matrix(n, dtype) for n in self.chunk]

    def forward(self, chunks: torch.Tensor) -> torch.Tensor:
        if len(self.chunk) == 1:
            return chunks @ self.mats[0].T
        (h, w), (dh, dw) = self.chunk, self.mats
        return (dh @ chunks.reshape(-1, h, w) @ dw.T).reshape(-1, h * w)

    def inverse(self, coefficients: torch.Tensor) -> torch.Tensor:
        if len(self.chunk) == 1:
            return coefficients @ self.mats[0]
        (h, w), (dh, dw) = self.chunk, self.mats
        return (dh.T @ coefficients.reshape(-1, h, w) @ dw).reshape(-1, h * w)


def top_k(chunks: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(indices, values), each (chunks, k): the k entries of largest
    magnitude in each chunk (k clamped to the chunk's length)."""
    idx = chunks.abs().topk(min(k, chunks.shape[1]), dim=1).indices
    return idx, chunks.gather(1, idx)


def scatter(indices: torch.Tensor, values: torch.Tensor, chunk_len: int) -> torch.Tensor:
    """A (chunks, chunk_len) matrix holding `values` at `indices`, zeros elsewhere."""
    out = torch.zeros(indices.shape[0], chunk_len, dtype=values.dtype)
    return out.scatter_(1, indices, values)


def mean_of_selections(indices: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                       chunk_len: int) -> torch.Tensor:
    """Every worker's (indices, values), each (chunks, k), averaged: per
    position the mean over the workers that selected it, 0 where none did."""
    out = torch.zeros(indices[0].shape[0], chunk_len, dtype=values[0].dtype)
    return out.scatter_reduce_(1, torch.cat(list(indices), 1), torch.cat(list(values), 1),
                               "mean", include_self=False)


QUANT_BINS = 4  # 2 bits
QUANT_STEP_SIGMAS = 1.5  # SparseLoCo's step: 6 sigmas over 4 bins


def quantize_2bit(v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SparseLoCo's 2-bit quantizer of a 1-D tensor v: (codes int64 in
    0..3, mu, table (4,)). mu = mean(v), c = v - mu, step s = 1.5 x the
    unbiased std of c, code = clamp(round(c/s + 2), 0, 3); table[b] is the
    mean of the c in bin b (0 for an empty bin). dequantize_2bit inverts."""
    mu = v.mean()
    c = v - mu
    sigma = c.std() if v.numel() > 1 else torch.zeros((), dtype=v.dtype)
    step = QUANT_STEP_SIGMAS * sigma
    if not step > 0:  # all values equal: every c is 0, any step codes them exactly
        step = torch.ones((), dtype=v.dtype)
    codes = torch.round(c / step + QUANT_BINS // 2).clamp(0, QUANT_BINS - 1).long()
    sums = torch.zeros(QUANT_BINS, dtype=v.dtype).scatter_add_(0, codes, c)
    counts = torch.bincount(codes, minlength=QUANT_BINS).to(v.dtype)
    return codes, mu, sums / counts.clamp(min=1)


def dequantize_2bit(codes: torch.Tensor, mu: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table[codes] + mu


# ------------------------------------------------------ the wire formats --
def index_bits(chunk_len: int) -> int:
    """Bits of a position within a chunk: 12 for a 4096-element chunk."""
    return math.ceil(math.log2(chunk_len)) if chunk_len > 1 else 0


def sparseloco_k(chunk_len: int) -> int:
    """SparseLoCo's values per chunk: 64 of 4096 (density 1.56%), at least 1."""
    return max(1, round(chunk_len * CHUNK_SIDE / CHUNK_SIDE ** 2))


def sparseloco_payload_bytes(shapes: Sequence[Sequence[int]]) -> int:
    """What one worker contributes to a SparseLoCo round: per tensor, per
    selected value an index and a 2-bit code, plus mu and the 4-entry table
    in fp32; each tensor's bits rounded up to whole bytes."""
    total = 0
    for shape in shapes:
        chunk_len = math.prod(chunk_shape(shape))
        selected = math.prod(shape) // chunk_len * sparseloco_k(chunk_len)
        total += math.ceil(selected * (index_bits(chunk_len) + 2) / 8) + (1 + QUANT_BINS) * 4
    return total


def demo_payload_bytes(shapes: Sequence[Sequence[int]], k: int, value_bits: int) -> int:
    """What one worker contributes to a DeMo step: per tensor, per selected
    DCT coefficient an index and the value unquantized (value_bits, the
    params' dtype); each tensor's bits rounded up to whole bytes."""
    total = 0
    for shape in shapes:
        chunk_len = math.prod(chunk_shape(shape))
        selected = math.prod(shape) // chunk_len * min(k, chunk_len)
        total += math.ceil(selected * (index_bits(chunk_len) + value_bits) / 8)
    return total
