"""Short version of `python -m benchmarks.lm`: a tiny GPT on real text
(4k-word vocabulary, tied embeddings) on 2 gloo ranks. Every optimizer stays
finite at every step and ends near its full-precision baseline."""
import pytest

from benchmarks.lm import compare

pytestmark = pytest.mark.slow  # the fast tier (-m "not slow") leaves these out

SHORT = dict(steps=100, freeze=0.2, nproc=2, seeds=[0], lr=2e-3, lamb_lr_scale=3.0, vocab=4096, dim=32, layers=1,
             heads=2, context=16, batch=8, eval_batch=64, every=50, block_size=256,
             scale_dtype="float32", schedule="cosine", warmup=0.1)


@pytest.mark.timeout(600)
def test_language_model_gaps_and_no_nan():
    rows, runs = compare(SHORT)
    report = "\n".join(f"{r['optimizer']}: held-out {r['loss']:.4f} vs {r['baseline_loss']:.4f} "
                       f"({r['gap_pct']:+.2f}%), finite {r['finite']}" for r in rows)
    print(report)
    assert all(r["finite"] for r in runs), report
    first = {r["optimizer"]: r["curve"][0][1] for r in runs}
    for r in rows:
        assert r["loss"] < first[r["optimizer"]], report  # they all learned
        assert r["gap_pct"] <= 5.0, report  # the short run's bar; the benchmark's is 1-2%


@pytest.mark.timeout(600)
def test_diloco_1bit_learns_like_fp32_diloco_for_a_fraction_of_the_bytes():
    rows, runs = compare(dict(SHORT, only=["DiLoCo-1bit"], sync_every=8, outer_lr=1.3,
                              outer_momentum=0.0, nesterov=False))
    (row,) = rows
    report = (f"DiLoCo-1bit {row['loss']:.4f} vs fp32 {row['baseline_loss']:.4f} "
              f"({row['gap_pct']:+.2f}%), bytes/step {row['bytes_per_step']:.0f} vs "
              f"{row['baseline_bytes_per_step']:.0f}")
    print(report)
    assert all(r["finite"] for r in runs), report
    first = {r["optimizer"]: r["curve"][0][1] for r in runs}
    assert row["loss"] < first["DiLoCo-1bit"], report
    assert row["gap_pct"] <= 5.0, report
    # 1/8 byte of sign + 4/256 of scale per element, each way, against 8 bytes of fp32
    assert row["bytes_per_step"] * 20 < row["baseline_bytes_per_step"], report
