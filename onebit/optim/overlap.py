"""Starting the 1-bit exchange during backward (`overlap_backward=True`).

A post-accumulate-grad hook on every trained parameter marks it ready. Once
every parameter of a bucket is ready, the bucket's exchange input (1-bit
Adam and LAMB: the new momentum; 0/1 Adam before its freeze: the gradient,
after it, at a sync that follows a sync: this step's displacement) is
written into the bucket's own fused buffer, and its compressed allreduce
is queued on one communication thread, so it runs while backward goes on.
step() takes the buckets in launch order as their exchanges finish, and
1-bit Adam (0/1 Adam at a sync) applies each bucket's update while the
later buckets are still on the wire (step_exchange.py). An
exchange that could not start in backward goes over the same buckets from
step() (`inputs_now`, `exchange_now`), so a group's errors keep one history.

Why the result is bitwise the fused one. Every tensor starts on its own
blocks, and every sign, scale and error is decided per block
(backends/base.py), so which buffer a tensor travels in changes which rank
serves its blocks, never their bits. The new momentum goes into the bucket,
not into the optimizer's state, so nothing is committed before step() has
agreed that the step is finite; each bucket's error buffers are copied
before its exchange and put back when the step is skipped or refused.

Why the collectives match across ranks. Every rank launches the buckets in
the same order: bucket k only after k - 1. A param whose .grad was None at
the last step is not waited for (it counts as zero, as in step()); a bucket
still waiting when backward ends is launched by step(), still in order. The
exchanges run on one thread, over a process group of their own, so a
collective that the main thread (or DDP) issues on its group cannot
interleave with them differently on different ranks within a group; and
step()'s own collective (the agreement) goes through the same thread after
the queued exchanges (`in_order`), so the two groups' collectives leave
every rank in one order too, as NCCL needs across communicators.

When a launched bucket's gradients change (a param thought unused gets a
gradient after all, a second backward before step(), or the user's
clip_grad_norm_ between backward and step()), the bucket is stale: step() agrees on that in the all-gather it makes anyway, and then
every rank puts the errors back and exchanges every bucket again from the
final gradients. Correct, but not overlapped: for gradient accumulation, run
all but the last micro-batch inside `with optimizer.no_overlap():`.

Under a GradScaler what backward saw is scaled, whether step() unscales it
or the user's unscale_ did before: those buckets are exchanged again from
the unscaled gradients, and once a step was scaled, later buckets wait for
step() instead.
"""
from __future__ import annotations

import contextlib
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ..feedback.exchange import BucketKey, ErrorFeedbackExchange
from ..handoff import StreamHandoff
from .guards import copy_masked_

# Where backward's end-of-pass callbacks are queued (as DDP queues its own).
_ENGINE = torch.autograd.Variable._execution_engine

FIRST_BUCKET_MB = 1.0  # the last layers' gradients come first: start on the wire early (as DDP)


class Bucket:
    """Some consecutive trained params of one group, exchanged together."""

    def __init__(self, key: BucketKey, params: List[torch.Tensor], positions: List[int]) -> None:
        self.key = key  # names its fused buffer and errors in the exchange
        self.index = key.group
        self.params = params
        self.positions = positions  # where the params sit in the group's trained list
        self.waiting: set = set()
        self.future = None  # the queued exchange
        self.collected = False  # step() has taken its result
        self.ready = None  # event: its input is written (compute stream)
        self.done = None  # event: its exchange finished (communication stream)
        self.ready_device: Optional[torch.device] = None  # where its buffer lives
        self.input_key = None  # what its input was written for (_exchange_input_key)
        self.grads_seen: List[Tuple[Optional[torch.Tensor], int]] = []  # (.grad, its version)

    def pick(self, xs: list) -> list:
        """Its entries of a list in the group's trained params' order."""
        return [xs[j] for j in self.positions]

    def land(self, out: List[torch.Tensor], views: List[torch.Tensor], seen: List[bool],
             masks: list) -> None:
        """Its exchanged values (`views` of its buffer) into `out`, zeroed
        where v == 0 (the guard's `seen` and `masks`, group order)."""
        copy_masked_(self.pick(out), views, self.pick(masks), self.pick(seen))


