"""Where tensors sit in the flat buffer of a compressed allreduce (wire format v2).

The buffer is cut into blocks of `block` elements and every block carries its
own scale, in both phases. Each tensor starts on a block boundary, so no block
mixes two tensors: a LayerNorm gain is never scaled by its neighbouring
embedding, and a block whose input is all zero stays exactly zero.

  layout = BlockLayout([t.numel() for t in tensors], block=256, world_size=p)
  layout.offsets[i]   where tensor i starts (a multiple of block)
  layout.numel        where the last tensor ends: the fused buffer's length
  layout.padded       N: a multiple of block * p, the worker error's size
  layout.counts       real elements in each of the N / block blocks

The positions that hold no element (`pads`: past a tensor's end up to the
next block boundary, and the padding up to N) are ignored on input, keep no
error and come back zero, so a block's scale is ||x|| / sqrt(real elements).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..wire import check_block_size


class BlockLayout:
    """Tensor-aligned blocks of a flat buffer (see the module docstring).

    sizes: numel of each tensor, in buffer order. padded: N, if the caller
    already has error buffers of that size (a multiple of block * world_size,
    at least `numel`); default the smallest such N.
    """

    def __init__(self, sizes: Sequence[int], block: int, world_size: int,
                 padded: Optional[int] = None) -> None:
        check_block_size(block)
        self.sizes = [int(s) for s in sizes]
        self.block, self.world_size = block, world_size
        self.offsets: List[int] = []
        end = 0
        for s in self.sizes:
            self.offsets.append(end)
            end += -(-s // block) * block
        self.numel = self.offsets[-1] + self.sizes[-1] if self.sizes else 0
        unit = block * world_size
        self.padded = max(unit, -(-end // unit) * unit) if padded is None else padded
        if self.padded % unit or self.padded < end:
            raise ValueError(f"a padded size of {self.padded} does not fit this layout: it needs "
                             f"a multiple of block_size*world_size={unit} that is at least {end}")
        self.chunk = self.padded // world_size
        real = torch.zeros(self.padded, dtype=torch.bool)
        for off, s in zip(self.offsets, self.sizes):
            real[off:off + s] = True
        counts = real.view(-1, block).sum(1, dtype=torch.float64)
        self._counts = counts.clamp_min_(1.0)  # an empty block has sum 0: any divisor gives 0
        self._pads = (~real).nonzero().view(-1)  # ascending
        self.inner_pads = int((self._pads < self.numel).sum())  # a prefix: pads ascend
        self._on: Dict[Tuple[str, torch.device, tuple], torch.Tensor] = {}

    @property
    def error_sizes(self) -> Tuple[int, int]:
        """(worker, server) error elements for this layout: N and N / p."""
        return self.padded, self.chunk

    @property
    def key(self) -> tuple:
        """What two ranks must agree on for their messages to line up."""
        return (self.padded, self.block, tuple(self.sizes))

    def _cached(self, name: str, device: torch.device, k: tuple, make) -> torch.Tensor:
        t = self._on.get((name, device, k))
        if t is None:
            t = self._on[(name, device, k)] = make().to(device)
        return t

    def counts(self, device: torch.device, lo: int = 0, hi: Optional[int] = None) -> torch.Tensor:
        """float64 real-element counts (at least 1) of the blocks in elements
        [lo, hi) (default: all N / block); lo and hi on block boundaries."""
        hi = self.padded if hi is None else hi
        return self._cached("counts", device, (lo, hi),
                            lambda: self._counts[lo // self.block:hi // self.block].clone())

    def pads(self, device: torch.device, lo: int = 0, hi: Optional[int] = None) -> torch.Tensor:
        """int64 pad positions in elements [lo, hi) (default: the whole
        buffer), relative to lo, ascending."""
        hi = self.padded if hi is None else hi
        return self._cached("pads", device, (lo, hi), lambda: self._pads[
            (self._pads >= lo) & (self._pads < hi)] - lo)

    def error_ranges(self, index: int, rank: int) -> Tuple[Optional[Tuple[int, int]],
                                                           Optional[Tuple[int, int]]]:
        """Where tensor `index` sits in rank `rank`'s (worker, server)
        errors, as (start, end) pairs, None where it has no element there:
        the worker error spans the whole buffer, the server error rank's
        chunk of it."""
        lo, hi = self.offsets[index], self.offsets[index] + self.sizes[index]
        base = rank * self.chunk
        s_lo, s_hi = max(lo, base), min(hi, base + self.chunk)
        return ((lo, hi) if lo < hi else None), ((s_lo - base, s_hi - base) if s_lo < s_hi else None)

    def views(self, flat: torch.Tensor, shapes: Sequence[torch.Size]) -> List[torch.Tensor]:
        """Each tensor's place in `flat`, shaped like it."""
        return [flat[o:o + s].view(shape) for o, s, shape in zip(self.offsets, self.sizes, shapes)]
