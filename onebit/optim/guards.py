"""The zero-variance guard: what a 1-bit exchange must not move.

An element whose second moment v is exactly 0 has never seen a gradient that
reached the variance estimate: an embedding row whose token never came up, a
head or an expert that got no tokens, a parameter whose .grad was always None.
Its true momentum is 0, but a 1-bit exchange gives it +-scale, and the update
m / (sqrt(0) + eps) is then about scale / 1e-8: the model blows up. So:

- after every compressed exchange, m (0/1 Adam: the gradient, or the local
  displacement) is zeroed where v == 0 (DeepSpeed's `exp_avg_mask`, derived
  automatically);
- a tensor whose v is 0 everywhere is not updated at all, weight decay
  included, exactly as torch.optim.Adam skips a parameter without a gradient.

v is identical on every rank (it only ever sees averaged gradients), so every
rank makes the same decisions. While v is frozen the masks are computed once.
On FSDP2 shards (shards.py) "seen" is decided for the whole parameter, so
every shard of it decides alike: a shard whose part of v is all 0 while
another shard's is not is a partly seen tensor, masked everywhere.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

Tensors = List[torch.Tensor]
# A group's v, or a function giving it: a cache that hits never calls it.
Variances = Union[Tensors, Callable[[], Tensors]]


def resolved(exp_avg_sqs: Variances) -> Tensors:
    """The v list that `exp_avg_sqs` is or gives."""
    return exp_avg_sqs() if callable(exp_avg_sqs) else exp_avg_sqs


class ZeroVarianceGuard:
    """Per param group: which tensors have seen a gradient (`seen`), and a
    mask of the elements that have, for the tensors that are only partly
    seen (None for tensors seen everywhere or nowhere; see _mask)."""

    def __init__(self, whole_counts: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
                 ) -> None:
        # Sharded params: per-tensor counts of the local shards -> of the params.
        self.whole_counts = whole_counts
        self._cache: Dict[int, tuple] = {}

    def clear(self) -> None:
        self._cache.clear()

    def check(self, index: int, exp_avg_sqs: Variances,
              version) -> Tuple[List[bool], List[Optional[torch.Tensor]]]:
        """(seen, masks) for group `index`. `version` names the current v
        (None: v changes every step, so nothing is cached). One host sync
        per group when it is (re)computed. `exp_avg_sqs`: the group's v, or
        a function giving it, called only when the cache misses."""
        cached = self._cache.get(index)
        if version is not None and cached is not None and cached[0] == version:
            return cached[1], cached[2]
        exp_avg_sqs = resolved(exp_avg_sqs)
        local = torch.stack([torch.count_nonzero(v) for v in exp_avg_sqs]) if exp_avg_sqs else None
        counts = local.tolist() if local is not None else []
        whole = (self.whole_counts(local).tolist() if self.whole_counts is not None
                 and local is not None else counts)
        seen = [w > 0 for w in whole]
        masks = [_mask(v, c, cached=version is not None) if 0 < w and c < v.numel() else None
                 for c, w, v in zip(counts, whole, exp_avg_sqs)]
        if version is not None:
            self._cache[index] = (version, seen, masks)
        else:
            self._cache.pop(index, None)
        return seen, masks


# A tensor with at most 1/SPARSE of its elements unseen keeps their indices
# instead of a bool mask: zeroing them then costs in proportion to their
# number, not a pass over the tensor (dead ReLU rows, a few rare tokens).
SPARSE = 16


def _mask(v: torch.Tensor, nonzero: int, cached: bool) -> torch.Tensor:
    """The mask of a partly seen tensor: fp32 1.0 where v != 0 and 0.0
    elsewhere, or, when few are unseen and the mask is kept (nonzero() is a
    host sync), the (ndim, k) int64 indices of the elements where v == 0.

    fp32, not bool: multiplying an fp32 tensor by a bool mask converts the
    mask to fp32 on every call, which on the CPU costs twice the multiply
    itself (measured: 4.3 against 1.4 ms for 4M elements). Same products,
    4 bytes per element instead of 1."""
    if cached and (v.numel() - nonzero) * SPARSE <= v.numel():
        return torch.nonzero(v == 0).t().contiguous()
    return v.ne(0).to(torch.float32)


def mask_unseen_(tensors: Tensors, masks: Sequence[Optional[torch.Tensor]],
                 seen: Sequence[bool]) -> None:
    """Zero `tensors` where v == 0: the elements of partly seen tensors, and
    all of a tensor never seen. (Indexed zeroing writes +0 where the product
    would give -0 for a negative input: equal values, and m's only uses, the
    update and the next lerp, give the same bits either way.)"""
    for t, mask, ok in zip(tensors, masks, seen):
        if not ok:
            t.zero_()
        elif mask is None:
            continue
        elif mask.is_floating_point():
            t.mul_(mask)
        else:
            t.index_put_(tuple(mask), torch.zeros((), dtype=t.dtype, device=t.device))


def copy_masked_(out: Tensors, src: Tensors, masks: Sequence[Optional[torch.Tensor]],
                 seen: Sequence[bool]) -> None:
    """out <- src, then zeroed where v == 0 as by mask_unseen_, in one pass
    where the mask is dense (a multiply instead of a copy and a multiply):
    how an exchanged average lands in the optimizer's tensors."""
    plain = [(o, s) for o, s, k, ok in zip(out, src, masks, seen) if ok and k is None]
    if plain:
        torch._foreach_copy_([o for o, _ in plain], [s for _, s in plain])
    for o, s, k, ok in zip(out, src, masks, seen):
        if not ok:
            o.zero_()
        elif k is not None and k.is_floating_point():
            torch.mul(s, k, out=o)
        elif k is not None:
            o.copy_(s)
            mask_unseen_([o], [k], [ok])


def only_seen(seen: Sequence[bool], *lists: Sequence) -> Tuple[list, ...]:
    """Each list without the entries of tensors that never saw a gradient."""
    if all(seen):
        return tuple(list(xs) for xs in lists)
    return tuple([x for x, ok in zip(xs, seen) if ok] for xs in lists)


def only_unseen(seen: Sequence[bool], *lists: Sequence) -> Tuple[list, ...]:
    """Each list with only the entries only_seen leaves out."""
    return only_seen([not ok for ok in seen], *lists)
