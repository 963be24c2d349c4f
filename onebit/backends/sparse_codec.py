"""The sparse 2-bit code: top-k per block, 2-bit values, error feedback on the rest.

DiLoCo's `compression="sparse2bit"`, after SparseLoCo (Sarfi et al., 2025:
top-k of the pseudo-gradient per chunk, 2-bit values, error feedback). It
rides the compressed allreduce of base.py like the other codes: each
worker sends every server the top-k of its chunk, each server averages
what it received, adds its own error and sends the top-k of that to
everyone. What a phase leaves out stays in that phase's error and is sent
in a later round. Two phases keep a rank's bytes at about twice its
message whatever the world size, where an all-gather of every rank's
top-k (SparseLoCo's) grows with it.

Per block of B elements (B = block_size) the code has `keep` slots (k),
each an index into the block and a 2-bit value, and the block's scale:

- selection: the k elements of largest |x| among the nonzero ones, ties to
  the lower index; a block with fewer than k nonzero elements leaves slots
  unused (a block that is all zero stays zero);
- scale s: the mean |x| over the selected elements, in float64, rounded to
  fp32 and then to `scale_dtype` (0 when none is selected);
- value: bit 0 the sign (1: negative), bit 1 the magnitude (0: s, 1: 2 s),
  1 iff |x| > 1.5 s: the nearer of the two levels;
- slots hold the selected elements in ascending index order; an unused
  slot repeats the index of the slot before it and decodes to 0 (slot 0 is
  unused only when nothing is selected, and then s is 0);
- bytes: a bit stream per block, least significant bit first, of the k
  indices, w = ceil(log2 B) bits each, then the k value fields:
  ceil(k (w + 2) / 8) bytes. B = 4096, k = 64 (the defaults): 96 bytes
  of indices, then 16 of values (slot j in bits 2 j, 2 j + 1 of them).

The worker's error becomes x - decoded(x), so nothing is lost: what the
k values did not carry, and the rounding of the ones they did, are sent
later. Written in torch ops: DiLoCo exchanges once every H steps.
docs/design.md gives the wire format beside the others.
"""
from __future__ import annotations

import torch

from .. import ops
from ..collectives import stable_digest

# SparseLoCo's 64 x 64 chunk; on the benchmark LM the best of 256 to 16384
# for the loss at equal bytes (docs/benchmarks/frontier.md)
DEFAULT_BLOCK = 4096
DENSITY = 64  # elements per value sent by default: SparseLoCo's 64 of 4096, 1.56%
HIGH = 2.0  # the larger magnitude, in scales
SPLIT = 1.5  # |x| above SPLIT * s takes the larger one: the nearer level


def index_bits(block: int) -> int:
    """w: the bits of an index into a block of `block` elements."""
    return max(1, (block - 1).bit_length())


