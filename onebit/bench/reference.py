"""A float64 simulation of the compressed allreduce for the benchmark's
#wrong column: p ranks' inputs in, the exact output out. Deliberately plain
torch, sharing no code with onebit.backends, written from the wire format v2
rules: one scale per block of B elements over its real elements (the first
numel of the buffer), no error and no value at the padding; bf16 scales are
the fp32 scale rounded to nearest-even bf16."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch


def _sign(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, 1.0, -1.0).to(x.dtype)


def _compress(x: torch.Tensor, real: torch.Tensor, block: int,
              scale_dtype: torch.dtype) -> torch.Tensor:
    """s_b * sign(x) on the real elements of each block, 0 elsewhere."""
    xb, rb = (x * real).view(-1, block), real.view(-1, block)
    s = (xb.square().sum(1) / rb.sum(1).clamp_min(1)).sqrt()
    if scale_dtype != torch.float32:  # what the wire holds: fp32, then rounded again
        s = s.float().to(scale_dtype).double()
    return (s[:, None] * _sign(xb) * rb).reshape(-1)


def simulate(buffers: List[torch.Tensor], worker_errors: List[torch.Tensor],
             server_errors: List[torch.Tensor], block: int,
             real: Optional[torch.Tensor] = None,
             scale_dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """(output[numel], server values c[N]) for one compressed allreduce.
    `real` (default: the first numel of N) marks the elements that exist."""
    p, n, numel = len(buffers), worker_errors[0].numel(), buffers[0].numel()
    chunk = n // p
    if real is None:
        real = torch.zeros(n, dtype=torch.float64)
        real[:numel] = 1.0
    compressed = []
    for b, e in zip(buffers, worker_errors):
        x = e.double() * real
        x[:numel] += b.double().reshape(-1) * real[:numel]
        compressed.append(_compress(x, real, block, scale_dtype))
    out, c_all = torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.float64)
    for k in range(p):
        part = slice(k * chunk, (k + 1) * chunk)
        c = (torch.stack([w[part] for w in compressed]).mean(0) + server_errors[k].double()) * real[part]
        out[part] = _compress(c, real[part], block, scale_dtype)
        c_all[part] = c
    return out[:numel], c_all


def simulate_hierarchical(buffers: List[torch.Tensor], worker_errors: List[torch.Tensor],
                          server_errors: List[torch.Tensor], block: int,
                          nodes: List[List[int]],
                          scale_dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """The same for the hierarchical allreduce: each node's exact mean, then
    shard s (S = N/K of the buffer padded for K*M ranks) compressed among the
    nodes by their s-th ranks (whose errors are S and S/M long); one node:
    the exact mean. Ranks index `buffers` and the errors."""
    k, m, numel = len(nodes[0]), len(nodes), buffers[0].numel()
    unit = block * k * m
    n = max(unit, -(-numel // unit) * unit)
    s_len = n // k
    real = torch.zeros(n, dtype=torch.float64)
    real[:numel] = 1.0
    means = []
    for ranks in nodes:
        x = torch.zeros(n, dtype=torch.float64)
        x[:numel] = torch.stack([buffers[r].double().reshape(-1) for r in ranks]).mean(0)
        means.append(x)
    out, c = torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.float64)
    for s in range(k):
        part = slice(s * s_len, (s + 1) * s_len)
        if m == 1:
            out[part] = c[part] = means[0][part]
            continue
        members = [ranks[s] for ranks in nodes]
        o, cs = simulate([x[part] for x in means], [worker_errors[r] for r in members],
                         [server_errors[r] for r in members], block, real[part], scale_dtype)
        out[part], c[part] = o, cs
    return out[:numel], c


def count_wrong(result: torch.Tensor, expected: torch.Tensor, server_values: torch.Tensor,
                rtol: float = 1e-3, ulp: float = 0.0) -> int:
    """Elements off by more than rtol * max|expected| + ulp * |their expected
    value|, ignoring positions whose server value is within 1e-5 of that
    scale of zero (a fair coin toss in fp32)."""
    scale = expected.abs().max().item() if expected.numel() else 0.0
    decided = server_values[: expected.numel()].abs() > 1e-5 * scale
    off = (result.double().reshape(-1) - expected).abs() > rtol * scale + ulp * expected.abs()
    return int((off & decided).sum())
