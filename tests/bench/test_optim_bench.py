"""`python -m onebit.bench optim` measures what it says (small sizes here)."""
import pytest
from tests.distributed import run_workers
from onebit.bench.optim import measure

pytestmark = pytest.mark.slow  # the fast tier (-m "not slow") leaves these out


def test_optim_bench_reports_every_optimizer_against_adam():
    rows = measure(total=20_000, tensors=4, iters=2)
    # torch 2.13 has a fused Adam for the CPU: the baseline is torch's fastest.
    assert rows[0]["optimizer"] == "torch.optim.Adam(fused)" and rows[0]["vs_adam"] == 1.0
    assert [r["optimizer"] for r in rows[1:3]] == ["torch.optim.AdamW(fused)",
                                                   "torch.optim.Adam(foreach)"]
    assert len(rows) == 11 and all(r["ms"] > 0 for r in rows)


def _measure_on_rank(rank, world):
    return measure(total=20_000, tensors=4, iters=2, rank=rank, world=world)


def test_optim_bench_on_3_ranks_reports_the_same_slowest_times_everywhere():
    per_rank = run_workers(_measure_on_rank, 3, timeout=120)
    assert len(per_rank[0]) == 11
    # Every rank reports each step's slowest rank: the same numbers.
    for rows in per_rank[1:]:
        assert [r["ms"] for r in rows] == [r["ms"] for r in per_rank[0]]
