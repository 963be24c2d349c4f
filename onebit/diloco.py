"""DiLoCo with 1-bit error-feedback outer gradients.

DiLoCo (Douillard et al., 2023) trains across slow links by talking rarely:
each rank takes `sync_every` (H) steps of its own inner optimizer (AdamW,
say) without any communication, then the ranks average the pseudo-gradient
Δ = (the parameters at the last sync) - (the parameters now), and an outer
optimizer (SGD: the paper's has Nesterov momentum, ours by default none, see
the class) applies the average to the last synced point. Every rank then
continues from the same parameters.

Here Δ travels through the same block-scaled error-compensated 1-bit
allreduce as the optimizers' gradients (`compression="1bit"`, the default):
what the signs and scales could not carry stays in this rank's worker and
server errors and joins the next round's Δ, so nothing is lost, only
delayed. `"bf16"` and `"none"` (fp32) are the baselines, as full-precision
all-reduces.

Use, around the usual loop (no DDP wrapper: inner steps are local):

    inner = torch.optim.AdamW(model.parameters(), lr=3e-4)
    diloco = onebit.DiLoCo(model, inner, sync_every=16)
    for x, y in loader:
        loss_fn(model(x), y).backward()
        inner.step()            # every 16th also makes the outer step
        inner.zero_grad()

The outer step hangs off the inner optimizer's step (a post-step hook), as
torchft's DiLoCo does. A GradScaler that skips an inner step skips the hook
too, so that rank syncs one step later; the ranks still meet, within the
timeout. A warmup (`warmup_steps`) averages gradients in fp32 before each
inner step instead, through a pre-step hook. What is not built yet:
streaming fragments and overlapping the exchange with inner steps
(Streaming DiLoCo).
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Union

import torch
import torch.distributed as dist

from . import collectives
from .backends.stats import TrafficStats, fp32_allreduce_bytes
from .optim.agreement import RankAgreement, nonfinite_flag
from .optim.checkpoints import (ErrorFeedbackRestartNotice, error_feedback_state,
                                 restore_error_feedback)
from .optim.checks import check_flag, check_number, check_positive_int
from .optim.exchange import ErrorFeedbackExchange, GroupKey
from .optim.telemetry import StepTelemetry
from .wire import DEFAULT_BLOCK_SIZE, WIRE_FORMAT_VERSION, check_block_size, scale_dtype_from

COMPRESSIONS = ("1bit", "bf16", "none")
_PSEUDO_GRADIENTS = GroupKey(0)  # the one fused buffer of every round


class DiLoCo:
    """Outer steps every `sync_every` inner steps of `inner_optimizer`.

    model: an nn.Module or an iterable of parameters; the ones that require
      grad when DiLoCo is built are synced (rank 0's values first).
    sync_every: H, inner steps per round (the papers use 16 to 500).
    outer_lr, outer_momentum, nesterov: the outer SGD. The default, plain
      SGD at lr 1.3 (a step a little past the average), measured best on
      our benchmark LM for fp32 and 1-bit pseudo-gradients alike, where
      DiLoCo's published Nesterov (0.7, 0.9) was far worse at a few dozen
      rounds (docs/benchmarks.md). The error feedback already carries what
      a round could not send into the next one.
    warmup_steps: inner steps before the first round in which the ranks
      average their gradients in fp32 before each inner step (synchronous
      data parallelism, as the optimizers' freeze_step); the rounds then
      start from where it ended. Default 0.
    compression: "1bit" (error-feedback 1-bit, see the module doc), "bf16"
      or "none" (fp32).
    process_group, timeout_s: the data-parallel group and the deadline of
      each collective (a dead rank is a CommunicationError, never a hang).
    block_size, scale_dtype, comm_backend_name: the 1-bit wire format and
      backend, as the optimizers take them.
    """

    def __init__(self, model: Union[torch.nn.Module, Iterable[torch.Tensor]],
                 inner_optimizer: torch.optim.Optimizer, sync_every: int,
                 outer_lr: float = 1.3, outer_momentum: float = 0.0, nesterov: bool = False,
                 compression: str = "1bit", warmup_steps: int = 0, process_group=None,
                 timeout_s: Optional[float] = None, block_size: int = DEFAULT_BLOCK_SIZE,
                 scale_dtype="float32", comm_backend_name: Optional[str] = None) -> None:
        check_positive_int("sync_every", sync_every)
        check_positive_int("warmup_steps", warmup_steps, minimum=0)
        check_number("outer_lr", outer_lr, low=0.0)
        check_number("outer_momentum", outer_momentum, high=1.0, high_open=True)
        check_flag("nesterov", nesterov)
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {list(COMPRESSIONS)}, got {compression!r}")
        if nesterov and outer_momentum == 0:
            raise ValueError("nesterov=True needs outer_momentum > 0 (as torch.optim.SGD)")
        check_block_size(block_size)
        self.timeout_s = collectives.check_timeout(timeout_s)
        params = model.parameters() if isinstance(model, torch.nn.Module) else model
        self.params: List[torch.Tensor] = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("DiLoCo: no parameter requires grad")
        self.sync_every, self.compression = sync_every, compression
        self.warmup_steps = warmup_steps
        self.inner_optimizer, self.process_group = inner_optimizer, process_group
        self.world_size = (dist.get_world_size(process_group)
                           if dist.is_available() and dist.is_initialized() else 1)
        self.block_size, self.scale_dtype = block_size, scale_dtype_from(scale_dtype)
        self.inner_steps = self.rounds = 0
        self.backend = None
        self.comm_device = torch.device("cpu")
        if self.world_size > 1:
            self.comm_device = collectives.communication_device(process_group)
            RankAgreement("DiLoCo", process_group, self.timeout_s).check_fields({
                "sync_every and warmup_steps": (sync_every, warmup_steps),
                "the synced parameters (shapes, dtypes)": [(tuple(p.shape), str(p.dtype))
                                                           for p in self.params],
                "compression and wire format": (compression, block_size, str(self.scale_dtype),
                                                WIRE_FORMAT_VERSION, comm_backend_name),
                "outer optimizer": (outer_lr, outer_momentum, nesterov)})
            collectives.broadcast_from_first_rank("DiLoCo: broadcast of rank 0's initial "
                                                  "parameters", self.params, process_group,
                                                  self.timeout_s)
            if compression == "1bit":
                from .backends import get_backend

                self.backend = get_backend(comm_backend_name, group=process_group,
                                           check_finite=False, block_size=block_size,
                                           scale_dtype=self.scale_dtype, timeout_s=self.timeout_s)
        # The last synced point, kept in fp32 whatever the params' dtype: the
        # outer optimizer steps it, and the params are set from it.
        self.anchors = [p.detach().float().clone() for p in self.params]
        self.outer_optimizer = torch.optim.SGD(self.anchors, lr=outer_lr, momentum=outer_momentum,
                                               nesterov=nesterov)
        self._exchange = ErrorFeedbackExchange(self.backend)
        self.traffic = TrafficStats()  # the full-precision baselines (the backend counts 1 bit)
        self._telemetry = StepTelemetry(
            [self.traffic] + ([self.backend.stats] if self.backend is not None else []))
        self._restart_notice = ErrorFeedbackRestartNotice("DiLoCo")
        self.warmup_traffic = TrafficStats()  # the warmup's gradient averaging (not a round's)
        self._hooks = [inner_optimizer.register_step_pre_hook(lambda *_: self._before_inner_step()),
                       inner_optimizer.register_step_post_hook(lambda *_: self._inner_step_done())]

    # ---------------------------------------------------------------- loop --
    def _before_inner_step(self) -> None:
        self._restart_notice.before_step()
        if self.inner_steps < self.warmup_steps and self.world_size > 1:
            self._average_gradients()

    def _inner_step_done(self) -> None:
        self.inner_steps += 1
        past = self.inner_steps - self.warmup_steps
        if past == 0:  # the rounds start from where the warmup ended
            with torch.no_grad():
                for a, p in zip(self.anchors, self.params):
                    a.copy_(p)
        elif past > 0 and past % self.sync_every == 0:
            self.sync()

    @torch.no_grad()
    def _average_gradients(self) -> None:
        """A warmup step: every rank's gradients, averaged in fp32 before
        the inner step (synchronous data parallelism; a missing .grad counts
        as zero, so every rank sends the same buffer)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1).float() for g in grads]).div_(self.world_size).to(
            self.comm_device)
        collectives.run("DiLoCo: averaging the warmup's gradients", lambda: dist.all_reduce(
            flat, group=self.process_group, async_op=True), self.timeout_s, self.process_group)
        nominal = fp32_allreduce_bytes(flat.numel(), self.world_size)
        self.warmup_traffic.add(nominal, nominal, nominal)
        for p, avg in zip(self.params, flat.split([p.numel() for p in self.params])):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(avg.view_as(p))

    @torch.no_grad()
    def sync(self) -> bool:
        """One outer round, now: average the pseudo-gradients, step the
        anchors, set every rank's params to them. Called by the inner
        optimizer's step every `sync_every` steps. Returns False when the
        round was skipped: a pseudo-gradient was not finite on some rank,
        and every rank then goes back to the last synced point."""
        deltas = [a - p.float() for a, p in zip(self.anchors, self.params)]
        round_no = self.rounds + 1
        bad = self._agree_on_round(round_no, deltas)
        if bad:
            for p, a in zip(self.params, self.anchors):
                p.copy_(a)
            self._telemetry.end_step(round_no, self.compression, skipped=True)
            return False
        self._average_(deltas)
        for a, d in zip(self.anchors, deltas):
            a.grad = d
        self.outer_optimizer.step()
        for p, a in zip(self.params, self.anchors):
            a.grad = None
            p.copy_(a)
        self.rounds = round_no
        self._telemetry.end_step(round_no, self.compression, skipped=False)
        return True

    def _average_(self, deltas: List[torch.Tensor]) -> None:
        if self.world_size == 1:
            return
        if self.compression == "1bit":
            self._exchange.compressed_average_(_PSEUDO_GRADIENTS, deltas)
            return
        dtype = torch.bfloat16 if self.compression == "bf16" else torch.float32
        flat = torch.cat([d.reshape(-1) for d in deltas]).div_(self.world_size).to(
            device=self.comm_device, dtype=dtype)
        collectives.run("DiLoCo: averaging pseudo-gradients", lambda: dist.all_reduce(
            flat, group=self.process_group, async_op=True), self.timeout_s, self.process_group)
        nominal = fp32_allreduce_bytes(flat.numel(), self.world_size)
        sent = nominal * dtype.itemsize // 4
        self.traffic.add(sent, sent, nominal)
        for d, avg in zip(deltas, flat.float().split([d.numel() for d in deltas])):
            d.copy_(avg.view_as(d))

    def _agree_on_round(self, round_no: int, deltas: List[torch.Tensor]) -> bool:
        """Whether any rank's pseudo-gradient is not finite; the same
        all-gather checks that every rank is at round `round_no`."""
        flag = nonfinite_flag([deltas], self.comm_device)
        if self.world_size == 1:
            return bool(flag)
        table = collectives.gather_numbers("DiLoCo: agreeing on the outer round", [flag, round_no],
                                           torch.int64, self.process_group, self.timeout_s)
        rounds = [row[1] for row in table]
        if len(set(rounds)) > 1:
            raise ValueError(f"DiLoCo: ranks are at different outer rounds {rounds}: they must "
                             "load the same checkpoint and take the same inner steps")
        return any(row[0] for row in table)

    def close(self) -> None:
        """Stop syncing: remove the hooks on the inner optimizer."""
        for hook in self._hooks:
            hook.remove()

    def __enter__(self) -> "DiLoCo":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------- telemetry --
    def comm_stats(self) -> Dict[str, object]:
        """The last round's and the run's traffic, as the optimizers'
        comm_stats(): step is the round, stage the compression; bytes are
        this rank's share, fp32_bytes what an fp32 all-reduce of the same
        pseudo-gradients sends; inner_steps, bytes_per_inner_step (the
        rounds' total over the inner steps since the warmup) and
        warmup_bytes_sent (its fp32 gradient averaging) besides."""
        report = self._telemetry.report(self.rounds, self.world_size,
                                        self._exchange.error_buffers().values())
        report["skipped_rounds"] = report.pop("skipped_steps")
        report["inner_steps"] = self.inner_steps
        since = self.inner_steps - min(self.inner_steps, self.warmup_steps)
        report["bytes_per_inner_step"] = report["total_bytes_sent"] / since if since else 0.0
        report["warmup_bytes_sent"] = self.warmup_traffic.totals["bytes_sent"]
        return report

    # --------------------------------------------------------- checkpoints --
    def state_dict(self) -> dict:
        """What every rank shares: the counters, the anchors, the outer
        optimizer's momentum. Save it with the model's and the inner
        optimizer's state; the error buffers are per rank
        (`error_feedback_state_dict`)."""
        return {"sync_every": self.sync_every, "compression": self.compression,
                "warmup_steps": self.warmup_steps,
                "inner_steps": self.inner_steps, "rounds": self.rounds,
                "anchors": [a.detach().clone() for a in self.anchors],
                "outer_optimizer": self.outer_optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Load what `state_dict` saved (the same parameters, the same H and
        compression, else a ValueError and nothing changes). Resets the error
        buffers: restore this rank's with `load_error_feedback_state_dict`."""
        for name in ("sync_every", "compression", "warmup_steps"):
            if state.get(name, 0 if name == "warmup_steps" else None) != getattr(self, name):
                raise ValueError(f"DiLoCo.load_state_dict: the checkpoint has {name}="
                                 f"{state.get(name)!r}, this DiLoCo {getattr(self, name)!r}. "
                                 "Nothing was loaded")
        anchors = state["anchors"]
        if [tuple(a.shape) for a in anchors] != [tuple(a.shape) for a in self.anchors]:
            raise ValueError("DiLoCo.load_state_dict: the checkpoint's parameters have other "
                             "shapes. Nothing was loaded")
        with torch.no_grad():
            for mine, saved in zip(self.anchors, anchors):
                mine.copy_(saved)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.inner_steps, self.rounds = int(state["inner_steps"]), int(state["rounds"])
        self._exchange.load_errors(None)
        self._restart_notice.loaded(self.backend is not None and self.rounds > 0)

    def _rank(self) -> int:
        return dist.get_rank(self.process_group) if self.world_size > 1 else 0

    def _error_layouts(self) -> dict:
        return self._exchange.layouts([self.params])

    def error_feedback_state_dict(self) -> dict:
        """This rank's worker and server errors (they differ on every rank):
        with them, a resume at the same world size is bitwise identical."""
        return error_feedback_state(self._exchange, self._error_layouts(), self.params[0].device,
                                    self._error_identity())

    def _error_identity(self) -> dict:
        return {"rank": self._rank(), "world_size": self.world_size, "rounds": self.rounds,
                "wire_format": WIRE_FORMAT_VERSION, "block_size": self.block_size}

    def load_error_feedback_state_dict(self, state: dict) -> bool:
        """Restore this rank's errors; at another world size, rank, round,
        block size or wire format they restart from zero and this returns
        False. Call it after `load_state_dict`."""
        loaded = restore_error_feedback(self._exchange, state, self._error_layouts(),
                                        self._error_identity())
        if loaded:
            self._restart_notice.restored()
        return loaded