def plan_buckets(trained: List[List[torch.Tensor]], cap: int, first_cap: int) -> List[Bucket]:
    """Buckets in the order backward usually produces gradients: the groups
    and their params in reverse, cut at `cap` elements (the first at
    `first_cap`), never across a group."""
    buckets = []
    for i in reversed(range(len(trained))):
        params, positions, size = [], [], 0
        for j in reversed(range(len(trained[i]))):
            limit = first_cap if not buckets else cap
            n = trained[i][j].numel()
            if params and size + n > limit:
                buckets.append(Bucket(BucketKey(i, len(buckets)), params, positions))
                params, positions, size = [], [], 0
            params.append(trained[i][j])
            positions.append(j)
            size += n
        if params:
            buckets.append(Bucket(BucketKey(i, len(buckets)), params, positions))
    return buckets


def signature(trained: List[List[torch.Tensor]]) -> tuple:
    return tuple(tuple(id(p) for p in ps) for ps in trained)


@dataclass(frozen=True)
class OverlapCallbacks:
    """What the overlap asks of its optimizer, and nothing else."""

    active: Callable[[], bool]  # can the coming step's exchange start during backward?
    trained: Callable[[], List[List[torch.Tensor]]]  # each group's trained params
    gradients: Callable[[List[torch.Tensor]], List[torch.Tensor]]  # their fp32 gradients
    # write_input(group, params, grads, out, positions): the exchange input into `out`
    write_input: Callable[..., None]
    input_key: Callable[[int], object]  # what a group's input depends on besides gradients


def check_overlap_group(group: dict) -> None:
    """A param group the overlap can serve: no clipping (max_grad_norm 0)."""
    if group["max_grad_norm"] > 0:
        raise ValueError("overlap_backward=True needs max_grad_norm=0: clipping needs the norm "
                         "of every gradient, which exists only after backward. Clipping "
                         "before step() yourself works, but exchanges every bucket again "
                         "in step(): turn the overlap off to clip")

