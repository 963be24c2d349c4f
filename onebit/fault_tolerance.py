"""Keep training when a replica fails: onebit's optimizers on torchft.

torchft (PyPI `torchft`, the `[ft]` extra) runs a Lighthouse and one
Manager per replica group: a quorum before each step, `should_commit()`
after it, and a joining replica healed from a peer. This module puts
onebit's 1-bit exchange on the replicas of the current quorum.

How a step goes, one process per replica group::

    opt.zero_grad()      1. quorum: torchft reconfigures the replicas' group;
                            a joining replica loads params and optimizer
                            state from a peer; when the replicas changed,
                            the exchange is reopened on the new group
    loss.backward()
    opt.step()           2. snapshot what the step changes
                         3. the onebit step: full-precision average or
                            1-bit exchange across the quorum
                         4. should_commit(): every replica group votes
                         5. commit, or roll back to the snapshot

Semantics (docs/fault_tolerance.md):

- A step that fails (an exchange error on this replica, or
  `should_commit()` saying no) is rolled back here: params, moments, stage
  counters, error buffers and the committed traffic stay as they were.
  torchft's vote is per replica group; a replica that committed a step the
  others rolled back is ahead, and the next quorum heals the others from it
  (torchft heals every replica behind the quorum's highest step).
- A quorum change (a replica left or joined) reopens the exchange on the
  new group. Each survivor keeps its worker errors (one value per element
  of the fused buffer, at the same offsets at any world size); the server
  errors, chunks laid out by world size, restart from zero; the momentum
  and the frozen variance are kept.
- A joining replica gets params (through the model's state dict, which the
  script registers with the Manager), optimizer state and stage counters
  from a peer, so it does not redo the warmup; its own error buffers start
  at zero.

torchft's quorum must be synchronous (`use_async_quorum=False`): a healing
replica then loads its peer's state before its forward pass and takes part
in the step, so after its first committed step it is bitwise identical to
its peers. `replica_manager` builds such a Manager.
"""
from __future__ import annotations

import copy
import datetime
import logging
import warnings
from typing import Callable, Dict, Iterable, List, Optional

import torch
import torch.distributed as dist

from .collectives import CommunicationError
from .feedback.state import carried_worker_errors

try:  # the [ft] extra
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo, create_store_client
    HAVE_TORCHFT = True
except ImportError:  # pragma: no cover - exercised where torchft is absent
    Manager = None
    ProcessGroupGloo = object
    create_store_client = None
    HAVE_TORCHFT = False

log = logging.getLogger(__name__)

# The warning a load without error buffers gives: after a quorum change the
# restart is this module's decision, logged here, not a lost checkpoint.
_RESTART_WARNING = ".*error-feedback buffers restarted from zero.*"


def require_torchft() -> None:
    if not HAVE_TORCHFT:
        raise ImportError("onebit.fault_tolerance needs torchft: pip install 'onebit[ft]' "
                          "(torchft>=0.2, Python 3.11 wheels)")


class ReplicaGroup(ProcessGroupGloo):
    """torchft's reconfigurable gloo group, which also keeps
    torch.distributed's default group equal to the current quorum.

    torchft calls `configure` with a fresh store prefix, this replica's rank
    and the world size at every quorum change. onebit's optimizers run their
    collectives (and their checks that every rank agrees) on a
    torch.distributed group, so the default group is rebuilt from the same
    store and ranks. One process per replica group: the default group then
    is the replicas, and nothing else may own it.

    `generation` counts the configurations: an optimizer built on an older
    one holds a world size that is no longer true.
    """

    def __init__(self, timeout: datetime.timedelta = datetime.timedelta(seconds=60)) -> None:
        require_torchft()
        super().__init__(timeout=timeout)
        self.generation = 0
        self.replica_rank = 0
        self.replica_world_size = 1
        self._default_timeout = timeout

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                  *args, **kwargs) -> None:
        super().configure(store_addr, replica_id, rank, world_size, *args, **kwargs)
        if dist.is_initialized():
            dist.destroy_process_group()
        # The same store and prefix as torchft's own group, one level down:
        # every replica of this quorum, and only they, meet there.
        store = create_store_client(f"{store_addr}/onebit", timeout=self._default_timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=self._default_timeout)
        self.replica_rank, self.replica_world_size = rank, world_size
        self.generation += 1


