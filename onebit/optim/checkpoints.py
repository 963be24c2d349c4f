"""Checkpoints of the onebit optimizers.

Where things live: the stage counters in every param group (one shared
dict under COUNTERS_KEY); moments and per-tensor state in `state[p]`, as
torch's optimizers keep them. That is the layout torch.distributed.checkpoint
(and FSDP2 and Accelerate on top of it) can map to parameter names. The
error-feedback buffers differ on every rank, so they are not in
`state_dict()` (feedback/state.py).

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
from typing import Callable, Dict, List, Optional

import torch

from .late import LATE_KEY, codes_fit


COUNTERS_KEY = "onebit"  # param_group[COUNTERS_KEY]: the counters that decide the stage
MOMENTUM_KEY = "momentum_compressed"  # saved with them: see MomentumRestart
PLACEHOLDERS_KEY = "placeholders"  # saved with them: the staged state saved as placeholders
TRAINED_KEY = "trained"  # saved with them: who the saved step trained (trained_codes)
STATE_KEY = "onebit"  # where checkpoints before DCP support kept them: state["onebit"]

# Keys torch.optim.Adam/AdamW keep in a param group that onebit has no use for.
_TORCH_ONLY = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused",
               "decoupled_weight_decay")


def share_counters(param_groups, counters: dict) -> None:
    """Put the one `counters` dict in every param group."""
    for g in param_groups:
        g[COUNTERS_KEY] = counters


def param_states(state: dict) -> list:
    """The (key, per-param state) pairs of an optimizer's `state` (keyed by
    param) or of a state_dict's (keyed by index). torch keeps entries keyed
    by anything else as they are (`opt.state["note"] = 1`): they are no
    param's, and nothing here reads or changes them."""
    return [(k, st) for k, st in state.items()
            if isinstance(k, (torch.Tensor, int)) and isinstance(st, dict)]


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
    per_param = [s for _, s in param_states(state_dict["state"])]
    if (groups and all("amsgrad" in g for g in groups)
            and all({"exp_avg", "exp_avg_sq"} <= set(s) for s in per_param)):
        return "Adam"
    return "unknown"


def adapt(optimizer, state_dict: dict, counters_at: Callable[[int], dict]) -> dict:
    """`state_dict` in this optimizer's own format, each group's
    `exp_avg_mask` kept from the optimizer's param groups (keep_masks), or
    ValueError. `counters_at(t)`: the counters this optimizer would have
    after t steps of full-precision Adam (used for Adam checkpoints)."""
    mine = type(optimizer).__name__
    kind = checkpoint_kind(state_dict)
    if kind == mine:
        return keep_masks(_counters_in_groups(state_dict), optimizer.param_groups)
    if kind == "Adam" and hasattr(optimizer, "_adam_compatible"):
        return keep_masks(_from_adam(optimizer, state_dict, counters_at), optimizer.param_groups)
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
        # torch's Adam adds the decay to the gradient (L2); onebit's, as
        # AdamW and DeepSpeed's, to the update: the run would go on with
        # another method. (torch before 2.6 does not say which it was.)
        if saved.get("weight_decay") and saved.get("decoupled_weight_decay") is False:
            raise ValueError(f"{mine}.load_state_dict: the checkpoint is torch.optim.Adam's with "
                             f"weight_decay={saved['weight_decay']} (L2: added to the gradient); "
                             f"{mine} decouples the decay as AdamW does, so the run would not "
                             "continue the same method. Load an AdamW checkpoint, or one with "
                             "weight_decay=0. Nothing was loaded")
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
    # torch's Adam averaged exactly: its momentum has nothing to restart.
    counters = {**counters_at(max(steps, default=0)), MOMENTUM_KEY: False}
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


