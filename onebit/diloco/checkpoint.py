"""DiLoCo's checkpoints: what `state_dict()` saves and `load_state_dict()`
takes back, and the per-rank part saved with the error buffers.

What every rank shares (`state_dict`): the settings that must match on
load, the counters, the anchors, the outer SGD's state and, with overlap,
every fragment's round in flight (its status and averaged pseudo-
gradients, waited for first: they land on the resumed run's schedule).
Every fragment has an entry, in flight or not, so that the structure is
the same at every step: torch.distributed.checkpoint loads into a fresh
state_dict() of the same shape (str keys, tensors only). Sharded params
save as DTensors of their placement.

Per rank (`error_feedback_state`): the error buffers and, with
keep_local_progress, this rank's params at each launch in flight.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

import torch

from ..feedback.channel import ErrorFeedbackChannel
from ..shards import ShardedParams, local, placed_like
from .rounds import Fragment, RoundInFlight

# Must match on load (the default: what checkpoints written before it held).
SETTINGS = {"sync_every": None, "compression": None, "warmup_steps": 0, "fragments": 1,
            "overlap_steps": 0}
# A fragment's entry: nothing in flight, an average to land, a skipped round.
IDLE, AVERAGED, SKIPPED = 0, 1, 2


def state_dict(diloco, fragments: Sequence[Fragment], sharded: bool) -> dict:
    """DiLoCo.state_dict()'s body: `diloco`'s public settings, counters,
    anchors and outer optimizer, and the `fragments`' rounds in flight."""
    return {**{name: getattr(diloco, name) for name in SETTINGS},
            "inner_steps": diloco.inner_steps, "rounds": diloco.rounds,
            "launches": diloco.launches,
            "anchors": [placed_like(a.detach().clone(), p)
                        for a, p in zip(diloco.anchors, diloco.params)],
            "outer_optimizer": _outer_state_dict(diloco.outer_optimizer, diloco.params, sharded),
            "in_flight": _in_flight_state(fragments, diloco.params) if diloco.overlap_steps
            else {}}  # without overlap nothing is in flight between inner steps


def _outer_state_dict(outer_optimizer, params: List[torch.Tensor], sharded: bool) -> dict:
    """The outer SGD's state_dict; sharded, its momentum as DTensors of
    the params' placement (new dicts: torch's share the live ones)."""
    sd = outer_optimizer.state_dict()
    if sharded:
        sd["state"] = {i: {k: placed_like(v, params[i]) if isinstance(v, torch.Tensor) else v
                           for k, v in st.items()} for i, st in sd["state"].items()}
    return sd


def _in_flight_state(fragments: Sequence[Fragment], params: List[torch.Tensor]) -> dict:
    """Every fragment's entry: its status, the averaged pseudo-gradients
    (zeros when there are none) and the params it launched with frozen."""
    out = {}
    for fragment in fragments:
        job = fragment.round
        status = IDLE if job is None else SKIPPED if job.skipped else AVERAGED
        anchors = fragment.members()[1]
        deltas = ([d.clone() for d in job.deltas] if status == AVERAGED
                  else [torch.zeros_like(a) for a in anchors])
        deltas = [placed_like(d, params[i]) for d, i in zip(deltas, fragment.positions)]
        frozen = set(job.frozen or ()) if job is not None else set()
        out[str(fragment.index)] = {  # str keys for DCP
            "status": torch.tensor(status), "deltas": deltas,
            # launched with these frozen (Fragment.frozen_now): the landing keeps them
            "frozen": torch.tensor([j in frozen for j in range(len(anchors))], dtype=torch.bool)}
    return out


def check_loadable(diloco, state: dict) -> None:
    """A ValueError, before anything is loaded, when `state` was saved with
    other settings or other parameter shapes than `diloco` has."""
    for name, default in SETTINGS.items():
        if state.get(name, default) != getattr(diloco, name):
            raise ValueError(f"DiLoCo.load_state_dict: the checkpoint has {name}="
                             f"{state.get(name)!r}, this DiLoCo {getattr(diloco, name)!r}. "
                             "Nothing was loaded")
    shapes = [tuple(local(a).shape) for a in state["anchors"]]
    if shapes != [tuple(a.shape) for a in diloco.anchors]:
        raise ValueError("DiLoCo.load_state_dict: the checkpoint's parameters have other "
                         "shapes. Nothing was loaded")