def default_keep(block: int) -> int:
    """Values sent per block by default: one per DENSITY elements."""
    return max(1, block // DENSITY)


def check_keep(keep: int, block: int) -> None:
    """A ValueError unless 1 <= keep <= block."""
    if not isinstance(keep, int) or isinstance(keep, bool) or not 1 <= keep <= block:
        raise ValueError(f"topk (values sent per block) must be an int from 1 to block_size="
                         f"{block}, got {keep!r}")


class SparseCodec:
    """Top-`keep` of each block of `block` elements, 2-bit values with the
    block's scale (the module doc gives the code and its bytes)."""

    name = "sparse2bit"
    bits = 2  # per value sent

    def __init__(self, block: int, keep: int) -> None:
        check_keep(keep, block)
        self.block, self.keep = block, keep
        self.width = index_bits(block)
        self.block_bytes = -(-keep * (self.width + 2) // 8)
        self.fingerprint = stable_digest(["sparse2bit", block, keep])

    def __repr__(self) -> str:
        return f"SparseCodec(block={self.block}, keep={self.keep})"

    def code_bytes(self, n: int) -> int:
        """Bytes of codes for n elements (whole blocks inside a message)."""
        return -(-n // self.block) * self.block_bytes

    def _check(self, block: int) -> None:
        if block != self.block:
            raise ValueError(f"this sparse code was made for blocks of {self.block} elements, "
                             f"got {block}")

    def compress(self, buf: torch.Tensor, err: torch.Tensor, counts: torch.Tensor, block: int,
                 scale_dtype: torch.dtype, scales_out: torch.Tensor,
                 codes_out: torch.Tensor) -> None:
        """Error feedback on one message: err <- x = buf (zero-padded to
        err.numel()) + err; per block the slots, the scale and the value
        fields of the module doc into codes_out and scales_out; err <- x -
        the decoded code. `counts` is not read: pads are zero, never selected."""
        self._check(block)
        x = err
        x[:buf.numel()] += buf.reshape(-1)
        blocks = x.view(-1, block)
        slots, used = self._select(blocks)
        values = blocks.gather(1, slots)
        magnitude = values.abs().double()
        count = used.sum(1)
        scale = (torch.where(used, magnitude, 0.0).sum(1) / count.clamp(min=1)).float()
        scale = scale.to(scale_dtype)
        scales_out.copy_(scale.view(torch.uint8).view(-1))
        s = scale.float()[:, None]
        high = used & (magnitude > SPLIT * s.double())
        negative = used & (values < 0)
        levels = _levels(s, high, negative, used)
        # Unused slots repeat a used index and add 0 there: exact in any order.
        blocks.scatter_add_(1, slots, -levels)
        fields = negative.to(torch.int64) | (high.to(torch.int64) << 1)
        codes_out.copy_(self._pack(slots, fields).view(-1))

    def _select(self, blocks: torch.Tensor):
        """(slots [blocks, k] int64, used [blocks, k] bool): the selected
        indices ascending, then unused slots repeating the last used one."""
        k, block = self.keep, self.block
        magnitude = blocks.abs()
        top = torch.topk(magnitude, k, dim=1)
        index, t = top.indices, top.values[:, -1:]
        # Among magnitudes equal to the k-th largest topk takes any; the code
        # takes the lowest indices. Blocks whose ties cross the k-th place
        # (rare in real data) are chosen again by that rule.
        crossing = ((magnitude == t).sum(1) > (top.values == t).sum(1)) & (t[:, 0] > 0)
        if bool(crossing.any()):
            index = index.clone()
            index[crossing] = _lowest_ties_first(magnitude[crossing], t[crossing], k)
        chosen = magnitude.gather(1, index) > 0  # zeros are never sent
        slots = torch.where(chosen, index, block).sort(dim=1).values
        used = slots < block
        last = (used.sum(1, keepdim=True) - 1).clamp(min=0)
        fill = torch.where(used.any(1, keepdim=True), slots.gather(1, last), 0)
        return torch.where(used, slots, fill), used

    def _pack(self, slots: torch.Tensor, fields: torch.Tensor) -> torch.Tensor:
        bits = torch.cat([_bits(slots, self.width), _bits(fields, 2)], 1)
        bits = torch.nn.functional.pad(bits, (0, self.block_bytes * 8 - bits.shape[1]))
        weights = 1 << torch.arange(8, device=bits.device)
        return (bits.view(bits.shape[0], -1, 8) * weights).sum(2).to(torch.uint8)

    def unpack(self, codes: torch.Tensor):
        """(slots, fields, used) of blocks' codes [blocks, block_bytes]."""
        shifts = torch.arange(8, dtype=torch.uint8, device=codes.device)
        bits = ((codes.view(codes.shape[0], -1, 1) >> shifts) & 1).view(codes.shape[0], -1)
        k, w = self.keep, self.width
        slots = _number(bits[:, :k * w].view(-1, k, w))
        fields = _number(bits[:, k * w:k * (w + 2)].view(-1, k, 2))
        used = torch.ones_like(slots, dtype=torch.bool)
        used[:, 1:] = slots[:, 1:] != slots[:, :-1]
        return slots, fields, used

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, nblocks: int) -> torch.Tensor:
        """One message's first `nblocks` blocks, decoded: fp32 [nblocks * block]."""
        slots, fields, used = self.unpack(codes[:nblocks * self.block_bytes].view(nblocks, -1))
        s = scales.reshape(-1)[:nblocks].float()[:, None]
        levels = _levels(s, fields >= 2, (fields & 1) == 1, used)
        out = torch.zeros(nblocks, self.block, dtype=torch.float32, device=codes.device)
        return out.scatter_add_(1, slots, levels).view(-1)

    def decode_mean(self, rows: torch.Tensor, scales: torch.Tensor, cols: int,
                    out: torch.Tensor, block: int) -> None:
        """out[j] = (sum over rows r, in order, of row r's decoded element j)
        * (1 / rows), j < cols: the order of the other codes' decode."""
        self._check(block)
        count = rows.shape[0]
        nblocks = -(-cols // block)
        scales = scales.reshape(count, -1)
        acc = torch.zeros(nblocks * block, dtype=torch.float32, device=out.device)
        for r in range(count):
            acc += self.decode(rows[r], scales[r], nblocks)
        out.copy_(acc[:cols] * (1.0 / count))

    def compress_rows(self, buf, err, counts, block, scale_dtype, messages, code_bytes) -> None:
        """`ops.compress_rows` for this code: a compress per row."""
        ops.compress_each_row(self.compress, buf, err, counts, block, scale_dtype, messages,
                              code_bytes)

    def decode_rows(self, rows, scales, cols, out, stride, block) -> None:
        """`ops.decode_rows` for this code: a one-row decode_mean per row."""
        ops.decode_each_row(self.decode_mean, rows, scales, cols, out, stride, block)


def _levels(s: torch.Tensor, high: torch.Tensor, negative: torch.Tensor,
            used: torch.Tensor) -> torch.Tensor:
    """fp32 [blocks, k]: +-s or +-2 s per slot, 0 where unused (exact in fp32)."""
    magnitude = torch.where(high, s * HIGH, s)
    return torch.where(used, torch.where(negative, -magnitude, magnitude), 0.0)


def _lowest_ties_first(magnitude: torch.Tensor, t: torch.Tensor, k: int) -> torch.Tensor:
    """[rows, k] indices: per row every element above t [rows, 1], the k-th
    largest magnitude, then the lowest indices equal to it, up to k."""
    above, at = magnitude > t, magnitude == t
    chosen = above | (at & (at.cumsum(1) <= k - above.sum(1, keepdim=True)))
    # Chosen element j goes to column (chosen before it); the rest to a
    # spare column k, dropped.
    place = torch.where(chosen, chosen.cumsum(1) - 1, k)
    index = torch.arange(magnitude.shape[1], device=magnitude.device).expand_as(magnitude)
    out = torch.zeros(magnitude.shape[0], k + 1, dtype=torch.int64, device=magnitude.device)
    return out.scatter_(1, place, index)[:, :k]


def _bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, m] non-negative ints -> [rows, m * width] bits, least significant first."""
    shifts = torch.arange(width, device=values.device)
    return ((values[:, :, None] >> shifts) & 1).view(values.shape[0], -1)


def _number(bits: torch.Tensor) -> torch.Tensor:
    """[rows, m, width] bits, least significant first -> [rows, m] int64."""
    weights = 1 << torch.arange(bits.shape[-1], device=bits.device)
    return (bits.to(torch.int64) * weights).sum(-1)