def add_placeholders(state_dict: dict, params, staged: Dict[str, tuple]) -> None:
    """Write a placeholder into `state_dict["state"]` for every per-param
    state a later stage creates (`staged`: name -> (placeholder maker,
    whether a checkpoint at a step holds it for real)) where it is missing,
    so a fresh optimizer's state_dict has every key a trained one has: DCP
    loads only into keys the target already has. `params`: the optimizer's
    params in state_dict order."""
    for key, st in param_states(state_dict["state"]):
        missing = [name for name in staged if name not in st]
        if missing:
            # torch's state_dict() hands out the optimizer's own per-param
            # dicts: a placeholder written there would join its live state
            # (on FSDP2 shards a DTensor sync_point, which 0/1 Adam's next
            # local step could not copy into). A copy of the dict takes it.
            st = state_dict["state"][key] = dict(st)
            for name in missing:
                st[name] = staged[name][0](params[key])


def drop_placeholders(state, staged: Dict[str, tuple], step: int,
                      saved_as_placeholders=None) -> None:
    """Remove from a loaded `state` the placeholders `add_placeholders` wrote:
    the staged entries the saving run could not hold for real, as it listed
    them (`saved_as_placeholders`). The loading run's own schedule may
    differ (a smaller freeze_step): by it, LAMB's zero placeholder had
    passed for a real trust-ratio average. Checkpoints written before the
    list: the staged entries a checkpoint at `step` cannot hold for real."""
    for name, (_, real) in staged.items():
        if (name in saved_as_placeholders if saved_as_placeholders is not None
                else not real(step)):
            for _, st in param_states(state):
                st.pop(name, None)


def keep_masks(state_dict: dict, param_groups) -> dict:
    """`state_dict` with each group's `exp_avg_mask` taken from the live
    `param_groups`, not the checkpoint (it may change between training
    phases, as DeepSpeed does)."""
    groups = [dict(g) for g in state_dict["param_groups"]]
    for mine, theirs in zip(param_groups, groups):
        theirs.pop("exp_avg_mask", None)
        if "exp_avg_mask" in mine:
            theirs["exp_avg_mask"] = mine["exp_avg_mask"]
    return {**state_dict, "param_groups": groups}


def trained_codes(signature: Optional[List[List[int]]]) -> str:
    """Which params the last step trained (each group's codes from
    late.LateJoiners.codes: frozen, trained, late), as one string: a
    resumed run must notice a change of that set at its next step as the
    run that did not stop does (its error buffers restart from zero), and
    load the error buffers laid out for the saved set. A string, so DCP
    carries it as it carries the other counters. "" before any step."""
    if signature is None:
        return ""
    return "|".join("".join(str(code) for code in row) for row in signature)


def signature_from_codes(saved, param_groups) -> Optional[List[List[int]]]:
    """What `trained_codes` saved, where it fits `param_groups` (as many
    groups, as many params in each); None where it does not or is absent
    (a checkpoint written before it, or by torch's Adam): the next step
    then takes the set it finds, as before."""
    if not isinstance(saved, str) or not saved or not set(saved) <= set("012|"):
        return None
    signature = [[int(code) for code in row] for row in saved.split("|")]
    return signature if codes_fit(signature, param_groups) else None


def annotate(state_dict: dict, params, *, step: int, momentum_compressed: bool,
             staged: Dict[str, tuple], late_warmup: int,
             trained: Optional[List[List[int]]]) -> None:
    """What an optimizer's state_dict adds to torch's, in place: each
    group's counters copied (the saved dict must not follow training), with
    whether the momentum came through compressed exchanges (MomentumRestart),
    the staged state saved as placeholders and who the step trained
    (trained_codes); and a placeholder for each per-param state a later
    stage creates (`staged`, the subclass's; a late joiner's warmup count,
    LATE_KEY, for everyone), so a fresh optimizer's state_dict has every key
    a trained one has: DCP loads only into keys the target already has."""
    placeholders = sorted(name for name, (_, real) in staged.items() if not real(step))
    for g in state_dict["param_groups"]:
        g[COUNTERS_KEY] = {**copy.deepcopy(g[COUNTERS_KEY]), MOMENTUM_KEY: momentum_compressed,
                           PLACEHOLDERS_KEY: placeholders, TRAINED_KEY: trained_codes(trained)}
    add_placeholders(state_dict, params,
                     {LATE_KEY: (lambda p: late_warmup, lambda step: True), **staged})


