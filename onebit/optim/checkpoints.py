"""Checkpoints of the onebit optimizers.

Where things live: the stage counters in every param group (one shared
dict under COUNTERS_KEY); moments and per-tensor state in `state[p]`, as
torch's optimizers keep them. That is the layout torch.distributed.checkpoint
(and FSDP2 and Accelerate on top of it) can map to parameter names. The
error-feedback buffers differ on every rank, so they are not in
`state_dict()`: each rank saves its own (`error_feedback_state_dict`), as a
file of its own or as a rank-named entry of a DCP checkpoint.

What `load_state_dict` accepts, decided before anything is loaded (a
refused checkpoint changes nothing):

- its own checkpoints, from any world size;
- a `torch.optim.Adam` or `AdamW` checkpoint, into OnebitAdam or
  ZeroOneAdam: the moments carry over and the stage follows from Adam's step
  count, so a running Adam job can switch to 1-bit Adam;
- nothing else: another onebit optimizer's checkpoint, Adam's into
  OnebitLamb (LAMB's trust ratios cannot come from Adam), AMSGrad or
  `maximize` checkpoints, and unknown formats raise ValueError naming why.
"""
from __future__ import annotations

import copy
from typing import Callable, Dict

import torch
import torch.distributed as dist

from ..backends.base import WIRE_FORMAT_VERSION
from .late import LATE_KEY

COUNTERS_KEY = "onebit"  # param_group[COUNTERS_KEY]: the counters that decide the stage
STATE_KEY = "onebit"  # where checkpoints before DCP support kept them: state["onebit"]

# Keys torch.optim.Adam/AdamW keep in a param group that onebit has no use for.
_TORCH_ONLY = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused",
               "decoupled_weight_decay")


