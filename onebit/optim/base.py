"""What the three 1-bit optimizers share: the step that orchestrates them.

Where the 1-bit step happens: `step()` -> `_take_step` -> the subclass's
`_update` -> its stage maths, a function with explicit inputs beside its
class, as torch.optim.adam's `adam()` (adam.py `onebit_adam`; lamb.py
`onebit_lamb_fresh_step_`, `onebit_lamb_frozen_step_`; zoadam.py
`sync_local_steps_`, `sync_single_`), which exchanges through
`StepExchange` (step_exchange.py).

`step()` is five verbs over a `StepPlan` (step_plan.py): gather, agree
(`StepGate`), average in full precision (averaging.py), update, finish.
The objects it holds are built from explicit inputs: `Communication`,
`ParamState` and `TrainedSet`, `GroupCaches`, `OverlapWiring`, the shared
`ErrorFeedbackChannel` (onebit/feedback/); checkpoint bodies: checkpoints.py.
"""
from __future__ import annotations

import abc
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from ..amp import AGREEING_SCALER_ATTRIBUTE
from ..backends.stats import TrafficStats
from ..feedback.channel import ErrorFeedbackChannel
from ..feedback.exchange import LateKey
from ..shards import ShardedParams
from . import checkpoints
from .caches import GroupCaches
from .checkpoints import COUNTERS_KEY
from .late import TRAINED, LateJoiners
from .averaging import FullPrecisionAveraging
from .communication import Communication, agreed_settings
from .copies import copied_attributes
from .options import CommOptions
from .overlap import OverlapCallbacks
from .overlap_wiring import OverlapWiring
from .param_state import ParamState, TrainedSet, check_new_group
from .step_exchange import StepExchange
from .step_plan import (StepGate, StepPlan, drop_scaler_handoff, gather, plan_untouched, put_back_untouched,
                        start_late, step_settings, unseen_trained)
from .stage import Stage