class SavedCounters:
    """The counters a loaded checkpoint holds, apart from what the save
    added to them (see `annotate`). `initial`: the optimizer's initial
    counters (keys a checkpoint written before them lacks);
    `had_error_feedback(counters, step)`: the schedule's."""

    def __init__(self, param_groups, initial: dict, had_error_feedback) -> None:
        counters = {**initial, **param_groups[0].get(COUNTERS_KEY, {})}
        self.step = counters["step"]
        self.had_error_feedback = had_error_feedback(counters, self.step)
        # Absent from checkpoints written before them: the stage decides.
        self.momentum_compressed = counters.pop(MOMENTUM_KEY, self.had_error_feedback)
        self.placeholders = counters.pop(PLACEHOLDERS_KEY, None)
        self.trained = signature_from_codes(counters.pop(TRAINED_KEY, None), param_groups)
        self.counters = counters


def drop_state_of_the_run(state: dict, is_late, names: tuple) -> None:
    """A late joiner (`is_late(param)`, or a param about to be one: no v)
    never held what the run's local steps keep (`names`: 0/1 Adam's synced
    point): the checkpoint's entry is a placeholder, which would pass for
    real after its warmup."""
    for p, st in param_states(state):
        if "exp_avg_sq" not in st or is_late(p):
            for name in names:
                st.pop(name, None)


def zero_momentum_(state: dict) -> None:
    """Restart every param's momentum from zero (MomentumRestart)."""
    for _, st in param_states(state):
        m = st.get("exp_avg")
        if isinstance(m, torch.Tensor):
            m.zero_()


class MomentumRestart:
    """The momentum restarts from zero at the first step after a resume
    whose error-feedback buffers did not come back (another world size, or
    a checkpoint saved without them), when the saved momentum came through
    compressed exchanges.

    Why: in the compression stage the saved `exp_avg` is the 1-bit average
    itself, a sign and one scale per block, and the error buffers held what
    it left out; they would have put it back over the next steps. Without
    them that bias stays in the momentum for the ~1/(1 - beta1) steps it
    takes to decay, and with a frozen variance every entry moves by the
    block's scale over its own sqrt(v): held-out loss up to 9% above the
    uninterrupted run's on a small GPT-2, against at most 2% with the
    restart (docs/checkpoints.md). `enabled` (the optimizer's `momentum_restart`)
    turns it off."""

    def __init__(self) -> None:
        self.enabled = True
        self.pending = False

    def loaded(self, momentum_compressed: bool) -> None:
        self.pending = momentum_compressed

    def restored(self) -> None:
        self.pending = False

    def due(self) -> bool:
        """Whether the coming step restarts the momentum (once per load)."""
        due, self.pending = self.pending and self.enabled, False
        return due



def state_in_fp32(state: dict, param_groups: list, saved: dict, keep: tuple) -> None:
    """The optimizer's state tensors back in fp32 after torch's
    `Optimizer.load_state_dict`, which casts every floating-point state
    tensor to its param's dtype: bf16 or fp16 params got bf16 moments, and
    the next step failed on the mixed dtypes. Where `saved` (the dict
    loaded) held fp32, that tensor is taken again, so nothing is rounded;
    where it held another dtype (a torch.optim.Adam checkpoint keeps such
    params' moments in theirs), it is widened. `keep`: the keys held in the
    param's dtype by design."""
    for group, saved_group in zip(param_groups, saved["param_groups"]):
        for p, index in zip(group["params"], saved_group["params"]):
            st, was = state.get(p), saved["state"].get(index, {})
            for key, value in (st or {}).items():
                if (key in keep or not isinstance(value, torch.Tensor)
                        or not value.is_floating_point() or value.dtype == torch.float32):
                    continue
                old = was.get(key)
                exact = isinstance(old, torch.Tensor) and old.dtype == torch.float32
                st[key] = old.to(value.device, copy=True) if exact else value.float()


