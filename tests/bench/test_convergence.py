"""Short version of `python -m benchmarks.convergence`: on real data (the
digits that ship with scikit-learn), 4 gloo ranks, each 1-bit optimizer ends
within the bar of its full-precision baseline after the same steps."""
import pytest

from benchmarks.convergence import compare

pytestmark = pytest.mark.slow  # the fast tier (-m "not slow") leaves these out


@pytest.mark.timeout(600)
def test_onebit_optimizers_match_their_baselines_on_digits():
    rows = compare(steps=600, freeze=0.2, nproc=4)
    report = "\n".join(f"{r['optimizer']}: loss {r['loss']:.4f} vs {r['baseline_loss']:.4f}, "
                       f"acc {r['accuracy']:.2f} vs {r['baseline_accuracy']:.2f}" for r in rows)
    assert [r["optimizer"] for r in rows] == ["OnebitAdam", "OnebitLamb", "ZeroOneAdam"]
    for r in rows:
        assert r["accuracy"] > 90.0, report  # they all actually learned
        assert r["ok"], report
