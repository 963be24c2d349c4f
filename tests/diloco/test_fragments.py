"""Streaming DiLoCo's schedule (fragments.py): the quiet step, against a
step-by-step replay of launches and landings written here."""
import pytest

from onebit.diloco.fragments import FragmentPlan


def _busy_steps(sync_every, fragments, delay, rounds=4):
    """Steps of one late round (0..H-1) after which some exchange is in
    flight: fragment f launches after steps f_start, f_start + H, ... with
    f_start = (f + 1) * H // F, and lands `delay` steps after its launch."""
    busy = set()
    late = (rounds - 1) * sync_every  # past the first round's start-up
    for f in range(fragments):
        start = (f + 1) * sync_every // fragments
        for launch in range(start, rounds * sync_every + 1, sync_every):
            for step in range(launch, launch + delay):  # launched, not landed yet
                if late <= step < late + sync_every:
                    busy.add(step - late)
    return busy


@pytest.mark.parametrize("sync_every,fragments,delay", [
    (16, 4, 1), (16, 4, 3), (16, 1, 0), (16, 1, 15), (4, 2, 1), (12, 5, 2), (8, 3, 2),
    (4, 4, 1), (6, 4, 3), (64, 7, 9)])
def test_the_quiet_step_is_the_first_step_with_nothing_in_flight(sync_every, fragments, delay):
    plan = FragmentPlan.split([10] * 8, fragments, sync_every, delay)
    busy = _busy_steps(sync_every, fragments, delay)
    quiet = [s for s in range(sync_every) if s not in busy]
    assert plan.quiet_step() == (quiet[0] if quiet else None)


def test_every_step_busy_has_no_quiet_step():
    # 4 fragments a step apart, each 1 step on the wire: some exchange is always running
    assert FragmentPlan.split([10] * 4, 4, 4, 1).quiet_step() is None
    assert FragmentPlan.split([10] * 4, 4, 4, 0).quiet_step() == 0  # tau = 0: never in flight