def settle_loaded(state: dict, param_groups: list, saved: dict, *, keep: tuple, shards,
                  initial: dict, had_error_feedback, staged: Dict[str, tuple], is_late,
                  state_of_the_run: tuple) -> SavedCounters:
    """onebit's part of a load, once torch's `Optimizer.load_state_dict`
    loaded `saved` into `state`: the state tensors back in fp32 but `keep`
    (state_in_fp32), sharded params' state back on their local shards
    (`shards`: the optimizer's ShardedParams), the placeholders `annotate`
    wrote dropped (`staged`: the subclass's), and the state of the run
    dropped for late joiners (`is_late(param)`, `state_of_the_run`'s names).
    Returns the counters the checkpoint holds (`initial`,
    `had_error_feedback`: as SavedCounters takes them), shared by every
    group (share_counters)."""
    state_in_fp32(state, param_groups, saved, keep=keep)
    shards.from_dtensors(state)
    counters = SavedCounters(param_groups, initial, had_error_feedback)
    drop_placeholders(state, staged, counters.step, counters.placeholders)
    drop_state_of_the_run(state, is_late, state_of_the_run)
    share_counters(param_groups, counters.counters)
    return counters


class ErrorFeedbackCheckpoint:
    """An optimizer's per-rank error-feedback checkpoint: the buffers of
    `channel` (its ErrorFeedbackChannel), laid out for the params the last
    step trained (`trained`: TrainedSet, over `params`: ParamState) and,
    with overlap_backward, for its buckets (`wiring`: OverlapWiring); and
    what a resume without them means for the momentum (`restart`)."""

    def __init__(self, channel, trained, params, wiring, world_size: int) -> None:
        self.channel, self.world_size = channel, world_size
        self.trained, self.params, self.wiring = trained, params, wiring
        self.restart = MomentumRestart()

    def before_step(self, state: dict) -> None:
        """A step's first act: the channel's notice of buffers that restarted
        from zero, and the momentum's restart where one is due (`state`: the
        optimizer's)."""
        self.channel.restart_notice.before_step()
        if self.restart.due():
            zero_momentum_(state)

    def momentum_compressed(self, exchanged: bool) -> bool:
        """What a checkpoint saves under MOMENTUM_KEY: whether its momentum came
        through compressed exchanges (`exchanged`: the optimizer's answer at
        the saved step) or still waits for its restart."""
        return self.restart.pending or exchanged

    def loaded(self, saved: "SavedCounters") -> None:
        """After `load_state_dict`: the saved step's trained set, as the run
        that did not stop holds it (the error buffers load laid out for it; a
        change shows at the next step); buffers that mean nothing until
        restored; the momentum's restart, if the saved one was compressed."""
        self.trained.loaded(saved.trained)
        self.channel.owner_loaded(self.world_size > 1 and saved.had_error_feedback)
        self.restart.loaded(saved.momentum_compressed)

    def layouts(self, param_groups) -> dict:
        """error_layouts for the optimizer's current `param_groups`."""
        return error_layouts(self.world_size, self.channel.exchange,
                             lambda: self.trained.last_lists(self.params, param_groups),
                             self.wiring.bucket_sizes)

    def state_dict(self, param_groups, step: int) -> dict:
        """This rank's buffers, at optimizer step `step` (zeros where a group
        has not exchanged yet)."""
        return self.channel.state_dict(self.layouts(param_groups), self.params.device(),
                                       {"step": step})

    def load(self, state: dict, param_groups, step: int) -> bool:
        """Restore `state` where it fits (ErrorFeedbackChannel.load_state_dict);
        whether it did."""
        loaded = self.channel.load_state_dict(state, self.layouts(param_groups), {"step": step})
        if loaded:
            self.restart.restored()
        return loaded


def error_layouts(world_size: int, exchange, trained: Callable[[], List[List[torch.Tensor]]],
                  bucket_sizes) -> dict:
    """Error-buffer key -> layout of every fused buffer an optimizer
    exchanges (what its error-feedback state dict holds): each group's
    (`trained()`: the params the last step trained, laid out for), and with
    overlap_backward each bucket's too, where every compressed exchange then
    goes (`bucket_sizes(trained)`, OverlapWiring's). None at world size 1."""
    if world_size == 1:
        return {}
    lists = trained()
    return exchange.layouts(lists, bucket_sizes(lists))
