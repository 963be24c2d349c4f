"""`python -m onebit.bench optim` measures what it says (small sizes here)."""
from onebit.bench.optim import measure


def test_optim_bench_reports_every_optimizer_against_adam():
    rows = measure(total=20_000, tensors=4, iters=2)
    assert rows[0]["optimizer"].startswith("torch.optim.Adam") and rows[0]["vs_adam"] == 1.0
    assert len(rows) == 10 and all(r["ms"] > 0 for r in rows)
    assert [r["optimizer"].strip() for r in rows].count("with graph_capture") == 2