def checkpoint_kind(state_dict: dict) -> str:
    """The optimizer that wrote `state_dict`: a onebit class name, "Adam" for
    torch's Adam/AdamW, or "unknown"."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        return "unknown"
    groups = state_dict["param_groups"]
    counters = state_dict["state"].get(STATE_KEY)
    if counters is None and groups:
        counters = groups[0].get(COUNTERS_KEY)
    if isinstance(counters, dict):
        if "optimizer" in counters:
            return counters["optimizer"]
        # Written before checkpoints named their optimizer: tell by the contents.
        if "var_interval" in counters:
            return "ZeroOneAdam"
        return "OnebitLamb" if groups and "max_coeff" in groups[0] else "OnebitAdam"
    per_param = [s for k, s in state_dict["state"].items() if k != STATE_KEY]
    if (groups and all("amsgrad" in g for g in groups)
            and all({"exp_avg", "exp_avg_sq"} <= set(s) for s in per_param)):
        return "Adam"
    return "unknown"


def adapt(optimizer, state_dict: dict, counters_at: Callable[[int], dict]) -> dict:
    """`state_dict` in this optimizer's own format, or ValueError.
    `counters_at(t)`: the counters this optimizer would have after t steps
    of full-precision Adam (used for Adam checkpoints)."""
    mine = type(optimizer).__name__
    kind = checkpoint_kind(state_dict)
    if kind == mine:
        return _counters_in_groups(state_dict)
    if kind == "Adam" and hasattr(optimizer, "_adam_compatible"):
        return _from_adam(optimizer, state_dict, counters_at)
    why = {
        "unknown": "it is not an optimizer state_dict that onebit knows",
        "Adam": f"{mine} keeps state that Adam does not have (LAMB's trust ratios); start "
                f"{mine} fresh, or switch from Adam to OnebitAdam or ZeroOneAdam",
    }.get(kind, f"it was written by {kind}, whose state means something else; load it into "
                f"{kind}")
    raise ValueError(f"{mine}.load_state_dict: refusing this checkpoint: {why}. Nothing was loaded")


def _from_adam(optimizer, state_dict: dict, counters_at) -> dict:
    mine = type(optimizer).__name__
    groups = []
    if len(state_dict["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"{mine}.load_state_dict: the Adam checkpoint has "
                         f"{len(state_dict['param_groups'])} param groups, this optimizer "
                         f"{len(optimizer.param_groups)}. Nothing was loaded")
    for live, saved in zip(optimizer.param_groups, state_dict["param_groups"]):
        for flag in ("amsgrad", "maximize"):
            if saved.get(flag):
                raise ValueError(f"{mine}.load_state_dict: the Adam checkpoint has {flag}=True, "
                                 f"which {mine} does not do. Nothing was loaded")
        group = {k: v for k, v in saved.items() if k not in _TORCH_ONLY}
        # What Adam has no word for (bias_correction, max_grad_norm, ...) stays as built.
        for k, v in live.items():
            if k != "params":
                group.setdefault(k, v)
        groups.append(group)
    state, steps = {}, []
    for key, s in state_dict["state"].items():
        s = dict(s)
        step = s.pop("step", None)
        if step is not None:
            steps.append(int(step.item() if isinstance(step, torch.Tensor) else step))
        s.pop("max_exp_avg_sq", None)
        state[key] = s
    counters = counters_at(max(steps, default=0))
    for g in groups:
        g[COUNTERS_KEY] = counters
    return {"state": state, "param_groups": groups}


def _counters_in_groups(state_dict: dict) -> dict:
    """Checkpoints written before DCP support kept the counters at
    state["onebit"]; move them where they live now."""
    if STATE_KEY not in state_dict["state"]:
        return state_dict
    state = dict(state_dict["state"])
    counters = state.pop(STATE_KEY)
    groups = [{**g, COUNTERS_KEY: counters} for g in state_dict["param_groups"]]
    return {**state_dict, "state": state, "param_groups": groups}


class Checkpoints:
    """The checkpoint half of OnebitOptimizer (see the module doc)."""

    # Per-param state a subclass creates only at some stage:
    # name -> (placeholder maker, whether a checkpoint at `step` holds it for real).
    # state_dict() writes a placeholder where it is missing, so a fresh
    # optimizer's state_dict has every key a trained one has: DCP loads only
    # into keys the target already has. load_state_dict drops the fake ones.
    def _staged_state(self) -> Dict[str, tuple]:
        return {}

    def state_dict(self) -> dict:
        sd = super().state_dict()
        for g in sd["param_groups"]:  # a copy per group: the saved dict must not follow training
            g[COUNTERS_KEY] = copy.deepcopy(g[COUNTERS_KEY])
        warm = self._warmup_length()
        # A late joiner's own warmup count (late.py); "done" for everyone else.
        staged = {LATE_KEY: (lambda p: warm, lambda step: True), **self._staged_state()}
        if staged:
            params = [p for g in self.param_groups for p in g["params"]]
            for key, st in sd["state"].items():
                for name, (make, _) in staged.items():
                    if name not in st:
                        st[name] = make(params[key])
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a checkpoint, from any world size: this optimizer's own, or a
        torch.optim.Adam/AdamW one where that makes sense (see the module doc).

        Kept from the *current* param groups, not the checkpoint: each group's
        `exp_avg_mask` (it may change between training phases, as DeepSpeed
        does). Reset: the error-feedback buffers; restore this rank's with
        `load_error_feedback_state_dict` afterwards (same world size), or
        they restart from zero (DeepSpeed's documented choice).
        """
        state_dict = dict(adapt(self, state_dict, self._counters_at))
        groups = [dict(g) for g in state_dict["param_groups"]]
        for mine, theirs in zip(self.param_groups, groups):
            theirs.pop("exp_avg_mask", None)
            if "exp_avg_mask" in mine:
                theirs["exp_avg_mask"] = mine["exp_avg_mask"]
        state_dict["param_groups"] = groups
        super().load_state_dict(state_dict)
        counters = {**self._initial_counters(), **self.param_groups[0].get(COUNTERS_KEY, {})}
        self._share_counters(counters)
        for name, (_, real) in self._staged_state().items():
            if not real(counters["step"]):
                for st in self.state.values():
                    st.pop(name, None)
        self._forget_layouts()

    # ------------------------------------------- per-rank error feedback --
    def error_feedback_state_dict(self) -> dict:
        """This rank's error-feedback buffers: what `state_dict()` leaves out,
        because they differ on every rank. Save one per rank next to the
        optimizer's checkpoint (with DCP: under a key naming the rank, see
        the README); with both, a resume at the same world size is bitwise
        identical to not stopping. Groups that have not exchanged yet get
        zeros of the right size, so a fresh optimizer's dict is a target DCP
        can load into."""
        rank = dist.get_rank(self.process_group) if self.world_size > 1 else 0
        groups = self._ef_exchange.errors_state(self._error_layouts(), self._device())
        return {"rank": rank, "world_size": self.world_size, "wire_format": WIRE_FORMAT_VERSION,
                "block_size": self.block_size, "step": self.counters["step"], "groups": groups}

    def error_feedback_key(self) -> str:
        """The key for this rank's error buffers in a DCP checkpoint. It names
        the world size too: at another one the buffers have other sizes, and
        DCP refuses to load a tensor into one of another size, so there the
        key is simply absent (load with allow_partial_load=True)."""
        rank = dist.get_rank(self.process_group) if self.world_size > 1 else 0
        return f"onebit_errors.world{self.world_size}.rank{rank}"

    def load_error_feedback_state_dict(self, state: dict) -> bool:
        """Restore what `error_feedback_state_dict` saved on this rank. At
        another world size, rank, block size, wire format or backend layout
        (flat against hierarchical), or from another
        step than the loaded optimizer state's, the buffers mean nothing
        here: they restart from zero (DeepSpeed's choice) and this returns
        False. Call it after `load_state_dict`, which resets them."""
        rank = dist.get_rank(self.process_group) if self.world_size > 1 else 0
        same = (state.get("world_size"), state.get("rank"), state.get("wire_format"),
                state.get("block_size"), state.get("step")) == (
                    self.world_size, rank, WIRE_FORMAT_VERSION, self.block_size,
                    self.counters["step"])
        if same and self.world_size > 1:
            # Buffers saved under another layout (say the hierarchical backend's
            # shards against the flat one's, or another bucket plan) have
            # other sizes and meanings.
            same = self._ef_exchange.layouts_match(state["groups"], self._error_layouts())
        self._ef_exchange.load_errors(state["groups"] if same else None)
        return same

    def _error_layouts(self) -> dict:
        """Error-buffer key -> layout of every fused buffer this optimizer
        exchanges: each group's, and with overlap_backward each bucket's too
        (where every compressed exchange then goes)."""
        if self.world_size == 1:
            return {}
        trained = self._trained_lists()
        buckets = self._overlap.bucket_sizes(trained) if self._overlap is not None else ()
        return self._ef_exchange.layouts(trained, buckets)
