"""The error-feedback exchange: every fused buffer the optimizer sends, and
the error buffers that make its 1-bit average converge.

One object owns what used to be spread over the optimizer and the overlap:

- the fused buffers and their layouts (the backend's BlockLayout: each
  tensor on its own blocks, zeros in between that stay zero);
- each compressed buffer's worker and server errors, created on first use
  (zeros, or the ones a checkpoint restored for the same layout);
- a copy of a bucket's errors taken before its exchange, put back when the
  step is undone (overlap.py);
- the per-rank error-feedback state dict (state.py).

Buffers are named by a key type, not by an overloaded int:

- `GroupKey(3)`: param group 3 exchanged as one fused buffer (its full-
  precision average shares the buffer); saved as "3";
- `BucketKey(3, 1)`: bucket 1 of the overlap's plan (its place in the whole
  plan, across groups), which holds params of group 3; saved as "3.1";
- `LateKey(3)`: the late joiners of group 3 (late.py), averaged in full
  precision only, so they have no errors and are never saved.
- `UnhookedKey(GroupKey(3))`: the params of group 3 outside the DDP model,
  averaged in full precision by the optimizer while the hook averages the
  rest (ddp.py); no errors.

Frozen dataclasses rather than tuples: `GroupKey(0)` and `LateKey(0)` must
be different keys.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch


@dataclass(frozen=True)
class GroupKey:
    """Param group `group`'s fused buffer."""

    group: int

    @property
    def name(self) -> str:
        return str(self.group)


@dataclass(frozen=True)
class BucketKey:
    """Bucket `number` of the overlap's plan (numbered across all groups),
    made of params of group `group`."""

    group: int
    number: int

    @property
    def name(self) -> str:
        return f"{self.group}.{self.number}"


@dataclass(frozen=True)
class LateKey:
    """The late joiners of group `group`: full precision only, no errors."""

    group: int


@dataclass(frozen=True)
class UnhookedKey:
    """The params of buffer `of` (a GroupKey or LateKey) that the DDP hook
    did not average: full precision only, no errors."""

    of: Union[GroupKey, LateKey]


ErrorKey = Union[GroupKey, BucketKey]  # buffers that carry error feedback
BufferKey = Union[GroupKey, BucketKey, LateKey, UnhookedKey]


def key_from_name(name: str) -> Optional[ErrorKey]:
    """The key a saved name ("3", "3.1") stands for; None for any other name."""
    try:
        parts = [int(x) for x in name.split(".")]
    except ValueError:
        return None
    if len(parts) == 1:
        return GroupKey(parts[0])
    if len(parts) == 2:
        return BucketKey(parts[0], parts[1])
    return None


