"""What the three 1-bit optimizers share: the process group and compressed
backend, gradient averaging, the fused compressed allreduce of a list of
tensors and GradScaler support. The concerns around them live beside it:
hyper-parameter checks (checks.py), the zero-variance guard (guards.py),
rank agreement (agreement.py), checkpoints (checkpoints.py), overlap with
backward (overlap.py), fixed-address buffers for graphs (capture.py), the
fused buffers and their error feedback (exchange.py). The maths lives in
`functional.py`; the stage machines in the optimizer classes.
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .. import collectives
from ..backends.base import DEFAULT_BLOCK_SIZE
from ..backends.stats import TrafficStats, fp32_allreduce_bytes
from ..graphs import GraphedRegion
from . import functional as F
from .agreement import RankAgreement, ReplicaDivergenceError, check_params_served  # noqa: F401
from .capture import StaticBuffers
from .checkpoints import COUNTERS_KEY, Checkpoints
from .checks import (check_block_size, check_flag, check_number, check_positive_int,
                     check_whole_parameters, scale_dtype_from)
from .exchange import ErrorFeedbackExchange, GroupKey, LateKey
from .guards import ZeroVarianceGuard
from .late import LateJoiners
from .overlap import Overlapping, exchange_group
from .telemetry import Telemetry



class OnebitOptimizer(RankAgreement, Checkpoints, LateJoiners, Telemetry, Overlapping,
                      StaticBuffers, torch.optim.Optimizer):
    """Base class; see OnebitAdam for the user-facing documentation.

    `process_group` is the data-parallel group (default: the world, or no
    communication at all when torch.distributed is not initialised).
    """

    # GradScaler then hands us `grad_scale` and `found_inf` instead of
    # stepping only on ranks that saw finite gradients (which would hang).
    _step_supports_amp_scaling = True

    def __init__(self, params, defaults: dict, comm_backend_name: Optional[str], cuda_aware: bool,
                 process_group=None, timeout_s: Optional[float] = None,
                 check_replicas_every: int = 0, graph_capture: bool = False,
                 block_size: int = DEFAULT_BLOCK_SIZE, scale_dtype="float32",
                 overlap_backward: bool = False, bucket_cap_mb: float = 25.0) -> None:
        # What the subclass set before calling us: its stage settings
        # (freeze_step, var_update_scaler, ...), part of the rank fingerprint.
        settings = {k: v for k, v in vars(self).items() if isinstance(v, (int, float, str, tuple))}
        check_positive_int("check_replicas_every", check_replicas_every, minimum=0)
        check_flag("graph_capture", graph_capture)
        check_flag("cuda_aware", cuda_aware)
        collectives.check_timeout(timeout_s)
        # It changes the rounding of the update, so ranks must agree on it too.
        self.graph_capture = settings["graph_capture"] = graph_capture
        check_block_size(block_size)
        self.block_size = settings["block_size"] = block_size
        self.scale_dtype = scale_dtype_from(scale_dtype)
        settings["scale_dtype"] = str(self.scale_dtype)
        check_flag("overlap_backward", overlap_backward)
        check_number("bucket_cap_mb", bucket_cap_mb, low=0.0, low_open=True)
        # Both decide the bucket plan, which every rank must share.
        settings["overlap_backward"], settings["bucket_cap_mb"] = overlap_backward, bucket_cap_mb
        super().__init__(params, defaults)
        self.timeout_s = timeout_s
        self.check_replicas_every = check_replicas_every
        self.process_group = process_group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(process_group) if self.distributed else 1
        self.cuda_aware = cuda_aware
        from ..backends import backend_name, get_backend

        self.comm_backend_name = backend_name(comm_backend_name)
        self.backend = None
        # Where this optimizer's own collectives (averaging, agreement) take tensors.
        self.comm_device = collectives.communication_device(process_group) \
            if self.distributed else torch.device("cpu")
        if self.world_size > 1:
            check_params_served(type(self).__name__, self.param_groups, process_group)
            # MPI has its own communicator and no deadlines; torch.distributed
            # backends take the process group and the deadline.
            mpi = self.comm_backend_name.startswith("mpi")
            kwargs = {"cuda_aware": cuda_aware} if mpi else {"timeout_s": timeout_s}
            group = None if mpi else process_group
            if overlap_backward and not mpi:  # the communication thread's own group (overlap.py)
                group = exchange_group(process_group)
            # The optimizer checks gradients (and agrees across ranks) itself.
            self.backend = get_backend(self.comm_backend_name, group=group, check_finite=False,
                                       block_size=block_size, scale_dtype=self.scale_dtype,
                                       **kwargs)
            self._check_ranks_agree(settings)
            self._broadcast_parameters()
        self._settings = settings  # re-checked when a param group is added
        # The fused buffers, their layouts and error feedback (exchange.py).
        self._ef_exchange = ErrorFeedbackExchange(self.backend)
        self._zero_variance = ZeroVarianceGuard()
        self._denoms: Dict[int, tuple] = {}  # group index -> (key, cached denominators)
        self._grads_averaged_externally = False  # set by the DDP hook for one step
        self._graph_regions: Dict[str, GraphedRegion] = {}
        self._static: Dict[tuple, object] = {}  # buffers kept from step to step (see capture.py)
        self._trainable_signature = None  # see _notice_trainable_changes
        self.traffic = TrafficStats()  # full-precision averaging (the backend counts its own)
        self._skipped_steps = 0
        self._last_step: Dict[str, object] = {}
        self._window = self._traffic_snapshot()  # traffic since the last step ended
        self._share_counters(self._initial_counters())
        self._setup_overlap(overlap_backward, bucket_cap_mb)

    # ------------------------------------------------------------ counters --
    def _initial_counters(self) -> dict:
        # The name tells a checkpoint's reader which optimizer's state it is.
        return {"optimizer": type(self).__name__, "step": 0}

    def _counters_at(self, step: int) -> dict:
        """The counters after `step` steps of full-precision Adam (what a
        torch.optim.Adam checkpoint means, see checkpoints.py)."""
        return {**self._initial_counters(), "step": step}

    @property
    def counters(self) -> dict:
        """The counters that decide the stage. They live in every param group
        (one dict, shared), where torch's tooling (torch.distributed.checkpoint,
        FSDP2, Accelerate) expects optimizer state that is not per-param."""
        return self.param_groups[0][COUNTERS_KEY]

    def _share_counters(self, counters: dict) -> None:
        for g in self.param_groups:
            g[COUNTERS_KEY] = counters

    # ---------------------------------------------------------------- step --
    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step (see the class docs for what each stage does).

        Shared by every onebit optimizer: gather fp32 gradients (a missing
        .grad counts as zero), average them in full precision when this step
        needs it, agree across ranks on skipping a non-finite step, then let
        the subclass's `_update` do the maths for step t.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t = self.counters["step"] + 1
        full = self.needs_full_precision_gradients()
        stage = self.stage()
        self._mark_late()
        self._notice_trainable_changes()
        groups = [(self._with_float_lr(g), self._trainable(g)) for g in self.param_groups]
        late = [(g, self._late(raw)) for (g, _), raw in zip(groups, self.param_groups)]
        grads = [self._gradients(ps) for _, ps in groups]
        late_grads = [self._gradients(ps) for _, ps in late]
        # Before any collective that depends on them, the ranks agree on which
        # params train (else the exchanges would not match: gloo aborts the
        # process) and on skipping a non-finite step, in one tiny all-gather.
        try:
            skip = self._skip_for_nonfinite(grads + late_grads)
        except BaseException:
            self._end_overlap()  # undoes what backward exchanged (overlap.py)
            raise
        if skip:
            self._end_overlap()
            self._skipped_steps += 1
            self._end_window(t, stage, skipped=True)
            return loss
        exchanged_in_buckets = self._overlap is not None and self._exchange_during_backward()
        if full:
            for i, gs in enumerate(grads):
                self._average_(GroupKey(i), gs)
        if not self._grads_averaged_externally:  # late joiners: full precision (late.py)
            for i, gs in enumerate(late_grads):
                self._average_(LateKey(i), gs)
        self._grads_averaged_externally = False  # the DDP hook's promise covers one step
        self.counters["step"] = t
        self._step_in_progress = t  # what an exchange input written from here on is for
        try:
            if exchanged_in_buckets:  # wait for them (a GradScaler's unscaling: exchange again)
                self._overlap.settle([ps for _, ps in groups], grads,
                                     relaunch=getattr(self, "grad_scale", None) is not None)
            self._update(t, groups, grads)
        finally:
            self._step_in_progress = None
            self._end_overlap()
        self._late_step(late, late_grads)
        if (self.check_replicas_every and self.world_size > 1 and t % self.check_replicas_every == 0
                and self._replicas_should_match(t)):
            self._check_replicas(t)
        self._end_window(t, stage, skipped=False)
        return loss

    def _update(self, t: int, groups: list, grads: list) -> None:
        """The maths of step t: groups is [(param_group, trainable params)],
        grads the matching fp32 gradients (averaged when full precision)."""
        raise NotImplementedError

    def add_param_group(self, param_group: dict) -> None:
        """torch.optim's add_param_group, made safe for data parallelism: every
        rank must add the same group at the same step (checked, like the
        construction), and its params start from rank 0's values. A group
        added after the variance froze gets its own warmup (late.py)."""
        params = param_group["params"]
        if not isinstance(params, (torch.Tensor, set)):  # a generator is read once
            params = param_group["params"] = list(params)
        check_whole_parameters(type(self).__name__, [params] if isinstance(params, torch.Tensor)
                               else params)
        super().add_param_group(param_group)
        if not hasattr(self, "_settings"):  # torch's __init__ adding the first groups
            return
        self.param_groups[-1][COUNTERS_KEY] = self.counters
        if self.world_size > 1:
            check_params_served(type(self).__name__, self.param_groups, self.process_group)
            self._check_ranks_agree(self._settings)
            self._broadcast_parameters(groups=self.param_groups[-1:])
        self._watch_group(self.param_groups[-1])
        self._on_group_added()

    def _on_group_added(self) -> None:
        """Subclasses size their per-group counters here."""

    @staticmethod
    def _with_float_lr(group: dict) -> dict:
        """The group as the maths reads it: a 0-dim tensor lr (torch.optim
        accepts one) read once as a float; the group itself keeps the tensor,
        which schedulers update in place."""
        lr = group["lr"]
        return {**group, "lr": float(lr)} if isinstance(lr, torch.Tensor) else group

    def mark_gradients_averaged(self) -> None:
        """The DDP comm hook's promise: this step's gradients reach step()
        already averaged in full precision (over this optimizer's group), so
        step() does not average them again. It covers one step."""
        self._grads_averaged_externally = True

    # ------------------------------------------------------------- tensors --
    def _trainable(self, group) -> List[torch.Tensor]:
        """The params this optimizer trains with its own stages: those that
        require grad, less late joiners in their own warmup (late.py). A param
        whose .grad is None at a step counts as a zero gradient, so every rank
        flattens the same layout."""
        return [p for p in group["params"] if p.requires_grad and not self._is_late(p)]

    def _state_tensor(self, p: torch.Tensor, name: str) -> torch.Tensor:
        st = self.state[p]
        t = st.get(name)
        if t is None:
            t = st[name] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        return t

    def _moments(self, group, params: List[torch.Tensor], grads: List[torch.Tensor]):
        """Clip this group's gradients (max_grad_norm) and return its fp32
        (exp_avg, exp_avg_sq) state tensors, created on first use."""
        self._clip_(grads, group["max_grad_norm"])
        return ([self._state_tensor(p, "exp_avg") for p in params],
                [self._state_tensor(p, "exp_avg_sq") for p in params])

    def _gradients(self, params: List[torch.Tensor]) -> List[torch.Tensor]:
        """fp32 gradients, unscaled when a GradScaler handed us its scale."""
        grads = []
        for p in params:
            if p.grad is None:
                g = torch.zeros_like(p, dtype=torch.float32)
            elif p.grad.is_sparse:
                raise ValueError(f"{type(self).__name__} does not support sparse gradients")
            else:
                g = p.grad.detach()
                g = g.float() if g.dtype != torch.float32 else g
            grads.append(g)
        scale = getattr(self, "grad_scale", None)
        if scale is not None and grads:
            torch._foreach_mul_(grads, (1.0 / scale.double()).float().item())
        return grads

    # -------------------------------------------------------- communication --
    def _average_(self, key, tensors: List[torch.Tensor]) -> None:
        """Full-precision mean across ranks, as one collective on fused buffer
        `key` (a GroupKey, or a LateKey for late joiners)."""
        if self.world_size == 1 or self._grads_averaged_externally or not tensors:
            return

        def all_reduce(flat: torch.Tensor) -> None:
            started = time.perf_counter()
            self._collective("gradient averaging (full-precision all-reduce)",
                             lambda: dist.all_reduce(flat, group=self.process_group, async_op=True))
            nominal = fp32_allreduce_bytes(sum(t.numel() for t in tensors), self.world_size)
            self.traffic.add(nominal, nominal, nominal, time.perf_counter() - started)

        self._ef_exchange.average_(key, tensors, all_reduce, self.world_size)

    def _compressed_average_(self, index: int, tensors: List[torch.Tensor]) -> None:
        """1-bit error-compensated mean across ranks of `tensors` (group
        `index`'s trained params' order), fused into one compressed_allreduce
        (each tensor on its own blocks); with overlap_backward, over the
        group's buckets (overlap.py)."""
        if self.world_size == 1 or not tensors:
            return
        if self._overlap is not None:
            for _ in self._overlap.exchange_now(
                    index, lambda b, views: torch._foreach_copy_(views, b.pick(tensors)),
                    tensors, [True] * len(tensors), [None] * len(tensors)):
                pass
            return
        self._ef_exchange.compressed_average_(GroupKey(index), tensors)

    def reset_compression_errors(self) -> None:
        """Forget the error-feedback buffers (they restart from zero)."""
        self._ef_exchange.reset()

    # -------------------------------------------------------- graph capture --
    def _collective(self, phase: str, start) -> None:
        collectives.run(f"{type(self).__name__}: {phase}", start, self.timeout_s, self.process_group)

    def _device(self) -> torch.device:
        for g in self.param_groups:
            for p in g["params"]:
                return p.device
        return torch.device("cpu")

    def _forget_layouts(self) -> None:
        self._ef_exchange.forget_layouts()
        self._zero_variance.clear()
        self._denoms.clear()
        self._graph_regions.clear()
        self._static.clear()

    def _clip_(self, grads: List[torch.Tensor], max_norm: float) -> None:
        if max_norm > 0 and grads:
            total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
            coef = max_norm / (float(total) + 1e-6)
            if coef < 1.0:
                torch._foreach_mul_(grads, coef)

    def _broadcast_parameters(self, groups=None) -> None:
        """Start every rank from rank 0's parameters (one collective per group)."""
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        for group in self.param_groups if groups is None else groups:
            params = [p for p in group["params"]]
            if not params:
                continue
            with torch.no_grad():
                flat = torch.cat([p.detach().reshape(-1).float() for p in params])
                self._collective("broadcast of rank 0's initial parameters",
                                 lambda: dist.broadcast(flat, src=src, group=self.process_group,
                                                        async_op=True))
                for p, v in zip(params, flat.split([p.numel() for p in params])):
                    p.copy_(v.view_as(p))

    # ----------------------------------------------------------------- DDP --
    def ddp_hook_state(self):
        """State for `model.register_comm_hook(opt.ddp_hook_state(), onebit.ddp_comm_hook)`."""
        from ..ddp import OnebitHookState

        return OnebitHookState(self)

    def _variance_frozen(self) -> bool:
        """Whether v is frozen for the coming step (a param that starts
        training now has v = 0 and is not moved: see agreement.py)."""
        raise NotImplementedError

    def needs_full_precision_gradients(self) -> bool:
        """Whether the coming step averages gradients in full precision (the
        DDP hook asks this during backward)."""
        raise NotImplementedError

    def _seen(self, index: int, group, exp_avg_sqs: List[torch.Tensor], version):
        """The zero-variance guard's (seen, masks) for group `index` (see
        guards.py); `version` names v as in `_denominators`. Where v changes
        every step and there is no weight decay, nothing can move an unseen
        element (its m is 0 too), so nothing is checked."""
        if version is None and not group["weight_decay"]:
            return [True] * len(exp_avg_sqs), [None] * len(exp_avg_sqs)
        return self._zero_variance.check(index, exp_avg_sqs, version)

    @staticmethod
    def _mask_(group, tensors: List[torch.Tensor]) -> None:
        """Multiply each tensor by the group's exp_avg_mask (DeepSpeed semantics:
        1-bit signs cannot represent exact zeros, so positions known to stay 0
        are forced back to 0 after every compressed exchange)."""
        for t in tensors:
            mask = OnebitOptimizer._group_mask(group, t.device)
            if mask is None:
                return
            t.mul_(mask)

    @staticmethod
    def _group_mask(group, device: torch.device) -> Optional[torch.Tensor]:
        """The group's exp_avg_mask on `device` (moved there once), or None."""
        mask = group.get("exp_avg_mask")
        if mask is not None and mask.device != device:
            mask = group["exp_avg_mask"] = mask.to(device)
        return mask

    def _denominators(self, index: int, group, exp_avg_sqs: List[torch.Tensor], bc2: float,
                      version) -> List[torch.Tensor]:
        """sqrt(v / bc2) + eps, cached while v is frozen.

        `version` names the current v (None: v changes every step, no cache).
        Once v stops changing the square root need not be recomputed each step:
        this buffer (one fp32 copy of the group) is what makes the compression
        stage cheaper than an Adam step.
        """
        if version is None:
            self._denoms.pop(index, None)
            return F.denominators(exp_avg_sqs, group["eps"], group["eps_inside_sqrt"], bc2,
                                  out=self._scratch("denominators", index, exp_avg_sqs))
        key = (version, group["eps"], group["eps_inside_sqrt"], bc2)
        cached = self._denoms.get(index)
        if cached is None or cached[0] != key:
            cached = self._denoms[index] = (key, F.denominators(
                exp_avg_sqs, group["eps"], group["eps_inside_sqrt"], bc2))
        return cached[1]

    @staticmethod
    def _bias_corrections(group, step: int, variance_updates: int):
        if not group["bias_correction"]:
            return 1.0, 1.0
        b1, b2 = group["betas"]
        return 1.0 - b1 ** step, (1.0 - b2 ** max(variance_updates, 1))


class FreezeStepOptimizer(OnebitOptimizer):
    """1-bit Adam and 1-bit LAMB: full precision up to `freeze_step`, 1-bit after."""

    freeze_step: int

    def compression_started(self, step: Optional[int] = None) -> bool:
        """Whether step `step` (default: the next one) is in the compression stage."""
        t = self.counters["step"] + 1 if step is None else step
        return t > self.freeze_step

    def needs_full_precision_gradients(self) -> bool:
        return not self.compression_started()

    def _exchange_during_backward(self) -> bool:
        return self.world_size > 1 and self.compression_started()

    def _exchange_input_(self, index, params, grads, out, positions) -> None:
        """The new momentum beta1 * m + (1 - beta1) * g, into `out`: m itself
        changes only when step() commits it."""
        m = [self._state_tensor(p, "exp_avg") for p in params]
        F.momentum_into(out, m, grads, self.param_groups[index]["betas"][0])

    def _variance_frozen(self) -> bool:
        return self.compression_started()

    def _warmup_length(self) -> int:
        return self.freeze_step

    def stage(self) -> str:
        return "compression" if self.compression_started() else "warmup"
