"""Short soak: 4 ranks, every optimizer through both stages, memory flat."""
import pytest

from benchmarks.soak import freeze_step, soak
from onebit.launch import spawn_local

pytestmark = pytest.mark.slow  # the fast tier (-m "not slow") leaves these out


@pytest.mark.timeout(400)
def test_memory_does_not_grow_once_settled():
    steps = 400
    rows = [r for per in spawn_local(soak, 4, steps, timeout=350) for r in per]
    assert len(rows) == 12 and freeze_step(steps) + 50 < steps
    for r in rows:
        assert r["trend_mb"] <= 4.0, r  # a leak of even 10 kB a step would exceed it