def replica_manager(model: torch.nn.Module, *, lighthouse_addr: str, replica_id: str,
                    timeout_s: float = 30.0, min_replica_size: int = 1,
                    store_port: Optional[int] = None, **manager_options) -> "Manager":
    """A torchft Manager for one replica group of one process, with the
    settings onebit needs: a `ReplicaGroup` and a synchronous quorum.
    Starts the replica group's TCPStore (torchft expects one) on a free
    port unless `store_port` names a running one. The model's
    state_dict travels to healing replicas; `FaultTolerantOptimizer` adds
    the optimizer's."""
    require_torchft()
    timeout = datetime.timedelta(seconds=timeout_s)
    keep_alive = None
    if store_port is None:
        keep_alive = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        store_port = keep_alive.port
    group = ReplicaGroup(timeout=timeout)
    manager = Manager(pg=group, min_replica_size=min_replica_size,
                      load_state_dict=model.load_state_dict, state_dict=model.state_dict,
                      use_async_quorum=False, timeout=timeout, quorum_timeout=timeout,
                      connect_timeout=timeout, rank=0, world_size=1, store_addr="localhost",
                      store_port=store_port, lighthouse_addr=lighthouse_addr,
                      replica_id=replica_id, **manager_options)
    manager.onebit_store = keep_alive  # the store lives as long as the manager
    manager.onebit_group = group  # what FaultTolerantOptimizer reopens the exchange on
    return manager


def _cloned(tree):
    """A copy of a state dict whose tensors do not follow training."""
    return copy.deepcopy(tree)


