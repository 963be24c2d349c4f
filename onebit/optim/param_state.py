"""Per-param state and gradients, over FSDP2 shards, and which params train.

The maths of a step holds local tensors (a sharded param's local shard,
shards.py); torch.optim keeps state under the param itself. `ParamState`
bridges the two: the state of a param or of the param a shard belongs to,
its fp32 state tensors created on first use, and its gradients as dense
fp32 tensors. `TrainedSet` remembers which params the last step trained
(the layout every fused buffer and error buffer was made for).
"""
from __future__ import annotations

from typing import List, Optional

import torch

from .. import collectives
from ..checks import check_each_parameter_once, check_real
from .functional import clipped
from .late import FROZEN, TRAINED, LateJoiners, codes_fit, late_adam_step_


def check_new_group(name: str, param_group: dict, param_groups, shards=None) -> None:
    """Refuse a param group about to be added to optimizer `name`'s
    `param_groups` that lists a param twice or a complex one, or (`shards`,
    once the optimizer is built) is not sharded like the rest. A generator
    of params becomes a list first: it can be read only once."""
    params = param_group["params"]
    if not isinstance(params, (torch.Tensor, set)):
        params = param_group["params"] = list(params)
    listed = [params] if isinstance(params, torch.Tensor) else params
    # torch takes named params too: (name, tensor) pairs
    tensors = [p[1] if isinstance(p, tuple) else p for p in listed]
    check_each_parameter_once(name, tensors)
    check_real(name, tensors)
    if shards is not None:
        shards.check_added([*param_groups, {**param_group, "params": listed}])


