"""How a compressed allreduce is cut into pieces, and how many to cut.

Pipelining cuts every rank's chunk (the N/p elements rank k serves) into the
same `count` block-aligned sub-ranges; piece j is sub-range j of every chunk.
While piece j's all-to-all is on the wire, piece j+1 is compressed, and piece
j-1's all-gather flies while piece j is served. Who serves an element never
changes, and every sign and scale is decided per block, so the count is a
schedule only: it changes no bit of the result and no error buffer, and it
may differ from call to call (as long as all ranks use the same one).

Whether pieces pay depends on the link. On a slow network the compression
hides behind the wire; where compression itself is the bottleneck (loopback,
fast links, many ranks per core) each extra pair of collectives only adds
latency. With `piece_size=None` (the default) the `PieceTuner` therefore
times both schedules on the first calls of each buffer layout and keeps the
faster, as judged by the slowest rank. `run_pipelined` drives the pieces
through the stages of a call, whatever those stages are.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

PIECE_SIZE = 1 << 21  # elements per piece when pipelining (measured: README, "Pipelining")
TRIALS = 3  # timed calls per schedule before the tuner decides
TUNING_CALLS = 2 + 2 * TRIALS  # two warm-up calls, then the trials alternate


def piece_ranges(chunk: int, block: int, count: int) -> List[Tuple[int, int]]:
    """`count` (at most chunk/block) near-equal block-aligned sub-ranges
    [a, b) of a chunk of `chunk` elements."""
    blocks = chunk // block
    count = max(1, min(count, blocks))
    return [(j * blocks // count * block, (j + 1) * blocks // count * block) for j in range(count)]


def piece_count(padded: int, piece_size: int) -> int:
    """Pieces of about `piece_size` elements in a buffer of `padded` (0: one)."""
    return 1 if piece_size == 0 else max(1, math.ceil(padded / piece_size))


def check_piece_size(piece_size) -> None:
    if piece_size is not None and (isinstance(piece_size, bool) or not isinstance(piece_size, int)
                                   or piece_size < 0):
        raise ValueError(f"piece_size must be None (tune it), 0 (no pipelining) or a number of "
                         f"elements per piece, got {piece_size!r}")


class CallTimer:
    """How long a call took to finish on its device, for the tuner: between
    two events on the device's current stream. A host clock around
    stream-ordered waits (NCCL's, XCCL's) would measure the launches only:
    the transfer is still running when the wait returns. On the host the
    events are the host clock. `seconds()` waits for the end event, so the
    tuner reads it only on the calls it times."""

    def __init__(self, device: torch.device) -> None:
        from ..accelerator import accelerator_for

        acc = accelerator_for(device)
        self._stream = acc.current_stream(device.index)  # the data's device, from any thread
        self._start, self._end = acc.Event(enable_timing=True), acc.Event(enable_timing=True)
        self._start.record(self._stream)

    def stop(self) -> "CallTimer":
        self._end.record(self._stream)
        return self

    def seconds(self) -> float:
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1e3


class PieceTuner:
    """The piece count for each call of a compressed allreduce.

    piece_size: an int fixes it (0: one piece); None times one piece against
    pieces of PIECE_SIZE for each layout, on calls that every rank makes in
    the same order, then agrees on the faster through `share`.
    """

    def __init__(self, piece_size: Optional[int]) -> None:
        check_piece_size(piece_size)
        self.piece_size = piece_size
        self._trial: Dict[tuple, dict] = {}
        self.chosen: Dict[tuple, int] = {}  # layout key -> piece count, once decided

    def count(self, key: tuple, padded: int, world_size: int) -> int:
        """The piece count for this call of layout `key`."""
        if self.piece_size is not None:
            return piece_count(padded, self.piece_size)
        if key in self.chosen:
            return self.chosen[key]
        pieces = piece_count(padded, PIECE_SIZE)
        if pieces == 1 or world_size == 1:
            self.chosen[key] = 1
            return 1
        trial = self._trial.setdefault(key, {"calls": 0, "times": {1: [], pieces: []}})
        # Call 0 and 1 warm both schedules up (buffers, connections); then they alternate.
        return (pieces, 1)[trial["calls"] % 2]

    def timing(self, key: tuple) -> bool:
        """Whether this call of layout `key` is one the tuner times (after
        `count` for it): `record` wants its time."""
        return key in self._trial and key not in self.chosen

    def record(self, key: tuple, count: int, seconds: Callable[[], float],
               share: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Note a call's time (`seconds()`, asked only on a timed trial: a
        CallTimer's waits for the device); after the trials, agree on the
        faster schedule. share(t) returns every rank's t stacked (an
        all-gather)."""
        trial = self._trial.get(key)
        if trial is None or key in self.chosen:
            return
        trial["calls"] += 1
        if trial["calls"] > 2:
            trial["times"][count].append(seconds())
        if trial["calls"] < TUNING_CALLS:
            return
        counts = sorted(trial["times"])
        mine = torch.tensor([sorted(trial["times"][c])[TRIALS // 2] for c in counts],
                            dtype=torch.float64)
        slowest = share(mine).max(0).values  # a step waits for the slowest rank
        self.chosen[key] = counts[int(slowest.argmin())]
        del self._trial[key]


class PipelineStage(NamedTuple):
    """One stage of a pipelined call: `work(piece)` on the host or device,
    then `start(piece)`, the collective it feeds (None: the last stage),
    which returns a handle whose `wait()` the next stage calls first."""

    work: Callable[[object], None]
    start: Optional[Callable[[object], object]] = None


def run_pipelined(pieces: Sequence[object], stages: Sequence[PipelineStage],
                  on_wire: Callable[..., object]) -> None:
    """Every piece through every stage, overlapped: at tick i, stage s takes
    piece i - s, after waiting for that piece's collective from stage s - 1.
    So while piece i's first collective is on the wire piece i + 1 is
    worked on, and so on down the stages. `on_wire(call, *args)` runs each
    start and wait (the caller times them as communication)."""
    handles: Dict[Tuple[int, int], object] = {}
    for tick in range(len(pieces) + len(stages) - 1):
        for s, stage in enumerate(stages):
            j = tick - s
            if not 0 <= j < len(pieces):
                continue
            if s > 0:
                on_wire(handles.pop((s - 1, j)).wait)
            stage.work(pieces[j])
            if stage.start is not None:
                handles[(s, j)] = on_wire(stage.start, pieces[j])
