"""Ranks that must agree, and the checks that make them: the construction
fingerprint (shapes, requires_grad, hyper-parameters, backend, wire format),
the per-step agreement on which params train and on skipping a non-finite
step, and the replica divergence guard. Each failure is a ValueError (or
ReplicaDivergenceError) on every rank, raised before anything changed."""
from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from .. import collectives
from ..backends.base import WIRE_FORMAT_VERSION, stable_digest


class ReplicaDivergenceError(RuntimeError):
    """The divergence guard found ranks whose parameters or state differ."""


def check_params_served(name: str, param_groups, group) -> None:
    """Every parameter must live where the process group's collectives take
    tensors (an NCCL group takes no host tensors): a ValueError naming the
    first that does not, before any collective, instead of a transport error
    deep inside the first step."""
    served = collectives.served_device_types(group)
    for gi, g in enumerate(param_groups):
        for pi, p in enumerate(g["params"]):
            if p.device.type not in served:
                raise ValueError(
                    f"{name}: param {pi} of group {gi} {tuple(p.shape)} is on {p.device}, but the "
                    f"process group ({dist.get_backend(group)}) takes tensors on "
                    f"{' or '.join(served)} only: move the model there first (model.to(device)) "
                    "or initialise the process group with a backend for that device")


class RankAgreement:
    """The agreement half of OnebitOptimizer."""

    def _nonfinite_flag(self, grads_by_group: List[List[torch.Tensor]]) -> torch.Tensor:
        """1 (a 0-dim int64 tensor on the communication device) where a
        GradScaler saw inf/NaN or a gradient holds a NaN or an inf (or values
        beyond ~1e19, which count as overflow): a tensor's 2-norm is NaN or
        inf iff it does, in one pass with no temporaries, 5x faster here than
        the max-norm. Decided on the device: no host sync."""
        flag = torch.zeros((), dtype=torch.int64, device=self.comm_device)
        live = [t for g in grads_by_group for t in g if t.numel()]
        if live:
            norms = torch.stack([n.to(self.comm_device) for n in torch._foreach_norm(live)])
            flag |= ~torch.isfinite(norms).all()
        found = getattr(self, "found_inf", None)
        if found is not None:
            flag |= (found.to(self.comm_device) > 0).reshape(())
        return flag

    def _skip_for_nonfinite(self, grads_by_group: List[List[torch.Tensor]]) -> bool:
        """Whether this step must be skipped: a GradScaler saw inf/NaN, or a
        gradient is not finite, on any rank. Without a GradScaler, non-finite
        gradients raise on every rank before anything changes. The same
        collective checks that the ranks train the same params. The flag
        stays on the device until the gathered table comes back: one host
        sync in all."""
        flag = self._nonfinite_flag(grads_by_group)
        if self.world_size > 1:
            # Third column: a bucket exchanged during backward must be done
            # again (overlap.py); every rank then redoes it, or none.
            table = self._gather_int64("agreeing on the trainable params and on skipping a "
                                       "non-finite step", [flag, self._trainable_digest,
                                                           int(self._overlap_stale())])
            self._agree_overlap_stale(any(row[2] for row in table))
            if len({row[1] for row in table}) > 1:
                raise ValueError(
                    f"{type(self).__name__}: ranks disagree on which parameters require grad "
                    f"at step {self.counters['step'] + 1}; nothing was updated. This rank "
                    f"({dist.get_rank(self.process_group)}) trains {self._trainable_summary()}. "
                    "Freeze and unfreeze the same parameters on every rank, at the same step")
            bad = any(row[0] for row in table)
        else:
            bad = bool(flag)
        if bad and getattr(self, "found_inf", None) is None:
            raise ValueError(f"{type(self).__name__}: NaN or Inf gradient at step "
                             f"{self.counters['step'] + 1} on at least one rank; nothing was "
                             "updated (use torch.amp.GradScaler to skip such steps)")
        return bad

    def _trainable_summary(self) -> str:
        return "; ".join(f"group {i}: {sum(p.requires_grad for p in g['params'])} of "
                         f"{len(g['params'])} params" for i, g in enumerate(self.param_groups))

    def _notice_trainable_changes(self) -> None:
        """Keep the digest of which params train (requires_grad) current; when
        it changes (layers frozen or unfrozen, a param group added), forget
        everything laid out for the old set: flat buffers, error-feedback
        buffers (they restart from zero), cached denominators and guards,
        graphs."""
        # 0: frozen, 1: trained, 2: a late joiner in its own warmup (late.py)
        signature = [[p.requires_grad + (p.requires_grad and self._is_late(p)) for p in g["params"]]
                     for g in self.param_groups]
        if signature == self._trainable_signature:
            return
        if self._trainable_signature is not None:
            self._forget_layouts()
        self._trainable_signature = signature
        self._trainable_digest = stable_digest(signature)

    def _gather_int64(self, phase: str, values: list) -> List[List[int]]:
        """Every rank's `values` (ints, or 0-dim tensors on the communication
        device), one list per rank, in one bounded all-gather."""
        return collectives.gather_numbers(f"{type(self).__name__}: {phase}", values, torch.int64,
                                          self.process_group, self.timeout_s)

    def _check_ranks_agree(self, settings: dict) -> None:
        """Construction-time fingerprint (one small all-gather): every rank
        must build the same optimizer, or the collectives would mismatch."""
        groups = [{k: (tuple(v.shape) if isinstance(v, torch.Tensor) else v)
                   for k, v in g.items() if k != "params"} for g in self.param_groups]
        fields = {
            "parameter shapes/order/requires_grad": [
                [(tuple(p.shape), str(p.dtype), p.requires_grad) for p in g["params"]]
                for g in self.param_groups],
            "hyper-parameters": (type(self).__name__, sorted(settings.items()),
                                 [sorted(g.items()) for g in groups]),
            "compressed backend": self.comm_backend_name,
            "wire format version": WIRE_FORMAT_VERSION,
        }
        digest = [stable_digest(v) for v in fields.values()]
        table = self._gather_int64("construction fingerprint", digest)
        bad = [name for j, name in enumerate(fields) if len({row[j] for row in table}) > 1]
        if bad:
            rank = dist.get_rank(self.process_group)
            raise ValueError(f"{type(self).__name__}: ranks disagree on {', '.join(bad)}; "
                             f"this rank ({rank}) has " + "; ".join(
                                 f"{b} = {fields[b]!r}"[:400] for b in bad))

    def _replicas_should_match(self, step: int) -> bool:
        """Whether all replicas are identical after `step` (0/1 Adam: only after a sync)."""
        return True

    def _check_replicas(self, step: int) -> None:
        """Divergence guard: compare a checksum of every parameter and state
        tensor across ranks; raise naming the first that differs."""
        names, sums = [], []
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                tensors = [("value", p.detach())] + sorted(
                    (k, v) for k, v in self.state.get(p, {}).items() if isinstance(v, torch.Tensor))
                for name, t in tensors:
                    raw = t.contiguous().view(-1).view(torch.uint8)
                    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
                    names.append(f"group {gi} param {pi} {tuple(p.shape)} {name}")
                    sums.append(int(words.sum(dtype=torch.int64)))
        if not sums:
            return
        table = self._gather_int64("replica divergence check", sums)
        for j, name in enumerate(names):
            column = [row[j] for row in table]
            if len(set(column)) > 1:
                odd = [r for r, v in enumerate(column) if v != column[0]]
                raise ReplicaDivergenceError(
                    f"{type(self).__name__}: replicas diverged by step {step}: {name} differs "
                    f"on rank(s) {odd} from rank 0")