class ParamState:
    """The state and gradients of an optimizer's params, as local tensors.

    `owner` is the optimizer: only its public `state` and `param_groups`
    are read, at each call, because torch's load_state_dict replaces both.
    `shards`: the optimizer's ShardedParams; `late`: its LateJoiners."""

    def __init__(self, owner, shards, late: LateJoiners) -> None:
        self.owner, self.shards, self.late = owner, shards, late

    def local_state(self):
        """`state`, which a sharded param's local shard indexes as the param."""
        return self.shards.state_view(self.owner.state)

    def of(self, p: torch.Tensor) -> dict:
        """The state of param `p`, or of the param whose local shard `p` is."""
        return self.owner.state[self.shards.owner(p)]

    def tensor(self, p: torch.Tensor, name: str) -> torch.Tensor:
        """`p`'s fp32 state tensor `name`, created (zeros) on first use."""
        st = self.of(p)
        t = st.get(name)
        if t is None:
            t = st[name] = torch.zeros_like(p, dtype=torch.float32,
                                            memory_format=torch.contiguous_format)
        return t

    def states(self, params: List[torch.Tensor]) -> List[dict]:
        """The state of each of `params` (as `of`), one lookup each: a step
        over thousands of small tensors pays per lookup (a tensor's hash is
        a Python call), so a step takes its params' states once and hands
        them to `moments` and `tensors`."""
        state = self.owner.state
        return [state[p] for p in self.shards.owners(params)]

    def tensors(self, params: List[torch.Tensor], name: str,
                states: Optional[List[dict]] = None) -> List[torch.Tensor]:
        """Each param's fp32 state tensor `name`, created on first use.
        `states`: the params' `states`, where the caller has them."""
        out = [st.get(name) for st in (self.states(params) if states is None else states)]
        for i, t in enumerate(out):
            if t is None:
                out[i] = self.tensor(params[i], name)
        return out

    def moments(self, params: List[torch.Tensor], states: Optional[List[dict]] = None):
        """The params' fp32 (exp_avg, exp_avg_sq), created on first use."""
        states = self.states(params) if states is None else states
        return self.tensors(params, "exp_avg", states), self.tensors(params, "exp_avg_sq", states)

    def gradients(self, params: List[torch.Tensor],
                  scale: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
        """fp32 gradients (zeros where .grad is None), unscaled by `scale`
        (a GradScaler's, handed to step())."""
        grads = self.shards.grads(params)
        # The usual case (every gradient there, dense fp32, outside autograd)
        # in one pass: a step over thousands of small tensors pays per tensor.
        if not all(g is not None and g.dtype is torch.float32 and not g.requires_grad
                   and not g.is_sparse for g in grads):
            grads = [self._fp32(p, g) for p, g in zip(params, grads)]
        if scale is not None and grads:
            torch._foreach_mul_(grads, (1.0 / scale.double()).float().item())
        return grads

    def _fp32(self, p: torch.Tensor, g: Optional[torch.Tensor]) -> torch.Tensor:
        if g is None:
            return torch.zeros_like(p, dtype=torch.float32)
        if g.is_sparse:
            raise ValueError(f"{type(self.owner).__name__} does not support sparse gradients")
        g = g.detach()
        return g.float() if g.dtype != torch.float32 else g

    def clipped(self, grads: List[torch.Tensor], max_norm: float) -> List[torch.Tensor]:
        """`grads` clipped to the global norm `max_norm`, the whole params'
        norm over shards (functional.clipped)."""
        return clipped(grads, max_norm, self.shards.whole_norms)

    def late_step_(self, group: dict, params: List[torch.Tensor], grads: List[torch.Tensor]) -> None:
        """Late joiners' own warmup step (late.late_adam_step_) on `grads`
        clipped to the group's max_grad_norm: Adam, its bias corrections
        counted per param from that param's first step."""
        steps = [LateJoiners.steps_done(self.local_state(), p) + 1 for p in params]
        late_adam_step_(params, self.clipped(grads, group["max_grad_norm"]),
                        self.tensors(params, "exp_avg"), self.tensors(params, "exp_avg_sq"),
                        steps, group)

    def clipped_groups(self, groups: list, grads: List[List[torch.Tensor]]
                       ) -> List[List[torch.Tensor]]:
        """Each group's `grads` clipped to its max_grad_norm (`groups`:
        [(param group, params)], as a StepPlan holds them)."""
        return [self.clipped(gs, group["max_grad_norm"]) for (group, _), gs in zip(groups, grads)]

    def trainable(self, group) -> List[torch.Tensor]:
        """The params trained with the optimizer's own stages: those that
        require grad, less late joiners in their own warmup (late.py), as
        local shards. A param whose .grad is None at a step counts as a zero
        gradient, so every rank flattens the same layout."""
        return self.shards.locals([p for p in group["params"]
                                   if p.requires_grad and not self.late.is_late(self.owner.state, p)])

    def coded(self, codes: List[List[int]], code: int) -> List[List[torch.Tensor]]:
        """Each group's params whose code (`codes`: LateJoiners.codes's, one
        row per group) is `code`, as local shards."""
        return [self.shards.locals([p for p, c in zip(g["params"], row) if c == code])
                for g, row in zip(self.owner.param_groups, codes)]

    def codes(self, variance_frozen: bool) -> List[List[int]]:
        """One pass over the params: who trains, who is late, who is frozen."""
        return self.late.codes(self.owner.state, self.owner.param_groups, variance_frozen)

    def device(self) -> torch.device:
        for g in self.owner.param_groups:
            for p in g["params"]:
                return p.device
        return torch.device("cpu")


class TrainedSet:
    """Which params the last step trained, as each group's codes
    (LateJoiners.codes), and its digest, which the ranks compare."""

    def __init__(self) -> None:
        self.signature: Optional[List[List[int]]] = None
        self.digest = 0  # 0: none yet
        self.stopped: List[torch.Tensor] = []  # trained last step, frozen from this one

    def hold(self, signature: Optional[List[List[int]]]) -> None:
        self.signature = signature
        self.digest = collectives.stable_digest(signature) if signature else 0

    def notice(self, signature: List[List[int]], param_groups) -> bool:
        """Hold `signature`; whether it changed from a set held before (layers
        frozen or unfrozen, a group added, a late joiner joining): then what
        was laid out for the old set must go, and the params that stopped
        training are kept in `stopped`."""
        if signature == self.signature:
            return False
        changed = self.signature is not None
        if changed:
            self.stopped = [p for group, old, new in zip(param_groups, self.signature, signature)
                            if len(old) == len(new)
                            for p, was, now in zip(group["params"], old, new)
                            if was != FROZEN and now == FROZEN]
        self.hold(signature)
        return changed

    def loaded(self, signature: Optional[List[List[int]]]) -> None:
        """Hold a checkpoint's set (SavedCounters.trained), as the run that
        did not stop holds it: nobody stopped training at its step."""
        self.hold(signature)
        self.stopped = []

    def take_stopped(self) -> List[torch.Tensor]:
        stopped, self.stopped = self.stopped, []
        return stopped

    def last_lists(self, params: ParamState, param_groups) -> List[List[torch.Tensor]]:
        """The params the last step trained (loaded: the saved step's), which
        the error buffers are laid out for; before any step, or where groups
        were added since, those that train now."""
        if self.signature is None or not codes_fit(self.signature, param_groups):
            return [params.trainable(g) for g in param_groups]
        return params.coded(self.signature, TRAINED)