@torch.no_grad()
def load_shared(state: dict, anchors: List[torch.Tensor], outer_optimizer,
                shards: ShardedParams) -> Tuple[int, int, int]:
    """Copy the saved anchors and outer SGD state in; return the counters
    (inner steps, rounds, launches)."""
    for mine, saved in zip(anchors, state["anchors"]):
        mine.copy_(local(saved))
    outer_optimizer.load_state_dict(state["outer_optimizer"])
    shards.from_dtensors(outer_optimizer.state)
    rounds = int(state["rounds"])
    return int(state["inner_steps"]), rounds, int(state.get("launches", rounds))


def restore_in_flight(state: dict, fragments: Sequence[Fragment],
                      planned_landing: Callable[[int], int]) -> None:
    """Put the saved rounds in flight back on their `fragments` (the others
    have none); `planned_landing(f)`: where fragment f's lands."""
    saved: Dict[int, dict] = {int(f): entry for f, entry in state.get("in_flight", {}).items()}
    for fragment in fragments:
        entry = saved.get(fragment.index)
        fragment.round = None
        if entry is None or int(entry["status"]) == IDLE:
            continue
        anchors = fragment.members()[1]
        frozen = entry.get("frozen")  # (absent from checkpoints written before it)
        fragment.round = RoundInFlight(
            [local(d).to(a.device) for d, a in zip(entry["deltas"], anchors)],
            skipped=int(entry["status"]) == SKIPPED,
            lands_at=planned_landing(fragment.index),
            frozen=None if frozen is None else [j for j, on in enumerate(frozen.tolist()) if on])


def error_feedback_state(channel: ErrorFeedbackChannel, fragments: Sequence[Fragment],
                         device: torch.device, rounds: int, keeps_progress: bool) -> dict:
    """DiLoCo.error_feedback_state_dict()'s body: `channel`'s errors of
    every fragment and, with keep_local_progress, the launch points."""
    state = channel.state_dict(_layouts(channel, fragments), device, {"rounds": rounds})
    if keeps_progress:
        state["launch_points"] = _launch_points_state(fragments)
    return state


def load_error_feedback(channel: ErrorFeedbackChannel, state: dict,
                        fragments: Sequence[Fragment], rounds: int,
                        keeps_progress: bool) -> bool:
    """DiLoCo.load_error_feedback_state_dict()'s body: False when the
    errors restart from zero (another world size, rank, round...)."""
    loaded = channel.load_state_dict(state, _layouts(channel, fragments), {"rounds": rounds})
    points = state.get("launch_points") if loaded else None
    if keeps_progress and points is not None:
        _load_launch_points(points, fragments)
    return loaded


def _layouts(channel: ErrorFeedbackChannel, fragments: Sequence[Fragment]) -> dict:
    return channel.exchange.layouts([f.members()[0] for f in fragments])


def _launch_points_state(fragments: Sequence[Fragment]) -> dict:
    """Every fragment's launch points (zeros when none is in flight: the
    same structure at every step, for DCP), in this rank's error state:
    they differ on every rank."""
    out = {}
    for fragment in fragments:
        points = fragment.round.launch_points if fragment.round is not None else None
        out[str(fragment.index)] = ([x.clone() for x in points] if points is not None
                                    else [torch.zeros_like(a) for a in fragment.members()[1]])
    return out


def _load_launch_points(points: dict, fragments: Sequence[Fragment]) -> None:
    """Give the rounds in flight their saved launch points (without them a
    landing drops this rank's progress since the launch)."""
    for fragment in fragments:
        if fragment.round is not None and str(fragment.index) in points:
            fragment.round.launch_points = [
                local(x).to(a.device).float()
                for x, a in zip(points[str(fragment.index)], fragment.members()[1])]