class _Snapshot:
    """What one step may change, taken before it: the params' values, the
    optimizer's state dict (moments, stage counters) and this rank's error
    buffers."""

    def __init__(self, params: List[torch.Tensor], optimizer) -> None:
        self.params = [p.detach().clone() for p in params]
        self.state = _cloned(optimizer.state_dict())
        self.errors = _cloned(optimizer.error_feedback_state_dict())

    def restore_params(self, params: List[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, saved in zip(params, self.params):
                p.copy_(saved)


def _step_and_vote(manager, on_this_quorum: bool, take_step: Callable[[], object]):
    """Take the step where this replica can (its exchange opened on this
    quorum, and nothing failed yet), then cast its vote; a failed exchange
    votes no. Returns (whether the step commits, the exchange's error)."""
    ok, error = on_this_quorum and manager.errored() is None, None
    if ok:
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_RESTART_WARNING)
                take_step()
        except CommunicationError as exc:  # a peer died or hung
            manager.report_error(exc)
            ok, error = False, exc
    return manager.should_commit() and ok, error  # every replica votes, whatever happened


def _restore_errors(owner, errors: Optional[dict], replicas_changed: bool) -> None:
    """Put this rank's error buffers `errors` (None: a healed replica's own
    start at zero) into `owner`, just rebuilt and loaded: as they were when
    the replicas are the same (a rolled-back step); else the worker errors
    where the fused buffers hold the same tensors, the server errors, laid
    out by world size, from zero (measured better than restarting both:
    docs/benchmarks/fault_tolerance.md)."""
    if errors is None:
        return
    if not replicas_changed:
        owner.load_error_feedback_state_dict(errors)
        return
    carried = carried_worker_errors(errors, owner.error_feedback_state_dict())
    if carried is not None:
        owner.load_error_feedback_state_dict(carried)


class FaultTolerantOptimizer:
    """A onebit optimizer whose steps commit through torchft.

    `make_optimizer(params)` builds the onebit optimizer (OnebitAdam,
    OnebitLamb or ZeroOneAdam) on the current quorum; it is called again
    whenever the replicas change or a step is rolled back, and must build
    the same optimizer each time (it is handed the same params). Use:

        manager = onebit.fault_tolerance.replica_manager(model, lighthouse_addr=..., replica_id=...)
        opt = FaultTolerantOptimizer(manager, model.parameters(),
                                     lambda ps: onebit.OnebitAdam(ps, lr=1e-3, freeze_step=100))
        for batch in batches:
            opt.zero_grad()          # the quorum, and healing, before the forward pass
            loss_fn(model(batch)).backward()
            opt.step()               # True when the step committed

    Not supported: `overlap_backward` (its hooks belong to one optimizer and
    the optimizer is rebuilt) and the DDP comm hook (onebit averages the
    gradients itself, as without DDP).
    """

    def __init__(self, manager: "Manager", params: Iterable[torch.Tensor],
                 make_optimizer: Callable[[List[torch.Tensor]], torch.optim.Optimizer]) -> None:
        require_torchft()
        self.manager = manager
        self.params = [p for p in params if p.requires_grad]
        self._make = make_optimizer
        self._group: ReplicaGroup = self._replica_group(manager)
        # Until the first quorum there is no group: a world-size-1 optimizer
        # holds the state (a peer may ask for it while healing another).
        self.optimizer = self._build()
        self._built_on = -1  # the group generation self.optimizer runs on
        self._pending: Optional[_Snapshot] = None  # rolled back or healed: rebuild from it
        self._pending_state: Optional[dict] = None
        self._quorum_started = False
        self.committed_steps = 0
        self.failed_steps = 0
        self.quorum_changes = 0
        self.committed_bytes = 0
        self.last_error: Optional[BaseException] = None
        manager.register_state_dict_fn("onebit_optimizer", self._load_healed_state,
                                       self.state_dict)

    @staticmethod
    def _replica_group(manager) -> ReplicaGroup:
        group = getattr(manager, "onebit_group", None)
        if group is None:
            raise ValueError("FaultTolerantOptimizer: build the Manager with "
                             "onebit.fault_tolerance.replica_manager(), which gives it a "
                             "ReplicaGroup and a synchronous quorum")
        return group

    def _build(self):
        opt = self._make(self.params)
        if opt.overlap_stats() is not None:
            raise ValueError("FaultTolerantOptimizer: overlap_backward=True is not supported "
                             "(the optimizer is rebuilt when the replicas change)")
        return opt

    # ------------------------------------------------------------ the step --
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start this step's quorum (torchft heals a joining replica here),
        reopen the exchange if the replicas changed, and clear gradients."""
        self.manager.start_quorum()
        self._quorum_started = True
        self._rebuild_if_needed()
        self.optimizer.zero_grad(set_to_none)

    def _rebuild_if_needed(self) -> None:
        changed = self._group.generation != self._built_on
        if not changed and self._pending is None and self._pending_state is None:
            return
        if self._pending_state is not None:  # healed from a peer
            state, errors = self._pending_state, None
        elif self._pending is not None:  # rolled back
            state, errors = self._pending.state, self._pending.errors
        else:
            state, errors = self.optimizer.state_dict(), self.optimizer.error_feedback_state_dict()
        try:
            fresh = self._build()
        except CommunicationError as exc:  # a peer died during the rebuild's checks
            self.manager.report_error(exc)
            self.last_error = exc
            return
        fresh.momentum_restart = False  # the momentum is a replica-wide value: keep it
        fresh.load_state_dict(state)
        _restore_errors(fresh, errors, changed)
        if changed:
            self.quorum_changes += 1
            log.info("onebit: replicas now %d (rank %d): the exchange reopened",
                     self._group.replica_world_size, self._group.replica_rank)
        self.optimizer, self._built_on = fresh, self._group.generation
        self._pending = self._pending_state = None

    def step(self, closure=None) -> bool:
        """The onebit step, committed only if every part of it succeeded and
        torchft's `should_commit()` agrees; else rolled back. Returns whether
        it committed."""
        if closure is not None:
            raise ValueError("FaultTolerantOptimizer.step: closures are not supported")
        if not self._quorum_started:
            self.zero_grad(set_to_none=False)  # keeps the gradients: start the quorum only
        self._quorum_started = False
        snapshot = _Snapshot(self.params, self.optimizer)
        committed, error = _step_and_vote(self.manager, self._built_on == self._group.generation,
                                          self.optimizer.step)
        self.last_error = error or self.last_error
        if committed:
            self.committed_steps += 1
            self.committed_bytes += int(self.optimizer.comm_stats().get("bytes_sent", 0))
            return True
        self.failed_steps += 1
        snapshot.restore_params(self.params)
        self._pending = snapshot
        return False

    # --------------------------------------------------------- checkpoints --
    def state_dict(self) -> dict:
        """The committed optimizer state (what a healing peer receives)."""
        if self._pending_state is not None:
            return self._pending_state
        if self._pending is not None:
            return self._pending.state
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self._load_healed_state(state_dict)
        self._rebuild_if_needed()

    def _load_healed_state(self, state_dict: dict) -> None:
        self._pending_state = _cloned(state_dict)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def comm_stats(self) -> Dict[str, object]:
        """The onebit optimizer's last report, with this run's fault counters."""
        return {**self.optimizer.comm_stats(), "committed_steps": self.committed_steps,
                "failed_steps": self.failed_steps, "quorum_changes": self.quorum_changes,
                "committed_bytes_sent": self.committed_bytes}


class FaultTolerantDiLoCo:
    """DiLoCo whose rounds commit through torchft.

    The inner steps stay local and involve no quorum. At each round's inner
    step: the quorum (a joining replica heals here), the round (the inner
    step, then the 1-bit or 2-bit average of the pseudo-gradients and the
    outer step), and torchft's vote. A round that fails is rolled back on
    this replica, inner step included: params, anchors, outer momentum,
    error buffers, the inner optimizer's state and the counters are as
    before it, so the next inner step is the round again, among the
    replicas that are left. The round is landed among the survivors, not
    dropped: their inner progress since the last round is kept and sent,
    and the anchors are identical on every replica after every committed
    round.

    `make_diloco()` builds `onebit.DiLoCo(model, inner_optimizer, ...)` on
    the current quorum (called again whenever the replicas change):
    plain rounds only (fragments=1, overlap_steps=0, warmup_steps=0).
    A replica that heals receives the anchors, the outer momentum, the
    counters and the inner optimizer's state, and starts from the anchors
    (the last synced point), with its error buffers at zero.

        diloco = FaultTolerantDiLoCo(manager, model, inner, lambda: onebit.DiLoCo(
            model, inner, sync_every=16, compression="1bit"))
        for batch in batches:
            loss_fn(model(batch)).backward()
            diloco.step()            # inner.step(); a round every 16th: True if it committed
            inner.zero_grad()
    """

    def __init__(self, manager: "Manager", model: torch.nn.Module,
                 inner_optimizer: torch.optim.Optimizer, make_diloco: Callable[[], object]) -> None:
        require_torchft()
        self.manager, self.inner = manager, inner_optimizer
        self._make = make_diloco
        self._group = FaultTolerantOptimizer._replica_group(manager)
        self.diloco = self._build()
        self.params = list(self.diloco.params)
        self._built_on = -1
        self._healed: Optional[dict] = None
        self.committed_rounds = self.failed_rounds = self.quorum_changes = 0
        self.last_error: Optional[BaseException] = None
        manager.register_state_dict_fn("onebit_diloco", self._load_healed_state, self.state_dict)

    def _build(self):
        diloco = self._make()
        if diloco.fragments != 1 or diloco.overlap_steps or diloco.warmup_steps:
            diloco.detach()
            raise ValueError("FaultTolerantDiLoCo: plain rounds only (fragments=1, "
                             "overlap_steps=0, warmup_steps=0)")
        return diloco

    @property
    def inner_steps(self) -> int:
        return self.diloco.inner_steps

    def state_dict(self) -> dict:
        """What a healing replica receives: DiLoCo's shared state and the
        inner optimizer's."""
        if self._healed is not None:
            return self._healed
        return {"diloco": self.diloco.state_dict(), "inner": self.inner.state_dict()}

    def _load_healed_state(self, state: dict) -> None:
        self._healed = _cloned(state)

    def step(self) -> Optional[bool]:
        """The inner step; at a round's step, the round as a transaction.
        Returns None between rounds, else whether the round committed."""
        d = self.diloco
        if (d.inner_steps + 1) % d.sync_every:
            self.inner.step()
            return None
        self.manager.start_quorum()
        self._rebuild_if_needed()
        d = self.diloco
        params = [p.detach().clone() for p in self.params]
        saved = (_cloned(d.state_dict()), _cloned(d.error_feedback_state_dict()),
                 _cloned(self.inner.state_dict()))
        committed, error = _step_and_vote(self.manager, self._built_on == self._group.generation,
                                          self.inner.step)  # the round hangs off the inner step
        self.last_error = error or self.last_error
        if committed:
            self.committed_rounds += 1
            return True
        self.failed_rounds += 1
        with torch.no_grad():
            for p, saved_p in zip(self.params, params):
                p.copy_(saved_p)
        self.inner.load_state_dict(saved[2])
        d.load_state_dict(saved[0])  # no collective: the group may be broken
        d.load_error_feedback_state_dict(saved[1])
        return False

    def _rebuild_if_needed(self) -> None:
        if self._group.generation == self._built_on and self._healed is None:
            return
        old = self.diloco
        errors = None  # a healed replica's own start at zero
        if self._healed is not None:  # start from the peer's last synced point
            state, inner_state = self._healed["diloco"], self._healed["inner"]
            mine = [a.detach().clone() for a in state["anchors"]]
        else:
            state, inner_state = _cloned(old.state_dict()), None
            errors = _cloned(old.error_feedback_state_dict())
            mine = [p.detach().clone() for p in self.params]
        old.detach()
        try:
            fresh = self._build()  # broadcasts rank 0's params: each takes its own back
        except CommunicationError as exc:
            self.manager.report_error(exc)
            self.last_error = exc
            self.diloco = old
            return
        with torch.no_grad():
            for p, value in zip(self.params, mine):
                p.copy_(value)
        fresh.load_state_dict(state)
        changed = self._group.generation != self._built_on
        _restore_errors(fresh, errors, changed)
        if inner_state is not None:
            self.inner.load_state_dict(inner_state)
        self.quorum_changes += changed
        log.info("onebit DiLoCo: replicas now %d (rank %d)",
                 self._group.replica_world_size, self._group.replica_rank)
        self.diloco, self._built_on, self._healed = fresh, self._group.generation, None

    def comm_stats(self) -> Dict[str, object]:
        return {**self.diloco.comm_stats(), "committed_rounds": self.committed_rounds,
                "failed_rounds": self.failed_rounds, "quorum_changes": self.quorum_changes}