class ErrorFeedbackExchange:
    """Fused buffers, their layouts and error feedback over one backend
    (`backend`: the optimizer's compressed backend; None at world size 1,
    where nothing is exchanged).

    A buffer keeps its storage while the sizes it holds do not change (no
    allocation per step; the overlap's views stay valid). The errors of a buffer
    may be created on the overlap's communication thread (`errors` inside
    its stream), so everything that reads or writes them there goes through
    `backup`, `allreduce` and `restore`.
    """

    def __init__(self, backend) -> None:
        self.backend = backend
        self._flat: Dict[BufferKey, Tuple[torch.Tensor, object]] = {}  # key -> (buffer, layout)
        self._errors: Dict[ErrorKey, Tuple[torch.Tensor, torch.Tensor]] = {}  # (worker, server)
        self._saved: Dict[ErrorKey, dict] = {}  # loaded, used when the buffer's layout matches
        self._backups: Dict[ErrorKey, Tuple[torch.Tensor, torch.Tensor]] = {}  # before an exchange
        self._round = 0  # one per optimizer step (new_round), backward included
        self._backup_round: Dict[ErrorKey, int] = {}  # the round each backup was taken in

    # ------------------------------------------------------------ buffers --
    def layout_for(self, sizes: Sequence[int]):
        """The backend's layout of a fused buffer of tensors of `sizes` elements."""
        return self.backend.layout(list(sizes))

    def buffer(self, key: BufferKey, like: List[torch.Tensor]) -> torch.Tensor:
        """Buffer `key`, sized for tensors shaped like `like` (kept while
        their sizes stay the same, else made anew, zeroed)."""
        sizes = [t.numel() for t in like]
        cached = self._flat.get(key)
        if cached is None or cached[1].sizes != sizes:
            layout = self.layout_for(sizes)
            device = like[0].device if like else torch.device("cpu")
            cached = self._flat[key] = (torch.zeros(layout.numel, device=device), layout)
        return cached[0]

    def views(self, key: BufferKey, like: List[torch.Tensor]) -> List[torch.Tensor]:
        """Buffer `key` cut into views shaped like `like` (no allocation)."""
        flat, layout = self._flat[key]
        return layout.views(flat, [t.shape for t in like])

    def prepare(self, key: BufferKey, like: List[torch.Tensor]) -> List[torch.Tensor]:
        """The views of buffer `key`, sized for `like` first."""
        self.buffer(key, like)
        return self.views(key, like)

    def flatten_into(self, key: BufferKey, tensors: List[torch.Tensor]) -> None:
        if tensors:
            torch._foreach_copy_(self.views(key, tensors), tensors)

    def unflatten_from(self, key: BufferKey, tensors: List[torch.Tensor]) -> None:
        if tensors:
            torch._foreach_copy_(tensors, self.views(key, tensors))

    # ---------------------------------------------------------- exchanges --
    def allreduce(self, key: ErrorKey) -> None:
        """The compressed allreduce of buffer `key`, in place, with its errors."""
        flat, layout = self._flat[key]
        self.backend.compressed_allreduce(flat, *self.errors(key), layout=layout)

    def average_(self, key: BufferKey, tensors: List[torch.Tensor],
                 mean_: Callable[[torch.Tensor], None]) -> None:
        """tensors <- their mean across ranks: `mean_(flat)` replaces buffer
        `key` by it in place (the caller's collective); a raise there
        leaves `tensors` as they were."""
        if not tensors:
            return
        flat = self.buffer(key, tensors)
        self.flatten_into(key, tensors)
        mean_(flat)
        self.unflatten_from(key, tensors)

    # ------------------------------------------------------------- errors --
    def errors(self, key: ErrorKey) -> Tuple[torch.Tensor, torch.Tensor]:
        """(worker_error, server_error) of buffer `key`: restored from a
        checkpoint for its layout, or zeros, on first use."""
        flat, layout = self._flat[key]
        errors = self._errors_at(key, layout)
        if errors is None:
            errors = self._errors[key] = self._restored(key, layout, flat.device, keep=False)
        return errors

    def _errors_at(self, key: ErrorKey, layout):
        """Buffer `key`'s errors if they exist at `layout`'s sizes, else None."""
        errors = self._errors.get(key)
        if errors is None or (errors[0].numel(), errors[1].numel()) != layout.error_sizes:
            return None
        return errors

    def error_buffers(self) -> Dict[ErrorKey, Tuple[torch.Tensor, torch.Tensor]]:
        """Every error pair made so far, in the order they were made
        (telemetry sums their norms in this order)."""
        return dict(self._errors)

    def errors_to_report(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """The error pairs the next exchanges start from: every one made so
        far, then those loaded from a checkpoint and not yet taken up (a
        resumed run's errors wait there until their buffer's first exchange,
        and its telemetry should not read 0 meanwhile)."""
        waiting = [(g["worker"], g["server"]) for k, g in self._saved.items()
                   if k not in self._errors]
        return list(self._errors.values()) + waiting

    def backup(self, key: ErrorKey) -> None:
        """Copy buffer `key`'s errors aside, before an exchange that may be undone."""
        worker, server = self.errors(key)
        saved = self._backups.get(key)
        if saved is None or saved[0].shape != worker.shape or saved[1].shape != server.shape:
            saved = self._backups[key] = (torch.empty_like(worker), torch.empty_like(server))
        saved[0].copy_(worker)
        saved[1].copy_(server)
        self._backup_round[key] = self._round

    def new_round(self) -> None:
        """The step's exchanges are over: backups taken from now on belong to the next."""
        self._round += 1

    def restore(self, key: ErrorKey) -> None:
        """Put back the errors `backup` copied: as if the exchange never happened."""
        saved = self._backups.get(key)
        if saved is None:
            return
        worker, server = self.errors(key)
        worker.copy_(saved[0])
        server.copy_(saved[1])

    def keep_tensor_errors(self, key: ErrorKey, like: List[torch.Tensor],
                           index: int) -> Callable[[], None]:
        """A function that puts tensor `index`'s slices of buffer `key`'s
        errors (a buffer of tensors shaped like `like`) back as they were
        before this round's exchange of `key`: from the backup taken before
        it when there was one (an exchange launched during backward ran
        before this call), else as they are now (zeros where they do not
        exist yet, a checkpoint's where one waits)."""
        if self.backend is None or not like:
            return lambda: None
        self.buffer(key, like)  # the step makes it anyway; its layout is made once
        layout = self._flat[key][1]
        ranges = self.backend.error_ranges(layout, index)
        now = self._errors_at(key, layout)
        if now is None:
            now = self._restored(key, layout, like[0].device, keep=True)
        kept = [None if r is None else t[r[0]:r[1]].clone() for t, r in zip(now, ranges)]
        this_round = self._round

        def put_back() -> None:
            errors = self._errors_at(key, layout)
            if errors is None:
                return  # never made, or made anew for another layout: nothing of this step
            before = (self._backups[key] if self._backup_round.get(key) == this_round
                      else None)
            for k, (t, r) in enumerate(zip(errors, ranges)):
                if r is not None:
                    t[r[0]:r[1]].copy_(kept[k] if before is None else before[k][r[0]:r[1]])
        return put_back

    def reset(self) -> None:
        """The errors restart from zero; the buffers stay. Errors loaded from
        a checkpoint and not yet taken up go too: they would come back at
        the next exchange (0/1 Adam resets at its freeze, and a run resumed
        from that very step would start it from the warmup's errors)."""
        self._errors.clear()
        self._saved = {}

    def forget_layouts(self) -> None:
        """Drop everything sized for the current params: a param's trainability
        or a checkpoint changed them."""
        self.reset()
        self._flat.clear()
        self._backups.clear()

    # -------------------------------------------------------- checkpoints --
    def layouts(self, trained: List[List[torch.Tensor]],
                buckets: Sequence[Tuple[BucketKey, Sequence[int]]] = ()) -> Dict[ErrorKey, object]:
        """Key -> layout of every buffer that carries errors: each group
        with trained params, then `buckets` ((key, sizes) in plan order)."""
        if self.backend is None:
            return {}
        out: Dict[ErrorKey, object] = {
            GroupKey(i): self.layout_for([p.numel() for p in ps])
            for i, ps in enumerate(trained) if ps}
        out.update((key, self.layout_for(sizes)) for key, sizes in buckets)
        return out

    def errors_state(self, layouts: Dict[ErrorKey, object], device: torch.device) -> dict:
        """Name -> {"layout", "worker", "server"} (copies) for every buffer of
        `layouts`, in its order; zeros of the right size where none exist yet
        (a checkpoint loader needs a target of every size)."""
        out = {}
        for key, layout in layouts.items():
            w, s = self._errors.get(key) or self._restored(key, layout, device, keep=True)
            out[key.name] = {"layout": repr(layout.key), "worker": w.detach().clone(),
                             "server": s.detach().clone()}
        return out

    @staticmethod
    def layouts_match(groups: dict, layouts: Dict[ErrorKey, object]) -> bool:
        """Whether every saved buffer of `groups` (name -> saved entry) has a
        buffer of the same layout here."""
        for name, saved in groups.items():
            layout = layouts.get(key_from_name(name))
            if layout is None or saved["layout"] != repr(layout.key):
                return False
        return True

    def load_errors(self, groups: Optional[dict]) -> None:
        """Reset the errors; each buffer then starts from its saved entry in
        `groups` (None: from zero) when its layout matches."""
        self.reset()
        self._saved = {key_from_name(k): g for k, g in groups.items()} if groups is not None else {}

    def _restored(self, key: ErrorKey, layout, device: torch.device, keep: bool):
        saved = self._saved.get(key) if keep else self._saved.pop(key, None)
        if saved is not None and saved["layout"] == repr(layout.key):
            return saved["worker"].to(device), saved["server"].to(device)
        worker, server = layout.error_sizes
        return torch.zeros(worker, device=device), torch.zeros(server, device=device)
