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
delayed. `"2bit"` sends -1, 0 or +1 times each block's scale instead
(backends/codecs.py), with the same error feedback. `"bf16"` and `"none"`
(fp32) are the baselines, as full-precision all-reduces.

Use, around the usual loop (no DDP wrapper: inner steps are local):

    inner = torch.optim.AdamW(model.parameters(), lr=3e-4)
    diloco = onebit.DiLoCo(model, inner, sync_every=16)
    for x, y in loader:
        loss_fn(model(x), y).backward()
        inner.step()            # every 16th also makes the outer step
        inner.zero_grad()

The outer step hangs off the inner optimizer's step (a post-step hook), as
torchft's DiLoCo does. torch's GradScaler, skipping an inner step on the
rank that overflowed alone, skips the hook too, so that rank syncs one step
later (the others wait for it), and `close()` catches it up at the end of
the loop; onebit.amp.GradScaler makes every rank skip that step instead.
A warmup (`warmup_steps`) averages gradients in fp32 before each
inner step instead, through a pre-step hook.

Streaming DiLoCo (Douillard et al., 2025): `fragments=F` syncs F slices of
the model at staggered inner steps (fragments.py), and `overlap_steps=tau`
runs each fragment's exchange on a communication thread while the next tau
inner steps go on; its outer step then lands, from the pseudo-gradient
measured at the launch. By default the fragment's params are then set to
its new anchor (torchft's fragment_update_alpha = 0): every rank again
holds the same values there, and the tau inner steps taken since the
launch are lost. `keep_local_progress=1` adds this rank's own progress
since the launch back on top of the new anchor instead (the anchors are
still the same everywhere; the params differ by what each rank did in those
tau steps, as they do between rounds anyway). `fragment_update_alpha=a`
(torchft's name and Streaming DiLoCo's mixing) lands the fragment at
(1 - a) * new anchor + a * this rank's params instead. The thread has a process
group of its own, so its collectives never interleave with the training
loop's. `fragments=1,
overlap_steps=0` is plain DiLoCo.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .. import collectives
from ..backends.codecs import CODECS
from ..backends.stats import TrafficStats
from ..checks import check_each_parameter_once, check_flag, check_number, check_positive_int
from ..feedback.agreement import RankAgreement, group_settings, nonfinite_flag
from ..feedback.channel import ErrorFeedbackChannel, open_backend, wire_backend_name
from ..feedback.exchange import GroupKey
from ..feedback.handoff import StreamHandoff, exchange_group
from ..half_precision import share
from ..shards import ShardedParams, local, placed_like
from ..wire import DEFAULT_BLOCK_SIZE, WIRE_FORMAT_VERSION, check_block_size, scale_dtype_from
from .fragments import FragmentPlan
from .misuse import ParamWriteWatch, ddp_in_call_stack

COMPRESSIONS = ("1bit", "2bit", "bf16", "none")
_DDP_MISUSE = ("DiLoCo: the model is wrapped in DistributedDataParallel, which all-reduces every "
               "gradient at every step, in full precision: DiLoCo would save nothing. DiLoCo's "
               "inner steps are local: pass the bare model, with no DDP wrapper")


@dataclass
class _FragmentRound:
    """A fragment's pseudo-gradients from their launch to their outer step:
    `deltas` hold the average once `skipped` is known (the thread's `future`
    has finished, or there was none). With 1-bit or 2-bit compression they are views
    of the fragment's exchange buffer, which its next launch rewrites: the
    round has landed by then (overlap_steps < sync_every)."""

    deltas: List[torch.Tensor]
    # This rank's params at the launch (fp32), for keep_local_progress.
    launch_points: Optional[List[torch.Tensor]] = None
    # The fragment's params frozen at the launch (positions in it; None: a
    # round restored from a checkpoint written before they were saved,
    # decided at its landing instead).
    frozen: Optional[List[int]] = None
    skipped: Optional[bool] = None
    closed: bool = False  # a proposal from close() that no rank launched (_catch_up)
    at_anchor: bool = False  # close(sync=True)'s last round: it lands on the new anchors
    # Where a schedule sets the outer lr: the inner step of its landing in
    # the schedule, and the lr read at the launch (_round_lr): there, or
    # (`planned` False) at the launch step, where the schedule gives none
    # there. None: it gave none at either, or the round was restored.
    lands_at: Optional[int] = None
    lr: Optional[float] = None
    planned: bool = True
    future: Optional[Future] = None  # returns the event after the exchange's device work


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
      a round could not send into the next one. outer_lr may also be a
      function of the inner steps taken (warmup included) at a round's
      place in the schedule, where its outer step lands (its launch plus
      overlap_steps; sync() lands at once), returning its lr; every rank
      reads it there, a rank that lags behind its peers (a skipped inner
      step) and lands in close() included: `onebit.SteppedOuterLR`
      makes the step larger once the first fast-changing rounds are past,
      which 1-bit pseudo-gradients (block-scaled signs, a normalised step)
      measured better with than fp32 ones.
    warmup_steps: inner steps before the first round in which the ranks
      average their gradients in fp32 before each inner step (synchronous
      data parallelism, as the optimizers' freeze_step); the rounds then
      start from where it ended. Default 0. After a warmup, 1-bit
      pseudo-gradients measured best at a larger outer lr (2.0), where
      fp32's stayed near 1.3: the block-scaled signs make a normalised
      step (docs/benchmarks.md).
    fragments: F, slices of the params (consecutive, about equal elements)
      synced at staggered inner steps, each once per H (Streaming DiLoCo);
      each keeps its own error buffers. Default 1.
    overlap_steps: tau, inner steps a fragment's exchange runs behind
      (0: the inner step that launches it waits for it); below sync_every.
    compression: "1bit" (error-feedback 1-bit, see the module doc),
      "2bit" (error-feedback ternary: -1, 0 or +1 times each block's scale,
      onebit/backends/codecs.py; over the "compressed" backend), "bf16" or
      "none" (fp32).
    keep_local_progress: with overlap_steps > 0, the share in [0, 1] of
      this rank's progress since a fragment's launch (its params then and
      now) that the fragment keeps on top of its new anchor when the outer
      step lands: 0 (the default) drops it, 1 re-adds all of it. It costs a
      copy of the fragment's params per exchange in flight, saved with
      this rank's `error_feedback_state_dict` (docs/usage.md, streaming
      DiLoCo; measured in docs/benchmarks.md: not better here at tau = 3).
    fragment_update_alpha: the share in [0, 1] of this rank's current params
      mixed into a landing fragment: p = (1 - alpha) * new anchor + alpha * p
      (torchft's fragment_update_alpha; Streaming DiLoCo's mixing). 0, the
      default, sets p to the new anchor. Not with keep_local_progress.
      (Measured in docs/benchmarks.md at tau = 3: 0.1 within noise of 0,
      0.5 far worse with an outer lr of 2.0.)
    process_group, timeout_s (keyword-only, as the options after them):
      the data-parallel group and the deadline of
      each collective (a dead rank is a CommunicationError, never a hang).
      With FSDP2-sharded params (fully_shard on a mesh's "shard" dim), the
      mesh's replicate group: each rank's anchors, outer momentum and
      errors are those of its local shards (onebit/shards.py).
    block_size, scale_dtype, comm_backend_name: the 1-bit wire format and
      backend, as the optimizers take them.
    """

    def __init__(self, model: Union[torch.nn.Module, Iterable[torch.Tensor]],
                 inner_optimizer: torch.optim.Optimizer, sync_every: int,
                 outer_lr: Union[float, Callable[[int], float]] = 1.3,
                 outer_momentum: float = 0.0, nesterov: bool = False,
                 compression: str = "1bit", warmup_steps: int = 0, fragments: int = 1,
                 overlap_steps: int = 0, *, keep_local_progress: float = 0.0,
                 fragment_update_alpha: float = 0.0, process_group=None,
                 timeout_s: Optional[float] = None, block_size: int = DEFAULT_BLOCK_SIZE,
                 scale_dtype="float32", comm_backend_name: Optional[str] = None) -> None:
        check_positive_int("sync_every", sync_every)
        check_positive_int("warmup_steps", warmup_steps, minimum=0)
        check_positive_int("fragments", fragments)
        check_positive_int("overlap_steps", overlap_steps, minimum=0)
        check_number("keep_local_progress", keep_local_progress, low=0.0, high=1.0)
        check_number("fragment_update_alpha", fragment_update_alpha, low=0.0, high=1.0)
        if keep_local_progress > 0 and fragment_update_alpha > 0:
            raise ValueError("DiLoCo: keep_local_progress and fragment_update_alpha each say "
                             "where a landing fragment goes: set one of them, not both")
        # A schedule is read at every landing; its first value is checked now.
        self._outer_lr_at = outer_lr if callable(outer_lr) else None
        first_lr = outer_lr(0) if callable(outer_lr) else outer_lr
        check_number("outer_lr", first_lr, low=0.0)
        check_number("outer_momentum", outer_momentum, high=1.0, high_open=True)
        check_flag("nesterov", nesterov)
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {list(COMPRESSIONS)}, got {compression!r}")
        if nesterov and outer_momentum == 0:
            raise ValueError("nesterov=True needs outer_momentum > 0 (as torch.optim.SGD)")
        check_block_size(block_size)
        self.timeout_s = collectives.check_timeout(timeout_s)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ValueError(_DDP_MISUSE)
        params = list(model.parameters() if isinstance(model, torch.nn.Module) else model)
        odd = next((p for p in params if not isinstance(p, torch.Tensor)), None)
        if odd is not None:
            raise ValueError(f"DiLoCo: model must be an nn.Module or an iterable of its "
                             f"parameters (tensors), got an element of type "
                             f"{type(odd).__name__} (for named_parameters(), pass "
                             f"model.parameters() or the model itself)")
        self.params: List[torch.Tensor] = [p for p in params if p.requires_grad]
        # The rounds sync self.params only: one of these unfrozen later would
        # train on every rank apart, never synced (checked at each inner step).
        self._frozen_when_built = [p for p in params if not p.requires_grad]
        if not self.params:
            raise ValueError("DiLoCo: no parameter requires grad")
        # A tensor listed twice would get two anchors and, in two fragments,
        # two outer steps a round.
        check_each_parameter_once("DiLoCo", self.params)
        self._shards = ShardedParams("DiLoCo", [{"params": self.params}], process_group)
        # Fragments by whole-param sizes: every shard of the model launches
        # and lands the same fragment at the same inner step.
        self.plan = FragmentPlan.split([p.numel() for p in self.params], fragments, sync_every,
                                       overlap_steps)
        self.sync_every, self.compression = sync_every, compression
        self.warmup_steps = warmup_steps
        self.fragments, self.overlap_steps = fragments, overlap_steps
        self.keep_local_progress = float(keep_local_progress)
        self.fragment_update_alpha = float(fragment_update_alpha)
        self.inner_optimizer, self.process_group = inner_optimizer, process_group
        self.world_size = (dist.get_world_size(process_group)
                           if collectives.is_distributed("DiLoCo") else 1)
        self.block_size, self.scale_dtype = block_size, scale_dtype_from(scale_dtype)
        self.inner_steps = self.rounds = 0
        # Exchanges launched so far, every fragment's: the ranks check they
        # agree on it (a rank whose GradScaler skipped an inner step launches
        # a step later, and the ranks still meet).
        self.launches = 0
        self.backend = None
        self.comm_device = torch.device("cpu")
        # The rounds' collectives: on the communication thread's own group
        # when they overlap inner steps.
        self._round_group = self._agree_group = process_group
        self._thread: Optional[ThreadPoolExecutor] = None
        if self.world_size > 1:
            self.comm_device = collectives.communication_device(process_group,
                                                                self.params[0].device)
            # The backend each rank will open, by its registered name: None,
            # DeepSpeed's "nccl" and "compressed" are one backend. (Moot for
            # rounds in bf16 or fp32, which use none.)
            wire = wire_backend_name(self._shards.comm_backend(comm_backend_name),
                                     CODECS.get(compression), process_group, self.timeout_s,
                                     self.comm_device)
            RankAgreement("DiLoCo", process_group, self.timeout_s).check_fields({
                "sync_every and warmup_steps": (sync_every, warmup_steps),
                "fragments, overlap_steps, keep_local_progress and fragment_update_alpha": (
                    fragments, overlap_steps, self.keep_local_progress,
                    self.fragment_update_alpha),
                "the synced parameters (which of the model's, shapes, dtypes)": (
                    len(params), [i for i, p in enumerate(params) if p.requires_grad],
                    [(tuple(p.shape), str(p.dtype)) for p in self.params]),
                "compression and wire format": (compression, block_size, str(self.scale_dtype),
                                                WIRE_FORMAT_VERSION, wire),
                # a schedule by its values at the first rounds' landings,
                # the inner steps _land reads it at
                "outer optimizer": ([outer_lr(step) for step in self._first_landings(65)]
                                    if callable(outer_lr) else outer_lr,
                                    outer_momentum, nesterov),
                **(self._shards.replica_fields() if self._shards.sharded else {})})
            collectives.broadcast_from_first_rank("DiLoCo: broadcast of rank 0's initial "
                                                  "parameters", self._locals(), process_group,
                                                  self.timeout_s)
            if overlap_steps:
                self._round_group = exchange_group(process_group)
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="onebit-diloco")
            # Sharded: a round is skipped on every shard of the model or on none.
            self._agree_group = self._round_group
            if self._shards.sharded:
                self._agree_group = (exchange_group(self._shards.mesh_group) if overlap_steps
                                     else self._shards.mesh_group)
            if compression in CODECS:
                self.backend = open_backend(wire, self._round_group, timeout_s=self.timeout_s,
                                            cuda_aware=False, block_size=block_size,
                                            scale_dtype=self.scale_dtype,
                                            codec=CODECS[compression])
        elif self._shards.sharded:
            # One replica of shards (a 1 x N mesh): no exchange, but a round
            # is still skipped on every shard of the model or on none.
            self._agree_group = self._shards.mesh_group
            self.comm_device = collectives.communication_device(self._agree_group,
                                                                self.params[0].device)
        # The last synced point, kept in fp32 whatever the params' dtype: the
        # outer optimizer steps it, and the params are set from it.
        self.anchors = [p.detach().float().clone() for p in self._locals()]
        self.outer_optimizer = torch.optim.SGD(self.anchors, lr=first_lr, momentum=outer_momentum,
                                               nesterov=nesterov)
        if outer_momentum:  # zeros step as SGD's first clone does; the state_dict keeps one
            for a in self.anchors:  # shape from the start (DCP loads into a fresh one)
                self.outer_optimizer.state[a]["momentum_buffer"] = torch.zeros_like(a)
        # One fused buffer per fragment, its errors, the traffic and what a checkpoint saves.
        self._channel = ErrorFeedbackChannel(
            "DiLoCo", self.backend, self.world_size,
            dist.get_rank(process_group) if self.world_size > 1 else 0, block_size,
            self._shards.identity())
        self.traffic = self._channel.traffic  # the baselines' (the backend counts its 1 bit)
        # fragment -> its round, from the launch of its exchange to its outer step
        self._in_flight: Dict[int, _FragmentRound] = {}
        self._handoff = StreamHandoff()
        self.warmup_traffic = TrafficStats()  # the warmup's gradient averaging (not a round's)
        self._hooks = [inner_optimizer.register_step_pre_hook(lambda *_: self._before_inner_step()),
                       inner_optimizer.register_step_post_hook(lambda *_: self._inner_step_done())]
        # Misuse that would go silent (misuse.py): a DDP wrapper, and
        # params stepped by an optimizer DiLoCo does not hook.
        self._writes = ParamWriteWatch(lambda: self.params)
        self._steps_at_start, self._armed = self.inner_steps, False
        # Built, not loaded: weights written before the first forward (a
        # pretrained model loaded now, say) are where the first round starts.
        self._fresh, self._closed = True, False
        self._resumed_unchecked = False  # (_check_same_step)
        self._has_forward = isinstance(model, torch.nn.Module)
        if self._has_forward:
            self._hooks.append(model.register_forward_pre_hook(
                lambda module, _: self._before_forward(module)))

    def _first_landings(self, rounds: int) -> List[int]:
        """The inner steps (as counted when a landing reads the outer lr)
        of every fragment's landings in the first `rounds` rounds."""
        return sorted(self.warmup_steps + self.plan.offset(f) + self.plan.delay
                      + k * self.sync_every for f in range(self.plan.count) for k in range(rounds))

    # ---------------------------------------------------------------- loop --
    def _before_inner_step(self) -> None:
        unfrozen = sum(p.requires_grad for p in self._frozen_when_built)
        if unfrozen:
            raise ValueError(
                f"DiLoCo: {unfrozen} param(s) frozen when DiLoCo was built now require grad; "
                "the rounds sync only the params that required grad then, so these would "
                "train on every rank apart. Nothing was stepped. Build DiLoCo with them "
                "trainable (a param no rank has a gradient for stays as it is), or build it "
                "again after unfreezing")
        self._channel.restart_notice.before_step()
        if self.inner_steps < self.warmup_steps and self.world_size > 1:
            self._average_gradients()

    def _before_forward(self, model: torch.nn.Module) -> None:
        if ddp_in_call_stack(model):
            raise ValueError(_DDP_MISUSE)
        self._check_writes("forward")

    def _check_writes(self, where: str) -> None:
        """A ValueError when the params were written while DiLoCo has counted
        no inner step since it was built or loaded: another optimizer steps
        them. Writes before a model's first forward are setup (weights
        loaded after DiLoCo was built or after its state was loaded), taken
        as they are by the first forward or by a state_dict(), sync() or
        close() before it: on a fresh build the anchors follow them, so the
        first round starts from the loaded weights (load the same ones on
        every rank, as the construction's broadcast made the params)."""
        if self.inner_steps != self._steps_at_start:
            return
        if not self._armed and self._has_forward:
            if self._writes.moved() and self._fresh:
                self._anchor_at_the_params()
            self._writes.mark()
            self._armed = where == "forward"
            return
        if self._writes.moved():
            raise ValueError(
                f"DiLoCo ({where}): the params changed, but DiLoCo has counted no inner step since "
                "it was built: an optimizer it does not hook is stepping them (one built again "
                "after DiLoCo(...), say), so no round ever runs and the replicas drift apart. "
                "Build the inner optimizer once, pass it to DiLoCo, and step that one")

    @torch.no_grad()
    def _anchor_at_the_params(self) -> None:
        """The last synced point is where the params are now."""
        for a, p in zip(self.anchors, self._locals()):
            a.copy_(p)

    def _inner_step_done(self) -> None:
        self.inner_steps += 1
        past = self.inner_steps - self.warmup_steps
        if past == 0:  # the rounds start from where the warmup ended
            self._anchor_at_the_params()
        elif past > 0:
            for f in self.plan.launching(past):
                self._launch(f, lands_at=self.inner_steps + self.plan.delay)
            for f in self.plan.landing(past):
                if f in self._in_flight:  # not landed early by drain() or sync()
                    self._land(f)

    @torch.no_grad()
    def _average_gradients(self) -> None:
        """A warmup step: every rank's gradients, averaged in fp32 before
        the inner step (synchronous data parallelism). As DDP does, a .grad
        missing on some ranks counts as zero there, and a param that has no
        .grad on any rank keeps none (so the inner optimizer skips it: no
        state, no weight decay). One value per param in the same all-reduce
        says whether this rank has its .grad. The first average after a load
        checks first that the ranks resumed at one inner step
        (_check_same_step)."""
        if self._resumed_unchecked:
            self._check_same_step()
            self._resumed_unchecked = False
        grads = [local(p.grad) if p.grad is not None else torch.zeros_like(local(p))
                 for p in self.params]
        has_grad = torch.tensor([float(p.grad is not None) for p in self.params],
                                device=self.params[0].device)
        *averages, anywhere = self._mean("DiLoCo: averaging the warmup's gradients",
                                         grads + [has_grad], torch.float32,
                                         self.process_group, self.warmup_traffic)
        for p, avg, used in zip(self.params, averages, anywhere.tolist()):
            if not used:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # a DTensor for a sharded param
            local(p.grad).copy_(avg.view_as(local(p)))

    def _check_same_step(self) -> None:
        """A ValueError on every rank, before the warmup's inner step, where
        the ranks resumed at different inner steps (each loaded another
        checkpoint): one all-reduce of (step, -step) for the largest and the
        smallest, once after a load. Else the average paired gradients of
        different steps with no error, until the first round made the
        ranks' collectives differ (a timeout). A collective of its own: in
        the average's buffer it would move gloo's chunks, and the average's
        bits with them."""
        extremes = torch.tensor([self.inner_steps, -self.inner_steps], dtype=torch.int64,
                                device=self.comm_device)
        collectives.run("DiLoCo: agreeing on the inner step after a load",
                        lambda: dist.all_reduce(extremes, op=dist.ReduceOp.MAX,
                                                group=self.process_group, async_op=True),
                        self.timeout_s, self.process_group)
        largest, smallest = extremes[0].item(), -extremes[1].item()
        if largest != smallest:
            raise ValueError(
                f"DiLoCo: ranks resumed at different inner steps of the warmup ({smallest} to "
                f"{largest}; this rank: {self.inner_steps}); nothing was stepped. Load the same "
                "checkpoint on every rank")

    def _mean(self, phase: str, tensors: List[torch.Tensor], dtype: torch.dtype, group,
              traffic: TrafficStats) -> List[torch.Tensor]:
        """The ranks' mean of `tensors`, flat fp32 pieces in their order: one
        all-reduce over `group` in `dtype` (each rank's share divided first),
        counted in `traffic` against fp32."""
        flat = share(torch.cat([t.reshape(-1).float() for t in tensors]), self.world_size,
                     dtype).to(self.comm_device)
        collectives.run(phase, lambda: dist.all_reduce(flat, group=group, async_op=True),
                        self.timeout_s, group)
        traffic.add_allreduce(flat.numel(), self.world_size, dtype.itemsize)
        return list(flat.float().split([t.numel() for t in tensors]))

    @torch.no_grad()
    def sync(self) -> bool:
        """One outer round of every fragment, now: what is in flight lands
        first, then each fragment's pseudo-gradients are averaged and its
        anchors stepped, and every rank's params are set to them. The inner
        steps make the rounds on their schedule; call this to end a run on
        a synced point. Returns False when a fragment's round
        was skipped: its pseudo-gradient was not finite on some rank, and
        every rank went back to its last synced point."""
        self._refuse_closed("sync")
        self._check_writes("sync")
        synced = self.drain()
        for f in range(self.plan.count):
            self._launch(f, lands_at=self.inner_steps)
            synced = self._land(f) and synced
        return synced

    @torch.no_grad()
    def drain(self) -> bool:
        """Land the outer steps of every exchange in flight, now (the end of
        a run); False if one was skipped."""
        synced = True
        for f in sorted(self._in_flight):
            synced = self._land(f) and synced
        return synced

    def _refuse_closed(self, where: str) -> None:
        if self._closed:
            raise ValueError(f"DiLoCo ({where}): this DiLoCo is closed (its hooks are gone and "
                             "its communication thread stopped); build a new one to go on "
                             "training with rounds")

    @property
    def exchanges_in_flight(self) -> int:
        """Fragments whose exchange has started and whose outer step has not
        landed yet (what drain() would wait for)."""
        return len(self._in_flight)

    def _locals(self) -> List[torch.Tensor]:
        """The synced params as this rank holds them: their local shards
        when sharded, taken afresh (FSDP2 rebinds them at lazy init and
        after a load)."""
        return [local(p) for p in self.params]

    def _members(self, fragment: int):
        ids = self.plan.members[fragment]
        return [local(self.params[i]) for i in ids], [self.anchors[i] for i in ids]

    @torch.no_grad()
    def _launch(self, fragment: int, lands_at: int, closing: bool = False) -> None:
        """Measure the fragment's pseudo-gradients and start their exchange
        (on the communication thread when it overlaps inner steps).
        lands_at: the inner step of its landing in the schedule, where it
        reads a scheduled outer lr. closing: a proposal from `close()`,
        exchanged only if some rank launches this exchange from its loop
        (`_catch_up`)."""
        lr, planned = self._round_lr(lands_at)
        params, anchors = self._members(fragment)
        if self.backend is not None:  # straight into the compressed exchange's buffer: no copies
            deltas = self._channel.exchange.prepare(GroupKey(fragment), anchors)
            for d, a, p in zip(deltas, anchors, params):
                torch.sub(a, p, out=d)
        else:
            deltas = [a - p.float() for a, p in zip(anchors, params)]
        job = self._in_flight[fragment] = _FragmentRound(deltas, frozen=self._frozen_in(fragment),
                                                         lands_at=lands_at, lr=lr,
                                                         planned=planned)
        outer = self._outer_digest((lr, planned))  # on the training thread, which sets the lr
        if self._keeps_progress():
            job.launch_points = [p.detach().float().clone() for p in params]
        self.launches += 1
        number = self.launches

        def exchange() -> None:
            job.skipped, job.closed = self._agree_on_round(number, fragment, job.deltas,
                                                           closing, job.frozen, outer)
            if not job.skipped and not job.closed:
                # A frozen param's slices of the errors stay as they were:
                # what they hold is sent when it trains again.
                keep = [self._channel.exchange.keep_tensor_errors(GroupKey(fragment), anchors, j)
                        for j in job.frozen] if self.backend is not None else []
                self._average_(fragment, job.deltas)
                for put_back in keep:
                    put_back()

        if self._thread is None:
            exchange()
            return
        device = job.deltas[0].device
        job.future = self._thread.submit(self._handoff.run_on_comm_thread, device,
                                         self._handoff.produced(device), exchange)

    def _finished(self, job: _FragmentRound) -> None:
        """Wait for a job's exchange (a failure raises here, on the training
        thread); the compute stream then waits for its device work."""
        if job.future is not None:
            done = job.future.result()
            self._handoff.consume(job.deltas[0].device, done)
            job.future = None

    @torch.no_grad()
    def _land(self, fragment: int) -> bool:
        """The fragment's outer step from its averaged pseudo-gradients, and
        its params set to the new anchors (back to the old ones when the
        round was skipped)."""
        lr = self._landing_lr(self._in_flight[fragment])  # a bad value raises first
        if lr is not None:
            for group in self.outer_optimizer.param_groups:
                group["lr"] = lr
        job = self._in_flight.pop(fragment)
        self._finished(job)
        params, anchors = self._members(fragment)
        round_no = self.rounds + 1
        if job.skipped:
            for p, a in zip(params, anchors):
                p.copy_(a)
            self._writes.mark()  # DiLoCo's own write (sync() may land before any inner step)
            self._channel.telemetry.end_step(round_no, self.compression, skipped=True)
            return False
        frozen = set(self._frozen_in(fragment) if job.frozen is None else job.frozen)
        for j, (a, d) in enumerate(zip(anchors, job.deltas)):
            a.grad = None if j in frozen else d
        self.outer_optimizer.step()  # SGD steps only the anchors that have a .grad
        for a in anchors:
            a.grad = None
        if job.at_anchor:  # close(sync=True): every rank on the new anchors
            for p, a in zip(params, anchors):
                p.copy_(a)
        elif self.fragment_update_alpha > 0:  # (1 - alpha) * anchor + alpha * p, in fp32
            for p, a in zip(params, anchors):
                p.copy_(torch.lerp(a, p.float(), self.fragment_update_alpha))
        elif job.launch_points is None:
            for p, a in zip(params, anchors):
                p.copy_(a)
        else:  # anchor + keep * (p - p at the launch), in fp32, rounded once
            for p, a, start in zip(params, anchors, job.launch_points):
                p.copy_(torch.add(a, p.float() - start, alpha=self.keep_local_progress))
        for j in frozen:  # at its anchor, which the outer step left as it was
            params[j].copy_(anchors[j])
        self._writes.mark()
        self.rounds = round_no
        self._channel.telemetry.end_step(round_no, self.compression, skipped=False)
        return True

    def _frozen_in(self, fragment: int) -> List[int]:
        """The positions in `fragment` of the synced params frozen now
        (requires_grad off): a round leaves their anchors as they are (no
        outer lr, no momentum) and sets them to their anchors, the last
        synced point, which every rank holds (their own steps since, if
        they trained after it, differ by rank)."""
        return [j for j, i in enumerate(self.plan.members[fragment])
                if not self.params[i].requires_grad]

    def _scheduled_lr(self, step: int) -> float:
        """The schedule's outer lr at inner step `step`; ValueError if it is
        no finite number >= 0."""
        lr = self._outer_lr_at(step)
        check_number("outer_lr", lr, low=0.0)
        return float(lr)

    def _round_lr(self, lands_at: int) -> Tuple[Optional[float], bool]:
        """A launching round's scheduled lr and whether it was read at its
        landing step in the schedule (`lands_at`), the same on every rank
        (None without a schedule). A schedule may end with the run: the
        last launches land past it, and a proposal at close() may never be
        made. Where it gives no lr at `lands_at`, the round takes the one
        at its launch step, which every rank that makes the round reached,
        for a landing before `lands_at` (drain(), close()); a landing at
        `lands_at` reads it there again, and raises (_landing_lr). None
        where it gives none at either."""
        if self._outer_lr_at is None:
            return None, True
        for step, planned in ((lands_at, True), (lands_at - self.plan.delay, False)):
            try:
                return self._scheduled_lr(step), planned
            except Exception:  # (any error of the user's schedule: raised at a landing)
                pass
        return None, False

    def _landing_lr(self, job: _FragmentRound) -> Optional[float]:
        """The outer lr a round lands with under a schedule (None without
        one): read at its landing step in the schedule, not where this rank
        lands it: a rank a step behind its peers lands its last rounds in
        close() (_catch_up), and drain() lands early; every rank must take
        the same lr (_round_lr)."""
        if self._outer_lr_at is None:
            return None
        early = job.lands_at > self.inner_steps
        if job.lr is None and early:  # restored, or undefined at both steps
            job.lr, job.planned = self._round_lr(job.lands_at)
        if job.lr is not None and (job.planned or early):
            return job.lr
        return self._scheduled_lr(job.lands_at)  # raises: the run reached it, undefined

    def _planned_landing(self, fragment: int) -> int:
        """The inner step where `fragment`'s round in flight at a saved step
        lands in the schedule: launched at or before it, it lands within a
        round after it."""
        for step in range(self.inner_steps + 1, self.inner_steps + self.sync_every + 1):
            if fragment in self.plan.landing(step - self.warmup_steps):
                return step
        return self.inner_steps

    def _outer_digest(self, lr: Tuple[Optional[float], bool]) -> int:
        """A digest of the outer SGD's settings for a round: a value set on
        one rank only (its lr, say) would let the anchors drift apart.
        Under a schedule, the lr the round will land with and where it was
        read (`lr`: _round_lr's, the same steps on every rank)."""
        settings = group_settings(self.outer_optimizer.param_groups,
                                  leave_out=("lr",) if self._outer_lr_at is not None else ())
        return collectives.stable_digest((settings, lr))

    def _keeps_progress(self) -> bool:
        """Whether a landing adds local progress back: only an exchange that
        runs behind inner steps has any."""
        return self.keep_local_progress > 0 and self.overlap_steps > 0

    def _average_(self, fragment: int, deltas: List[torch.Tensor]) -> None:
        if self.backend is not None:  # compressed: `deltas` are views of the buffer (_launch)
            self._channel.exchange.allreduce(GroupKey(fragment))
            return
        if self.world_size == 1:
            return
        dtype = torch.bfloat16 if self.compression == "bf16" else torch.float32
        averages = self._mean("DiLoCo: averaging pseudo-gradients", deltas, dtype,
                              self._round_group, self.traffic)
        for d, avg in zip(deltas, averages):
            d.copy_(avg.view_as(d))

    def _agree_on_round(self, number: int, fragment: int, deltas: List[torch.Tensor],
                        closing: bool = False, frozen: Sequence[int] = (),
                        outer: int = 0) -> Tuple[bool, bool]:
        """Whether any rank's pseudo-gradient is not finite, and whether
        every rank only proposes this exchange from `close()` (then nobody
        makes it); the same all-gather checks that every rank is at exchange
        `number`, of `fragment` (a sync() on one rank only pairs fragments),
        with the same params `frozen` (positions in the fragment) and the
        same `outer` settings (_outer_digest)."""
        flag = nonfinite_flag([deltas], self.comm_device)
        if self.world_size == 1 and not self._shards.sharded:
            return bool(flag), closing
        table = collectives.gather_numbers("DiLoCo: agreeing on the outer round",
                                           [flag, number, int(closing), fragment,
                                            collectives.stable_digest(list(frozen)), outer],
                                           torch.int64,
                                           self._agree_group, self.timeout_s)
        numbers = [row[1] for row in table]
        if len(set(numbers)) > 1:
            raise ValueError(f"DiLoCo: ranks are at different outer exchanges {numbers}: they "
                             "must load the same checkpoint and take the same inner steps")
        fragments = [row[3] for row in table]
        if len(set(fragments)) > 1:
            raise ValueError(f"DiLoCo: ranks exchange different fragments {fragments} at outer "
                             f"exchange {number}: call sync() on every rank, after the same "
                             "inner step")
        if len({row[4] for row in table}) > 1:
            raise ValueError(f"DiLoCo: ranks freeze different synced params at outer exchange "
                             f"{number} (this rank: positions {list(frozen)} of fragment "
                             f"{fragment}): freeze and unfreeze layers on every rank, at the "
                             "same inner step")
        if len({row[5] for row in table}) > 1:
            scheduled = ("; under an outer_lr schedule, the lr this round lands with, read at "
                         "its landing step: the same schedule on every rank, and sync() after "
                         "the same inner step (a rank whose GradScaler skipped one is a step "
                         "behind: end with close())" if self._outer_lr_at is not None else "")
            raise ValueError(f"DiLoCo: ranks disagree on the outer optimizer's settings at outer "
                             f"exchange {number} (its param groups' lr, momentum...): set "
                             f"them on every rank alike{scheduled}")
        return any(row[0] for row in table), all(row[2] for row in table)

    def close(self, sync: bool = False) -> None:
        """Stop syncing: land what is in flight (`drain`), join the rounds
        other ranks launched that this rank has not reached (`_catch_up`),
        remove the hooks on the inner optimizer, stop the communication
        thread. Call it (or use `with DiLoCo(...)`) on every rank at the end
        of the loop.

        By default the params stay where the last round and this rank's
        own inner steps since left them: the same on every rank only when
        the loop ended at a round boundary. sync=True (on every rank) ends
        on a synced point whatever the step: once caught up, every fragment
        that some rank moved since its last landing makes one more round,
        and every rank's params are set to its new anchors, bit for bit the
        same (fragment_update_alpha and keep_local_progress do not apply to
        that landing). A fragment no rank moved costs the round's agreement
        only (one all-gather of six numbers) and stays as it is."""
        check_flag("sync", sync)
        self._close(catch_up=True, final_round=sync)


    def detach(self) -> None:
        """Remove the hooks and stop the communication thread, with no
        collective and no check: for a wrapper that replaces this DiLoCo by
        one on another process group (onebit.fault_tolerance), where peers
        may be gone. Rounds in flight are dropped."""
        self._closed = True
        for hook in self._hooks:
            hook.remove()
        if self._thread is not None:
            self._thread.shutdown(wait=True)

    def _close(self, catch_up: bool, final_round: bool = False) -> None:
        if self._closed:  # closing again (close() in a `with` block, say) has nothing to do
            return
        self._closed = True
        try:
            self._check_writes("close")
            self.drain()
            if catch_up:
                self._catch_up()
            if final_round:
                self._final_round()
        finally:
            for hook in self._hooks:
                hook.remove()
            if self._thread is not None:
                self._thread.shutdown(wait=True)

    def __enter__(self) -> "DiLoCo":
        return self

    def __exit__(self, *exc) -> None:
        # Leaving on an error: the peers may be gone, proposing more rounds
        # would only wait out the deadline.
        self._close(catch_up=exc[0] is None)

    @torch.no_grad()
    def _catch_up(self) -> None:
        """A rank whose GradScaler skipped inner steps that its peers took
        (torch's GradScaler skips on the rank that overflowed alone) makes
        each later round a step after them, and a loop of fixed length ends
        with it behind: its peers are already in the agreement of a round
        it never launches. Here it proposes, in schedule order, the
        exchanges it would launch next, from its params as they are; a
        proposal pairs with a peer's launch of the same exchange (one
        all-gather, the same on both sides), and is made and landed like
        any round. Once every rank only proposes, nobody is behind: the
        proposal is dropped, and nothing was sent but that all-gather."""
        position = self.inner_steps - self.warmup_steps
        if self.world_size == 1 or position < 0:  # not in the rounds yet
            return
        while True:
            position += 1
            launching = self.plan.launching(position)
            if not launching:
                continue
            fragment = launching[0]
            self._launch(fragment, lands_at=self.warmup_steps + position + self.plan.delay,
                         closing=True)
            if self._dropped(fragment):
                return
            self._land(fragment)

    @torch.no_grad()
    def _final_round(self) -> None:
        """close(sync=True): one more round of every fragment that some rank
        moved since its last landing, landed at its new anchors on every
        rank. A rank that has not moved the fragment (its params are its
        anchors, in the params' dtype) only proposes the round; when no
        rank moved it, nobody makes it (the agreement that _catch_up uses).
        Under an outer_lr schedule it reads the lr at the furthest rank's
        inner step: a rank whose GradScaler skipped steps counts fewer, and
        every rank must land the round alike."""
        lands_at = self.inner_steps
        if self._outer_lr_at is not None and (self.world_size > 1 or self._shards.sharded):
            table = collectives.gather_numbers("DiLoCo: agreeing on the last round's inner step",
                                               [self.inner_steps], torch.int64,
                                               self._agree_group, self.timeout_s)
            lands_at = max(row[0] for row in table)
        for fragment in range(self.plan.count):
            params, anchors = self._members(fragment)
            unmoved = all(torch.equal(p, a.to(p.dtype)) for p, a in zip(params, anchors))
            self._launch(fragment, lands_at=lands_at, closing=unmoved)
            self._in_flight[fragment].at_anchor = True
            if not self._dropped(fragment):
                self._land(fragment)

    def _dropped(self, fragment: int) -> bool:
        """Wait for the fragment's exchange; when every rank only proposed
        it (from close()), nobody made it: forget it and say so."""
        job = self._in_flight[fragment]
        self._finished(job)
        if job.closed:
            del self._in_flight[fragment]
            self.launches -= 1
        return job.closed

    # ----------------------------------------------------------- telemetry --
    def comm_stats(self) -> Dict[str, object]:
        """The last round's and the run's traffic, as the optimizers'
        comm_stats(): step is the round, stage the compression; bytes are
        this rank's share, fp32_bytes what an fp32 all-reduce of the same
        pseudo-gradients sends; inner_steps, bytes_per_inner_step (the
        rounds' total over the inner steps since the warmup) and
        warmup_bytes_sent (its fp32 gradient averaging) besides."""
        report = self._channel.report(self.rounds)
        report["skipped_rounds"] = report.pop("skipped_steps")
        report["inner_steps"] = self.inner_steps
        since = self.inner_steps - min(self.inner_steps, self.warmup_steps)
        report["bytes_per_inner_step"] = report["total_bytes_sent"] / since if since else 0.0
        report["warmup_bytes_sent"] = self.warmup_traffic.totals["bytes_sent"]
        return report

    # --------------------------------------------------------- checkpoints --
    _SETTINGS = {"sync_every": None, "compression": None, "warmup_steps": 0, "fragments": 1,
                 "overlap_steps": 0}  # must match on load (the default: older checkpoints)

    def state_dict(self) -> dict:
        """What every rank shares: the counters, the anchors, the outer
        optimizer's momentum, and the averaged pseudo-gradients of the
        exchanges in flight (waited for: their outer steps land on the
        resumed run's schedule). Save it with the model's and the inner
        optimizer's state; the error buffers are per rank
        (`error_feedback_state_dict`)."""
        self._check_writes("state_dict")
        self._settle()
        return {**{name: getattr(self, name) for name in self._SETTINGS},
                "inner_steps": self.inner_steps, "rounds": self.rounds, "launches": self.launches,
                "anchors": [placed_like(a.detach().clone(), p)
                            for a, p in zip(self.anchors, self.params)],
                "outer_optimizer": self._outer_state_dict(),
                "in_flight": self._in_flight_state()}

    def _outer_state_dict(self) -> dict:
        """The outer SGD's state_dict; sharded, its momentum as DTensors of
        the params' placement (new dicts: torch's share the live ones)."""
        sd = self.outer_optimizer.state_dict()
        if self._shards.sharded:
            sd["state"] = {i: {k: placed_like(v, self.params[i]) if isinstance(v, torch.Tensor)
                               else v for k, v in st.items()} for i, st in sd["state"].items()}
        return sd

    # An in-flight entry's status: nothing in flight, an average to land, a skipped round.
    _IDLE, _AVERAGED, _SKIPPED = 0, 1, 2

    def _in_flight_state(self) -> dict:
        """With overlap, every fragment's entry, in flight or not, so that
        the structure is the same at every step (torch.distributed.checkpoint
        loads into a fresh state_dict() of the same shape): its status and
        the averaged pseudo-gradients (zeros when there are none). Without
        overlap nothing is ever in flight between inner steps."""
        if not self.overlap_steps:
            return {}
        out = {}
        for f in range(self.plan.count):
            job = self._in_flight.get(f)
            status = self._IDLE if job is None else self._SKIPPED if job.skipped else self._AVERAGED
            anchors = self._members(f)[1]
            deltas = ([d.clone() for d in job.deltas] if status == self._AVERAGED
                      else [torch.zeros_like(a) for a in anchors])
            deltas = [placed_like(d, self.params[i])
                      for d, i in zip(deltas, self.plan.members[f])]
            frozen = set(job.frozen or ()) if job is not None else set()
            out[str(f)] = {"status": torch.tensor(status), "deltas": deltas,  # str keys for DCP
                           # launched with these frozen (_frozen_in): the landing keeps them
                           "frozen": torch.tensor([j in frozen for j in range(len(anchors))],
                                                  dtype=torch.bool)}
        return out

    def _settle(self) -> None:
        """Wait for every exchange in flight; they stay in flight."""
        for job in self._in_flight.values():
            self._finished(job)

    def load_state_dict(self, state: dict) -> None:
        """Load what `state_dict` saved (the same parameters, the same H and
        compression, else a ValueError and nothing changes). Resets the error
        buffers: restore this rank's with `load_error_feedback_state_dict`."""
        for name, default in self._SETTINGS.items():
            if state.get(name, default) != getattr(self, name):
                raise ValueError(f"DiLoCo.load_state_dict: the checkpoint has {name}="
                                 f"{state.get(name)!r}, this DiLoCo {getattr(self, name)!r}. "
                                 "Nothing was loaded")
        anchors = [local(a) for a in state["anchors"]]
        if [tuple(a.shape) for a in anchors] != [tuple(a.shape) for a in self.anchors]:
            raise ValueError("DiLoCo.load_state_dict: the checkpoint's parameters have other "
                             "shapes. Nothing was loaded")
        with torch.no_grad():
            for mine, saved in zip(self.anchors, anchors):
                mine.copy_(saved)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self._shards.from_dtensors(self.outer_optimizer.state)
        self.inner_steps, self.rounds = int(state["inner_steps"]), int(state["rounds"])
        self.launches = int(state.get("launches", self.rounds))
        self._settle()  # the thread no longer writes what is replaced here
        self._in_flight = {}
        for f, entry in state.get("in_flight", {}).items():
            status = int(entry["status"])
            if status != self._IDLE:
                anchors = self._members(int(f))[1]
                frozen = entry.get("frozen")  # (absent from checkpoints written before it)
                self._in_flight[int(f)] = _FragmentRound(
                    [local(d).to(a.device) for d, a in zip(entry["deltas"], anchors)],
                    skipped=status == self._SKIPPED, lands_at=self._planned_landing(int(f)),
                    frozen=None if frozen is None else [j for j, on in enumerate(frozen.tolist())
                                                        if on])
        # An exchange launched and not landed yet (streaming) has moved the
        # errors too: the launches count, not the landed rounds.
        self._channel.owner_loaded(self.backend is not None and self.launches > 0)
        self._steps_at_start, self._armed = self.inner_steps, False
        self._fresh = False  # the anchors are the checkpoint's: loaded params must not move them
        self._resumed_unchecked = True
        self._writes.mark()

    def _error_layouts(self) -> dict:
        return self._channel.exchange.layouts([self._members(f)[0] for f in range(self.plan.count)])

    def error_feedback_state_dict(self) -> dict:
        """This rank's worker and server errors (they differ on every rank):
        with them, a resume at the same world size is bitwise identical."""
        self._settle()
        state = self._channel.state_dict(self._error_layouts(), self.params[0].device,
                                         {"rounds": self.rounds})
        if self._keeps_progress():
            state["launch_points"] = self._launch_points_state()
        return state

    def _launch_points_state(self) -> dict:
        """Every fragment's launch points (zeros when none is in flight: the
        same structure at every step, for DCP), in this rank's error state:
        they differ on every rank."""
        out = {}
        for f in range(self.plan.count):
            job = self._in_flight.get(f)
            points = job.launch_points if job is not None else None
            out[str(f)] = ([x.clone() for x in points] if points is not None
                           else [torch.zeros_like(a) for a in self._members(f)[1]])
        return out

    def error_feedback_key(self) -> str:
        """The key for this rank's errors in a DCP checkpoint (as the
        optimizers' `error_feedback_key`, under another prefix)."""
        return self._channel.key("onebit_diloco_errors")

    def load_error_feedback_state_dict(self, state: dict) -> bool:
        """Restore this rank's errors; at another world size, rank, round,
        block size or wire format they restart from zero and this returns
        False. Call it after `load_state_dict`."""
        loaded = self._channel.load_state_dict(state, self._error_layouts(),
                                               {"rounds": self.rounds})
        points = state.get("launch_points") if loaded else None
        for f, job in self._in_flight.items():  # without them a landing drops the progress
            if self._keeps_progress() and points is not None and str(f) in points:
                job.launch_points = [local(x).to(a.device).float()
                                     for x, a in zip(points[str(f)], self._members(f)[1])]
        return loaded


@dataclass(frozen=True)
class SteppedOuterLR:
    """An outer lr schedule for DiLoCo(outer_lr=...): `early` until inner
    step `from_step`, then `later` (a class, not a lambda, so that it
    pickles into spawned workers)."""

    early: float
    later: float
    from_step: int

    def __call__(self, inner_steps: int) -> float:
        return self.early if inner_steps < self.from_step else self.later
