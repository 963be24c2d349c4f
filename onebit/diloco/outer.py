"""DiLoCo with 1-bit (or 2-bit, or sparse 2-bit) error-feedback outer gradients.

DiLoCo (Douillard et al., 2023) trains across slow links by talking rarely:
each rank takes `sync_every` (H) steps of its own inner optimizer, then the
ranks average the pseudo-gradient Δ = anchors (the parameters at the last
sync) - parameters now, and an outer SGD steps the anchors by the average;
every rank continues from them. Δ travels through the same block-scaled
error-compensated 1-bit allreduce as the optimizers' gradients: what the
signs and scales could not carry stays in this rank's errors and joins the
next round's Δ. Streaming DiLoCo (Douillard et al., 2025): `fragments=F`
syncs F slices of the model at staggered inner steps (fragments.py), and
`overlap_steps=tau` lands each one tau inner steps after its launch.

A round, where to read it:

    inner.step()  ->  DiLoCo._inner_step_done (a post-step hook, as torchft's)
      Fragment.launch   Δ measured, the ranks agree, Δ averaged   (rounds.py)
      Fragment.wait     the exchange's thread and device work
      Fragment.land     the outer step on the anchors, params set from them

DiLoCo only schedules: which fragment launches and lands at which inner
step, with which outer lr (outer_lr.py). The rest: arguments (options.py),
groups and backend (links.py), the warmup (averaging.py), checkpoints
(checkpoint.py), misuse (misuse.py). docs/usage.md says how to choose the
settings, and what they measured.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Union

import torch
import torch.distributed as dist

from .. import collectives
from ..backends.stats import TrafficStats
from ..checks import check_flag
from ..feedback.channel import ErrorFeedbackChannel
from ..handoff import StreamHandoff
from ..shards import ShardedParams, local
from . import checkpoint
from .averaging import RankMean, WarmupAverage
from .fragments import FragmentPlan
from .links import connect
from .misuse import MisuseGuard
from .options import DiLoCoOptions, synced_params
from .outer_lr import OuterLR
from .round_agreement import RoundAgreement
from .rounds import Fragment, RoundParts


class DiLoCo:
    """Outer steps every `sync_every` inner steps of `inner_optimizer`.

    model: an nn.Module or an iterable of parameters; the ones that require
      grad when DiLoCo is built are synced (rank 0's values first).
    sync_every: H, inner steps per round (the papers use 16 to 500).
    outer_lr, outer_momentum, nesterov: the outer SGD; by default plain SGD
      at lr 1.3, a step a little past the average (DiLoCo's published
      Nesterov is outer_lr=0.7, outer_momentum=0.9, nesterov=True).
      outer_lr may also be a function of the inner steps taken (warmup
      included), read where a round's outer step lands in the schedule
      (its launch plus overlap_steps; sync() lands at once), on every rank
      alike: `onebit.SteppedOuterLR` makes the step larger once the first
      fast-changing rounds are past (docs/usage.md).
    warmup_steps: inner steps before the first round in which the ranks
      average their gradients in fp32 before each inner step (synchronous
      data parallelism, as the optimizers' freeze_step); the rounds then
      start from where it ended. Default 0.
    fragments: F, slices of the params (consecutive, about equal elements)
      synced at staggered inner steps, each once per H (Streaming DiLoCo);
      each keeps its own error buffers. Default 1.
    overlap_steps: tau, inner steps a fragment's exchange runs behind
      (0: the inner step that launches it waits for it); below sync_every.
    compression: "1bit" (error-feedback 1-bit), "2bit" (error-feedback
      ternary: -1, 0 or +1 times each block's scale, backends/codecs.py),
      "sparse2bit" (error-feedback top-k: `topk` values of each block, an
      index and 2 bits each, backends/sparse_codec.py; the last two over
      the "compressed" backend), "bf16" or "none" (fp32), the last two
      full-precision all-reduces.
    keep_local_progress: with overlap_steps > 0, the share in [0, 1] of
      this rank's progress since a fragment's launch that the fragment
      keeps on top of its new anchor when the outer step lands: 0 (the
      default) drops it, 1 re-adds all of it. It costs a copy of the
      fragment's params per exchange in flight, saved with this rank's
      `error_feedback_state_dict`.
    fragment_update_alpha: the share in [0, 1] of this rank's current params
      mixed into a landing fragment: p = (1 - alpha) * new anchor + alpha * p
      (torchft's name; Streaming DiLoCo's mixing). 0, the default, sets p to
      the new anchor. Not with keep_local_progress.
    process_group, timeout_s (keyword-only, as the options after them):
      the data-parallel group (with FSDP2-sharded params, the mesh's
      replicate group: docs/sharding.md) and the deadline of each
      collective (a dead rank is a CommunicationError, never a hang).
    block_size, scale_dtype, comm_backend_name: the 1-bit wire format and
      backend, as the optimizers take them; block_size None (the default)
      is 256, or 4096 for the sparse wire.
    error_decay: with a compressed wire, the share of this rank's error
      buffer that joins each round (SparseLoCo's decay: e <- error_decay *
      e + Δ before the exchange); 1, the default, keeps all of it
      (SparseLoCo uses 0.95; docs/usage.md says what it measured).
    topk: with compression="sparse2bit", the values sent per block of
      block_size elements (None, the default: one per 64, SparseLoCo's
      64 of 4096, 1.56%). Fewer bytes, and values wait more rounds to be
      sent; docs/usage.md says how to choose it.
    """

    def __init__(self, model: Union[torch.nn.Module, Iterable[torch.Tensor]],
                 inner_optimizer: torch.optim.Optimizer, sync_every: int,
                 outer_lr: Union[float, Callable[[int], float]] = 1.3,
                 outer_momentum: float = 0.0, nesterov: bool = False,
                 compression: str = "1bit", warmup_steps: int = 0, fragments: int = 1,
                 overlap_steps: int = 0, *, keep_local_progress: float = 0.0,
                 fragment_update_alpha: float = 0.0, process_group=None,
                 timeout_s: Optional[float] = None, block_size: Optional[int] = None,
                 scale_dtype="float32", comm_backend_name: Optional[str] = None,
                 topk: Optional[int] = None, error_decay: float = 1.0) -> None:
        o = self.options = DiLoCoOptions(
            sync_every, outer_lr, outer_momentum, nesterov, compression, warmup_steps,
            fragments, overlap_steps, keep_local_progress, fragment_update_alpha, timeout_s,
            block_size, scale_dtype, topk, error_decay)
        all_params, self.params, self._frozen_when_built = synced_params(model)
        self._shards = ShardedParams("DiLoCo", [{"params": self.params}], process_group)
        # Fragments by whole-param sizes: every shard of the model launches
        # and lands the same fragment at the same inner step.
        self.plan = FragmentPlan.split([p.numel() for p in self.params], fragments, sync_every,
                                       overlap_steps)
        self.sync_every, self.compression, self.warmup_steps = sync_every, compression, warmup_steps
        self.fragments, self.overlap_steps = fragments, overlap_steps
        self.keep_local_progress = o.keep_local_progress
        self.fragment_update_alpha = o.fragment_update_alpha
        self.inner_optimizer, self.process_group = inner_optimizer, process_group
        self.timeout_s, self.block_size, self.scale_dtype = o.timeout_s, o.block_size, \
            o.wire_scale_dtype
        self.world_size = (dist.get_world_size(process_group)
                           if collectives.is_distributed("DiLoCo") else 1)
        # Exchanges launched so far, every fragment's: the ranks check they
        # agree on it (a rank whose GradScaler skipped an inner step launches
        # a step later, and the ranks still meet).
        self.inner_steps = self.rounds = self.launches = 0
        self._lr = OuterLR(outer_lr, self.plan, warmup_steps)
        self._links = connect(o, self._shards, self.params, all_params, process_group,
                              self.world_size, self._lr.fingerprint(), comm_backend_name)
        self.backend, self.comm_device = self._links.backend, self._links.comm_device
        # The last synced point, kept in fp32 whatever the params' dtype: the
        # outer optimizer steps it, and the params are set from it.
        self.anchors = [local(p).detach().float().clone() for p in self.params]
        self.outer_optimizer = self._outer_sgd()
        self._watch(model)
        self._fragments = self._build_rounds()

    def _outer_sgd(self) -> torch.optim.SGD:
        o = self.options
        sgd = torch.optim.SGD(self.anchors, lr=o.first_lr, momentum=o.outer_momentum,
                              nesterov=o.nesterov)
        if o.outer_momentum:  # zeros step as SGD's first clone does; the state_dict keeps one
            for a in self.anchors:  # shape from the start (DCP loads into a fresh one)
                sgd.state[a]["momentum_buffer"] = torch.zeros_like(a)
        return sgd

    def _build_rounds(self) -> List[Fragment]:
        """The error-feedback channel, the full-precision averages (the
        warmup's, bf16 and fp32 rounds') and the fragments."""
        o, links = self.options, self._links
        # One fused buffer per fragment, its errors, the traffic and what a checkpoint saves.
        self._channel = ErrorFeedbackChannel(
            "DiLoCo", self.backend, self.world_size,
            dist.get_rank(self.process_group) if self.world_size > 1 else 0, o.block_size,
            self._shards.identity())
        self.traffic = self._channel.traffic  # the baselines' (the backend counts its 1 bit)
        self.warmup_traffic = TrafficStats()  # the warmup's gradient averaging (not a round's)
        mean = RankMean(self.world_size, self.comm_device, self.timeout_s)
        self._warmup = WarmupAverage(mean, self.process_group, self.warmup_traffic)
        dtype = torch.bfloat16 if o.compression == "bf16" else torch.float32
        agreement = RoundAgreement(links.agree_group, self.world_size > 1 or self._shards.sharded,
                                   self.comm_device, self.timeout_s, self._lr.schedule is not None)
        parts = RoundParts(
            self.params, self.anchors, o, self._channel, self.backend is not None,
            self.outer_optimizer, agreement,
            lambda deltas: mean.into("DiLoCo: averaging pseudo-gradients", deltas, dtype,
                                     links.round_group, self.traffic),
            self._guard.writes, links.thread, StreamHandoff())
        return [Fragment(f, ids, parts) for f, ids in enumerate(self.plan.members)]

    def _watch(self, model) -> None:
        """The hooks on the inner optimizer (and the model's forward), and
        the checks for misuse that would go silent (misuse.py)."""
        has_forward = isinstance(model, torch.nn.Module)
        self._guard = MisuseGuard(self.params, self._frozen_when_built, has_forward,
                                  self._anchor_at_the_params)
        self._hooks = [
            self.inner_optimizer.register_step_pre_hook(lambda *_: self._before_inner_step()),
            self.inner_optimizer.register_step_post_hook(lambda *_: self._inner_step_done())]
        self._closed = False
        if has_forward:
            self._hooks.append(model.register_forward_pre_hook(
                lambda module, _: self._guard.before_forward(module, self.inner_steps)))

    # ---------------------------------------------------------- the rounds --
    def _inner_step_done(self) -> None:
        self.inner_steps += 1
        past = self.inner_steps - self.warmup_steps
        if past == 0:  # the rounds start from where the warmup ended
            self._anchor_at_the_params()
        elif past > 0:
            for f in self.plan.launching(past):
                self._launch(f, lands_at=self.inner_steps + self.plan.delay)
            for f in self.plan.landing(past):
                if self._fragments[f].round is not None:  # not landed early by drain(), sync()
                    self._land(f)

    def _launch(self, fragment: int, lands_at: int, closing: bool = False) -> None:
        """Start `fragment`'s round, whose outer step lands at inner step
        `lands_at` of the schedule (where it reads a scheduled outer lr).
        closing: a proposal from `close()`, exchanged only if some rank
        launches this exchange from its loop (`_catch_up`)."""
        lr = self._lr.for_round(lands_at)
        outer = self._lr.digest(self.outer_optimizer.param_groups, lr)  # on this thread
        self.launches += 1
        self._fragments[fragment].launch(self.launches, lands_at, lr, outer, closing)

    def _land(self, fragment: int) -> bool:
        """Land `fragment`'s round in flight: False when it was skipped."""
        frag = self._fragments[fragment]
        lr = self._lr.at_landing(frag.round, self.inner_steps)  # a bad value raises first
        landed = frag.land(lr, self.rounds + 1)
        self.rounds += landed
        return landed

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
        for f in range(self.plan.count):
            if self._fragments[f].round is not None:
                synced = self._land(f) and synced
        return synced

    @property
    def exchanges_in_flight(self) -> int:
        """Fragments whose exchange has started and whose outer step has not
        landed yet (what drain() would wait for)."""
        return sum(f.round is not None for f in self._fragments)

    def _settle(self) -> None:
        """Wait for every exchange in flight; they stay in flight."""
        for fragment in self._fragments:
            fragment.wait()

    @torch.no_grad()
    def _anchor_at_the_params(self) -> None:
        """The last synced point is where the params are now (their local
        shards, taken afresh: FSDP2 rebinds them at lazy init and a load)."""
        for a, p in zip(self.anchors, self.params):
            a.copy_(local(p))

    # -------------------------------------------------------------- misuse --
    def _before_inner_step(self) -> None:
        self._guard.check_unfrozen()
        self._channel.restart_notice.before_step()
        if self.inner_steps < self.warmup_steps and self.world_size > 1:
            self._warmup(self.params, self.inner_steps)

    def _check_writes(self, where: str) -> None:
        self._guard.check_writes(where, self.inner_steps)

    def _refuse_closed(self, where: str) -> None:
        if self._closed:
            raise ValueError(f"DiLoCo ({where}): this DiLoCo is closed (its hooks are gone and "
                             "its communication thread stopped); build a new one to go on "
                             "training with rounds")

    # --------------------------------------------------------------- close --
    def close(self, sync: bool = False) -> None:
        """Stop syncing, on every rank at the end of the loop (or leave a
        `with DiLoCo(...)` block): land what is in flight (`drain`), join the
        rounds other ranks launched that this rank has not reached
        (`_catch_up`), remove the hooks, stop the communication thread.

        By default the params stay where the last round and this rank's own
        inner steps since left them: the same on every rank only when the
        loop ended at a round boundary. sync=True ends on a synced point
        whatever the step: every fragment some rank moved since its last
        landing makes one more round, and every rank's params are set to its
        new anchors, bit for bit the same (fragment_update_alpha and
        keep_local_progress do not apply). A fragment no rank moved costs
        the round's agreement only (one all-gather of six numbers)."""
        check_flag("sync", sync)
        self._close(catch_up=True, final_round=sync)

    def detach(self) -> None:
        """Remove the hooks and stop the communication thread, with no
        collective and no check: for a wrapper that replaces this DiLoCo by
        one on another process group (onebit.fault_tolerance), where peers
        may be gone. Rounds in flight are dropped."""
        self._closed = True
        self._unhook()

    def _unhook(self) -> None:
        for hook in self._hooks:
            hook.remove()
        if self._links.thread is not None:
            self._links.thread.shutdown(wait=True)

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
            self._unhook()

    def __enter__(self) -> "DiLoCo":
        return self

    def __exit__(self, *exc) -> None:
        # Leaving on an error: the peers may be gone, proposing more rounds
        # would only wait out the deadline.
        self._close(catch_up=exc[0] is None)

    @torch.no_grad()
    def _catch_up(self) -> None:
        """A rank whose GradScaler skipped inner steps that its peers took
        makes each later round a step after them, and a loop of fixed length
        ends with it behind, its peers waiting in the agreement of a round
        it never launches. Here it proposes, in schedule order, the
        exchanges it would launch next, from its params as they are: a
        proposal pairs with a peer's launch of the same exchange and is made
        and landed like any round. Once every rank only proposes, nobody is
        behind: the proposal is dropped, having cost one all-gather."""
        position = self.inner_steps - self.warmup_steps
        if self.world_size == 1 or position < 0:  # not in the rounds yet
            return
        for fragment, position in self.plan.launches_after(position):
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
        if self._lr.schedule is not None and (self.world_size > 1 or self._shards.sharded):
            table = collectives.gather_numbers("DiLoCo: agreeing on the last round's inner step",
                                               [self.inner_steps], torch.int64,
                                               self._links.agree_group, self.timeout_s)
            lands_at = max(row[0] for row in table)
        for f, fragment in enumerate(self._fragments):
            params, anchors = fragment.members()
            unmoved = all(torch.equal(p, a.to(p.dtype)) for p, a in zip(params, anchors))
            self._launch(f, lands_at=lands_at, closing=unmoved)
            fragment.round.at_anchor = True
            if not self._dropped(f):
                self._land(f)

    def _dropped(self, fragment: int) -> bool:
        """Wait for the fragment's exchange; when every rank only proposed
        it (from close()), nobody made it: forget it and say so."""
        frag = self._fragments[fragment]
        frag.wait()
        closed = frag.round.closed
        if closed:
            frag.round = None
            self.launches -= 1
        return closed

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
    def state_dict(self) -> dict:
        """What every rank shares: the counters, the anchors, the outer
        optimizer's momentum, and the averaged pseudo-gradients of the
        exchanges in flight (waited for: their outer steps land on the
        resumed run's schedule). Save it with the model's and the inner
        optimizer's state; the error buffers are per rank
        (`error_feedback_state_dict`). The layout: checkpoint.py."""
        self._check_writes("state_dict")
        self._settle()
        return checkpoint.state_dict(self, self._fragments, self._shards.sharded)

    def load_state_dict(self, state: dict) -> None:
        """Load what `state_dict` saved (the same parameters, the same H and
        compression, else a ValueError and nothing changes). Resets the error
        buffers: restore this rank's with `load_error_feedback_state_dict`."""
        checkpoint.check_loadable(self, state)
        self.inner_steps, self.rounds, self.launches = checkpoint.load_shared(
            state, self.anchors, self.outer_optimizer, self._shards)
        self._settle()  # the thread no longer writes what is replaced here
        checkpoint.restore_in_flight(state, self._fragments,
                                     lambda f: self._lr.planned_landing(f, self.inner_steps))
        # An exchange launched and not landed yet (streaming) has moved the
        # errors too: the launches count, not the landed rounds.
        self._channel.owner_loaded(self.backend is not None and self.launches > 0)
        self._guard.loaded(self.inner_steps)
        self._warmup.resumed()  # the first average checks the ranks resumed at one step

    def error_feedback_state_dict(self) -> dict:
        """This rank's worker and server errors (they differ on every rank):
        with them, a resume at the same world size is bitwise identical."""
        self._settle()
        return checkpoint.error_feedback_state(self._channel, self._fragments,
                                               self.params[0].device, self.rounds,
                                               self.options.keeps_progress)

    def error_feedback_key(self) -> str:
        """The key for this rank's errors in a DCP checkpoint (as the
        optimizers' `error_feedback_key`, under another prefix)."""
        return self._channel.key("onebit_diloco_errors")

    def load_error_feedback_state_dict(self, state: dict) -> bool:
        """Restore this rank's errors; at another world size, rank, round,
        block size or wire format they restart from zero and this returns
        False. Call it after `load_state_dict`."""
        return checkpoint.load_error_feedback(self._channel, state, self._fragments, self.rounds,
                                              self.options.keeps_progress)
