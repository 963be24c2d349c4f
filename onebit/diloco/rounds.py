"""A fragment's rounds: launch → average → outer step → land.

Each `Fragment` owns a slice of the synced params (fragments.py) and drives
its rounds through three verbs, as torchft's streaming fragments do:

1. `launch`: measure the pseudo-gradients Δ = anchors - params (straight
   into the compressed exchange's buffer) and start their exchange: the
   ranks agree on the round (round_agreement.py), then average Δ, on the
   communication thread when it overlaps inner steps;
2. `wait`: the training thread waits for that exchange (a failure raises
   here) and its device work;
3. `land`: the outer SGD steps the anchors by the average, and the params
   are set from the new anchors (or back to the old ones when some rank's
   Δ was not finite: the round is skipped everywhere).

DiLoCo (outer.py) only decides when each fragment launches and lands, and
with which outer lr (outer_lr.py).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from ..feedback.channel import ErrorFeedbackChannel
from ..feedback.exchange import GroupKey
from ..handoff import StreamHandoff
from ..shards import local
from .misuse import ParamWriteWatch
from .options import DiLoCoOptions
from .round_agreement import RoundAgreement


@dataclass
class RoundInFlight:
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
    closed: bool = False  # a proposal from close() that no rank launched (DiLoCo._catch_up)
    at_anchor: bool = False  # close(sync=True)'s last round: it lands on the new anchors
    # Where a schedule sets the outer lr: the inner step of its landing in
    # the schedule, and the lr read at the launch (OuterLR.for_round): there, or
    # (`planned` False) at the launch step, where the schedule gives none
    # there. None: it gave none at either, or the round was restored.
    lands_at: Optional[int] = None
    lr: Optional[float] = None
    planned: bool = True
    future: Optional[Future] = None  # returns the event after the exchange's device work


@dataclass
class RoundParts:
    """What every fragment's rounds share; DiLoCo builds it once.
    `mean_`: averages uncompressed pseudo-gradients over the ranks, in
    place (compressed ones go through `channel`'s exchange)."""

    params: List[torch.Tensor]  # DiLoCo's synced params (local shards taken afresh)
    anchors: List[torch.Tensor]
    options: DiLoCoOptions
    channel: ErrorFeedbackChannel
    compressed: bool
    outer_optimizer: torch.optim.Optimizer
    agreement: RoundAgreement
    mean_: Callable[[List[torch.Tensor]], None]
    writes: ParamWriteWatch
    thread: Optional[ThreadPoolExecutor]
    handoff: StreamHandoff


class Fragment:
    """Fragment `index` (its params at `positions` of the synced ones) and
    its round in flight (`round`: None when there is none)."""

    def __init__(self, index: int, positions: List[int], parts: RoundParts) -> None:
        self.index, self.positions, self._parts = index, positions, parts
        self.round: Optional[RoundInFlight] = None

    def members(self) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """The fragment's params (this rank's local shards) and anchors."""
        parts = self._parts
        return ([local(parts.params[i]) for i in self.positions],
                [parts.anchors[i] for i in self.positions])

    def frozen_now(self) -> List[int]:
        """The positions in the fragment of the synced params frozen now
        (requires_grad off): a round leaves their anchors as they are (no
        outer lr, no momentum) and sets them to their anchors, the last
        synced point, which every rank holds (their own steps since, if
        they trained after it, differ by rank)."""
        return [j for j, i in enumerate(self.positions)
                if not self._parts.params[i].requires_grad]

    # ------------------------------------------------------------ 1. launch --
    @torch.no_grad()
    def launch(self, number: int, lands_at: int, lr: Tuple[Optional[float], bool],
               outer: int, closing: bool = False) -> None:
        """Measure the pseudo-gradients and start their exchange, launch
        `number` of the run. lands_at: the inner step of its landing in the
        schedule; lr: OuterLR.for_round's there; outer: the outer SGD's
        digest (OuterLR.digest). closing: a proposal from `close()`,
        exchanged only if some rank launches this exchange from its loop."""
        parts = self._parts
        params, anchors = self.members()
        if parts.compressed:  # straight into the compressed exchange's buffer: no copies
            deltas = parts.channel.exchange.prepare(GroupKey(self.index), anchors)
            for d, a, p in zip(deltas, anchors, params):
                torch.sub(a, p, out=d)
        else:
            deltas = [a - p.float() for a, p in zip(anchors, params)]
        job = self.round = RoundInFlight(deltas, frozen=self.frozen_now(), lands_at=lands_at,
                                         lr=lr[0], planned=lr[1])
        if parts.options.keeps_progress:
            job.launch_points = [p.detach().float().clone() for p in params]

        def exchange() -> None:
            self._agree_and_average(job, anchors, number, closing, outer)

        if parts.thread is None:
            exchange()
            return
        device = job.deltas[0].device
        job.future = parts.thread.submit(parts.handoff.run_on_comm_thread, device,
                                         parts.handoff.produced(device), exchange)

    def _agree_and_average(self, job: RoundInFlight, anchors: List[torch.Tensor], number: int,
                           closing: bool, outer: int) -> None:
        parts = self._parts
        job.skipped, job.closed = parts.agreement.check(number, self.index, job.deltas, closing,
                                                        job.frozen, outer)
        if job.skipped or job.closed:
            return
        # A frozen param's slices of the errors stay as they were: what
        # they hold is sent when it trains again.
        key = GroupKey(self.index)
        keep = ([parts.channel.exchange.keep_tensor_errors(key, anchors, j) for j in job.frozen]
                if parts.compressed else [])
        if parts.compressed:  # `deltas` are views of the exchange's buffer
            if parts.options.error_decay != 1.0:  # (a frozen param's slices are put back)
                parts.channel.exchange.errors(key)[0].mul_(parts.options.error_decay)
            parts.channel.exchange.allreduce(key)
        else:
            parts.mean_(job.deltas)
        for put_back in keep:
            put_back()

    # -------------------------------------------------------------- 2. wait --
    def wait(self) -> None:
        """Wait for the round's exchange (a failure raises here, on the
        training thread); the compute stream then waits for its device work."""
        job = self.round
        if job is not None and job.future is not None:
            done = job.future.result()
            self._parts.handoff.consume(job.deltas[0].device, done)
            job.future = None

    # -------------------------------------------------------------- 3. land --
    @torch.no_grad()
    def land(self, lr: Optional[float], round_no: int) -> bool:
        """The outer step (at `lr`, None: as the outer SGD holds it) from the
        averaged pseudo-gradients, and the params set from the new anchors
        (back to the old ones when the round was skipped: False)."""
        parts = self._parts
        if lr is not None:
            for group in parts.outer_optimizer.param_groups:
                group["lr"] = lr
        job = self.round
        try:
            self.wait()
        finally:
            self.round = None  # landed, or its exchange failed: no longer in flight
        params, anchors = self.members()
        if job.skipped:
            for p, a in zip(params, anchors):
                p.copy_(a)
            parts.writes.mark()  # DiLoCo's own write (sync() may land before any inner step)
            parts.channel.telemetry.end_step(round_no, parts.options.compression, skipped=True)
            return False
        frozen = set(self.frozen_now() if job.frozen is None else job.frozen)
        for j, (a, d) in enumerate(zip(anchors, job.deltas)):
            a.grad = None if j in frozen else d
        parts.outer_optimizer.step()  # SGD steps only the anchors that have a .grad
        for a in anchors:
            a.grad = None
        self._set_params(job, params, anchors)
        for j in frozen:  # at its anchor, which the outer step left as it was
            params[j].copy_(anchors[j])
        parts.writes.mark()
        parts.channel.telemetry.end_step(round_no, parts.options.compression, skipped=False)
        return True

    def _set_params(self, job: RoundInFlight, params: List[torch.Tensor],
                    anchors: List[torch.Tensor]) -> None:
        """Where the landing fragment's params go: the new anchors, or mixed
        with this rank's params (fragment_update_alpha), or with its progress
        since the launch added back (keep_local_progress)."""
        options = self._parts.options
        if job.at_anchor:  # close(sync=True): every rank on the new anchors
            for p, a in zip(params, anchors):
                p.copy_(a)
        elif options.fragment_update_alpha > 0:  # (1 - alpha) * anchor + alpha * p, in fp32
            for p, a in zip(params, anchors):
                p.copy_(torch.lerp(a, p.float(), options.fragment_update_alpha))
        elif job.launch_points is None:
            for p, a in zip(params, anchors):
                p.copy_(a)
        else:  # anchor + keep * (p - p at the launch), in fp32, rounded once
            for p, a, start in zip(params, anchors, job.launch_points):
                p.copy_(torch.add(a, p.float() - start, alpha=options.keep_local_progress))