class OnebitOptimizer(torch.optim.Optimizer, metaclass=abc.ABCMeta):
    """Base class; see OnebitAdam for the user-facing documentation.

    `process_group`: the data-parallel group (default: the world, or none
    without torch.distributed); with FSDP2-sharded params, the mesh's
    replicate dim (the maths runs on local shards, shards.py). A subclass
    hands in its stage schedule (stage_schedules.py) and communication
    options (options.py) and fills in the contract below (`_update` and
    `_exchange_input_` required); `rank_agreed_settings`: its attributes,
    set before this constructor, that every rank must share too."""

    # GradScaler then hands us `grad_scale` and `found_inf` instead of
    # stepping only on ranks that saw finite gradients (which would hang).
    _step_supports_amp_scaling = True
    # ... and agrees on found_inf across ranks itself (amp.py need not).
    agrees_on_found_inf = True
    rank_agreed_settings: Tuple[str, ...] = ()

    def __init__(self, params, defaults: dict, schedule, options: CommOptions) -> None:
        name = type(self).__name__
        self._schedule = schedule
        settings = agreed_settings(schedule, {n: getattr(self, n) for n in self.rank_agreed_settings},
                                   options)
        self._comm: Optional[Communication] = None  # (torch's __init__ adds the first groups)
        super().__init__(params, defaults)
        self._shards = ShardedParams(name, self.param_groups, options.process_group)
        self._params = ParamState(self, self._shards,
                                  LateJoiners(schedule.warmup_length, schedule.warmup_option))
        comm = Communication(name, options, settings, self._shards, self._params.device())
        comm.open(self.param_groups, self._shards)
        self._comm = comm
        self._channel = ErrorFeedbackChannel(
            name, comm.backend, comm.world_size, comm.rank, options.block_size,
            self._shards.identity(), " The momentum restarts from zero (see momentum_restart).")
        self._caches = GroupCaches(self._shards)  # v's denominators and masks, scratch
        self._averaging = FullPrecisionAveraging(
            name, comm.process_group, comm.world_size, comm.timeout_s, options.averaging_dtype,
            self._channel.exchange, self._channel.traffic)
        self._trained = TrainedSet()  # see _codes
        self.last_stage: Optional[Stage] = None  # the stage of the last step taken
        checkpoints.share_counters(self.param_groups, self._initial_counters())
        # Late-bound: a subclass (or a test) may replace these methods.
        callbacks = OverlapCallbacks(
            active=lambda: self._exchange_during_backward(),
            trained=lambda: self._params.coded(self._codes(self.stage_at(
                self.counters["step"] + 1).variance_frozen), TRAINED),
            gradients=lambda params: self._params.gradients(params, getattr(self, "grad_scale", None)),
            write_input=lambda *args: self._exchange_input_(*args),
            input_key=lambda index: self._exchange_input_key(index))
        self._wiring = OverlapWiring(options.overlap_backward and self.world_size > 1,
                                     self._channel.exchange, callbacks, options.bucket_cap_mb,
                                     self.param_groups)
        overlap = self._wiring.overlap
        self._exchanges = StepExchange(self._channel.exchange, overlap, self.world_size)  # (step_exchange.py)
        self._gate = StepGate(name, comm.agreement, comm.agreeing, comm.comm_device, overlap)
        self._ef_checkpoint = checkpoints.ErrorFeedbackCheckpoint(
            self._channel, self._trained, self._params, self._wiring, comm.world_size)

    # The communication's settings (communication.py), read-only.
    process_group = property(lambda self: self._comm.process_group)
    distributed = property(lambda self: self._comm.distributed)
    world_size = property(lambda self: self._comm.world_size)
    timeout_s = property(lambda self: self._comm.timeout_s)
    cuda_aware = property(lambda self: self._comm.options.cuda_aware)
    comm_backend_name = property(lambda self: self._comm.comm_backend_name)
    backend = property(lambda self: self._comm.backend)
    comm_device = property(lambda self: self._comm.comm_device)
    block_size = property(lambda self: self._comm.options.block_size)
    scale_dtype = property(lambda self: self._comm.options.wire_scale_dtype)
    averaging_dtype = property(lambda self: self._comm.options.averaging_dtype)
    check_replicas_every = property(lambda self: self._comm.options.check_replicas_every)

    def __getstate__(self) -> dict:
        """copy.deepcopy and pickle: at world size 1 an independent copy that
        steps as the original; refused past one rank or sharded (copies.py)."""
        return copied_attributes(type(self).__name__, self.world_size, self._shards.sharded,
                                 self.__dict__)

    # ------------------------------------------------ the subclass contract --
    @abc.abstractmethod
    def _update(self, stage: Stage, groups: list, grads: list) -> None:
        """Step `stage.step`'s maths on `groups` ([(param_group, trained params)])
        and their fp32 `grads` (averaged where the stage is full precision)."""

    @abc.abstractmethod
    def _exchange_input_(self, index: int, params, grads, out, positions) -> None:
        """Write what the coming step exchanges for these params of group
        `index` (at `positions` in its trained list) into `out`."""

    def _exchange_input_key(self, index: int):
        """What besides the gradients group `index`'s exchange input was written
        from that may change between backward and step() (hyper-parameters)."""
        return None

    def _staged_state(self) -> Dict[str, tuple]:
        """Per-param state only some stages create: name -> (placeholder maker,
        whether a checkpoint at `step` holds it for real); see `state_dict`."""
        return {}

    def _after_load(self) -> None:
        """The subclass's part of `load_state_dict`, before the user's post-hooks."""

    def _late_update(self, key: LateKey, group, params, grads) -> None:
        """A late joiner's own warmup step (ParamState.late_step_: Adam)."""
        self._params.late_step_(group, params, grads)

    # ------------------------------------------------------------ counters --
    @property
    def counters(self) -> dict:
        """The counters that decide the stage: one dict in every param group, where
        torch.distributed.checkpoint, FSDP2 and Accelerate expect non-per-param state."""
        return self.param_groups[0][COUNTERS_KEY]

    def _initial_counters(self) -> dict:
        return self._schedule.initial_counters(type(self).__name__, len(self.param_groups))

    def stage_at(self, step: int) -> Stage:
        """The stage of step `step` (from the counters as they are now)."""
        return self._schedule.stage_at(self.counters, step)

    def _exchange_during_backward(self) -> bool:
        """Whether the coming step's exchange can start in backward (its input: gradients)."""
        return self.world_size > 1 and self._schedule.exchanges_during_backward(
            self.counters, self.counters["step"] + 1)

    def stage(self) -> str:
        """The stage of the coming step, in words."""
        return self.stage_at(self.counters["step"] + 1).name

    def needs_full_precision_gradients(self) -> bool:
        """Whether the coming step averages in full precision (the DDP hook asks)."""
        return self.stage_at(self.counters["step"] + 1).full_precision

    # ---------------------------------------------------------------- step --
    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step (see the class docs for what each stage does):
        gather fp32 gradients (a missing .grad counts as zero), agree across
        ranks on skipping a non-finite step and on the params no rank has a
        gradient for (left as they were), average in full precision when the
        stage says so, clip (max_grad_norm), then the subclass's maths."""
        try:
            return self._step(closure)
        except BaseException:
            drop_scaler_handoff(self)  # a GradScaler's grad_scale and found_inf
            raise

    def _step(self, closure):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plan = self._gather()
        try:
            go_on = self._agree(plan)
            if go_on:
                self._averaging.average_step_(plan)
        except BaseException:  # ranks that disagree, a dead peer, an fp16 mean out of range:
            self._wiring.end_step()  # step t never began; undo what backward exchanged (overlap.py)
            raise
        finally:
            self._averaging.forget_marks()  # the DDP hook's promise covers one step
        if not go_on:
            self._wiring.end_step()
            self._channel.telemetry.end_step(plan.stage.step, plan.stage.name, skipped=True)
            return loss
        self._take_step(plan)  # the maths: the subclass's _update
        self._finish(plan)
        return loss

    def _gather(self) -> StepPlan:
        """The coming step's stage, who trains, who is late, their fp32 gradients."""
        self._ef_checkpoint.before_step(self.state)
        self._shards.forget_views()
        stage = self.stage_at(self.counters["step"] + 1)
        return gather(stage, self._codes(stage.variance_frozen), self.param_groups, self._params,
                      self._wiring.overlap, getattr(self, "grad_scale", None))

    def _agree(self, plan: StepPlan) -> bool:
        """Whether the step goes on, as every rank agreed (StepGate); `plan` learns
        the params no rank has a gradient for and what to put back (untouched.py)."""
        skip, gradless = self._gate.agree(
            plan, unseen_trained(plan, self._caches, self._params), self.param_groups,
            step_settings(self.counters, self.param_groups), self._trained.digest,
            getattr(self, "found_inf", None),
            agreeing_scaler=getattr(self, AGREEING_SCALER_ATTRIBUTE, False),
            fp16_hint=bool(self._averaging.hooked) and self.averaging_dtype == torch.float16)
        gradless, overlap = self._shards.locals(gradless), self._wiring.overlap
        if self._trained.stopped:  # (the ranks agree on them: the step goes on)
            self._params_stopped_training(self._trained.take_stopped())
        if skip:
            return False
        plan_untouched(plan, gradless, self._leaves_gradless_params(plan.stage), self._params, overlap,
                       self._channel.exchange, self.STATE_OF_THE_RUN)
        plan.exchanged_in_buckets = overlap is not None and self._exchange_during_backward()
        return True

    def _take_step(self, plan: StepPlan) -> None:
        """Step t's maths: the subclass's `_update` (the 1-bit step), on the
        gradients clipped (warmup: the average; else the local one)."""
        stage = plan.stage
        self.counters["step"] = stage.step
        self._wiring.step_in_progress = stage.step  # what an exchange input written from here on is for
        try:
            self._wiring.settle(plan, getattr(self, "found_inf", None))  # backward's exchanges
            self._update(stage, plan.groups, self._params.clipped_groups(plan.groups, plan.grads))
            self._schedule.advance(self.counters, stage)
        finally:
            self._wiring.step_in_progress = None
            self._wiring.end_step()

    def _finish(self, plan: StepPlan) -> None:
        """Late joiners' steps, untouched params put back, first used ones made late."""
        for i, ((group, params), gs) in enumerate(zip(plan.late, plan.late_grads)):
            if params:
                self._late_update(LateKey(i), group, params, gs)
                LateJoiners.advance(self._params.local_state(), params)
        put_back_untouched(plan, self._caches)
        if plan.first_used:
            start_late(plan.first_used, self._params)
            # (now, not at the next step: a checkpoint now holds the buffers that go on)
            self._forget_layouts()
        self.last_stage = plan.stage
        self._comm.check_replicas(plan.stage, self.param_groups, self._params)
        self._channel.telemetry.end_step(plan.stage.step, plan.stage.name, skipped=False)

    # State a step sets whether a param had a gradient or not: left as the
    # step made it when the step puts an untouched param back.
    STATE_OF_THE_RUN: tuple = ()
    # State held in the param's dtype; every other state tensor is fp32.
    STATE_IN_PARAM_DTYPE: tuple = ()

    def _leaves_gradless_params(self, stage: Stage) -> bool:
        """Whether step `stage` leaves the params no rank has a gradient for
        as they were (untouched.py): every step does, but 0/1 Adam's syncs."""
        return True

    def add_param_group(self, param_group: dict) -> None:
        """torch.optim's add_param_group, made safe for data parallelism: every
        rank must add the same group at the same step (checked, like the
        construction), and its params start from rank 0's values. A group
        added after the variance froze gets its own warmup (late.py)."""
        check_new_group(type(self).__name__, param_group, self.param_groups,
                        self._shards if self._comm is not None else None)
        super().add_param_group(param_group)
        if self._comm is not None:  # (else torch's __init__ adding the first groups)
            self._comm.admit(self.param_groups, self._shards, self._wiring)
            self.param_groups[-1][COUNTERS_KEY] = self.counters
            self._schedule.group_added(self.counters)

    def mark_gradients_averaged(self, params: Optional[Iterable[torch.Tensor]] = None) -> None:
        """The DDP comm hook's promise, for one step: this step's gradients of
        `params` (default: all) reach step() averaged in full precision over
        this optimizer's group; step() averages only the others (a head
        outside the DDP model, added with add_param_group)."""
        every = [p for g in self.param_groups for p in g["params"]] if params is None else params
        self._averaging.mark(every)

    @property
    def traffic(self) -> TrafficStats:
        """The optimizer's own full-precision averaging (the backend counts
        its 1-bit exchanges); a DDP comm hook adds its all-reduces here."""
        return self._channel.traffic

    def comm_stats(self) -> Dict[str, object]:
        """The last step's traffic and cost and the run's totals, as a plain
        dict (cheap: log it every step): step, stage (`stage()`: the coming
        one's), world_size; bytes_sent, bytes_received, fp32_bytes (an fp32
        ring all-reduce of the same gradients), compression_ratio
        (fp32_bytes / bytes_sent), comm_s (transport), compress_s (kernels
        around it), and total_* over the run; worker_error_norm and
        server_error_norm (error-feedback residuals: one that keeps growing
        warns of a bad freeze point); skipped_steps (non-finite, under a
        GradScaler). A DDP hook's backward traffic counts toward the next
        step. Bytes are each rank's share (onebit.backends.stats)."""
        return self._channel.report(self.counters["step"])

    # ------------------------------------------------------------- tensors --
    def _codes(self, variance_frozen: bool) -> List[List[int]]:
        """Who trains, is late, is frozen at the coming step; a change of who trains
        undoes backward's exchanges and forgets old layouts (errors restart at 0)."""
        codes = self._params.codes(variance_frozen)
        if self._trained.notice(codes, self.param_groups):
            self._wiring.abandon()
            self._forget_layouts()
        return codes

    def _params_stopped_training(self, params: List[torch.Tensor]) -> None:
        """`params`, trained at the last step, are frozen from this one (every
        rank agreed): nothing to do where the replicas are equal after every
        step (0/1 Adam's local steps are not)."""

    def _forget_layouts(self) -> None:
        self._channel.exchange.forget_layouts()
        self._caches.forget()

    def reset_compression_errors(self) -> None:
        """Forget the error-feedback buffers (they restart from zero)."""
        self._channel.exchange.reset()

    # ------------------------------------------------- overlap with backward --
    def _coming_step(self) -> int:
        return self._wiring.coming_step(self.counters["step"])

    def no_overlap(self):
        """Context manager: backward passes inside start no exchange (every micro-batch
        but the last, as DDP's no_sync); without overlap_backward it does nothing."""
        return self._wiring.no_overlap()

    def overlap_stats(self) -> Optional[dict]:
        """With overlap_backward: how many bucket exchanges started in backward,
        how many in step() (gradients that never came, a GradScaler's step),
        how many were done again, and step()'s seconds waiting; else None."""
        return self._wiring.stats()

    # --------------------------------------------------------- checkpoints --
    def state_dict(self) -> dict:
        """torch's state_dict, with the counters copied and a placeholder for
        each per-param state a later stage creates (checkpoints.annotate):
        a fresh optimizer's state_dict has every key a trained one has."""
        sd, step = super().state_dict(), self.counters["step"]
        params = [p for g in self.param_groups for p in g["params"]]
        compressed = self._ef_checkpoint.momentum_compressed(
            self.world_size > 1 and self._schedule.had_error_feedback(self.counters, step))
        checkpoints.annotate(sd, params, step=step, staged=self._staged_state(),
                             momentum_compressed=compressed,
                             late_warmup=self._params.late.warmup_length, trained=self._trained.signature)
        self._shards.to_dtensors(sd, params)  # sharded params: state in their placement, for DCP
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a checkpoint, from any world size: this optimizer's own, or a
        torch.optim.Adam/AdamW one where that makes sense (see checkpoints.py).

        Kept from the *current* param groups, not the checkpoint: each group's
        `exp_avg_mask` (it may change between training phases, as DeepSpeed
        does). Reset: the error-feedback buffers; restore this rank's with
        `load_error_feedback_state_dict` afterwards (same world size), or
        they restart from zero (DeepSpeed's documented choice)."""
        state_dict = checkpoints.adapt(self, state_dict, lambda step: self._schedule.counters_at(
            type(self).__name__, len(self.param_groups), step))
        # torch runs the user's load post-hooks inside its part: they wait for ours.
        post_hooks = self._optimizer_load_state_dict_post_hooks
        self._optimizer_load_state_dict_post_hooks = type(post_hooks)()
        try:
            super().load_state_dict(state_dict)
        finally:
            self._optimizer_load_state_dict_post_hooks = post_hooks
        saved = checkpoints.settle_loaded(
            self.state, self.param_groups, state_dict, keep=self.STATE_IN_PARAM_DTYPE,
            shards=self._shards, initial=self._initial_counters(),
            had_error_feedback=self._schedule.had_error_feedback, staged=self._staged_state(),
            is_late=lambda p: self._params.late.is_late(self.state, p),
            state_of_the_run=self.STATE_OF_THE_RUN)
        self._forget_layouts()
        self._ef_checkpoint.loaded(saved)
        self._after_load()
        for hook in post_hooks.values():
            hook(self)

    def error_feedback_state_dict(self) -> dict:
        """This rank's error-feedback buffers, which `state_dict()` leaves out
        (they differ on every rank). Save one per rank beside the optimizer's
        checkpoint (with DCP: under `error_feedback_key()`, see the README):
        with both, a resume at the same world size is bitwise identical to
        not stopping. Groups yet to exchange get zeros of the right size, so
        a fresh optimizer's dict is a target DCP can load into."""
        return self._ef_checkpoint.state_dict(self.param_groups, self.counters["step"])

    def error_feedback_key(self) -> str:
        """This rank's error buffers' key in a DCP checkpoint (ErrorFeedbackChannel.key)."""
        return self._channel.key("onebit_errors")

    def load_error_feedback_state_dict(self, state: dict) -> bool:
        """Restore what `error_feedback_state_dict` saved on this rank. At
        another world size, rank, block size, wire format or backend layout
        (flat against hierarchical), or from another step than the loaded
        optimizer state's, they mean nothing here: they restart from zero
        (DeepSpeed's choice) and this returns False. Call it after
        `load_state_dict`, which resets them."""
        return self._ef_checkpoint.load(state, self.param_groups, self.counters["step"])

    @property
    def momentum_restart(self) -> bool:
        """Whether the momentum restarts from zero at the first step after a
        load whose error buffers did not come back, when the saved momentum is
        a compressed average (default True; see docs/checkpoints.md)."""
        return self._ef_checkpoint.restart.enabled

    @momentum_restart.setter
    def momentum_restart(self, enabled: bool) -> None:
        self._ef_checkpoint.restart.enabled = bool(enabled)

    # ----------------------------------------------------------------- DDP --
    def ddp_hook_state(self):
        """State for `model.register_comm_hook(opt.ddp_hook_state(), onebit.ddp_comm_hook)`."""
        from ..ddp import OnebitHookState

        return OnebitHookState(self)