class BackwardOverlap:
    """The hooks, the bucket plan and the communication thread of one
    optimizer: its buckets' buffers and errors live in `exchange`."""

    def __init__(self, exchange: ErrorFeedbackExchange, callbacks: OverlapCallbacks,
                 bucket_cap_mb: float) -> None:
        self.exchange = exchange
        self.callbacks = callbacks
        self.cap = max(1, int(bucket_cap_mb * 2 ** 20) // 4)
        self.first_cap = min(self.cap, int(FIRST_BUCKET_MB * 2 ** 20) // 4)
        self.buckets: List[Bucket] = []
        self.of_param: Dict[int, Bucket] = {}
        self.signature = None
        self.launched = 0  # buckets launched so far in this step, in order
        self.planned = False  # whether this backward has checked the plan
        self.stale = False  # a launched bucket's gradients changed since (agreed in step())
        # Params that had no .grad at the last step are not waited for (a
        # head or a branch unused so far would hold back every later bucket);
        # if one gets a gradient after all, its bucket goes stale.
        self.absent: set = set()
        self.enabled = True  # off inside no_overlap()
        # A GradScaler hands step() the scale, so what backward saw is scaled
        # and would be exchanged again: once a step was scaled, the buckets
        # wait for step() rather than be exchanged twice.
        self.scaled = False
        self.settled = False  # every bucket of this step is launched; step() collects them
        self.failure: Optional[BaseException] = None  # a bucket's exchange failed in this step
        self._warned = False
        self._end_of_backward_queued = False
        self._hooked: set = set()
        # Bucket exchanges started during backward and by step(), exchanges
        # done again, and the seconds step() waited for them.
        self.stats = {"launched_in_backward": 0, "launched_in_step": 0, "redone": 0,
                      "wait_s": 0.0}
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="onebit-exchange")
        self.handoff = StreamHandoff()
        self._now: Dict[int, List[Bucket]] = {}  # group -> buckets step() exchanges itself

    # ------------------------------------------------------------- hooks --
    def watch(self, params) -> None:
        """Hook every param that can receive a gradient (once each)."""
        for p in params:
            if id(p) not in self._hooked and p.requires_grad and p.is_leaf:
                p.register_post_accumulate_grad_hook(self._ready)
                self._hooked.add(id(p))

    def _ready(self, p: torch.Tensor) -> None:
        if not self.enabled or self.scaled or not self.callbacks.active():
            return
        if not self.planned:
            self._plan(self.callbacks.trained())
            self.planned = True
        if not self._end_of_backward_queued:
            self._end_of_backward_queued = True
            _ENGINE.queue_callback(self._backward_ending)
        bucket = self.of_param.get(id(p))
        if bucket is None:
            return
        if bucket.future is not None:
            self.stale = True  # a second backward: step() exchanges again
            return
        bucket.waiting.discard(id(p))
        while self.launched < len(self.buckets) and not self.buckets[self.launched].waiting:
            self._launch(self.buckets[self.launched], None)

    def _backward_ending(self) -> None:
        """Backward's end (an autograd engine callback). The gradients are
        read in one more callback, queued now: it runs after those backward
        queued before this one ran, such as DDP's, which copies the averaged
        buckets into .grad."""
        _ENGINE.queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        """Note each launched bucket's .grad as backward left it, for
        notice_changed_gradients."""
        self._end_of_backward_queued = False
        for b in self.buckets[:self.launched]:
            b.grads_seen = [(p.grad, p.grad._version if p.grad is not None else 0)
                            for p in b.params]

    @contextlib.contextmanager
    def no_overlap(self):
        enabled, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = enabled

    # -------------------------------------------------------------- plan --
    def _plan(self, trained: List[List[torch.Tensor]]) -> None:
        sig = signature(trained)
        if sig != self.signature:
            self.signature = sig
            self.buckets = plan_buckets(trained, self.cap, self.first_cap)
            self.of_param = {id(p): b for b in self.buckets for p in b.params}
        for b in self.buckets:
            b.waiting = {id(p) for p in b.params} - self.absent

    def bucket_sizes(self, trained: List[List[torch.Tensor]]
                     ) -> List[Tuple[BucketKey, Sequence[int]]]:
        """Each bucket's key and its params' sizes, in plan order, for the
        trained params `trained`."""
        return [(b.key, [p.numel() for p in b.params])
                for b in plan_buckets(trained, self.cap, self.first_cap)]

    def places(self, trained: List[List[torch.Tensor]], index: int,
               ids: set) -> List[Tuple[BucketKey, List[torch.Tensor], int]]:
        """(bucket key, its params, position in them) of each param of group
        `index` whose id is in `ids`, in the plan for `trained`."""
        return [(b.key, b.params, k) for b in plan_buckets(trained, self.cap, self.first_cap)
                if b.index == index for k, p in enumerate(b.params) if id(p) in ids]

    # ---------------------------------------------------------- exchange --
    def _launch(self, bucket: Bucket, grads: Optional[List[torch.Tensor]]) -> None:
        """Write the bucket's exchange input and queue its exchange.
        grads: the step's own gradients of its params (None: read .grad)."""
        self.stats["launched_in_step" if grads is not None else "launched_in_backward"] += 1
        if grads is None:
            grads = self.callbacks.gradients(bucket.params)
        views = self.exchange.prepare(bucket.key, bucket.params)
        self.callbacks.write_input(bucket.index, bucket.params, grads, views, bucket.positions)
        bucket.input_key = self.callbacks.input_key(bucket.index)
        bucket.ready_device = views[0].device
        bucket.ready = self.handoff.produced(bucket.ready_device)
        bucket.future = self._thread.submit(self._exchange, bucket)
        self.launched += 1

    def _exchange(self, bucket: Bucket) -> None:
        """On the communication thread: keep the errors, then exchange. Once
        one bucket failed, the later ones of the step fail at once: their
        collectives would each only wait out the deadline."""
        if self.failure is not None:
            raise self.failure

        def backup_and_exchange() -> None:
            # Both here, in the comm stream: the errors may be created now.
            self.exchange.backup(bucket.key)
            self.exchange.allreduce(bucket.key)

        try:
            bucket.done = self.handoff.run_on_comm_thread(bucket.ready_device, bucket.ready,
                                                          backup_and_exchange)
        except BaseException as exc:
            self.failure = exc
            raise

    def in_order(self, work: Callable[[], object]) -> object:
        """`work()`, a collective of step() over another process group, run
        on the communication thread after every exchange queued so far, and
        its result. So the collectives of a step leave every rank in one
        order across the two communicators: NCCL can deadlock when ranks
        issue operations of two communicators in different orders (a GPU
        busy in one rank's kernel while its peer waits in the other). Run
        straight away when this step queued nothing. The cost: step() learns
        the agreement's verdict, and can land buckets, only once the
        exchanges queued in backward are done."""
        if not self.launched:
            return work()
        device = self.buckets[0].ready_device  # the handoff's device: the exchanges' own
        results = []

        def in_turn() -> None:
            if self.failure is not None:  # a bucket failed: its peers are gone
                raise self.failure
            results.append(work())

        done = self._thread.submit(self.handoff.run_on_comm_thread, device,
                                   self.handoff.produced(device), in_turn).result()
        self.handoff.consume(device, done)
        return results[0]

    def notice_changed_gradients(self) -> None:
        """step(), first: a bucket launched in backward whose params' .grad
        changed after backward ended (clipped or scaled in place, or
        replaced) is stale, as after a second backward. Otherwise step()
        would update from an exchange of gradients the user had meant to
        change (clip_grad_norm_ between backward and step())."""
        for b in self.buckets[:self.launched]:
            if any(p.grad is not g or (g is not None and g._version != v)
                   for p, (g, v) in zip(b.params, b.grads_seen)):
                self.stale = True
            b.grads_seen = []  # (the gradients are not held past the step)

    def launch_rest(self, trained: List[List[torch.Tensor]],
                    grads: List[List[torch.Tensor]]) -> None:
        """step(), before its agreement: launch the buckets backward did not
        (one holding a param that got no gradient on this rank), from the
        step's gradients. A param with a gradient on some ranks only left
        a rank waiting for it: that rank launched fewer buckets and queued
        the agreement ahead of exchanges its peers had queued it behind,
        and each waited for the other. Now every rank queues every bucket,
        then the agreement. Only where backward launches (alike on every
        rank: not under a GradScaler's relaunch, nor in no_overlap)."""
        if not self.enabled or self.scaled or not self.callbacks.active():
            return
        # (backward may have planned for other params: a group added since,
        # whose params step() now trains apart as late joiners)
        replan = signature(trained) != self.signature
        if replan and self.launched:
            self.abandon()
        self._launch_the_rest(trained, grads, replan)

    def _launch_the_rest(self, trained, grads, replan: bool) -> None:
        """Plan for `trained` where asked (or not yet planned), then launch
        every bucket not launched yet from the step's gradients `grads`."""
        if replan or not self.planned:
            self._plan(trained)
            self.planned = True
        for b in self.buckets[self.launched:]:
            self._launch(b, b.pick(grads[b.index]))

    def settle(self, trained: List[List[torch.Tensor]], grads: List[List[torch.Tensor]],
               relaunch: bool) -> None:
        """step(), before the update: make sure every bucket was launched
        from this step's gradients and the same plan (`collect` then waits
        for each). relaunch: the gradients step() uses differ from what
        backward saw (a GradScaler unscaled them): exchange again from
        `grads`."""
        self.scaled = relaunch
        # An input written for other hyper-parameters (0/1 Adam's sync bakes
        # in lr: a scheduler that stepped between backward and step()).
        changed = any(b.input_key != self.callbacks.input_key(b.index)
                      for b in self.buckets[:self.launched])
        redo = self.stale or relaunch or changed or signature(trained) != self.signature
        if redo and self.launched:
            if self.stale and not self._warned:
                self._warned = True
                warnings.warn("onebit overlap_backward: gradients changed after their bucket was "
                              "exchanged (a param unused at the last step got one, several "
                              "backward passes ran before step(), or the gradients were changed "
                              "in place after backward, as clip_grad_norm_ does); the buckets "
                              "are exchanged again at step(). With gradient accumulation, run "
                              "all but the last micro-batch inside `with "
                              "optimizer.no_overlap():`; a loop that clips every step gains "
                              "nothing from the overlap: turn it off",
                              RuntimeWarning, stacklevel=4)
            self.stats["redone"] += self.launched
            self.abandon()
        self._launch_the_rest(trained, grads, redo)
        self.settled = True

    def collect(self, index: int, out: List[torch.Tensor], seen: List[bool],
                masks: list) -> Iterator[List[int]]:
        """Group `index`'s buckets in launch order, each as soon as its
        exchange finishes: its exchanged values go into `out` (the group's
        trained params' order), zeroed where v == 0 (the guard's `seen` and
        `masks`), and its positions in `out` are yielded."""
        for b in self.buckets:
            if b.index != index:
                continue
            started = time.perf_counter()
            b.future.result()  # a CommunicationError of the thread surfaces here
            self.stats["wait_s"] += time.perf_counter() - started
            self.handoff.consume(b.ready_device, b.done)
            b.collected = True
            b.land(out, self.exchange.views(b.key, b.params), seen, masks)
            yield b.positions

    def inputs_now(self, index: int, like: List[torch.Tensor]) -> List[torch.Tensor]:
        """For an exchange of group `index` that step() makes itself: the
        buffers of its buckets, as views in the group's order (shaped like
        `like`), for the caller to write the input into; `exchange_now`
        then sends them. Over the buckets' buffers and errors, so that a
        group's error feedback keeps one history whichever path a step takes
        (and the bits stay those of the fused exchange). Exchanges launched
        during backward for this step are undone first."""
        if self.launched:
            self.abandon()
        views: List[Optional[torch.Tensor]] = [None] * len(like)
        self._now[index] = [b for b in plan_buckets(self.callbacks.trained(), self.cap,
                                                    self.first_cap) if b.index == index]
        for b in self._now[index]:
            for j, view in zip(b.positions, self.exchange.prepare(b.key, b.params)):
                views[j] = view
        return views

    def exchange_now(self, index: int, out: Optional[List[torch.Tensor]], seen: List[bool],
                     masks: list) -> Iterator[List[int]]:
        """The buckets `inputs_now` handed out, bucket by bucket: each one's
        compressed allreduce runs at once, and the result goes into `out` as
        in `collect` (with `out` None it stays in the buffers)."""
        for b in self._now.pop(index):
            self.exchange.allreduce(b.key)
            if out is not None:
                b.land(out, self.exchange.views(b.key, b.params), seen, masks)
            yield b.positions

    def abandon(self) -> None:
        """Put back the errors of every launched exchange that step() did
        not collect: as if it never happened."""
        failure = None
        for b in self.buckets:
            if b.future is None or b.collected:
                continue
            try:
                b.future.result()
            except BaseException as exc:  # noqa: BLE001 - the first one is re-raised below
                failure = failure or exc
            if failure is None:  # its exchange ran, after its backup
                self.handoff.consume(b.ready_device, b.done)
                self.exchange.restore(b.key)
            b.future = None
        self.launched = 0
        if failure is not None:
            raise failure

    def end_step(self) -> None:
        """After step(): exchanges nobody collected (a skipped or refused
        step, or one cut short by an error) are undone; the next backward
        starts a new plan check."""
        try:
            if self.launched:
                self.abandon()
        finally:
            self.exchange.new_round()
            self.absent = {id(p) for b in self.buckets for p in b.params if p.grad is None}
            for b in self.buckets:
                b.future, b.collected, b.grads_seen = None, False, []
            self.launched, self.planned, self.stale, self.settled = 0, False, False, False
            self.failure = None

    def close(self) -> None:
        self._thread.shutdown(wait=True)
